"""Pages of a KV pool: which fixed-size pages each holder of KV uses (bookkeeping only, no tensors).

A replica's KV pool (:class:`~llava_sessions.model.kv.paged.KVPages`) holds keys and values in
``num_pages`` pages of ``page_size`` token positions each. Every holder of KV (a session, a
conversation-cache entry, a shared image prefix, a running answer) holds a :class:`PageTable`: its
pages in position order and how many positions it has written. The token at position ``p`` lives
in slot ``pages[p // page_size] * page_size + p % page_size`` of the pool.

Pages are shared by reference count (:class:`PagePool`): a fork (:func:`fork`) shares every page of
its source, so two sessions on one image, or a session continuing a cache entry, hold the same
prefix pages and copy nothing. A holder about to write into a last page that another holder also
references copies that one page first (copy on write, :func:`reserve`); full pages are never
written again, so they are never copied. A holder's bytes are its pages: ``ceil(tokens /
page_size) x page bytes``, nothing padded beyond its last page.

Where a holder's pages go: each holder's pages are kept in as few runs of consecutive pages as the
free pages allow, so attention can read a run as one view of the pool, with no gather
(:mod:`.runs`). A holder that grows takes the page after its last one when that is free; a new run
starts in the middle of the longest free run, leaving room on both sides for the holders around it
to grow into (a buddy allocator's spreading, without its power-of-two sizes).

Anchors, read and not copied: vLLM's block pool (``vllm/v1/core/block_pool.py``: ref counts, a free
queue, the bookkeeping apart from the memory) and nano-vllm's ``engine/block_manager.py``
(``can_allocate`` / ``allocate`` / ``deallocate``). An expected shortage returns None and changes
nothing; a caller's error raises.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import NamedTuple

__all__ = ["PageCopy", "PagePool", "PageTable", "fork", "pages_for", "release", "reserve", "truncate"]


#: A run of free pages in :attr:`PagePool._is_free`.
_FREE_RUN = re.compile(b"\x01+")


def pages_for(num_tokens: int, page_size: int) -> int:
    """Pages of ``page_size`` positions that ``num_tokens`` positions fill: ``ceil(num_tokens / page_size)``."""
    return -(-num_tokens // page_size)


class PagePool:
    """The free list and reference counts of ``num_pages`` pages of ``page_size`` positions.

    Args:
        num_pages: pages in the pool (the tensors' first dimension).
        page_size: token positions per page.

    Raises:
        ValueError: a count below 1.
    """

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"a pool needs at least one page of one position, not {num_pages} x {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self._is_free = bytearray(b"\x01" * num_pages)  # 1 at a free page
        self._num_free = num_pages
        self._refs = [0] * num_pages

    @property
    def num_free_pages(self) -> int:
        """Pages no holder references."""
        return self._num_free

    @property
    def usage(self) -> float:
        """Share of the pages referenced, 0.0-1.0."""
        return 1.0 - self._num_free / self.num_pages

    def free_pages(self) -> list[int]:
        """The free pages, in order."""
        return [p for p, free in enumerate(self._is_free) if free]

    def pages_for(self, num_tokens: int) -> int:
        """Pages that ``num_tokens`` positions fill (:func:`pages_for`)."""
        return pages_for(num_tokens, self.page_size)

    def ref_count(self, page: int) -> int:
        """Holders referencing ``page``."""
        return self._refs[page]

    def grow(self, num_pages: int) -> None:
        """Add ``num_pages`` free pages, numbered after the existing ones (the tensors grow alike:
        :meth:`~llava_sessions.model.kv.paged.KVPages.grow`).

        Raises:
            ValueError: ``num_pages`` below 1.
        """
        if num_pages < 1:
            raise ValueError(f"a pool grows by at least one page, not {num_pages}")
        self._is_free.extend(b"\x01" * num_pages)
        self._num_free += num_pages
        self._refs.extend([0] * num_pages)
        self.num_pages += num_pages

    def allocate(self, num_pages: int, after: int | None = None) -> list[int] | None:
        """Take ``num_pages`` free pages (each referenced once), in as few runs as the free pages allow
        (module docstring); None, taking none, when fewer are free.

        Args:
            num_pages: pages to take.
            after: the holder's last page, when it grows: the pages right after it come first.
        """
        if num_pages > self._num_free:
            return None
        if num_pages == 0:
            return []
        free = self._is_free
        if after is not None and free[after + 1 : after + 1 + num_pages] == b"\x01" * num_pages:
            pages = list(range(after + 1, after + 1 + num_pages))
        else:
            pages = []
            runs = sorted(((m.end() - m.start(), m.start()) for m in _FREE_RUN.finditer(free)), reverse=True)
            for length, start in runs:
                take = min(length, num_pages - len(pages))
                first = start + (length - take) // 2 if not pages else start  # a new run: mid-run
                pages.extend(range(first, first + take))
                if len(pages) == num_pages:
                    break
        for page in pages:
            free[page] = 0
            self._refs[page] = 1
        self._num_free -= num_pages
        return pages

    def share(self, pages: list[int]) -> None:
        """Add one reference to each of ``pages``.

        Raises:
            ValueError: a page no holder references (it may already belong to someone else).
        """
        for page in pages:
            if self._refs[page] == 0:
                raise ValueError(f"page {page} is free: only a held page can be shared")
        for page in pages:
            self._refs[page] += 1

    def free(self, pages: list[int]) -> None:
        """Drop one reference to each of ``pages``; a page nobody references goes back to the free list.

        Raises:
            ValueError: a page already free.
        """
        for page in pages:
            if self._refs[page] == 0:
                raise ValueError(f"page {page} is already free")
            self._refs[page] -= 1
            if self._refs[page] == 0:
                self._is_free[page] = 1
                self._num_free += 1


@dataclass
class PageTable:
    """One holder's pages, in position order, and the positions it has written (``num_tokens``)."""

    pages: list[int] = field(default_factory=list)
    num_tokens: int = 0

    def slots(self, start: int, stop: int, page_size: int) -> list[int]:
        """Pool slots of positions ``start .. stop`` (``page * page_size + offset``).

        Raises:
            IndexError: a position past the table's pages.
        """
        if stop > len(self.pages) * page_size:
            raise IndexError(f"position {stop - 1} is past the table's {len(self.pages)} pages")
        return [self.pages[p // page_size] * page_size + p % page_size for p in range(start, stop)]


class PageCopy(NamedTuple):
    """A page the tensors must copy before a write: the first ``num_tokens`` positions of ``src``
    into ``dst`` (copy on write of a shared, partly written last page)."""

    src: int
    dst: int
    num_tokens: int


def reserve(pool: PagePool, table: PageTable, num_tokens: int) -> list[PageCopy] | None:
    """Make room in ``table`` for ``num_tokens`` more positions and count them written
    (``table.num_tokens`` grows; the forward pass writes them at :meth:`PageTable.slots`).

    A partly written last page that another holder references is replaced by a fresh page first
    (copy on write); then pages are added until the new positions fit.

    Returns:
        The page copies the tensors must make before the pass (at most one), or None when the pool
        has too few free pages (``table`` and the pool are unchanged).
    """
    size = pool.page_size
    used = table.num_tokens % size
    shared_tail = used > 0 and pool.ref_count(table.pages[table.num_tokens // size]) > 1
    need = pool.pages_for(table.num_tokens + num_tokens) - len(table.pages) + int(shared_tail)
    last = table.pages[-1] if table.pages and not shared_tail else None
    fresh = pool.allocate(need, after=last) if need > 0 else []
    if fresh is None:
        return None
    copies: list[PageCopy] = []
    if shared_tail:
        index = table.num_tokens // size
        src, dst = table.pages[index], fresh.pop(0)
        pool.free([src])
        table.pages[index] = dst
        copies.append(PageCopy(src, dst, used))
    table.pages.extend(fresh)
    table.num_tokens += num_tokens
    return copies


def fork(pool: PagePool, table: PageTable, num_tokens: int | None = None) -> PageTable:
    """A new table holding the first ``num_tokens`` (default: all) positions of ``table`` by sharing
    its pages: no page is copied (a write into a shared last page copies it then, :func:`reserve`).

    Raises:
        ValueError: ``num_tokens`` is more than ``table`` holds.
    """
    n = table.num_tokens if num_tokens is None else num_tokens
    if n > table.num_tokens:
        raise ValueError(f"cannot fork {n} positions of a table of {table.num_tokens}")
    pages = table.pages[: pool.pages_for(n)]
    pool.share(pages)
    return PageTable(list(pages), n)


def truncate(pool: PagePool, table: PageTable, num_tokens: int) -> None:
    """Keep the first ``num_tokens`` positions of ``table``; the pages past them are freed (in place).

    Raises:
        ValueError: ``num_tokens`` is more than ``table`` holds.
    """
    if num_tokens > table.num_tokens:
        raise ValueError(f"cannot truncate a table of {table.num_tokens} positions to {num_tokens}")
    keep = pool.pages_for(num_tokens)
    pool.free(table.pages[keep:])
    del table.pages[keep:]
    table.num_tokens = num_tokens


def release(pool: PagePool, table: PageTable) -> None:
    """Free all of ``table``'s pages and empty it (in place)."""
    truncate(pool, table, 0)
