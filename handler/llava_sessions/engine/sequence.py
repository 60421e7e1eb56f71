"""The engine's requests in flight, as state: an answer (:class:`Sequence`, the field's noun for one
prompt and its generated tokens; a request of ``n`` answers is ``n`` sequences) and an open or an added
image (:class:`ImagePrefill`: the vision tower, then the conversation's prefix prefilled).

nano-vllm's ``sequence.py``: these hold a request's progress (token ids, cached count, decode row,
sampling state, timings; an image prefill's images and prefix) and run no forward pass. The engine
changes them as it executes a step (:mod:`.engine`); the scheduler reads them through
:meth:`Sequence.view` / :meth:`ImagePrefill.view` (:class:`~.scheduler.RequestView`).

Iterating a sequence and ``close()`` are conveniences that call back into the engine that made it
(:class:`Driver`): ``next(seq)`` runs steps of that answer alone; ``close()`` abandons it.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence as GenericSequence
from typing import TYPE_CHECKING, Any, Literal, Protocol

from ..conversation import common_prefix_len
from ..errors import ServiceError, overloaded
from ..results import AddImageResult, Answer, FinishReason, OpenResult, RestoredFrom, TokenEvent, elapsed_ms
from ..sampling.params import SamplingParams
from ..sampling.sampler import IncrementalDetokenizer, Sampler
from .scheduler import RequestView, TimeBudget

if TYPE_CHECKING:
    from ..sessions.session import Session, SessionSnapshot

__all__ = ["Driver", "Sequence", "ImagePrefill", "Phase", "EngineRequest"]


class Phase(enum.Enum):
    """Where an answer is: ``WAITING`` (not started: a demoted session is restored first; or
    preempted: its KV dropped, it resumes from here), ``PREFILLING`` (its prompt in chunks; a resumed
    answer's prompt and tokens so far), ``DECODING`` (a row of the decode batch), ``DONE``."""

    WAITING = "waiting"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    DONE = "done"


class Driver(Protocol):
    """What a request calls back into: the engine that made it."""

    def step(self, work: GenericSequence[EngineRequest], *, prefill_budget: int | TimeBudget | None = None) -> None:
        """Run one engine step over ``work``."""

    def abandon(self, work: EngineRequest) -> None:
        """Abandon ``work`` (client gone); its session is left as before it."""


class Sequence:
    """One answer in flight: the prompt, the tokens so far and how far its prefill got.

    Made by ``SessionEngine.start`` (the session is busy from then on). When it ends, :attr:`answer`
    is set; when a step fails, :attr:`error` is set; :attr:`done` either way.

    Attributes:
        session: the session it answers in.
        prompt / prompt_ids: the question and the full templated conversation's token ids.
        params: sampling parameters (``max_new_tokens`` possibly clipped to the room left).
        remember: the turn joins the history when the answer completes.
        truncated_turns: oldest turns the conversation leaves to fit the context.
        room_tokens: new tokens device memory is made room for when it starts (``max_new_tokens``;
            fewer for an answer without a limit, whose KV then grows with the decode batch).
        start_bytes: device bytes its start needs room for (a restore's or a resent conversation's
            image features, the KV of its uncached prompt and of ``room_tokens``); the step's plan grants them.
        phase: :class:`Phase`.
        row: this answer's row in the decode batch, while it has one.
        num_reused_tokens: prompt tokens served from the session's KV cache.
        restored_from: the tier a demoted session was rebuilt from (None: a KV hit).
        num_preemptions: times the engine preempted it to let older answers grow (vLLM's rule: the
            newest goes); it resumes exactly, its KV recomputed (:attr:`prefill_ids`).
        created: when it was admitted (``time.perf_counter()`` s): the newest is preempted first.
        samples: every answer of its request (``params.n``; :mod:`.samples`), by choice index: the head
            (the one that prefills the prompt on the session) and the others, which fork from it.
        head: the request's answer on the session (itself for a request of one answer).
        index: its choice index among :attr:`samples`.
        timings: ms: ``restore``, ``prefill`` (accumulated), then ``ttft``, ``total``, ``decode_tokens_per_s``.
    """

    kind: Literal["question"] = "question"

    def __init__(
        self,
        driver: Driver,
        session: Session,
        prompt: str,
        prompt_ids: list[int],
        params: SamplingParams,
        remember: bool,
        sampler: Sampler,
        detokenizer: IncrementalDetokenizer,
        *,
        truncated_turns: int = 0,
        room_tokens: int | None = None,
        start_bytes: int = 0,
    ) -> None:
        self._driver = driver
        self.session = session
        self.prompt = prompt
        self.prompt_ids = prompt_ids
        self.params = params
        self.remember = remember
        self.truncated_turns = truncated_turns
        self.room_tokens = params.max_new_tokens if room_tokens is None else room_tokens
        self.start_bytes = start_bytes
        self.sampler = sampler
        self.detokenizer = detokenizer
        self.phase = Phase.WAITING
        self.prefilled = False  # the prompt is in the KV cache (stays True once set)
        self.row: int | None = None
        self.num_reused_tokens = 0
        self.restored_from: RestoredFrom | None = None
        self.num_preemptions = 0
        self.answer: Answer | None = None
        self.error: Exception | None = None
        self.timings: dict[str, float] = {}
        self._events: list[TokenEvent] = []
        self._t0 = self.created = time.perf_counter()
        self._t_first = self._t_last = 0.0
        self._max_stop = max((len(s) for s in params.stop), default=0)
        self.images_to_encode: list[tuple[int, Any]] = []
        self.feature_rows: list[Any] = []
        self.features_pending = False  # the session's features are assembled when the answer starts
        self.resent = False  # a whole conversation resent (OpenAI messages), not one question
        self.samples: list[Sequence] = [self]
        self.head: Sequence = self
        self.index = 0
        #: a head whose answer ended while other answers of its request still run: its session keeps
        #: the turn (and goes idle) once all have ended, or is put back if the request is abandoned
        self.turn_waits = False

    def set_images_to_encode(self, images: list[tuple[int, Any]], rows: list[Any], *, assemble: bool) -> None:
        """A resent conversation's images the vision tower must encode before the prefill: ``(index
        in the conversation, decoded image or None)``, and every image's feature rows found held
        (``[tokens_i, hidden]``, None for those to encode); ``assemble``: the session's features are
        made of them when the answer starts (False: the session keeps its own)."""
        self.images_to_encode, self.feature_rows = list(images), list(rows)
        self.features_pending = assemble
        self.resent = True

    def no_room(self) -> ServiceError:
        """The error of a start refused device memory (503 ``overloaded``)."""
        return overloaded("not enough device memory for this answer now; retry later", "step_memory")

    # ------------------------------------------------------------------ reading
    @property
    def session_id(self) -> str:
        """The session this answer belongs to."""
        return self.session.session_id

    @property
    def done(self) -> bool:
        """True once the answer finished or failed."""
        return self.phase is Phase.DONE

    @property
    def ready(self) -> bool:
        """It may run: a head always; another sample once the head's prompt is prefilled (it forks then)."""
        return self.head is self or self.head.prefilled

    @property
    def all_done(self) -> bool:
        """Every answer of its request (:attr:`samples`) finished or failed."""
        return all(s.done for s in self.samples)

    @property
    def events(self) -> list[TokenEvent]:
        """The token events generated so far, in order (do not modify)."""
        return self._events

    @property
    def next_position(self) -> int:
        """Position id of the token the next decode step feeds (the last one sampled)."""
        return len(self.prompt_ids) + len(self._events) - 1

    @property
    def resuming(self) -> bool:
        """It was preempted after its first token: its prefill recomputes the KV of the prompt and the
        tokens so far, and samples nothing (its next token is fed by the decode step that follows)."""
        return bool(self._events) and self.phase is not Phase.DECODING

    @property
    def prefill_ids(self) -> list[int]:
        """The token ids whose KV must be cached before it decodes: the prompt, and once it has
        tokens (a resumed answer) every token but the last (the next decode step feeds that one)."""
        return self.prompt_ids + [e.id for e in self._events[:-1]] if self._events else self.prompt_ids

    def num_reusable_tokens(self) -> int:
        """Prefill tokens the session's KV cache serves now (at least one token is always prefilled)."""
        ids = self.prefill_ids
        return min(common_prefix_len(self.session.cached_ids, ids), len(ids) - 1)

    def view(self) -> RequestView:
        """What the scheduler sees: a decode row, or a prefill (after the vision tower when the
        session must be restored from the ``image`` tier)."""
        if self.phase is Phase.DECODING:
            return RequestView(
                "question",
                decoding=True,
                has_row=self.row is not None,
                num_kv_tokens=self.next_position,
                num_held_kv_tokens=self.session.num_held_kv_tokens,
                created=self.created,
            )
        if self.phase is Phase.WAITING:
            session = self.session
            restore = not self.features_pending and session.image_features is None and bool(session.images)
            restore_vision = bool(self.images_to_encode) or restore
            uncached = len(self.prefill_ids) - (0 if restore_vision else self.num_reusable_tokens())
            return RequestView(
                "question", needs_vision=restore_vision, num_prefill_tokens=uncached, start_bytes=self.start_bytes
            )
        return RequestView("question", num_prefill_tokens=len(self.prefill_ids) - len(self.session.cached_ids))

    # ------------------------------------------------------------------ changes (the engine's)
    def started(self, restored_from: RestoredFrom | None, num_reused_tokens: int, restore_ms: float) -> None:
        """The session is ready to prefill: restored (or a KV hit) and cropped to the reused tokens
        (a resumed answer keeps what its first start reported)."""
        self.phase = Phase.PREFILLING
        if not self._events:
            self.restored_from, self.num_reused_tokens = restored_from, num_reused_tokens
            self.timings["restore"] = restore_ms

    def preempt(self, start_bytes: int) -> None:
        """The engine dropped its row and KV to let older answers grow: it waits, then resumes with
        the KV of :attr:`prefill_ids` recomputed (``start_bytes``: the device bytes that needs)."""
        self.phase, self.row, self.start_bytes = Phase.WAITING, None, start_bytes
        self.num_preemptions += 1

    def prefilled_all(self) -> None:
        """The prompt is in the KV cache: the first token is sampled next, then it decodes."""
        self.phase = Phase.DECODING
        self.prefilled = True

    def append(
        self,
        token: int,
        logprob: float | None,
        eos_token_ids: frozenset[int],
        top: tuple[tuple[int, float], ...] = (),
    ) -> FinishReason | None:
        """Record a sampled token (``top``: the most likely ``(id, logprob)`` pairs at its position);
        return why the answer ends with it (EOS unless ``ignore_eos``, one of ``stop_token_ids``, a
        stop sequence, or a structured output's grammar complete: ``stop``; ``max_new_tokens``
        reached: ``length``), or None."""
        now = time.perf_counter()
        if not self._events:
            self._t_first = now
        self._t_last = now
        special = token in eos_token_ids
        params = self.params
        ends_on_eos = special and not params.ignore_eos
        detok = self.detokenizer
        before = len(detok.text)
        text = "" if ends_on_eos else detok.push(token)  # an EOS that ends the answer writes no text
        finish: FinishReason | None = None
        window = detok.text[max(0, before - self._max_stop) :]
        grammar = self.sampler.grammar
        if (
            ends_on_eos
            or token in params.stop_token_ids
            or (self._max_stop and any(s in window for s in params.stop))
            or grammar is not None
            and grammar.done
        ):
            finish = "stop"
        elif len(self._events) + 1 >= self.params.max_new_tokens:
            finish = "length"
        if finish:
            text += detok.flush()
        self._events.append(TokenEvent(token, text, logprob, special, top))
        return finish

    def finish(self, finish_reason: FinishReason) -> Answer:
        """End the answer; returns (and keeps) its :class:`~llava_sessions.results.Answer`."""
        self.phase = Phase.DONE
        n = len(self._events)
        decode_s = self._t_last - self._t_first
        if n:
            self.timings["ttft"] = elapsed_ms(self._t0, self._t_first)
        self.timings["total"] = elapsed_ms(self._t0)
        self.timings["decode_tokens_per_s"] = round((n - 1) / decode_s, 2) if n > 1 and decode_s > 0 else 0.0
        self.answer = Answer(
            text=self.detokenizer.text,
            finish_reason=finish_reason,
            prompt_tokens=len(self.prompt_ids),
            cached_tokens=self.num_reused_tokens,
            generated_tokens=n,
            tokens=list(self._events),
            timings=dict(self.timings),
            seed=self.sampler.seed,
            restored_from=self.restored_from,
            max_new_tokens=self.params.max_new_tokens,
            truncated_turns=self.truncated_turns,
        )
        return self.answer

    def abort(self) -> None:
        """Stop the answer where it is (its session is closing): the session is put back as before
        the question, and the answer so far ends with ``abort`` (kept as :attr:`answer`, not
        remembered); so does every other answer of its request. Nothing happens to one already done."""
        for s in self.samples:
            ended = s.done
            s._driver.abandon(s)  # a head whose turn waits for the others is put back too
            if not ended:
                s.finish("abort")

    def fail(self, exc: Exception) -> None:
        """Record ``exc`` as this answer's error (the engine puts the session back)."""
        self.error = exc

    def end(self) -> None:
        """Mark the answer ended without an answer (failed or abandoned)."""
        self.phase = Phase.DONE

    # ------------------------------------------------------------------ conveniences
    def __iter__(self) -> Sequence:
        return self

    def __next__(self) -> TokenEvent:
        if self.done:
            raise StopIteration
        self._driver.step([self])
        if self.error is not None:
            raise self.error
        return self._events[-1]

    def close(self) -> None:
        """Abandon the answer and every other answer of its request (client gone); the session stays
        as it was before the question."""
        for s in self.samples:
            s._driver.abandon(s)


class ImagePrefill:
    """An open or an added image in flight: the vision tower, then the conversation up to the next
    question prefilled in chunks.

    Made by ``SessionEngine.begin_open`` / ``begin_add_image`` (the session is admitted and busy).
    When done, :attr:`result` is set and the session is idle; when a step fails, :attr:`error` is set
    and the session is removed (an open) or put back as before (an added image: :attr:`snapshot`).

    Attributes:
        action: ``open`` or ``add_image``.
        session: the session; prefix: the conversation's token ids up to the next question.
        images: the decoded images still to encode (emptied once encoded).
        new_image: an added image's encoded bytes, its sizes and placeholder counts of every image
            once it joins (None for an open).
        snapshot: the session before an added image joined it (for the rollback).
        encoded: the vision tower ran; num_reused_tokens: prefix tokens kept from the KV cache.
        shared_rows: an open's images' feature rows found in other sessions (``share_images``): no
            vision tower runs, and the prefix KV another session holds is copied.
        start_bytes: device bytes its first chunk needs room for (features and the prefix's KV); the
            step's plan grants them.
        timings: ms: ``decode`` (when decoded by the engine), ``encode``, ``prefill``, ``total``.
    """

    kind: Literal["image"] = "image"

    def __init__(
        self,
        driver: Driver,
        action: Literal["open", "add_image"],
        session: Session,
        images: list[Any],
        prefix: list[int],
        t0: float,
        decode_ms: float | None,
        new_image: tuple[bytes, list[tuple[int, ...]], list[int]] | None = None,
        *,
        start_bytes: int = 0,
    ) -> None:
        self._driver = driver
        self.action = action
        self.session = session
        self.images = images
        self.prefix = prefix
        self.new_image = new_image
        self.start_bytes = start_bytes
        self.snapshot: SessionSnapshot | None = None
        self.encoded = False
        self.shared_rows: list[Any] | None = None  # every image's feature rows, held by other sessions
        #: a video's frames encoded so far (index in ``images`` → its frames' feature rows, in order)
        self.video_rows: dict[int, list[Any]] = {}
        self.num_reused_tokens = 0
        self.result: OpenResult | AddImageResult | None = None
        self.error: Exception | None = None
        self.done = False
        self.timings: dict[str, float] = {} if decode_ms is None else {"decode": decode_ms}
        self._t0 = t0

    @property
    def session_id(self) -> str:
        """The session the work is for."""
        return self.session.session_id

    def view(self) -> RequestView:
        """What the scheduler sees: the vision tower first, then the prefix's uncached tokens."""
        if not self.encoded:
            return RequestView(
                "image",
                needs_vision=self.shared_rows is None,
                num_prefill_tokens=len(self.prefix),
                start_bytes=self.start_bytes,
            )
        return RequestView("image", num_prefill_tokens=len(self.prefix) - len(self.session.cached_ids))

    def finish(self) -> OpenResult | AddImageResult:
        """The prefix is cached: set and return :attr:`result`."""
        self.done = True
        self.timings["total"] = elapsed_ms(self._t0)
        session, timings = self.session, dict(self.timings)
        if self.action == "open":
            self.result = OpenResult(
                session.session_id, session.expires_at, session.image_tokens[0], len(self.prefix), timings
            )
        else:
            self.result = AddImageResult(
                session.session_id,
                image_tokens=session.image_tokens[-1],
                images=len(session.images),
                prefix_tokens=len(self.prefix),
                cached_tokens=self.num_reused_tokens,
                timings=timings,
            )
        return self.result

    def no_room(self) -> ServiceError:
        """The error of a start refused device memory (503 ``overloaded``)."""
        what = "a new session" if self.action == "open" else "the image now"
        return overloaded(f"not enough device memory for {what}", "session_room")

    def fail(self, exc: Exception) -> None:
        """Record ``exc`` as the prefill's error (the engine undoes the prefill)."""
        self.error = exc

    def end(self) -> None:
        """Mark the prefill ended without a result (failed or abandoned)."""
        self.done = True

    def close(self) -> None:
        """Abandon the prefill (client gone): an open's session is removed, an added image undone."""
        self._driver.abandon(self)


#: A request the engine steps (what the scheduler sees one :class:`~.scheduler.RequestView` of).
EngineRequest = Sequence | ImagePrefill
