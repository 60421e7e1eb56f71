"""The requests in flight between ``handle()`` calls, and what every dialect's answers share.

A :class:`RequestState` is one admitted request (an open, an added image, an answer) whose work the engine
steps across TorchServe's calls; it carries the :class:`Dialect` its request came in, decided once
where the body was decoded, so every later frame and error is written by that dialect's encoder.
:class:`RequestTable` holds the requests and the replies both dialects give alike (an error reply, a new
session's id, the generation slots). Nothing here knows a dialect's shapes.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from ..engine import ImagePrefill, Sequence, SessionEngine
from ..errors import ErrorCode, ServiceError, overloaded
from ..results import TokenEvent
from .contract import NEW_SESSION_LITERAL, SESSION_ID_HEADER, SESSION_ID_RE, SLOT_WAIT_HEADER
from .framing import BatchRequest, Framing, Reply

if TYPE_CHECKING:
    from ..config import Settings
    from ..metrics import WorkerMetrics

__all__ = ["GENERATION_SLOTS", "Dialect", "RequestState", "RequestTable", "Serving"]

#: ``max_concurrent_generations`` when the setting is 0, by the replica's device type. A GPU's
#: tokens/s keeps growing to 64 sessions at once, so its slots are not the 16 that keep a CPU's steps
#: short (benchmarks/results/the-gpu-table.md).
GENERATION_SLOTS = {"cpu": 16, "cuda": 64}

log = logging.getLogger(__name__)


class Dialect(Protocol):
    """What the service asks of a dialect (``native``, ``chat``): admit a decoded body, emit a request's
    frame for this call, and write an error in its own shape."""

    def admit(self, request: BatchRequest, data: Any, now: float) -> Reply | RequestState:
        """Admit one decoded body: an answer now, or a request to step. Raises ServiceError."""
        ...

    def emit(self, req: RequestState) -> Reply:
        """The request's frame for this ``handle()`` call."""
        ...

    def encode_error(self, error: ServiceError) -> bytes:
        """A whole error reply body in this dialect's shape."""
        ...

    def error_status(self, error: ServiceError) -> int:
        """The HTTP status this dialect answers ``error`` with."""
        ...

    def pending_frame(self, request: BatchRequest, data: Any) -> Reply:
        """The first frame of a request still waiting for its images (:mod:`.fetches`): no body, the
        status, headers and content type its answer will have."""
        ...

    def late_error(self, request: BatchRequest, data: Any, err: ServiceError) -> Reply:
        """The last frame of a request whose first frame went out and whose admission then failed."""
        ...


@dataclass
class RequestState:
    """An open, an added image or an answer in flight, across ``handle()`` calls (keyed by
    TorchServe's request id).

    Attributes:
        dialect: the dialect the request came in; its frames and errors are that dialect's.
        command: the dialect's command for the request.
        work: the engine's state of it (``Sequence`` or ``ImagePrefill``).
        own_group: the TorchServe job group is this session's own (not the shared ``NEW_SESSION``).
        held: the client held this session before the request (not an open, not a sessionless request): if
            the session is gone when the request fails, the reply says it closed.
        calls: ``handle()`` calls this request was part of (more than one: its first frame is out).
        sessionless: a chat request without a session: its session becomes a conversation-cache entry
            when it answered, and is removed otherwise (:meth:`RequestTable.end_sessionless`).
        opened: a chat request that opened its session (``NEW_SESSION``): new-session headers.
        stream: a streamed chat answer's events; frames: a chat stream's last events, one per call.
        sent / ended: a stream's token events sent per choice index, and the choices that ended.
        urls: image URL → content key, kept by the session when the answer ends.
        warnings: what the request gets otherwise than it asked, said in its reply (a video with
            fewer frames than asked: :attr:`~llava_sessions.video.SampledVideo.shortfall`).
    """

    request_id: str
    session_id: str
    dialect: Dialect
    command: Any
    last_seen: float
    work: Sequence | ImagePrefill
    own_group: bool = True
    held: bool = True
    t0: float = 0.0  # admission time (perf_counter), for an open's total_ms
    fetch_timings: dict[str, float] = field(default_factory=dict)  # an image's fetch and decode, ms
    calls: int = 0
    ahead: int = 0  # steps run by run_ahead() since the request was last in a handle() call
    sent: dict[int, int] = field(default_factory=dict)  # choice index -> its token events sent (streaming)
    ended: set[int] = field(default_factory=set)  # choices whose last event went out (streaming)
    error: ServiceError | None = None
    sessionless: bool = False
    opened: bool = False
    stream: Any = None
    frames: list[bytes] = field(default_factory=list)
    urls: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    @property
    def done(self) -> bool:
        """Its work ended: an image prefill's, or every answer of a question's (``n``)."""
        work = self.work
        return work.all_done if isinstance(work, Sequence) else work.done

    def news(self, seq: Sequence) -> list[TokenEvent]:
        """``seq``'s token events not sent yet (a streamed answer's, one of the request's ``n``); they
        count as sent from now on."""
        start = self.sent.get(seq.index, 0)
        self.sent[seq.index] = len(seq.events)
        return seq.events[start:]

    @property
    def streamed(self) -> bool:
        """The answer streams (either dialect's ``stream``): its tokens go out as they come."""
        return bool(getattr(self.command, "stream", False))

    @property
    def continued(self) -> bool:
        """An earlier ``handle()`` call already sent this request a frame (its status and headers are out)."""
        return self.calls > 1


