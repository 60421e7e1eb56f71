"""The codec: request bodies in, commands for the scheduler; engine results in, reply bodies out.

LitServe's ``decode_request`` / ``encode_response`` split: :meth:`Codec.decode_request` validates a
body (:func:`.protocol.parse_request`) and turns every accepted shape, the AWS TorchServe LLaVA
sample's (``start_session``, ``send_text_prompt``) included, into one of five commands
(:class:`OpenCommand`, :class:`GenerateCommand`, :class:`AddImageCommand`, :class:`ResetCommand`,
:class:`CloseCommand`) with
the server's defaults applied. The ``encode_*`` methods render the replies; a command remembers
whether it came in the AWS sample's shape, and only this module looks at that, so the scheduler has
no branch for it. Error bodies are rendered here alone (:meth:`Codec.encode_error`,
:meth:`Codec.encode_stream_error`). No TorchServe here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Union

from .chat_codec import ChatCommand, NewSessionCommand, chat_command, encode_openai_error
from .chat_protocol import ChatCompletionRequest, SessionControlRequest
from .config import Settings
from .contract import NEW_SESSION_LITERAL, format_expires
from .conversation import Turn
from .errors import ServiceError
from .protocol import (
    AddImageRequest,
    CloseSessionRequest,
    GenerateRequest,
    ImageSource,
    OpenSessionRequest,
    parse_request,
)
from .responses import (
    AddImageResponse,
    CloseResponse,
    ErrorBody,
    GenerateResponse,
    GenerationDetails,
    OpenSessionResponse,
    ResetResponse,
    SendTextPromptResponse,
    StartSessionResponse,
    StreamLine,
    TokenInfo,
)
from .results import AddImageResult, Answer, ContextPolicy, OpenResult, TokenEvent
from .sampling_params import SamplingParams

__all__ = [
    "JSON",
    "JSON_LINES",
    "AddImageCommand",
    "CloseCommand",
    "Codec",
    "Command",
    "GenerateCommand",
    "OpenCommand",
    "ResetCommand",
]

#: Content type of whole replies.
JSON = "application/json"
#: Content type of streamed replies (one JSON object per line; SageMaker LMI / TGI format).
JSON_LINES = "application/jsonlines"


@dataclass(frozen=True)
class OpenCommand:
    """Open a session on ``image`` (``legacy``: reply in the AWS sample's ``start_session`` shape)."""

    kind: ClassVar[str] = "open_session"

    image: ImageSource
    system_prompt: str | None
    history: tuple[Turn, ...] = ()
    legacy: bool = False
    history_images: tuple[ImageSource, ...] = ()  # the images the history's turns place, in order


@dataclass(frozen=True)
class GenerateCommand:
    """Answer ``prompt`` in the session.

    Attributes:
        prompt: the question (plain text).
        params: sampling parameters with the server's defaults applied.
        remember: the turn joins the history.
        stream: reply as JSON lines, a chunk per ``handle()`` call.
        details: include the per-token list in the reply's details.
        legacy: reply in the AWS sample's ``send_text_prompt`` shape (``{"response_text"}``).
        context_policy: ``truncate`` or ``error`` when the turn does not fit the context.
        clip_max_new_tokens: ``params.max_new_tokens`` is the server default, not the request's,
            so it may be clipped to the room left.
    """

    kind: ClassVar[str] = "generate"

    prompt: str
    params: SamplingParams
    remember: bool = True
    stream: bool = False
    details: bool = False
    legacy: bool = False
    context_policy: ContextPolicy = "truncate"
    clip_max_new_tokens: bool = False


@dataclass(frozen=True)
class AddImageCommand:
    """Append ``image`` to the session's conversation."""

    kind: ClassVar[str] = "add_image"

    image: ImageSource


@dataclass(frozen=True)
class ResetCommand:
    """Forget the conversation, keep the images."""

    kind: ClassVar[str] = "reset"


@dataclass(frozen=True)
class CloseCommand:
    """Close the session."""

    kind: ClassVar[str] = "close_session"


Command = Union[  # noqa: UP007 - a runtime alias on 3.10
    OpenCommand, GenerateCommand, AddImageCommand, ResetCommand, CloseCommand, ChatCommand, NewSessionCommand
]


def _token(event: TokenEvent) -> TokenInfo:
    return TokenInfo(id=event.id, text=event.text, logprob=event.logprob, special=event.special)


class Codec:
    """Decode request bodies into commands and encode replies, under the server's limits.

    Args:
        settings: the handler settings (body, prompt and ``max_new_tokens`` limits, defaults).
        model_name: the served model's name (OpenAI replies carry it).
    """

    def __init__(self, settings: Settings, model_name: str = "llava") -> None:
        self.settings = settings
        self.model_name = model_name

    # ------------------------------------------------------------------ decode
    def decode_request(self, body: Any) -> Command:
        """Validate one request body and return its command.

        Args:
            body: bytes / str, or the dict TorchServe decoded from an ``application/json`` body.

        Raises:
            ServiceError: ``invalid_request`` / ``invalid_parameter`` (400) or
                ``payload_too_large`` (413), as :func:`.protocol.parse_request` says.
        """
        s = self.settings
        request = parse_request(
            body,
            max_body_bytes=s.max_body_bytes,
            max_prompt_chars=s.max_prompt_chars,
            max_new_tokens_cap=s.max_new_tokens_cap,
        )
        if isinstance(request, ChatCompletionRequest):
            try:
                return chat_command(request, s, self.model_name)
            except ServiceError as err:
                err.dialect = "openai"
                raise
        if isinstance(request, SessionControlRequest):
            return NewSessionCommand() if request.requestType == NEW_SESSION_LITERAL else CloseCommand()
        legacy = request.legacy
        canonical = request.canonical()
        if isinstance(canonical, OpenSessionRequest):
            history = tuple(Turn(t.prompt, t.answer, len(t.images)) for t in canonical.history)
            images = tuple(image for t in canonical.history for image in t.images)
            return OpenCommand(canonical.image, canonical.system_prompt or s.system_prompt, history, legacy, images)
        if isinstance(canonical, GenerateRequest):
            p = canonical.parameters
            params = SamplingParams(
                max_new_tokens=p.max_new_tokens or s.default_max_new_tokens,
                temperature=p.temperature,
                top_p=p.top_p,
                top_k=p.top_k,
                repetition_penalty=p.repetition_penalty,
                do_sample=p.do_sample,
                seed=p.seed,
                stop=tuple(p.stop),
                logprobs=p.details or canonical.stream,
            )
            return GenerateCommand(
                canonical.prompt,
                params,
                remember=canonical.remember,
                stream=canonical.stream,
                details=p.details,
                legacy=legacy,
                context_policy=canonical.context_policy or s.context_policy,
                clip_max_new_tokens=p.max_new_tokens is None,
            )
        if isinstance(canonical, AddImageRequest):
            return AddImageCommand(canonical.image)
        if isinstance(canonical, CloseSessionRequest):
            return CloseCommand()
        return ResetCommand()

    # ------------------------------------------------------------------ encode
    @staticmethod
    def encode_open(command: OpenCommand, result: OpenResult, timings_ms: Mapping[str, float]) -> bytes:
        """The reply to an open: ``{"session_id", "expires_at", "image_tokens", "timings"}``, or the
        AWS sample's ``{"session_id"}``. ``timings_ms``: phase name → milliseconds (``fetch``, ...)."""
        if command.legacy:
            return StartSessionResponse(session_id=result.session_id).model_dump_json().encode()
        timings = {f"{k}_ms": v for k, v in timings_ms.items()}
        return (
            OpenSessionResponse(
                session_id=result.session_id,
                expires_at=format_expires(result.expires_at),
                image_tokens=result.image_tokens,
                timings=timings,
            )
            .model_dump_json()
            .encode()
        )

    @staticmethod
    def encode_add_image(result: AddImageResult, timings_ms: Mapping[str, float]) -> bytes:
        """The reply to an added image: ``{"session_id", "image_tokens", "images", "prefix_tokens",
        "cached_tokens", "timings"}``. ``timings_ms``: phase name → milliseconds."""
        return (
            AddImageResponse(
                session_id=result.session_id,
                image_tokens=result.image_tokens,
                images=result.images,
                prefix_tokens=result.prefix_tokens,
                cached_tokens=result.cached_tokens,
                timings={f"{k}_ms": v for k, v in timings_ms.items()},
            )
            .model_dump_json()
            .encode()
        )

    @staticmethod
    def encode_reset(session_id: str) -> bytes:
        """The reply to a reset: ``{"session_id", "reset": true}``."""
        return ResetResponse(session_id=session_id).model_dump_json().encode()

    @staticmethod
    def encode_close(session_id: str) -> bytes:
        """The reply to a close (one shape for both: the AWS sample reads ``success``, ours ``closed``)."""
        return CloseResponse(session_id=session_id).model_dump_json().encode()

    @staticmethod
    def details(answer: Answer, with_tokens: bool) -> GenerationDetails:
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

    def encode_answer(self, command: GenerateCommand, answer: Answer) -> bytes:
        """The whole reply to a non-streamed question: ``{"generated_text", "details"}``, or the AWS
        sample's ``{"response_text"}``."""
        if command.legacy:
            return SendTextPromptResponse(response_text=answer.text).model_dump_json().encode()
        details = self.details(answer, command.details)
        return GenerateResponse(generated_text=answer.text, details=details).model_dump_json().encode()

    @staticmethod
    def encode_tokens(events: Sequence[TokenEvent]) -> bytes:
        """Stream lines for ``events``: ``{"token": {...}, "generated_text": null, "details": null}`` each."""
        return b"".join(StreamLine(token=_token(e)).to_line() for e in events)

    def encode_stream_end(self, command: GenerateCommand, answer: Answer, last: TokenEvent) -> bytes:
        """The last stream line: the ``last`` generated token with ``generated_text`` and ``details``."""
        details = self.details(answer, command.details)
        return StreamLine(token=_token(last), generated_text=answer.text, details=details).to_line()

    @staticmethod
    def encode_stream_error(error: ServiceError) -> bytes:
        """The terminal line of a stream that failed after its first chunk: ``{"error": {code, message}}``."""
        return StreamLine.for_error(error).to_line()

    @staticmethod
    def encode_error(error: ServiceError) -> bytes:
        """A whole error reply body: ``{"error": {"code", "message"}}``, or OpenAI's error object
        ``{"error": {"message", "type", "param", "code"}}`` for a request in that dialect."""
        if error.dialect == "openai":
            return json.dumps(encode_openai_error(error)).encode()
        return ErrorBody.from_error(error).model_dump_json().encode()

    @staticmethod
    def encode_new_session(session_id: str, expires_at: int) -> bytes:
        """The reply to AWS's ``{"requestType": "NEW_SESSION"}``: ``{"session_id", "expires_at"}``."""
        return json.dumps({"session_id": session_id, "expires_at": format_expires(expires_at)}).encode()
