"""Model replicas of one TorchServe worker: one process per device, sessions placed and routed here.

SageMaker's sticky routing pins a session to an *instance*; inside it, one TorchServe worker (more
are refused: they lose ``NEW_SESSION`` follow-ups, docs/decisions/42-one-worker.md) receives every request. With
``devices`` naming N > 1 devices, that worker's handler is a :class:`ReplicaRouter`:

- it starts one **replica process** per device (``multiprocessing`` spawn). Each builds its own
  model copy, session store (its device's KV budget, its own ``max_sessions``, 1/N of the host
  budget) and :class:`~llava_sessions.service.SessionService`, and serves the requests it is
  sent exactly as a lone worker would (the same scheduler, batched decode, errors per request);
- :meth:`ReplicaRouter.handle` splits a TorchServe batch by replica and sends every part at once,
  so the replicas' forward passes run at the same time in different processes (two model copies in
  threads of one interpreter serialise on the GIL: 1.07-1.17x measured, vs 1.85x in processes);
- **placement**: a request in flight goes to its replica; a request naming a placed session to that
  session's replica; a chat request without a session (no header, or a TorchServe-minted id) to the
  replica that last answered a request of its prefix key (:func:`~.wire.affinity.prefix_key`: its
  salt, system prompt and first user message), where the conversation cache holds its turns; anything
  else (``NEW_SESSION``, an unknown id, a first turn) to the replica with the most room, ties to the
  fewest sessions, as each
  replica reported after its last call (counted forward within a batch). Room is the free KV budget
  in sessions (free bytes / one new session's features + prefix KV), capped by the replica's free
  session slots, so equal GPUs fill evenly and a fuller or smaller device gets fewer. An answer carrying
  ``X-Amzn-SageMaker-New-Session-Id`` places that id; one carrying the Closed header removes it;
- **faults**: an error inside a replica's step fails that replica's requests with typed errors (as
  in any worker). A replica process that dies (or, tensor parallel, ends because one of its ranks
  died) costs no client error, as a dead worker behind the proxy costs none: its requests in flight get
  the retryable ``503 model_not_ready`` with ``Retry-After``, or, a stream whose first frame went out,
  that code as its last event (:func:`~.wire.framing.cut_stream_tail`), which ``llava_client`` sends
  again; its sessions are lost (their ids then get 404 ``session_not_found`` + the Closed header from a
  live replica, and clients reopen them with their history); it is started again in the background,
  and the other replicas keep serving.

**Each replica sees only its GPUs.** A replica on ``cuda:k`` (with ``tensor_parallel_size`` N: GPUs ``k``
to ``k + N - 1``) starts with ``CUDA_VISIBLE_DEVICES`` naming those GPUs alone (:func:`replica_environment`),
as TorchServe and vLLM give each worker its own GPU, so inside it the model runs on ``cuda:0`` and that
is the current device from the first CUDA call on. Without it, every replica's current device is GPU 0:
``torch.cuda.graph`` captures on the current device's side stream, so replicas 1..N-1 would capture
empty graphs and replay stale logits, their events would record on GPU 0's stream, and each would open a
context there. A CPU replica sees no GPU.

Pipes carry plain data: ``(BatchRequest list, request ids whose clients left)`` in, ``(Reply list, stats,
metrics payload)`` out; image bytes cross once, with the open request. A request in flight that TorchServe's batch
lacks is gone (its client left; :meth:`~llava_sessions.service.SessionService.handle`): the router,
which alone sees the whole batch, tells its replica, in a call of its own if no request goes there.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any

from .config import Settings, resolve_devices
from .errors import ErrorCode, ServiceError
from .metrics import WorkerMetrics
from .native.responses import encode_error
from .service import SessionService
from .wire.affinity import prefix_key
from .wire.contract import CLOSED_SESSION_ID_HEADER, NEW_SESSION_ID_HEADER, SEQUENCE_END_HEADER
from .wire.framing import JSON, BatchRequest, Framing, Reply, cut_stream_tail

__all__ = ["ReplicaRouter", "replica_environment", "resolve_devices"]

log = logging.getLogger(__name__)

#: Seconds a replica may take to load its model before the worker gives up on it.
REPLICA_START_TIMEOUT_S = 3600.0
#: Prefix keys remembered (least recently answered forgotten first).
MAX_PREFIX_KEYS = 100_000
#: ``Retry-After`` (seconds) of a request that no live replica can take, or whose replica died.
REPLICA_RETRY_AFTER_S = 5
#: What a request whose replica died with it in flight is told (``model_not_ready``).
REPLICA_LOST = "the model replica serving this request stopped (it restarts)"
#: The environment variable CUDA reads, when it initialises, for the GPUs a process may see (NVIDIA,
#: "CUDA C++ Programming Guide", CUDA environment variables).
VISIBLE_GPUS_ENV = "CUDA_VISIBLE_DEVICES"

#: Held while a replica process starts: its GPUs are set in this process's environment for the moment
#: of the start (``multiprocessing``'s spawn copies the environment; it takes no environment of its own).
_SPAWN_LOCK = threading.Lock()


def replica_environment(device: str, tensor_parallel_size: int, visible: str | None) -> tuple[str | None, str]:
    """The GPUs a replica on ``device`` may see, and the device it names inside its process.

    Args:
        device: the replica's device as ``devices`` names it (``"cuda:1"``, ``"cuda"``, ``"cpu"``, or
            ``""``: the model's own choice, left as it is).
        tensor_parallel_size: GPUs per replica (its ranks take the GPUs after its own).
        visible: this process's ``CUDA_VISIBLE_DEVICES`` (None: unset, every GPU visible); ``cuda:k``
            counts within it, as CUDA does.

    Returns:
        ``(CUDA_VISIBLE_DEVICES for the replica, or None to leave it as it is; the replica's device)``:
        ``cuda:k`` gives the ``k``-th to ``(k + N - 1)``-th visible GPUs and ``cuda:0``; ``cpu`` gives
        ``""`` (no GPU) and ``cpu``.

    Raises:
        ValueError: ``visible`` lists fewer GPUs than the replica needs.
    """
    kind, _, index = device.partition(":")
    if kind == "cpu":
        return "", device
    if kind != "cuda":
        return None, device
    first, size = int(index or 0), max(1, tensor_parallel_size)
    if visible is None:
        gpus = [str(i) for i in range(first + size)]
    else:
        gpus = [g.strip() for g in visible.split(",") if g.strip()]
    if len(gpus) < first + size:
        raise ValueError(
            f"devices names {device} with tensor_parallel_size {size}, but {VISIBLE_GPUS_ENV}={visible!r} "
            f"lists {len(gpus)} GPU(s); name visible GPUs only"
        )
    return ",".join(gpus[first : first + size]), "cuda:0"


def replica_settings(settings: Settings, device: str, num_replicas: int) -> Settings:
    """``settings`` for one replica on ``device``: its device / gpu_id and 1/N of the host budget
    (at least 1 byte; host memory is the instance's, shared). ``max_sessions`` is per replica (a
    GPU's own KV budget bounds it), so it is kept whole."""
    update: dict[str, Any] = {"devices": device or "auto"}
    if device:
        kind, _, index = device.partition(":")
        update["device"] = kind
        update["gpu_id"] = int(index) if index else (0 if kind == "cuda" else None)
    if num_replicas > 1:
        update["host_budget_bytes"] = max(1, settings.host_budget_bytes // num_replicas)
        if not settings.torch_threads and device == "cpu":
            update["torch_threads"] = max(1, (os.cpu_count() or 1) // num_replicas)
    return settings.model_copy(update=update)


def _replica_main(
    conn: Connection, index: int, num_replicas: int, builder: Callable[..., SessionService], build: dict[str, Any]
) -> None:
    """A replica process: build a service on its device, then serve the requests it is sent until the
    pipe closes (the worker exited) or ``None`` arrives; between calls its requests in flight run ahead
    (:meth:`SessionService.run_ahead`)."""
    try:
        service = builder(replica=index, num_replicas=num_replicas, **build)
    except BaseException as exc:  # noqa: BLE001 - reported to the router, which fails the start
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", service.placement_stats()))
    while True:
        try:
            # no call waiting: keep the requests in flight decoding (SessionService.run_ahead), so this
            # device does not sit idle while the other replicas and TorchServe's round trip finish
            while not conn.poll(0) and service.run_ahead():
                pass
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        batch, gone = message
        results = service.handle(batch, gone)
        conn.send((results, service.placement_stats(), service.metrics.collect(service.engine)))


class _Replica:
    """The router's handle on one replica process."""

    def __init__(self, index: int, device: str) -> None:
        self.index = index
        self.device = device
        self.process: Any = None
        self.conn: Connection | None = None
        self.stats: dict[str, int] = {"free_bytes": 0, "num_sessions": 0, "new_session_bytes": 1}
        self.alive = False


class ReplicaRouter:
    """The worker's handler core when ``devices`` names several devices (module docstring).

    Has :class:`~llava_sessions.service.SessionService`'s entry points: :meth:`handle`,
    :meth:`internal_error`, :meth:`emit_metrics`.

    Args:
        settings: the worker's validated settings.
        devices: one device per replica (``resolve_devices``).
        build: keyword arguments of ``builder`` (picklable).
        builder: builds one replica's service in its process (``llava_sessions.worker.build_local_service``,
            passed down so this module does not import the worker's wiring); a module-level function.
        metrics: TorchServe's metrics cache, or None.
        end_header: TorchServe's sequence-end header name (``ctx.header_key_sequence_end``).

    Raises:
        RuntimeError: a replica failed to start (its error in the message).
    """

    def __init__(
        self,
        settings: Settings,
        devices: list[str],
        build: Mapping[str, Any],
        metrics: Any = None,
        *,
        builder: Callable[..., SessionService],
        end_header: str = SEQUENCE_END_HEADER,
    ) -> None:
        self.settings = settings
        self.devices = devices
        self._build = dict(build)
        self._builder = builder
        self._metrics = WorkerMetrics(metrics, interval_s=settings.metrics_interval_ms / 1000.0)
        self._ctx = multiprocessing.get_context("spawn")
        self.replicas = [_Replica(i, d) for i, d in enumerate(devices)]
        self.placement: dict[str, int] = {}  # session id -> replica
        self.prefixes: OrderedDict[str, int] = OrderedDict()  # prefix key of a sessionless chat -> replica
        self._jobs: dict[str, int] = {}  # request id of a request in flight -> replica
        self._keys: dict[str, str] = {}  # request id of a sessionless chat in flight -> its prefix key
        self._types: dict[str, str] = {}  # request id in flight -> its reply's content type (a stream's dialect)
        self._lock = threading.Lock()
        self._framing = Framing(end_header)
        self._pool = ThreadPoolExecutor(max_workers=len(devices), thread_name_prefix="llava-replica")
        for replica in self.replicas:
            self._spawn(replica)
        for replica in self.replicas:  # the model loads run at the same time
            self._await_ready(replica)

    # ------------------------------------------------------------------ lifecycle
    def _spawn(self, replica: _Replica) -> None:
        """Start ``replica``'s process, seeing only its GPUs (:func:`replica_environment`)."""
        visible, device = replica_environment(
            replica.device, self.settings.tensor_parallel_size, os.environ.get(VISIBLE_GPUS_ENV)
        )
        parent, child = self._ctx.Pipe()
        replica.process = self._ctx.Process(
            target=_replica_main,
            args=(child, replica.index, len(self.replicas), self._builder, self._build | {"device": device}),
            name=f"llava-replica-{replica.index}",
            daemon=True,
        )
        with _SPAWN_LOCK:
            before = os.environ.get(VISIBLE_GPUS_ENV)
            try:
                if visible is not None:
                    os.environ[VISIBLE_GPUS_ENV] = visible
                replica.process.start()
            finally:
                if before is None:
                    os.environ.pop(VISIBLE_GPUS_ENV, None)
                else:
                    os.environ[VISIBLE_GPUS_ENV] = before
        child.close()
        replica.conn = parent

    def _await_ready(self, replica: _Replica) -> None:
        assert replica.conn is not None
        if not replica.conn.poll(REPLICA_START_TIMEOUT_S):
            raise RuntimeError(f"replica {replica.index} ({replica.device}) did not start in time")
        try:
            status, detail = replica.conn.recv()
        except (EOFError, OSError) as exc:
            raise RuntimeError(f"replica {replica.index} ({replica.device}) died while starting") from exc
        if status != "ready":
            raise RuntimeError(f"replica {replica.index} ({replica.device}) failed to start: {detail}")
        replica.stats = detail
        replica.alive = True
        log.warning("replica ready", extra={"replica": replica.index, "device": replica.device})

    def _restart(self, replica: _Replica) -> None:
        """Start a dead replica again (in a background thread); its sessions are gone."""
        try:
            if replica.process is not None:
                replica.process.join(timeout=5)
            self._spawn(replica)
            self._await_ready(replica)
        except Exception:  # noqa: BLE001 - it stays down; placement avoids it
            log.exception("replica restart failed", extra={"replica": replica.index})

    def close(self) -> None:
        """Stop every replica process."""
        for replica in self.replicas:
            if replica.conn is not None:
                try:
                    replica.conn.send(None)
                except OSError:
                    pass
            if replica.process is not None:
                replica.process.join(timeout=10)
                if replica.process.is_alive():
                    replica.process.kill()
        self._pool.shutdown(wait=False)

    # ------------------------------------------------------------------ entry
    def handle(self, batch: list[BatchRequest]) -> list[Reply]:
        """Route the requests, let every replica with requests run its slice at once, answer each request.

        Never raises: a dead replica's requests, and a new request while no replica is alive, get the
        retryable ``model_not_ready`` (:meth:`lost`, :meth:`not_ready`). Either ends the TorchServe job
        group minted for a request that came without a session (as a refused open does on a replica):
        left open, each such group would hold one of TorchServe's ``maxNumSequence`` until its idle
        timeout, and clients retrying through a restart would exhaust them (TorchServe's own 503 "has
        no worker").
        """
        parts: dict[int, list[int]] = {}
        tallies = {r.index: dict(r.stats) for r in self.replicas if r.alive}
        continuing = {i for i, request in enumerate(batch) if request.body is None}  # TorchServe's continuations
        gone = self._gone(batch)
        for index in gone:
            parts.setdefault(index, [])
        for i, request in enumerate(batch):
            target = self._route(request, tallies)
            parts.setdefault(target, []).append(i)
        results: list[Reply | None] = [None] * len(batch)
        futures = {
            index: self._pool.submit(
                self._call, self.replicas[index], [batch[i] for i in positions], gone.get(index, [])
            )
            for index, positions in parts.items()
            if index >= 0
        }
        for index, positions in parts.items():
            answers = futures[index].result() if index >= 0 else None
            for k, i in enumerate(positions):
                if answers is not None:
                    result = answers[k]
                else:
                    if index < 0 and i not in continuing:  # no replica alive to take a new request
                        result = self.not_ready()
                    else:  # its replica died with it in flight
                        result = self.lost(self._types.get(batch[i].request_id, JSON) if i in continuing else None)
                    group = batch[i].session_id
                    if batch[i].minted and group:  # a group TorchServe minted: no session holds it
                        result.headers.update(self._framing.end_sequence(group))
                results[i] = result
                self._book(batch[i], result, index)
        return [r if r is not None else Reply(b"") for r in results]

    def _gone(self, batch: list[BatchRequest]) -> dict[int, list[str]]:
        """The requests in flight that ``batch`` lacks (their clients left), by live replica; forgotten here."""
        in_batch = {request.request_id for request in batch}
        gone: dict[int, list[str]] = {}
        with self._lock:
            for rid in [rid for rid in self._types if rid not in in_batch]:
                del self._types[rid]
            for rid in [rid for rid in self._jobs if rid not in in_batch]:
                index = self._jobs.pop(rid)
                self._keys.pop(rid, None)
                if self.replicas[index].alive:
                    gone.setdefault(index, []).append(rid)
        return gone

    def _route(self, request: BatchRequest, tallies: dict[int, dict[str, int]]) -> int:
        """The replica for ``request`` (-1: none is alive)."""
        with self._lock:
            known = self._jobs.get(request.request_id)
            if known is None and request.session_id:
                known = self.placement.get(request.session_id)
        if known is not None and self.replicas[known].alive:
            return known
        if not tallies or request.body is None:  # no replica, or a request whose replica is gone
            return -1
        if request.minted or not request.session_id:  # no session: where its prefix was answered, if anywhere
            key = prefix_key(request.body, request.custom_attributes)
            if key is not None:
                with self._lock:
                    self._keys[request.request_id] = key
                    holder = self.prefixes.get(key)
                if holder is not None and holder in tallies:
                    return holder
        best = max(tallies, key=lambda i: (_room(tallies[i]), -tallies[i]["num_sessions"], -i))
        tallies[best]["free_bytes"] -= tallies[best].get("new_session_bytes", 0)
        tallies[best]["num_sessions"] += 1
        return best

    def _call(self, replica: _Replica, batch: list[BatchRequest], gone: list[str]) -> list[Reply] | None:
        """One slice on one replica (``gone``: its requests whose clients left); None when its process is
        gone (then restarted)."""
        conn = replica.conn
        try:
            assert conn is not None
            conn.send((batch, gone))
            results, stats, payload = conn.recv()
        except (EOFError, OSError, AssertionError):
            self._replica_died(replica)
            return None
        replica.stats = stats
        self._metrics.publish(payload, replica.index)
        return results

    def _replica_died(self, replica: _Replica) -> None:
        with self._lock:
            if not replica.alive:
                return
            replica.alive = False
            lost = [sid for sid, i in self.placement.items() if i == replica.index]
            for sid in lost:
                del self.placement[sid]
            for key in [k for k, i in self.prefixes.items() if i == replica.index]:
                del self.prefixes[key]
            for rid in [rid for rid, i in self._jobs.items() if i == replica.index]:
                del self._jobs[rid]
        log.error(
            "replica process died; its sessions are lost",
            extra={"replica": replica.index, "device": replica.device, "sessions": len(lost)},
        )
        threading.Thread(target=self._restart, args=(replica,), daemon=True).start()

    def _book(self, request: BatchRequest, result: Reply, index: int) -> None:
        """Record what the answer says: a request continuing, a session placed or closed."""
        headers = {k.lower(): v for k, v in result.headers.items()}
        with self._lock:
            if index >= 0 and result.stop is False:
                self._jobs[request.request_id] = index
                self._types.setdefault(request.request_id, result.content_type)  # the first frame's
            else:
                self._jobs.pop(request.request_id, None)
                self._types.pop(request.request_id, None)
                key = self._keys.pop(request.request_id, None)
                if key is not None and index >= 0 and result.status == 200:
                    self.prefixes[key] = index
                    self.prefixes.move_to_end(key)
                    if len(self.prefixes) > MAX_PREFIX_KEYS:
                        self.prefixes.popitem(last=False)
            new_id = headers.get(NEW_SESSION_ID_HEADER.lower())
            if new_id and index >= 0:
                self.placement[new_id.split(";", 1)[0].strip()] = index
            closed = headers.get(CLOSED_SESSION_ID_HEADER.lower())
            if closed:
                self.placement.pop(closed, None)

    # ------------------------------------------------------------------ the entry's helpers
    def internal_error(self) -> Reply:
        """A 500 ``internal_error`` reply (the entry's last line of defence)."""
        err = ServiceError(ErrorCode.INTERNAL_ERROR, "internal error")
        return Framing.frame(encode_error(err), continued=False, last=True, status=err.status)

    @classmethod
    def lost(cls, stream_type: str | None) -> Reply:
        """The reply to a continuing request whose replica died with it in flight: ``model_not_ready`` as a
        stream's last event in its dialect when its first frame (``stream_type``: its content type) went
        out, else the typed ``503`` with ``Retry-After`` (:meth:`not_ready`). Retryable, as the proxy
        answers a request cut by a dead worker."""
        if stream_type is None:
            return cls.not_ready(REPLICA_LOST)
        return Framing.frame(cut_stream_tail(stream_type, REPLICA_LOST), continued=True, last=True)

    @staticmethod
    def not_ready(message: str = "no model replica can take this request yet (restarting after a crash)") -> Reply:
        """A ``503 model_not_ready`` reply with ``Retry-After`` (:data:`REPLICA_RETRY_AFTER_S`): no replica is
        alive to take a new request (they are being started again), or ``message`` says why."""
        err = ServiceError(ErrorCode.MODEL_NOT_READY, f"{message}; retry shortly", retry_after_s=REPLICA_RETRY_AFTER_S)
        headers = {"Retry-After": str(REPLICA_RETRY_AFTER_S)}
        return Framing.frame(encode_error(err), continued=False, last=True, status=err.status, headers=headers)

    def emit_metrics(self) -> None:
        """Metrics are published as each replica answers (:meth:`_call`); nothing left to do."""


def _room(stats: Mapping[str, int]) -> int:
    """New sessions a replica can take: its free KV budget in sessions, capped by its session slots."""
    by_memory = stats["free_bytes"] // max(1, stats["new_session_bytes"])
    return min(by_memory, stats.get("max_sessions", by_memory) - stats["num_sessions"])
