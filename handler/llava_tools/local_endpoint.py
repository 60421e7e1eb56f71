"""A SageMaker-runtime look-alike on 127.0.0.1 over N local TorchServes: ``llava-local-endpoint``.

A development and test tool, NOT a production router: it lets unmodified boto3 code (and
``llava_client.SageMakerTransport``) talk to several real TorchServe backends the way it would talk
to a multi-instance SageMaker endpoint with stateful sessions::

    llava-local-endpoint --model-dir models/tiny --backends 2 --port 8090

    rt = boto3.client("sagemaker-runtime", endpoint_url="http://127.0.0.1:8090", region_name="us-east-1",
                      aws_access_key_id="x", aws_secret_access_key="x")
    opened = rt.invoke_endpoint(EndpointName="any", Body=b'{"type": "open_session", ...}',
                                ContentType="application/json", SessionId="NEW_SESSION")
    session_id = opened["NewSessionId"].split(";")[0]

What it does, and what SageMaker is believed to do (botocore's service model is verified; the rest
mirrors public AWS material and is unverified against a live endpoint):

- ``POST /endpoints/{name}/invocations`` and ``.../invocations-response-stream``; any endpoint name
  is accepted unless ``--endpoint-name`` is given (others then get ``ValidationError``).
- Sticky sessions by ``X-Amzn-SageMaker-Session-Id``. ``NEW_SESSION`` (or no id) goes to the
  least-loaded healthy backend (fewest sessions this router placed there). ``NEW_SESSION`` is
  forwarded as the literal header, as SageMaker forwards the value boto3 sends: TorchServe puts
  every such open in its one ``NEW_SESSION`` job group and the handler mints ``llava-<uuid4>``.
  ``--mint-session-ids`` removes the header instead, so TorchServe mints ``ts-seq-<uuid>`` (what
  the AWS TorchServe sample expects); an absent id is always forwarded absent. Either way the
  handler answers ``X-Amzn-SageMaker-New-Session-Id`` and the router remembers id → backend. A
  known id goes to its backend. An id the router does not know goes to the least-loaded backend as
  is; the container answers ``404 session_not_found`` with the Closed header (as an instance that
  does not hold the session would). ``X-Amzn-SageMaker-Closed-Session-Id`` in a reply forgets the
  session.
- Replies: the container's body and ``Content-Type``; ``X-Amzn-SageMaker-New-Session-Id`` /
  ``-Closed-Session-Id`` passed through (boto3 ``NewSessionId`` / ``ClosedSessionId``);
  ``x-Amzn-Invoked-Production-Variant: AllTraffic``; a fresh ``x-amzn-RequestId``.
- A container status >= 400 becomes SageMaker's ``ModelError``: HTTP 424, header
  ``x-amzn-ErrorType: ModelError:...`` (botocore takes the error code from it), JSON body with
  ``ErrorCode`` (``CLIENT_ERROR_FROM_MODEL`` for 4xx, ``INTERNAL_FAILURE_FROM_MODEL`` for 5xx),
  ``Message`` (``Received client error (404) from primary with message "..."``),
  ``OriginalStatusCode`` (int) and ``OriginalMessage`` (the container's body), ``LogStreamArn``.
  boto3 raises ``client.exceptions.ModelError`` with ``e.response["OriginalStatusCode"]``.
- A backend that is gone (connection refused, reset, or closed before answering). CHOICE: its
  sessions are lost, as they are when a SageMaker instance dies, and the client must see
  "session gone" quickly rather than a hang or a generic 5xx. The request that finds it down gets
  ``ModelError`` with ``OriginalStatusCode 404`` and ``OriginalMessage``
  ``{"error": {"code": "session_not_found", ...}}`` plus the Closed header; the router forgets every
  session of that backend (later requests with those ids reach a live backend, which answers the
  same 404) and sends new sessions elsewhere until the backend's ``/ping`` answers 200 again.
  A new session whose backend refuses the connection is retried on another backend (nothing was
  sent); with none left the reply is ``ServiceUnavailable`` (503).
- Streaming: the reply is ``application/vnd.amazon.eventstream``; each piece of the container's
  chunked body is sent as it arrives as one ``PayloadPart`` event (headers ``:event-type PayloadPart``,
  ``:message-type event``, ``:content-type application/octet-stream``; the payload IS the raw bytes,
  since ``PayloadPart.Bytes`` is an ``eventpayload`` blob), with prelude and message CRC32s.
  The container's Content-Type goes in ``X-Amzn-SageMaker-Content-Type``. An error before the
  first byte is a plain ``ModelError`` reply; a failure mid-stream is a ``ModelStreamError``
  exception event (``ErrorCode: StreamBroken``), which boto3 raises as ``EventStreamError``.
  ``NEW_SESSION`` is refused here (``ValidationError``), as SageMaker does.
- Bodies over 6 MiB (6,291,456 bytes) and session ids outside botocore's pattern
  ``^[a-zA-Z0-9](-*[a-zA-Z0-9])*$`` are refused with ``ValidationError``.
- ``GET /ping``: 200 when every backend's ``/ping`` answers 200, else 503.
  ``GET /debug/sessions``: ``{"backends": [{"index", "url", "healthy", "sessions", "log_dir"}],
  "sessions": {id: index}}``.

SIGINT / SIGTERM stop the HTTP server and every TorchServe backend it started (each in its own
process group, TMPDIR and ports: :class:`~llava_tools.serve.LocalServer`).
"""

