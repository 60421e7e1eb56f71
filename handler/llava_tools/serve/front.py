"""The public port of ``llava-serve`` and of the container: a truthful ``/ping``, OpenAI's routes,
TorchServe's own paths relayed.

TorchServe's ``/ping`` answers Healthy from about a second after start, long before the model is
loaded, and again after a worker died (its worker threads count as healthy whatever their state);
SageMaker reads ``/ping`` 200 as "ready for ``/invocations``". TorchServe's inference API also has no
OpenAI paths. So TorchServe listens on a loopback port and this proxy on the public one:

- ``GET /ping`` (and vLLM's ``GET /health``): 200 ``{"status": "Healthy"}`` only while the worker serves (its owner, ``llava-serve``'s
  :class:`~llava_tools.serve.server.LocalServer`, calls :meth:`OpenAIFront.set_ready` once the worker is READY
  and clears it while it restarts TorchServe), else 503; any other request while it does not serve
  gets a typed ``503 model_not_ready`` with ``Retry-After`` at once;
- ``POST /v1/chat/completions``: sends the body unchanged to TorchServe's ``/invocations``, where the
  handler's chat dialect answers it exactly as it answers SageMaker (``llava_sessions.chat``); a
  stream comes back as server-sent events ending ``data: [DONE]``, relayed chunk by chunk;
- ``GET /v1/models`` (and ``/v1/models/<id>``): the served model, in OpenAI's ``Model`` shape
  (both ``/v1`` routes only with ``routes``);
- a body past TorchServe's own ``max_request_size``: the typed ``413 payload_too_large``;
- a POST naming URL or S3 images (with ``images``): those are fetched first, then the request is
  relayed with their ticket, and the worker's ``GET /_llava/images/<ticket>?source=...`` lookups
  are answered here (:mod:`llava_tools.serve.image_relay`: a slow or failing image host then holds only
  its own request, and a failed fetch always gets its typed 4xx);
- ``GET /metrics``: TorchServe's Prometheus metrics, read from its metrics port (:mod:`.front_routes`);
- anything else: relayed to TorchServe as it came (method, path, headers, body).

A client that leaves closes the TorchServe connection (its job then freed): seen by watching its socket
until the reply's first chunk, then by a failed write.

If TorchServe still refuses connections while flagged serving, a request waits for it, up to
``restart_wait_s`` (then ``503 model_not_ready`` with ``Retry-After``): nothing was sent.

The session header, ``Accept`` and SageMaker's custom attributes pass through both ways; an
``Authorization`` header (the openai package always sends one) is not forwarded.

Each hop costs what the extra relay costs, so the proxy moves bytes, not objects: per client
connection a thread reads the request head (RFC 9112 framing: ``Content-Length`` bodies, a chunked
reply relayed chunk by chunk) and keeps one kept-alive connection to TorchServe; no header is parsed
beyond what routing and framing need, and a body is decoded only when it may name an image URL.
``benchmarks/openai_front.py`` measures the added latency side by side (benchmarks/results/stateless-conversations.md).
"""

from __future__ import annotations

import hmac
import math
import socketserver
import threading
import time
from typing import Any

from llava_sessions.wire.contract import (
    CUSTOM_ATTRIBUTES_HEADER,
    IMAGE_TICKET_HEADER,
    NEW_SESSION_LITERAL,
    OPENAI_ROUTE_HEADER,
    SESSION_ID_HEADER,
    SLOT_WAIT_HEADER,
)
from llava_sessions.wire.framing import cut_stream_tail
from llava_sessions.wire.inbound import CHAT_LARGE_IMAGE_HINT, LARGE_IMAGE_HINT

from ..processes import BackgroundServing
from .front_routes import CHAT_COMPLETIONS_PATH, answered_here
from .http_wire import (
    CANONICAL,
    DRAIN_PIECE_BYTES,
    INTERNAL,
    MAX_HEAD_BYTES,
    MAX_RETRY_AFTER_S,
    NOT_FORWARDED,
    OPENAI_PREFIX,
    RESTART_POLL_S,
    RETRY_AFTER_S,
    WORKER_LOST,
    Backend,
    ClientGone,
    Closed,
    Fields,
    WorkerLost,
    await_backend,
    client_gone,
    field,
    openai_error,
    read_head,
    response,
    worker_died,
)
from .image_relay import ImageRelay
from .slot_queue import SlotQueue, SlotsTaken, slot_refusal
from .torchserve_files import MAX_REQUEST_BYTES

__all__ = ["OPENAI_PREFIX", "RESTART_WAIT_S", "OpenAIFront"]

