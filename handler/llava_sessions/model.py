"""LLaVA model runner: loading, image encoding, chat templating, prefill and decode steps.

Pure model operations over explicit state; no sessions, HTTP or JSON. One forward pass per call,
batch size 1. The KV cache is a transformers ``DynamicCache`` whose layers hold
``keys``/``values`` of shape ``[1, num_kv_heads, cached_len, head_dim]`` in the model dtype.

Architectures (:data:`ARCHITECTURES`, chosen by ``config.json``'s ``architectures``): llava-1.5
(``LlavaForConditionalGeneration``), LLaVA-NeXT (``LlavaNextForConditionalGeneration``, "anyres"
tiling) and LLaVA-OneVision (``LlavaOnevisionForConditionalGeneration``, anyres_max_9; Qwen2). All
architecture knowledge lives here: the engine sees images as feature rows and token counts.

Mechanics (verified, shared/notes/llava-transformers.md): an image's features are the model's own
``get_image_features`` output (vision tower, projector and, for NeXT / OneVision, the tile packing
with newline rows), shape ``[image_tokens, text_hidden]``, where ``image_tokens`` depends on the
image size for anyres models; they replace the embeddings of that image's ``<image>`` placeholder
tokens in order, exactly as the models' ``forward`` does with ``masked_scatter``, so a cached prefill
is token-identical to ``model.generate`` from scratch in fp32.
"""

from __future__ import annotations

import inspect
import json
import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers.cache_utils import Cache, StaticLayer

from .errors import ErrorCode, ServiceError

log = logging.getLogger(__name__)

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}

#: Prefixes of image-only conversations remembered by :meth:`LlavaRunner.prefix_ids` (least recently used go).
PREFIX_MEMO_SIZE = 64

#: The checkpoint architectures served (``config.json`` ``architectures[0]``, transformers class names).
ARCHITECTURES: tuple[str, ...] = (
    "LlavaForConditionalGeneration",
    "LlavaNextForConditionalGeneration",
    "LlavaOnevisionForConditionalGeneration",
)


def checkpoint_architecture(model_dir: str | Path) -> str:
    """The architecture named by ``model_dir/config.json`` (one of :data:`ARCHITECTURES`).

    Raises:
        FileNotFoundError: no config.json.
        ValueError: an architecture this server does not serve.
    """
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path.parent} is not a checkpoint folder (no config.json)")
    names = json.loads(path.read_text()).get("architectures") or []
    for name in names:
        if name in ARCHITECTURES:
            return str(name)
    raise ValueError(f"{path.parent}: architecture {names or '(none)'} is not one of {', '.join(ARCHITECTURES)}")


def image_only_processor_class(processor_class: type) -> Any:
    """``processor_class`` without its video processor: LLaVA-OneVision's processor requires one, and
    transformers' video processors need torchvision, which a server of images does not need."""

    def get_attributes(cls: type) -> list[str]:
        return [a for a in processor_class.get_attributes() if a != "video_processor"]  # type: ignore[attr-defined]

    return type(processor_class.__name__, (processor_class,), {"get_attributes": classmethod(get_attributes)})


def load_processor(model_dir: str | Path) -> Any:
    """The checkpoint's own processor (``AutoProcessor``); a processor whose video processor cannot
    load here (no torchvision) is loaded without it (:func:`image_only_processor_class`).

    Raises:
        OSError / ValueError: the folder has no loadable processor.
    """
    import transformers
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(model_dir)
    except (OSError, ValueError, ImportError, AttributeError):
        config = Path(model_dir) / "processor_config.json"
        name = json.loads(config.read_text()).get("processor_class", "") if config.is_file() else ""
        cls = getattr(transformers, name, None)
        if cls is None or "video_processor" not in cls.get_attributes():
            raise
        log.info("loading the processor without its video processor", extra={"processor": name})
        return image_only_processor_class(cls).from_pretrained(model_dir)


def resolve_device(device: str = "auto", gpu_id: int | None = None) -> torch.device:
    """Return ``cuda:<gpu_id>`` when CUDA is available (or asked for), else ``cpu``.

    Raises:
        ValueError: ``device="cuda"`` without CUDA, or an unknown device string.
    """
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda, not {device!r}")
    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("device=cuda but CUDA is not available")
    return torch.device("cuda", gpu_id or 0)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """Return the torch dtype: ``auto`` is float16 on GPU and float32 on CPU.

    Raises:
        ValueError: an unknown dtype name.
    """
    if dtype == "auto":
        return torch.float16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be auto, float16, bfloat16 or float32, not {dtype!r}")
    return _DTYPES[dtype]