from __future__ import annotations

import argparse
import http.client
import json
import re
import struct
import sys
import threading
import time
import uuid
import zlib
from collections.abc import Mapping, Sequence, Set
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from llava_sessions.wire.contract import (
    CLOSED_SESSION_ID_HEADER,
    NEW_SESSION_ID_HEADER,
    NEW_SESSION_LITERAL,
    SESSION_ID_HEADER,
    SESSION_ID_PATTERN,
    SESSION_ID_RE,
    session_id_of,
)

from .serve import (
    LocalServer,
    _parse_assignment,
    run_until_signal,
)

__all__ = [
    "MAX_BODY_BYTES",
    "BackendRef",
    "LocalEndpoint",
    "Router",
    "RouterServer",
    "encode_event",
    "main",
    "model_error_body",
    "payload_part_event",
    "stream_error_event",
]

#: SageMaker's request body limit (InvokeEndpoint), bytes.
MAX_BODY_BYTES = 6_291_456
VARIANT_NAME = "AllTraffic"
MODEL_ERROR_TYPE = "ModelError:http://internal.amazon.com/coral/com.amazon.sagemaker/"
HEADER_CUSTOM_ATTRIBUTES = "X-Amzn-SageMaker-Custom-Attributes"
HEADER_STREAM_ACCEPT = "X-Amzn-SageMaker-Accept"
HEADER_STREAM_CONTENT_TYPE = "X-Amzn-SageMaker-Content-Type"
EVENT_STREAM_CONTENT_TYPE = "application/vnd.amazon.eventstream"
#: Largest payload of one PayloadPart event, bytes (a container chunk larger than this is split).
MAX_EVENT_PAYLOAD_BYTES = 64 * 1024
#: Seconds between /ping probes of a backend marked down.
PROBE_INTERVAL_S = 1.0
#: Seconds to wait for a backend's reply (per read); SageMaker allows 60 s for a whole reply.
DEFAULT_READ_TIMEOUT_S = 120.0
_PATH_RE = re.compile(r"^/endpoints/([^/]+)/(invocations|invocations-response-stream)$")


# ---- AWS event stream framing ------------------------------------------------------------------


