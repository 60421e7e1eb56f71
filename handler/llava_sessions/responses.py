"""The wire protocol's replies: pydantic models of every response body (outbound; docs/api.md).

The codec (``llava_sessions.codec``) renders engine results through these models, so a reply's shape
is stated once. Requests are ``llava_sessions.protocol``'s.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from .errors import ServiceError

__all__ = [
    "AddImageResponse",
    "CloseResponse",
    "ErrorBody",
    "ErrorDetail",
    "GenerateResponse",
    "GenerationDetails",
    "OpenSessionResponse",
    "ResetResponse",
    "SendTextPromptResponse",
    "StartSessionResponse",
    "StreamLine",
    "TokenInfo",
]


class _Outbound(BaseModel):
    model_config = ConfigDict(extra="forbid")


class OpenSessionResponse(_Outbound):
    """Reply to ``open_session``.

    Attributes:
        session_id: the new session's id (also in the session headers).
        expires_at: absolute expiry, ``YYYY-MM-DDTHH:MM:SSZ`` UTC (:func:`format_expires`).
        image_tokens: number of positions the image occupies in the context.
        timings: named phase durations in milliseconds (e.g. ``fetch_ms``, ``encode_ms``).
    """

    session_id: str
    expires_at: str
    image_tokens: int
    timings: dict[str, float] = Field(default_factory=dict)


class AddImageResponse(_Outbound):
    """Reply to ``add_image``.

    Attributes:
        session_id: the session.
        image_tokens: positions the new image occupies in the context (they depend on its size for
            anyres models).
        images: images the session holds now (the opening one included).
        prefix_tokens: tokens of the conversation up to the next question, now in the KV cache.
        cached_tokens: of those, how many were reused from the cache (not recomputed).
        timings: named phase durations in milliseconds (``fetch_ms``, ``decode_ms``, ``encode_ms``,
            ``prefill_ms``, ``total_ms``).
    """

    session_id: str
    image_tokens: int
    images: int
    prefix_tokens: int
    cached_tokens: int
    timings: dict[str, float] = Field(default_factory=dict)


class TokenInfo(_Outbound):
    """One generated token: vocabulary ``id``, decoded ``text`` (a detokenization delta, may be empty),
    natural-log probability, and ``special`` (an end-of-sequence token, whose text is empty), as TGI's."""

    id: int
    text: str
    logprob: float | None = None
    special: bool = False


class GenerationDetails(_Outbound):
    """Accounting of one generation.

    Attributes:
        finish_reason: ``"stop"`` (EOS or a stop string) or ``"length"`` (max_new_tokens reached).
        prompt_tokens: tokens of this turn's prompt (after templating).
        cached_tokens: context tokens reused from the session's cache (not recomputed).
        generated_tokens: tokens generated.
        max_new_tokens: the limit this answer ran under (the request's, the server default, or that
            default clipped to the room left in the context).
        truncated_turns: how many of the oldest remembered turns left the context (and the
            session's history) so that this turn fits; 0 when none did.
        seed: the sampler's seed (the one given, or the one drawn), so a sampled answer can be
            repeated; null for greedy answers.
        restored_from: the tier a demoted session was rebuilt from for this answer (``"features"``
            or ``"image"``); null when its KV cache was resident.
        tokens: per-token list, only when ``parameters.details`` was true.
        timings: named durations in milliseconds (e.g. ``ttft_ms``, ``total_ms``) and rates.
    """

    finish_reason: Literal["stop", "length"]
    prompt_tokens: int
    cached_tokens: int
    generated_tokens: int
    max_new_tokens: int | None = None
    truncated_turns: int = 0
    seed: int | None = None
    restored_from: Literal["features", "image"] | None = None
    tokens: list[TokenInfo] | None = None
    timings: dict[str, float] = Field(default_factory=dict)


class GenerateResponse(_Outbound):
    """Reply to a non-streaming ``generate``."""

    generated_text: str
    details: GenerationDetails | None = None


class ErrorDetail(_Outbound):
    """``{"code", "message"}`` of an error; ``code`` is an :class:`ErrorCode` value."""

    code: str
    message: str

    @classmethod
    def from_error(cls, error: ServiceError) -> ErrorDetail:
        """Build from a :class:`ServiceError`."""
        return cls(code=error.code.value, message=error.message)


class ErrorBody(_Outbound):
    """An error reply body: ``{"error": {"code", "message"}}``."""

    error: ErrorDetail

    @classmethod
    def from_error(cls, error: ServiceError) -> ErrorBody:
        """Build from a :class:`ServiceError`."""
        return cls(error=ErrorDetail.from_error(error))


class StreamLine(_Outbound):
    """One line of a streamed reply, SageMaker LMI / TGI JSON-lines format.

    Every line of an answer carries a ``token`` object: ``{"token": {...}, "generated_text": null,
    "details": null}``, and the last line carries the last generated token together with
    ``generated_text`` and ``details`` (TGI's shape), so readers that do
    ``json.loads(line)["token"]["text"]`` on every line read to the end, and the token texts join
    to ``generated_text``. An error found mid-stream (after the status went out with the first
    chunk) is the last line instead: ``{"token": null, "generated_text": null, "details": null,
    "error": {code, message}}``.
    """

    token: TokenInfo | None = None
    generated_text: str | None = None
    details: GenerationDetails | None = None
    error: ErrorDetail | None = None

    @classmethod
    def for_error(cls, error: ServiceError) -> StreamLine:
        """Build the terminal error line for ``error``."""
        return cls(error=ErrorDetail.from_error(error))

    def to_line(self) -> bytes:
        """Serialise as one UTF-8 JSON line ending in ``\\n``; ``error`` appears only when set."""
        exclude = {"error"} if self.error is None else None
        return self.model_dump_json(exclude=exclude).encode("utf-8") + b"\n"


class CloseResponse(_Outbound):
    """Reply to ``close_session``; ``success`` is kept for the AWS sample's client."""

    session_id: str
    closed: Literal[True] = True
    success: Literal[True] = True


class ResetResponse(_Outbound):
    """Reply to ``reset``."""

    session_id: str
    reset: Literal[True] = True


class StartSessionResponse(_Outbound):
    """Reply to the AWS sample's ``start_session``."""

    session_id: str


class SendTextPromptResponse(_Outbound):
    """Reply to the AWS sample's ``send_text_prompt``."""

    response_text: str
