"""HTTP/1.1 as the proxy moves it: a message head read line by line (RFC 9112), replies and error
objects written as bytes, TorchServe's connection, and the last event of a stream whose worker died.
No objects beyond what routing and framing need (:mod:`.front` relays bytes)."""

from __future__ import annotations

import io
import json
import selectors
import socket
import time
from typing import IO
from urllib.parse import parse_qs

from llava_sessions.wire.contract import (
    CUSTOM_ATTRIBUTES_HEADER,
    IMAGE_RELAY_PATH,
    IMAGE_TICKET_HEADER,
    OPENAI_ROUTE_HEADER,
    SESSION_ID_HEADER,
    SLOT_WAIT_HEADER,
)

from .image_relay import ImageRelay

__all__ = [
    "CANONICAL",
    "DRAIN_PIECE_BYTES",
    "HEALTH_PATHS",
    "INTERNAL",
    "MAX_HEAD_BYTES",
    "MAX_RETRY_AFTER_S",
    "NOT_FORWARDED",
    "OPENAI_PREFIX",
    "RESTART_POLL_S",
    "RETRY_AFTER_S",
    "WORKER_LOST",
    "Backend",
    "ClientGone",
    "Closed",
    "Fields",
    "WorkerLost",
    "await_backend",
    "client_gone",
    "field",
    "openai_error",
    "ping_reply",
    "read_head",
    "relayed_image",
    "response",
    "worker_died",
    "unauthorized",
]

#: Where OpenAI's routes start (the ``base_url`` a client sets ends with it).
OPENAI_PREFIX = "/v1"
#: Longest request or reply head relayed, bytes (TorchServe's own limit is 8 KiB per line).
MAX_HEAD_BYTES = 65536
#: Bytes read at a time while dropping a body that is refused before it reaches TorchServe.
DRAIN_PIECE_BYTES = 1 << 20
#: ``Retry-After`` (seconds) of the 503 answered while the worker does not serve, when no estimate
#: of its return is known (the first start); a restart's estimate is clamped to 1..MAX_RETRY_AFTER_S.
RETRY_AFTER_S = 5
MAX_RETRY_AFTER_S = 30
#: Seconds between two connection attempts while TorchServe restarts.
RESTART_POLL_S = 0.2
#: Header names TorchServe (its sequence id) and the handler look up by exact case, forwarded in it
#: whatever case the client sent (HTTP names are case-insensitive, RFC 9110 section 5.1; HTTP/2
#: clients and many libraries send lower case): a lower-case session header would otherwise open a
#: new TorchServe sequence and the request would run without its session.
CANONICAL = {
    name.lower().encode(): name.encode()
    for name in (
        SESSION_ID_HEADER,
        CUSTOM_ATTRIBUTES_HEADER,
        "Accept",
        "Content-Type",
    )
}
#: Request headers not forwarded to TorchServe: the hop's own (RFC 9110 section 7.6.1), the
#: client's credentials, and the image ticket only this proxy writes.
NOT_FORWARDED = frozenset(
    {b"connection", b"keep-alive", b"proxy-connection", b"te", b"upgrade", b"expect", b"authorization", b"host"}
    | {IMAGE_TICKET_HEADER.lower().encode(), OPENAI_ROUTE_HEADER.lower().encode()}
)


class Closed(Exception):
    """The peer closed the connection (or sent something that is not HTTP/1.1)."""


class WorkerLost(Exception):
    """TorchServe gave no reply to relay (its worker died with the request in flight): nothing was
    relayed to the client yet."""


#: The health checks the proxy answers itself, without a key: SageMaker's ``/ping``, vLLM's ``/health``.
HEALTH_PATHS = (b"/ping", b"/health")
#: What a request cut by a dead worker is told (``503 model_not_ready``, or a stream's last event:
#: :func:`~llava_sessions.wire.framing.cut_stream_tail`).
WORKER_LOST = "the model server stopped while answering (its worker died and restarts); retry shortly"
#: Reply headers TorchServe adds for its own use (its stream flag, its caching headers) and the worker's
#: word to the proxy (:data:`SLOT_WAIT_HEADER`), not relayed to clients; TorchServe's ``x-request-id``
#: is (OpenAI's clients read it as the request's id).
INTERNAL = frozenset({b"ts_stream_next", b"pragma", b"cache-control", b"expires", SLOT_WAIT_HEADER.lower().encode()})


def worker_died(status: bytes, body: bytes) -> bool:
    """Whether a TorchServe reply says the worker died with the request in flight: its own error
    ``{"code": ..., "type": "InternalServerException", "message": "Worker died."}``, which TorchServe
    0.12's worker threads send as 500, as 413 after a SIGKILL (exit 137), or as 507; the proxy answers
    such a request as one cut by the worker's death (sent again when it may be, else ``503 model_not_ready``)."""
    return status in (b"500", b"507", b"413") and b'"Worker died."' in body


Fields = list[tuple[bytes, bytes, bytes]]


