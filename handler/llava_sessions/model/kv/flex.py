"""Decode attention straight over the KV pool's pages with FlexAttention (no gather, no padding).

The static decode step (:mod:`.graphs`) reads each row's positions gathered from its pages and padded
to its length bucket; a 32-row step at ~600 positions spent most of its time on that gather and the
masked attention over the padding (benchmarks/results/the-gpu-table.md). FlexAttention
(PyTorch's ``torch.nn.attention.flex_attention``, compiled on a CUDA device) reads the pool itself:

- the keys and values are a layer's whole pool, ``[1, kv_heads, pages x page_size, head_dim]``,
  broadcast over the rows (no copy);
- a :class:`~torch.nn.attention.flex_attention.BlockMask` whose kv blocks are pages
  (``BLOCK_SIZE`` ``(128, page_size)``; one query per row fits one query block): each row's whole
  pages are *full* blocks (read without a mask), and a partial last page is the one block whose
  ``mask_mod`` keeps the row's first ``rem`` positions in it, so a page's free tail is never read
  (without the bound the free tail's stale values enter the softmax); the mask function holds on every
  position too, as FlexAttention's unfused path (a CPU) applies it everywhere;
- the block mask's tensors are persistent buffers (:class:`PageBlocks`) overwritten before each step,
  so a CUDA graph captured over them replays any step of its bucket.

A shared page (a prefix two sessions hold) is read by both rows through their own block lists; the
mask depends only on the row and the position within the page. :func:`paged_flex_attention` is
registered with transformers' ``AttentionInterface`` as :data:`PAGED_FLEX_ATTENTION`; the static
pass runs the model with it and hands the block mask as the attention mask (transformers passes a 4D
mask, a ``BlockMask`` included, to attention as it is).

Reading the pages this way was faster than the gather from 8 rows up, and more so the more rows; at
one row the gather was faster (benchmarks/results/the-gpu-table.md). So a
GPU's engine reads buckets of :data:`~.graphs.FLEX_MIN_ROWS` rows and more this way (``paged_read``
``auto``), smaller ones gathered.

References: PyTorch, "FlexAttention" (``BlockMask.from_kv_blocks``, ``mask_mod``, full blocks),
and its paged-attention example (``torch.nn.attention.experimental._paged_attention``), read, not copied.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from transformers import AttentionInterface

if TYPE_CHECKING:
    from ..gpu.staging import HostStaging

__all__ = ["PAGED_FLEX_ATTENTION", "PageBlocks", "paged_flex_attention"]

#: The attention implementation's name while the static step reads pages with FlexAttention.
PAGED_FLEX_ATTENTION = "llava_paged_flex"
#: Query rows of one block (FlexAttention's; a decode row has one query, so one block holds it).
Q_BLOCK = 128

_compiled: dict[str, Any] = {}


#: Shapes FlexAttention may be compiled for in one process (one per batch bucket read with it, and the
#: kernel table's): torch's default recompile limit is 8.
RECOMPILE_LIMIT = 64


def _flex(device: torch.device) -> Any:
    """FlexAttention compiled on a CUDA device (its fused kernel), eager elsewhere (the tests).

    Compiled at static shapes, one kernel per batch size: compiled with dynamic shapes (what
    ``torch.compile`` turns to at a second batch size), inductor's kernel refused the pool's blocks on
    a GPU ("Q and KV block size must be divisible by BLOCK_M and BLOCK_N", KV blocks of 16
    positions); at static shapes, as ``benchmarks/paged_attention.py``
    compiles it, the same blocks compiled and ran there.
    """
    if device.type != "cuda":
        return flex_attention
    if "cuda" not in _compiled:
        dynamo = torch._dynamo.config
        dynamo.recompile_limit = max(dynamo.recompile_limit, RECOMPILE_LIMIT)
        _compiled["cuda"] = torch.compile(flex_attention, dynamic=False)
    return _compiled["cuda"]


def paged_flex_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """One decode step's attention over the pool (transformers' attention-function signature).

    Args:
        query: ``[B, heads, 1, head_dim]``, one query per row.
        key, value: a layer's whole pool ``[1, kv_heads, slots, head_dim]`` (what
            :class:`~.paged.SlotsCache` returns with ``whole_pool``).
        attention_mask: the rows' :class:`BlockMask` over the pool (:meth:`PageBlocks.mask`).
        scaling: the softmax scale (the model's).

    Returns:
        ``([B, 1, heads, head_dim], None)``: the output as transformers' attention functions give it.
    """
    rows = query.shape[0]
    out = _flex(query.device)(
        query,
        key.expand(rows, -1, -1, -1),
        value.expand(rows, -1, -1, -1),
        block_mask=attention_mask,
        scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1],
    )
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(PAGED_FLEX_ATTENTION, paged_flex_attention)


class PageBlocks:
    """The block-mask buffers of up to ``max_rows`` rows over a pool of ``num_pages`` pages.

    Args:
        max_rows: the most rows of a step.
        num_pages, page_size: the pool's (its pages are the kv blocks; a fixed pool on a GPU).
        device: the pool's.

    The buffers (int32 where FlexAttention reads them): ``partial`` ``[rows, 1, 1]`` (1 when a row's
    last page is partial), ``partial_pages`` ``[rows, 1, 1, num_pages]`` (that page first), ``whole``
    ``[rows, 1, 1]`` and ``whole_pages`` ``[rows, 1, 1, num_pages]`` (the row's whole pages in order);
    for the mask function, ``owned`` ``[rows, num_pages + 1]`` bool (True at a row's whole pages; the last
    column, no page, takes the table's padding), ``last``
    ``[rows]`` (its partial page, or -1) and ``rem`` ``[rows]`` (its positions in that page). The fused
    kernel calls the mask function on partial blocks only; the unfused one (a CPU) on every position,
    so it must hold everywhere: a position is read when its page is one of the row's whole pages, or
    is the row's partial page and the position is within the row's length.
    """

    def __init__(self, max_rows: int, num_pages: int, page_size: int, device: torch.device) -> None:
        self.num_pages, self.page_size = num_pages, page_size
        i32, i64 = torch.int32, torch.long
        self.partial = torch.zeros(max_rows, 1, 1, dtype=i32, device=device)
        self.partial_pages = torch.zeros(max_rows, 1, 1, num_pages, dtype=i32, device=device)
        self.whole = torch.zeros(max_rows, 1, 1, dtype=i32, device=device)
        self.whole_pages = torch.zeros(max_rows, 1, 1, num_pages, dtype=i32, device=device)
        self.owned = torch.zeros(max_rows, num_pages + 1, dtype=torch.bool, device=device)  # + a padding column
        self._table = torch.zeros(max_rows * num_pages, dtype=i32, device=device)  # the rows' whole pages, as sent
        self._values = torch.zeros(max_rows, 5, dtype=i64, device=device)  # the rows' other values, as sent
        self.last = torch.full((max_rows,), -1, dtype=i64, device=device)
        self.rem = torch.zeros(max_rows, dtype=i64, device=device)
        self._masks: dict[int, BlockMask] = {}

    def fill(self, pages: Sequence[Sequence[int]], lengths: Sequence[int], staging: HostStaging | None = None) -> None:
        """Overwrite the first ``len(pages)`` rows: row ``r`` reads the first ``lengths[r]`` positions of
        its ``pages[r]`` (a pad row: one page, length 1). The host values go up in two copies, through
        ``staging`` when given (a GPU's pinned buffers, not blocking the host; the caller begins and
        ends the step's copies), and ``owned`` is set on the device from them."""
        size, rows = self.page_size, len(pages)
        whole = [n // size for n in lengths]
        width = max(1, *whole)
        table = torch.full((rows, width), self.num_pages, dtype=torch.int32)  # past a row's whole pages: none
        for r, (p, w) in enumerate(zip(pages, whole, strict=True)):
            table[r, :w] = torch.tensor(p[:w], dtype=torch.int32)
        rem = [n - w * size for n, w in zip(lengths, whole, strict=True)]
        last = [p[w] if n else -1 for p, w, n in zip(pages, whole, rem, strict=True)]
        # per row: whole pages, partial page (0 if none), whether it has one, that page (-1 if none), its positions
        values = torch.tensor(
            [[w, max(q, 0), int(n > 0), q, n] for w, q, n in zip(whole, last, rem, strict=True)], dtype=torch.long
        )
        upload = staging.upload if staging is not None else (lambda _name, dst, src: dst.copy_(src))
        tables, values_on = self._table[: rows * width].view(rows, width), self._values[:rows]  # contiguous
        upload("flex table", tables, table)
        upload("flex rows", values_on, values)
        self.whole_pages[:rows, 0, 0, :width].copy_(tables.masked_fill(tables == self.num_pages, 0))
        self.whole[:rows, 0, 0].copy_(values_on[:, 0])
        self.partial_pages[:rows, 0, 0, 0].copy_(values_on[:, 1])
        self.partial[:rows, 0, 0].copy_(values_on[:, 2])
        self.last[:rows].copy_(values_on[:, 3])
        self.rem[:rows].copy_(values_on[:, 4])
        self.owned[:rows].zero_()
        self.owned[:rows].scatter_(1, tables.long(), True)  # the column past the pages takes the padding

    def mask(self, rows: int) -> BlockMask:
        """The block mask of the first ``rows`` rows, over the buffers themselves (built once per row
        count: a step overwrites the buffers, not the mask)."""
        if rows not in self._masks:
            owned, last, rem, size = self.owned, self.last, self.rem, self.page_size

            def read(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
                page = kv_idx // size
                return owned[b, page] | ((page == last[b]) & (kv_idx % size < rem[b]))

            self._masks[rows] = BlockMask.from_kv_blocks(
                self.partial[:rows],
                self.partial_pages[:rows],
                self.whole[:rows],
                self.whole_pages[:rows],
                BLOCK_SIZE=(Q_BLOCK, size),
                mask_mod=read,
                seq_lengths=(1, self.num_pages * size),
            )
        return self._masks[rows]
