"""The chat dialect's replies: ``chat.completion`` objects, ``chat.completion.chunk`` streams, OpenAI's error object.

The reply shapes are OpenAI's API reference ("The chat completion object", "The chat completion chunk
object"; ``openai.types.chat.ChatCompletion`` / ``ChatCompletionChunk`` validate them in the tests).
Streams are server-sent events (``data: {...}`` events ending with ``data: [DONE]``, as OpenAI, vLLM
and TGI send them), or JSON lines (one chunk per line, no ``[DONE]``: LMI's form) when the request's
``Accept`` is ``application/jsonlines``. Each event is written whole in its own frame (several
SageMaker stream wrappers assume one event per PayloadPart: docs/platform.md). Every error
of this dialect is written by :func:`encode_error` (a whole body) or :meth:`ChatStream.error` (a
stream's last events). AWS's session bodies answer :func:`encode_new_session` / :func:`encode_closed`.
No torch.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from ..errors import ServiceError
from ..results import Answer, TokenEvent
from ..wire.contract import format_expires
from ..wire.framing import EVENT_STREAM, EVENT_STREAM_UTF8, JSON_LINES
from .command import ChatCommand

__all__ = [
    "EVENT_STREAM",
    "ChatCompletionChunk",
    "ChatCompletionResponse",
    "ChatStream",
    "encode_closed",
    "encode_completion",
    "encode_error",
    "encode_new_session",
    "error_status",
    "openai_error",
    "openai_error_type",
    "usage_of",
]


class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TopLogprob(_Out):
    """One alternative at a position: ``token`` text, ``logprob``, its UTF-8 ``bytes``."""

    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    """A generated token's log-probability and its ``top_logprobs`` alternatives."""

    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(_Out):
    """``choices[0].logprobs``: the generated tokens' log-probabilities."""

    content: list[TokenLogprob] | None
    refusal: None = None


class Message(_Out):
    """``choices[0].message``: the assistant's answer."""

    role: Literal["assistant"] = "assistant"
    content: str
    refusal: None = None


class Choice(_Out):
    """One choice of a completion (one of ``n`` answers, by ``index``)."""

    index: int = 0
    message: Message
    logprobs: ChoiceLogprobs | None
    finish_reason: Literal["stop", "length", "abort"]


class PromptTokensDetails(_Out):
    """``usage.prompt_tokens_details``: ``cached_tokens`` served from the session's KV cache."""

    cached_tokens: int


class Usage(_Out):
    """Token counts of a completion (``completion_tokens`` include an ending EOS)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class ChatCompletionResponse(_Out):
    """OpenAI's ``chat.completion`` object."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    system_fingerprint: str | None = None
    warnings: list[str] | None = None  # ours, left out when none: what was done otherwise than asked


class Delta(_Out):
    """A chunk's ``delta``: the role (first chunk), then content."""

    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(_Out):
    """One choice's part of a chunk (a chunk carries the choices that have news, by ``index``)."""

    index: int = 0
    delta: Delta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort"] | None = None


class ChatCompletionChunk(_Out):
    """OpenAI's ``chat.completion.chunk`` object (``choices`` empty in the usage chunk)."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
    warnings: list[str] | None = None  # ours, on a stream's last chunk of choices, left out when none


def openai_error_type(status: int) -> str:
    """OpenAI's error ``type`` for an HTTP status: ``invalid_request_error`` (4xx) or ``server_error``."""
    return "invalid_request_error" if status < 500 else "server_error"


def openai_error(error: ServiceError) -> dict[str, Any]:
    """OpenAI's error object ``{"error": {"message", "type", "param", "code"}}``; ``code`` is our
    stable error code."""
    return {
        "error": {
            "message": error.message,
            "type": openai_error_type(error_status(error)),
            "param": error.param,
            "code": error.code.value,
        }
    }


def _usage(answers: Sequence[Answer]) -> Usage:
    """A request's usage: its prompt once, every answer's tokens (OpenAI counts all ``n`` choices)."""
    head = answers[0]
    return usage_of(head.prompt_tokens, sum(a.generated_tokens for a in answers), head.cached_tokens)


