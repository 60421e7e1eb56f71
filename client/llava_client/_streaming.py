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
from ._types import Answer, Token, warnings_of

__all__ = ["AnswerStream", "ChatStream", "ChatStreamEvent", "ChatUsage"]

log = logging.getLogger("llava_client")

_E = TypeVar("_E")
_S = TypeVar("_S", bound="_Stream")


def ms_since(t0: float) -> float:
    """Milliseconds from ``t0`` (``time.perf_counter()`` seconds) to now, to 3 decimals."""
    return round((time.perf_counter() - t0) * 1000.0, 3)


#: Times one stream is sent again after its server's worker died mid-answer.
MAX_STREAM_RESUMES = 2
#: The code of the error event a stream ends with when its server's worker died mid-answer (the
#: server's proxy writes it: nothing of the answer survived, and the worker restarts).
WORKER_LOST_CODE = "model_not_ready"


class _Stream(Generic[_E]):
    """What both streams share: an iterator over ``_iterate()``'s items and a context manager that
    closes the response when left (:meth:`close`, idempotent); :attr:`text` joins ``_pieces``.

    Riding out a dead worker (``resend``): a stream that ends with ``model_not_ready`` (its server's
    worker died mid-answer; nothing of the answer survived) is sent again through ``resend()`` (the
    client's retries wait out the restart, and a lost session is recovered there), and the answer
    goes on where it stopped: the resent answer's first characters, which must be the text already
    given, are skipped (greedy answers, and sampled ones with a seed, come out the same; the clients
    give every sampled request a seed). An answer that comes out otherwise raises the error.
    """

    def __init__(self, lines: LineStream, session_id: str, resend: Callable[[], LineStream] | None = None) -> None:
        self._lines = lines
        self._pieces: list[str] = []
        self._closed = False
        self._resend = resend
        self._skip: str | None = None  # after a resend: the text already given, to skip
        self._replayed = ""  # after a resend: the resent answer's text so far, while it is skipped
        self._error: LlavaError | None = None  # the error a resend rides out
        self._gen = self._iterate()
        self.session_id = session_id
        #: Times this stream was sent again after a dead worker.
        self.resumes = 0

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

    def _resumed(self, error: LlavaError) -> bool:
        """After ``error`` ended the stream mid-answer: whether it was sent again (``self._lines`` is
        the new reply's; the text given so far is skipped from it by :meth:`_given`)."""
        if (
            self._resend is None
            or getattr(error, "code", None) != WORKER_LOST_CODE
            or self.resumes >= MAX_STREAM_RESUMES
        ):
            return False
        log.warning("the server's worker died mid-answer (%s); sending the request again", error)
        self._lines.close()
        self._lines = self._resend()
        self.resumes += 1
        self._skip, self._replayed, self._error = self.text, "", error
        return True

    def _given(self, piece: str) -> str:
        """Record ``piece`` of the answer; return what of it is new to the reader (after a resend,
        the text already given is skipped).

        Raises:
            LlavaError: the resent answer differs from the text already given.
        """
        if self._skip is None:
            self._pieces.append(piece)
            return piece
        self._replayed += piece
        skip, replayed = self._skip, self._replayed
        if not (skip.startswith(replayed) or replayed.startswith(skip)):
            assert self._error is not None
            raise self._error  # an answer that differs cannot go on where the other stopped
        if len(replayed) <= len(skip):
            return ""
        self._skip = None
        rest = replayed[len(skip) :]
        self._pieces.append(rest)
        return rest


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
        self,
        lines: LineStream,
        *,
        on_answer: Callable[[Answer], None] | None,
        t0: float,
        session_id: str,
        resend: Callable[[], LineStream] | None = None,
    ) -> None:
        self._on_answer = on_answer
        self._t0 = t0
        self._ttft_ms: float | None = None
        self._tokens: list[Token] = []
        self.answer: Answer | None = None
        super().__init__(lines, session_id, resend)

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
            while True:
                try:
                    yield from self._read()
                    return
                except LlavaError as err:
                    if not self._resumed(err):
                        raise
                    self._tokens = []  # the resent answer's tokens are the answer's (the same ones)
        finally:
            self._closed = True
            self._lines.close()

    def _read(self) -> Generator[str, None, None]:
        """The answer's text pieces from ``self._lines``; sets :attr:`answer` at the last line.

        Raises:
            LlavaError: an error line (typed), a malformed line, or (:class:`APIConnectionError`) the
                stream ended before its last line.
        """
        for raw in self._lines:
            line = _json_line(raw)
            token = line.get("token")
            if token:  # every line of an answer has one; the last also has generated_text and details
                if self._ttft_ms is None:
                    self._ttft_ms = ms_since(self._t0)
                text = str(token.get("text") or "")
                self._tokens.append(Token(int(token.get("id", -1)), text, token.get("logprob")))
                if text and (new := self._given(text)):
                    yield new
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
        warnings: what the server did otherwise than asked, in its words (our ``warnings`` field of a
            chunk: a video with fewer frames than asked); empty when nothing.
        session_id: the session it answers in (``""``: none).
    """

    def __init__(self, lines: LineStream, *, session_id: str, resend: Callable[[], LineStream] | None = None) -> None:
        self.finish_reason: str | None = None
        self.usage: ChatUsage | None = None
        self.warnings: tuple[str, ...] = ()
        self.done = False
        super().__init__(lines, session_id, resend)

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
            while True:
                try:
                    yield from self._read()
                    break
                except LlavaError as err:
                    if not self._resumed(err):
                        raise
            self.done = True
            yield ChatStreamEvent("", self.finish_reason, self.usage)
        finally:
            self._closed = True
            self._lines.close()

    def _read(self) -> Generator[ChatStreamEvent, None, None]:
        """The answer's text deltas from ``self._lines``, up to its ``finish_reason``.

        Raises:
            LlavaError: an error event (typed), a malformed event, or (:class:`APIConnectionError`)
                the stream ended before its last chunk.
        """
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
            self.warnings += tuple(w for w in warnings_of(chunk) if w not in self.warnings)
            for choice in chunk.get("choices") or ():
                self.finish_reason = choice.get("finish_reason") or self.finish_reason
                piece = (choice.get("delta") or {}).get("content")
                if piece and (new := self._given(piece)):
                    yield ChatStreamEvent(new)
        if self.finish_reason is None:
            raise APIConnectionError("the stream ended before its last chunk")


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
