"""The requests the proxy answers itself, never relayed to TorchServe's inference port.

- ``GET /ping`` and vLLM's ``GET /health``: 200 only while the worker serves (no key needed);
- the worker's image lookups (``GET /_llava/images/<ticket>``: the ticket is their secret);
- with an API key, any other request without it: ``401 invalid_api_key``;
- ``GET /metrics``: TorchServe's Prometheus text (the worker's ``llava_*`` metrics and its own), read
  from its metrics port on loopback, as vLLM serves ``/metrics`` on its API's port;
- OpenAI's routes other than chat completions (``GET /v1/models``, ``/v1/models/<id>``, a 404 for the
  rest).
"""

from __future__ import annotations

import http.client
import json
from typing import Any, Protocol

from llava_sessions.wire.contract import IMAGE_RELAY_PATH

from .http_wire import (
    HEALTH_PATHS,
    OPENAI_PREFIX,
    Fields,
    field,
    openai_error,
    ping_reply,
    relayed_image,
    response,
    unauthorized,
)
from .image_relay import ImageRelay

__all__ = ["CHAT_COMPLETIONS_PATH", "METRICS_PATH", "FrontState", "answered_here", "metrics_reply"]

CHAT_COMPLETIONS_PATH = OPENAI_PREFIX.encode() + b"/chat/completions"
"""The one OpenAI route relayed to TorchServe (as ``/invocations``); the proxy answers the rest."""
#: Prometheus's conventional path, on the API's port as vLLM serves it.
METRICS_PATH = b"/metrics"
#: Seconds to wait for TorchServe's metrics port.
METRICS_TIMEOUT_S = 10.0


class FrontState(Protocol):
    """What these routes read of the proxy (:class:`~llava_tools.serve.front.OpenAIFront`)."""

    ready: bool
    images: ImageRelay | None
    metrics: tuple[str, int] | None
    routes: bool
    model_names: tuple[str, ...]

    def retry_after_s(self) -> int: ...

    def authorized(self, authorization: bytes | None) -> bool: ...

    def model_card(self, name: str | None = None) -> dict[str, Any]: ...


def answered_here(server: FrontState, method: bytes, target: bytes, fields: Fields) -> bytes | None:
    """The reply to a request the proxy answers itself (module docstring), or None: it goes on to
    TorchServe (chat completions as ``/invocations``, any other path as it came)."""
    path = target.partition(b"?")[0]
    if path in HEALTH_PATHS:
        return ping_reply(server.ready, server.retry_after_s())
    if server.images is not None and method == b"GET" and path.startswith(IMAGE_RELAY_PATH.encode()):
        return relayed_image(server.images, target)  # the worker's lookup: its ticket is the secret
    if not server.authorized(field(fields, b"authorization")):
        return unauthorized()
    if method == b"GET" and path == METRICS_PATH and server.metrics is not None:
        return metrics_reply(server.metrics)
    if server.routes and (path.startswith(OPENAI_PREFIX.encode() + b"/") or path == OPENAI_PREFIX.encode()):
        return _openai(server, method, path)
    if server.routes and path.rstrip(b"/") in WITHOUT_V1:  # an OpenAI client whose base_url lacks /v1
        message = f"{path.decode(errors='replace')} is not served here: an OpenAI base_url ends in /v1"
        return openai_error(404, "Not Found", message + f" (this path is {OPENAI_PREFIX}{path.decode()})", "not_found")
    return None


#: OpenAI's paths as a client whose ``base_url`` lacks ``/v1`` asks for them (TorchServe would answer its
#: bare "Requested resource is not found").
WITHOUT_V1 = (b"/chat/completions", b"/models", b"/completions", b"/embeddings")


def metrics_reply(address: tuple[str, int]) -> bytes:
    """TorchServe's ``GET /metrics`` at ``address`` (its metrics port) as a whole reply; ``503
    model_not_ready`` while nothing answers there (a restart)."""
    conn = http.client.HTTPConnection(*address, timeout=METRICS_TIMEOUT_S)
    try:
        conn.request("GET", METRICS_PATH.decode())
        reply = conn.getresponse()
        body = reply.read()
        kind = (reply.getheader("Content-Type") or "text/plain; version=0.0.4").encode("latin-1")
    except OSError:
        return openai_error(503, "Service Unavailable", "the metrics are not available now", "model_not_ready")
    finally:
        conn.close()
    head = b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n"
    return head % (reply.status, reply.reason.encode("latin-1"), kind, len(body)) + body


def _openai(server: FrontState, method: bytes, path: bytes) -> bytes | None:
    """OpenAI's routes answered here (None: chat completions, relayed to ``/invocations``)."""
    if method == b"POST" and path == CHAT_COMPLETIONS_PATH:
        return None
    if method == b"GET" and path == b"/v1/models":
        cards = [server.model_card(name) for name in server.model_names]
        return response(200, "OK", json.dumps({"object": "list", "data": cards}).encode())
    if method == b"GET" and path.startswith(b"/v1/models/"):
        name = path.removeprefix(b"/v1/models/").decode(errors="replace")
        if name in server.model_names:
            return response(200, "OK", json.dumps(server.model_card(name)).encode())
        return openai_error(404, "Not Found", "no such model on this server", "model_not_found")
    message = f"{method.decode(errors='replace')} {path.decode(errors='replace')} is not served here"
    return openai_error(404, "Not Found", message + "; use POST /v1/chat/completions", "not_found")