def usage_of(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> Usage:
    """OpenAI's ``usage`` object for these token counts (``total_tokens`` their sum)."""
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
    )


def _final_text(text: str, stop: Sequence[str], keep: bool = False) -> str:
    """``text`` up to the first stop sequence (OpenAI leaves the stop sequence out; ``keep``: up to
    its end, vLLM's ``include_stop_str_in_output``)."""
    found = [(i, len(s)) for i, s in ((text.find(s), s) for s in stop) if i >= 0]
    if not found:
        return text
    cut, length = min(found)
    return text[: cut + length] if keep else text[:cut]


def _logprobs(events: Sequence[TokenEvent], token_text: Callable[[int], str]) -> ChoiceLogprobs:
    content = []
    for e in events:
        if e.special or e.logprob is None:
            continue
        text = token_text(e.id)
        top = [TopLogprob(token=token_text(i), logprob=lp, bytes=list(token_text(i).encode())) for i, lp in e.top]
        content.append(TokenLogprob(token=text, logprob=e.logprob, bytes=list(text.encode()), top_logprobs=top))
    return ChoiceLogprobs(content=content)


def encode_completion(
    command: ChatCommand,
    answers: Sequence[Answer],
    token_text: Callable[[int], str],
    completion_id: str | None = None,
    *,
    warnings: Sequence[str] = (),
) -> bytes:
    """The whole reply to a non-streamed chat request: a ``chat.completion`` object, one choice per answer.

    Args:
        command: the request's command; answers: its finished answers, by choice index (``n``).
        token_text: token id → its text (for ``logprobs``).
        completion_id: the id to give it (default: a new ``chatcmpl-<uuid>``).
        warnings: what the request got otherwise than it asked (our ``warnings`` field; left out when none).
    """
    params = command.params
    choices = [
        Choice(
            index=i,
            message=Message(content=_final_text(answer.text, params.stop, command.keep_stop)),
            logprobs=_logprobs(answer.tokens, token_text) if params.logprobs else None,
            finish_reason=answer.finish_reason,
        )
        for i, answer in enumerate(answers)
    ]
    reply = ChatCompletionResponse(
        id=completion_id or f"chatcmpl-{uuid.uuid4().hex}",
        created=int(time.time()),
        model=command.model,
        choices=choices,
        usage=_usage(answers),
        warnings=list(warnings) or None,
    )
    return reply.model_dump_json(exclude=None if warnings else {"warnings"}).encode()


