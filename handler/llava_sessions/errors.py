"""Typed errors with stable codes, shared by the engine, the store and the protocol layer.

Every error a client can see is a :class:`ServiceError` carrying an HTTP status, a stable
``code`` (an :class:`ErrorCode` value, never renamed once released) and a human message. It knows
no dialect: the request's dialect writes it with that status (the native
``{"error": {"code", "message"}}``, or OpenAI's error object). No torch, no HTTP here.
"""

from __future__ import annotations

from enum import Enum
from typing import Literal


class ErrorCode(str, Enum):
    """Stable error codes of the wire protocol (see docs/api.md)."""

    INVALID_REQUEST = "invalid_request"  # 400: malformed JSON, unknown type, missing/unknown field
    INVALID_PARAMETER = "invalid_parameter"  # 400: a value out of range
    MISSING_SESSION_ID = "missing_session_id"  # 400: generate/reset/close without a session id
    IMAGE_INVALID = "image_invalid"  # 400: not a decodable image
    IMAGE_FETCH_FAILED = "image_fetch_failed"  # 400: URL / S3 object could not be fetched
    IMAGE_FETCH_TIMEOUT = "image_fetch_timeout"  # 400: the image's host did not deliver it within the deadline
    IMAGE_URL_FORBIDDEN = "image_url_forbidden"  # 400: URL scheme, host or address refused
    IMAGE_UUID_NOT_FOUND = "image_uuid_not_found"  # 400: an image named by uuid that nothing (in its salt) holds
    VIDEO_INVALID = "video_invalid"  # 400: not a readable video (container, codec, no frames, truncated)
    VIDEO_UNSUPPORTED = "video_unsupported"  # 400: a video for a model without a video path (llava-1.5, NeXT)
    MODEL_NOT_FOUND = "model_not_found"  # 404: the OpenAI route names a model this server does not serve
    SESSION_NOT_FOUND = "session_not_found"  # 404: unknown id (never opened here, or closed)
    SESSION_EXPIRED = "session_expired"  # 404: past its TTL or idle timeout
    SESSION_EVICTED = "session_evicted"  # 404: dropped because the host-memory cap was reached
    SESSION_BUSY = "session_busy"  # 409: the session already has a generation in flight
    PAYLOAD_TOO_LARGE = "payload_too_large"  # 413: request body over the limit
    IMAGE_TOO_LARGE = "image_too_large"  # 413: image bytes or pixels over the limit
    VIDEO_TOO_LARGE = "video_too_large"  # 413: video bytes, frame pixels or frames to decode over the limit
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # 422: prompt + max_new_tokens > max positions
    IMAGE_LIMIT_EXCEEDED = "image_limit_exceeded"  # 422: images or image tokens per session over the limit
    OVERLOADED = "overloaded"  # 503: no memory or generation slot now; retry later
    MODEL_NOT_READY = "model_not_ready"  # 503: the model is loading, or reloading after a worker died
    INTERNAL_ERROR = "internal_error"  # 500: a bug; details only in the server log


#: HTTP status of each code (RFC 9110 semantics).
HTTP_STATUS: dict[ErrorCode, int] = {
    ErrorCode.INVALID_REQUEST: 400,
    ErrorCode.INVALID_PARAMETER: 400,
    ErrorCode.MISSING_SESSION_ID: 400,
    ErrorCode.IMAGE_INVALID: 400,
    ErrorCode.IMAGE_FETCH_FAILED: 400,
    ErrorCode.IMAGE_FETCH_TIMEOUT: 400,
    ErrorCode.IMAGE_URL_FORBIDDEN: 400,
    ErrorCode.IMAGE_UUID_NOT_FOUND: 400,
    ErrorCode.VIDEO_INVALID: 400,
    ErrorCode.VIDEO_UNSUPPORTED: 400,
    ErrorCode.MODEL_NOT_FOUND: 404,
    ErrorCode.SESSION_NOT_FOUND: 404,
    ErrorCode.SESSION_EXPIRED: 404,
    ErrorCode.SESSION_EVICTED: 404,
    ErrorCode.SESSION_BUSY: 409,
    ErrorCode.PAYLOAD_TOO_LARGE: 413,
    ErrorCode.IMAGE_TOO_LARGE: 413,
    ErrorCode.VIDEO_TOO_LARGE: 413,
    ErrorCode.CONTEXT_LENGTH_EXCEEDED: 422,
    ErrorCode.IMAGE_LIMIT_EXCEEDED: 422,
    ErrorCode.OVERLOADED: 503,
    ErrorCode.MODEL_NOT_READY: 503,
    ErrorCode.INTERNAL_ERROR: 500,
}


class ServiceError(Exception):
    """An error to report to the client as ``{"error": {"code", "message"}}``.

    Args:
        code: the stable error code; the HTTP status follows from it (:data:`HTTP_STATUS`).
        message: a human-readable message. It must never contain prompts, image bytes,
            internal addresses or stack traces.
        retry_after_s: for ``overloaded``, the value of the ``Retry-After`` header (seconds).
        param: the request field at fault (``messages[2].content``), for OpenAI's error object.
        shortage: for ``overloaded``, what the request waits for (:data:`Shortage`), or None.
    """

    def __init__(
        self,
        code: ErrorCode,
        message: str,
        *,
        retry_after_s: int | None = None,
        param: str | None = None,
        shortage: Shortage | None = None,
    ) -> None:
        super().__init__(message)
        self.code = ErrorCode(code)
        self.message = message
        self.retry_after_s = retry_after_s
        self.param = param
        self.shortage = shortage

    @property
    def status(self) -> int:
        """HTTP status code for this error."""
        return HTTP_STATUS[self.code]

    def __repr__(self) -> str:
        return f"ServiceError({self.code.value!r}, {self.message!r})"


#: What an ``overloaded`` request waits for: room to hold a session's state (a new session, an added
#: image, a demoted session's restore: other sessions must close, expire or be demoted), device
#: memory for one answer's step (freed as running answers finish), or a generation slot (freed at the
#: end of any answer).
Shortage = Literal["session_room", "step_memory", "generation_slot"]

#: The one Retry-After policy (seconds) for ``overloaded``, by what the request waits for (RFC 9110 10.2.3).
RETRY_AFTER_S: dict[str, int] = {"session_room": 5, "step_memory": 2, "generation_slot": 1}


def overloaded(message: str, shortage: Shortage) -> ServiceError:
    """A ``503 overloaded`` error whose ``Retry-After`` follows :data:`RETRY_AFTER_S` for ``shortage``."""
    return ServiceError(ErrorCode.OVERLOADED, message, retry_after_s=RETRY_AFTER_S[shortage], shortage=shortage)


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` and ``noun`` in a message, the noun plural unless ``n`` is 1: ``1 session``, ``2 sessions``
    (``plural``: the plural when it is not ``noun + "s"``)."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"
