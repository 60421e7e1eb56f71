"""Executing a step's plan: its prefill chunks, its decode step, and the memory and preemptions it decides.

Each prefill chunk runs here (:meth:`StepExecutor.run_chunk`: what comes before its tokens, then the
chunk; the first rides the decode step's pass when the plan says so: :meth:`StepExecutor.decode_with_chunk`).
Device memory comes with the plan only (scheduler rules 10-11): room is made here, for a chunk's
``grant_bytes`` and the decode batch's ``batch_bytes`` once the answers the plan preempts have left,
and nowhere else. A preempted answer leaves the batch and resumes later with its KV recomputed. What a
chunk needs before its tokens is :mod:`.inputs`'; what a pass produces, :mod:`.outputs`'; the forward
passes themselves, the model runner's. A failure is its own request's: the others in the step run on.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..errors import overloaded
from .ahead import StepAhead
from .inputs import StepInputs
from .memory import kv_grant_bytes
from .outputs import StepOutputs
from .samples import fork_samples
from .scheduler import PrefillChunk, Room, make_room
from .sequence import EngineRequest, Phase, Sequence

if TYPE_CHECKING:
    from ..sessions.store import SessionStore
    from .model_runner import ModelRunner
    from .sharing import ImageSharing

__all__ = ["BatchRoom", "Start", "StepExecutor"]

log = logging.getLogger(__name__)


class Start(enum.Enum):
    """What a prefill chunk's start (:meth:`StepExecutor._start`) left for its tokens this step."""

    #: its tokens run now
    TOKENS = "tokens"
    #: a preempted answer waits for room (older answers end and free it)
    WAITS = "waits"
    #: the plan gives it no tokens this step (the step's share went to others)
    NO_TOKENS = "no_tokens"
    #: its vision tower (or a video's next frames) took this step's share
    VISION_SPENT = "vision_spent"
    #: an image whose prefix is all cached: its prefill is finished
    FINISHED = "finished"
    #: the request failed (its ``error`` set, its session put back)
    FAILED = "failed"


@dataclasses.dataclass(frozen=True)
class BatchRoom:
    """A step's plan for its decode batch, as the engine carries it out: ``rebuild`` (lay it out anew
    first), ``batch_bytes`` (room made for them once ``leaving`` left), ``leaving`` (the answers
    ``decision`` preempts), ``decision`` (the scheduler's :class:`~.scheduler.Room`)."""

    rebuild: bool
    batch_bytes: int = 0
    leaving: tuple[Sequence, ...] = ()
    decision: Room = Room()