#: Seconds the proxy holds a request while its worker restarts: a tiny model's restart measured
#: 10-16 s on a quiet 2-core machine and 30-33 s under load (docs/api.md, "When a worker dies").
RESTART_WAIT_S = 60.0


class _Connection(socketserver.StreamRequestHandler):
    """One client connection: its requests in turn, each answered here or relayed to TorchServe."""

    server: OpenAIFront
    disable_nagle_algorithm = True

    def handle(self) -> None:
        self.backend: Backend | None = None
        try:
            while self._one_request():
                pass
        except (Closed, OSError, ClientGone):
            pass
        finally:
            if self.backend is not None:
                self.backend.close()

    def _one_request(self) -> bool:
        """Serve one request; returns whether the connection stays open."""
        start, fields = read_head(self.rfile)
        method, _, rest = start.partition(b" ")
        target = rest.rpartition(b" ")[0]
        if field(fields, b"transfer-encoding") is not None:
            self.wfile.write(response(411, "Length Required", b'{"code": 411, "message": "send a Content-Length"}'))
            return False
        if field(fields, b"expect") == b"100-continue":
            self.wfile.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        length = field(fields, b"content-length") or b"0"
        if not length.isdigit():
            self.wfile.write(response(400, "Bad Request", b'{"code": 400, "message": "bad Content-Length"}'))
            return False
        if int(length) > self.server.max_request_bytes:
            return self._refuse_large(int(length), target.startswith(OPENAI_PREFIX.encode()))
        body = self.rfile.read(int(length))
        keep = (field(fields, b"connection") or b"").lower() != b"close"
        local = answered_here(self.server, method, target, fields)
        if local is not None:
            self.wfile.write(local)
            return keep
        openai_route = self.server.routes and method == b"POST" and target.partition(b"?")[0] == CHAT_COMPLETIONS_PATH
        if not self.server.ready and not self.server.wait_ready():
            message = "the model is not serving yet (starting, or restarting after a worker died); retry shortly"
            self.wfile.write(self._not_ready(message))
            return keep
        return self._forward(method, b"/invocations" if openai_route else target, fields, body, openai_route) and keep

    def _forward(self, method: bytes, target: bytes, fields: Fields, body: bytes, openai_route: bool) -> bool:
        """Relay the request to TorchServe (its images fetched first) and its reply back; returns False
        when the client connection must close. A request cut by a dead worker before any byte of its
        reply is sent again once the worker is back when it holds no session state (nothing of it
        survived); a session's request gets the typed, retryable ``503 model_not_ready``."""
        server = self.server
        head = [b"%s %s HTTP/1.1" % (method, target), b"Host: torchserve"]
        head += [b"%s: %s" % (CANONICAL.get(n, name), v) for n, name, v in fields if n not in NOT_FORWARDED]
        ticket, images = None, server.images
        if images is not None and method == b"POST":
            attributes = field(fields, CUSTOM_ATTRIBUTES_HEADER.lower().encode())
            ticket = images.prefetch(body, attributes.decode("latin-1") if attributes else None)
        if ticket is not None:
            head.append(b"%s: %s" % (IMAGE_TICKET_HEADER.encode(), ticket.encode()))
        if openai_route:
            head.append(b"%s: 1" % OPENAI_ROUTE_HEADER.encode())
        request = b"\r\n".join(head) + b"\r\n\r\n" + body
        stateless = field(fields, SESSION_ID_HEADER.lower().encode()) in (None, b"", NEW_SESSION_LITERAL.encode())
        try:
            for attempt in (0, 1):
                try:
                    return self._relay_held(request, method == b"HEAD")
                except WorkerLost:
                    if attempt or not stateless or not server.restarting() or not server.wait_ready():
                        self.wfile.write(self._not_ready(WORKER_LOST))
                        return False
            return False
        finally:
            if images is not None and ticket is not None:
                images.release(ticket)
            if server.queue is not None:
                server.queue.wake_one()  # a slot may have freed

    def _relay_held(self, request: bytes, head_only: bool) -> bool:
        """:meth:`_relay`, held while refused for want of a slot (:meth:`SlotQueue.hold`), then refused.

        Raises:
            ClientGone: the client left while its request was held.
            WorkerLost: as :meth:`_relay`.
        """
        queue = self.server.queue
        try:
            if queue is None:
                return self._relay(request, head_only)
            return queue.hold(lambda: self._relay(request, head_only), lambda: client_gone(self.connection))
        except SlotsTaken as taken:
            if client_gone(self.connection):
                raise ClientGone() from None
            self.wfile.write(taken.reply)
            return True

    def _refuse_large(self, length: int, openai_route: bool) -> bool:
        """Answer a body over TorchServe's own limit (which would get its bare 413) with the typed
        ``payload_too_large``: read and drop the body first (a client that is still sending would
        otherwise see a reset, not the answer), then close. OpenAI's error object carries
        ``error.code`` and ``error.message``, which both dialects' clients read."""
        left = length
        while left > 0 and (piece := self.rfile.read(min(left, DRAIN_PIECE_BYTES))):
            left -= len(piece)
        limit = self.server.max_request_bytes
        hint = CHAT_LARGE_IMAGE_HINT if openai_route else f"{LARGE_IMAGE_HINT} (a chat body: its image_url.url)"
        message = f"request body is {length:,} bytes, over the {limit:,}-byte limit; {hint}"
        self.wfile.write(openai_error(413, "Payload Too Large", message, "payload_too_large"))
        return False

    def _not_ready(self, message: str) -> bytes:
        """The typed, retryable ``503 model_not_ready`` with ``Retry-After`` (the restart's countdown)."""
        retry_after_s = self.server.retry_after_s()
        return openai_error(503, "Service Unavailable", message, "model_not_ready", retry_after_s=retry_after_s)

    def _relay(self, request: bytes, head_only: bool) -> bool:
        """Send ``request`` to TorchServe and relay its reply; returns False when the client
        connection must close (TorchServe unreachable or broke off).

        A stream cut after its body began ends with ``model_not_ready`` as its last event
        (:func:`cut_stream_tail`).

        Raises:
            WorkerLost: nothing was relayed, and TorchServe gave no reply, its own ``507 Worker
                died.``, or a chunked reply cut before its first byte of body (a worker killed with
                the request in flight: TorchServe sends the head with the first, empty frame).
            SlotsTaken: a 503 for want of a slot (the worker's, marked, or TorchServe's, shaped here).
        """
        try:
            start, fields = self._send(request)
        except ConnectionRefusedError:  # still restarting after restart_wait_s: nothing was sent
            self.wfile.write(self._not_ready("the model server is restarting; retry shortly"))
            return False
        except TimeoutError:
            message = f"the model server sent nothing for {self.server.read_timeout_s:g} s"
            self.wfile.write(openai_error(504, "Gateway Timeout", message, "backend_timeout"))
            return False
        except (Closed, OSError):
            raise WorkerLost() from None
        backend = self.backend
        assert backend is not None
        kept = [b"%s: %s" % (name, v) for n, name, v in fields if n != b"connection" and n not in INTERNAL]
        head = b"\r\n".join([start, *kept]) + b"\r\n\r\n"
        length = field(fields, b"content-length")
        status = start.split(b" ", 2)[1] if start.count(b" ") else b"502"
        no_body = head_only or status in (b"204", b"304") or status.startswith(b"1")
        if no_body or length is not None:
            body = b"" if no_body else backend.reader.read(int(length or 0))
            if worker_died(status, body):
                self.backend = None
                backend.close()
                raise WorkerLost()
            refused = slot_refusal(status, field(fields, SLOT_WAIT_HEADER.lower().encode()) is not None, head, body)
            if refused is not None:
                raise SlotsTaken(refused)
            self.wfile.write(head + body)
        elif (field(fields, b"transfer-encoding") or b"").lower() == b"chunked":
            self._relay_chunks(backend, head, field(fields, b"content-type") or b"")
        else:  # delimited by TorchServe closing the connection
            self.wfile.write(head.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n", 1) + backend.reader.read())
            return False
        if (field(fields, b"connection") or b"").lower() == b"close":
            backend.close()
            self.backend = None
        return True

    def _send(self, request: bytes) -> tuple[bytes, Fields]:
        """Send on the kept-alive connection and read the reply's head; a connection TorchServe closed
        while idle is replaced once (the request never reached it then).

        Raises:
            Closed, OSError: TorchServe does not answer.
        """
        key = self.server.backend_key  # TorchServe's token authorization: its current launch's key
        if key:  # (the client's own Authorization is never forwarded)
            request = request.replace(b"\r\n\r\n", b"\r\nAuthorization: Bearer %s\r\n\r\n" % key.encode(), 1)
        for attempt in (0, 1):
            reused = self.backend is not None
            if self.backend is None:
                self.backend = self._connect()
            try:
                self.backend.sock.sendall(request)
                await_backend(self.backend, self.connection, self.server.read_timeout_s)
                return read_head(self.backend.reader)
            except (Closed, OSError):
                self.backend.close()
                self.backend = None
                if not reused or attempt:
                    raise
        raise AssertionError("unreachable")

    def _connect(self) -> Backend:
        """A new connection to TorchServe. While it refuses connections (``llava-serve`` restarts it
        after a worker died) the request waits, up to ``restart_wait_s``: nothing was sent, so the
        client sees the restart as a slower answer, not as an error.

        Raises:
            OSError: TorchServe still refuses (or cannot be reached) after ``restart_wait_s``.
        """
        deadline = time.monotonic() + self.server.restart_wait_s
        while True:
            try:
                return Backend(self.server.backend, self.server.read_timeout_s)
            except ConnectionRefusedError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(RESTART_POLL_S)

    def _relay_chunks(self, backend: Backend, head: bytes, content_type: bytes) -> None:
        """Relay a chunked body chunk by chunk as it arrives, up to its last chunk and trailer. The
        head goes out with the first chunk (TorchServe sends it with a first frame that may be
        empty): a reply cut before any chunk can still be answered with a status of its own. The client
        is watched until the first chunk (a whole answer's only one), then a failed write shows it left
        (sooner, TorchServe 0.12 parks a poll thread on a group then closed: docs/decisions/44-short-job-group-idle-time.md).

        Raises:
            WorkerLost: TorchServe broke off before the first chunk (nothing was written).
            ClientGone: the client left while TorchServe sent nothing.
        """
        write, reader = self.wfile.write, backend.reader
        pending: bytes | None = head
        try:
            while True:
                if pending is not None:
                    await_backend(backend, self.connection, self.server.read_timeout_s)
                size_line = reader.readline(MAX_HEAD_BYTES)
                if not size_line.endswith(b"\n"):
                    raise Closed()
                size = int(size_line.split(b";", 1)[0].strip() or b"0", 16)
                if size == 0:
                    trailer = b""
                    while (line := reader.readline(MAX_HEAD_BYTES)) not in (b"\r\n", b"\n", b""):
                        trailer += line
                    write((pending or b"") + size_line + trailer + b"\r\n")
                    return
                piece = reader.read(size + 2)  # the chunk and its CRLF
                if len(piece) != size + 2:
                    raise Closed()
                write((pending or b"") + size_line + piece)
                pending = None
        except (Closed, OSError, ValueError):
            if pending is not None:
                raise WorkerLost() from None
            tail = cut_stream_tail(content_type, WORKER_LOST)
            write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(tail), tail))


