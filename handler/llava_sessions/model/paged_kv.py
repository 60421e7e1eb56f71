"""A replica's KV pool in pages, and the caches through which the model's own attention reads and writes it.

:class:`KVPages` holds every layer's keys and values as ``[num_pages, page_size, kv_heads,
head_dim]`` in the model dtype, preallocated once; which pages a holder uses is the bookkeeping of
:mod:`llava_sessions.engine.pages` (a :class:`~llava_sessions.engine.pages.PageTable`). Position
``p`` of a table lives in slot ``pages[p // page_size] * page_size + p % page_size``.

The caches plug into transformers' public ``Cache`` interface, as :mod:`.kv_cache` does, so the
model's own layers and SDPA attention run unchanged:

- :class:`PagedCache`: one sequence's forward pass (a prefill over cached positions, or one decode
  token): the pass's new keys and values go to their slots, and attention reads the sequence's
  positions gathered from its pages (``[1, kv_heads, length, head_dim]``);
- :class:`PagedBatchCache`: one decode step of several sequences, each with its own table and
  length: each row's token goes to its slot, attention reads the rows gathered and right-padded
  (``[B, kv_heads, longest, head_dim]``, pads masked by :attr:`PagedBatchCache.attention_mask`).
  A row joins or leaves the step by being in the list or not: no KV moves.

The gather is a copy of the attended positions per layer per pass (transformers' continuous
batching reads its paged cache the same way). Measured on this CPU (26 Nov, fp32, 8 rows, one query
over 600 keys): gather + SDPA about 7.5 ms against 1.3-2.0 ms for contiguous SDPA, which is why the
decode batch on the CPU stays the contiguous :class:`~.kv_cache.BatchKVCache` (issue 43 allows a CPU
layout that keeps the CPU's numbers). Greedy tokens through these caches equal ``model.generate``'s
in fp32 (tests/core/test_kv_pages.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

if TYPE_CHECKING:
    from ..engine.pages import PageCopy, PageTable

__all__ = ["KVPages", "PagedBatchCache", "PagedCache"]


class KVPages:
    """Every decoder layer's keys and values in ``num_pages`` pages, preallocated (zeros).

    Args:
        num_layers, num_kv_heads, head_dim: the text model's shape.
        num_pages, page_size: the pool's pages and token positions per page.
        dtype, device: the model's.

    Attributes:
        keys, values: per layer ``[num_pages, page_size, kv_heads, head_dim]``.
        num_copied_bytes: KV bytes copied from page to page since start (copy on write); tests
            read it to show what a step did not copy.
    """

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.page_size = page_size
        self.num_copied_bytes = 0

    @property
    def bytes_per_page(self) -> int:
        """Device bytes of one page across every layer, keys and values."""
        return 2 * sum(k[0].nbytes for k in self.keys)

    def nbytes(self) -> int:
        """Device bytes of the whole pool."""
        return sum(k.nbytes + v.nbytes for k, v in zip(self.keys, self.values, strict=True))

    def copy(self, copies: Iterable[PageCopy]) -> None:
        """Copy each ``src`` page's first ``num_tokens`` positions into ``dst``, in every layer (the
        copies :func:`~llava_sessions.engine.pages.reserve` asks for)."""
        for c in copies:
            for keys, values in zip(self.keys, self.values, strict=True):
                keys[c.dst, : c.num_tokens] = keys[c.src, : c.num_tokens]
                values[c.dst, : c.num_tokens] = values[c.src, : c.num_tokens]
            self.num_copied_bytes += c.num_tokens * self.bytes_per_page // self.page_size

    def write(self, layer: int, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write ``keys`` / ``values`` ``[n, kv_heads, head_dim]`` at ``slots`` ``[n]`` (long) of ``layer``."""
        self.keys[layer].view(-1, *keys.shape[1:]).index_copy_(0, slots, keys.to(self.keys[layer].dtype))
        self.values[layer].view(-1, *values.shape[1:]).index_copy_(0, slots, values.to(self.values[layer].dtype))

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``layer``'s keys and values at ``slots`` (``[..., L]`` long): ``[..., kv_heads, L, head_dim]``
        (a copy, laid out as attention reads it)."""
        k = self.keys[layer].view(-1, *self.keys[layer].shape[2:])[slots]
        v = self.values[layer].view(-1, *self.values[layer].shape[2:])[slots]
        return k.transpose(-3, -2), v.transpose(-3, -2)


class _PagedLayer(CacheLayerMixin):
    """One decoder layer's view of the pool for one pass: where the pass writes (``write_slots``
    ``[n]``, or ``[B]`` one per row), what attention reads (``read_slots`` ``[1, L]`` or ``[B, L]``)
    and how many of the read positions the pass itself writes (``num_new``: ``n``, or 1 per row)."""

    def __init__(
        self, pages: KVPages, index: int, write_slots: torch.Tensor, read_slots: torch.Tensor, num_new: int
    ) -> None:
        super().__init__()
        self.pages, self.index = pages, index
        self.write_slots, self.read_slots, self.num_new = write_slots, read_slots, num_new
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to allocate: the pool is preallocated."""

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the pass's ``[B, kv_heads, n, head_dim]`` states at their slots; return the attended
        positions ``[B, kv_heads, L, head_dim]`` gathered from the pool."""
        heads, dim = key_states.shape[1], key_states.shape[-1]
        flat_k = key_states.transpose(1, 2).reshape(-1, heads, dim)  # [B * n, kv_heads, head_dim]
        flat_v = value_states.transpose(1, 2).reshape(-1, heads, dim)
        self.pages.write(self.index, self.write_slots, flat_k, flat_v)
        return self.pages.gather(self.index, self.read_slots)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """The mask covers every attended position (those written before and the pass's own)."""
        return int(self.read_slots.shape[-1]), 0

    def get_seq_length(self) -> int:
        """Positions held before the pass (the longest row's, in a batch)."""
        return int(self.read_slots.shape[-1]) - self.num_new

    def get_max_length(self) -> int:
        """No fixed maximum: the pool's free pages are the limit."""
        return -1


def _slots(table: PageTable, start: int, stop: int, page_size: int, device: torch.device) -> torch.Tensor:
    return torch.tensor(table.slots(start, stop, page_size), dtype=torch.long, device=device)


class PagedCache(Cache):
    """The cache of one sequence's forward pass over ``table``'s pages.

    Args:
        pages: the pool.
        table: the sequence's pages, already reserved for the pass (``num_tokens`` counts the pass's
            positions: :func:`~llava_sessions.engine.pages.reserve`).
        num_new: the pass's new positions ``n`` (the last ``n`` of ``table``).

    Raises:
        ValueError: ``num_new`` is not between 1 and the table's positions.
    """

    def __init__(self, pages: KVPages, table: PageTable, num_new: int) -> None:
        if not 0 < num_new <= table.num_tokens:
            raise ValueError(f"{num_new} new positions in a table of {table.num_tokens}")
        device = pages.keys[0].device
        write = _slots(table, table.num_tokens - num_new, table.num_tokens, pages.page_size, device)
        read = _slots(table, 0, table.num_tokens, pages.page_size, device)[None]
        layers = [_PagedLayer(pages, i, write, read, num_new) for i in range(len(pages.keys))]
        super().__init__(layers=list(layers))


class PagedBatchCache(Cache):
    """The cache of one decode step of several sequences, one new token each.

    Args:
        pages: the pool.
        tables: one per row, each already reserved for its new token (its last position).

    Attributes:
        attention_mask: ``[B, longest]`` long, 1 where a row's positions are (its own, the new one
            included), 0 for the right padding; pass it to the model as the attention mask.
        positions: ``[B]`` each row's new position (its length - 1).
    """

    def __init__(self, pages: KVPages, tables: Sequence[PageTable]) -> None:
        device = pages.keys[0].device
        size = pages.page_size
        longest = max(t.num_tokens for t in tables)
        read = torch.zeros(len(tables), longest, dtype=torch.long, device=device)
        self.attention_mask = torch.zeros(len(tables), longest, dtype=torch.long, device=device)
        for row, table in enumerate(tables):
            read[row, : table.num_tokens] = _slots(table, 0, table.num_tokens, size, device)
            self.attention_mask[row, : table.num_tokens] = 1
        write = read[torch.arange(len(tables), device=device), [t.num_tokens - 1 for t in tables]]
        self.positions = [t.num_tokens - 1 for t in tables]
        layers = [_PagedLayer(pages, i, write, read, 1) for i in range(len(pages.keys))]
        super().__init__(layers=list(layers))
