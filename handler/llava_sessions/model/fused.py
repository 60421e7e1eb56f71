"""One forward pass for a decode step and a prefill chunk together (Sarathi-Serve's fused step).

Sarathi-Serve (Agrawal et al., "Taming Throughput-Latency Tradeoff in LLM Inference with
Sarathi-Serve", OSDI 2024) runs a prefill chunk in the same forward pass as the running answers'
decode step: the weights are read once and a pass's fixed cost (the per-layer work whatever the
token count; benchmarks/results/beside-transformers-serve.md measures two passes against one) is paid
once. Here the pass's input is one sequence of
``B + C`` tokens: the ``B`` decode rows' next tokens, then the chunk's ``C`` tokens. Everything but
attention is per token, so the model's own layers run it unchanged; attention is where the two parts
differ, and :func:`fused_attention` (registered as :data:`FUSED_ATTENTION` with transformers'
``AttentionInterface``) runs the model's own SDPA attention twice: the decode rows over their KV
(``[B, kv_heads, length, head_dim]`` gathered, or read as runs of pages on a CPU: :mod:`.kv.runs`),
one row each as a decode step does, and the chunk over its session's KV (causal from the chunk's
first position, as a prefill does).

:class:`FusedCache` is what the layers see as their cache: :meth:`FusedCache.update` writes the decode
rows' keys and values at their slots of the pool and appends the chunk's to its session's cache, and
hands attention both parts. The model's mask builder is skipped (the attention
name has no mask function), the masks being the two parts' own.

A prefill over cached positions (a follow-up question, a prompt's later chunk, a fused pass's chunk)
attends with a causal mask aligned to the bottom right: its ``C`` queries see the ``start`` cached
positions and the chunk causally. transformers builds that mask as a ``[1, 1, C, start + C]`` tensor,
which keeps SDPA off its flash kernel on CUDA. With :attr:`LlavaModel.lower_right_prefill
<llava_sessions.model.LlavaModel.lower_right_prefill>` (CUDA) the chunk attends through
:func:`lower_right_attention` (:data:`LOWER_RIGHT_ATTENTION`) instead: the same SDPA call with
``torch.nn.attention.bias.causal_lower_right(C, start + C)``, which PyTorch dispatches to its flash
kernel (whose causal flag means lower right) or its memory-efficient one, materializing the mask only
where neither applies (as on the CPU, where it is therefore off).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch
from torch.nn.attention.bias import causal_lower_right
from transformers import AttentionInterface
from transformers.cache_utils import Cache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from .kv.cache import undo_pass
from .kv.runs import attend_runs

__all__ = [
    "FUSED_ATTENTION",
    "LOWER_RIGHT_ATTENTION",
    "FusedCache",
    "attention_on",
    "attention_window",
    "context_limit",
    "fused_attention",
    "lower_right_attention",
    "prefer_sdpa_backends",
]

log = logging.getLogger(__name__)

#: The attention implementation's name while a fused pass runs (transformers' ``AttentionInterface``).
FUSED_ATTENTION = "llava_fused_step"
#: The attention implementation's name while a prefill over cached positions runs in SDPA's
#: lower-right causal form (:func:`lower_right_attention`).
LOWER_RIGHT_ATTENTION = "llava_lower_right_prefill"


def attention_window(text_config: Any) -> int | None:
    """The sliding attention window (tokens) some layer of a text model of ``text_config`` attends
    within, or None when every layer attends to the whole context: Mistral's ``sliding_window``
    (4,096 in Mistral-7B-v0.1's config, None from v0.2), Qwen2's when ``use_sliding_window``, a
    ``sliding_attention`` entry of ``layer_types``. Within its first ``window`` positions such a model
    attends to every position before each one (transformers' sliding-window mask keeps key ``k`` for
    query ``q`` while ``q - k < window``), which is what the pool's attention computes."""
    window = getattr(text_config, "sliding_window", None)
    if getattr(text_config, "use_sliding_window", True) is False:
        window = None
    layer_types = getattr(text_config, "layer_types", None) or []
    if window is None or (layer_types and all(t == "full_attention" for t in layer_types)):
        return None
    return int(window)


def context_limit(text_config: Any) -> int:
    """The context a text model of ``text_config`` is served with, tokens: its ``max_position_embeddings``,
    capped at its sliding attention window (:func:`attention_window`), within which the pool's full
    attention is the model's own (docs/decisions/74-a-sliding-window-caps-the-context.md); a cap is
    logged once as a warning, since a longer conversation is then truncated or refused
    (``context_length_exceeded``)."""
    limit, window = int(text_config.max_position_embeddings), attention_window(text_config)
    if window is not None and window < limit:
        log.warning("the model attends within a sliding window of %d tokens: its context is capped at it", window)
        return window
    return limit


class _Parts(NamedTuple):
    """What attention gets for one layer: the decode rows' keys or values ``[B, kv_heads, length,
    head_dim]`` and the session's ``[1, kv_heads, start + C, head_dim]``."""

    batch: torch.Tensor
    session: torch.Tensor
    cache: FusedCache


class FusedCache(Cache):
    """The cache a fused pass's layers update: the decode batch's rows and one session's KV.

    Args:
        batch: the decode rows' :class:`~.kv.paged.SlotsCache` (each row writes its token at its table's slot).
        row_mask: ``[B, L]`` bool, where each decode row may attend over the ``L`` positions the
            batch's layers return (its own valid ones and the new one).
        session_cache: the chunk's session cache (a :class:`~.kv.paged.SessionKV`; grows by ``C``).
        start: positions the session's cache holds before the chunk.
        num_rows: ``B``, the decode rows (the first ``B`` tokens of the pass).
        lower_right: the chunk attends in SDPA's lower-right causal form (:func:`lower_right_attention`).
    """

    def __init__(
        self,
        batch: Cache,
        row_mask: torch.Tensor,
        session_cache: Any,
        start: int,
        num_rows: int,
        *,
        lower_right: bool = False,
    ) -> None:
        super().__init__(layers=list(session_cache.layers))
        self.batch = batch
        self.row_mask = row_mask[:, None, None, :]
        self.session_cache = session_cache
        self.start = start
        self.num_rows = num_rows
        self.lower_right = lower_right
        self._chunk_mask: torch.Tensor | None = None

    def chunk_mask(self, num_tokens: int, device: torch.device) -> Any:
        """The chunk's causal mask ``[1, 1, C, start + C]`` bool, or its lower-right causal bias with
        ``lower_right`` (None from position 0: SDPA's own causal mask, as the model's prefill uses)."""
        if self.start == 0:
            return None
        if self.lower_right and num_tokens > 1:
            return causal_lower_right(num_tokens, self.start + num_tokens)
        if self._chunk_mask is None:
            cols = torch.arange(self.start + num_tokens, device=device)
            rows = torch.arange(self.start, self.start + num_tokens, device=device)
            self._chunk_mask = (cols[None, :] <= rows[:, None])[None, None]
        return self._chunk_mask

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[Any, Any]:
        """Write one layer's new keys and values ``[1, kv_heads, B + C, head_dim]``: the first ``B``
        at the rows' slots of the pool, the rest onto the session's
        cache.

        Returns:
            The layer's keys and values as ``_Parts`` (the rows' read positions, the session's all).
        """
        b = self.num_rows
        rows: Any = self.batch.layers[layer_idx]  # a paged layer: writes the rows at their slots
        bk, bv = rows.update(_rows(key_states, b), _rows(value_states, b))
        sk, sv = self.session_cache.update(key_states[:, :, b:], value_states[:, :, b:], layer_idx)
        return _Parts(bk, sk, self), _Parts(bv, sv, self)

    def undo(self) -> None:
        """Take the chunk's positions back off every layer of the session's cache (after a failed
        pass, whichever layers it reached)."""
        undo_pass(self.session_cache, self.start)


def _rows(states: torch.Tensor, num_rows: int) -> torch.Tensor:
    """The decode rows' part of a pass's ``[1, heads, B + C, head_dim]`` states, one row each:
    ``[B, heads, 1, head_dim]``."""
    return states[0, :, :num_rows].transpose(0, 1).unsqueeze(2)


def fused_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: Any,
    value: Any,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention of a fused pass (``query`` ``[1, heads, B + C, head_dim]``; ``key`` / ``value`` the
    :class:`FusedCache`'s parts): the model's SDPA attention for the decode rows over their batch rows,
    then for the chunk over its session; returns ``[1, B + C, heads, head_dim]`` and no weights."""
    cache = key.cache
    kwargs.pop("is_causal", None)
    b = cache.num_rows
    runs = getattr(cache.batch, "runs", None)  # rows read as runs of the pool (:mod:`.kv.runs`)
    if runs is not None:
        rows = attend_runs(_rows(query, b), key.batch, value.batch, runs, kwargs.get("scaling"))
    else:
        rows, _ = sdpa_attention_forward(
            module, _rows(query, b), key.batch, value.batch, cache.row_mask, is_causal=False, **kwargs
        )
    q_chunk = query[:, :, b:]
    mask = cache.chunk_mask(q_chunk.shape[2], query.device)
    chunk, _ = sdpa_attention_forward(module, q_chunk, key.session, value.session, mask, **kwargs)
    return torch.cat([rows.transpose(0, 1).reshape(1, b, *rows.shape[2:]), chunk], dim=1), None


def lower_right_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention of one sequence's prefill of ``C`` positions over its cache (``query`` ``[1, heads,
    C, head_dim]``; ``key`` / ``value`` ``[1, kv_heads, start + C, head_dim]``): the model's SDPA
    attention with ``causal_lower_right(C, start + C)`` as its mask (PyTorch's
    ``torch.nn.attention.bias``), or SDPA's own causal form from position 0; returns ``[1, C, heads,
    head_dim]`` and no weights. ``attention_mask`` is None (the implementation has no mask function)."""
    kwargs.pop("is_causal", None)
    num_queries, num_keys = query.shape[2], key.shape[2]
    if num_queries == num_keys or num_queries == 1:
        return sdpa_attention_forward(module, query, key, value, None, is_causal=num_queries > 1, **kwargs)
    mask = causal_lower_right(num_queries, num_keys)
    return sdpa_attention_forward(module, query, key, value, mask, is_causal=False, **kwargs)


AttentionInterface.register(FUSED_ATTENTION, fused_attention)
AttentionInterface.register(LOWER_RIGHT_ATTENTION, lower_right_attention)


@contextmanager
def attention_on(config: Any, name: str) -> Iterator[None]:
    """While inside, the layers of the text model configured by ``config`` attend with the attention
    implementation registered as ``name`` (:data:`FUSED_ATTENTION`, :data:`LOWER_RIGHT_ATTENTION`);
    the implementation's name is restored on leaving."""
    before = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = before


def prefer_sdpa_backends(device: torch.device) -> None:
    """On a CUDA device, take cuDNN out of the backends PyTorch's SDPA may pick (process-wide; flash,
    memory-efficient and math stay as they were). Nothing changes on other devices.

    Why (``benchmarks/profile_step.py``; figures in benchmarks/results/the-gpu-table.md): cuDNN's SDPA builds an
    execution plan for each new shape, milliseconds of host time per call. A decode step's keys grow
    by one position each step, so every layer meets a new shape and an eager decode step spends most
    of its time in ``aten::_cudnn_attention_forward``; at a repeated shape the plan is reused. Without cuDNN a masked decode step runs
    the memory-efficient kernel, and an unmasked prefill the flash one.
    """
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)