def encode_event(headers: Sequence[tuple[str, str]], payload: bytes) -> bytes:
    """Encode one AWS event-stream message (string headers only).

    Layout: ``total_length:u32 headers_length:u32 prelude_crc:u32 headers payload message_crc:u32``
    (big-endian), each header ``name_len:u8 name type:u8(7=string) value_len:u16 value``; the prelude
    CRC32 covers the first 8 bytes, the message CRC32 everything before it.
    """
    encoded = b""
    for name, value in headers:
        name_bytes, value_bytes = name.encode(), value.encode()
        encoded += struct.pack(">B", len(name_bytes)) + name_bytes
        encoded += struct.pack(">BH", 7, len(value_bytes)) + value_bytes
    total = 12 + len(encoded) + len(payload) + 4
    prelude = struct.pack(">II", total, len(encoded))
    message = prelude + struct.pack(">I", zlib.crc32(prelude)) + encoded + payload
    return message + struct.pack(">I", zlib.crc32(message))


def payload_part_event(data: bytes) -> bytes:
    """A ``PayloadPart`` event carrying ``data`` (botocore: ``{"PayloadPart": {"Bytes": data}}``)."""
    return encode_event(
        [(":event-type", "PayloadPart"), (":content-type", "application/octet-stream"), (":message-type", "event")],
        data,
    )


def stream_error_event(message: str, error_code: str = "StreamBroken") -> bytes:
    """A ``ModelStreamError`` exception event (botocore raises ``EventStreamError`` for it)."""
    body = json.dumps({"Message": message, "ErrorCode": error_code}).encode()
    return encode_event(
        [
            (":exception-type", "ModelStreamError"),
            (":content-type", "application/json"),
            (":message-type", "exception"),
        ],
        body,
    )


def model_error_body(
    original_status: int, original_body: bytes, *, endpoint: str, backend: int, log_hint: str = ""
) -> dict[str, Any]:
    """Return SageMaker's ``ModelError`` JSON for a container reply with status >= 400.

    ``original_status`` 0 stands for "no reply in time" (SageMaker reports a timed-out invocation
    as a server error with status 0).
    """
    text = original_body.decode("utf-8", "replace")
    client_side = 400 <= original_status < 500
    kind = "client" if client_side else "server"
    see = f" See {log_hint} for more information." if log_hint else ""
    return {
        "ErrorCode": "CLIENT_ERROR_FROM_MODEL" if client_side else "INTERNAL_FAILURE_FROM_MODEL",
        "Message": f'Received {kind} error ({original_status}) from primary with message "{text}".{see}',
        "OriginalStatusCode": original_status,
        "OriginalMessage": text,
        "LogStreamArn": f"arn:aws:logs:local:000000000000:log-group:/aws/sagemaker/Endpoints/{endpoint}"
        f":log-stream:{VARIANT_NAME}/backend-{backend}",
    }


def _session_gone_body(session_id: str, reason: str) -> bytes:
    return json.dumps(
        {"error": {"code": "session_not_found", "message": f"session {session_id} is gone: {reason}"}}
    ).encode()


# ---- routing ----------------------------------------------------------------------------------


@dataclass
class BackendRef:
    """One backend as the router sees it."""

    index: int
    url: str
    log_dir: str = ""
    healthy: bool = True
    last_probe: float = 0.0

    @property
    def host_port(self) -> tuple[str, int]:
        """``(host, port)`` of the backend's inference API."""
        parts = urlsplit(self.url)
        return parts.hostname or "127.0.0.1", parts.port or 80


