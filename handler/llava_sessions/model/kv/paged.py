"""A replica's KV pool in pages, and the caches through which the model's own attention reads and writes it.

:class:`KVPages` holds every layer's keys and values as ``[num_pages, page_size, kv_heads,
head_dim]`` in the model dtype, preallocated once; which pages a holder uses is the bookkeeping of
:mod:`llava_sessions.model.kv.pages` (a :class:`~llava_sessions.model.kv.pages.PageTable`). Position
``p`` of a table lives in slot ``pages[p // page_size] * page_size + p % page_size``.

The caches plug into transformers' public ``Cache`` interface, as :mod:`.cache` does, so the
model's own layers and SDPA attention run unchanged:

- :class:`SessionKV`: a session's cache, the one a prefill or a fused chunk extends in place;
- :class:`SlotsCache`: one forward pass over given slots: one sequence's (a prefill over cached
  positions, or one decode token; :meth:`SlotsCache.of_sequence`), attention reading its positions
  gathered from its pages (``[1, kv_heads, length, head_dim]``), or one decode step of several
  sequences (:meth:`SlotsCache.of_rows`), each row's token written to its slot and the rows read
  gathered and right-padded (``[B, kv_heads, longest, head_dim]``, pads masked by
  :attr:`SlotsCache.attention_mask`). A row joins or leaves the step by being in the list or not.

The gather copies the attended positions per layer per pass; a decode step on a CPU reads each row's
runs of pages as views of the pool instead (:mod:`.runs`). Greedy tokens through these caches equal
``model.generate``'s in fp32 (tests/core/test_kv_pages.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .pages import PagePool, PageTable, fork, release, reserve, truncate
from .runs import Runs, table_runs

if TYPE_CHECKING:
    from .pages import PageCopy

__all__ = ["KVPages", "KVPool", "SessionKV", "SlotsCache", "page_slots"]


class KVPages:
    """Every decoder layer's keys and values in ``num_pages`` pages, preallocated (zeros).

    Args:
        num_layers, num_kv_heads, head_dim: the text model's shape.
        num_pages, page_size: the pool's pages and token positions per page.
        dtype, device: the model's.
        mirror: a tensor-parallel replica's other ranks (:class:`~..parallel.RankGroup`: anything with
            ``send``), told of the pool's creation, growths and copies, so their pages (their own heads)
            stay laid out as these; None: one process.

    Attributes:
        keys, values: per layer ``[num_pages, page_size, kv_heads, head_dim]`` (a layer may hold more
            pages after a growth that failed midway: :meth:`grow`).
        num_pages: the pages every layer holds.
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
        mirror: Any = None,
    ) -> None:
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        with torch.inference_mode():  # written only in inference mode (:meth:`write`, :meth:`copy`, :meth:`grow`)
            self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
            self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.page_size = page_size
        self.num_pages = num_pages
        self.num_copied_bytes = 0
        self.mirror = mirror
        if mirror is not None:
            mirror.send(("pages", num_layers, num_pages, page_size, num_kv_heads, head_dim, dtype))

    @property
    def bytes_per_page(self) -> int:
        """Device bytes of one page across every layer, keys and values."""
        return 2 * sum(k[0].nbytes for k in self.keys)

    def nbytes(self) -> int:
        """Device bytes of the whole pool."""
        return sum(k.nbytes + v.nbytes for k, v in zip(self.keys, self.values, strict=True))

    @torch.inference_mode()
    def grow(self, num_pages: int) -> None:
        """Add ``num_pages`` zeroed pages after the existing ones in every layer, one tensor at a time
        (each reallocated and its pages copied once, the old one freed before the next grows: the
        device holds the pool and one grown tensor at once, not two pools).

        Raises:
            torch.OutOfMemoryError: the device has no room for a larger tensor. :attr:`num_pages` is
                unchanged (the tensors grown so far keep their extra pages, which nothing reads, and
                the next growth to at least as many pages does not grow them again).
        """
        target = self.num_pages + num_pages
        for tensors in (self.keys, self.values):
            for i, t in enumerate(tensors):
                if t.shape[0] < target:
                    tensors[i] = _grown(t, target)
        self.num_pages = target
        if self.mirror is not None:
            self.mirror.send(("grow", num_pages))

    @torch.inference_mode()
    def copy(self, copies: Iterable[PageCopy]) -> None:
        """Copy each ``src`` page's first ``num_tokens`` positions into ``dst``, in every layer (the
        copies :func:`~llava_sessions.model.kv.pages.reserve` asks for)."""
        copies = list(copies)
        for c in copies:
            for keys, values in zip(self.keys, self.values, strict=True):
                keys[c.dst, : c.num_tokens] = keys[c.src, : c.num_tokens]
                values[c.dst, : c.num_tokens] = values[c.src, : c.num_tokens]
            self.num_copied_bytes += c.num_tokens * self.bytes_per_page // self.page_size
        if copies and self.mirror is not None:
            self.mirror.send(("copy", copies))

    @torch.inference_mode()
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


