"""What any KV cache a forward pass runs over answers: its length, and a failed pass taken back.

A session's cache is a :class:`~.paged.SessionKV` in the replica's pool; a one-off pass outside the
engine (the compile warm-up, a test's reference) may run over a transformers ``DynamicCache``
(``[1, kv_heads, length, head_dim]`` per layer). :meth:`LlavaModel.prefill
<llava_sessions.model.LlavaModel.prefill>` takes either.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["cache_len", "undo_pass"]


def cache_len(cache: Any) -> int:
    """Number of token positions held by ``cache`` (0 for ``None``)."""
    return 0 if cache is None else int(cache.get_seq_length())


def undo_pass(cache: Any, start: int) -> None:
    """Take a failed forward pass's positions back off ``cache``, to the ``start`` it held before
    (whichever layers the pass reached), so the pass can run again: a session's pages past them
    freed, a ``DynamicCache``'s tensors cut."""
    truncate = getattr(cache, "truncate", None)
    if truncate is not None:
        if cache_len(cache) > start:
            truncate(start)
        return
    for layer in cache.layers:
        keys = getattr(layer, "keys", None)
        if isinstance(keys, torch.Tensor) and keys.shape[-2] > start:
            layer.keys = layer.keys[:, :, :start].clone()
            layer.values = layer.values[:, :, :start].clone()
