"""The loaded LLaVA model: image encoding, prefill and decode forward passes over explicit state.

Pure model operations: no sessions, no scheduling policy, no HTTP or JSON. ``prefill`` runs one
sequence's uncached tokens (a session's :class:`~.kv.paged.SessionKV`, or any transformers ``Cache``);
``decode_batch`` runs one token for every row of a :class:`~.kv.paged.SlotsCache` in one pass. The engine sees images as feature rows and token counts.

Mechanics (verified, docs/platform.md): an image's features are the model's own
``get_image_features`` output (vision tower, projector and, for NeXT / OneVision, the tile packing
with newline rows), shape ``[image_tokens, text_hidden]``, where ``image_tokens`` depends on the
image size for anyres models; they replace the embeddings of that image's ``<image>`` placeholder
tokens in order, exactly as the models' ``forward`` does with ``masked_scatter``, so a cached prefill
is token-identical to ``model.generate`` from scratch in fp32.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import Cache

from ..errors import ErrorCode, ServiceError
from ..sampling.grammar import Grammars
from .fused import (
    FUSED_ATTENTION,
    LOWER_RIGHT_ATTENTION,
    FusedCache,
    attention_on,
    context_limit,
    prefer_sdpa_backends,
)
from .gpu.staging import upload
from .gpu.vision_graph import image_features
from .kv.cache import cache_len, undo_pass
from .kv.paged import SessionKV
from .packed_linears import pack_linears
from .parallel import cache_keyword, load_replica
from .templating import ChatTemplate
from .video import VIDEO_ARCHITECTURES, EncodedVideo, VideoPreprocessing, preprocess_frames, video_token_count

if TYPE_CHECKING:
    from .gpu.pixels import DevicePixels
    from .gpu.tile_graphs import TileGraphs
    from .gpu.vision_graph import VisionGraph

__all__ = ["LlavaModel"]


class LlavaModel:
    """A loaded LLaVA-family checkpoint and the forward passes the session engine needs.

    Args:
        model: one of ``ARCHITECTURES`` (:mod:`~llava_sessions.model.loading`) in eval mode on ``device``.
        processor: its processor (image processor, tokenizer, chat template).
        video_preprocessing: its video processor's settings (:mod:`.video`; default: the class
            defaults), used by a model with a video path.
        ranks: the other ranks when ``model`` is rank 0's shard of a tensor-parallel replica
            (:class:`~.parallel.RankGroup`), sent each text pass first (over the KV pool's slots only).

    Attributes:
        architecture: the model's class name.
        num_image_tokens: placeholder tokens of one base tile (576 for llava-1.5 at 336 px, which
            is every image's count there; anyres models add tiles: :meth:`image_token_count`).
        max_positions: the context limit, tokens: the text model's ``max_position_embeddings``, or its
            sliding attention window when that is shorter (within it every position attends to all before
            it, as the pool's full attention computes: docs/decisions/74-a-sliding-window-caps-the-context.md).
        kv_bytes_per_token: KV-cache bytes one token costs (2 × layers × kv_heads × head_dim × dtype size;
            a tensor-parallel replica's across its ranks).
        num_kv_heads: the key-value heads this process holds (a rank's share under tensor parallel).
        feature_bytes_per_token: device bytes of one image-feature row (hidden × dtype size).
        template: the chat template and tokenizer (:class:`~llava_sessions.model.templating.ChatTemplate`).
        eos_token_ids: token ids that end an answer.
        grammars: structured outputs' matchers over the tokenizer (:class:`~llava_sessions.sampling.grammar.Grammars`).
        supports_video: the model has a video path served here (:data:`.video.VIDEO_ARCHITECTURES`).
        lower_right_prefill: a prefill over cached positions attends in SDPA's lower-right causal form
            (:func:`~.fused.lower_right_attention`; on CUDA, where that reaches the flash kernel).
    """

    def __init__(
        self, model: Any, processor: Any, video_preprocessing: VideoPreprocessing | None = None, ranks: Any = None
    ) -> None:
        self.model, self.ranks, self.processor = model, ranks, processor
        self.tokenizer = processor.tokenizer
        self.config = model.config
        text = self.config.text_config
        self.device, self.dtype = next(model.parameters()).device, next(model.parameters()).dtype
        #: Linears running over oneDNN-prepacked weights (:mod:`.packed_linears`): a CPU model's own replica.
        self.packed_linears: int = pack_linears(model) if self.device.type == "cpu" and ranks is None else 0
        self.image_token_id: int = int(self.config.image_token_id)
        self.architecture: str = type(model).__name__
        video_id = getattr(self.config, "video_token_id", None)
        self.supports_video: bool = (
            self.architecture in VIDEO_ARCHITECTURES
            and video_id is not None
            and getattr(processor, "video_token", None) is not None
        )
        self.video_preprocessing = video_preprocessing or VideoPreprocessing.from_settings({}, self.architecture)
        #: OneVision ends a video's rows with its ``image_newline`` row; LLaVA-NeXT-Video has none.
        self._video_newline = getattr(self.config, "spatial_pool_stride", None) is None
        #: The checkpoint's chat template and tokenizer (:class:`~llava_sessions.model.templating.ChatTemplate`).
        self.template = ChatTemplate(
            processor, self.image_token_id, int(video_id) if self.supports_video and video_id is not None else None
        )
        self.image_token: str = self.template.image_token
        vision = self.config.vision_config
        num_patches = (vision.image_size // vision.patch_size) ** 2
        strategy = self.config.vision_feature_select_strategy
        has_cls = getattr(vision, "model_type", "") == "clip_vision_model"  # SigLIP has no CLS token
        self.num_image_tokens: int = num_patches + (1 if has_cls and strategy != "default" else 0)
        # OneVision lays out each image of a several-image conversation as one base tile + a newline
        # row (its get_image_features takes batch_num_images; processing_llava_onevision.replace_image_token)
        self._multi_image_base_tile = "batch_num_images" in inspect.signature(model.get_image_features).parameters
        self._cache_kw = cache_keyword(model)
        self.max_positions: int = context_limit(text)
        self.lower_right_prefill: bool = self.device.type == "cuda" and ranks is None
        prefer_sdpa_backends(self.device)  # cuDNN's SDPA plans each new shape (see its docstring)
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        self.kv_bytes_per_token: int = 2 * text.num_hidden_layers * kv_heads * head_dim * self.dtype.itemsize
        self.num_kv_heads, self.head_dim = kv_heads // (ranks.size if ranks is not None else 1), head_dim
        #: Device bytes of one image-feature row (text hidden size x dtype size).
        self.feature_bytes_per_token: int = text.hidden_size * self.dtype.itemsize
        eos = model.generation_config.eos_token_id
        eos = self.tokenizer.eos_token_id if eos is None else eos
        self.eos_token_ids: frozenset[int] = frozenset([eos] if isinstance(eos, int) else eos)
        #: Structured outputs' matchers over this tokenizer (built on first use).
        self.grammars = Grammars(self.tokenizer, sorted(self.eos_token_ids))

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_pretrained(
        cls,
        model_dir: str | Path,
        *,
        device: str = "auto",
        gpu_id: int | None = None,
        dtype: str = "auto",
        tensor_parallel_size: int = 1,
        threads: int = 0,
    ) -> LlavaModel:
        """Load a local llava-hf checkpoint folder (:func:`~llava_sessions.model.loading.load_model`); with
        ``tensor_parallel_size`` > 1 as rank 0, the other ranks started (:func:`~.parallel.load_replica`).

        Raises:
            FileNotFoundError: ``model_dir`` is not a folder with a config.json.
            ValueError: bad device or dtype, an architecture not in ``ARCHITECTURES``, or a
                ``tensor_parallel_size`` the heads or GPUs refuse (:func:`~.parallel.check_tensor_parallel`).
        """
        model, processor, ranks = load_replica(model_dir, device, gpu_id, dtype, tensor_parallel_size, threads)
        return cls(model, processor, VideoPreprocessing.from_folder(model_dir, type(model).__name__), ranks)

    # ------------------------------------------------------------------ images
    def base_layout(self, num_images: int) -> bool:
        """Whether images of a conversation with ``num_images`` images are laid out as one base tile
        each (OneVision's several-image mode) rather than by their own size."""
        return self._multi_image_base_tile and num_images > 1

    def image_token_count(self, image_size: tuple[int, ...], num_images: int = 1) -> int:
        """Placeholder tokens of an image of ``image_size`` (height, width in pixels) in a
        conversation holding ``num_images`` still images: the processor's own count
        (``_get_num_multimodal_tokens``: 576 for llava-1.5, tiles for anyres models), or one base
        tile + a newline row in OneVision's several-image mode. A video's size is ``(frames,
        height, width)``: its count is :func:`.video.video_token_count`.

        Raises:
            ValueError: a video's size on a model without a video path (callers check
                :attr:`supports_video` first).
        """
        if len(image_size) == 3:
            if not self.supports_video:
                raise ValueError(f"{self.architecture} has no video path")
            return video_token_count(self.config, image_size[0], self.video_preprocessing)
        if self.base_layout(num_images):
            return self.num_image_tokens + 1
        counter = getattr(self.processor, "_get_num_multimodal_tokens", None)
        if counter is None:
            return self.num_image_tokens
        return int(counter(image_sizes=[list(image_size)]).num_image_tokens[0])

    @torch.inference_mode()
    def encode_images(
        self,
        images: Sequence[Any],
        num_images: int | None = None,
        *,
        pixels: DevicePixels | None = None,
        tower: VisionGraph | TileGraphs | None = None,
    ) -> list[torch.Tensor]:
        """Preprocess RGB PIL ``images``, run the vision tower, the projector and the model's tile
        packing; a sampled video among them (anything with ``num_frames`` and ``frames``
        ``[T, H, W, 3]`` uint8) takes the model's video path (:meth:`encode_video`).

        Args:
            images: the media to encode, in conversation order.
            num_images: still images in the conversation they belong to (default: those among
                ``images``); decides OneVision's layout (:meth:`image_token_count`).
            pixels: llava-1.5's preprocessing on the device (:mod:`.gpu.pixels`; None: the processor's).
            tower: the vision tower as CUDA graphs (:mod:`.gpu.vision_graph`, :mod:`.gpu.tile_graphs`),
                where a call's pixels match it (None: the model's own ``get_image_features``). The model
                holds neither: the engine's runner owns and passes them.

        Returns:
            One ``[image_tokens_i, text_hidden]`` tensor per medium, model dtype, on the device;
            ``image_tokens_i == image_token_count(size_i, num_images)``.

        Raises:
            ServiceError(image_invalid): the processor cannot handle an image.
            ValueError: a video on a model without a video path.
        """
        items = list(images)
        videos = {i for i, item in enumerate(items) if getattr(item, "num_frames", None) is not None}
        if videos:
            stills = [item for i, item in enumerate(items) if i not in videos]
            total = len(stills) if num_images is None else num_images
            still_feats = iter(self.encode_images(stills, total, pixels=pixels, tower=tower) if stills else [])
            return [self.encode_video(item) if i in videos else next(still_feats) for i, item in enumerate(items)]
        images = items
        total = len(images) if num_images is None else num_images
        base = self.base_layout(total)
        if pixels is not None and not base:  # llava-1.5's steps on the device (:mod:`.gpu.pixels`)
            try:
                on_device = pixels(images)
            except ValueError as exc:
                raise ServiceError(ErrorCode.IMAGE_INVALID, "the image could not be preprocessed") from exc
            return self.encode_pixels(on_device, tower=tower)
        # several-image mode needs a nested batch of >= 2 images; a lone one is preprocessed twice
        batch: Any = [images + images[:1] if len(images) == 1 else images] if base else images
        try:
            out = self.processor.image_processor(images=batch, return_tensors="pt")
        except Exception as exc:  # noqa: BLE001 - any processor failure is the image's fault
            raise ServiceError(ErrorCode.IMAGE_INVALID, "the image could not be preprocessed") from exc
        kwargs: dict[str, Any] = {}
        if "image_sizes" in out:
            kwargs["image_sizes"] = out["image_sizes"][: len(images)]
        if base:
            kwargs["batch_num_images"] = torch.tensor([max(2, len(images))])
        pixel_values = out["pixel_values"][: len(images)]
        return self.encode_pixels(pixel_values, tower=tower, **kwargs)

    @torch.inference_mode()
    def encode_video(self, video: Any) -> torch.Tensor:
        """Preprocess a sampled video's frames (:func:`.video.preprocess_frames`) and run the model's
        own ``get_video_features`` (vision tower per frame, projector, pooling, newline row).

        Args:
            video: ``frames`` ``[T, H, W, 3]`` uint8 RGB (a :class:`~llava_sessions.video.SampledVideo`),
                or an :class:`~.video.EncodedVideo`, whose features are returned as they are.

        Returns:
            ``[video_token_count(T), text_hidden]``, model dtype, on the device.

        Raises:
            ValueError: the model has no video path.
        """
        if isinstance(video, EncodedVideo):
            return video.features
        return self._video_rows(video.frames)

    @torch.inference_mode()
    def encode_video_frames(self, video: Any, start: int, stop: int) -> torch.Tensor:
        """The feature rows of frames ``start:stop`` of ``video`` alone (the model's video path on those
        frames, without the newline row that ends a video): ``[(stop - start) x rows per frame,
        text_hidden]``. A video's features are its frames' rows in order, then :meth:`video_newline`
        (each frame goes through the tower, projector and pooling on its own), when the model has one.

        Raises:
            ValueError: the model has no video path.
        """
        rows = self._video_rows(video.frames[start:stop])
        return rows[:-1] if self._video_newline else rows

    def video_rows_per_frame(self) -> int:
        """Feature rows one video frame takes (196 on OneVision at 384 px, 144 on LLaVA-NeXT-Video at 336)."""
        return video_token_count(self.config, 1, self.video_preprocessing) - int(self._video_newline)

    def video_newline(self) -> torch.Tensor | None:
        """The row that ends a video's features (OneVision's ``image_newline``): ``[1, text_hidden]``;
        None for a model whose videos end without one (LLaVA-NeXT-Video).

        Raises:
            ValueError: the model has no video path.
        """
        if not self.supports_video:
            raise ValueError(f"{self.architecture} has no video path")
        if not self._video_newline:
            return None
        return getattr(self.model, "model", self.model).image_newline.detach().reshape(1, -1)

    def _video_rows(self, frames: Any) -> torch.Tensor:
        """``get_video_features`` of ``frames`` (``[T, H, W, 3]`` uint8): ``[rows, text_hidden]``."""
        if not self.supports_video:
            raise ValueError(f"{self.architecture} has no video path")
        pixels = preprocess_frames(frames, self.video_preprocessing).to(self.device, self.dtype)
        out = self.model.get_video_features(
            pixel_values_videos=pixels,
            vision_feature_layer=self.config.vision_feature_layer,
            vision_feature_select_strategy=self.config.vision_feature_select_strategy,
        )
        feats = out.pooler_output if hasattr(out, "pooler_output") else out
        return feats.reshape(-1, feats.shape[-1]).contiguous()

    @torch.inference_mode()
    def encode_pixels(
        self, pixel_values: torch.Tensor, tower: VisionGraph | TileGraphs | None = None, **kwargs: Any
    ) -> list[torch.Tensor]:
        """Run ``get_image_features`` on preprocessed ``pixel_values`` (``[N, 3, H, W]``, or
        ``[N, tiles, 3, H, W]`` for anyres models, with their ``image_sizes`` in ``kwargs``), through
        ``tower`` where they match it (:meth:`encode_images`); returns one ``[image_tokens_i,
        text_hidden]`` tensor per image."""
        pixel_values = pixel_values.to(self.device, self.dtype)
        if tower is not None and tower.matches(pixel_values, kwargs):
            return tower.run(pixel_values, **kwargs)  # on a GPU: the tower replayed per image
        return image_features(self.model, pixel_values, **kwargs)

    # ------------------------------------------------------------------ forward passes
    def new_cache(self) -> Any:
        """An empty ``DynamicCache`` for a one-off pass outside the engine (the compile warm-up, a
        reference in tests); a session's cache is in the engine's pool."""
        from transformers import DynamicCache

        return DynamicCache(config=self.config.text_config)

    def embed(self, ids: list[int], first_row: int, image_features: torch.Tensor | None) -> torch.Tensor:
        """Embeddings ``[1, len(ids), hidden]``; the k-th image placeholder in ``ids`` takes row
        ``first_row + k`` of ``image_features`` (every image's rows, in conversation order). One past
        the last row is a token the model sampled (a preempted answer's recomputed KV): text, as decoded."""
        host = torch.tensor([ids], dtype=torch.long)  # the placeholders found on the host: no wait for the GPU
        embeds = self._embed_ids(upload(host, self.device), host)
        left = 0 if image_features is None else max(0, int(image_features.shape[0]) - first_row)
        places = [i for i, t in enumerate(ids) if t == self.image_token_id][:left]
        if image_features is not None and places:
            rows = image_features[first_row : first_row + len(places)].to(embeds.dtype)
            embeds[0].index_copy_(0, upload(torch.tensor(places, dtype=torch.long), self.device), rows)
        return embeds

    @torch.inference_mode()
    def prefill(self, cache: Any, ids: list[int], image_features: torch.Tensor | None) -> torch.Tensor:
        """Run the positions of ``ids`` beyond the cache in one forward pass, extending ``cache``.

        Args:
            cache: a session's :class:`~.kv.paged.SessionKV` (or a ``DynamicCache``) holding exactly
                ``ids[:cache_len]`` (mutated: grows to ``len(ids)``).
            ids: the FULL token ids of the sequence; ``len(ids) > cache_len(cache)``.
            image_features: ``[image tokens of every image, hidden]`` (the images' rows in conversation
                order); needed only if uncached ids hold image placeholders.

        Returns:
            Logits ``[vocab]`` (float32) of the last position.
        """
        start = cache_len(cache)
        if start >= len(ids):
            raise ValueError(f"nothing to prefill: cache holds {start} of {len(ids)} tokens")
        first_row = ids[:start].count(self.image_token_id)
        embeds = self.embed(ids[start:], first_row, image_features)
        return self._forward(cache, embeds, start)

    @torch.inference_mode()
    def decode(self, cache: Any, token_id: int) -> torch.Tensor:
        """Feed one token at position ``cache_len(cache)`` (``cache`` grows by one); logits ``[vocab]`` float32."""
        start = cache_len(cache)
        embeds = self._embed_ids(torch.tensor([[token_id]], device=self.device))
        return self._forward(cache, embeds, start)

    # ------------------------------------------------------------------ batched decode
    @torch.inference_mode()
    def decode_batch(
        self,
        batch: Cache,
        token_ids: Sequence[int] | torch.Tensor,
        positions: Sequence[int] | torch.Tensor,
        attention_mask: Any,
    ) -> torch.Tensor:
        """One decode step for every row of ``batch`` in one forward pass.

        Args:
            batch: the rows' KV, a :class:`~.kv.paged.SlotsCache` (each row's new key and value written
                at its table's last position).
            token_ids, positions: ``B`` input tokens (any id for a masked row) and position ids
                (each row's own); lists, or long tensors ``[B, 1]`` on the device (a graph's buffers).
            attention_mask: ``[B, L]`` long (:attr:`~.kv.paged.SlotsCache.attention_mask`: 1 where a row
                may attend over its gathered positions, the new one included, 0 for its pads); or a ready
                4D ``[B, 1, 1, L]`` bool mask or FlexAttention ``BlockMask`` (passed on as it is).

        Returns:
            Logits ``[B, vocab]`` float32.

        Raises:
            Exception: the forward pass failed; the caller takes back what it wrote
                (the rows' tables truncated).
        """
        ids = torch.as_tensor(token_ids, device=self.device).reshape(-1, 1)
        out = self.text_pass(
            batch,
            inputs_embeds=self._embed_ids(ids),
            attention_mask=attention_mask,
            position_ids=torch.as_tensor(positions, device=self.device).reshape(-1, 1),
            logits_to_keep=1,
        )
        return out.logits[:, -1].float()

    @torch.inference_mode()
    def fused_step(
        self,
        batch: Cache,
        token_ids: list[int],
        positions: list[int],
        attention_mask: Any,
        cache: Any,
        ids: list[int],
        image_features: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step for every row of ``batch`` and the prefill of ``ids`` beyond ``cache``, in
        one forward pass (:mod:`.fused`; Sarathi-Serve's fused step).

        Args:
            batch, token_ids, positions, attention_mask: as :meth:`decode_batch`.
            cache, ids, image_features: as :meth:`prefill` (``cache`` is not a row of ``batch``).

        Returns:
            ``(logits [B, vocab], logits [vocab])`` float32: the decode rows', as :meth:`decode_batch`
            gives them (the same values, measured in fp32 on CPU), and the chunk's last position's, as
            :meth:`prefill` gives them (within float rounding: the chunk's matrix products have another
            shape; 1e-6 measured).

        Raises:
            Exception: the forward pass failed; ``cache`` is as before the call, and the caller takes
                back what the rows wrote (as after :meth:`decode_batch`).
        """
        start = cache_len(cache)
        if start >= len(ids):
            raise ValueError(f"nothing to prefill: cache holds {start} of {len(ids)} tokens")
        rows = len(token_ids)
        chunk = self.embed(ids[start:], ids[:start].count(self.image_token_id), image_features)
        embeds = torch.cat([self._embed_ids(torch.tensor([token_ids], device=self.device)), chunk], 1)
        n = chunk.shape[1]
        position_ids = torch.tensor([list(positions) + list(range(start, start + n))], device=self.device)
        keep = torch.tensor([*range(rows), rows + n - 1], device=self.device)
        fused = FusedCache(batch, attention_mask.bool(), cache, start, rows, lower_right=self.lower_right_prefill)
        try:
            with attention_on(self.config.text_config, FUSED_ATTENTION):
                out = self.model(
                    inputs_embeds=embeds,
                    position_ids=position_ids,
                    use_cache=True,
                    **{self._cache_kw: fused},
                    logits_to_keep=keep,
                )
        except BaseException:
            fused.undo()  # the chunk's positions; the rows' are the caller's (as decode_batch's)
            raise
        logits = out.logits[0].float()
        return logits[:rows], logits[rows]

    def _forward(self, cache: Any, embeds: torch.Tensor, start: int) -> torch.Tensor:
        n = embeds.shape[1]
        position_ids = torch.arange(start, start + n, device=self.device).unsqueeze(0)
        attention_mask = torch.ones(1, start + n, dtype=torch.long, device=self.device)
        if self.lower_right_prefill and start > 0 and n > 1:
            with attention_on(self.config.text_config, LOWER_RIGHT_ATTENTION):
                return self._logits(cache, embeds, start, position_ids, attention_mask)
        return self._logits(cache, embeds, start, position_ids, attention_mask)

    def _logits(
        self, cache: Any, embeds: torch.Tensor, start: int, position_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> torch.Tensor:
        if self.ranks is not None and isinstance(cache, SessionKV):
            cache = cache.pass_cache(embeds.shape[1])  # its slots known before the other ranks are told
        try:
            out = self.text_pass(
                cache, inputs_embeds=embeds, attention_mask=attention_mask, position_ids=position_ids, logits_to_keep=1
            )
        except BaseException:
            undo_pass(cache, start)  # as before the pass: a retry (after an out-of-memory error) runs it again
            raise
        return out.logits[0, -1].float()

    def _embed_ids(self, ids: torch.Tensor, host: torch.Tensor | None = None) -> torch.Tensor:
        """``[*ids.shape, hidden]``; sharded by vocabulary under tensor parallel: every rank looks ``ids`` up."""
        if self.ranks is None:
            return self.model.get_input_embeddings()(ids)
        with self.ranks.sharded("a sharded token lookup"):
            self.ranks.send(("embed", host if host is not None else ids.cpu()))
            return self.model.get_input_embeddings()(ids)

    def text_pass(self, cache: Any, **inputs: Any) -> Any:
        """The model's pass over ``cache``; under tensor parallel sent to the other ranks first, a
        failure after that ending the replica (:mod:`.parallel`: its ranks are out of step)."""
        if self.ranks is None:
            return self.model(use_cache=True, **{self._cache_kw: cache}, **inputs)
        self.ranks.check(cache)
        with self.ranks.sharded("a sharded pass"):
            self.ranks.forward(cache, inputs)
            return self.model(use_cache=True, **{self._cache_kw: cache}, **inputs)
