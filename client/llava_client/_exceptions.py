"""Typed errors of the client, split first by where they happened (openai-python style).

- No response at all: :class:`APIConnectionError` (its subclass :class:`APITimeoutError` for a
  timeout). ``request_sent`` says whether the request may have reached the server.
- A response with an error: :class:`APIStatusError` carrying ``status_code``, the stable ``code``
  of the wire protocol (``session_not_found``, ``overloaded``, ...), ``message``, the parsed
  ``body`` and the ``request_id`` when the transport knows it. One subclass per status family,
  chosen in ONE place: :func:`error_class`.

The code → status table :data:`CODE_STATUS` mirrors the server's ``llava_sessions.errors.HTTP_STATUS``
(a test keeps them equal). It is needed because a few errors arrive with status 200: a non-streamed
answer that failed after its first step, and the last line of a stream that failed mid-answer
(TorchServe sends the status with the first frame).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

__all__ = [
    "CODE_STATUS",
    "APIConnectionError",
    "APIStatusError",
    "APITimeoutError",
    "AuthenticationError",
    "ContextLengthExceeded",
    "ImageLimitExceeded",
    "InternalServerError",
    "InvalidRequest",
    "LlavaError",
    "Overloaded",
    "PayloadTooLarge",
    "RateLimited",
    "SessionBusy",
    "SessionEvicted",
    "SessionExpired",
    "SessionGone",
    "SessionNotFound",
    "error_class",
    "make_status_error",
    "status_error_from_body",
]

#: HTTP status of each error code of the wire protocol (= ``llava_sessions.errors.HTTP_STATUS``).
CODE_STATUS: dict[str, int] = {
    "invalid_request": 400,
    "invalid_parameter": 400,
    "missing_session_id": 400,
    "image_invalid": 400,
    "image_fetch_failed": 400,
    "image_fetch_timeout": 400,
    "image_url_forbidden": 400,
    "image_uuid_not_found": 400,
    "video_invalid": 400,
    "video_unsupported": 400,
    "model_not_found": 404,
    "session_not_found": 404,
    "session_expired": 404,
    "session_evicted": 404,
    "session_busy": 409,
    "payload_too_large": 413,
    "image_too_large": 413,
    "video_too_large": 413,
    "context_length_exceeded": 422,
    "image_limit_exceeded": 422,
    "overloaded": 503,
    "model_not_ready": 503,
    "internal_error": 500,
}


class LlavaError(Exception):
    """Base of every error this client raises (besides ``TypeError``/``ValueError`` for bad arguments
    and ``OSError`` for an unreadable local image)."""


class APIConnectionError(LlavaError):
    """No response: the connection failed, broke, or a stream ended before its last line.

    Attributes:
        request_sent: False when the request surely never reached the server (connection refused,
            connect timeout, DNS failure): then even a request that appends a turn may be retried.
    """

    def __init__(self, message: str = "connection error", *, request_sent: bool = True) -> None:
        super().__init__(message)
        self.message = message
        self.request_sent = request_sent


class APITimeoutError(APIConnectionError):
    """No response within the timeout (connect or read)."""

    def __init__(self, message: str = "request timed out", *, request_sent: bool = True) -> None:
        super().__init__(message, request_sent=request_sent)


class APIStatusError(LlavaError):
    """The server answered with an error.

    Attributes:
        status_code: HTTP status (for SageMaker: the container's ``OriginalStatusCode``; for an
            error reported inside a 200 body, the status its ``code`` stands for).
        code: the wire protocol's error code (``"session_not_found"``...), TorchServe's or
            SageMaker's own error type for errors they raise themselves, or None.
        message: the human-readable message.
        body: the parsed JSON body (or the raw text), or None.
        request_id: the request id the transport saw (SageMaker ``RequestId``), or None.
    """

    def __init__(
        self,
        message: str,
        *,
        status_code: int,
        code: str | None = None,
        body: Any = None,
        request_id: str | None = None,
    ) -> None:
        super().__init__(f"{status_code} {code}: {message}" if code else f"{status_code}: {message}")
        self.status_code = status_code
        self.code = code
        self.message = message
        self.body = body
        self.request_id = request_id


class InvalidRequest(APIStatusError):
    """400: malformed request, bad parameter, missing session id, or an image that cannot be used."""


class AuthenticationError(APIStatusError):
    """401 ``invalid_api_key``: the server requires an API key (``llava-serve --api-key``) and the
    request carried none or another (``SessionClient.from_url(..., api_key=...)``, ``LLAVA_API_KEY``)."""


class SessionGone(APIStatusError):
    """404: the session no longer exists on the server (base of the three reasons)."""


class SessionNotFound(SessionGone):
    """404 ``session_not_found``: unknown id (closed, or lost with a restarted worker)."""


class SessionExpired(SessionGone):
    """404 ``session_expired``: past its time-to-live or idle timeout."""


class SessionEvicted(SessionGone):
    """404 ``session_evicted``: dropped to make room (the server's memory cap was reached)."""


class SessionBusy(APIStatusError):
    """409: the session is already generating an answer (one request at a time per session)."""


class PayloadTooLarge(APIStatusError):
    """413: request body or image over the limit (also raised client-side before sending)."""


class ContextLengthExceeded(APIStatusError):
    """``context_length_exceeded``: history + prompt + ``max_new_tokens`` do not fit the model's
    context (422 in the native dialect, 400 in the chat dialect, as OpenAI and vLLM answer it)."""


class ImageLimitExceeded(APIStatusError):
    """``image_limit_exceeded`` (422 native, 400 chat): the session holds the server's maximum of
    images or image tokens."""


class RateLimited(APIStatusError):
    """429: throttled (SageMaker ``ThrottlingException`` / ``ModelNotReadyException``); retried."""


class Overloaded(APIStatusError):
    """503: no memory or generation slot now; retried with backoff.

    Attributes:
        retry_after: the server's ``Retry-After`` hint in seconds, or None.
    """

    def __init__(self, message: str, *, retry_after: float | None = None, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.retry_after = retry_after


class InternalServerError(APIStatusError):
    """5xx other than 503: a server bug or a dead worker (TorchServe 507)."""


_BY_CODE: dict[str, type[APIStatusError]] = {
    "session_not_found": SessionNotFound,
    "session_expired": SessionExpired,
    "session_evicted": SessionEvicted,
    "context_length_exceeded": ContextLengthExceeded,
    "image_limit_exceeded": ImageLimitExceeded,
}

_BY_STATUS: dict[int, type[APIStatusError]] = {
    401: AuthenticationError,
    400: InvalidRequest,
    409: SessionBusy,
    413: PayloadTooLarge,
    422: ContextLengthExceeded,
    429: RateLimited,
    503: Overloaded,
}


def error_class(status_code: int, code: str | None) -> type[APIStatusError]:
    """Return the exception class for an error response: the one mapping of (status, code) → type.

    A session code picks its :class:`SessionGone` subclass, and ``context_length_exceeded`` /
    ``image_limit_exceeded`` theirs, whatever the status (the chat dialect answers them 400, the
    native one 422); otherwise the status decides; a 404 without a session code (e.g. a wrong URL) is a plain
    :class:`APIStatusError`, so it never triggers session recovery.
    """
    if code in _BY_CODE:
        return _BY_CODE[code]
    if status_code in _BY_STATUS:
        return _BY_STATUS[status_code]
    if status_code >= 500:
        return InternalServerError
    return APIStatusError


def _parse_retry_after(value: Any) -> float | None:
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        return None
    return seconds if seconds >= 0 else None


def make_status_error(
    status_code: int,
    code: str | None,
    message: str,
    *,
    body: Any = None,
    request_id: str | None = None,
    retry_after: Any = None,
) -> APIStatusError:
    """Build the typed error for ``(status_code, code)`` (see :func:`error_class`)."""
    cls = error_class(status_code, code)
    kwargs: dict[str, Any] = {"status_code": status_code, "code": code, "body": body, "request_id": request_id}
    if issubclass(cls, Overloaded):
        kwargs["retry_after"] = _parse_retry_after(retry_after)
    return cls(message, **kwargs)


def status_error_from_body(
    status_code: int,
    body: bytes | str | Mapping[str, Any] | None,
    *,
    headers: Mapping[str, str] | None = None,
    request_id: str | None = None,
) -> APIStatusError:
    """Build the typed error for an error response body.

    Understands our ``{"error": {"code", "message"}}``, TorchServe's own
    ``{"code": 503, "type": "ServiceUnavailableException", "message": ...}`` and anything else
    (kept as text). A 200 status with an ``error`` body takes the status its code stands for.
    """
    parsed: Any = body
    if isinstance(body, (bytes, bytearray)):
        body = bytes(body).decode("utf-8", "replace")
    if isinstance(body, str):
        try:
            parsed = json.loads(body) if body.strip() else None
        except ValueError:
            parsed = body
    code: str | None = None
    message = ""
    if isinstance(parsed, Mapping):
        error = parsed.get("error")
        if isinstance(error, Mapping):
            code = error.get("code") if isinstance(error.get("code"), str) else None
            message = str(error.get("message", ""))
        else:
            code = parsed.get("type") if isinstance(parsed.get("type"), str) else None
            message = str(parsed.get("message", "")) or json.dumps(parsed)[:500]
    elif isinstance(parsed, str):
        message = parsed[:500]
    if status_code < 400:
        status_code = CODE_STATUS.get(code or "", 500)
    retry_after = None
    if headers is not None:
        retry_after = next((v for k, v in headers.items() if k.lower() == "retry-after"), None)
    return make_status_error(
        status_code, code, message or f"HTTP {status_code}", body=parsed, request_id=request_id, retry_after=retry_after
    )
