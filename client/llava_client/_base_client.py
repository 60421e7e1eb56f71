"""The base client: a transport, the request limit, and retries that never append a turn twice.

Retries (:func:`should_retry`): at most ``max_retries`` times, with capped jittered exponential
backoff honouring ``Retry-After``, and only where a repeat cannot duplicate work:

- opens, resets, closes and ``remember=False`` questions: on connection errors and timeouts,
  503, 429 and 409 ``session_busy``;
- a remembered question (it appends a turn): only when the server surely did not run it, i.e.
  the connection was never established, the handler refused it before any work (503
  ``overloaded``, 409 ``session_busy``), or SageMaker throttled (429);
- a stream only before its response started (never once a token arrived).

A restarting server answers ``503 model_not_ready`` (its proxy, with ``Retry-After``) or refuses
connections for a few seconds (docs/api.md, "When a worker dies"): once the server has answered this
client, such a request is retried for up to ``restart_wait_s`` seconds (default
:data:`DEFAULT_RESTART_WAIT_S`) from the first, past ``max_retries``, with the same backoff capped at
:data:`MAX_RESTART_RETRY_DELAY_S`; nothing ran, so any request may be repeated. A server that never answered (a wrong port, a server not started) gets
only ``max_retries``: the error, naming the URL, comes within a few seconds.
"""

from __future__ import annotations

import itertools
import json
import logging
import random
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any, TypeVar

from ._exceptions import (
    APIConnectionError,
    LlavaError,
    Overloaded,
    PayloadTooLarge,
    RateLimited,
    SessionBusy,
    status_error_from_body,
)
from ._images import MAX_BODY_BYTES, Downsized, ImageInput, fit_payload, image_budget, image_payload
from ._transport import LineStream, RawResponse, Transport, parse_expires, parse_session_header

__all__ = [
    "DEFAULT_MAX_RETRIES",
    "DEFAULT_RESTART_WAIT_S",
    "INITIAL_RETRY_DELAY_S",
    "MAX_RETRY_DELAY_S",
    "BaseClient",
    "retry_delay",
    "should_retry",
]

log = logging.getLogger("llava_client")

#: Retries after the first attempt.
DEFAULT_MAX_RETRIES = 2
#: First backoff delay; doubles per retry, capped at :data:`MAX_RETRY_DELAY_S`, times a 0.75–1.0 jitter.
INITIAL_RETRY_DELAY_S = 0.5
MAX_RETRY_DELAY_S = 8.0
#: Seconds a request that could not connect keeps being retried: a server restart's window (a tiny model's
#: restart measured 10-16 s quiet, 30-33 s under load; the server's proxy holds requests 60 s too).
DEFAULT_RESTART_WAIT_S = 60.0
#: Longest wait between two connection attempts inside that window.
MAX_RESTART_RETRY_DELAY_S = 2.0


T = TypeVar("T")
_Client = TypeVar("_Client", bound="BaseClient")


def should_retry(error: LlavaError, *, retry_safe: bool) -> bool:
    """Whether ``error`` may be retried.

    Args:
        error: what the attempt raised.
        retry_safe: the request cannot append a turn twice (open, reset, close, ``remember=False``).

    Connection errors and timeouts: when ``retry_safe``, or when the request surely never left
    (``request_sent`` false). 429: always. 409 ``session_busy``: always (the handler refuses it
    before any work while another request of the session is in flight). 503: when ``retry_safe``,
    or when it was refused before any work (code ``overloaded`` or ``model_not_ready``). Nothing else.
    """
    if isinstance(error, APIConnectionError):
        return retry_safe or not error.request_sent
    if isinstance(error, (RateLimited, SessionBusy)):
        return True
    if isinstance(error, Overloaded):
        return retry_safe or error.code in ("overloaded", "model_not_ready")
    return False


def retry_delay(attempt: int, error: LlavaError) -> float:
    """Seconds to wait before retry number ``attempt + 1``: ``Retry-After`` if given, else backoff."""
    hint = getattr(error, "retry_after", None)
    if hint is not None:
        return min(float(hint), MAX_RETRY_DELAY_S)
    delay = min(INITIAL_RETRY_DELAY_S * 2.0**attempt, MAX_RETRY_DELAY_S)
    return delay * (1.0 - 0.25 * random.random())