class Router:
    """Sticky session routing over backends: id → backend index, least-loaded placement.

    Thread-safe. ``sessions`` counts only sessions this router saw open and not yet close.
    """

    def __init__(self, backends: Sequence[BackendRef], *, probe_interval_s: float = PROBE_INTERVAL_S) -> None:
        if not backends:
            raise ValueError("at least one backend")
        self.backends = list(backends)
        self.probe_interval_s = probe_interval_s
        self._sessions: dict[str, int] = {}
        self._lock = threading.Lock()

    def lookup(self, session_id: str) -> int | None:
        """Return the backend index holding ``session_id``, or None if unknown."""
        with self._lock:
            return self._sessions.get(session_id)

    def least_loaded(self, exclude: Set[int] = frozenset()) -> int | None:
        """Return the healthy backend with the fewest sessions (lowest index on ties), or None."""
        self._probe_down(exclude)
        with self._lock:
            counts = {b.index: 0 for b in self.backends if b.healthy and b.index not in exclude}
            for index in self._sessions.values():
                if index in counts:
                    counts[index] += 1
        if not counts:
            return None
        return min(counts, key=lambda index: (counts[index], index))

    def opened(self, session_id: str, index: int) -> None:
        """Record that ``session_id`` lives on backend ``index``."""
        with self._lock:
            self._sessions[session_id] = index

    def closed(self, session_id: str) -> None:
        """Forget ``session_id`` (no error if unknown)."""
        with self._lock:
            self._sessions.pop(session_id, None)

    def mark_down(self, index: int) -> list[str]:
        """Mark backend ``index`` down and forget its sessions; return the forgotten ids."""
        with self._lock:
            backend = self.backends[index]
            backend.healthy = False
            backend.last_probe = time.monotonic()
            lost = [sid for sid, where in self._sessions.items() if where == index]
            for sid in lost:
                del self._sessions[sid]
        return lost

    def snapshot(self) -> dict[str, Any]:
        """Return the ``/debug/sessions`` view."""
        with self._lock:
            sessions = dict(self._sessions)
        return {
            "backends": [
                {
                    "index": b.index,
                    "url": b.url,
                    "healthy": b.healthy,
                    "sessions": sum(1 for index in sessions.values() if index == b.index),
                    "log_dir": b.log_dir,
                }
                for b in self.backends
            ],
            "sessions": sessions,
        }

    def _probe_down(self, exclude: Set[int]) -> None:
        now = time.monotonic()
        for backend in self.backends:
            if backend.healthy or backend.index in exclude or now - backend.last_probe < self.probe_interval_s:
                continue
            backend.last_probe = now
            if _ping(backend) == 200:
                backend.healthy = True


def _ping(backend: BackendRef, timeout_s: float = 1.0) -> int | None:
    host, port = backend.host_port
    connection = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        connection.request("GET", "/ping")
        response = connection.getresponse()
        response.read()
        return response.status
    except (OSError, http.client.HTTPException):
        return None
    finally:
        connection.close()


# ---- HTTP front --------------------------------------------------------------------------------


class _BackendGone(Exception):
    """The backend did not answer: refused (nothing sent) or dropped the connection."""

    def __init__(self, reason: str, *, refused: bool) -> None:
        super().__init__(reason)
        self.refused = refused


class _BackendTimeout(Exception):
    """The backend accepted the request but did not answer within the read timeout."""


