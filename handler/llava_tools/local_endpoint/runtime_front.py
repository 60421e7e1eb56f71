"""The local endpoint's HTTP proxy: SageMaker runtime's ``InvokeEndpoint`` and
``InvokeEndpointWithResponseStream`` on loopback, over a :class:`~llava_tools.local_endpoint.routing.Router`.

What it emulates, and why each choice, is :mod:`llava_tools.local_endpoint`'s docstring; the formats
are :mod:`.sagemaker_wire`'s, the routing and the call to a backend :mod:`.routing`'s.
"""

from __future__ import annotations

import hmac
import http.client
import json
import re
import sys
import uuid
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
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

from ..processes import BackgroundServing
from .routing import BackendGone, BackendTimeout, Router, forward, ping
from .sagemaker_wire import (
    EVENT_STREAM_CONTENT_TYPE,
    HEADER_CUSTOM_ATTRIBUTES,
    HEADER_STREAM_ACCEPT,
    HEADER_STREAM_CONTENT_TYPE,
    MAX_BODY_BYTES,
    MODEL_ERROR_TYPE,
    TIMEOUT_MESSAGE,
    VARIANT_NAME,
    model_error_body,
    payload_part_event,
    read_frame,
    session_gone_body,
    stream_error_event,
)

__all__ = ["DEFAULT_READ_TIMEOUT_S", "PREFIX_AWARE_ID_HEADER", "RouterServer"]

#: botocore's header for ``InvokeEndpoint``'s ``PrefixAwareId`` (sagemaker-runtime service model).
PREFIX_AWARE_ID_HEADER = "X-Amzn-SageMaker-Prefix-Aware-Id"

#: Seconds to wait for a backend's reply (per read); SageMaker allows 60 s for a whole reply.
DEFAULT_READ_TIMEOUT_S = 120.0

_PATH_RE = re.compile(r"^/endpoints/([^/]+)/(invocations|invocations-response-stream|openai/v1/chat/completions)$")
#: SageMaker's OpenAI-compatible route (May 2026): ``<runtime>/endpoints/<name>/openai/v1`` is the
#: ``base_url`` of the openai package; which container path it reaches is not documented, so it is
#: sent to ``/invocations``, where the chat dialect answers (docs/platform.md).
OPENAI_OPERATION = "openai/v1/chat/completions"
#: What a request without the ``--api-key`` is told (boto3 raises it as ``ClientError``).
API_KEY_REFUSED = (
    "missing or wrong API key: sign with it as the AWS access key id (boto3: aws_access_key_id=<key>) "
    "or send 'Authorization: Bearer <key>'"
)
_SIGV4_CREDENTIAL = re.compile(r"^AWS4-HMAC-SHA256 Credential=([^/,\s]+)/")