def cache_len(cache: Any) -> int:
    """Number of token positions held by ``cache`` (0 for ``None``)."""
    return 0 if cache is None else int(cache.get_seq_length())


def crop_cache(cache: Any, length: int) -> None:
    """Keep the first ``length`` positions of ``cache`` in place, and compact its storage.

    ``DynamicCache.crop`` slices a view, which keeps the whole old storage alive; the
    clone makes the bytes the ledger accounts (tokens x ``kv_bytes_per_token``) the real ones.
    """
    remove = cache_len(cache) - length
    if remove < 0:
        raise ValueError(f"cannot crop a cache of {cache_len(cache)} tokens to {length}")
    if remove == 0:
        return
    cache.crop(-remove)
    for layer in cache.layers:
        if isinstance(getattr(layer, "keys", None), torch.Tensor):
            layer.keys = layer.keys.clone()
            layer.values = layer.values.clone()


def common_prefix_len(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token-id lists."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class BatchKVLayer(StaticLayer):
    """One decoder layer's keys and values for a batch of decode rows, preallocated and written in place.

    ``keys`` / ``values``: ``[B, kv_heads, capacity, head_dim]`` in the model dtype. Every row writes
    its next position at the same column (``length``, shared); rows are left-padded (a row's valid
    columns are marked in the attention mask the caller passes), so a decode step writes one column
    and copies nothing else. :meth:`update` returns views of the first ``length`` columns, so
    attention runs over what is written, not the whole capacity.
    """

    keys: torch.Tensor
    values: torch.Tensor
    cumulative_length: torch.Tensor
    length: int = 0

    def allocate(self, num_rows: int, num_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        """Allocate zeroed ``[num_rows, num_heads, max_cache_len, head_dim]`` keys and values; length 0."""
        shape = (num_rows, num_heads, self.max_cache_len, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.dtype, self.device = dtype, device
        self.batch_size, self.num_heads, self.k_head_dim, self.v_head_dim = num_rows, num_heads, head_dim, head_dim
        self.cumulative_length = torch.tensor(0, dtype=torch.long)
        self.length = 0
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``key_states`` / ``value_states`` ``[B, kv_heads, n, head_dim]`` at columns
        ``length .. length + n`` (in place); return views of columns ``0 .. length + n``.

        Raises:
            IndexError: the capacity is exhausted (the engine rebuilds the batch before that).
        """
        n = key_states.shape[-2]
        start = self.length
        if start + n > self.max_cache_len:
            raise IndexError(f"batch KV capacity {self.max_cache_len} exhausted")
        self.keys[:, :, start : start + n] = key_states
        self.values[:, :, start : start + n] = value_states
        self.length = start + n
        self.cumulative_length.fill_(self.length)
        return self.keys[:, :, : self.length], self.values[:, :, : self.length]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """The attention mask covers the written columns plus the ``query_length`` new ones."""
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        """Columns written (pads included)."""
        return self.length


class BatchKVCache(Cache):
    """The KV cache of a decode batch: one :class:`BatchKVLayer` per decoder layer (transformers'
    ``Cache`` interface, so the model's own attention reads and writes it)."""

    def __init__(self, num_layers: int, capacity: int) -> None:
        layers = [BatchKVLayer(capacity) for _ in range(num_layers)]
        super().__init__(layers=list(layers))
        #: The same layers, typed (``Cache.layers`` is typed for every layer kind).
        self.batch_layers: list[BatchKVLayer] = layers
        self.capacity = capacity

    @property
    def length(self) -> int:
        """Columns written so far (shared by every row)."""
        return self.batch_layers[0].length if self.batch_layers else 0

    def set_length(self, length: int) -> None:
        """Move every layer's write column to ``length`` (after loading rows, or undoing a failed step)."""
        for layer in self.batch_layers:
            layer.length = length
            layer.cumulative_length.fill_(length)

    def nbytes(self) -> int:
        """Device bytes of the preallocated keys and values."""
        return sum(layer.keys.nbytes + layer.values.nbytes for layer in self.batch_layers)


@dataclass(frozen=True)
class Turn:
    """One remembered exchange: the user's ``prompt`` and the assistant's ``answer`` text;
    ``images``: how many of the session's images open that user message (before its text)."""

    prompt: str
    answer: str
    images: int = 0


@dataclass(frozen=True)
class Chat:
    """A conversation apart from its next question: what the chat template renders.

    Attributes:
        system_prompt: optional system message.
        turns: remembered exchanges, oldest first (each carries the images opening its message).
        pending_images: images not yet asked about: they open the next user message.
        image_tokens: placeholder tokens of every image, in conversation order
            (``len == sum(t.images for t in turns) + pending_images``).
    """

    system_prompt: str | None
    turns: tuple[Turn, ...] = ()
    pending_images: int = 1
    image_tokens: tuple[int, ...] = field(default=())

    def without_oldest(self, n: int) -> Chat:
        """The chat with its ``n`` oldest turns dropped; their images move to the first turn kept
        (or to the next question when none is), so no image ever leaves the context."""
        if n <= 0:
            return self
        moved = sum(t.images for t in self.turns[:n])
        kept = list(self.turns[n:])
        pending = self.pending_images
        if kept:
            first = kept[0]
            kept[0] = Turn(first.prompt, first.answer, first.images + moved)
        else:
            pending += moved
        return Chat(self.system_prompt, tuple(kept), pending, self.image_tokens)


class LlavaRunner:
    """A loaded LLaVA-family checkpoint and the forward passes the session engine needs.

    Args:
        model: one of :data:`ARCHITECTURES` in eval mode on ``device``.
        processor: its processor (image processor, tokenizer, chat template).

    Attributes:
        architecture: the model's class name.
        num_image_tokens: placeholder tokens of one base tile (576 for llava-1.5 at 336 px, which
            is every image's count there; anyres models add tiles: :meth:`image_token_count`).
        max_positions: the text model's ``max_position_embeddings`` (context limit, tokens).
        kv_bytes_per_token: KV-cache bytes one token costs (2 × layers × kv_heads × head_dim × dtype size).
        eos_token_ids: token ids that end an answer.
    """

    def __init__(self, model: Any, processor: Any) -> None:
        self.model = model
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.config = model.config
        text = self.config.text_config
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.image_token_id: int = int(self.config.image_token_id)
        self.image_token: str = getattr(processor, "image_token", "<image>")
        self.architecture: str = type(model).__name__
        vision = self.config.vision_config
        num_patches = (vision.image_size // vision.patch_size) ** 2
        strategy = self.config.vision_feature_select_strategy
        has_cls = getattr(vision, "model_type", "") == "clip_vision_model"  # SigLIP has no CLS token
        self.num_image_tokens: int = num_patches + (1 if has_cls and strategy != "default" else 0)
        # OneVision lays out each image of a several-image conversation as one base tile + a newline
        # row (its get_image_features takes batch_num_images; processing_llava_onevision.replace_image_token)
        self._multi_image_base_tile = "batch_num_images" in inspect.signature(model.get_image_features).parameters
        self.max_positions: int = int(text.max_position_embeddings)
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        self.kv_bytes_per_token: int = 2 * text.num_hidden_layers * kv_heads * head_dim * self.dtype.itemsize
        self.num_kv_heads: int = kv_heads
        self.head_dim: int = head_dim
        eos = model.generation_config.eos_token_id
        if eos is None:
            eos = self.tokenizer.eos_token_id
        self.eos_token_ids: frozenset[int] = frozenset([eos] if isinstance(eos, int) else eos)
        self._prefix_cache: OrderedDict[tuple[Any, ...], list[int]] = OrderedDict()

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_pretrained(
        cls, model_dir: str | Path, *, device: str = "auto", gpu_id: int | None = None, dtype: str = "auto"
    ) -> LlavaRunner:
        """Load model, processor and chat template from a local llava-hf checkpoint folder.

        Args:
            model_dir: folder with config.json, weights, tokenizer and processor files.
            device: ``auto`` (``cuda:<gpu_id>`` when available, else CPU), ``cpu`` or ``cuda``.
            gpu_id: CUDA device index (TorchServe passes one per worker).
            dtype: ``auto`` (float16 on GPU, float32 on CPU), ``float16``, ``bfloat16`` or ``float32``.

        Raises:
            FileNotFoundError: ``model_dir`` is not a folder with a config.json.
            ValueError: bad device or dtype, or an architecture not in :data:`ARCHITECTURES`.
        """
        import transformers
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        path = Path(model_dir)
        architecture = checkpoint_architecture(path)
        dev = resolve_device(device, gpu_id)
        torch_dtype = resolve_dtype(dtype, dev)
        loaded: Any = getattr(transformers, architecture).from_pretrained(path, dtype=torch_dtype)
        model = loaded.to(dev)
        processor = load_processor(path)
        log.info(
            "loaded checkpoint",
            extra={"model_dir": str(path), "architecture": architecture, "device": str(dev), "dtype": str(torch_dtype)},
        )
        return cls(model.eval(), processor)

    # ------------------------------------------------------------------ images
    def _base_layout(self, num_images: int) -> bool:
        """Whether images of a conversation with ``num_images`` images are laid out as one base tile
        each (OneVision's several-image mode) rather than by their own size."""
        return self._multi_image_base_tile and num_images > 1

    def image_token_count(self, image_size: tuple[int, int], num_images: int = 1) -> int:
        """Placeholder tokens of an image of ``image_size`` (height, width in pixels) in a
        conversation holding ``num_images`` images: the processor's own count
        (``_get_num_multimodal_tokens``: 576 for llava-1.5, tiles for anyres models), or one base
        tile + a newline row in OneVision's several-image mode.
        """
        if self._base_layout(num_images):
            return self.num_image_tokens + 1
        counter = getattr(self.processor, "_get_num_multimodal_tokens", None)
        if counter is None:
            return self.num_image_tokens
        return int(counter(image_sizes=[list(image_size)]).num_image_tokens[0])

    @torch.inference_mode()
    def encode_images(self, images: Sequence[Any], num_images: int | None = None) -> list[torch.Tensor]:
        """Preprocess RGB PIL ``images``, run the vision tower, the projector and the model's tile packing.

        Args:
            images: the images to encode, in conversation order.
            num_images: images in the conversation they belong to (default ``len(images)``); decides
                OneVision's layout (:meth:`image_token_count`).

        Returns:
            One ``[image_tokens_i, text_hidden]`` tensor per image, model dtype, on the device;
            ``image_tokens_i == image_token_count(size_i, num_images)``.

        Raises:
            ServiceError(image_invalid): the processor cannot handle an image.
        """
        images = list(images)
        total = len(images) if num_images is None else num_images
        base = self._base_layout(total)
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
        return self.encode_pixels(pixel_values, **kwargs)

    @torch.inference_mode()
    def encode_pixels(self, pixel_values: torch.Tensor, **kwargs: Any) -> list[torch.Tensor]:
        """Run ``get_image_features`` on preprocessed ``pixel_values`` (``[N, 3, H, W]``, or
        ``[N, tiles, 3, H, W]`` for anyres models, with their ``image_sizes`` in ``kwargs``); returns
        one ``[image_tokens_i, text_hidden]`` tensor per image."""
        pixel_values = pixel_values.to(self.device, self.dtype)
        out = self.model.get_image_features(
            pixel_values=pixel_values,
            vision_feature_layer=self.config.vision_feature_layer,
            vision_feature_select_strategy=self.config.vision_feature_select_strategy,
            **kwargs,
        )
        feats = out.pooler_output if hasattr(out, "pooler_output") else out
        per_image = list(feats) if isinstance(feats, (list, tuple)) else list(feats.unbind(0))
        return [f.reshape(-1, f.shape[-1]).contiguous() for f in per_image]

    # ------------------------------------------------------------------ text
    def conversation(self, chat: Chat, prompt: str | None) -> list[dict]:
        """Build chat messages: optional system, each user message opened by its images, remembered
        answers as assistant messages, then ``prompt`` as the last user message (opened by the
        pending images)."""
        messages: list[dict] = []
        if chat.system_prompt:
            messages.append({"role": "system", "content": [{"type": "text", "text": chat.system_prompt}]})
        for turn in chat.turns:
            content = [{"type": "image"}] * turn.images + [{"type": "text", "text": turn.prompt}]
            messages.append({"role": "user", "content": content})
            messages.append({"role": "assistant", "content": [{"type": "text", "text": turn.answer}]})
        if prompt is not None:
            content = [{"type": "image"}] * chat.pending_images + [{"type": "text", "text": prompt}]
            messages.append({"role": "user", "content": content})
        return messages

    def conversation_text(self, chat: Chat, prompt: str) -> str:
        """Chat-template the full conversation with the generation prompt (``<image>`` not expanded)."""
        messages = self.conversation(chat, prompt)
        return self.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def tokenize(self, text: str, image_tokens: Sequence[int]) -> list[int]:
        """Tokenize templated text, expanding the i-th ``<image>`` to ``image_tokens[i]`` placeholders
        (what the processors do), with the tokenizer's special tokens (BOS).

        Raises:
            ValueError: the text holds a different number of ``<image>`` than ``image_tokens``.
        """
        parts = text.split(self.image_token)
        if len(parts) - 1 != len(image_tokens):
            raise ValueError(f"{len(parts) - 1} image placeholders in the text for {len(image_tokens)} images")
        # The placeholder is an added token, split off before the text around it is tokenized, so
        # one copy per image tokenizes its neighbours exactly as n copies do: expand the ids, not
        # the text (a 576-token image then costs the tokenizer one token, not 576).
        ids = self.tokenizer(text, add_special_tokens=True)["input_ids"]
        if ids.count(self.image_token_id) == len(image_tokens):
            out: list[int] = []
            counts = iter(image_tokens)
            for token in ids:
                if token == self.image_token_id:
                    out.extend([token] * next(counts))
                else:
                    out.append(token)
            return out
        # a tokenizer that does not keep the placeholder whole: expand the text, as the processors do
        expanded = parts[0] + "".join(
            self.image_token * n + part for n, part in zip(image_tokens, parts[1:], strict=True)
        )
        return list(self.tokenizer(expanded, add_special_tokens=True)["input_ids"])

    def conversation_ids(self, chat: Chat, prompt: str) -> list[int]:
        """Token ids of the full chat-templated conversation ending in the generation prompt."""
        return self.tokenize(self.conversation_text(chat, prompt), chat.image_tokens)

    def prefix_ids(self, chat: Chat) -> list[int]:
        """Token ids every next question shares: system prompt, images and turns, whatever the question.

        Found as the common prefix of two conversations that differ only in their last question,
        so it holds for any chat template. Without turns the result is memoised (the last
        :data:`PREFIX_MEMO_SIZE` system prompt / image layouts).
        """

        def compute() -> list[int]:
            a = self.conversation_ids(chat, "A")
            b = self.conversation_ids(chat, "Z")
            return a[: common_prefix_len(a, b)]

        if chat.turns:
            return compute()
        key = (chat.system_prompt, chat.pending_images, chat.image_tokens)
        if key in self._prefix_cache:
            self._prefix_cache.move_to_end(key)
        else:
            self._prefix_cache[key] = compute()
            while len(self._prefix_cache) > PREFIX_MEMO_SIZE:  # anyres image sizes make many keys
                self._prefix_cache.popitem(last=False)
        return list(self._prefix_cache[key])

    def count_text_tokens(self, text: str) -> int:
        """Number of tokens of ``text`` alone (no special tokens)."""
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    # ------------------------------------------------------------------ forward passes
    def new_cache(self) -> Any:
        """Return an empty ``DynamicCache`` for this model."""
        from transformers import DynamicCache

        return DynamicCache(config=self.config.text_config)

    def _embed(self, ids: list[int], first_row: int, image_features: torch.Tensor | None) -> torch.Tensor:
        """Embeddings ``[1, len(ids), hidden]``; the k-th image placeholder in ``ids`` takes row
        ``first_row + k`` of ``image_features`` (every image's rows, in conversation order)."""
        ids_t = torch.tensor([ids], device=self.device)
        embeds = self.model.get_input_embeddings()(ids_t)
        mask = ids_t[0] == self.image_token_id
        count = int(mask.sum())
        if count:
            if image_features is None or first_row + count > image_features.shape[0]:
                raise RuntimeError("image placeholders to prefill but not as many image feature rows")
            embeds[0, mask] = image_features[first_row : first_row + count].to(embeds.dtype)
        return embeds

    @torch.inference_mode()
    def prefill(self, cache: Any, ids: list[int], image_features: torch.Tensor | None) -> torch.Tensor:
        """Run the positions of ``ids`` beyond the cache in one forward pass, extending ``cache``.

        Args:
            cache: a ``DynamicCache`` holding exactly ``ids[:cache_len]`` (mutated: grows to ``len(ids)``).
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
        embeds = self._embed(ids[start:], first_row, image_features)
        return self._forward(cache, embeds, start)

    @torch.inference_mode()
    def decode(self, cache: Any, token_id: int) -> torch.Tensor:
        """Feed one token at position ``cache_len(cache)``; returns logits ``[vocab]`` (float32).

        ``cache`` is mutated (grows by one position).
        """
        start = cache_len(cache)
        embeds = self.model.get_input_embeddings()(torch.tensor([[token_id]], device=self.device))
        return self._forward(cache, embeds, start)

    # ------------------------------------------------------------------ batched decode
    def new_batch_cache(self, num_rows: int, capacity: int) -> BatchKVCache:
        """Allocate a :class:`BatchKVCache` of ``num_rows`` rows × ``capacity`` columns, zeroed.

        Bytes: ``num_rows × capacity × kv_bytes_per_token``.
        """
        text = self.config.text_config
        cache = BatchKVCache(text.num_hidden_layers, capacity)
        for layer in cache.batch_layers:
            layer.allocate(num_rows, self.num_kv_heads, self.head_dim, self.dtype, self.device)
        return cache

    @staticmethod
    def load_row(batch: BatchKVCache, row: int, cache: Any, end: int) -> None:
        """Copy a session's ``DynamicCache`` (``[1, kv_heads, L, head_dim]`` per layer) into ``row`` of
        ``batch`` at columns ``end - L .. end`` (right-aligned: its next token goes to column ``end``)."""
        n = cache_len(cache)
        for dst, src in zip(batch.batch_layers, cache.layers, strict=True):
            dst.keys[row, :, end - n : end] = src.keys[0]
            dst.values[row, :, end - n : end] = src.values[0]

    def extract_row(self, batch: BatchKVCache, row: int, columns: torch.Tensor) -> Any:
        """Gather ``row``'s ``columns`` (a ``[n]`` long tensor of column indexes, in order) into a new
        ``DynamicCache`` of ``n`` positions (``[1, kv_heads, n, head_dim]`` per layer)."""
        cache = self.new_cache()
        for i, layer in enumerate(batch.batch_layers):
            keys = layer.keys[row].index_select(1, columns).unsqueeze(0)
            values = layer.values[row].index_select(1, columns).unsqueeze(0)
            cache.update(keys, values, i)
        return cache

    @torch.inference_mode()
    def decode_batch(
        self, batch: BatchKVCache, token_ids: list[int], positions: list[int], attention_mask: torch.Tensor
    ) -> torch.Tensor:
        """One decode step for every row of ``batch`` in one forward pass.

        Args:
            batch: the rows' KV; each row's new key/value is written at column ``batch.length``
                (mutated: ``length`` grows by one).
            token_ids: ``B`` input tokens, one per row (any id for a row that is masked out).
            positions: ``B`` position ids (each row's own sequence position: rows have
                different lengths and may have skipped steps).
            attention_mask: ``[B, batch.length + 1]`` long, 1 where a row may attend (its own
                valid columns, including the new one), 0 for pads, holes and masked rows.

        Returns:
            Logits ``[B, vocab]`` float32.
        """
        ids = torch.tensor(token_ids, device=self.device).unsqueeze(1)
        embeds = self.model.get_input_embeddings()(ids)
        out = self.model(
            inputs_embeds=embeds,
            attention_mask=attention_mask,
            position_ids=torch.tensor(positions, device=self.device).unsqueeze(1),
            past_key_values=batch,
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1].float()

    def _forward(self, cache: Any, embeds: torch.Tensor, start: int) -> torch.Tensor:
        n = embeds.shape[1]
        position_ids = torch.arange(start, start + n, device=self.device).unsqueeze(0)
        attention_mask = torch.ones(1, start + n, dtype=torch.long, device=self.device)
        out = self.model(
            inputs_embeds=embeds,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[0, -1].float()