_TIMEOUT_MESSAGE = (
    "Your invocation timed out while waiting for a response from container primary. Review the latency "
    "metrics for each container in Amazon CloudWatch, resolve the issue, and try again."
)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: RouterServer

    # -- plumbing --
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - BaseHTTPRequestHandler's name
        if self.server.verbose:
            super().log_message(format, *args)

    def _send(self, status: int, body: bytes, headers: Mapping[str, str]) -> None:
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("x-amzn-RequestId", str(uuid.uuid4()))
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _send_json(self, status: int, payload: Any, headers: Mapping[str, str] | None = None) -> None:
        self._send(status, json.dumps(payload).encode(), {"Content-Type": "application/json", **(headers or {})})

    def _aws_error(self, status: int, error_type: str, message: str) -> None:
        self._send_json(status, {"message": message}, {"x-amzn-ErrorType": f"{error_type}:"})

    # -- routes --
    def do_GET(self) -> None:  # noqa: N802
        path = urlsplit(self.path).path
        router = self.server.router
        if path == "/ping":
            statuses = [_ping(b) for b in router.backends]
            ok = all(s == 200 for s in statuses)
            self._send_json(200 if ok else 503, {"status": "Healthy" if ok else "Unhealthy", "backends": statuses})
        elif path == "/debug/sessions":
            self._send_json(200, router.snapshot())
        else:
            self._aws_error(404, "UnknownOperationException", f"no such path: {path}")

    def do_POST(self) -> None:  # noqa: N802
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        match = _PATH_RE.match(urlsplit(self.path).path)
        if not match:
            self._aws_error(404, "UnknownOperationException", f"no such operation: POST {self.path}")
            return
        endpoint, operation = match.group(1), match.group(2)
        stream = operation == "invocations-response-stream"
        if self.server.endpoint_name and endpoint != self.server.endpoint_name:
            self._aws_error(400, "ValidationError", f"Endpoint {endpoint} of account 000000000000 not found.")
            return
        if len(body) > MAX_BODY_BYTES:
            self._aws_error(400, "ValidationError", f"Request body is over the {MAX_BODY_BYTES}-byte limit.")
            return
        session_id = self.headers.get(SESSION_ID_HEADER)
        if session_id and session_id != NEW_SESSION_LITERAL and not SESSION_ID_RE.match(session_id):
            self._aws_error(
                400,
                "ValidationError",
                f"1 validation error detected: Value '{session_id}' at 'sessionId' failed to satisfy "
                f"constraint: Member must satisfy regular expression pattern: {SESSION_ID_PATTERN}",
            )
            return
        if stream and session_id == NEW_SESSION_LITERAL:
            self._aws_error(
                400,
                "ValidationError",
                "NEW_SESSION is not supported by InvokeEndpointWithResponseStream; open with InvokeEndpoint.",
            )
            return
        self._invoke(endpoint, body, session_id or None, stream)

    def _invoke(self, endpoint: str, body: bytes, session_id: str | None, stream: bool) -> None:
        router = self.server.router
        opening = session_id is None or session_id == NEW_SESSION_LITERAL
        index = None if session_id is None or opening else router.lookup(session_id)
        sticky = index is not None
        forward_id = None if opening else session_id
        if session_id == NEW_SESSION_LITERAL and self.server.pass_new_session:
            forward_id = NEW_SESSION_LITERAL
        tried: set[int] = set()
        while True:
            if index is None:
                index = router.least_loaded(exclude=tried)
                if index is None:
                    self._aws_error(503, "ServiceUnavailable", "no healthy backend (all local TorchServes are down)")
                    return
            try:
                connection, response = self._forward(router.backends[index], body, forward_id, stream)
                break
            except _BackendTimeout:
                self._model_error(endpoint, index, 0, _TIMEOUT_MESSAGE.encode(), {})
                return
            except _BackendGone as gone:
                lost = router.mark_down(index)
                if sticky and session_id is not None:
                    self._session_gone(endpoint, index, session_id, f"backend {index} {gone}", lost)
                    return
                if not gone.refused:  # the request may have reached it: do not send it twice
                    self._model_error(
                        endpoint,
                        index,
                        502,
                        json.dumps({"error": {"code": "backend_gone", "message": f"backend {index} {gone}"}}).encode(),
                        {},
                    )
                    return
                tried.add(index)
                index = None
        try:
            self._relay(endpoint, index, connection, response, stream, session_id if sticky else None)
        finally:
            connection.close()

    def _forward(self, backend: BackendRef, body: bytes, session_id: str | None, stream: bool):
        host, port = backend.host_port
        connection = http.client.HTTPConnection(host, port, timeout=self.server.read_timeout_s)
        headers = {"Content-Type": self.headers.get("Content-Type", "application/json")}
        accept = self.headers.get(HEADER_STREAM_ACCEPT if stream else "Accept")
        if accept:
            headers["Accept"] = accept
        if self.headers.get(HEADER_CUSTOM_ATTRIBUTES):
            headers[HEADER_CUSTOM_ATTRIBUTES] = self.headers[HEADER_CUSTOM_ATTRIBUTES]
        if session_id is not None:
            headers[SESSION_ID_HEADER] = session_id
        try:
            connection.connect()
        except ConnectionRefusedError as exc:
            connection.close()
            raise _BackendGone(f"refused the connection ({exc})", refused=True) from None
        except OSError as exc:
            connection.close()
            raise _BackendGone(f"unreachable ({exc})", refused=True) from None
        try:
            connection.request("POST", "/invocations", body=body, headers=headers)
            response = connection.getresponse()
        except TimeoutError:
            connection.close()
            raise _BackendTimeout() from None
        except (OSError, http.client.HTTPException) as exc:
            connection.close()
            raise _BackendGone(f"dropped the connection ({type(exc).__name__})", refused=False) from None
        return connection, response

    def _track(self, index: int, response: http.client.HTTPResponse) -> dict[str, str]:
        """Update the session map from the reply; return the session headers to pass on."""
        router = self.server.router
        passed: dict[str, str] = {}
        new_value = response.getheader(NEW_SESSION_ID_HEADER)
        closed_value = response.getheader(CLOSED_SESSION_ID_HEADER)
        if new_value:
            passed[NEW_SESSION_ID_HEADER] = new_value
            new_id = session_id_of(new_value)
            if new_id and response.status < 400:
                router.opened(new_id, index)
        if closed_value:
            passed[CLOSED_SESSION_ID_HEADER] = closed_value
            router.closed(closed_value.strip())
        attributes = response.getheader(HEADER_CUSTOM_ATTRIBUTES)
        if attributes:
            passed[HEADER_CUSTOM_ATTRIBUTES] = attributes
        return passed

    def _relay(
        self,
        endpoint: str,
        index: int,
        connection: http.client.HTTPConnection,
        response: http.client.HTTPResponse,
        stream: bool,
        sticky_id: str | None,
    ) -> None:
        passed = self._track(index, response)
        content_type = response.getheader("Content-Type", "application/octet-stream")
        if response.status >= 400 or not stream:
            try:
                data = response.read()
            except TimeoutError:
                self._model_error(endpoint, index, 0, _TIMEOUT_MESSAGE.encode(), passed)
                return
            except (OSError, http.client.HTTPException) as exc:
                lost = self.server.router.mark_down(index)
                reason = f"backend {index} broke off its reply ({type(exc).__name__})"
                if sticky_id is not None:
                    self._session_gone(endpoint, index, sticky_id, reason, lost)
                else:
                    self._model_error(
                        endpoint,
                        index,
                        502,
                        json.dumps({"error": {"code": "backend_gone", "message": reason}}).encode(),
                        passed,
                    )
                return
            if response.status >= 400:
                self._model_error(endpoint, index, response.status, data, passed)
            else:
                self._send(
                    200,
                    data,
                    {"Content-Type": content_type, "x-Amzn-Invoked-Production-Variant": VARIANT_NAME, **passed},
                )
            return
        self.send_response(200)
        self.send_header("Content-Type", EVENT_STREAM_CONTENT_TYPE)
        self.send_header(HEADER_STREAM_CONTENT_TYPE, content_type)
        self.send_header("x-Amzn-Invoked-Production-Variant", VARIANT_NAME)
        self.send_header("x-amzn-RequestId", str(uuid.uuid4()))
        for key, value in passed.items():
            self.send_header(key, value)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            while True:
                try:
                    piece = response.read1(MAX_EVENT_PAYLOAD_BYTES)
                except (OSError, http.client.HTTPException) as exc:
                    self._write_chunk(stream_error_event(f"backend {index} broke off the stream: {exc}"))
                    break
                if not piece:
                    break
                self._write_chunk(payload_part_event(piece))
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the client went away; the backend's reply is dropped

    def _write_chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def _model_error(self, endpoint: str, index: int, status: int, body: bytes, passed: Mapping[str, str]) -> None:
        backend = self.server.router.backends[index]
        hint = f"backend {index} logs in {backend.log_dir}" if backend.log_dir else f"backend {index} logs"
        error = model_error_body(status, body, endpoint=endpoint, backend=index, log_hint=hint)
        self._send_json(424, error, {"x-amzn-ErrorType": MODEL_ERROR_TYPE, **passed})

    def _session_gone(self, endpoint: str, index: int, session_id: str, reason: str, lost: list[str]) -> None:
        if self.server.verbose:
            print(f"llava-local-endpoint: {reason}; forgot {len(lost)} session(s)", file=sys.stderr, flush=True)
        self._model_error(
            endpoint, index, 404, _session_gone_body(session_id, reason), {CLOSED_SESSION_ID_HEADER: session_id}
        )


