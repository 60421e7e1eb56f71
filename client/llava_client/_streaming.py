"""Streamed answers as they arrive: :class:`AnswerStream` (a native ``generate``: text pieces) and
:class:`ChatStream` (a chat completion: :class:`ChatStreamEvent` deltas, the last carrying
``finish_reason`` and ``usage``, as openai-python's stream object ends with them).

Streams: :meth:`Session.stream` sends the request at once (errors before the first token raise
there) and returns an :class:`AnswerStream`, an iterator of text pieces and a context manager.
Leaving the ``with`` block (or calling ``close()``) early closes the HTTP response / event stream.
An error reported mid-stream raises from the iteration. ``stream.answer`` is the :class:`Answer`
once the last line arrived (None before). An answer cut short is abandoned: it is not added to
:attr:`Session.history`, and TorchServe drops the job when its client disconnects, so the server
does not remember it either (what SageMaker's front end does on a client disconnect is unverified).
Until the handler notices the dropped job, the session may answer 409 :class:`SessionBusy`.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from ._exceptions import APIConnectionError, LlavaError, status_error_from_body
from ._transport import LineStream
from ._types import Answer, Token

__all__ = ["AnswerStream", "ChatStream", "ChatStreamEvent", "ChatUsage"]

log = logging.getLogger("llava_client")

_E = TypeVar("_E")
_S = TypeVar("_S", bound="_Stream")


def ms_since(t0: float) -> float:
    """Milliseconds from ``t0`` (``time.perf_counter()`` seconds) to now, to 3 decimals."""
    return round((time.perf_counter() - t0) * 1000.0, 3)


class _Stream(Generic[_E]):
    """What both streams share: an iterator over ``_iterate()``'s items and a context manager that
    closes the response when left (:meth:`close`, idempotent); :attr:`text` joins ``_pieces``."""

    def __init__(self, lines: LineStream, session_id: str) -> None:
        self._lines = lines
        self._pieces: list[str] = []
        self._closed = False
        self._gen = self._iterate()
        self.session_id = session_id

    def _iterate(self) -> Generator[_E, None, None]:
        raise NotImplementedError

    def __iter__(self) -> Iterator[_E]:
        return self

    def __next__(self) -> _E:
        return next(self._gen)

    def __enter__(self: _S) -> _S:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def text(self) -> str:
        """The text received so far."""
        return "".join(self._pieces)

    def close(self) -> None:
        """Stop reading and release the connection. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._gen.close()
        self._lines.close()
        self._closed_early()

    def _closed_early(self) -> None:
        """Called by :meth:`close` (a stream read to its end is closed already)."""


class AnswerStream(_Stream[str]):
    """The text pieces of an answer as they arrive: an iterator and a context manager.

    ``for piece in stream`` yields non-empty text pieces (their concatenation is the answer text).
    When the last line arrives, :attr:`answer` is set and the iteration ends. An error reported
    mid-stream raises (typed, e.g. :class:`Overloaded`); a connection that breaks raises
    :class:`APIConnectionError`. Leaving ``with`` (or :meth:`close`) early closes the response.

    Attributes:
        answer: the :class:`Answer` once complete, else None.
        session_id: the session the answer belongs to.
    """

    def __init__(
        self, lines: LineStream, *, on_answer: Callable[[Answer], None] | None, t0: float, session_id: str
    ) -> None:
        self._on_answer = on_answer
        self._t0 = t0
        self._ttft_ms: float | None = None
        self._tokens: list[Token] = []
        self.answer: Answer | None = None
        super().__init__(lines, session_id)

    @property
    def client_ttft_ms(self) -> float | None:
        """Milliseconds from the call to the first token's arrival here (None before it)."""
        return self._ttft_ms

    def until_done(self) -> Answer:
        """Consume the rest of the stream and return the :class:`Answer`."""
        for _ in self:
            pass
        if self.answer is None:
            raise LlavaError("the stream was closed before the answer was complete")
        return self.answer

    def _closed_early(self) -> None:
        if self.answer is None:
            log.info(
                "stream of session %s closed before its end: the answer is abandoned (not remembered)", self.session_id
            )

    def _iterate(self) -> Generator[str, None, None]:
        try:
            for raw in self._lines:
                line = _json_line(raw)
                token = line.get("token")
                if token:  # every line of an answer has one; the last also has generated_text and details
                    if self._ttft_ms is None:
                        self._ttft_ms = ms_since(self._t0)
                    text = str(token.get("text") or "")
                    self._tokens.append(Token(int(token.get("id", -1)), text, token.get("logprob")))
                    if text:
                        self._pieces.append(text)
                        yield text
                if line.get("generated_text") is not None or line.get("details") is not None:
                    total_ms = ms_since(self._t0)
                    final = line.get("generated_text")
                    answer = Answer.from_wire(
                        str(final if final is not None else self.text),
                        line.get("details"),
                        tokens=self._tokens,
                        client_ttft_ms=self._ttft_ms if self._ttft_ms is not None else total_ms,
                        client_total_ms=total_ms,
                    )
                    self.answer = answer
                    if self._on_answer is not None:
                        self._on_answer(answer)
                    return
            raise APIConnectionError("the stream ended before its last line")
        finally:
            self._closed = True
            self._lines.close()