class BaseClient:
    """A transport with retries and the request limit: what sessions and the chat dialect call.

    Args:
        transport: an :class:`~llava_client.HttpTransport`, a :class:`~llava_client.SageMakerTransport`,
            or anything with their ``invoke`` / ``invoke_stream`` / ``close``.
        max_retries: retries after the first attempt (see :func:`should_retry`).
        auto_recover: reopen and replay a session the server lost (:mod:`llava_client._sessions`).
        max_body_bytes: largest request body sent (SageMaker's limit by default).
        restart_wait_s: seconds a request that could not connect is retried (past ``max_retries``),
            to ride out a server restart, once the server has answered this client; 0 turns this off.

    ``with`` closes the transport at the end.
    """

    def __init__(
        self,
        transport: Transport,
        *,
        max_retries: int = DEFAULT_MAX_RETRIES,
        auto_recover: bool = True,
        max_body_bytes: int = MAX_BODY_BYTES,
        restart_wait_s: float = DEFAULT_RESTART_WAIT_S,
    ) -> None:
        if max_retries < 0:
            raise ValueError("max_retries must be >= 0")
        if restart_wait_s < 0:
            raise ValueError("restart_wait_s must be >= 0")
        self.transport = transport
        self.max_retries = max_retries
        self.restart_wait_s = restart_wait_s
        self._reached = False  # the server answered once: a refused connection is then a restart
        self.auto_recover = auto_recover
        self.max_body_bytes = max_body_bytes

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.transport!r})"

    def __enter__(self: _Client) -> _Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the transport (open sessions stay open on the server until closed or expired)."""
        self.transport.close()

    def inline_image(self, image: ImageInput) -> tuple[dict[str, str], Downsized | None]:
        """The wire's image object for ``image``; an inline image over the request limit downsized
        (:func:`~llava_client._images.fit_payload`; said in the log and returned)."""
        payload, downsized = fit_payload(image_payload(image), image_budget(self.max_body_bytes))
        if downsized is not None:
            log.info("%s", downsized)
        return payload, downsized

    def encode(self, request: dict[str, Any]) -> bytes:
        """``request`` as compact UTF-8 JSON.

        Raises:
            PayloadTooLarge: over ``max_body_bytes`` (checked before sending).
        """
        body = json.dumps(request, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
        if len(body) > self.max_body_bytes:
            hint = (
                "upload the image to S3 and pass its s3:// URI (or an https URL) instead of inline data"
                if request.get("type") in ("open_session", "add_image") or "messages" in request
                else "shorten the prompt"
            )
            raise PayloadTooLarge(
                f"request body is {len(body):,} bytes, over the {self.max_body_bytes:,}-byte limit "
                f"(checked before sending); {hint}",
                status_code=413,
                code="payload_too_large",
            )
        return body

    def _retrying(self, call: Callable[[], T], *, retry_safe: bool, what: str) -> T:
        """``call()`` under :func:`should_retry` and the restart window; the last error raises."""
        first_refusal: float | None = None
        for attempt in itertools.count():
            try:
                result = call()
                self._reached = True
                return result
            except LlavaError as err:
                refused = (isinstance(err, APIConnectionError) and not err.request_sent) or (
                    isinstance(err, Overloaded) and err.code == "model_not_ready"  # a proxy whose server restarts
                )
                if not isinstance(err, APIConnectionError):
                    self._reached = True  # it answered: a later refusal is a restart, not a wrong address
                if refused and first_refusal is None:
                    first_refusal = time.monotonic()
                in_window = (
                    refused
                    and self._reached
                    and first_refusal is not None
                    and time.monotonic() - first_refusal < self.restart_wait_s
                )
                if not in_window and (attempt >= self.max_retries or not should_retry(err, retry_safe=retry_safe)):
                    raise
                delay = retry_delay(attempt, err)
                if in_window:
                    delay = min(delay, MAX_RESTART_RETRY_DELAY_S)
                log.info(
                    "retrying %s in %.2f s after %s (retry %d of %d)", what, delay, err, attempt + 1, self.max_retries
                )
                time.sleep(delay)
        raise AssertionError("unreachable")

    def invoke(self, request: dict[str, Any], session_id: str | None, *, retry_safe: bool) -> tuple[dict, RawResponse]:
        """Send ``request`` with retries; return (parsed JSON body, raw reply). Error bodies raise."""
        body = self.encode(request)

        def call() -> tuple[dict, RawResponse]:
            raw = self.transport.invoke(body, session_id=session_id)
            try:
                data = json.loads(raw.body)
            except ValueError:
                raise LlavaError(f"the server's reply is not JSON: {raw.body[:200]!r}") from None
            if not isinstance(data, dict):
                raise LlavaError("the server's reply is not a JSON object")
            if data.get("error"):  # an error found after the status went out (200)
                raise status_error_from_body(raw.status_code, data, headers=raw.headers, request_id=raw.request_id)
            return data, raw

        return self._retrying(call, retry_safe=retry_safe, what=str(request.get("type")))

    def invoke_stream(self, request: dict[str, Any], session_id: str, *, retry_safe: bool) -> LineStream:
        """Send ``request`` with retries (only before its response started); return its lines."""
        body = self.encode(request)
        return self._retrying(
            lambda: self.transport.invoke_stream(body, session_id=session_id),
            retry_safe=retry_safe,
            what="streamed chat" if "messages" in request else "streamed generate",
        )

    def invoke_open(self, request: dict[str, Any], what: str) -> tuple[str, datetime | None, dict]:
        """Send a request that opens a session (``open_session``, AWS's ``NEW_SESSION``); return its
        id and expiry (from ``X-Amzn-SageMaker-New-Session-Id``, else the body) and the reply's JSON.

        Raises:
            LlavaError: the reply named no session id (``what`` says which request). Others: :meth:`invoke`'s.
        """
        data, raw = self.invoke(request, None, retry_safe=True)
        session_id, expires_at = parse_session_header(raw.new_session_id)
        session_id = session_id or data.get("session_id")
        if not session_id:
            raise LlavaError(f"the server's {what} reply named no session id")
        return session_id, expires_at or parse_expires(data.get("expires_at")), data
