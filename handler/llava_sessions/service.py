"""The session service: admission and the step-wise scheduler, on TorchServe's continuous batching.

TorchServe (sequence batching + continuous batching) calls the handler with a batch of rows; a
row is a new request or a job that asked to continue (its stopping criterion returned False).
Each :meth:`SessionService.handle` call

1. admits the new rows: decodes them (:class:`.codec.Codec`), validates session ids and headers,
   answers opens, resets and closes at once, starts generations (:meth:`SessionEngine.start`);
   errors become per-row JSON errors with their status;
2. advances every job in the batch by a bounded slice (``step_max_tokens`` tokens each, within
   ``step_max_ms``; at least one step each), interleaving jobs token by token;
3. returns one :class:`RowResult` per row: a streamed job's new tokens as one chunk of JSON lines,
   a non-streamed job's empty output until its answer is complete (empty chunks never reach the
   client: shared/notes/torchserve-sagemaker.md), and a ``stop`` flag for the row's stopping
   criterion (None: a whole response; False: more chunks follow; True: last chunk).

TorchServe sends status and headers with a job's FIRST frame, even an empty one (verified: headers
set on a later frame are dropped). So everything that decides a status happens in the admitting
call: for an open or an added image, the fetch, the image decode, the id and the room for it (the
engine's admission; the vision tower and the prefix prefill then run in scheduler steps); for a
question, the session and context checks. An error found later is reported in the body: the last
JSON line of a stream, or the JSON error body of a non-streamed answer (status 200). Nothing raises
out of :meth:`handle`.

Header contract (names from shared/notes/torchserve-sagemaker.md): an open answers
``X-Amzn-SageMaker-Session-Id: <id>; Expires=<UTC>`` and ``X-Amzn-SageMaker-New-Session-Id`` with
the same value; a close, or any request naming a session that is gone, answers
``X-Amzn-SageMaker-Closed-Session-Id: <id>``, which is also TorchServe's sequence-end header, so
the job group is freed at once.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable

from .chat_jobs import ChatJobs
from .codec import (
    JSON_LINES,
    AddImageCommand,
    ChatCommand,
    Codec,
    Command,
    GenerateCommand,
    NewSessionCommand,
    OpenCommand,
    ResetCommand,
)
from .config import Settings
from .contract import (
    CLOSED_SESSION_ID_HEADER,
    NEW_SESSION_ID_HEADER,
    NEW_SESSION_LITERAL,
    SESSION_ID_HEADER,
    SESSION_ID_RE,
    session_header_value,
)
from .conversation import Chat
from .engine import Generation, ImageTask, SessionEngine
from .errors import ErrorCode, ServiceError, overloaded
from .images import decode_image, fetch_image_bytes
from .jobs import Job, Row, RowResult
from .metrics import WorkerMetrics
from .results import AddImageResult, OpenResult, elapsed_ms

__all__ = ["Row", "RowResult", "SessionService"]

log = logging.getLogger(__name__)

#: A job TorchServe has not brought back for this long is abandoned (its session freed for use).
STALE_JOB_S = 600.0


class SessionService:
    """Admission and the step-wise scheduler over TorchServe's rows (decoding and encoding: :class:`Codec`).

    Args:
        settings: validated handler settings.
        engine: the session engine.
        end_header: TorchServe's sequence-end response header name (``ctx.header_key_sequence_end``).
        fetch: ``(ImageSource, Settings) -> bytes`` (injectable so tests can use a local server).
        metrics: where answers and errors are observed (:class:`WorkerMetrics`); a private one if None.
        model_name: the served model's name (OpenAI chat replies carry it).
    """

    def __init__(
        self,
        settings: Settings,
        engine: SessionEngine,
        *,
        end_header: str = CLOSED_SESSION_ID_HEADER,
        fetch: Callable[..., bytes] = fetch_image_bytes,
        metrics: WorkerMetrics | None = None,
        model_name: str = "llava",
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.codec = Codec(settings, model_name)
        self.chat = ChatJobs(self)
        self.metrics = metrics or WorkerMetrics()
        self.end_header = end_header
        self.fetch = fetch
        self._jobs: dict[str, Job] = {}
        self._new_session_bytes: int | None = None
        tokenizer = getattr(engine.runner, "tokenizer", None)
        #: token id -> its text (OpenAI ``logprobs``)
        self.token_text: Callable[[int], str] = (
            (lambda i: tokenizer.decode([i])) if tokenizer is not None else (lambda i: str(i))
        )

    # ------------------------------------------------------------------ entry
    def handle(self, rows: list[Row]) -> list[RowResult]:
        """Admit new rows, advance every job in the batch by one slice, answer each row.

        Never raises: an unexpected error becomes that row's 500 ``internal_error``.
        """
        now = time.monotonic()
        results: list[RowResult | None] = [None] * len(rows)
        active: list[tuple[int, Job]] = []
        self._drop_abandoned(rows)
        for i, row in enumerate(rows):
            job = self._jobs.get(row.request_id)
            if job is None:
                try:
                    admitted = self._admit(row, now)
                except ServiceError as err:
                    results[i] = self.error_result(row.session_id, err)
                    continue
                except Exception:  # noqa: BLE001 - never raise out of handle()
                    log.exception("request failed", extra={"request_id": row.request_id})
                    results[i] = self.error_result(None, ServiceError(ErrorCode.INTERNAL_ERROR, "internal error"))
                    continue
                if isinstance(admitted, RowResult):
                    results[i] = admitted
                    continue
                job = admitted
                self._jobs[row.request_id] = job
            job.last_seen = now
            job.calls += 1
            job.ahead = 0
            active.append((i, job))
        self._advance([job for _, job in active])
        for i, job in active:
            try:
                results[i] = self._emit(job)
            except Exception:  # noqa: BLE001
                log.exception("emit failed", extra={"request_id": job.request_id})
                self.forget(job, abandon=True)  # an unfinished answer or open leaves its session as before
                results[i] = self.error_result(
                    None, ServiceError(ErrorCode.INTERNAL_ERROR, "internal error"), chunk=job.sent or job.calls > 1
                )
        self._reap(now)
        return [r if r is not None else RowResult(b"") for r in results]

    # ------------------------------------------------------------------ admission
    def _admit(self, row: Row, now: float) -> RowResult | Job:
        if row.body is None:
            raise ServiceError(ErrorCode.INVALID_REQUEST, "empty request body")
        command: Command = self.codec.decode_request(row.body)
        if isinstance(command, OpenCommand):
            return self._admit_open(row, command, now)
        if isinstance(command, ChatCommand):
            return self.chat.admit(row, command, now)
        if isinstance(command, NewSessionCommand):
            try:
                return self.chat.open_session(row)
            except ServiceError as err:
                err.dialect = "openai"
                raise
        sid = row.session_id
        if row.minted or not sid or sid == NEW_SESSION_LITERAL:
            raise ServiceError(
                ErrorCode.MISSING_SESSION_ID, f"{command.kind} needs the {SESSION_ID_HEADER} header of an open session"
            )
        if isinstance(command, AddImageCommand):
            return self._admit_image(row, sid, command, now)
        if isinstance(command, ResetCommand):
            self.engine.reset(sid)
            return RowResult(self.codec.encode_reset(sid), headers={SESSION_ID_HEADER: sid})
        if not isinstance(command, GenerateCommand):  # close
            self.engine.close(sid)
            return RowResult(self.codec.encode_close(sid), headers=self._closed_headers(sid))
        self.engine.check_idle(sid)  # a gone or busy session is the more precise answer
        self.check_generation_slot()
        gen = self.engine.start(
            sid,
            command.prompt,
            command.params,
            remember=command.remember,
            context_policy=command.context_policy,
            clip_max_new_tokens=command.clip_max_new_tokens,
        )
        return Job(row.request_id, sid, command, now, work=gen)

    def check_generation_slot(self) -> None:
        """Raise ``overloaded`` when ``max_concurrent_generations`` answers are in flight."""
        if sum(isinstance(j.work, Generation) for j in self._jobs.values()) >= self.settings.max_concurrent_generations:
            raise overloaded("too many generations in flight on this worker; retry shortly", "generation_slot")

    def session_id_for_open(self, row: Row) -> str:
        """The id a new session gets: TorchServe's minted or the client's own, else (the shared
        ``NEW_SESSION`` group, or no sequence batching) a new ``llava-<uuid4>``.

        Raises:
            ServiceError: invalid_request (an id not valid, or already open).
        """
        sid = row.session_id
        if sid is None or sid == NEW_SESSION_LITERAL:
            sid = f"llava-{uuid.uuid4()}"
        elif not row.minted and not SESSION_ID_RE.match(sid):
            raise ServiceError(ErrorCode.INVALID_REQUEST, f"{SESSION_ID_HEADER} is not a valid session id")
        if sid in self.engine.store:
            raise ServiceError(ErrorCode.INVALID_REQUEST, "a session with this id is already open")
        return sid

    def _admit_open(self, row: Row, command: OpenCommand, now: float) -> RowResult | Job:
        """Admit an open: the id (:meth:`session_id_for_open`), then the image path
        (:meth:`_admit_image`); a failed open leaves no session behind and ends its own TorchServe
        job group."""
        own_group = bool(row.session_id) and row.session_id != NEW_SESSION_LITERAL
        sid = self.session_id_for_open(row)
        try:
            return self._admit_image(row, sid, command, now, own_group=own_group)
        except ServiceError as err:
            return self.error_result(sid if own_group else None, err)

    def _admit_image(
        self, row: Row, sid: str, command: OpenCommand | AddImageCommand, now: float, *, own_group: bool = True
    ) -> Job:
        """Admit an open or an added image: everything that decides its status happens here (the
        session's state, the fetch, the decode, room for it), since TorchServe fixes status and
        headers with the first frame; the vision tower and the prefill then run in scheduler steps.

        Raises:
            ServiceError: from the fetch, the decode and the engine's admission.
        """
        if isinstance(command, AddImageCommand):
            self.engine.check_idle(sid)  # before any fetch: a gone or busy session is the precise answer
        t0 = time.perf_counter()
        sources = [command.image, *(command.history_images if isinstance(command, OpenCommand) else ())]
        data = [self.fetch(source, self.settings) for source in sources]
        t_fetched = time.perf_counter()
        images = [decode_image(b, max_pixels=self.settings.max_image_pixels) for b in data]
        t_decoded = time.perf_counter()
        if isinstance(command, OpenCommand):
            task = self.engine.begin_open(
                sid,
                data[0],
                command.system_prompt,
                image=images[0],
                history=list(command.history),
                history_images=list(zip(data[1:], images[1:], strict=True)),
            )
        else:
            task = self.engine.begin_add_image(sid, data[0], image=images[0])
        job = Job(row.request_id, sid, command, now, work=task, own_group=own_group, t0=t0)
        job.intake_timings = {"fetch": elapsed_ms(t0, t_fetched), "decode": elapsed_ms(t_fetched, t_decoded)}
        return job

    # ------------------------------------------------------------------ scheduling
    def _advance(self, jobs: list[Job]) -> None:
        """Run up to ``step_max_tokens`` scheduler steps within ``step_max_ms`` (at least one).

        Each step advances every running job by one token: the jobs that still need their prefill
        run it, and all the others decode together in one forward pass (:meth:`SessionEngine.step`).
        """
        deadline = time.perf_counter() + self.settings.step_max_ms / 1000.0
        running = [j for j in jobs if not j.work.done and j.error is None]
        for step in range(self.settings.step_max_tokens):
            running = [j for j in running if not j.work.done]
            if not running or (step > 0 and time.perf_counter() >= deadline):
                break
            self._engine_step(running)

    def _engine_step(self, running: list[Job]) -> None:
        """One scheduler step over ``running``; a job whose work failed gets its typed error."""
        self.engine.step([j.work for j in running], prefill_budget=self.settings.step_token_budget)
        for job in running:
            exc = job.work.error
            if exc is None or job.error is not None:
                continue
            if isinstance(exc, ServiceError):
                job.error = exc
            else:
                log.error("generation failed", exc_info=exc, extra={"session_id": job.session_id})
                job.error = ServiceError(ErrorCode.INTERNAL_ERROR, "internal error during generation")

    def run_ahead(self) -> bool:
        """Between ``handle()`` calls, advance the jobs in flight by one scheduler step, each at most
        ``step_max_tokens`` steps past the last call it was in; the next call emits what they made.

        A replica process (llava_sessions.replicas) calls this while no call is waiting, so its device
        keeps decoding while the other replicas finish their slices and TorchServe's round trip goes
        on. The bound keeps an answer whose client left (TorchServe stops bringing its job back) from
        decoding on. Returns False when there was nothing to run. Never raises.
        """
        running = [
            j
            for j in self._jobs.values()
            if not j.work.done and j.error is None and j.ahead < self.settings.step_max_tokens
        ]
        if not running:
            return False
        try:
            self._engine_step(running)
        except Exception:  # noqa: BLE001 - as in handle(): the jobs' own errors are recorded by _engine_step
            log.exception("run-ahead step failed")
            return False
        for job in running:
            job.ahead += 1
        return True

    # ------------------------------------------------------------------ output
    def _emit(self, job: Job) -> RowResult:
        """The row's output for this call. The first call fixes status, headers and content type
        (TorchServe sends them with the first frame, even an empty one)."""
        if isinstance(job.work, ImageTask):
            return self._emit_image_task(job, job.work)
        if isinstance(job.command, ChatCommand):
            return self.chat.emit(job)
        gen, command, codec = job.work, job.command, self.codec
        assert isinstance(command, GenerateCommand) and isinstance(gen, Generation)
        finished = gen.done or job.error is not None
        if command.stream:
            new = gen.events[job.emitted :]
            job.emitted = len(gen.events)
            if not finished:
                return self._chunk(job, codec.encode_tokens(new), last=False)
            self.forget(job)
            if job.error is None:  # the last token goes out with generated_text and details (TGI's shape)
                assert gen.answer is not None and new, "an answer ends in the step that generated its last token"
                self.metrics.observe_answer(gen.answer)
                end = codec.encode_stream_end(command, gen.answer, new[-1])
                return self._chunk(job, codec.encode_tokens(new[:-1]) + end, last=True)
            body = codec.encode_tokens(new)
            if not job.sent and not body:
                return self.error_result(job.session_id, job.error, chunk=job.calls > 1)
            self.metrics.count_error(job.error)
            return self._chunk(job, body + codec.encode_stream_error(job.error), last=True)
        if not finished:
            return RowResult(b"", headers={SESSION_ID_HEADER: job.session_id}, stop=False)
        self.forget(job)
        if job.error is not None:
            return self.error_result(job.session_id, job.error, chunk=job.calls > 1)
        assert gen.answer is not None
        self.metrics.observe_answer(gen.answer)
        return RowResult(
            codec.encode_answer(command, gen.answer),
            headers={SESSION_ID_HEADER: job.session_id},
            stop=True if job.calls > 1 else None,
        )

    def _emit_image_task(self, job: Job, task: ImageTask) -> RowResult:
        """An open's or added image's output: empty frames (with the session headers and status 200)
        until it is done, then its body; an error after the first frame is the body (its status is
        already out). An open's headers carry the new session id and its ``Expires``."""
        if task.kind_of_task == "open":
            value = session_header_value(job.session_id, task.session.expires_at)
            headers = {SESSION_ID_HEADER: value, NEW_SESSION_ID_HEADER: value}
        else:
            headers = {SESSION_ID_HEADER: job.session_id}
        if not task.done and job.error is None:
            return RowResult(b"", headers=headers, stop=False)
        self.forget(job)
        if job.error is not None:
            task.close()
            return self.error_result(job.session_id if job.own_group else None, job.error, chunk=job.calls > 1)
        result = task.result
        assert result is not None
        timings = {**job.intake_timings, **result.timings, "total": elapsed_ms(job.t0)}
        if isinstance(job.command, OpenCommand) and isinstance(result, OpenResult):
            body = self.codec.encode_open(job.command, result, timings)
        else:
            assert isinstance(result, AddImageResult)
            body = self.codec.encode_add_image(result, timings)
        return RowResult(body, headers=headers, stop=True if job.calls > 1 else None)

    def _chunk(self, job: Job, body: bytes, *, last: bool) -> RowResult:
        # A stream that ends in its first frame is one whole response: TorchServe sends no response
        # head for a first frame that is also the last chunk (verified: the client hangs).
        stop: bool | None = (True if job.sent else None) if last else False
        job.sent = True  # the first frame, even empty, fixes status and headers
        return RowResult(body, headers={SESSION_ID_HEADER: job.session_id}, content_type=JSON_LINES, stop=stop)

    def forget(self, job: Job, *, abandon: bool = False) -> None:
        """Drop ``job`` from the jobs in flight (``abandon``: its work is closed first, its session
        left as before it); a one-shot chat request's session goes with it."""
        self._jobs.pop(job.request_id, None)
        if abandon:
            job.work.close()
        if job.one_shot:
            self.close_quietly(job.session_id)

    def close_quietly(self, session_id: str) -> None:
        """Close ``session_id`` if it is open and idle; never raises."""
        try:
            self.engine.close(session_id)
        except ServiceError:
            pass

    def _closed_headers(self, session_id: str) -> dict[str, str]:
        return {CLOSED_SESSION_ID_HEADER: session_id, self.end_header: session_id}

    def error_result(self, session_id: str | None, err: ServiceError, *, chunk: bool = False) -> RowResult:
        """A JSON error row for the request of TorchServe job group ``session_id``.

        A request that leaves no open session behind (unknown, expired or evicted id, failed
        open, missing id) gets the closed/sequence-end header: TorchServe frees the job group at
        once and the router learns the session is gone. The shared ``NEW_SESSION`` group is
        never ended.
        """
        self.metrics.count_error(err)
        if err.code is ErrorCode.IMAGE_FETCH_FAILED:  # the operator's to fix (credentials, a role, the network)
            log.warning("image fetch failed: %s", err.message, extra={"session_id": session_id})
        headers: dict[str, str] = {}
        if session_id and session_id != NEW_SESSION_LITERAL and session_id not in self.engine.store:
            headers.update(self._closed_headers(session_id))
        if err.retry_after_s:
            headers["Retry-After"] = str(err.retry_after_s)
        return RowResult(self.codec.encode_error(err), status=err.status, headers=headers, stop=True if chunk else None)

    def _drop_abandoned(self, rows: list[Row]) -> None:
        """Abandon the jobs of sessions that have a NEW request in this batch.

        TorchServe hands a session its next request only once the previous one left the job
        group; when a client disconnects mid-stream it drops the job silently and never brings it
        back ("Connection to client got closed; Removing job"). So a new request for a session
        whose job is not in this batch means that job is gone: close its generation (the session
        returns to its state before that question) instead of answering 409 until it goes stale.
        """
        in_batch = {row.request_id for row in rows}
        new_sessions = {row.session_id for row in rows if row.request_id not in self._jobs and row.session_id}
        for rid, job in list(self._jobs.items()):
            if job.session_id in new_sessions and rid not in in_batch:
                self.forget(job, abandon=True)
                log.info("dropped a job its client abandoned", extra={"session_id": job.session_id})

    def _reap(self, now: float) -> None:
        """Abandon jobs TorchServe stopped bringing back (their sessions become usable again)."""
        for job in list(self._jobs.values()):
            if now - job.last_seen > STALE_JOB_S:
                self.forget(job, abandon=True)
                log.warning("abandoned a job TorchServe stopped polling", extra={"session_id": job.session_id})

    # ------------------------------------------------------------------ entry helpers
    def internal_error(self) -> RowResult:
        """A 500 ``internal_error`` row (the entry's last line of defence)."""
        return self.error_result(None, ServiceError(ErrorCode.INTERNAL_ERROR, "internal error"))

    def placement_stats(self) -> dict[str, int]:
        """What a replica router places new sessions by: ``free_bytes`` (device budget left, bytes),
        ``num_sessions``, ``max_sessions`` and ``new_session_bytes`` (what one new session's image
        features and prefix KV cost, bytes)."""
        engine, store = self.engine, self.engine.store
        if self._new_session_bytes is None:  # the prefix is templated once, not per call
            runner = engine.runner
            chat = Chat(self.settings.system_prompt, image_tokens=(runner.num_image_tokens,))
            self._new_session_bytes = engine.new_session_bytes(len(runner.template.prefix_ids(chat)))
        return {
            "free_bytes": store.device_budget_bytes - store.device_bytes(),
            "num_sessions": len(store),
            "new_session_bytes": self._new_session_bytes,
            "max_sessions": self.settings.max_sessions,
        }

    def emit_metrics(self) -> None:
        """Publish the worker's metrics (:meth:`WorkerMetrics.emit`); never raises."""
        self.metrics.emit(self.engine)