@dataclass(frozen=True)
class ChatUsage:
    """A chat answer's token counts: ``prompt_tokens``, ``completion_tokens``, and ``cached_tokens``
    (prompt tokens the server served from its cache)."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    @classmethod
    def from_wire(cls, usage: dict[str, Any]) -> ChatUsage:
        """OpenAI's ``usage`` object."""
        details = usage.get("prompt_tokens_details") or {}
        return cls(
            int(usage.get("prompt_tokens", 0)),
            int(usage.get("completion_tokens", 0)),
            int(details.get("cached_tokens", 0)),
        )


@dataclass(frozen=True)
class ChatStreamEvent:
    """One event of a :class:`ChatStream`: ``text``, the answer's next piece (may be empty on the
    last event); the last event alone carries ``finish_reason`` (``stop``, ``length``) and ``usage``
    (:class:`ChatUsage`, None if the server sent none). ``str(event)`` is its text."""

    text: str
    finish_reason: str | None = None
    usage: ChatUsage | None = None

    def __str__(self) -> str:
        return self.text


class ChatStream(_Stream[ChatStreamEvent]):
    """A streamed chat completion: an iterator of :class:`ChatStreamEvent` and a context manager.

    Text deltas come as they arrive; the last event carries ``finish_reason`` and ``usage``, which
    :attr:`finish_reason` and :attr:`usage` keep. An error object in the stream raises (typed, by its
    code); a connection that breaks raises :class:`APIConnectionError`. Leaving ``with`` (or
    :meth:`close`) early closes the response.

    Attributes:
        finish_reason, usage: the last event's, once it came (None before).
        session_id: the session it answers in (``""``: none).
    """

    def __init__(self, lines: LineStream, *, session_id: str) -> None:
        self.finish_reason: str | None = None
        self.usage: ChatUsage | None = None
        self.done = False
        super().__init__(lines, session_id)

    def until_done(self) -> str:
        """Consume the rest of the stream; return the whole answer's text.

        Raises:
            LlavaError: the stream was closed before its end. Others: as iterating.
        """
        for _ in self:
            pass
        if not self.done:
            raise LlavaError("the stream was closed before the answer was complete")
        return self.text

    def _iterate(self) -> Generator[ChatStreamEvent, None, None]:
        try:
            for raw in self._lines:
                text = raw.decode("utf-8").strip()
                text = text[5:].strip() if text.startswith("data:") else text
                if not text:
                    continue
                if text == "[DONE]":
                    break
                chunk = _json_line(text)
                if chunk.get("usage"):
                    self.usage = ChatUsage.from_wire(chunk["usage"])
                for choice in chunk.get("choices") or ():
                    self.finish_reason = choice.get("finish_reason") or self.finish_reason
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        self._pieces.append(piece)
                        yield ChatStreamEvent(piece)
            if self.finish_reason is None:
                raise APIConnectionError("the stream ended before its last chunk")
            self.done = True
            yield ChatStreamEvent("", self.finish_reason, self.usage)
        finally:
            self._closed = True
            self._lines.close()


def _json_line(raw: bytes | str) -> dict[str, Any]:
    """One JSON object of a stream (a native answer's line, a ``chat.completion.chunk``).

    Raises:
        LlavaError: not a JSON object. APIStatusError: it is an error object (typed by its code).
    """
    try:
        line = json.loads(raw)
    except ValueError:
        raise LlavaError(f"malformed stream line from the server: {raw[:200]!r}") from None
    if not isinstance(line, dict):
        raise LlavaError("malformed stream line from the server (not a JSON object)")
    if line.get("error"):
        raise status_error_from_body(200, line)
    return line
