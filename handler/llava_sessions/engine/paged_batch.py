"""The decode batch over the replica's KV pool: each running answer decodes straight into its session's pages.

A row is a running answer; its session's KV cache is a :class:`~llava_sessions.model.SessionKV`. A
decode step reserves one position in each decoding row's page table (a new page every ``page_size``
tokens; a shared, partly written last page is copied first, as any write to it is), runs one forward
pass over the rows' tables (:class:`~llava_sessions.model.kv.paged.SlotsCache`: each row's token
written to its slot) and records the fed tokens in each session (:meth:`Session.record_decode
<llava_sessions.sessions.session.Session.record_decode>`), so the ledger books the pages a row holds
as they are taken, and a finished answer's session already holds its turn.

How a step runs is not decided here: the batch hands each step (its rows, and a chunk beside them) to
the runner's :class:`~.runners.StepRunners`, which chooses the static step (a CUDA graph replayed on a
GPU) or an eager pass.

Costs. Joining, leaving and compaction copy no KV (a row is a place in :attr:`PagedDecodeBatch.rows`);
a step writes one position per row and layer. Memory: the rows' own pages, nothing beside them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from ..model import KVPool, LlavaModel, SessionKV
from ..model.kv.cache import undo_pass
from .memory import oom_attempts
from .runners import Chunk, Step, StepRunners
from .scheduler import BatchLayout

if TYPE_CHECKING:
    from ..sessions.session import Session
    from ..sessions.store import SessionStore
    from .sequence import Sequence

__all__ = ["PagedDecodeBatch"]

log = logging.getLogger(__name__)


class PagedDecodeBatch:
    """The running answers' decode step over their sessions' pages (module docstring).

    Args:
        model: the loaded model (the batched forward).
        store: the session store (demotions after an out-of-memory error).
        pool: the replica's KV pool, which holds every decoding session's cache.
        passes: the runner's :class:`~.runners.StepRunners`, which runs each step's pass.

    Attributes:
        rows: the running answers by row (None: a row whose answer left; compacted when under half live).
        num_builds: times the rows were laid out anew (joins, compaction); no KV moves in one.
    """

    def __init__(
        self,
        model: LlavaModel,
        store: SessionStore,
        pool: KVPool,
        passes: StepRunners,
    ) -> None:
        self.model = model
        self.store = store
        self.pool = pool
        self.passes = passes
        self.rows: list[Sequence | None] = []
        self.num_builds = 0

    @property
    def num_live(self) -> int:
        """Rows that belong to a running answer."""
        return sum(g is not None for g in self.rows)

    def layout(self) -> BatchLayout:
        """The batch's shape, for the scheduler (a step books the pages its rows open)."""
        return BatchLayout(len(self.rows), self.num_live, self.model.kv_bytes_per_token, self.pool.page_size)

    def forward(self, seqs: list[Sequence], *, rebuild: bool) -> torch.Tensor:
        """Run one decode step for ``seqs`` (each prefilled, its session's cache in the pool) in one
        forward pass, after giving the answers without a row one when ``rebuild``; each session then
        holds the fed token's position.

        Returns:
            Logits ``[len(rows), vocab]`` float32, indexed by each generation's ``row`` (a row that
            sat the step out holds zeros).

        Raises:
            ServiceError: overloaded (out of memory twice).
            Exception: the forward pass failed (every table is as before the step).
        """
        logits, _ = self._step(seqs, rebuild, None, [])
        return logits

    def forward_with_chunk(
        self, seqs: list[Sequence], *, rebuild: bool, session: Session, ids: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward` and the prefill of ``ids`` beyond ``session``'s cache in one forward pass
        (the runner's choice, :mod:`.runners`: the static step's, or :meth:`LlavaModel.fused_step
        <llava_sessions.model.LlavaModel.fused_step>`).

        Returns:
            ``(logits [len(rows), vocab], logits [vocab])`` float32: the rows' (by ``row``), the
            chunk's last position's.

        Raises:
            ServiceError: overloaded (as :meth:`forward`). Exception: the forward pass failed (every
            table and the session's cache as before the step).
        """
        logits, last = self._step(seqs, rebuild, session, ids)
        assert last is not None
        return logits, last

    def _step(
        self, seqs: list[Sequence], rebuild: bool, session: Session | None, ids: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One pass: the rows' decode step, and with a ``session`` its chunk of ``ids``."""
        if rebuild:
            self._build([g for g in seqs if g.row is None])
        caches = [_paged(g.session) for g in seqs]
        starts = [c.table.num_tokens for c in caches]
        tokens = [g.events[-1].id for g in seqs]
        last = None
        for attempt in oom_attempts(self.store, keep=session):
            with attempt:
                try:
                    for c in caches:
                        self.pool.make_room(c.table, 1)
                    tables = [c.table for c in caches]
                    positions = [t.num_tokens - 1 for t in tables]
                    assert positions == [g.next_position for g in seqs], "a row's cache: its prompt, fed tokens"
                    chunks = () if session is None else (Chunk.of(session, ids),)
                    by_row, lasts = self.passes.execute(Step.of(tables, tokens, chunks))
                    assert by_row is not None  # the step has rows
                    logits, last = by_row, (lasts[0] if lasts else None)
                except BaseException:
                    for c, start in zip(caches, starts, strict=True):
                        undo_pass(c, start)  # a failed pass leaves no position behind: a retry runs it again
                    raise
        for g, token in zip(seqs, tokens, strict=True):
            g.session.record_decode([token])
        rows = [g.row for g in seqs]
        if rows == list(range(len(self.rows))):  # every row decoded, in order: the logits are by row already
            return logits, last
        out = logits.new_zeros(len(self.rows), logits.shape[-1])
        out[torch.tensor(rows, device=logits.device)] = logits
        return out, last

    def forward_ahead(
        self, seqs: list[Sequence], tokens: torch.Tensor, room: Callable[[int], bool]
    ) -> tuple[torch.Tensor, list[int]] | None:
        """The next decode step of ``seqs`` launched before the host reads their last tokens (async
        scheduling, :mod:`.ahead`): fed ``tokens`` (``[len(seqs)]`` long on the device, each row's token
        the last step chose), through the static step only, once ``room`` (bytes -> granted; the
        executor's) grants the pages it opens. Each session's cache gets the fed token's
        position, not recorded in the session: the caller records the token once it reads it, or takes
        the position back (:func:`~llava_sessions.model.kv.cache.undo_pass`) when the answer ends with it.

        Returns:
            ``(logits [len(seqs), vocab] float32 in seqs' order, each cache's length before the step)``,
            or None, every cache as before: no static step or bucket holds the step, no room for the
            pages it opens, or the pass failed (logged at DEBUG: the caller's next step, in step with
            the host, runs it again and learns its error).
        """
        caches = [_paged(g.session) for g in seqs]
        starts = [c.table.num_tokens for c in caches]
        assert starts == [g.next_position + 1 for g in seqs], "a row's cache: its prompt, every token but the fed one"
        if not self.passes.can_run(Step([c.table for c in caches], tokens, (), max(starts) + 1)):
            return None  # only the static step takes tokens on the device
        size = self.pool.page_size
        opened = sum(1 for s in starts if s % size == 0) * size * self.model.kv_bytes_per_token
        if opened and not room(opened):
            return None
        try:
            for c in caches:
                self.pool.make_room(c.table, 1)
            logits, _ = self.passes.execute(Step.of([c.table for c in caches], tokens))
            assert logits is not None  # the step has rows
        except BaseException as exc:
            for c, start in zip(caches, starts, strict=True):
                undo_pass(c, start)
            if not isinstance(exc, Exception):
                raise
            log.debug("a decode step launched ahead failed; the next step runs it in step", exc_info=True)
            return None
        return logits, starts

    def drop(self, seq: Sequence) -> None:
        """Take ``seq`` out of the batch (it ended: its session's cache holds every position it fed;
        or it is preempted: its session's KV is the caller's)."""
        if seq.row is None:
            return
        self.rows[seq.row] = None
        seq.row = None
        if self.num_live == 0:
            self.rows = []

    def bytes_without(self, seqs: list[Sequence], leaving: list[Sequence]) -> int:
        """Device bytes a step of ``seqs`` (the answers that decode) needs beyond what their sessions
        hold, without ``leaving`` (preempted: their KV freed): a page for each row whose next position
        opens one, less the pages ``leaving`` hold (negative: the step fits in what they free)."""
        gone = {id(g) for g in leaving}
        size, per_token = self.pool.page_size, self.model.kv_bytes_per_token
        opened = sum(1 for g in seqs if id(g) not in gone and g.next_position % size == 0)
        freed = sum(g.session.num_held_kv_tokens for g in leaving)
        return (opened * size - freed) * per_token

    def _build(self, joining: list[Sequence]) -> None:
        """Give ``joining`` rows after the live ones, the holes dropped (no KV moves)."""
        members = [g for g in self.rows if g is not None] + joining
        for row, g in enumerate(members):
            g.row = row
        self.rows = list(members)
        self.num_builds += 1


def _paged(session: Session) -> SessionKV:
    """``session``'s cache, which a paged decode step writes in place.

    Raises:
        TypeError: it is not in the pool.
    """
    cache = session.kv_cache
    if cache is None:
        raise TypeError("a decode row needs its session's KV in the pool, and it holds none")
    return cache