def read_head(reader: IO[bytes] | io.BufferedIOBase) -> tuple[bytes, Fields]:
    """The start line and the header fields of a message: ``(lower-cased name, name as sent, value)``
    (TorchServe matches header names case-sensitively: they are relayed as sent).

    Raises:
        Closed: end of stream before a whole head, or a head over :data:`MAX_HEAD_BYTES`.
    """
    start = reader.readline(MAX_HEAD_BYTES)
    while start in (b"\r\n", b"\n"):  # RFC 9112 section 2.2: empty lines before a request are ignored
        start = reader.readline(MAX_HEAD_BYTES)
    if not start.endswith(b"\n"):
        raise Closed()
    fields: Fields = []
    size = len(start)
    while True:
        line = reader.readline(MAX_HEAD_BYTES)
        size += len(line)
        if not line.endswith(b"\n") or size > MAX_HEAD_BYTES:
            raise Closed()
        if line in (b"\r\n", b"\n"):
            return start.rstrip(b"\r\n"), fields
        name, _, value = line.partition(b":")
        name = name.strip()
        fields.append((name.lower(), name, value.strip()))


def field(fields: Fields, name: bytes) -> bytes | None:
    """The value of the field ``name`` (lower case), or None."""
    return next((v for n, _, v in fields if n == name), None)


def response(status: int, reason: str, body: bytes, extra: bytes = b"") -> bytes:
    return (
        b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n"
        % (status, reason.encode(), len(body), extra)
    ) + body


def openai_error(status: int, reason: str, message: str, code: str, *, retry_after_s: int = 0) -> bytes:
    """OpenAI's error object (``openai.APIError`` reads ``error.message`` and ``error.code``; our
    dialects' clients read the same two fields), with ``Retry-After`` when given."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    extra = b"Retry-After: %d\r\n" % retry_after_s if retry_after_s else b""
    return response(status, reason, json.dumps(body).encode(), extra)


def unauthorized() -> bytes:
    """``401 invalid_api_key`` (OpenAI's error object and code, which both dialects' clients read), with
    ``WWW-Authenticate: Bearer`` (RFC 6750)."""
    message = "missing or wrong API key: send the header 'Authorization: Bearer <key>'"
    body = {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}
    return response(401, "Unauthorized", json.dumps(body).encode(), b"WWW-Authenticate: Bearer\r\n")


def ping_reply(ready: bool, retry_after_s: int) -> bytes:
    """SageMaker's health check: 200 only while the worker serves (TorchServe's own ``/ping`` says
    Healthy from before the model is loaded and after a worker died), else 503."""
    if ready:
        return response(200, "OK", b'{"status": "Healthy"}')
    return response(503, "Service Unavailable", b'{"status": "Unhealthy"}', b"Retry-After: %d\r\n" % retry_after_s)


def relayed_image(images: ImageRelay, target: bytes) -> bytes:
    """The worker's lookup ``GET /_llava/images/<ticket>?source=<url>``: the image this proxy fetched
    for that request (``application/octet-stream``), or its fetch's error object."""
    path, _, query = target.partition(b"?")
    ticket = path[len(IMAGE_RELAY_PATH) :].decode("latin-1")
    source = parse_qs(query.decode("latin-1")).get("source", [""])[0]
    status, body = images.answer(ticket, source)
    if isinstance(body, bytes):
        head = b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\nContent-Length: %d\r\n\r\n"
        return head % len(body) + body
    return response(status, "Image Fetch", json.dumps(body).encode())


class Backend:
    """One kept-alive connection to TorchServe."""

    def __init__(self, address: tuple[str, int], timeout_s: float) -> None:
        self.sock = socket.create_connection(address, timeout=timeout_s)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.reader = self.sock.makefile("rb")

    def close(self) -> None:
        self.reader.close()
        self.sock.close()


class ClientGone(Exception):
    """The client closed its connection while its request was relayed."""


def client_gone(client: socket.socket) -> bool:
    """Whether ``client`` closed its connection (end of stream or a reset); pipelined bytes stay unread."""
    try:
        with selectors.DefaultSelector() as watch:
            watch.register(client, selectors.EVENT_READ)
            return bool(watch.select(0)) and not client.recv(1, socket.MSG_PEEK)
    except OSError:
        return True


def await_backend(backend: Backend, client: socket.socket, timeout_s: float) -> None:
    """Wait until TorchServe sends more (a reply's head, a chunk), watching the client's connection
    meanwhile; at once when bytes are buffered already (looked at without blocking).

    Raises:
        ClientGone: the client closed its connection first; the caller closes its connection to
            TorchServe, whose frontend then drops the job with its next frame.
        TimeoutError: nothing from TorchServe for ``timeout_s`` seconds.
    """
    sock = backend.sock
    sock.setblocking(False)
    try:
        if backend.reader.peek(1):
            return
    except OSError:
        return  # the read that follows reports it
    finally:
        sock.settimeout(timeout_s)
    deadline = time.monotonic() + timeout_s
    with selectors.DefaultSelector() as watch:
        watch.register(sock, selectors.EVENT_READ, "backend")
        watch.register(client, selectors.EVENT_READ, "client")
        while (left := deadline - time.monotonic()) > 0:
            for key, _ in watch.select(left):
                if key.data == "backend":
                    return
                if client_gone(client):
                    raise ClientGone()
                watch.unregister(client)  # a pipelined request: read after this reply
    raise TimeoutError()