def _grown(t: torch.Tensor, num_pages: int) -> torch.Tensor:
    """``t`` ``[pages, ...]`` with zeroed pages after its own, ``num_pages`` in all (a new tensor)."""
    return torch.cat([t, t.new_zeros((num_pages - t.shape[0], *t.shape[1:]))])


class _PagedLayer(CacheLayerMixin):
    """One decoder layer's view of the pool for one pass: where the pass writes (``write_slots``
    ``[n]``, or ``[B]`` one per row), what attention reads (``read_slots`` ``[1, L]`` or ``[B, L]``)
    and how many of the read positions the pass itself writes (``num_new``: ``n``, or 1 per row)."""

    def __init__(
        self,
        pages: KVPages,
        index: int,
        write_slots: torch.Tensor,
        read_slots: torch.Tensor,
        num_new: int,
        whole_pool: bool = False,
    ) -> None:
        super().__init__()
        self.pages, self.index = pages, index
        self.write_slots, self.read_slots, self.num_new = write_slots, read_slots, num_new
        self.whole_pool = whole_pool
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to allocate: the pool is preallocated."""

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the pass's ``[B, kv_heads, n, head_dim]`` states at their slots; return the attended
        positions ``[B, kv_heads, L, head_dim]`` gathered from the pool (with ``whole_pool``: the
        layer's whole pool ``[1, kv_heads, slots, head_dim]``, a view, for :mod:`.flex`)."""
        heads, dim = key_states.shape[1], key_states.shape[-1]
        flat_k = key_states.transpose(1, 2).reshape(-1, heads, dim)  # [B * n, kv_heads, head_dim]
        flat_v = value_states.transpose(1, 2).reshape(-1, heads, dim)
        self.pages.write(self.index, self.write_slots, flat_k, flat_v)
        if self.whole_pool:
            k, v = self.pages.keys[self.index], self.pages.values[self.index]
            return k.view(1, -1, heads, dim).transpose(1, 2), v.view(1, -1, heads, dim).transpose(1, 2)
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
    if stop > len(table.pages) * page_size:
        raise IndexError(f"position {stop - 1} is past the table's {len(table.pages)} pages")
    return page_slots([table.pages], page_size)[0, start:stop].to(device)


def page_slots(
    pages: Sequence[Sequence[int]], page_size: int, *, width: int | None = None, pad: int = 0
) -> torch.Tensor:
    """Every slot of each row's ``pages`` in position order, ``[rows, width x page_size]`` long on the
    host (``width``: the most pages of a row by default; a shorter row padded with page ``pad``'s
    slots): one tensor op for all positions, where a Python loop over them would cost the host a
    step's microseconds per position."""
    width = max(len(p) for p in pages) if width is None else width
    table = torch.tensor([[*p, *[pad] * (width - len(p))] for p in pages], dtype=torch.long)
    return (table[:, :, None] * page_size + torch.arange(page_size)).reshape(len(pages), -1)