class RouterServer(ThreadingHTTPServer):
    """The SageMaker-runtime HTTP front over a :class:`Router` (backends given by URL).

    Args:
        address: ``(host, port)`` to bind; port 0 picks a free one.
        router: the session router over the backends.
        endpoint_name: accept only this endpoint name (default: any).
        read_timeout_s: seconds to wait on a backend read.
        verbose: log each request to stderr.
        pass_new_session: forward an open's literal ``NEW_SESSION`` header to the backend, as
            SageMaker does (the handler then mints the id); False sends no header (TorchServe mints
            it, as the AWS TorchServe sample expects). The handler serves both
            (shared/notes/torchserve-sagemaker.md).
    """

    daemon_threads = True
    allow_reuse_address = True

    def __init__(
        self,
        address: tuple[str, int],
        router: Router,
        *,
        endpoint_name: str | None = None,
        read_timeout_s: float = DEFAULT_READ_TIMEOUT_S,
        verbose: bool = False,
        pass_new_session: bool = True,
    ) -> None:
        super().__init__(address, _Handler)
        self.router = router
        self.endpoint_name = endpoint_name
        self.read_timeout_s = read_timeout_s
        self.verbose = verbose
        self.pass_new_session = pass_new_session
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """Base URL (``endpoint_url`` for boto3)."""
        host, port = self.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> RouterServer:
        """Serve in a daemon thread; return self."""
        self._thread = threading.Thread(target=self.serve_forever, name="llava-local-endpoint", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and close the socket."""
        if self._thread is not None:
            self.shutdown()
            self._thread = None
        self.server_close()


# ---- the whole thing -----------------------------------------------------------------------------


class LocalEndpoint:
    """N :class:`LocalServer` backends behind a SageMaker-runtime-compatible router on loopback.

    Args:
        model_dir: checkpoint folder every backend serves.
        backends: number of TorchServe instances (each its own ports, TMPDIR, process group).
        port: router port on ``host``; 0 picks a free one.
        host: router bind address (loopback by default: this is a development tool).
        endpoint_name: accept only this endpoint name (default: any).
        read_timeout_s: seconds to wait on a backend read.
        verbose: log each request to stderr.
        pass_new_session: forward an open's literal ``NEW_SESSION`` (as SageMaker does), or no
            header (False: TorchServe mints the id); see :class:`RouterServer`.
        **server_kwargs: keyword arguments of :class:`LocalServer` for every backend
            (``overrides``, ``model_config_overrides``, ``handler``, ``startup_timeout_s``, ...).

    Use as a context manager, or :meth:`start` / :meth:`stop`.
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        backends: int = 2,
        port: int = 0,
        host: str = "127.0.0.1",
        endpoint_name: str | None = None,
        read_timeout_s: float = DEFAULT_READ_TIMEOUT_S,
        verbose: bool = False,
        pass_new_session: bool = True,
        **server_kwargs: Any,
    ) -> None:
        if backends < 1:
            raise ValueError(f"backends must be >= 1, got {backends}")
        self.servers = [LocalServer(model_dir, **server_kwargs) for _ in range(backends)]
        self.port = port
        self.host = host
        self.endpoint_name = endpoint_name
        self.read_timeout_s = read_timeout_s
        self.verbose = verbose
        self.pass_new_session = pass_new_session
        self.router: Router | None = None
        self._httpd: RouterServer | None = None

    @property
    def url(self) -> str:
        """The router's base URL (``endpoint_url`` for boto3)."""
        if self._httpd is None:
            raise RuntimeError("not started")
        return self._httpd.url

    def start(self) -> LocalEndpoint:
        """Start every backend (in parallel), then the router. Stops everything on failure.

        Raises:
            ServerStartError: a backend did not become ready (message holds its log tail).
        """
        try:
            with ThreadPoolExecutor(len(self.servers)) as pool:
                for future in [pool.submit(server.start) for server in self.servers]:
                    future.result()
            refs = [BackendRef(i, s.url, str(s.log_dir)) for i, s in enumerate(self.servers)]
            self.router = Router(refs)
            self._httpd = RouterServer(
                (self.host, self.port),
                self.router,
                endpoint_name=self.endpoint_name,
                read_timeout_s=self.read_timeout_s,
                verbose=self.verbose,
                pass_new_session=self.pass_new_session,
            ).start()
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def running(self) -> bool:
        """Whether the router is serving (a stopped backend does not stop the endpoint)."""
        return self._httpd is not None

    def abort_start(self) -> None:
        """Make a :meth:`start` in progress give up soon (from a signal handler)."""
        for server in self.servers:
            server.abort_start()

    def stop(self) -> None:
        """Stop the router and every backend (in parallel). Idempotent."""
        httpd, self._httpd = self._httpd, None
        if httpd is not None:
            httpd.stop()
        with ThreadPoolExecutor(len(self.servers)) as pool:
            list(pool.map(lambda server: server.stop(), self.servers))

    def __enter__(self) -> LocalEndpoint:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


