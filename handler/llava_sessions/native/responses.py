"""The native dialect's replies: pydantic models of every response body (docs/api.md) and their encoders.

The ``encode_*`` functions render engine results through these models, so a reply's shape is stated
once; the AWS sample's shapes (``start_session``, ``send_text_prompt``) are chosen here by the
command's ``legacy`` flag. Every error of this dialect is written by :func:`encode_error` (a whole
body) or :func:`encode_stream_error` (a stream's last line). Requests are :mod:`.protocol`'s. No torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from ..errors import ServiceError
from ..results import AddImageResult, Answer, OpenResult, TokenEvent
from ..wire.contract import format_expires
from .protocol import GenerateCommand, OpenCommand

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
    "encode_add_image",
    "encode_answer",
    "encode_close",
    "encode_error",
    "error_status",
    "encode_open",
    "encode_reset",
    "encode_stream_end",
    "encode_stream_error",
    "encode_tokens",
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
        warnings: what the server did otherwise than asked (a video with fewer frames than asked);
            absent when nothing.
    """

    session_id: str
    expires_at: str
    image_tokens: int
    timings: dict[str, float] = Field(default_factory=dict)
    warnings: list[str] | None = None


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
        warnings: as :class:`OpenSessionResponse`'s.
    """

    session_id: str
    image_tokens: int
    images: int
    prefix_tokens: int
    cached_tokens: int
    timings: dict[str, float] = Field(default_factory=dict)
    warnings: list[str] | None = None


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
        finish_reason: ``"stop"`` (EOS or a stop string), ``"length"`` (max_new_tokens reached) or
            ``"abort"`` (the session was closed while the answer ran: what it said until then).
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

    finish_reason: Literal["stop", "length", "abort"]
    prompt_tokens: int
    cached_tokens: int
    generated_tokens: int
    max_new_tokens: int | None = None
    truncated_turns: int = 0
    seed: int | None = None
    restored_from: Literal["features", "image"] | None = None
    tokens: list[TokenInfo] | None = None
    timings: dict[str, float] = Field(default_factory=dict)


class GenerateChoice(_Outbound):
    """One answer of a ``generate`` of ``parameters.n`` > 1, by ``index``."""

    index: int
    generated_text: str
    details: GenerationDetails | None = None


class GenerateResponse(_Outbound):
    """Reply to a non-streaming ``generate``: the answer the session keeps; with ``parameters.n`` > 1
    also ``choices``, every answer by index (that one included)."""

    generated_text: str
    details: GenerationDetails | None = None
    choices: list[GenerateChoice] | None = None


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
    "error": {code, message}}``. An answer stopped by its session's close after its last token went
    out ends with ``"token": null`` and ``details.finish_reason`` ``"abort"``.
    """

    token: TokenInfo | None = None
    generated_text: str | None = None
    details: GenerationDetails | None = None
    error: ErrorDetail | None = None
    index: int | None = None  # the answer's, with ``parameters.n`` > 1

    @classmethod
    def for_error(cls, error: ServiceError) -> StreamLine:
        """Build the terminal error line for ``error``."""
        return cls(error=ErrorDetail.from_error(error))

    def to_line(self) -> bytes:
        """Serialise as one UTF-8 JSON line ending in ``\\n``; ``error`` appears only when set."""
        exclude = {name for name in ("error", "index") if getattr(self, name) is None}
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


def _token(event: TokenEvent) -> TokenInfo:
    return TokenInfo(id=event.id, text=event.text, logprob=event.logprob, special=event.special)


def encode_open(
    command: OpenCommand, result: OpenResult, timings_ms: Mapping[str, float], warnings: Sequence[str] = ()
) -> bytes:
    """The reply to an open: ``{"session_id", "expires_at", "image_tokens", "timings"}`` (and
    ``warnings`` when any), or the AWS sample's ``{"session_id"}``. ``timings_ms``: phase name →
    milliseconds (``fetch``, ...)."""
    if command.legacy:
        return StartSessionResponse(session_id=result.session_id).model_dump_json().encode()
    timings = {f"{k}_ms": v for k, v in timings_ms.items()}
    return (
        OpenSessionResponse(
            session_id=result.session_id,
            expires_at=format_expires(result.expires_at),
            image_tokens=result.image_tokens,
            timings=timings,
            warnings=list(warnings) or None,
        )
        .model_dump_json(exclude=None if warnings else {"warnings"})
        .encode()
    )