class SlotsCache(Cache):
    """The cache of one forward pass over slots of the pool: the pass's new keys and values written at
    ``write`` (``[n]`` for one sequence's ``n`` new positions, or ``[B]``, one per row of a decode step;
    long, on the pool's device), attention reading ``read`` (``[1, L]`` or ``[B, L]``; a row's pads masked
    by :attr:`attention_mask`; with ``whole_pool`` attention gets each layer's whole pool instead, read
    through a block mask: :mod:`.flex`). Only tensor ops read the slots, so a CUDA graph replays a step
    over the same tensors after they are overwritten (:mod:`.graphs`).

    Built for one sequence's pass by :meth:`of_sequence` and for a decode step's rows by
    :meth:`of_rows`.

    Attributes:
        attention_mask: ``[B, L]`` long, 1 where a row's positions are, 0 for its right padding (rows
            only; None for one sequence); pass it to the model as the attention mask.
        positions: each row's new position (its length - 1; rows only).
        runs: each row's runs of slots (:func:`.runs.table_runs`) when the step reads them
            (:meth:`of_rows` with ``runs``), else None.
    """

    def __init__(
        self,
        pages: KVPages,
        write: torch.Tensor,
        read: torch.Tensor,
        num_new: int = 1,
        *,
        whole_pool: bool = False,
    ) -> None:
        super().__init__(
            layers=[_PagedLayer(pages, i, write, read, num_new, whole_pool) for i in range(len(pages.keys))]
        )
        self.attention_mask: torch.Tensor | None = None
        self.positions: list[int] = []
        self.runs: Runs | None = None

    @classmethod
    def of_sequence(cls, pages: KVPages, table: PageTable, num_new: int) -> SlotsCache:
        """One sequence's pass over ``table``'s pages (already reserved for the pass: ``num_tokens``
        counts its positions, :func:`~llava_sessions.model.kv.pages.reserve`) whose last ``num_new``
        positions are new: a prefill over cached positions, or one decode token.

        Raises:
            ValueError: ``num_new`` is not between 1 and the table's positions.
        """
        if not 0 < num_new <= table.num_tokens:
            raise ValueError(f"{num_new} new positions in a table of {table.num_tokens}")
        device = pages.keys[0].device
        write = _slots(table, table.num_tokens - num_new, table.num_tokens, pages.page_size, device)
        read = _slots(table, 0, table.num_tokens, pages.page_size, device)[None]
        return cls(pages, write, read, num_new)

    @classmethod
    def of_rows(cls, pages: KVPages, tables: Sequence[PageTable], *, runs: bool = False) -> SlotsCache:
        """One decode step of several sequences, one new token each: ``tables``, one per row, each
        already reserved for its new token (its last position). A row joins or leaves a step by being
        in the list or not: no KV moves.

        With ``runs``, attention reads each row's runs of consecutive pages as views of the pool
        (:mod:`.runs`: :attr:`runs` set, each layer's whole pool handed to attention, and a
        ``[B, 1, 1, 1]`` mask that only stops transformers building one); else each row's positions
        gathered and right-padded, :attr:`attention_mask` masking the pads."""
        device = pages.keys[0].device
        lengths = torch.tensor([t.num_tokens for t in tables])
        longest = int(lengths.max())
        read = page_slots([t.pages for t in tables], pages.page_size)[:, :longest]  # pads: page 0's, masked
        write = read[torch.arange(len(tables)), lengths - 1]
        cache = cls(pages, write.to(device), read.to(device), whole_pool=runs)
        if runs:
            cache.runs = [table_runs(t.pages, t.num_tokens, pages.page_size) for t in tables]
            cache.attention_mask = torch.ones(len(tables), 1, 1, 1, dtype=torch.bool, device=device)
        else:
            cache.attention_mask = (torch.arange(longest)[None, :] < lengths[:, None]).long().to(device)
        cache.positions = [t.num_tokens - 1 for t in tables]
        return cache


