"""Decode attention over the KV pool read as runs of consecutive pages: each run one view of the pool.

A decode step's rows read their positions from their pages. Gathered (:meth:`.paged.KVPages.gather`),
every layer copies each row's keys and values into a padded batch before SDPA reads them again, about
three times the bytes attention needs; on a CPU that copy, not the arithmetic, is most of the step
(docs/decisions/19-the-kv-pool-in-pages.md). The pool keeps each holder's pages in few runs of
consecutive pages (:class:`.pages.PagePool`: a growing holder takes the page after its last), and a run
of pages is a run of slots, so it is a strided view of a layer's ``[slots, kv_heads, head_dim]``
tensor: no copy. Here each row's attention is, per kv head, its query heads' scores against each run
(``q @ k^T``, ``[kv_heads, group, run]``), the scores of its runs side by side, one softmax over all of
them in float32, then the probabilities times each run's values, summed: the same softmax(q k^T) v as
SDPA over the gathered positions, within float rounding. A decode row has one query, so its scores
are one row per head, and nothing needs a mask: a row reads exactly its own positions.

The attention function is registered with transformers' ``AttentionInterface`` as
:data:`PAGED_RUNS_ATTENTION`; within :func:`reading_runs` and with that implementation on, a pass reads
the rows' runs (:func:`table_runs`), while :class:`~.paged.SlotsCache` hands each layer's whole pool as the keys and
values (``whole_pool``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from typing import Any

import torch
from transformers import AttentionInterface

__all__ = [
    "MIN_SHARED_POSITIONS",
    "PAGED_RUNS_ATTENTION",
    "Runs",
    "attend_runs",
    "paged_runs_attention",
    "reading_runs",
    "shared_groups",
    "shared_prefix",
    "skip_positions",
    "table_runs",
]

#: The attention implementation's name while a decode step reads its rows' runs.
PAGED_RUNS_ATTENTION = "llava_paged_runs"

#: Each row's runs as slot ranges ``[(start, stop), ...]`` of the pool, in position order.
Runs = list[list[tuple[int, int]]]

_RUNS: ContextVar[Runs | None] = ContextVar("llava_paged_runs", default=None)


def table_runs(pages: Sequence[int], num_tokens: int, page_size: int) -> list[tuple[int, int]]:
    """The slot ranges ``[start, stop)`` holding a table's first ``num_tokens`` positions, one per run
    of consecutive pages in ``pages`` (a table's pages in position order), in position order.

    Raises:
        IndexError: ``num_tokens`` is more than ``pages`` hold.
    """
    if num_tokens > len(pages) * page_size:
        raise IndexError(f"{num_tokens} positions in {len(pages)} pages of {page_size}")
    runs: list[tuple[int, int]] = []
    left = num_tokens
    i = 0
    while left > 0:
        j = i + 1
        while j < len(pages) and pages[j] == pages[j - 1] + 1:
            j += 1
        start = pages[i] * page_size
        n = min((j - i) * page_size, left)
        runs.append((start, start + n))
        left -= n
        i = j
    return runs


@contextlib.contextmanager
def reading_runs(runs: Runs) -> Iterator[None]:
    """Within the block, :func:`paged_runs_attention` reads ``runs`` (one list per row of the pass);
    the caller turns the attention implementation on (``fused.attention_on(..., PAGED_RUNS_ATTENTION)``)."""
    token = _RUNS.set(runs)
    try:
        yield
    finally:
        _RUNS.reset(token)


def paged_runs_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """One decode step's attention over the rows' runs set by :func:`reading_runs` (transformers'
    attention-function signature; ``attention_mask`` unused): :func:`attend_runs`.

    Raises:
        RuntimeError: called outside :func:`reading_runs`.
    """
    runs = _RUNS.get()
    if runs is None:
        raise RuntimeError("paged runs attention reads the rows' runs set by reading_runs()")
    return attend_runs(query, key, value, runs, scaling), None


def attend_runs(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, runs: Runs, scaling: float | None = None
) -> torch.Tensor:
    """Each row's attention over its runs of the pool (module docstring). Rows that read their first
    positions from the same slots (the ``n`` samples of one prompt: forks share its pages) read those
    shared positions once for all of them (:func:`shared_groups`): their queries are stacked and each
    shared run is multiplied once, as vLLM's cascade attention and FlashInfer's shared-prefix batch
    decoding do on a GPU; each row's own positions are then read as before.

    Args:
        query: ``[B, heads, 1, head_dim]``, one query per row.
        key, value: a layer's whole pool ``[1, kv_heads, slots, head_dim]`` (views).
        runs: each row's slot ranges (:func:`table_runs`), ``B`` lists.
        scaling: the softmax scale (the model's; default ``head_dim ** -0.5``).

    Returns:
        ``[B, 1, heads, head_dim]``: the output as transformers' attention functions give it.

    Raises:
        RuntimeError: more than one query per row, or not one list of runs per row.
    """
    rows, heads, queries, dim = query.shape
    if queries != 1 or len(runs) != rows:
        raise RuntimeError(f"runs attention reads one query per row: {queries} for {len(runs)} runs of {rows}")
    keys, values = key[0], value[0]  # [kv_heads, slots, head_dim]
    kv_heads = keys.shape[0]
    scale = dim**-0.5 if scaling is None else scaling
    out = query.new_empty(rows, 1, heads, dim)
    q_all = query[:, :, 0].reshape(rows, kv_heads, heads // kv_heads, dim) * scale  # [B, kv_heads, group, dim]
    group_size = heads // kv_heads
    for members, shared in shared_groups(runs):
        length = sum(b - a for a, b in shared)
        common: tuple[torch.Tensor, ...] = ()
        if shared:  # the members' queries stacked, each shared run read once: [kv_heads, R x group, positions]
            stacked = q_all[members].transpose(0, 1).reshape(kv_heads, -1, dim)
            scores = torch.cat([stacked @ keys[:, a:b].transpose(1, 2) for a, b in shared], dim=-1)
            common = scores.split(group_size, dim=1)
        probs_shared = []
        for k, r in enumerate(members):
            own = skip_positions(runs[r], length)
            parts = [common[k]] if shared else []
            parts += [q_all[r] @ keys[:, a:b].transpose(1, 2) for a, b in own]
            probs = torch.cat(parts, dim=-1).float().softmax(-1).to(query.dtype)  # [kv_heads, group, positions]
            probs_shared.append(probs[..., :length])
            total = _weighted(probs[..., length:], values, own)
            out[r, 0] = (total if total is not None else torch.zeros_like(q_all[r])).reshape(heads, dim)
        if shared:
            joint = _weighted(torch.cat(probs_shared, dim=1), values, shared)  # [kv_heads, R x group, dim]
            assert joint is not None
            for k, part in enumerate(joint.split(group_size, dim=1)):
                out[members[k], 0] += part.reshape(heads, dim)
    return out


def _weighted(probs: torch.Tensor, values: torch.Tensor, spans: Sequence[tuple[int, int]]) -> torch.Tensor | None:
    """``probs [kv_heads, rows, positions]`` times the values of ``spans`` (their positions in order),
    summed over the spans: ``[kv_heads, rows, head_dim]``, None without spans."""
    total, offset = None, 0
    for a, b in spans:
        part = probs[..., offset : offset + b - a] @ values[:, a:b]
        total = part if total is None else total + part
        offset += b - a
    return total


#: Positions rows must share before they read them together (a shorter common prefix costs more in
#: the stacking than reading it once saves).
MIN_SHARED_POSITIONS = 64


def shared_prefix(a: Sequence[tuple[int, int]], b: Sequence[tuple[int, int]]) -> int:
    """How many first positions two rows' runs read from the same slots."""
    n = 0
    for (a0, a1), (b0, b1) in zip(a, b, strict=False):
        if a0 != b0:
            break
        n += min(a1, b1) - a0
        if a1 != b1:
            break
    return n


def skip_positions(spans: Sequence[tuple[int, int]], num: int) -> list[tuple[int, int]]:
    """``spans`` without their first ``num`` positions."""
    out = []
    for a, b in spans:
        if num >= b - a:
            num -= b - a
            continue
        out.append((a + num, b))
        num = 0
    return out


def shared_groups(runs: Runs) -> list[tuple[list[int], list[tuple[int, int]]]]:
    """The rows of ``runs`` grouped by a common first stretch of slots: ``(rows, shared spans)`` per
    group, every row in one group. A group is a row and every row that shares at least
    :data:`MIN_SHARED_POSITIONS` first positions with it (the shortest such share is the group's); a
    row that shares less with all is a group of its own with no shared spans (it reads its runs alone).
    """
    by_first: dict[int, list[int]] = {}
    for r, spans in enumerate(runs):
        by_first.setdefault(spans[0][0] if spans else -1 - r, []).append(r)
    groups: list[tuple[list[int], list[tuple[int, int]]]] = []
    for bucket in by_first.values():
        while bucket:  # the first row and every row sharing enough of it; the rest try again
            leader, rest = bucket[0], bucket[1:]
            shares = {r: shared_prefix(runs[leader], runs[r]) for r in rest}
            partners = [r for r in rest if shares[r] >= MIN_SHARED_POSITIONS]
            if partners:
                length = min(shares[r] for r in partners)
                groups.append(([leader, *partners], _take_positions(runs[leader], length)))
            else:
                groups.append(([leader], []))
            bucket = [r for r in rest if r not in partners]
    return groups


def _take_positions(spans: Sequence[tuple[int, int]], num: int) -> list[tuple[int, int]]:
    """The first ``num`` positions of ``spans``, as spans."""
    out = []
    for a, b in spans:
        if num <= 0:
            break
        out.append((a, min(b, a + num)))
        num -= min(b, a + num) - a
    return out


AttentionInterface.register(PAGED_RUNS_ATTENTION, paged_runs_attention)