class OpenAIFront(BackgroundServing, socketserver.ThreadingTCPServer):
    """The public port of ``llava-serve``: OpenAI's routes, and TorchServe's relayed (module docstring).

    Args:
        address: ``(host, port)`` to bind; port 0 picks a free one.
        backend: TorchServe's inference ``(host, port)`` (settable later: a restart may move it).
        model_name: the served model's names (``served_model_name``: one, or a list of aliases, the
            first the main one), as ``/v1/models`` lists them.
        read_timeout_s: seconds to wait on one read from TorchServe.
        restart_wait_s: seconds a request waits for TorchServe to accept connections again (a
            restart); then ``503 model_not_ready`` with ``Retry-After``.
        max_request_bytes: TorchServe's ``max_request_size``: a longer body gets the typed
            ``413 payload_too_large`` here (shorter ones over the handler's own limit get it there).
        routes: serve OpenAI's ``/v1`` routes (False: every path is relayed as it came).
        images: fetch a request's URL and S3 images before relaying it, and answer the worker's
            lookups of them (:mod:`llava_tools.serve.image_relay`); None: the worker fetches them.
        api_key: when set, every request but ``GET /ping`` (and the worker's image lookups, whose
            ticket is their secret) must carry ``Authorization: Bearer <api_key>`` (vLLM's
            ``--api-key`` rule), compared in constant time; else ``401 invalid_api_key``.
        queue: where requests refused for want of a generation slot wait to be sent again
            (:class:`~llava_tools.serve.slot_queue.SlotQueue`); None: the refusal goes to the client.

    Set by its owner as TorchServe starts: :attr:`backend` (above), :attr:`metrics` (TorchServe's
    metrics ``(host, port)``, served as ``GET /metrics`` here; None: the path is relayed) and
    :attr:`backend_key` (TorchServe's inference key, sent on every relayed request while its token
    authorization is on, as with ``llava-serve --api-key``; None: it is off).

    Until :meth:`set_ready` says the worker serves, ``GET /ping`` answers 503 and every other
    request a typed ``503 model_not_ready`` with ``Retry-After`` (its body read first).

    Raises:
        OSError: the address cannot be bound.
    """

    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128
    thread_name = "llava-openai-front"

    def __init__(
        self,
        address: tuple[str, int],
        backend: tuple[str, int],
        model_name: str | tuple[str, ...],
        *,
        read_timeout_s: float = 600.0,
        restart_wait_s: float = RESTART_WAIT_S,
        max_request_bytes: int = MAX_REQUEST_BYTES,
        routes: bool = True,
        images: ImageRelay | None = None,
        api_key: str | None = None,
        queue: SlotQueue | None = None,
    ) -> None:
        super().__init__(address, _Connection)
        self.metrics: tuple[str, int] | None = None
        self.backend_key: str | None = None
        self.images = images
        self.queue = queue
        self._expected_auth = ("Bearer " + api_key).encode() if api_key else None
        self.max_request_bytes = max_request_bytes
        self.routes = routes
        #: Whether the worker behind serves (:meth:`set_ready`).
        self.ready = False
        self._served = False  # it served once: a later "not ready" is a restart, which requests wait out
        self._ready_changed = threading.Condition()
        self._back_at: float | None = None  # when a restart should be done (time.monotonic()), if known
        self._restart_s = 0.0  # the last start's duration, seconds (a restart's expected duration)
        self.backend = backend
        self.restart_wait_s = restart_wait_s
        #: The names the served model answers to on ``/v1`` (the first is the main one).
        self.model_names: tuple[str, ...] = (model_name,) if isinstance(model_name, str) else tuple(model_name)
        self.read_timeout_s = read_timeout_s
        self.created = int(time.time())

    def set_ready(self, ready: bool, expected_s: float | None = None) -> None:
        """Say whether the worker behind serves requests (``llava-serve`` sets it once the worker is
        READY, clears it while it restarts TorchServe, and leaves it clear if that failed).

        Args:
            ready: it serves.
            expected_s: not serving: seconds until it should serve again (the last start's
                duration), which the 503s' ``Retry-After`` counts down; None: unknown.
        """
        with self._ready_changed:
            self._back_at = None if ready or expected_s is None else time.monotonic() + expected_s
            if expected_s:
                self._restart_s = expected_s
            self.ready = ready
            self._served |= ready
            self._ready_changed.notify_all()

    def authorized(self, authorization: bytes | None) -> bool:
        """Whether a request with this ``Authorization`` header value may be served (always, without an
        API key); compared in constant time (``hmac.compare_digest``)."""
        expected = self._expected_auth
        return expected is None or hmac.compare_digest(authorization or b"", expected)

    def restarting(self, grace_s: float = 1.0) -> bool:
        """Whether the worker is restarting (it served before and does not now), waiting up to
        ``grace_s`` for the supervisor to say so after a request was cut (it sees a death at once)."""
        with self._ready_changed:
            self._ready_changed.wait_for(lambda: not self.ready, timeout=grace_s)
            return self._served and not self.ready

    def wait_ready(self) -> bool:
        """While the worker restarts (it served before), wait up to ``restart_wait_s`` for it to serve
        again, as a request waits for TorchServe to accept connections; before the first start, do not
        wait (SageMaker sends no traffic before ``/ping`` says 200). Returns whether it serves."""
        with self._ready_changed:
            if self._served:
                self._ready_changed.wait_for(lambda: self.ready, timeout=self.restart_wait_s)
            return self.ready

    def retry_after_s(self) -> int:
        """``Retry-After`` of a 503 while the worker does not serve: the seconds left until a restart
        should be done (1..MAX_RETRY_AFTER_S), else :data:`RETRY_AFTER_S`."""
        back_at = self._back_at
        if back_at is None:  # serving (a request just cut: the worker died, a restart takes the last start's time)
            return max(1, min(MAX_RETRY_AFTER_S, math.ceil(self._restart_s))) if self._restart_s else RETRY_AFTER_S
        return max(1, min(MAX_RETRY_AFTER_S, math.ceil(back_at - time.monotonic())))

    def model_card(self, name: str | None = None) -> dict[str, Any]:
        """The served model under ``name`` (default: its first name) as OpenAI's ``Model`` object
        (``id``, ``object``, ``created``, ``owned_by``)."""
        model_id = name or self.model_names[0]
        return {"id": model_id, "object": "model", "created": self.created, "owned_by": "llava-sessions"}

    @property
    def port(self) -> int:
        """The bound port."""
        return int(self.server_address[1])