def presented_key(authorization: str | None) -> str:
    """The API key an ``Authorization`` header presents: a ``Bearer`` token (the openai package), or
    the access key id of an AWS Signature Version 4 (boto3 signs every request so: its
    ``Credential=<access key id>/<date>/<region>/sagemaker/aws4_request``); ``""`` for none."""
    value = (authorization or "").strip()
    if value.startswith("Bearer "):
        return value[len("Bearer ") :].strip()
    match = _SIGV4_CREDENTIAL.match(value)
    return match.group(1) if match else ""


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
            statuses = [ping(b) for b in router.backends]  # each backend's proxy: 200 only while it serves
            ok = 200 in statuses  # the endpoint serves while one instance does (it listens once all served)
            self._send_json(200 if ok else 503, {"status": "Healthy" if ok else "Unhealthy", "backends": statuses})
        elif not self.server.authorized(self.headers.get("Authorization")):
            self._aws_error(401, "UnrecognizedClientException", API_KEY_REFUSED)
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
        raw = operation == OPENAI_OPERATION
        if not self.server.authorized(self.headers.get("Authorization")):
            if raw:  # the openai package's route: OpenAI's 401
                message = "missing or wrong API key: send the header 'Authorization: Bearer <key>'"
                error = {"message": message, "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}
                self._send_json(401, {"error": error}, {"WWW-Authenticate": "Bearer"})
            else:
                self._aws_error(401, "UnrecognizedClientException", API_KEY_REFUSED)
            return
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
        self._invoke(endpoint, body, session_id or None, stream, raw=raw)

    def _invoke(self, endpoint: str, body: bytes, session_id: str | None, stream: bool, *, raw: bool = False) -> None:
        """Send ``body`` to a backend (the session's, else the least loaded) and relay its reply:
        SageMaker's shapes, or (``raw``: the OpenAI route) the container's reply as it came."""
        router = self.server.router
        opening = session_id is None or session_id == NEW_SESSION_LITERAL
        index = None if session_id is None or opening else router.lookup(session_id)
        sticky = index is not None
        prefix = self._prefix_key(body, raw) if session_id is None and router.prefix_aware else None
        if prefix is not None:
            index = router.for_prefix(prefix)
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
                connection, response = forward(
                    router.backends[index], body, self._backend_headers(forward_id, stream), self.server.read_timeout_s
                )
                break
            except BackendTimeout:
                self._model_error(endpoint, index, 0, TIMEOUT_MESSAGE.encode(), {})
                return
            except BackendGone as gone:
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
        router.outstanding(index, +1)
        try:
            if prefix is not None and response.status < 400:
                router.served(prefix, index)
            if raw:
                self._relay_raw(index, response)
            else:
                self._relay(endpoint, index, connection, response, stream, session_id if sticky else None)
        finally:
            router.outstanding(index, -1)
            connection.close()

    def _prefix_key(self, body: bytes, openai: bool) -> tuple[str, Any]:
        """SageMaker's ``PREFIX_AWARE`` key of a request without a session: its ``PrefixAwareId`` and
        the body's first ``PrefixLength`` bytes (on the OpenAI route: the first ``PrefixLength``
        characters of the messages' text), as botocore's ``PrefixAwareRoutingConfig`` documents."""
        app = self.headers.get(PREFIX_AWARE_ID_HEADER) or ""
        length = self.server.prefix_length
        if not openai:
            return app, body[:length]
        try:
            messages = json.loads(body).get("messages") or []
        except (ValueError, AttributeError, RecursionError):
            return app, body[:length]
        texts = []
        for message in messages if isinstance(messages, list) else []:
            content = message.get("content") if isinstance(message, dict) else None
            parts = content if isinstance(content, list) else [{"text": content}]
            texts += [p["text"] for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str)]
        return app, "".join(texts)[:length]

    def _backend_headers(self, session_id: str | None, stream: bool) -> dict[str, str]:
        """What a backend is sent: the content type, ``Accept`` (a stream's from SageMaker's own
        header), the custom attributes, the session id, and the endpoint's API key (the backends
        want it too)."""
        headers = {"Content-Type": self.headers.get("Content-Type", "application/json")}
        if self.server.api_key:
            headers["Authorization"] = f"Bearer {self.server.api_key}"
        accept = self.headers.get(HEADER_STREAM_ACCEPT if stream else "Accept")
        if accept:
            headers["Accept"] = accept
        if self.headers.get(HEADER_CUSTOM_ATTRIBUTES):
            headers[HEADER_CUSTOM_ATTRIBUTES] = self.headers[HEADER_CUSTOM_ATTRIBUTES]
        if session_id is not None:
            headers[SESSION_ID_HEADER] = session_id
        return headers

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
                self._model_error(endpoint, index, 0, TIMEOUT_MESSAGE.encode(), passed)
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
                    piece = read_frame(response)
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

    def _relay_raw(self, index: int, response: http.client.HTTPResponse) -> None:
        """Relay the container's reply as it came (status, content type, session headers, body;
        a chunked one chunk by chunk): the OpenAI route hands the client the container's own reply."""
        passed = self._track(index, response)
        self.send_response(response.status)
        self.send_header("Content-Type", response.getheader("Content-Type", "application/json"))
        self.send_header("x-amzn-RequestId", str(uuid.uuid4()))
        for key, value in passed.items():
            self.send_header(key, value)
        try:
            if not response.chunked:
                data = response.read()
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                return
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            while piece := read_frame(response):
                self._write_chunk(piece)
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except (OSError, http.client.HTTPException):
            self.close_connection = True  # the client went away, or the backend broke off

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
            endpoint, index, 404, session_gone_body(session_id, reason), {CLOSED_SESSION_ID_HEADER: session_id}
        )


class RouterServer(BackgroundServing, ThreadingHTTPServer):
    """The SageMaker-runtime HTTP proxy over a :class:`Router` (backends given by URL).

    Args:
        address: ``(host, port)`` to bind; port 0 picks a free one.
        router: the session router over the backends.
        endpoint_name: accept only this endpoint name (default: any).
        read_timeout_s: seconds to wait on a backend read.
        verbose: log each request to stderr.
        prefix_length: ``PREFIX_AWARE``'s ``PrefixLength`` (with a router made ``prefix_aware``).
        api_key: when set, every request but ``GET /ping`` must present it (:func:`presented_key`;
            compared in constant time), else 401 (``UnrecognizedClientException``; OpenAI's
            ``invalid_api_key`` on the OpenAI route). The real SageMaker checks IAM credentials instead.
        pass_new_session: forward an open's literal ``NEW_SESSION`` header to the backend (the
            handler then mints ``llava-<uuid4>``); False (the default) sends no header, so TorchServe
            mints ``ts-seq-<uuid4>``: what the AWS TorchServe sample's notebook asserts a real endpoint
            does. The handler serves both, as AWS's session manager does
            (docs/platform.md).
    """

    daemon_threads = True
    allow_reuse_address = True
    thread_name = "llava-local-endpoint"

    def __init__(
        self,
        address: tuple[str, int],
        router: Router,
        *,
        endpoint_name: str | None = None,
        read_timeout_s: float = DEFAULT_READ_TIMEOUT_S,
        verbose: bool = False,
        pass_new_session: bool = False,
        prefix_length: int = 1024,
        api_key: str | None = None,
    ) -> None:
        super().__init__(address, _Handler)
        self.api_key = api_key or None
        self.prefix_length = prefix_length
        self.router = router
        self.endpoint_name = endpoint_name
        self.read_timeout_s = read_timeout_s
        self.verbose = verbose
        self.pass_new_session = pass_new_session

    def authorized(self, authorization: str | None) -> bool:
        """Whether a request with this ``Authorization`` header may be served (always, without a key)."""
        if self.api_key is None:
            return True
        return hmac.compare_digest(presented_key(authorization).encode(), self.api_key.encode())

    @property
    def url(self) -> str:
        """Base URL (``endpoint_url`` for boto3)."""
        host, port = self.server_address[:2]
        return f"http://{host!s}:{port}"