class KVPool:
    """A replica's KV pool: the pages' tensors (:class:`KVPages`) and their bookkeeping
    (:class:`~llava_sessions.model.kv.pages.PagePool`), growing when a holder needs more pages than are
    free. Every session's KV is a :class:`SessionKV` over it.

    Args:
        num_layers, num_kv_heads, head_dim, dtype, device: the text model's.
        page_size: token positions per page (vLLM's default block size, 16).
        num_pages: pages allocated at the start; the pool grows by what a holder lacks, and at least
            a quarter, each time (so its free pages stay under a fifth of it after a growth; a growth
            copies the pool once).
        mirror: the other ranks of a tensor-parallel replica (:class:`KVPages`); None: one process.
        fixed: the pool never grows (a GPU's: sized once at start, so its tensors stay where a CUDA
            graph read them, :mod:`.graphs`); a holder finding no free page gets
            ``torch.OutOfMemoryError``, on which the engine demotes idle sessions (their pages freed)
            and retries (:func:`~llava_sessions.engine.memory.oom_attempts`).

    Attributes:
        pages: the tensors. pool: the free list and reference counts.
        num_grows: times the pool grew since start.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        *,
        page_size: int = 16,
        num_pages: int = 64,
        fixed: bool = False,
        mirror: Any = None,
    ) -> None:
        self.pool = PagePool(num_pages, page_size)
        self.pages = KVPages(num_layers, num_pages, page_size, num_kv_heads, head_dim, dtype, device, mirror)
        self.fixed = fixed
        self.num_grows = 0

    @property
    def page_size(self) -> int:
        """Token positions per page."""
        return self.pool.page_size

    def new_cache(self) -> SessionKV:
        """An empty session cache over this pool."""
        return SessionKV(self)

    def make_room(self, table: PageTable, num_tokens: int) -> None:
        """Room in ``table`` for ``num_tokens`` more positions (:func:`~llava_sessions.model.kv.pages.reserve`:
        a shared, partly written last page copied first); the pool grows when too few pages are free.

        Raises:
            torch.OutOfMemoryError: the device has no room to grow the pool, or a fixed pool has too
                few free pages (``table`` unchanged).
        """
        copies = reserve(self.pool, table, num_tokens)
        if copies is None and self.fixed:
            raise torch.OutOfMemoryError(f"out of memory: the KV pool's {self.pool.num_pages} pages are held")
        if copies is None:
            # the pages it lacks, one for a copied last page, less the free ones
            need = self.pool.pages_for(table.num_tokens + num_tokens) - len(table.pages) + 1 - self.pool.num_free_pages
            self.grow(max(need, self.pool.num_pages // 4))
            copies = reserve(self.pool, table, num_tokens)
            assert copies is not None, "a grown pool has the pages"
        self.pages.copy(copies)

    def grow(self, num_pages: int) -> None:
        """Add ``num_pages`` pages (tensors first: after an out-of-memory error the pool hands out
        the pages it had, and holds them as before)."""
        self.pages.grow(num_pages)
        self.pool.grow(num_pages)
        self.num_grows += 1

    def slots(self, table: PageTable, start: int, stop: int) -> torch.Tensor:
        """Pool slots ``[stop - start]`` (long, on the pool's device) of ``table``'s positions ``start .. stop``."""
        return _slots(table, start, stop, self.page_size, self.pages.keys[0].device)

    def num_used_bytes(self) -> int:
        """Device bytes of the pages some holder references (each page once, however many share it)."""
        return (self.pool.num_pages - self.pool.num_free_pages) * self.pages.bytes_per_page

    def check(self, tables: Iterable[PageTable]) -> None:
        """Assert that ``tables`` are every holder: each page is referenced exactly as often as they
        list it, and a page none lists is free (no page leaked, none shared without a count)."""
        counts = [0] * self.pool.num_pages
        for table in tables:
            for page in table.pages:
                counts[page] += 1
        refs = [self.pool.ref_count(p) for p in range(self.pool.num_pages)]
        assert counts == refs, "the pool's reference counts differ from the holders' page tables"
        assert self.pool.num_free_pages == counts.count(0)
        assert self.pool.free_pages() == [p for p, n in enumerate(counts) if n == 0], "the free map is off"


class _SessionLayer(CacheLayerMixin):
    """One decoder layer's face of a :class:`SessionKV` (what transformers' mask builder asks a layer)."""

    def __init__(self, owner: SessionKV) -> None:
        super().__init__()
        self.owner = owner
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to allocate: the pool is preallocated."""

    def update(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Not called: :meth:`SessionKV.update` writes every layer."""
        raise NotImplementedError("a session's layers are written through SessionKV.update")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """The mask covers the positions held and the pass's own."""
        return self.owner.table.num_tokens + query_length, 0

    def get_seq_length(self) -> int:
        """Positions held."""
        return self.owner.table.num_tokens

    def get_max_length(self) -> int:
        """No fixed maximum: the pool grows."""
        return -1


class SessionKV(Cache):
    """A session's KV cache as a page table in a :class:`KVPool`: the transformers ``Cache`` a prefill
    pass (:meth:`~llava_sessions.model.LlavaModel.prefill`, a fused pass's chunk) extends in place.

    A pass's new keys and values ``[1, kv_heads, n, head_dim]`` go to their slots (the table reserves
    them when layer 0 writes); attention reads the positions gathered from the pages
    (``[1, kv_heads, length, head_dim]``), or the pass's own states when nothing was held before it.

    Args:
        pool: the replica's pool.
        table: the pages held (default: none).
    """

    def __init__(self, pool: KVPool, table: PageTable | None = None) -> None:
        self.pool = pool
        self.table = table if table is not None else PageTable()
        self._write: torch.Tensor | None = None
        self._read: torch.Tensor | None = None
        super().__init__(layers=[_SessionLayer(self) for _ in pool.pages.keys])

    @property
    def num_held_tokens(self) -> int:
        """Positions the table's pages hold room for: its pages x page size (what the ledger books)."""
        return len(self.table.pages) * self.pool.page_size

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write one layer's new ``[1, kv_heads, n, head_dim]`` keys and values (layer 0 reserves the
        ``n`` positions first); return the layer's keys and values over every position.

        Raises:
            torch.OutOfMemoryError: layer 0 found no room to grow the pool.
        """
        if layer_idx == 0:
            start, n = self.table.num_tokens, key_states.shape[-2]
            self.pool.make_room(self.table, n)
            self._write = self.pool.slots(self.table, start, start + n)
            self._read = self.pool.slots(self.table, 0, start + n)[None] if start else None
        assert self._write is not None
        pages = self.pool.pages
        pages.write(layer_idx, self._write, key_states[0].transpose(0, 1), value_states[0].transpose(0, 1))
        if self._read is None:
            return key_states, value_states
        return pages.gather(layer_idx, self._read)

    def layer_states(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``layer_idx``'s keys and values over every held position, ``[1, kv_heads, length, head_dim]`` (a copy)."""
        return self.pool.pages.gather(layer_idx, self.pool.slots(self.table, 0, self.table.num_tokens)[None])

    def extend(self, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> None:
        """Append every layer's ``[1, kv_heads, n, head_dim]`` keys and values (one tensor per layer).

        Raises:
            torch.OutOfMemoryError: no room to grow the pool (nothing appended).
        """
        start, n = self.table.num_tokens, keys[0].shape[-2]
        self.pool.make_room(self.table, n)
        slots = self.pool.slots(self.table, start, start + n)
        for i, (k, v) in enumerate(zip(keys, values, strict=True)):
            self.pool.pages.write(i, slots, k[0].transpose(0, 1), v[0].transpose(0, 1))

    def pass_cache(self, num_new: int) -> SlotsCache:
        """Room for a pass of ``num_new`` more positions made in the table now (not when layer 0 writes,
        as :meth:`update` does), and the pass's :class:`SlotsCache` over it: how a tensor-parallel
        replica runs a prefill, its slots known before the other ranks are told of the pass. The
        table holds the new positions from here on (:meth:`truncate` takes them back).

        Raises:
            torch.OutOfMemoryError: no room to grow the pool (the table unchanged).
        """
        self.pool.make_room(self.table, num_new)
        return SlotsCache.of_sequence(self.pool.pages, self.table, num_new)

    def fork(self, num_tokens: int) -> SessionKV:
        """A new cache holding this one's first ``num_tokens`` positions by sharing their pages (no copy).

        Raises:
            ValueError: more positions than held.
        """
        return SessionKV(self.pool, fork(self.pool.pool, self.table, num_tokens))

    def truncate(self, num_tokens: int) -> None:
        """Keep the first ``num_tokens`` positions, freeing the pages past them (ValueError: more than held)."""
        truncate(self.pool.pool, self.table, num_tokens)

    def release(self) -> None:
        """Free every page (the cache is empty after)."""
        release(self.pool.pool, self.table)
