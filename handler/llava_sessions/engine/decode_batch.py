"""The decode batch: the running answers of one worker as rows of one left-padded, preallocated KV cache.

Layout (:class:`~llava_sessions.model.kv.cache.BatchKVCache`, per decoder layer): keys and values
``[B, kv_heads, capacity, head_dim]``. Every row writes its next token at the same column
(``length``); a row's sequence ends at that column and starts wherever its own length puts it (left
padding). ``mask [B, capacity]`` (long, 1 = a valid position of that row) carries the padding, the
holes of rows that sat out a step (a job TorchServe did not bring back in a call) and the rows that left.

Costs. A decode step writes one column per layer in place and copies no KV. Building the batch
copies each member's KV once (when the scheduler says so: ``scheduler.needs_rebuild``). A leaving
row's valid columns are gathered into a ``DynamicCache`` for its session (one copy of that session).
Memory: ``B × capacity × kv_bytes_per_token``; the overhead over the rows' own KV is the padding
(longest minus each row's length) plus at most ``grow_columns`` free columns per row. A row's
session keeps its own copy of the KV the row was loaded from (read back only the answer's positions
when it leaves), until room runs out (:meth:`DecodeBatch.unlend`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ..model import BatchKVCache, LlavaModel, cache_len
from .memory import oom_attempts
from .scheduler import BatchLayout

if TYPE_CHECKING:
    from ..sessions.session import Session
    from ..sessions.store import SessionStore
    from .sequence import Sequence

__all__ = ["DecodeBatch"]


class DecodeBatch:
    """The decode batch's KV layout and its one forward pass per step.

    Args:
        model: the loaded model (allocates the cache, runs the batched forward).
        store: the session store (the batch's bytes count against the device budget).
        new_cache: an empty session cache, which a leaving row's KV goes into (default the model's
            ``DynamicCache``; the engine's is in its KV pool).
        grow_columns: free columns allocated past the longest row at each build.
    """

    def __init__(
        self,
        model: LlavaModel,
        store: SessionStore,
        new_cache: Callable[[], Any] | None = None,
        *,
        grow_columns: int = 64,
    ) -> None:
        self.model = model
        self.store = store
        self.new_cache = new_cache or model.new_cache
        self.grow_columns = grow_columns
        self.cache: BatchKVCache | None = None
        self.mask: torch.Tensor | None = None
        self.rows: list[Sequence | None] = []
        self.num_builds = 0  # how many times the batch was (re)built (a copy of every member's KV)

    @property
    def num_live(self) -> int:
        """Rows that belong to a running answer."""
        return sum(g is not None for g in self.rows)

    def layout(self) -> BatchLayout:
        """The batch's shape, for the scheduler."""
        cache, per_token = self.cache, self.model.kv_bytes_per_token
        if cache is None:
            return BatchLayout(grow_columns=self.grow_columns, kv_bytes_per_token=per_token)
        longest = max((g.next_position for g in self.rows if g is not None), default=0)  # a row's KV tokens
        return BatchLayout(
            len(self.rows), self.num_live, cache.length, cache.capacity, longest, self.grow_columns, per_token
        )

    def forward(self, seqs: list[Sequence], *, rebuild: bool) -> torch.Tensor:
        """Run one decode step for ``seqs`` (each prefilled) in one forward pass, after laying the
        batch out anew when ``rebuild`` (the answers without a row join then).

        Rows of the batch not in ``seqs`` sit this step out (their new column is masked).

        Returns:
            Logits ``[B, vocab]`` float32, indexed by each generation's ``row``.

        Raises:
            ServiceError: overloaded (out of memory twice).
            Exception: the forward pass failed (the batch is left as before the step).
        """
        tokens, positions, col = self._inputs(seqs, rebuild)
        cache, mask = self.cache, self.mask
        assert cache is not None and mask is not None
        try:
            for attempt in oom_attempts(self.store, keep=None):
                with attempt:
                    try:
                        logits = self.model.decode_batch(cache, tokens, positions, mask[:, : col + 1])
                    except BaseException:
                        cache.set_length(col)  # a failed pass leaves no column behind: a retry runs it again
                        raise
        except BaseException:
            mask[:, col] = 0
            raise
        return logits

    def forward_with_chunk(
        self, seqs: list[Sequence], *, rebuild: bool, session: Session, ids: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward`, with the prefill of ``ids`` beyond ``session``'s KV cache in the same
        forward pass (:meth:`LlavaModel.fused_step <llava_sessions.model.LlavaModel.fused_step>`).

        Returns:
            ``(logits [B, vocab], logits [vocab])`` float32: the rows' (by ``row``), the chunk's last
            position's.

        Raises:
            ServiceError: overloaded (as :meth:`forward`). Exception: the forward pass failed (the
            batch and the session's cache are left as before the step).
        """
        tokens, positions, col = self._inputs(seqs, rebuild)
        cache, mask = self.cache, self.mask
        assert cache is not None and mask is not None
        try:
            for attempt in oom_attempts(self.store, keep=session):
                with attempt:
                    try:
                        out = self.model.fused_step(
                            cache, tokens, positions, mask[:, : col + 1], session.kv_cache, ids, session.image_features
                        )
                    except BaseException:
                        cache.set_length(col)
                        raise
        except BaseException:
            mask[:, col] = 0
            raise
        return out

    def _inputs(self, seqs: list[Sequence], rebuild: bool) -> tuple[list[int], list[int], int]:
        """Lay the batch out anew when ``rebuild``, open the next column to ``seqs``' rows; returns
        every row's input token and position (0 for a row that sits out) and that column."""
        if rebuild:
            self._build([g for g in seqs if g.row is None])
        cache, mask = self.cache, self.mask
        assert cache is not None and mask is not None
        col = cache.length
        tokens = [0] * len(self.rows)
        positions = [0] * len(self.rows)
        for g in seqs:
            assert g.row is not None, "an answer without a row decodes only after a rebuild"
            tokens[g.row] = g.events[-1].id
            positions[g.row] = g.next_position
            mask[g.row, col] = 1
        return tokens, positions, col

    def release(self, seq: Sequence) -> Any:
        """Take ``seq`` out of the batch; returns its session's cache with the row's positions past
        it appended (the answer's, ``[1, kv_heads, n, head_dim]`` per layer: the prompt's were lent
        and never changed), or, when the session holds none, a new one (``new_cache``'s) with every
        position; None when it had no row.

        Raises:
            torch.OutOfMemoryError: no room for the positions (the row stays in the batch).
        """
        row = seq.row
        if row is None:
            return None
        assert self.cache is not None and self.mask is not None
        columns = torch.nonzero(self.mask[row, : self.cache.length]).flatten()
        into = seq.session.kv_cache
        if into is None:
            into = self.new_cache()
        new = columns[cache_len(into) :]
        kv = self.cache.extract_row(row, new, into) if new.numel() else into  # may fail: the row stays
        seq.row = None
        self.rows[row] = None
        if self.num_live == 0:
            self._free()
        return kv

    def drop(self, seq: Sequence) -> None:
        """Take ``seq`` out of the batch without reading its row back (it is preempted: its KV is
        recomputed when it resumes); the row's columns stay until the next rebuild."""
        if seq.row is None:
            return
        self.rows[seq.row] = None
        seq.row = None
        if self.num_live == 0:
            self._free()

    def unlend(self) -> bool:
        """Free the sessions' own copies of the KV their rows hold (:meth:`Session.lend_kv
        <llava_sessions.sessions.session.Session.lend_kv>`), for room when none is left: a row holds
        every position of its answer's conversation, which :meth:`release` then reads back whole.
        Returns whether any copy was freed."""
        lent = [g.session for g in self.rows if g is not None and g.session.kv_lent and g.session.kv_cache is not None]
        for session in lent:
            session.drop_kv()
        return bool(lent)

    def bytes_without(self, seqs: list[Sequence], leaving: list[Sequence]) -> int:
        """Device bytes of the batch laid out anew for its live rows and ``seqs`` (the joining ones),
        all but ``leaving``: ``rows x (longest row + grow_columns) x kv_bytes_per_token`` (scheduler
        rule 10's arithmetic)."""
        gone = {id(g) for g in leaving}
        rows = [g for g in self.rows if g is not None] + [g for g in seqs if g.row is None]
        rows = [g for g in rows if id(g) not in gone]
        if not rows:
            return 0
        width = max(g.next_position for g in rows)
        return len(rows) * (width + self.grow_columns) * self.model.kv_bytes_per_token

    def _build(self, joining: list[Sequence]) -> None:
        """Lay out the live rows and ``joining`` (whose KV their sessions lend) anew, in the device
        memory the step's plan made room for (:attr:`~.scheduler.StepPlan.batch_bytes`)."""
        members = [g for g in self.rows if g is not None] + joining
        old, old_mask = self.cache, self.mask
        old_columns: list[torch.Tensor | None] = []
        lengths: list[int] = []
        for g in members:
            if g.row is not None:
                assert old is not None and old_mask is not None
                cols = torch.nonzero(old_mask[g.row, : old.length]).flatten()
                old_columns.append(cols)
                lengths.append(int(cols.numel()))
            else:
                old_columns.append(None)
                lengths.append(cache_len(g.session.kv_cache))
        width = max(lengths)  # room for the new layout was made with the step's plan (scheduler rule 10)
        for attempt in oom_attempts(self.store, keep=None):
            with attempt:
                cache = self.model.new_batch_cache(len(members), width + self.grow_columns)
        mask = torch.zeros(len(members), cache.capacity, dtype=torch.long, device=self.model.device)
        for row, (g, src_cols, n) in enumerate(zip(members, old_columns, lengths, strict=True)):
            if src_cols is not None:
                assert old is not None and g.row is not None
                for dst, src in zip(cache.batch_layers, old.batch_layers, strict=True):
                    dst.keys[row, :, width - n : width] = src.keys[g.row].index_select(1, src_cols)
                    dst.values[row, :, width - n : width] = src.values[g.row].index_select(1, src_cols)
            else:
                cache.load_row(row, g.session.kv_cache, width)
                g.session.lend_kv()  # the row holds a copy (the session is busy: never demoted)
            cache.zero_leading(row, width - n)
            mask[row, width - n : width] = 1
        cache.set_length(width)
        for row, g in enumerate(members):
            g.row = row
        self.cache, self.mask, self.rows = cache, mask, list(members)
        self.store.batch_bytes = cache.nbytes()
        self.num_builds += 1

    def _free(self) -> None:
        self.cache = None
        self.mask = None
        self.rows = []
        self.store.batch_bytes = 0
