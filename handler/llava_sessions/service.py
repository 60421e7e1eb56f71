"""The session service: protocol in, engine work, protocol out, on TorchServe's continuous batching.

TorchServe (sequence batching + continuous batching) calls the handler with a batch of rows; a
row is a new request or a job that asked to continue (its stopping criterion returned False).
Each :meth:`SessionService.handle` call

1. admits the new rows: parses them (:mod:`.protocol`), validates session ids and headers,
   answers opens, resets and closes at once, starts generations (:meth:`SessionEngine.start`);
   errors become per-row JSON errors with their status;
2. advances every job in the batch by a bounded slice (``step_max_tokens`` tokens each, within
   ``step_max_ms``; at least one step each), interleaving jobs token by token;
3. returns one :class:`RowResult` per row: a streamed job's new tokens as one chunk of JSON lines,
   a non-streamed job's empty output until its answer is complete (empty chunks never reach the
   client: shared/notes/torchserve-sagemaker.md), and a ``stop`` flag for the row's stopping
   criterion (None: a whole response; False: more chunks follow; True: last chunk).

TorchServe sends status and headers with a job's FIRST frame, even an empty one (verified: headers
set on a later frame are dropped). So everything that decides a status happens in the admission
call: an open runs whole there (fetch, decode, vision tower, prefix prefill), and a generation's
first step (restore + prefill, where memory errors arise) runs in the call that admits it. An
error found later is reported in the body: the last JSON line of a stream, or the JSON error body
of a non-streamed answer (status 200). Nothing raises out of :meth:`handle`.

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
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

from .config import Settings
from .engine import Answer, Generation, SessionEngine
from .errors import ErrorCode, ServiceError
from .images import decode_image, fetch_image_bytes
from .model import Turn
from .protocol import (
    CLOSED_SESSION_ID_HEADER,
    NEW_SESSION_ID_HEADER,
    NEW_SESSION_LITERAL,
    SESSION_ID_HEADER,
    SESSION_ID_RE,
    CloseResponse,
    CloseSessionRequest,
    ErrorBody,
    GenerateRequest,
    GenerateResponse,
    GenerationDetails,
    OpenSessionRequest,
    OpenSessionResponse,
    ResetRequest,
    ResetResponse,
    SendTextPromptResponse,
    StartSessionResponse,
    StreamLine,
    TokenInfo,
    format_expires,
    parse_request,
    session_header_value,
)
from .sampling import SamplingParams

log = logging.getLogger(__name__)

JSON = "application/json"
JSON_LINES = "application/jsonlines"
#: A job TorchServe has not brought back for this long is abandoned (its session freed for use).
STALE_JOB_S = 600.0


@dataclass
class Row:
    """One row of a TorchServe batch.

    Attributes:
        request_id: TorchServe's request id (stable across a job's continuations).
        session_id: the sequence id header's value (``X-Amzn-SageMaker-Session-Id``), or None.
        minted: TorchServe minted ``session_id`` because the request came without one.
        body: the request body (bytes, or the dict TorchServe decoded); None on continuations.
    """

    request_id: str
    session_id: str | None
    minted: bool
    body: Any


@dataclass
class RowResult:
    """What to answer for one row: ``body`` bytes, HTTP ``status``, response ``headers``,
    ``content_type``, and ``stop`` for the stopping criterion (None: whole response; False: a
    chunk, more follow; True: the last chunk)."""

    body: bytes
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    content_type: str = JSON
    stop: bool | None = None


@dataclass
class _Job:
    """A generation in flight, across ``handle()`` calls (keyed by TorchServe's request id)."""

    request_id: str
    session_id: str
    legacy: bool
    last_seen: float
    gen: Generation
    stream: bool = False
    details: bool = False
    calls: int = 0  # handle() calls this job was part of
    sent: bool = False  # a streamed frame went out (status and headers are fixed)
    emitted: int = 0  # token events already sent (streaming)
    error: ServiceError | None = None


class SessionService:
    """Decode → run → encode for every row, and the step-wise scheduler.

    Args:
        settings: validated handler settings.
        engine: the session engine.
        end_header: TorchServe's sequence-end response header name (``ctx.header_key_sequence_end``).
        fetch: ``(ImageSource, Settings) -> bytes`` (injectable so tests can use a local server).
        metrics: TorchServe's metrics cache (``context.metrics``), or None.
    """

    def __init__(self, settings: Settings, engine: SessionEngine, *, end_header: str = CLOSED_SESSION_ID_HEADER,
                 fetch: Callable[..., bytes] = fetch_image_bytes, metrics: Any = None) -> None:
        self.settings = settings
        self._metrics = metrics
        self._metric_objects: dict[str, Any] = {}
        self._counters_sent: dict[tuple, float] = {}
        self.engine = engine
        self.end_header = end_header
        self._fetch = fetch
        self._jobs: dict[str, _Job] = {}
        self.errors_by_code: Counter[str] = Counter()
        self.ttft_ms: list[float] = []  # read-and-reset by the metrics emitter
        self.decode_tokens_per_s: list[float] = []

    # ------------------------------------------------------------------ entry
    def handle(self, rows: list[Row]) -> list[RowResult]:
        """Admit new rows, advance every job in the batch by one slice, answer each row.

        Never raises: an unexpected error becomes that row's 500 ``internal_error``.
        """
        now = time.monotonic()
        results: list[RowResult | None] = [None] * len(rows)
        active: list[tuple[int, _Job]] = []
        self._drop_abandoned(rows)
        for i, row in enumerate(rows):
            job = self._jobs.get(row.request_id)
            if job is None:
                try:
                    admitted = self._admit(row, now)
                except ServiceError as err:
                    results[i] = self._error_result(row.session_id, err)
                    continue
                except Exception:  # noqa: BLE001 - never raise out of handle()
                    log.exception("request failed", extra={"request_id": row.request_id})
                    results[i] = self._error_result(None, ServiceError(ErrorCode.INTERNAL_ERROR, "internal error"))
                    continue
                if isinstance(admitted, RowResult):
                    results[i] = admitted
                    continue
                job = admitted
                self._jobs[row.request_id] = job
            job.last_seen = now
            job.calls += 1
            active.append((i, job))
        self._advance([job for _, job in active])
        for i, job in active:
            try:
                results[i] = self._emit(job)
            except Exception:  # noqa: BLE001
                log.exception("emit failed", extra={"request_id": job.request_id})
                self._jobs.pop(job.request_id, None)
                results[i] = self._error_result(None, ServiceError(ErrorCode.INTERNAL_ERROR, "internal error"),
                                                chunk=job.sent)
        self._reap(now)
        return [r if r is not None else RowResult(b"") for r in results]

    # ------------------------------------------------------------------ admission
    def _admit(self, row: Row, now: float) -> RowResult | _Job:
        if row.body is None:
            raise ServiceError(ErrorCode.INVALID_REQUEST, "empty request body")
        s = self.settings
        request = parse_request(row.body, max_body_bytes=s.max_body_bytes, max_prompt_chars=s.max_prompt_chars,
                                max_new_tokens_cap=s.max_new_tokens_cap)
        legacy = request.legacy
        canonical = request.canonical()
        if isinstance(canonical, OpenSessionRequest):
            return self._admit_open(row, canonical, legacy)
        sid = row.session_id
        if row.minted or not sid or sid == NEW_SESSION_LITERAL:
            raise ServiceError(ErrorCode.MISSING_SESSION_ID,
                               f"{canonical.type} needs the {SESSION_ID_HEADER} header of an open session")
        if isinstance(canonical, ResetRequest):
            self.engine.reset(sid)
            return RowResult(ResetResponse(session_id=sid).model_dump_json().encode(), headers={SESSION_ID_HEADER: sid})
        if isinstance(canonical, CloseSessionRequest):
            self.engine.close(sid)
            # one reply for both: the AWS sample reads "success", ours "closed"
            return RowResult(CloseResponse(session_id=sid).model_dump_json().encode(), headers=self._closed_headers(sid))
        assert isinstance(canonical, GenerateRequest)
        self.engine.check_idle(sid)  # a gone or busy session is the more precise answer
        if len(self._jobs) >= s.max_concurrent_generations:
            raise ServiceError(ErrorCode.OVERLOADED, "too many generations in flight on this worker; retry shortly",
                               retry_after_s=1)
        p = canonical.parameters
        params = SamplingParams(
            max_new_tokens=p.max_new_tokens or s.default_max_new_tokens, temperature=p.temperature, top_p=p.top_p,
            top_k=p.top_k, repetition_penalty=p.repetition_penalty, do_sample=p.do_sample, seed=p.seed,
            stop=tuple(p.stop), logprobs=p.details or canonical.stream,
        )
        gen = self.engine.start(sid, canonical.prompt, params, remember=canonical.remember)
        return _Job(row.request_id, sid, legacy, now, gen=gen, stream=canonical.stream and not legacy,
                    details=p.details)

    def _admit_open(self, row: Row, request: OpenSessionRequest, legacy: bool) -> RowResult:
        """Open a session in the admission call: status and headers of a TorchServe reply are fixed
        by the first frame, so fetch, decode, vision tower and prefix prefill all happen here."""
        sid = row.session_id
        own_group = bool(sid) and sid != NEW_SESSION_LITERAL
        if not own_group:
            # No TorchServe-minted id (NEW_SESSION literal, or no sequence batching): mint one.
            sid = f"llava-{uuid.uuid4()}"
        elif not row.minted and not SESSION_ID_RE.match(sid):
            raise ServiceError(ErrorCode.INVALID_REQUEST, f"{SESSION_ID_HEADER} is not a valid session id")
        if sid in self.engine.store:
            raise ServiceError(ErrorCode.INVALID_REQUEST, "a session with this id is already open")
        try:
            data = self._fetch(request.image, self.settings)
            image = decode_image(data, max_pixels=self.settings.max_image_pixels)
            history = [Turn(t.prompt, t.answer) for t in request.history]
            result = self.engine.open(sid, data, request.system_prompt or self.settings.system_prompt, image=image,
                                      history=history)
        except ServiceError as err:
            # the open failed: no session is left behind; end TorchServe's job group if it is its own
            return self._error_result(sid if own_group else None, err)
        value = session_header_value(sid, result.expires_at)
        headers = {SESSION_ID_HEADER: value, NEW_SESSION_ID_HEADER: value}
        if legacy:
            body = StartSessionResponse(session_id=sid).model_dump_json()
        else:
            timings = {f"{k}_ms": v for k, v in result.timings.items()}
            body = OpenSessionResponse(session_id=sid, expires_at=format_expires(result.expires_at),
                                       image_tokens=result.image_tokens, timings=timings).model_dump_json()
        return RowResult(body.encode(), headers=headers)

    # ------------------------------------------------------------------ scheduling
    def _advance(self, jobs: list[_Job]) -> None:
        """Advance each job by up to ``step_max_tokens`` steps within ``step_max_ms`` (≥ 1 step each)."""
        deadline = time.perf_counter() + self.settings.step_max_ms / 1000.0
        gens = [j for j in jobs if not j.gen.done and j.error is None]
        for step in range(self.settings.step_max_tokens):
            if step > 0 and time.perf_counter() >= deadline:
                break
            for job in gens:
                if job.gen.done or job.error is not None:
                    continue
                try:
                    next(job.gen, None)
                except ServiceError as err:
                    job.error = err
                except Exception:  # noqa: BLE001
                    log.exception("generation failed", extra={"session_id": job.session_id})
                    job.error = ServiceError(ErrorCode.INTERNAL_ERROR, "internal error during generation")

    # ------------------------------------------------------------------ output
    def _emit(self, job: _Job) -> RowResult:
        """The row's output for this call. The first call fixes status, headers and content type
        (TorchServe sends them with the first frame, even an empty one)."""
        gen = job.gen
        assert gen is not None
        finished = gen.done or job.error is not None
        if job.stream:
            lines = [StreamLine(token=TokenInfo(id=e.id, text=e.text, logprob=e.logprob)).to_line()
                     for e in gen.events[job.emitted:]]
            job.emitted = len(gen.events)
            if finished:
                self._jobs.pop(job.request_id, None)
                if job.error is not None:
                    if not job.sent and not lines:
                        return self._error_result(job.session_id, job.error, chunk=job.calls > 1)
                    self._count_error(job.error)
                    lines.append(StreamLine.for_error(job.error).to_line())
                else:
                    answer = gen.answer
                    assert answer is not None
                    self._observe(answer)
                    lines.append(StreamLine(generated_text=answer.text, details=self._details(answer, job.details)).to_line())
                return self._chunk(job, b"".join(lines), last=True)
            return self._chunk(job, b"".join(lines), last=False)
        if not finished:
            return RowResult(b"", headers={SESSION_ID_HEADER: job.session_id}, stop=False)
        self._jobs.pop(job.request_id, None)
        if job.error is not None:
            return self._error_result(job.session_id, job.error, chunk=job.calls > 1)
        answer = gen.answer
        assert answer is not None
        self._observe(answer)
        if job.legacy:
            body = SendTextPromptResponse(response_text=answer.text).model_dump_json()
        else:
            body = GenerateResponse(generated_text=answer.text, details=self._details(answer, job.details)).model_dump_json()
        return RowResult(body.encode(), headers={SESSION_ID_HEADER: job.session_id},
                         stop=True if job.calls > 1 else None)

    def _chunk(self, job: _Job, body: bytes, *, last: bool) -> RowResult:
        # A stream that ends in its first frame is one whole response: TorchServe sends no response
        # head for a first frame that is also the last chunk (verified: the client hangs).
        stop: bool | None = (True if job.sent else None) if last else False
        job.sent = True  # the first frame, even empty, fixes status and headers
        return RowResult(body, headers={SESSION_ID_HEADER: job.session_id}, content_type=JSON_LINES, stop=stop)

    @staticmethod
    def _details(answer: Answer, with_tokens: bool) -> GenerationDetails:
        t = answer.timings
        timings = {f"{k}_ms": v for k, v in t.items() if k != "decode_tokens_per_s"}
        timings["decode_tokens_per_s"] = t.get("decode_tokens_per_s", 0.0)
        tokens = [TokenInfo(id=e.id, text=e.text, logprob=e.logprob) for e in answer.tokens] if with_tokens else None
        return GenerationDetails(finish_reason=answer.finish_reason, prompt_tokens=answer.prompt_tokens,
                                 cached_tokens=answer.cached_tokens, generated_tokens=answer.generated_tokens,
                                 tokens=tokens, timings=timings)

    def _observe(self, answer: Answer) -> None:
        self.ttft_ms.append(answer.timings.get("ttft", 0.0))
        self.decode_tokens_per_s.append(answer.timings.get("decode_tokens_per_s", 0.0))

    def _closed_headers(self, session_id: str) -> dict[str, str]:
        return {CLOSED_SESSION_ID_HEADER: session_id, self.end_header: session_id}

    def _count_error(self, err: ServiceError) -> None:
        self.errors_by_code[err.code.value] += 1

    def _error_result(self, session_id: str | None, err: ServiceError, *, chunk: bool = False) -> RowResult:
        """A JSON error row for the request of TorchServe job group ``session_id``.

        A request that leaves no open session behind (unknown, expired or evicted id, failed
        open, missing id) gets the closed/sequence-end header: TorchServe frees the job group at
        once and the router learns the session is gone. The shared ``NEW_SESSION`` group is
        never ended.
        """
        self._count_error(err)
        headers: dict[str, str] = {}
        if session_id and session_id != NEW_SESSION_LITERAL and session_id not in self.engine.store:
            headers.update(self._closed_headers(session_id))
        if err.retry_after_s:
            headers["Retry-After"] = str(err.retry_after_s)
        body = ErrorBody.from_error(err).model_dump_json().encode()
        return RowResult(body, status=err.status, headers=headers, stop=True if chunk else None)

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
                self._jobs.pop(rid, None)
                job.gen.close()
                log.info("dropped a job its client abandoned", extra={"session_id": job.session_id})

    def _reap(self, now: float) -> None:
        """Abandon jobs TorchServe stopped bringing back (their sessions become usable again)."""
        for rid, job in list(self._jobs.items()):
            if now - job.last_seen > STALE_JOB_S:
                self._jobs.pop(rid, None)
                job.gen.close()
                log.warning("abandoned a job TorchServe stopped polling", extra={"session_id": job.session_id})


    # ------------------------------------------------------------------ metrics
    def internal_error(self) -> RowResult:
        """A 500 ``internal_error`` row (the entry's last line of defence)."""
        return self._error_result(None, ServiceError(ErrorCode.INTERNAL_ERROR, "internal error"))

    def metrics_snapshot(self) -> dict[str, Any]:
        """Current gauges and monotonic counters (see docs/design.md, Metrics)."""
        store, engine = self.engine.store, self.engine
        by_tier = store.bytes_by_tier()
        st = store.stats
        return {
            "gauges": {
                ("OpenSessions", ()): len(store),
                ("SessionBytes", ("kv",)): by_tier["kv"],
                ("SessionBytes", ("features",)): by_tier["features"],
                ("SessionBytes", ("image",)): by_tier["image"],
            },
            "counters": {
                ("Demotions", ("kv",)): st.num_demotions_kv,
                ("Demotions", ("features",)): st.num_demotions_features,
                ("Restores", ()): st.num_restores,
                ("SessionsEvicted", ()): st.num_evicted,
                ("SessionsExpired", ()): st.num_expired,
                ("ReusedPromptTokens", ()): engine.num_reused_tokens,
                ("PrefilledPromptTokens", ()): engine.num_prefilled_tokens,
                **{("Errors", (code,)): n for code, n in self.errors_by_code.items()},
            },
        }

    def emit_metrics(self) -> None:
        """Publish metrics through TorchServe's metrics API (Prometheus on the metrics port).

        Gauges are set, counters advanced by their change since the last call, and each answer's
        time to first token (ms) and decode rate (tokens/s) recorded as histogram / gauge samples.
        Never raises.
        """
        if self._metrics is None:
            return
        try:
            from ts.metrics.metric_type_enum import MetricTypes

            snap = self.metrics_snapshot()
            updates: list[tuple[str, tuple, float, Any, str]] = []
            for (name, dims), value in snap["gauges"].items():
                updates.append((name, dims, value, MetricTypes.GAUGE, "Bytes" if name == "SessionBytes" else "Count"))
            for key, value in snap["counters"].items():
                delta = value - self._counters_sent.get(key, 0)
                if delta:
                    self._counters_sent[key] = value
                    updates.append((key[0], key[1], delta, MetricTypes.COUNTER, "Count"))
            for v in self.ttft_ms:  # seconds: Prometheus' default histogram buckets are in seconds
                updates.append(("TimeToFirstTokenSeconds", (), v / 1000.0, MetricTypes.HISTOGRAM, "s"))
            for v in self.decode_tokens_per_s:
                updates.append(("DecodeTokensPerSecond", (), v, MetricTypes.GAUGE, "Count"))
            self.ttft_ms.clear()
            self.decode_tokens_per_s.clear()
            for name, dims, value, mtype, unit in updates:
                dim_names = _METRIC_DIMS.get(name, [])
                metric = self._metric_objects.get(name)
                if metric is None:
                    metric = self._metrics.add_metric_to_cache(f"llava_{name}", unit, ["ModelName", *dim_names], mtype)
                    self._metric_objects[name] = metric
                metric.add_or_update(value, ["llava", *dims])
        except Exception:  # noqa: BLE001 - metrics must never hurt serving
            log.debug("metrics emission failed", exc_info=True)


_METRIC_DIMS = {"SessionBytes": ["Tier"], "Demotions": ["Tier"], "Errors": ["Code"]}


def build_service(handler_section: dict, *, env: Any = None, archive_dir: str | None = None, gpu_id: int | None = None,
                  end_header: str = CLOSED_SESSION_ID_HEADER, metrics: Any = None) -> SessionService:
    """Build settings, model, store, engine and service for one worker.

    Args:
        handler_section: the ``handler:`` section of model-config.yaml.
        env: environment overrides (``LLAVA_*``).
        archive_dir: TorchServe's model directory; used as the checkpoint folder when
            ``model_dir`` is empty and it holds a config.json.
        gpu_id: TorchServe's GPU for this worker (``settings.gpu_id`` wins).
        end_header: TorchServe's sequence-end header name.
        metrics: TorchServe's metrics cache (``context.metrics``) or None.

    Raises:
        ValueError: invalid settings; FileNotFoundError: no checkpoint folder.
    """
    import functools
    from pathlib import Path

    from .engine import EngineLimits, default_device_budget
    from .model import LlavaRunner
    from .sessions import SessionStore

    settings = Settings.from_sources(handler_section, env)
    logging.getLogger("llava_sessions").setLevel(settings.log_level)
    model_dir = settings.model_dir
    if not model_dir and archive_dir and (Path(archive_dir) / "config.json").is_file():
        model_dir = archive_dir
    if not model_dir:
        raise FileNotFoundError("no model folder: set handler.model_dir or LLAVA_MODEL_DIR")
    runner = LlavaRunner.from_pretrained(model_dir, device=settings.device,
                                         gpu_id=settings.gpu_id if settings.gpu_id is not None else gpu_id,
                                         dtype=settings.dtype)
    budget = settings.device_budget_bytes or default_device_budget(runner, settings.device_budget_fraction)
    store = SessionStore(device_budget_bytes=budget, host_budget_bytes=settings.host_budget_bytes,
                         max_sessions=settings.max_sessions, ttl_s=settings.session_ttl_s,
                         idle_timeout_s=settings.idle_timeout_s)
    engine = SessionEngine(runner, store, functools.partial(decode_image, max_pixels=settings.max_image_pixels),
                           EngineLimits(max_new_tokens_cap=settings.max_new_tokens_cap,
                                        max_prompt_tokens=settings.max_prompt_tokens))
    log.warning("llava-sessions ready", extra={"model_dir": model_dir, "device": str(runner.device),
                                                "device_budget_bytes": budget})
    return SessionService(settings, engine, end_header=end_header, metrics=metrics)
