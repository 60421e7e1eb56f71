"""KV caches: a session's ``DynamicCache`` helpers and the decode batch's preallocated :class:`BatchKVCache`.

A session's cache is a transformers ``DynamicCache`` whose layers hold ``keys``/``values`` of shape
``[1, num_kv_heads, cached_len, head_dim]`` in the model dtype. The decode batch's cache holds every
running answer as one left-padded row (:class:`BatchKVLayer`).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, StaticLayer

__all__ = [
    "BatchKVCache",
    "BatchKVLayer",
    "cache_len",
    "crop_cache",
    "extend_cache",
    "held_len",
    "layer_states",
    "release_cache",
    "undo_pass",
]


def cache_len(cache: Any) -> int:
    """Number of token positions held by ``cache`` (0 for ``None``)."""
    return 0 if cache is None else int(cache.get_seq_length())


def held_len(cache: Any) -> int:
    """Token positions of device memory ``cache`` holds, what the ledger books: a session cache in
    pages (:class:`~.paged.SessionKV`) its pages x page size, a ``DynamicCache`` its positions
    (0 for ``None``)."""
    held = getattr(cache, "num_held_tokens", None)
    return cache_len(cache) if held is None else int(held)


def release_cache(cache: Any) -> None:
    """Give ``cache``'s memory back now: a paged cache's pages go back to its pool (a ``DynamicCache``'s
    tensors go when nothing references them; None: nothing)."""
    release = getattr(cache, "release", None)
    if release is not None:
        release()


def layer_states(cache: Any, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``layer_idx``'s keys and values over every position of ``cache``, ``[1, kv_heads, length, head_dim]``
    (a paged cache's gathered from its pages; a ``DynamicCache``'s own tensors)."""
    gather = getattr(cache, "layer_states", None)
    if gather is not None:
        return gather(layer_idx)
    layer = cache.layers[layer_idx]
    return layer.keys, layer.values


def extend_cache(cache: Any, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
    """Append every layer's ``[1, kv_heads, n, head_dim]`` keys and values to ``cache`` (one tensor per
    layer; a paged cache reserves the ``n`` positions in its pool first).

    Raises:
        torch.OutOfMemoryError: no room (a paged cache: nothing appended).
    """
    extend = getattr(cache, "extend", None)
    if extend is not None:
        extend(keys, values)
        return
    for i, (k, v) in enumerate(zip(keys, values, strict=True)):
        cache.update(k, v, i)


def undo_pass(cache: Any, start: int) -> None:
    """Take a failed forward pass's positions back off ``cache``, to the ``start`` it held before
    (whichever layers the pass reached), so the pass can run again."""
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


def crop_cache(cache: Any, length: int) -> None:
    """Keep the first ``length`` positions of ``cache`` in place, and compact its storage.

    ``DynamicCache.crop`` slices a view, which keeps the whole old storage alive; the
    clone makes the bytes the ledger accounts (tokens x ``kv_bytes_per_token``) the real ones.
    A paged cache frees the pages past ``length``.

    Raises:
        ValueError: ``cache`` holds fewer than ``length`` positions.
    """
    remove = cache_len(cache) - length
    if remove < 0:
        raise ValueError(f"cannot crop a cache of {cache_len(cache)} tokens to {length}")
    if remove == 0:
        return
    truncate = getattr(cache, "truncate", None)
    if truncate is not None:
        truncate(length)
        return
    cache.crop(-remove)
    for layer in cache.layers:
        if isinstance(getattr(layer, "keys", None), torch.Tensor):
            layer.keys = layer.keys.clone()
            layer.values = layer.values.clone()


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
        """Allocate ``[num_rows, num_heads, max_cache_len, head_dim]`` keys and values, uninitialized
        (a column is written before attention reads it, except a row's left pads: the builder zeroes
        those, :meth:`BatchKVCache.zero_leading`); length 0."""
        shape = (num_rows, num_heads, self.max_cache_len, head_dim)
        self.keys = torch.empty(shape, dtype=dtype, device=device)
        self.values = torch.empty(shape, dtype=dtype, device=device)
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

    def zero_leading(self, row: int, columns: int) -> None:
        """Zero ``row``'s first ``columns`` columns in every layer: its left pads, which attention reads
        (masked out: zeros keep a NaN or an infinity of uninitialized memory out of the scores)."""
        if columns > 0:
            for layer in self.batch_layers:
                layer.keys[row, :, :columns].zero_()
                layer.values[row, :, :columns].zero_()

    def nbytes(self) -> int:
        """Device bytes of the preallocated keys and values."""
        return sum(layer.keys.nbytes + layer.values.nbytes for layer in self.batch_layers)

    def load_row(self, row: int, cache: Any, end: int) -> None:
        """Copy a session's cache (``[1, kv_heads, L, head_dim]`` per layer; a paged one gathered from
        its pages) into ``row`` at columns ``end - L .. end`` (right-aligned: its next token goes to
        column ``end``)."""
        n = cache_len(cache)
        for i, dst in enumerate(self.batch_layers):
            keys, values = layer_states(cache, i)
            dst.keys[row, :, end - n : end] = keys[0]
            dst.values[row, :, end - n : end] = values[0]

    def extract_row(self, row: int, columns: torch.Tensor, into: Any) -> Any:
        """Append ``row``'s ``columns`` (a ``[n]`` long tensor of column indexes, in order) to ``into``
        (a session cache: a ``DynamicCache`` or a :class:`~.paged.SessionKV`) as ``n`` positions
        (``[1, kv_heads, n, head_dim]`` per layer); returns it.

        Raises:
            torch.OutOfMemoryError: a paged cache's pool has no room to grow (nothing appended).
        """
        layers = self.batch_layers
        keys = [layer.keys[row].index_select(1, columns).unsqueeze(0) for layer in layers]
        extend_cache(into, keys, [layer.values[row].index_select(1, columns).unsqueeze(0) for layer in layers])
        return into