class ChatStream:
    """The events of one streamed chat request, each a whole frame: chunks whose ``choices`` carry the
    news of each of its ``n`` answers by ``index`` (every choice's first carries the role), each
    answer's ``finish_reason`` in the chunk after its last token, then the usage chunk and ``[DONE]``.

    Args:
        command: the request's command.
        sse: server-sent events (``data: {...}\\n\\n``, ending ``data: [DONE]``); False: JSON lines.
        token_text: token id → its text (for ``logprobs``).
    """

    def __init__(self, command: ChatCommand, *, sse: bool, token_text: Callable[[int], str]) -> None:
        self.command = command
        self.sse = sse
        self.token_text = token_text
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self._role_sent: set[int] = set()  # the choices whose role went out
        self._sent: dict[int, str] = {}  # each choice's content already sent
        self._holdback = max((len(s) for s in command.params.stop), default=1) - 1

    @property
    def content_type(self) -> str:
        """``text/event-stream; charset=utf-8`` or ``application/jsonlines``."""
        return EVENT_STREAM_UTF8 if self.sse else JSON_LINES

    def _frame(self, payload: str) -> bytes:
        return f"data: {payload}\n\n".encode() if self.sse else f"{payload}\n".encode()

    def chunk(self, choices: list[ChunkChoice], usage: Usage | None = None, warnings: Sequence[str] = ()) -> bytes:
        """One ``chat.completion.chunk`` event of ``choices`` (and ``usage``, ``warnings`` when given)."""
        chunk = ChatCompletionChunk(
            id=self.id,
            created=self.created,
            model=self.command.model,
            choices=choices,
            usage=usage,
            warnings=list(warnings) or None,
        )
        return self._frame(chunk.model_dump_json(exclude=None if warnings else {"warnings"}))

    def _delta(self, index: int, content: str | None) -> Delta:
        role: Literal["assistant"] | None = None if index in self._role_sent else "assistant"
        self._role_sent.add(index)
        return Delta(role=role, content=content)

    def tokens(self, index: int, events: Sequence[TokenEvent], text: str) -> ChunkChoice | None:
        """Choice ``index``'s part of a chunk for its new tokens (``events``, sampled since its last chunk;
        ``text``: its whole answer so far), or None when there are none. Every token gets a chunk, its
        content empty when its text is (a special token) or held back (text that could begin a stop
        sequence waits until it cannot), and the role goes with the first token's, as vLLM streams:
        a client's time to first token is the first token's."""
        if not events:
            return None
        sent = self._sent.get(index, "")
        ready = text[: max(len(sent), len(text) - self._holdback)] if self._holdback else text
        content = ready[len(sent) :]
        logprobs = _logprobs(events, self.token_text) if self.command.params.logprobs else None
        self._sent[index] = ready
        return ChunkChoice(index=index, delta=self._delta(index, content), logprobs=logprobs)

    def finish(self, index: int, answer: Answer, last: Sequence[TokenEvent]) -> ChunkChoice:
        """Choice ``index``'s last part: the rest of its content and its ``finish_reason``."""
        final = _final_text(answer.text, self.command.params.stop, self.command.keep_stop)
        sent = self._sent.get(index, "")
        content = final[len(sent) :] if final.startswith(sent) else ""
        logprobs = _logprobs(last, self.token_text) if self.command.params.logprobs else None
        delta = self._delta(index, content)
        return ChunkChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=answer.finish_reason)

    def end(self, choices: list[ChunkChoice], answers: Sequence[Answer], warnings: Sequence[str] = ()) -> list[bytes]:
        """The last frames: the chunk of the last ``choices`` (when any; with the ``warnings``), the
        usage chunk when asked for, and ``[DONE]`` (server-sent events); ``answers``: every answer, by index."""
        usage = _usage(answers)
        continuous = usage if self.command.continuous_usage else None
        frames = [self.chunk(choices, continuous, warnings)] if choices or warnings else []
        if self.command.include_usage:
            frames.append(self.chunk([], usage))
        return frames + self._done()

    def error(self, error: ServiceError) -> list[bytes]:
        """The frames of a stream that fails after it began: OpenAI's error object, then ``[DONE]``."""
        return [self._frame(json.dumps(openai_error(error)))] + self._done()

    def _done(self) -> list[bytes]:
        return [b"data: [DONE]\n\n"] if self.sse else []


def encode_error(error: ServiceError) -> bytes:
    """A whole error reply body in this dialect: OpenAI's error object (:func:`openai_error`)."""
    return json.dumps(openai_error(error)).encode()


def error_status(error: ServiceError) -> int:
    """The HTTP status of ``error`` in this dialect: OpenAI's and vLLM's, 400 for a request they refuse
    as it stands (a conversation too long for the context, too many images), where the native
    dialect answers 422; every other status as :data:`~llava_sessions.errors.HTTP_STATUS` gives it."""
    return 400 if error.status == 422 else error.status


def encode_new_session(session_id: str, expires_at: int) -> bytes:
    """The reply to AWS's ``{"requestType": "NEW_SESSION"}``: ``{"session_id", "expires_at"}``
    (``expires_at``: epoch seconds, written as UTC ``YYYY-MM-DDTHH:MM:SSZ``)."""
    return json.dumps({"session_id": session_id, "expires_at": format_expires(expires_at)}).encode()


class SessionClosed(_Out):
    """The reply to AWS's ``{"requestType": "CLOSE"}``: the session, ``closed`` and ``success``
    (the AWS sample's client reads ``success``)."""

    session_id: str
    closed: Literal[True] = True
    success: Literal[True] = True


def encode_closed(session_id: str) -> bytes:
    """The reply to AWS's ``{"requestType": "CLOSE"}`` (:class:`SessionClosed`)."""
    return SessionClosed(session_id=session_id).model_dump_json().encode()
