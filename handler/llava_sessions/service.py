"""The session service: decode a request's body, pick its dialect once, step the engine, emit each request's frame.

TorchServe (sequence batching + continuous batching) calls the handler with a batch of requests; each
is a new request or a request that asked to continue (its stopping criterion returned False).
Each :meth:`SessionService.handle` call

1. admits the new requests: loads each body (:func:`.wire.inbound.load_body`), decides its dialect
   (:func:`.wire.inbound.is_chat_body`: OpenAI chat and AWS's session bodies; else the native
   ``type`` bodies) and hands it to that dialect's serving, which answers at once or returns a
   :class:`~.wire.in_flight.RequestState` carrying the dialect; a refused request is that dialect's error reply;
   a request naming a URL or S3 image waits as a :class:`~.wire.fetches.PendingRequest` while a thread
   fetches it beside the loop, and is admitted from its body once the bytes are in;
2. advances every request in the batch by a bounded slice (``step_max_tokens`` steps, within
   ``step_max_ms``; at least one, and none past the step that sampled a stream's first token),
   interleaving requests token by token (:meth:`SessionEngine.step`); a stream's first event is its
   first token's (the chat dialect's role goes with it, as vLLM streams);
3. returns one :class:`Reply` per request, each written by its request's dialect under TorchServe's
   framing (:mod:`.wire.framing`). Nothing raises out of :meth:`handle`.

A body that is not JSON, too large or empty has no dialect yet: it is answered in the native one.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Collection
from concurrent import futures
from concurrent.futures import Future

from .chat.serving import ChatServing
from .config import Settings
from .conversation import Chat
from .engine import Sequence, SessionEngine, TimeBudget
from .errors import ErrorCode, ServiceError
from .images.fetch import fetch_image_bytes
from .metrics import WorkerMetrics
from .native.serving import NativeServing
from .wire.contract import SEQUENCE_END_HEADER
from .wire.fetches import FetchPending, ImageFetcher, PendingRequest
from .wire.framing import BatchRequest, Framing, Reply
from .wire.in_flight import Dialect, RequestState, RequestTable
from .wire.inbound import for_chat, is_chat_body, load_body, names_chat_keys

__all__ = ["BatchRequest", "Reply", "SessionService", "step_budget"]

log = logging.getLogger(__name__)

#: A request TorchServe has not brought back for this long is abandoned (its session freed for use): a
#: backstop only, as a request missing from a batch is abandoned at once (:meth:`SessionService.handle`).
STALE_JOB_S = 600.0


def step_budget(settings: Settings) -> int | TimeBudget:
    """The budget each engine step is planned within (:func:`~.engine.scheduler.schedule`): the fixed
    ``step_token_budget`` in tokens, or else the time budget of the ``max_step_*`` settings."""
    return settings.step_token_budget or TimeBudget(
        settings.max_step_ms_while_decoding,
        settings.max_prefill_tokens_per_pass,
        settings.max_step_ratio_while_opening,
    )


class SessionService:
    """The requests of TorchServe's batches in, each request's frame out (module docstring).

    Args:
        settings: validated handler settings.
        engine: the session engine.
        end_header: TorchServe's sequence-end response header name (``ctx.header_key_sequence_end``).
        fetch: ``(ImageSource, Settings) -> bytes`` (injectable so tests can use a local server).
        metrics: where answers and errors are observed (:class:`WorkerMetrics`); a private one if None.
        model_names: the names the served model answers to (``served_model_name``, else the checkpoint
            folder's): OpenAI's route refuses others (404); chat replies carry one of them.
        image_relay: the public port's proxy that fetches a request's images before relaying it
            (:class:`~llava_sessions.wire.fetches.ImageFetcher`'s ``relay``), or None.
    """

    def __init__(
        self,
        settings: Settings,
        engine: SessionEngine,
        *,
        end_header: str = SEQUENCE_END_HEADER,
        fetch: Callable[..., bytes] = fetch_image_bytes,
        metrics: WorkerMetrics | None = None,
        model_names: tuple[str, ...] = ("llava",),
        image_relay: str | None = None,
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.metrics = metrics or WorkerMetrics()
        self.requests = RequestTable(settings, engine, Framing(end_header), self.metrics)
        self.fetcher = ImageFetcher(
            fetch, settings.image_fetch_workers, image_relay
        )  # URL / S3 fetches beside the loop
        self.parked: dict[str, PendingRequest] = {}  # request id -> a request waiting for its images
        fetch = self.fetcher
        self.native = NativeServing(settings, engine, self.requests, fetch, self.metrics)
        tokenizer = getattr(engine.model, "tokenizer", None)
        token_text: Callable[[int], str] = (
            (lambda i: tokenizer.decode([i])) if tokenizer is not None else (lambda i: str(i))
        )
        self.chat = ChatServing(
            settings, engine, self.requests, fetch, self.metrics, model_names=model_names, token_text=token_text
        )
        self._new_session_bytes: int | None = None
        self.step_budget: int | TimeBudget = step_budget(settings)

    # ------------------------------------------------------------------ entry
    def handle(self, batch: list[BatchRequest], gone: Collection[str] | None = None) -> list[Reply]:
        """Admit new requests, advance every request in the batch by one slice, answer each request.

        Args:
            batch: TorchServe's batch (or a replica's part of it).
            gone: request ids of requests in flight whose clients left (:meth:`_drop_gone`); None: every
                request in flight that is not in ``batch`` (the whole batch is this service's).

        Never raises: an unexpected error becomes that request's 500 ``internal_error``.
        """
        now = time.monotonic()
        self._drop_gone(batch, gone)
        results: list[Reply | None] = [None] * len(batch)
        active: list[tuple[int, RequestState]] = []
        waiting: list[tuple[int, PendingRequest]] = []
        for i, request in enumerate(batch):
            req = self.requests.in_flight.get(request.request_id)
            if req is None:
                parked = self.parked.get(request.request_id)
                admitted = parked if parked is not None else self._admit(request, now)
                if isinstance(admitted, PendingRequest):
                    admitted.last_seen = now
                    waiting.append((i, admitted))
                    continue
                if isinstance(admitted, Reply):
                    self.requests.done_admitting(request.request_id)
                    results[i] = admitted
                    continue
                req = self._enter(admitted, calls=0)
            active.append((i, self._seen(req, now)))
        busy = bool(active) or any(not j.done for j in self.requests.in_flight.values())
        for i, parked in waiting:
            resumed = self._resume(parked, now, busy)
            if isinstance(resumed, Reply):
                results[i] = resumed
            else:
                active.append((i, self._seen(resumed, now)))
        self._advance([req for _, req in active])
        for i, req in active:
            try:
                results[i] = req.dialect.emit(req)
            except Exception:  # noqa: BLE001
                log.exception("emit failed", extra={"request_id": req.request_id})
                self.requests.forget(req, abandon=True)  # an unfinished answer or open leaves its session as before
                err = ServiceError(ErrorCode.INTERNAL_ERROR, "internal error")
                results[i] = self.requests.error(req.dialect, None, err, continued=req.continued)
        self._reap(now)
        final = [r if r is not None else Reply(b"") for r in results]
        self.requests.carry_group_ends(final[i] for i, req in active if req.continued)
        self.metrics.num_in_flight = len(self.requests.in_flight) + len(self.parked)
        return final

    def _enter(self, req: RequestState, *, calls: int) -> RequestState:
        """Put an admitted request in the table (``calls``: ``handle()`` calls its request already had)."""
        self.requests.in_flight[req.request_id] = req
        self.requests.done_admitting(req.request_id)
        req.calls = calls
        return req

    @staticmethod
    def _seen(req: RequestState, now: float) -> RequestState:
        req.last_seen = now
        req.calls += 1
        req.ahead = 0
        return req

    def _admit(self, request: BatchRequest, now: float) -> Reply | RequestState | PendingRequest:
        """Decode the request's body, decide its dialect, let that dialect admit it; a refusal is the
        dialect's error reply (a body with no dialect yet: the native one's); a request that needs an
        image still being fetched waits as an :class:`PendingRequest`. Never raises."""
        dialect: Dialect = self.chat if request.openai_route else self.native  # before the body is read
        try:
            if request.body is None:
                raise ServiceError(ErrorCode.INVALID_REQUEST, "empty request body")
            data = load_body(request.body, self.settings.max_body_bytes)
            if is_chat_body(data):
                dialect = self.chat
            fetches: dict[str, Future] = {}
            try:
                with self.fetcher.admitting(fetches, request.image_ticket):
                    return dialect.admit(request, data, now)
            except FetchPending as pending:
                parked = PendingRequest(request, dialect, data, fetches, pending.future)
                self.parked[request.request_id] = parked
                return parked
        except ServiceError as err:
            self.requests.done_admitting(request.request_id)
            if err.code is ErrorCode.PAYLOAD_TOO_LARGE and names_chat_keys(request.body):
                dialect, err = self.chat, for_chat(err)  # too large to decode: its dialect is read from its raw keys
            return self.requests.error(dialect, request.session_id, err, held=not request.minted)
        except Exception:  # noqa: BLE001 - never raise out of handle()
            log.exception("request failed", extra={"request_id": request.request_id})
            return self.requests.error(dialect, None, ServiceError(ErrorCode.INTERNAL_ERROR, "internal error"))

    def _resume(self, parked: PendingRequest, now: float, busy: bool) -> Reply | RequestState:
        """A request waiting for its images: admitted once they are in (the next image's fetch may
        then start), else its first frame (after waiting up to ``image_fetch_wait_ms`` while other
        answers run, up to the fetch's own deadline when none does) or an empty continuation."""
        settings, request = self.settings, parked.request
        wait_s = 0.0 if parked.framed else settings.image_fetch_wait_ms / 1000.0
        if not busy and not parked.framed:
            wait_s = settings.fetch_total_timeout_s + 1.0
        deadline = time.monotonic() + wait_s
        while True:
            futures.wait([parked.future], timeout=max(0.0, deadline - time.monotonic()))
            if not parked.future.done():
                if parked.framed:
                    return self.requests.framing.frame(b"", continued=True, last=False)
                parked.framed = True
                return parked.dialect.pending_frame(request, parked.data)
            try:
                with self.fetcher.admitting(parked.fetches, request.image_ticket):
                    admitted = parked.dialect.admit(request, parked.data, now)
            except FetchPending as pending:
                parked.future = pending.future
                continue
            except Exception as exc:  # noqa: BLE001 - a ServiceError is the request's; anything else a bug
                del self.parked[request.request_id]
                self.requests.done_admitting(request.request_id)
                if isinstance(exc, ServiceError):
                    err = exc
                else:
                    log.exception("request failed", extra={"request_id": request.request_id})
                    err = ServiceError(ErrorCode.INTERNAL_ERROR, "internal error")
                if parked.framed:
                    return parked.dialect.late_error(request, parked.data, err)
                return self.requests.error(parked.dialect, request.session_id, err, held=not request.minted)
            del self.parked[request.request_id]
            if isinstance(admitted, Reply):  # answered at once (a refused open answers, not raises)
                self.requests.done_admitting(request.request_id)
                return dataclasses.replace(admitted, stop=True) if parked.framed else admitted
            return self._enter(admitted, calls=1 if parked.framed else 0)

    # ------------------------------------------------------------------ scheduling
    def _advance(self, requests: list[RequestState]) -> None:
        """Run up to ``step_max_tokens`` scheduler steps within ``step_max_ms`` (at least one).

        Each step advances every running request by one token: the requests that still need their prefill
        run it, and all the others decode together in one forward pass (:meth:`SessionEngine.step`).
        The call ends after the step that sampled a stream's first token, so that token goes out at
        once (time to first token is not time to ``step_max_tokens`` tokens). By default a call runs one
        step, so each token leaves in its own chunk and a new request joins at the next step
        (docs/decisions/77-a-stream-sends-each-token-as-it-is-sampled.md); more groups later tokens.
        """
        deadline = time.perf_counter() + self.settings.step_max_ms / 1000.0
        running = [j for j in requests if not j.done and j.error is None]
        for step in range(self.settings.step_max_tokens):
            running = [j for j in running if not j.done]
            if not running or (step > 0 and time.perf_counter() >= deadline):
                break
            first = [j.work for j in running if j.streamed and isinstance(j.work, Sequence) and not j.work.events]
            self._engine_step(running)
            if any(seq.events for seq in first):
                break

    def _engine_step(self, running: list[RequestState]) -> None:
        """One scheduler step over ``running``; a request whose work failed gets its typed error."""
        self.engine.step([j.work for j in running], prefill_budget=self.step_budget)
        for req in running:
            exc = req.work.error
            if exc is None or req.error is not None:
                continue
            if isinstance(exc, ServiceError):
                req.error = exc
            else:
                log.error("generation failed", exc_info=exc, extra={"session_id": req.session_id})
                req.error = ServiceError(ErrorCode.INTERNAL_ERROR, "internal error during generation")

    def run_ahead(self) -> bool:
        """Between ``handle()`` calls, advance the requests in flight by one scheduler step, each at most
        ``step_max_tokens`` steps past the last call it was in; the next call emits what they made.

        A replica process (llava_sessions.replicas) calls this while no call is waiting, so its device
        keeps decoding while the other replicas finish their slices and TorchServe's round trip goes
        on. The bound keeps an answer whose client left (TorchServe stops bringing its request back) from
        decoding on. Returns False when there was nothing to run. Never raises.
        """
        running = [
            j
            for j in self.requests.in_flight.values()
            if not j.done and j.error is None and j.ahead < self.settings.step_max_tokens
        ]
        if not running:
            return False
        try:
            self._engine_step(running)
        except Exception:  # noqa: BLE001 - as in handle(): the requests' own errors are recorded by _engine_step
            log.exception("run-ahead step failed")
            return False
        for req in running:
            req.ahead += 1
        return True

    # ------------------------------------------------------------------ requests no call brings back
    def _drop_gone(self, batch: list[BatchRequest], gone: Collection[str] | None) -> None:
        """Free the requests (and requests waiting for images) whose clients left, before anything is admitted.

        With sequence + continuous batching TorchServe keeps every request that asked to continue and
        sends it in EVERY later batch until its last frame; a request whose client disconnected is
        dropped when its next frame is written ("Connection to client got closed; Removing job") and
        never comes back, with nothing said to the worker. So a request in flight that a batch lacks is
        gone: its generation slot, KV and session are released now (an answer's session returns to
        its state before the question; an open's session is removed; a sessionless request's is freed), and the
        TorchServe job group minted for it is ended on the next continuation frame
        (:meth:`RequestTable.carry_group_ends`), so it holds no ``maxNumSequence`` slot until its idle
        timeout. ``gone``: the ids to drop (a replica is told by its router, which sees the whole
        batch); None: every id in flight that ``batch`` lacks.
        """
        if gone is None:
            in_batch = {request.request_id for request in batch}
            gone = [rid for rid in (*self.requests.in_flight, *self.parked) if rid not in in_batch]
        for rid in gone:
            parked = self.parked.pop(rid, None)
            if parked is not None:
                self.requests.done_admitting(rid)
                if parked.request.minted and parked.request.session_id:
                    self.requests.end_group_later(parked.request.session_id)
            req = self.requests.in_flight.get(rid)
            if req is not None:
                self.requests.abandon(req)
                log.info("freed a request its client left", extra={"session_id": req.session_id})

    def _reap(self, now: float) -> None:
        """Abandon requests TorchServe stopped bringing back (their sessions become usable again), and
        requests waiting for images it stopped bringing back."""
        for rid, parked in list(self.parked.items()):
            if now - parked.last_seen > STALE_JOB_S:
                del self.parked[rid]
                self.requests.done_admitting(rid)
        for req in list(self.requests.in_flight.values()):
            if now - req.last_seen > STALE_JOB_S:
                self.requests.forget(req, abandon=True)
                log.warning("abandoned a request TorchServe stopped polling", extra={"session_id": req.session_id})

    # ------------------------------------------------------------------ entry helpers
    def internal_error(self) -> Reply:
        """A 500 ``internal_error`` reply (the entry's last line of defence), in the native dialect."""
        return self.requests.error(self.native, None, ServiceError(ErrorCode.INTERNAL_ERROR, "internal error"))

    def placement_stats(self) -> dict[str, int]:
        """What a replica router places new sessions by: ``free_bytes`` (device budget left, bytes;
        conversation-cache entries count as free: they go first when room is needed),
        ``num_sessions``, ``max_sessions`` and ``new_session_bytes`` (what one new session's image
        features and prefix KV cost, bytes)."""
        engine, store = self.engine, self.engine.store
        if self._new_session_bytes is None:  # the prefix is templated once, not per call
            model = engine.model
            chat = Chat(self.settings.system_prompt, image_tokens=(model.num_image_tokens,))
            self._new_session_bytes = engine.new_session_bytes(len(model.template.prefix_ids(chat)))
        return {
            "free_bytes": store.device_budget_bytes - store.device_bytes() + store.num_cache_bytes,
            "num_sessions": len(store),
            "new_session_bytes": self._new_session_bytes,
            "max_sessions": self.settings.max_sessions,
        }

    def emit_metrics(self) -> None:
        """Publish the worker's metrics (:meth:`WorkerMetrics.emit`); never raises."""
        self.metrics.emit(self.engine)