# ---- CLI -------------------------------------------------------------------------------------


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llava-local-endpoint",
        description="Development/test tool: a SageMaker-runtime-compatible endpoint on 127.0.0.1 that "
        "routes sticky sessions over N local TorchServe backends (not a production router).",
    )
    parser.add_argument("--model-dir", required=True, help="llava-hf checkpoint folder")
    parser.add_argument("--backends", type=int, default=2, help="TorchServe instances (default 2)")
    parser.add_argument("--port", type=int, default=8090, help="router port on 127.0.0.1 (0: any free port)")
    parser.add_argument("--endpoint-name", default=None, help="accept only this endpoint name (default: any)")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        type=_parse_assignment,
        metavar="KEY=VALUE",
        help="handler setting for every backend (repeatable)",
    )
    parser.add_argument(
        "--ts-set",
        dest="model_config_overrides",
        action="append",
        default=[],
        type=_parse_assignment,
        metavar="KEY=VALUE",
        help="top-level model-config.yaml key for every backend (repeatable)",
    )
    parser.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for each backend")
    parser.add_argument(
        "--read-timeout", type=float, default=DEFAULT_READ_TIMEOUT_S, help="seconds to wait on a backend read"
    )
    parser.add_argument("--verbose", action="store_true", help="log every request")
    parser.add_argument(
        "--mint-session-ids",
        dest="pass_new_session",
        action="store_false",
        help="open without the session header, so TorchServe mints ts-seq-<uuid> ids (default: forward the "
        "literal NEW_SESSION, as SageMaker does; the handler then mints llava-<uuid>)",
    )
    parser.add_argument("--handler", default=None, help=argparse.SUPPRESS)  # tests: another TorchServe handler
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``llava-local-endpoint`` until SIGINT/SIGTERM; returns the exit code."""
    args = _build_parser().parse_args(argv)
    if not 0 <= args.port <= 65535 or args.backends < 1:
        print("llava-local-endpoint: --port must be 0..65535 and --backends >= 1", file=sys.stderr)
        return 2
    endpoint = LocalEndpoint(
        args.model_dir,
        backends=args.backends,
        port=args.port,
        endpoint_name=args.endpoint_name,
        read_timeout_s=args.read_timeout,
        verbose=args.verbose,
        pass_new_session=args.pass_new_session,
        overrides=dict(args.overrides),
        model_config_overrides=dict(args.model_config_overrides),
        startup_timeout_s=args.startup_timeout,
        handler=args.handler,
    )
    return run_until_signal(
        "llava-local-endpoint",
        endpoint,
        starting=f"starting {args.backends} TorchServe backend(s)",
        ready=lambda: "ready at {} (backends: {})".format(
            endpoint.url, ", ".join(f"{s.url} (logs {s.log_dir})" for s in endpoint.servers)
        ),
    )


if __name__ == "__main__":
    sys.exit(main())