class RequestTable:
    """The requests in flight (by TorchServe request id) and the replies both dialects share.

    Args:
        settings: the handler settings (``max_concurrent_generations``).
        engine: the session engine (a session's existence, ending stateless requests' sessions).
        framing: TorchServe's framing (error replies, closed headers).
        metrics: where errors are counted.
    """

    def __init__(self, settings: Settings, engine: SessionEngine, framing: Framing, metrics: WorkerMetrics) -> None:
        self.settings = settings
        self.engine = engine
        self.framing = framing
        self.metrics = metrics
        self.in_flight: dict[str, RequestState] = {}
        self._fresh_ids: dict[str, str] = {}  # request id -> the session id it was given
        self._group_ends: list[str] = []  # TorchServe job groups to end on the next continuation frame

    @property
    def generation_slots(self) -> int:
        """Answers this worker decodes at once: ``max_concurrent_generations``, or when that is 0 the
        :data:`GENERATION_SLOTS` of the engine's device."""
        device = getattr(getattr(self.engine, "model", None), "device", None)
        kind = getattr(device, "type", "cpu")
        return self.settings.max_concurrent_generations or GENERATION_SLOTS.get(kind, GENERATION_SLOTS["cpu"])

    def check_generation_slot(self, n: int = 1) -> None:
        """Check that ``n`` more answers fit in :attr:`generation_slots` beside those in flight
        (every answer of a request of several counts).

        Raises:
            ServiceError: overloaded when they do not fit now; invalid_parameter (``n``) when ``n``
                exceeds the setting, so that they never would.
        """
        cap = self.generation_slots
        if n > cap:
            message = f"n: at most {cap} answers per request on this server (its max_concurrent_generations)"
            raise ServiceError(ErrorCode.INVALID_PARAMETER, message, param="n")
        running = sum(len(j.work.samples) for j in self.in_flight.values() if isinstance(j.work, Sequence))
        if running + n > cap:
            raise overloaded("too many generations in flight on this worker; retry shortly", "generation_slot")

    def new_session_id(self, request: BatchRequest) -> str:
        """The id a new session gets: TorchServe's minted or the client's own, else (the shared
        ``NEW_SESSION`` group, or no sequence batching) a new ``llava-<uuid4>``.

        Raises:
            ServiceError: invalid_request (an id not valid, or already open).
        """
        sid = request.session_id
        if sid is None or sid == NEW_SESSION_LITERAL:
            sid = self.fresh_id(request.request_id)
        elif not request.minted and not SESSION_ID_RE.match(sid):
            raise ServiceError(ErrorCode.INVALID_REQUEST, f"{SESSION_ID_HEADER} is not a valid session id")
        if sid in self.engine.store:
            raise ServiceError(ErrorCode.INVALID_REQUEST, "a session with this id is already open")
        return sid

    def fresh_id(self, request_id: str) -> str:
        """A new ``llava-<uuid4>`` session id for a request, the same each time while it waits for its
        images (its first frame may have carried it); :meth:`done_admitting` forgets it."""
        return self._fresh_ids.setdefault(request_id, f"llava-{uuid.uuid4()}")

    def done_admitting(self, request_id: str) -> None:
        """The request is admitted (or refused): its :meth:`fresh_id` is no longer needed."""
        self._fresh_ids.pop(request_id, None)

    @staticmethod
    def session_of(request: BatchRequest, kind: str) -> str:
        """The open session ``request`` names for a ``kind`` request (generate, close, ...).

        Raises:
            ServiceError: missing_session_id (no header, ``NEW_SESSION``, or an id TorchServe minted).
        """
        sid = request.session_id
        if request.minted or not sid or sid == NEW_SESSION_LITERAL:
            raise ServiceError(
                ErrorCode.MISSING_SESSION_ID, f"{kind} needs the {SESSION_ID_HEADER} header of an open session"
            )
        return sid

    def forget(self, req: RequestState, *, abandon: bool = False) -> None:
        """Drop ``req`` from the requests in flight (``abandon``: its work is closed first, its session
        left as before it); a sessionless chat request's session ends with it (:meth:`end_sessionless`)."""
        self.in_flight.pop(req.request_id, None)
        if abandon:
            req.work.close()
        if req.sessionless:
            self.end_sessionless(req, failed=abandon)

    def abandon(self, req: RequestState) -> None:
        """Free a request whose client left (:meth:`forget` with its work closed); a job group that no
        session holds any more (a sessionless request's, a failed open's) is ended with the next continuation
        frame (:meth:`carry_group_ends`)."""
        self.forget(req, abandon=True)
        if req.own_group and req.session_id and req.session_id not in self.engine.store:
            self.end_group_later(req.session_id)

    def stop_session(self, session_id: str) -> None:
        """Stop every request in flight in session ``session_id`` before it closes (vLLM aborts a
        running request likewise): an answer ends now with ``finish_reason`` ``abort``, what it said
        until then being its answer (:meth:`Sequence.abort`); an image being added fails with
        ``session_not_found``. Its session is left idle, as before the request. In place."""
        for req in self.in_flight.values():
            if req.session_id != session_id or req.sessionless or req.done or req.error is not None:
                continue
            if isinstance(req.work, Sequence):
                req.work.abort()
            else:
                req.work.close()
                req.error = ServiceError(
                    ErrorCode.SESSION_NOT_FOUND, "the session was closed while the image was added"
                )

    def end_group_later(self, group: str) -> None:
        """End TorchServe job group ``group`` with the next continuation frame (the request it was
        minted for is gone, so no frame of its own will)."""
        if group != NEW_SESSION_LITERAL and group not in self._group_ends:
            self._group_ends.append(group)

    def carry_group_ends(self, frames: Iterable[Reply]) -> None:
        """Add the job groups waiting to end (:meth:`end_group_later`) to the first of ``frames``
        (frames of requests whose first frame went out, so the header reaches TorchServe, not a client):
        TorchServe reads the sequence-end header as ``;``-separated group ids and ends each. Kept for a
        later call when ``frames`` is empty. In place."""
        frame = next(iter(frames), None) if self._group_ends else None
        if frame is None:
            return
        key = self.framing.end_header
        own = frame.headers.get(key)
        frame.headers[key] = ";".join([own, *self._group_ends] if own else self._group_ends)
        self._group_ends.clear()

    def end_sessionless(self, req: RequestState, *, failed: bool = False) -> None:
        """End a chat request without a session: an answered one's state stays as a conversation-cache
        entry (:meth:`SessionEngine.retain`); a failed or abandoned one's is removed. Never raises."""
        if failed or req.error is not None:
            self.close_quietly(req.session_id)
        else:
            self.engine.retain(req.session_id)

    def close_quietly(self, session_id: str) -> None:
        """Close ``session_id`` if it is open and idle; never raises."""
        try:
            self.engine.close(session_id)
        except ServiceError:
            pass

    def error(
        self,
        dialect: Dialect,
        session_id: str | None,
        err: ServiceError,
        *,
        held: bool = True,
        continued: bool = False,
    ) -> Reply:
        """A JSON error reply in ``dialect``'s shape for the request of TorchServe job group ``session_id``.

        A request that leaves no open session behind ends its job group at once (TorchServe's
        sequence end). Only where the client ``held`` that session (it named an id it had: unknown,
        expired, evicted) does the reply also say the session closed (SageMaker's
        ``X-Amzn-SageMaker-Closed-Session-Id``, boto3's ``ClosedSessionId``): a failed open or a
        sessionless request's group, minted by TorchServe, is no session the client ever had. The shared
        ``NEW_SESSION`` group is never ended. ``continued``: the request's first frame went out (this is
        its last chunk).
        """
        self.metrics.count_error(err)
        if err.code is ErrorCode.IMAGE_FETCH_FAILED:  # the operator's to fix (credentials, a role, the network)
            log.warning("image fetch failed: %s", err.message, extra={"session_id": session_id})
        headers: dict[str, str] = {}
        if session_id and session_id != NEW_SESSION_LITERAL and session_id not in self.engine.store:
            if held and SESSION_ID_RE.match(session_id):
                headers.update(self.framing.closed(session_id))
            else:
                headers.update(self.framing.end_sequence(session_id))
        if err.retry_after_s:
            headers["Retry-After"] = str(err.retry_after_s)
        if err.shortage == "generation_slot" and not continued:
            headers[SLOT_WAIT_HEADER] = "1"  # refused before anything was done: the proxy may hold it
        return self.framing.frame(
            dialect.encode_error(err), continued=continued, last=True, status=dialect.error_status(err), headers=headers
        )


class Serving:
    """What both dialects' serving stands on (their base): the settings, the engine, the requests in
    flight with the replies both give alike, TorchServe's framing, the image fetch and the metrics.

    Args:
        settings: the handler settings.
        engine: the session engine.
        requests: the requests in flight (:class:`RequestTable`; its ``framing`` is TorchServe's).
        fetch: ``(ImageSource, Settings) -> bytes``.
        metrics: where answers are observed.
    """

    def __init__(
        self,
        settings: Settings,
        engine: SessionEngine,
        requests: RequestTable,
        fetch: Callable[..., bytes],
        metrics: WorkerMetrics,
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.requests = requests
        self.framing = requests.framing
        self.fetch = fetch
        self.metrics = metrics
