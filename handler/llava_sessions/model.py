"""LLaVA model runner: loading, image encoding, chat templating, prefill and decode steps.

Pure model operations over explicit state; no sessions, HTTP or JSON. One forward pass per call,
batch size 1. The KV cache is a transformers ``DynamicCache`` whose layers hold
``keys``/``values`` of shape ``[1, num_kv_heads, cached_len, head_dim]`` in the model dtype.

Mechanics (verified, shared/notes/llava-transformers.md): image features are the projector's
output for the vision tower's layer ``vision_feature_layer`` (CLS dropped for the ``default``
strategy), shape ``[num_image_tokens, text_hidden]``; they replace the embeddings of the
``<image>`` placeholder tokens exactly as ``LlavaModel.forward`` does with ``masked_scatter``, so
a cached prefill is token-identical to ``model.generate`` from scratch in fp32.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers.cache_utils import Cache, StaticLayer

from .errors import ErrorCode, ServiceError

log = logging.getLogger(__name__)

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


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
    """One remembered exchange: the user's ``prompt`` and the assistant's ``answer`` text."""

    prompt: str
    answer: str


class LlavaRunner:
    """A loaded LLaVA checkpoint and the forward passes the session engine needs.

    Args:
        model: a ``LlavaForConditionalGeneration`` in eval mode on ``device``.
        processor: its ``LlavaProcessor`` (image processor, tokenizer, chat template).

    Attributes:
        num_image_tokens: placeholder tokens per image (576 for llava-1.5 at 336 px).
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
        vision = self.config.vision_config
        num_patches = (vision.image_size // vision.patch_size) ** 2
        strategy = self.config.vision_feature_select_strategy
        self.num_image_tokens: int = num_patches + (0 if strategy == "default" else 1)
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
        self._prefix_cache: dict[str | None, list[int]] = {}

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
            ValueError: bad device or dtype.
        """
        from transformers import AutoProcessor, LlavaForConditionalGeneration
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        path = Path(model_dir)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} is not a checkpoint folder (no config.json)")
        dev = resolve_device(device, gpu_id)
        torch_dtype = resolve_dtype(dtype, dev)
        loaded: Any = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch_dtype)
        model = loaded.to(dev)
        processor = AutoProcessor.from_pretrained(path)
        log.info("loaded checkpoint", extra={"model_dir": str(path), "device": str(dev), "dtype": str(torch_dtype)})
        return cls(model.eval(), processor)

    # ------------------------------------------------------------------ images
    @torch.inference_mode()
    def encode_image(self, image: Any) -> torch.Tensor:
        """Preprocess one RGB PIL image, run the vision tower and the projector.

        Returns:
            Image features ``[num_image_tokens, text_hidden]`` in the model dtype, on the device.

        Raises:
            ServiceError(image_invalid): the processor cannot handle the image.
        """
        try:
            pixels = self.processor.image_processor(images=[image], return_tensors="pt")["pixel_values"]
        except Exception as exc:  # noqa: BLE001 - any processor failure is the image's fault
            raise ServiceError(ErrorCode.IMAGE_INVALID, "the image could not be preprocessed") from exc
        return self.encode_pixels(pixels)

    @torch.inference_mode()
    def encode_pixels(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Run the vision tower + projector on ``pixel_values [1, 3, H, W]``; see :meth:`encode_image`."""
        pixel_values = pixel_values.to(self.device, self.dtype)
        out = self.model.get_image_features(
            pixel_values=pixel_values,
            vision_feature_layer=self.config.vision_feature_layer,
            vision_feature_select_strategy=self.config.vision_feature_select_strategy,
        )
        feats = out.pooler_output if hasattr(out, "pooler_output") else out
        if isinstance(feats, (list, tuple)):
            feats = torch.cat(list(feats), dim=0)
        return feats.reshape(-1, feats.shape[-1]).contiguous()

    # ------------------------------------------------------------------ text
    def conversation(self, system_prompt: str | None, turns: list[Turn], prompt: str | None) -> list[dict]:
        """Build chat messages: optional system, the image in the first user message before its text,
        remembered answers as assistant messages, then ``prompt`` as the last user message."""
        messages: list[dict] = []
        if system_prompt:
            messages.append({"role": "system", "content": [{"type": "text", "text": system_prompt}]})
        questions = [t.prompt for t in turns] + ([prompt] if prompt is not None else [])
        answers = [t.answer for t in turns]
        for i, question in enumerate(questions):
            content = ([{"type": "image"}] if i == 0 else []) + [{"type": "text", "text": question}]
            messages.append({"role": "user", "content": content})
            if i < len(answers):
                messages.append({"role": "assistant", "content": [{"type": "text", "text": answers[i]}]})
        return messages

    def conversation_text(self, system_prompt: str | None, turns: list[Turn], prompt: str) -> str:
        """Chat-template the full conversation with the generation prompt (``<image>`` not expanded)."""
        messages = self.conversation(system_prompt, turns, prompt)
        return self.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def tokenize(self, text: str) -> list[int]:
        """Tokenize templated text, expanding each ``<image>`` to :attr:`num_image_tokens` placeholders
        (what ``LlavaProcessor`` does), with the tokenizer's special tokens (BOS)."""
        expanded = text.replace(self.image_token, self.image_token * self.num_image_tokens)
        return list(self.tokenizer(expanded, add_special_tokens=True)["input_ids"])

    def conversation_ids(self, system_prompt: str | None, turns: list[Turn], prompt: str) -> list[int]:
        """Token ids of the full chat-templated conversation ending in the generation prompt."""
        return self.tokenize(self.conversation_text(system_prompt, turns, prompt))

    def prefix_ids(self, system_prompt: str | None, turns: list[Turn] | None = None) -> list[int]:
        """Token ids every next question shares: system prompt, image and ``turns``, whatever the question.

        Found as the common prefix of two conversations that differ only in their last question,
        so it holds for any chat template. Without turns the result is memoised per system prompt.
        """

        def compute() -> list[int]:
            a = self.conversation_ids(system_prompt, turns or [], "A")
            b = self.conversation_ids(system_prompt, turns or [], "Z")
            return a[: common_prefix_len(a, b)]

        if turns:
            return compute()
        if system_prompt not in self._prefix_cache:
            self._prefix_cache[system_prompt] = compute()
        return list(self._prefix_cache[system_prompt])

    def count_text_tokens(self, text: str) -> int:
        """Number of tokens of ``text`` alone (no special tokens)."""
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    # ------------------------------------------------------------------ forward passes
    def new_cache(self) -> Any:
        """Return an empty ``DynamicCache`` for this model."""
        from transformers import DynamicCache

        return DynamicCache(config=self.config.text_config)

    def _embed(self, ids: list[int], start: int, image_features: torch.Tensor | None, image_start: int) -> torch.Tensor:
        """Embeddings ``[1, len(ids), hidden]`` for positions ``start..``; image placeholders take
        row ``position - image_start`` of ``image_features``."""
        ids_t = torch.tensor([ids], device=self.device)
        embeds = self.model.get_input_embeddings()(ids_t)
        mask = ids_t[0] == self.image_token_id
        if bool(mask.any()):
            if image_features is None:
                raise RuntimeError("image placeholders to prefill but no image features")
            positions = torch.nonzero(mask).flatten() + start - image_start
            rows = image_features.index_select(0, positions).to(embeds.dtype)
            embeds[0, mask] = rows
        return embeds

    @torch.inference_mode()
    def prefill(self, cache: Any, ids: list[int], image_features: torch.Tensor | None) -> torch.Tensor:
        """Run the positions of ``ids`` beyond the cache in one forward pass, extending ``cache``.

        Args:
            cache: a ``DynamicCache`` holding exactly ``ids[:cache_len]`` (mutated: grows to ``len(ids)``).
            ids: the FULL token ids of the sequence; ``len(ids) > cache_len(cache)``.
            image_features: ``[num_image_tokens, hidden]``; needed only if uncached ids hold image placeholders.

        Returns:
            Logits ``[vocab]`` (float32) of the last position.
        """
        start = cache_len(cache)
        if start >= len(ids):
            raise ValueError(f"nothing to prefill: cache holds {start} of {len(ids)} tokens")
        image_start = ids.index(self.image_token_id) if self.image_token_id in ids else 0
        embeds = self._embed(ids[start:], start, image_features, image_start)
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