def encode_add_image(result: AddImageResult, timings_ms: Mapping[str, float], warnings: Sequence[str] = ()) -> bytes:
    """The reply to an added image: ``{"session_id", "image_tokens", "images", "prefix_tokens",
    "cached_tokens", "timings"}`` (and ``warnings`` when any). ``timings_ms``: phase name → milliseconds."""
    return (
        AddImageResponse(
            session_id=result.session_id,
            image_tokens=result.image_tokens,
            images=result.images,
            prefix_tokens=result.prefix_tokens,
            cached_tokens=result.cached_tokens,
            timings={f"{k}_ms": v for k, v in timings_ms.items()},
            warnings=list(warnings) or None,
        )
        .model_dump_json(exclude=None if warnings else {"warnings"})
        .encode()
    )


def encode_reset(session_id: str) -> bytes:
    """The reply to a reset: ``{"session_id", "reset": true}``."""
    return ResetResponse(session_id=session_id).model_dump_json().encode()


def encode_close(session_id: str) -> bytes:
    """The reply to a close (one shape for both: the AWS sample reads ``success``, ours ``closed``)."""
    return CloseResponse(session_id=session_id).model_dump_json().encode()


def generation_details(answer: Answer, with_tokens: bool) -> GenerationDetails:
    """The ``details`` object of an answer; ``with_tokens`` adds the per-token list."""
    t = answer.timings
    timings = {f"{k}_ms": v for k, v in t.items() if k != "decode_tokens_per_s"}
    timings["decode_tokens_per_s"] = t.get("decode_tokens_per_s", 0.0)
    tokens = [_token(e) for e in answer.tokens] if with_tokens else None
    return GenerationDetails(
        finish_reason=answer.finish_reason,
        prompt_tokens=answer.prompt_tokens,
        cached_tokens=answer.cached_tokens,
        generated_tokens=answer.generated_tokens,
        max_new_tokens=answer.max_new_tokens,
        truncated_turns=answer.truncated_turns,
        seed=answer.seed,
        restored_from=answer.restored_from,
        tokens=tokens,
        timings=timings,
    )


def encode_answer(command: GenerateCommand, answers: Sequence[Answer], kept: int = 0) -> bytes:
    """The whole reply to a non-streamed question: ``{"generated_text", "details"}`` of answer ``kept``
    (the session's), with every answer's as ``choices`` when there are several; or the AWS sample's
    ``{"response_text"}``."""
    answer = answers[kept]
    if command.legacy:
        return SendTextPromptResponse(response_text=answer.text).model_dump_json().encode()
    choices = None
    if len(answers) > 1:
        choices = [
            GenerateChoice(index=i, generated_text=a.text, details=generation_details(a, command.details))
            for i, a in enumerate(answers)
        ]
    details = generation_details(answer, command.details)
    reply = GenerateResponse(generated_text=answer.text, details=details, choices=choices)
    return reply.model_dump_json(exclude={"choices"} if choices is None else None).encode()


def encode_tokens(events: Sequence[TokenEvent], index: int | None = None) -> bytes:
    """Stream lines for ``events``: ``{"token": {...}, "generated_text": null, "details": null}`` each
    (and the answer's ``index`` when given)."""
    return b"".join(StreamLine(token=_token(e), index=index).to_line() for e in events)


def encode_stream_end(
    command: GenerateCommand, answer: Answer, last: TokenEvent | None, index: int | None = None
) -> bytes:
    """The last stream line of an answer: the ``last`` generated token with ``generated_text`` and
    ``details`` (and its ``index`` when given); an answer aborted after its last token went out ends
    with ``"token": null`` (as an error line does)."""
    details = generation_details(answer, command.details)
    token = _token(last) if last is not None else None
    return StreamLine(token=token, generated_text=answer.text, details=details, index=index).to_line()


def encode_stream_error(error: ServiceError) -> bytes:
    """The terminal line of a stream that failed after its first chunk: ``{"error": {code, message}}``."""
    return StreamLine.for_error(error).to_line()


def encode_error(error: ServiceError) -> bytes:
    """A whole error reply body: ``{"error": {"code", "message"}}``."""
    return ErrorBody.from_error(error).model_dump_json().encode()


def error_status(error: ServiceError) -> int:
    """The HTTP status of ``error`` in this dialect: :data:`~llava_sessions.errors.HTTP_STATUS`'s."""
    return error.status
