"""The decode step at static shapes over the KV pool, captured as CUDA graphs and replayed.

A decode step of ``n`` rows whose longest row has ``m`` positions runs in a bucket ``(B, L)``: the
smallest of the batch sizes 1, 2, 4, 8, then every 16 up to ``max_rows`` (nano-vllm's
``capture_cudagraph``) that holds ``n``, and the smallest attended length of 512, 640, 768, 896,
1024, 1280, ... positions (:func:`length_buckets`: each at most 25% longer than the last) up to the
model's context that holds ``m``. Every input of the pass lives in persistent buffers on the
device, overwritten before each step:

- ``ids`` / ``positions`` ``[max_rows, 1]`` long: each row's fed token and its position;
- ``write`` ``[max_rows]`` long: the pool slot of each row's new position;
- per length ``L``: ``read`` ``[max_rows, L]`` long, the slots attention reads (each row's pages in
  order, then the scratch page's), and ``mask`` ``[max_rows, 1, 1, L]`` bool, True at a row's
  positions (transformers passes a 4D mask to attention as it is).

On a GPU each buffer, FlexAttention's block-mask buffers too, is filled from a pinned host buffer of
its own, copied without blocking the host (:class:`~.staging.HostStaging`); the next step's fill waits
for the last step's copies (a CUDA event recorded after them) before it writes the pinned buffers again.

A pad row (``n < B``) writes and reads only the scratch page, a page of the pool that no holder gets,
and attends to its one slot; its logits are dropped. Nothing in the pass reads a host value, so on a
CUDA device each bucket's pass is captured once at start (:meth:`DecodeGraphs.capture`, the largest
first, every graph in one memory pool) and a step is a buffer copy and a replay. The pool must be
fixed (:class:`~..kv.paged.KVPool` ``fixed``): a graph reads the tensors it was captured over.

On a CPU the same static pass runs eagerly (nothing to capture: the engine's CPU default runs each
step at its own shape, :mod:`llava_sessions.engine.paged_batch`); tests run it there to show its greedy tokens equal ``model.generate``'s. On a
GPU, ``benchmarks/gpu.py`` checks replay against eager. Attention reads the rows' positions gathered
from the pages and padded to ``L`` (SDPA over a copy, as :class:`~..kv.paged.SlotsCache` does),
or, with ``paged_read`` ``flex``, the pool itself through FlexAttention's block mask
(:mod:`..kv.flex`: its buffers are overwritten with the others), a bucket then having one length,
the whole pool's. ``auto`` (a GPU's engine) reads buckets of fewer than :data:`FLEX_MIN_ROWS` rows
gathered and larger ones with FlexAttention: the gather was faster at one row, FlexAttention from 8
rows up (benchmarks/results/the-gpu-table.md).

References: PyTorch, "CUDA Graphs" (``torch.cuda.graph``, ``CUDAGraph.replay``, static inputs
overwritten with ``copy_``); nano-vllm ``engine/model_runner.py`` (buckets, capture largest first in
one pool), read, not copied.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

import torch

from ..fused import attention_on
from ..kv.flex import PAGED_FLEX_ATTENTION, PageBlocks
from ..kv.paged import KVPool, SlotsCache, page_slots
from ..kv.pages import PageTable, pages_for, release, truncate
from .graph_table import GraphTable
from .staging import HostStaging

if TYPE_CHECKING:
    from ..llava import LlavaModel

__all__ = ["FLEX_MIN_ROWS", "DecodeGraphs", "PagedRead", "batch_buckets", "length_buckets"]

#: How the static step's attention reads the pages: ``gather`` (each row's slots gathered, padded to
#: the bucket, SDPA under a mask), ``flex`` (FlexAttention over the pool through a block mask,
#: :mod:`..kv.flex`), or ``auto``: the gather for buckets of fewer than ``flex_rows`` rows, FlexAttention
#: from there (what a GPU's engine runs: :data:`FLEX_MIN_ROWS`).
PagedRead = Literal["gather", "flex", "auto"]

#: The smallest batch bucket ``auto`` reads with FlexAttention: below it the gather was faster, from it
#: up FlexAttention, by a margin that grew with the rows (benchmarks/results/the-gpu-table.md).
FLEX_MIN_ROWS = 8

log = logging.getLogger(__name__)

#: The shortest attended length a graph is captured for (positions).
MIN_GRAPH_LENGTH = 512


def batch_buckets(max_rows: int) -> list[int]:
    """Batch sizes a graph is captured for: 1, 2, 4, 8, then every 16 up to ``max_rows`` (and
    ``max_rows`` itself), ascending. ``max_rows`` below 1 gives none."""
    sizes = [b for b in (1, 2, 4, 8) if b <= max_rows] + list(range(16, max_rows + 1, 16))
    return sorted({*sizes, max_rows}) if max_rows >= 1 else []


def length_buckets(max_len: int, page_size: int) -> list[int]:
    """Attended lengths a graph is captured for, ascending: from 512 positions, each a quarter of the
    power of two at or below it longer (at least 128: 512, 640, 768, 896, 1024, 1280, ...), so a step's
    bucket is at most 25% longer than its longest row, then ``max_len``; each rounded up to whole pages
    of ``page_size``.

    Why not doubling: attention reads a bucket's whole length, gathered from the pages. A 32-row step
    at ~600 positions in the 1,024 bucket spent most of its time on that gather and the masked
    attention over it, not on the weights' read (benchmarks/results/the-gpu-table.md).
    """
    top = pages_for(max_len, page_size) * page_size
    sizes, length = [], MIN_GRAPH_LENGTH
    while length < top:
        sizes.append(pages_for(length, page_size) * page_size)
        length += max(128, (1 << (length.bit_length() - 1)) // 4)
    return sorted({*sizes, top})


def _smallest(sizes: Sequence[int], n: int) -> int | None:
    return next((s for s in sizes if s >= n), None)


class DecodeGraphs:
    """Decode steps of up to ``max_rows`` rows at static shapes over ``pool`` (module docstring).

    Args:
        model: the loaded model (:meth:`~..llava.LlavaModel.decode_batch` is the captured pass).
        pool: the replica's KV pool; one page of it becomes the scratch page (:attr:`table`).
        max_rows: the largest batch a step runs at static shapes (larger steps: the caller's eager path).
        max_len: the longest attended length, positions (the model's context).
        paged_read: how attention reads the pages (:data:`PagedRead`).
        flex_rows: with ``auto``, the smallest batch bucket read with FlexAttention.

    A bucket read with FlexAttention reads the whole pool whatever its rows' lengths, so it has one
    length, the longest (one graph per batch size); a gathered bucket has every length of
    :func:`length_buckets`.

    Attributes:
        paged_read: how its attention reads the pages; flex_rows: the smallest bucket read with
            FlexAttention (above every bucket with ``gather``).
        table: the scratch page, held for as long as the graphs live (a holder of the pool's, for
            :meth:`KVPool.check <.paged_kv.KVPool.check>`).
        steps: the pass's :class:`~.graph_table.GraphTable` by bucket: its ``num_replays``, ``num_eager``,
            ``replay`` switch (the check that replay gives the same tokens as the same pass run eagerly,
            ``benchmarks/gpu.py``) and ``mempool`` (:mod:`.prefill_graphs` captures into it too).
        num_prefills: chunks prefilled as a step's rows (:meth:`run_with_chunks`).

    Raises:
        torch.OutOfMemoryError: a fixed pool has no free page for the scratch page.
    """

    def __init__(
        self,
        model: LlavaModel,
        pool: KVPool,
        *,
        max_rows: int,
        max_len: int,
        paged_read: PagedRead = "gather",
        flex_rows: int = FLEX_MIN_ROWS,
    ) -> None:
        self.model, self.pool = model, pool
        self.rows = batch_buckets(max_rows)
        self.lengths = length_buckets(max_len, pool.page_size)
        self.paged_read = paged_read
        self.flex_rows = {"gather": max_rows + 1, "flex": 1, "auto": flex_rows}[paged_read]
        self.table = PageTable()
        pool.make_room(self.table, 1)
        self._scratch = self.table.pages[0]
        device, top = pool.pages.keys[0].device, self.rows[-1]
        self._ids = torch.zeros(top, 1, dtype=torch.long, device=device)
        self._positions = torch.zeros(top, 1, dtype=torch.long, device=device)
        self._write = torch.full((top,), self._scratch * pool.page_size, dtype=torch.long, device=device)
        self._read = {L: self._write[:, None].repeat(1, L) for L in self.lengths}
        self._mask = {L: torch.zeros(top, 1, 1, L, dtype=torch.bool, device=device) for L in self.lengths}
        for mask in self._mask.values():
            mask[:, 0, 0, 0] = True  # a pad row attends to its one scratch slot
        self._blocks = self._new_blocks() if self.flex_rows <= self.rows[-1] else None
        #: On a GPU, the host side of each buffer in pinned memory, copied without blocking the host.
        self._staging = HostStaging(device)
        self.steps: GraphTable[tuple[int, int]] = GraphTable(lambda key: self._pass(*key))
        self.num_prefills = 0

    def close(self) -> None:
        """Drop the graphs and give the scratch page back to the pool (the object is unusable after)."""
        self.steps.close()
        release(self.pool.pool, self.table)

    @property
    def buckets(self) -> list[tuple[int, int]]:
        """Every bucket ``(B, L)``, the largest first (the order of capture)."""
        return sorted(((b, L) for b in self.rows for L in self._lengths_of(b)), reverse=True)

    def bucket(self, num_rows: int, longest: int) -> tuple[int, int] | None:
        """The bucket ``(B, L)`` of a step of ``num_rows`` rows whose longest has ``longest``
        positions (its new one included); None when it is larger than every bucket."""
        rows = _smallest(self.rows, num_rows)
        length = None if rows is None else _smallest(self._lengths_of(rows), longest)
        return None if rows is None or length is None else (rows, length)

    def reads_flex(self, rows: int) -> bool:
        """Whether a bucket of ``rows`` rows reads the pages with FlexAttention (else gathered)."""
        return rows >= self.flex_rows

    def _lengths_of(self, rows: int) -> list[int]:
        return self.lengths[-1:] if self.reads_flex(rows) else self.lengths

    def capture(self) -> None:
        """Capture every bucket's pass as a CUDA graph, the largest first, all in one memory pool
        (each pass run once eagerly first, over the scratch page only).

        Raises:
            RuntimeError: not on a CUDA device, or the capture failed (the caller runs eagerly).
        """
        self.steps.capture(self.buckets, device=self.pool.pages.keys[0].device)
        log.info("captured %d decode graphs (rows %s x lengths %s)", self.steps.num_graphs, self.rows, self.lengths)

    def run(self, tables: Sequence[PageTable], token_ids: Sequence[int] | torch.Tensor) -> torch.Tensor | None:
        """One decode step of ``tables`` (each reserved for its new position, the last) fed
        ``token_ids``: replayed when its bucket was captured, else run at static shapes eagerly.
        ``token_ids`` may be a ``[len(tables)]`` long tensor on the device (the tokens the last step chose,
        which the host has not read: async scheduling), copied into the step's input there.

        Returns:
            Logits ``[len(tables), vocab]`` float32 (a tensor of the caller's), or None when the step
            is larger than every bucket (nothing written: the caller runs it its own way).
        """
        n = len(tables)
        lengths = [t.num_tokens for t in tables]
        key = self.bucket(n, max(lengths))
        if key is None:
            return None
        rows, length = key
        self._fill(tables, token_ids, rows, length)
        return self.steps(key)[:n]

    def prefill(self, table: PageTable, token_ids: Sequence[int]) -> torch.Tensor | None:
        """Prefill ``token_ids`` (text: no image placeholders) after ``table``'s positions as the rows of
        one static step (:meth:`run_with_chunks` with no decode rows).

        Why: an eager prefill of a follow-up question (~40 tokens) launches ~1,400 kernels: it is
        launch-bound, several times the weights' read (benchmarks/results/the-gpu-table.md).

        Returns:
            Logits ``[vocab]`` float32 of the last position, ``table`` extended by ``len(token_ids)``
            positions; None when no bucket holds the rows (nothing reserved or written: the caller
            prefills its own way).

        Raises:
            torch.OutOfMemoryError: a fixed pool has too few free pages (``table`` unchanged).
        """
        done = self.run_with_chunks([], [], [(table, token_ids)])
        return None if done is None else done[1][0]

    def run_with_chunks(
        self, tables: Sequence[PageTable], token_ids: Sequence[int], chunks: Sequence[tuple[PageTable, Sequence[int]]]
    ) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
        """One static step of decode rows (``tables``, each reserved for its new position, fed
        ``token_ids``, as :meth:`run`) and of each chunk's tokens (text: no image placeholders) after its
        table's positions, as rows: row ``i`` of a chunk feeds its ``i``-th token at position ``start + i``
        and attends to the table's first ``start + i + 1`` positions. Every row writes its slot before any
        row reads (each layer writes the step's keys and values, then attends), so a chunk's rows see each
        other's positions as a causal prefill does, and nothing of another row's table. Several sessions'
        questions thus prefill in one replay beside the running answers' decode step (vLLM's mixed batch
        of decode and prefill tokens), where each alone would be a pass of its own.

        Returns:
            ``(logits [len(tables), vocab] of the decode rows, [logits [vocab] of each chunk's last
            position])``, float32, each chunk's table extended by its tokens; None when a chunk is empty
            or no bucket holds every row (nothing reserved or written: the caller runs them its own way).

        Raises:
            torch.OutOfMemoryError: a fixed pool has too few free pages. On any failure every chunk's
                table is as before the call (the decode rows' are the caller's).
        """
        sizes, size = [len(ids) for _, ids in chunks], self.pool.page_size
        starts = [t.num_tokens for t, _ in chunks]
        longest = max([t.num_tokens for t in tables] + [s + n for s, n in zip(starts, sizes, strict=True)])
        if not all(sizes) or self.bucket(len(tables) + sum(sizes), longest) is None:
            return None
        rows, ids = list(tables), list(token_ids)
        try:
            for (table, chunk), start in zip(chunks, starts, strict=True):
                self.pool.make_room(table, len(chunk))
                rows += [
                    PageTable(table.pages[: pages_for(start + i + 1, size)], start + i + 1) for i in range(len(chunk))
                ]
                ids += chunk
            logits = self.run(rows, ids)
        except BaseException:
            for (table, _), start in zip(chunks, starts, strict=True):
                truncate(self.pool.pool, table, start)  # a failed pass leaves its positions behind: take them back
            raise
        assert logits is not None  # the bucket holds the rows
        self.num_prefills += len(chunks)
        ends = [len(tables) + n for n in itertools.accumulate(sizes)]
        return logits[: len(tables)], [logits[end - 1] for end in ends]

    def _fill(
        self, tables: Sequence[PageTable], token_ids: Sequence[int] | torch.Tensor, rows: int, length: int
    ) -> None:
        """Overwrite the buffers' first ``rows`` rows: the tables' rows, then pad rows on the scratch page
        (a pad row's id is left as it is when ``token_ids`` is on the device: any id serves a dropped row)."""
        size, n = self.pool.page_size, len(tables)
        pages = [t.pages for t in tables] + [[self._scratch]] * (rows - n)  # a pad row: the scratch page
        counts = [t.num_tokens for t in tables] + [1] * (rows - n)  # a pad row attends to its one slot
        lengths = torch.tensor(counts, dtype=torch.long)
        staging = self._staging
        staging.begin()  # the last step's copies read the pinned buffers: done before they are written
        if isinstance(token_ids, torch.Tensor):  # on the device: copied there, behind the step that chose them
            self._ids[:n, 0].copy_(token_ids)
        else:
            ids = torch.zeros(rows, 1, dtype=torch.long)
            ids[:n, 0] = torch.tensor(list(token_ids))
            staging.upload("ids", self._ids[:rows], ids)
        staging.upload("positions", self._positions[:rows], (lengths - 1)[:, None])
        last = [p[(c - 1) // size] * size + (c - 1) % size for p, c in zip(pages, counts, strict=True)]
        staging.upload("write", self._write[:rows], torch.tensor(last, dtype=torch.long))
        if not self.reads_flex(rows):  # the gather's read slots and mask
            slots = page_slots(pages, size, width=length // size, pad=self._scratch)
            staging.upload(("read", length), self._read[length][:rows], slots)
            mask = torch.arange(length)[None, :] < lengths[:, None]
            staging.upload(("mask", length), self._mask[length][:rows, 0, 0], mask)
        else:
            assert self._blocks is not None  # a flex bucket exists, so its buffers do
            if self._blocks.num_pages != self.pool.pages.num_pages:  # a CPU pool grew (a GPU's is fixed)
                self._blocks = self._new_blocks()
            self._blocks.fill(pages, counts, staging)
        staging.end()

    def _new_blocks(self) -> PageBlocks:
        pages, top = self.pool.pages, self.rows[-1]
        blocks = PageBlocks(top, pages.num_pages, pages.page_size, pages.keys[0].device)
        blocks.fill([[self._scratch]] * top, [1] * top)  # every row a pad row, as the other buffers start
        return blocks

    def _pass(self, rows: int, length: int) -> torch.Tensor:
        """The static pass of bucket ``(rows, length)`` over the buffers: logits ``[rows, vocab]`` float32."""
        ids, positions = self._ids[:rows], self._positions[:rows]
        if self.reads_flex(rows):  # FlexAttention over the pool's pages (the read slots only size the cache)
            assert self._blocks is not None
            cache = SlotsCache(self.pool.pages, self._write[:rows], self._read[length][:rows], whole_pool=True)
            with attention_on(self.model.config.text_config, PAGED_FLEX_ATTENTION):
                return self.model.decode_batch(cache, ids, positions, self._blocks.mask(rows))
        cache = SlotsCache(self.pool.pages, self._write[:rows], self._read[length][:rows])
        return self.model.decode_batch(cache, ids, positions, self._mask[length][:rows])