class StepExecutor:
    """Carries out a step's plan (module docstring).

    Args:
        store: the sessions and their memory; runner: the model runner (every forward pass); sharing:
        what other sessions hold; decode_image: encoded bytes -> image;
        async_scheduling: a decode step whose tokens the device chooses launches the next before they are
            recorded (:class:`~.ahead.StepAhead`; the static step only).

    Attributes:
        inputs: :class:`~.inputs.StepInputs` (before a chunk); outputs: :class:`~.outputs.StepOutputs`
            (after a pass, and rollback); ahead: the :class:`~.ahead.StepAhead` (None: every step in
            step with the host).
        num_preemptions: answers preempted so that older ones could grow (the plan's
            :class:`~.scheduler.Room`, carried out by :meth:`_batch_room`).
    """

    def __init__(
        self,
        store: SessionStore,
        runner: ModelRunner,
        sharing: ImageSharing,
        decode_image: Callable[[bytes], Any],
        *,
        async_scheduling: bool = False,
    ) -> None:
        self.store = store
        self.runner = runner
        self.model = runner.model
        self.inputs = StepInputs(store, runner, sharing, decode_image)
        self.outputs = StepOutputs(store, runner)
        static = async_scheduling and runner.static_steps  # the static step only
        self.ahead = StepAhead(runner.batch, self.outputs, self._ahead_room) if static else None
        self.num_preemptions = 0

    def step_ahead(self, live: list[EngineRequest]) -> bool:
        """Async scheduling (:mod:`.ahead`): when the engine's step over ``live`` is the decode step of
        the answers in flight, launch the next and record theirs, and return True; otherwise record the
        tokens in flight, if any (some of ``live`` may be done after), and return False."""
        if self.ahead is None:
            return False
        if self.ahead.continues(live):
            self.ahead.step()
            return True
        self.ahead.settle()
        return False

    def _ahead_room(self, num_bytes: int) -> bool:
        """Room for the ``num_bytes`` of pages a decode step launched ahead opens (:mod:`.ahead`): the
        one grant outside a step's plan, made as :meth:`_batch_room` makes a planned step's."""
        return self.store.allocate(num_bytes, keep=None)

    def settle(self) -> None:
        """Record the tokens in flight, if any (:meth:`StepAhead.settle <.ahead.StepAhead.settle>`)."""
        if self.ahead is not None:
            self.ahead.settle()

    def decode(self, seqs: list[Sequence], room: BatchRoom) -> None:
        """Run the decode step of ``seqs`` together and sample each one's next token, once ``room``'s
        plan is carried out (preemptions, then room made for the batch's bytes); a failed forward
        pass fails every one of them (their sessions put back)."""
        seqs = self._batch_room(seqs, room)
        if not seqs:
            return
        try:
            logits = self.runner.decode(seqs, rebuild=room.rebuild)
        except Exception as exc:  # noqa: BLE001 - the batched step failed: each of its answers fails
            for g in seqs:
                self.outputs.fail(g, exc)
            return
        except BaseException:
            for g in seqs:
                self.outputs.put_back(g)
            raise
        if self.ahead is not None and self.ahead.eligible(seqs):
            self.ahead.accept(seqs, logits)
        else:
            self.outputs.accept_rows(seqs, logits)

    def _batch_room(self, seqs: list[Sequence], room: BatchRoom) -> list[Sequence]:
        """Carry out the plan's :class:`~.scheduler.Room` for the decode step (scheduler rules 10-11):
        preempt the answers it names (:meth:`_preempt`), then make room for the pages the step opens.
        When that room is not there because the step's earlier work took memory after the plan (a fused
        chunk's restore), the room is planned again (:meth:`_replan_room`) and carried out the same way.
        ``refused``: every answer fails ``overloaded``. Returns the answers that decode this step."""
        for attempt in (room, None):
            if attempt is None:
                attempt = self._replan_room(seqs, room)
            if attempt.decision.refused:
                break
            for gone in attempt.leaving:
                self._preempt(gone)
            seqs = [g for g in seqs if g not in attempt.leaving]
            if attempt.batch_bytes <= 0 or self.store.allocate(attempt.batch_bytes, keep=None):
                return seqs
        for g in seqs:
            self.outputs.fail(g, overloaded("not enough device memory to decode now; retry later", "step_memory"))
        return []

    def _replan_room(self, seqs: list[Sequence], room: BatchRoom) -> BatchRoom:
        """Rule 11 decided again for ``seqs`` on what the ledger holds now (:func:`~.scheduler.make_room`):
        the one decision taken after a step's plan, when the step's earlier work took the room the plan
        counted on."""
        views = [g.view() for g in seqs]
        decision, batch_bytes = make_room(views, range(len(seqs)), self.runner.batch.layout(), self.store.room_bytes())
        return BatchRoom(room.rebuild, batch_bytes, tuple(seqs[i] for i in decision.preempt), decision)

    def _preempt(self, seq: Sequence) -> None:
        """Preempt ``seq``: its row leaves the batch unread and its session's KV is dropped (no copy;
        the session keeps its image features), so it waits, then recomputes the KV of its prompt and
        tokens so far (:attr:`~.sequence.Sequence.prefill_ids`) and decodes on: the same tokens, as
        greedy decoding and a seeded sampler give them. Its stream pauses meanwhile."""
        batch = self.runner.batch
        batch.drop(seq)
        seq.session.drop_kv()
        left = max(1, seq.room_tokens - len(seq.events))
        # it resumes once room is made for its KV and the page its next decode step may open: resuming
        # sooner would only be preempted again
        joined = batch.bytes_without([seq], [])
        seq.preempt(kv_grant_bytes(self.model, self.runner.page_size, 0, len(seq.prefill_ids) + left) + joined)
        self.num_preemptions += 1

    def run_chunk(self, w: EngineRequest, chunk: PrefillChunk) -> None:
        """Execute one prefill chunk of a step's plan: what comes before its tokens (a waiting answer's
        start, an image's vision tower), then the chunk in a pass of its own. A failure is ``w``'s
        alone (its ``error`` set, its session put back)."""
        if self._start(w, chunk) is Start.TOKENS:
            self._tokens(w, chunk)

    def run_chunks(self, items: list[tuple[EngineRequest, PrefillChunk]]) -> None:
        """Execute prefill chunks of a step's plan: each one's start (as :meth:`run_chunk`), then their
        text chunks together as the rows of shared static steps where the runner has them
        (:meth:`ModelRunner.prefill_together <.model_runner.ModelRunner.prefill_together>`), the others
        each in a pass of its own. A failure is its request's alone: a shared pass that fails runs its
        chunks again, each alone."""
        ready = [(w, c) for w, c in items if self._start(w, c) is Start.TOKENS]
        parts = [(w.session, self._ids(w), c.num_tokens, w.timings) for w, c in ready]
        try:
            together = self.runner.prefill_together(parts) if len(ready) > 1 else [None] * len(ready)
        except BaseException:
            for w, _ in ready:
                self.outputs.fail(w, RuntimeError("interrupted"))
            raise
        for (w, chunk), last in zip(ready, together, strict=True):
            if last is None:  # not in a shared step: a pass of its own
                self._tokens(w, chunk)
                continue
            try:
                self._after_tokens(w, last)
            except Exception as exc:  # noqa: BLE001
                self.outputs.fail(w, exc)

    def _start(self, w: EngineRequest, chunk: PrefillChunk) -> Start:
        """Run what comes before ``chunk``'s tokens (:meth:`_before_tokens`) and say what it left. A
        failure is ``w``'s alone (its ``error`` set, its session put back: :attr:`Start.FAILED`)."""
        try:
            return self._before_tokens(w, chunk)
        except Exception as exc:  # noqa: BLE001 - one request's failure is that request's
            self.outputs.fail(w, exc)
        except BaseException:
            self.outputs.fail(w, RuntimeError("interrupted"))
            raise
        return Start.FAILED

    def _tokens(self, w: EngineRequest, chunk: PrefillChunk) -> None:
        """Prefill ``chunk``'s tokens in a pass of their own (its start has run: :meth:`_start`), then
        what follows them. A failure is ``w``'s alone."""
        try:
            self._after_tokens(w, self.runner.prefill(w.session, self._ids(w), chunk.num_tokens, w.timings)[0])
        except Exception as exc:  # noqa: BLE001 - one request's failure is that request's
            self.outputs.fail(w, exc)
        except BaseException:
            self.outputs.fail(w, RuntimeError("interrupted"))
            raise

    def decode_with_chunk(self, seqs: list[Sequence], room: BatchRoom, w: EngineRequest, chunk: PrefillChunk) -> None:
        """Rule 9 (:mod:`.scheduler`): the decode step of ``seqs`` and ``chunk``'s tokens in one forward
        pass (``room``: as :meth:`decode`). When the chunk runs no tokens after all, the decode step
        runs alone; when the batch gets no room or the pass fails, each part runs on its own, so each
        failure stays its own request's."""
        if self._start(w, chunk) is not Start.TOKENS:
            self.decode(seqs, room)
            return
        seqs = self._batch_room(seqs, room)
        if not seqs:
            self._tokens(w, chunk)
            return
        try:
            rows, last = self.runner.decode_with_chunk(
                seqs,
                rebuild=room.rebuild,
                session=w.session,
                ids=self._ids(w),
                num_tokens=chunk.num_tokens,
                timings=w.timings,
            )
        except Exception:  # noqa: BLE001 - whose failure it is, the parts alone tell
            log.debug("the fused decode and prefill pass failed; running them apart", exc_info=True)
            self.decode(seqs, BatchRoom(room.rebuild))  # its room is made
            self._tokens(w, chunk)
            return
        except BaseException:
            for g in seqs:
                self.outputs.put_back(g)
            self.outputs.fail(w, RuntimeError("interrupted"))
            raise
        self.outputs.accept_rows(seqs, rows)
        try:
            self._after_tokens(w, last)
        except Exception as exc:  # noqa: BLE001
            self.outputs.fail(w, exc)

    def _before_tokens(self, w: EngineRequest, chunk: PrefillChunk) -> Start:
        """What runs before a prefill chunk's tokens: room made for its ``grant_bytes`` (scheduler rule
        10: the work's start; ``overloaded`` when none can be made), a waiting answer's start
        (restore, crop), an image's vision tower. Returns what that leaves for the chunk's tokens.

        Raises:
            ServiceError: overloaded (no room for the start). Exception: the start failed.
        """
        if chunk.grant_bytes and not self.store.allocate(chunk.grant_bytes, keep=w.session):
            if isinstance(w, Sequence) and w.resuming:
                return Start.WAITS
            raise w.no_room()
        if isinstance(w, Sequence):
            if w.phase is Phase.WAITING:
                self.inputs.start_sequence(w)
            return Start.TOKENS if chunk.num_tokens != 0 else Start.NO_TOKENS
        if chunk.vision and chunk.vision_ms is not None and self.inputs.encode_frames(w, chunk.vision_ms):
            return Start.VISION_SPENT  # a video's frames are left
        if chunk.vision or not w.encoded:  # not a vision chunk: features another session holds
            self.inputs.encode_image_prefill(w)
            if chunk.vision and chunk.num_tokens == 0:
                return Start.VISION_SPENT
        if len(w.session.cached_ids) < len(w.prefix):
            return Start.TOKENS
        self.outputs.finish_image_prefill(w)
        return Start.FINISHED

    def _after_tokens(self, w: EngineRequest, logits: Any) -> None:
        """What follows a prefill chunk's pass: an answer whose prompt is all prefilled samples its first
        token; an image whose prefix is all cached is done."""
        if isinstance(w, Sequence):
            if len(w.session.cached_ids) == len(w.prefill_ids):
                resumed = w.resuming  # its next token is known: the decode step feeds it
                first = not w.prefilled
                w.prefilled_all()
                if first and len(w.samples) > 1:  # the request's other answers start from this prompt
                    fork_samples(w, self.model, self.outputs.accept, logits)
                if not resumed:
                    self.outputs.accept(w, logits)
        elif len(w.session.cached_ids) == len(w.prefix):
            self.outputs.finish_image_prefill(w)

    @staticmethod
    def _ids(w: EngineRequest) -> list[int]:
        """The full token ids ``w`` prefills (an answer's prompt, and a resumed one's tokens so far;
        an image's prefix)."""
        return w.prefill_ids if isinstance(w, Sequence) else w.prefix
