"""OpenAI chat completions through llava-sessions: send a whole ``messages`` conversation, read the reply.

The server's chat dialect (docs/api.md, "Chat completions"): the client resends the whole
conversation every turn, as with any OpenAI-compatible server; in a session, the server answers from
its cache of that conversation (the images are not re-encoded, the history not re-prefilled). ::

    from llava_client import SessionClient, image_part

    client = SessionClient.from_url("http://127.0.0.1:8080")
    messages = [{"role": "user", "content": [image_part("photo.jpg"), {"type": "text", "text": "What is this?"}]}]
    with client.chat_session() as chat:                 # {"requestType": "NEW_SESSION"} ... CLOSE
        reply = chat.complete(messages, max_tokens=64)
        messages += [reply.message, {"role": "user", "content": "And the colours?"}]
        with chat.stream(messages) as stream:           # a ChatStream: text deltas, then the end
            for event in stream:
                print(event.text, end="")
        print(stream.finish_reason, stream.usage)

``client.complete(messages)`` and ``client.stream_chat(messages)`` are sessionless requests (no session).
Replies are the server's OpenAI ``chat.completion`` objects (:attr:`ChatReply.raw`). A chat session
the server lost (a worker restart, its TTL, an eviction) is opened again and the conversation resent
to it, once, with a WARNING log line: the conversation is all the server needs.
"""

from __future__ import annotations

import base64
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from ._base_client import BaseClient
from ._exceptions import LlavaError, SessionGone
from ._images import ImageInput, VideoInput, fit_payload, image_budget, image_payload, video_payload
from ._streaming import ChatStream
from ._transport import LineStream
from ._types import warnings_of

__all__ = ["ChatReply", "ChatSession", "image_part", "video_part"]

log = logging.getLogger("llava_client")

_T = TypeVar("_T")


def image_part(image: ImageInput, *, max_bytes: int | None = None) -> dict[str, Any]:
    """An OpenAI ``image_url`` content part for ``image``: a local path, bytes or a PIL image go
    inline as a ``data:`` URI, downsized (:func:`~llava_client._images.fit_payload`, logged) when
    over ``max_bytes`` of base64 (default :func:`~llava_client._images.image_budget`: SageMaker's
    6 MiB request limit less room for the rest, what the client's own requests allow);
    an ``http(s)://`` URL or ``s3://`` URI is passed for the server to fetch.

    Raises:
        FileNotFoundError: a local path that does not exist.
    """
    payload, downsized = fit_payload(image_payload(image), image_budget() if max_bytes is None else max_bytes)
    if downsized is not None:
        log.info("%s", downsized)
    if "base64" in payload:
        data = payload["base64"]
        if not data.startswith("data:"):
            kind = _sniff(base64.b64decode(data[:64] + "=" * (-len(data[:64]) % 4)))
            data = f"data:image/{kind};base64,{data}"
        return {"type": "image_url", "image_url": {"url": data}}
    return {"type": "image_url", "image_url": {"url": payload.get("url") or payload["s3_uri"]}}


def video_part(video: VideoInput, *, num_frames: int | None = None, fps: float | None = None) -> dict[str, Any]:
    """A ``video_url`` content part for ``video`` (vLLM's shape; ``num_frames`` or ``fps`` on the part,
    as SGLang takes them): a local file or bytes inline as a ``data:video/...;base64,`` URI, an
    ``http(s)://`` URL or ``s3://`` URI for the server to fetch.

    Raises:
        FileNotFoundError: a local path that does not exist. ValueError: both ``num_frames`` and ``fps``.
    """
    payload = video_payload(video, num_frames=num_frames, fps=fps)
    url = payload.pop("base64", None) or payload.pop("url", None) or payload.pop("s3_uri")
    return {"type": "video_url", "video_url": {"url": url}, **payload}


def _sniff(head: bytes) -> str:
    if head.startswith(b"\x89PNG"):
        return "png"
    if head[:3] == b"GIF":
        return "gif"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "webp"
    return "jpeg"


@dataclass(frozen=True)
class ChatReply:
    """A ``chat.completion`` reply.

    Attributes:
        text: the assistant's answer; finish_reason: ``stop`` or ``length``.
        prompt_tokens / completion_tokens: token counts; cached_tokens: prompt tokens the server
            served from its cache (the session's, or one shared by content).
        raw: the whole ``chat.completion`` object as the server sent it.
    """

    text: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    raw: dict[str, Any]

    @property
    def warnings(self) -> tuple[str, ...]:
        """What the server did otherwise than asked, in its words (a video with fewer frames than asked)."""
        return warnings_of(self.raw)

    @property
    def message(self) -> dict[str, str]:
        """The answer as the assistant message to append to the conversation."""
        return {"role": "assistant", "content": self.text}

    @classmethod
    def from_completion(cls, data: dict[str, Any]) -> ChatReply:
        """Read a ``chat.completion`` object.

        Raises:
            LlavaError: it is not one.
        """
        try:
            choice = data["choices"][0]
            usage = data.get("usage") or {}
            details = usage.get("prompt_tokens_details") or {}
            return cls(
                text=choice["message"]["content"] or "",
                finish_reason=choice.get("finish_reason"),
                prompt_tokens=int(usage.get("prompt_tokens", 0)),
                completion_tokens=int(usage.get("completion_tokens", 0)),
                cached_tokens=int(details.get("cached_tokens", 0)),
                raw=data,
            )
        except (KeyError, IndexError, TypeError, ValueError):
            raise LlavaError("the server's reply is not a chat.completion object") from None


def chat_request(messages: list[dict[str, Any]], stream: bool, params: dict[str, Any]) -> dict[str, Any]:
    """The request body: ``messages``, ``stream`` and the OpenAI parameters given (``max_tokens``,
    ``temperature``, ``top_p``, ``stop``, ``seed``, ...); a stream asks for its usage at the end
    (``stream_options.include_usage``) unless ``params`` say otherwise, and a sampled stream
    (``temperature`` unset is OpenAI's 1.0) gets a ``seed`` of its own when it has none, so a stream
    sent again after a dead worker comes out the same (:func:`stream_body`)."""
    body: dict[str, Any] = {"messages": messages, **params}
    if stream:
        body["stream"] = True
        body.setdefault("stream_options", {"include_usage": True})
        if body.get("temperature", 1.0) != 0 and body.get("seed") is None:
            body["seed"] = random.getrandbits(31)
    return body


def complete(client: BaseClient, messages: list[dict[str, Any]], session_id: str, **params: Any) -> ChatReply:
    """Send the conversation (in session ``session_id``, or ``""`` for none) and return the reply."""
    return complete_body(client, chat_request(messages, False, params), session_id)


def complete_body(client: BaseClient, body: dict[str, Any], session_id: str) -> ChatReply:
    """Send a chat-completions request body (a resent conversation: safe to retry) and return the reply."""
    data, _ = client.invoke(body, session_id, retry_safe=True)
    return ChatReply.from_completion(data)


def stream(client: BaseClient, messages: list[dict[str, Any]], session_id: str, **params: Any) -> ChatStream:
    """Send the conversation; return its :class:`ChatStream` (the request is sent now).

    Raises:
        APIStatusError: the request was refused (iterating raises one the stream reports).
    """
    return stream_body(client, chat_request(messages, True, params), session_id)


def stream_body(
    client: BaseClient, body: dict[str, Any], session_id: str, resend: Callable[[], LineStream] | None = None
) -> ChatStream:
    """Send a streamed chat-completions request body now; return its :class:`ChatStream`, which a
    dead worker's ``model_not_ready`` mid-answer sends again (``resend``, default: ``body`` in
    ``session_id`` once more) and continues where it stopped.

    Raises:
        APIStatusError: the request was refused.
    """
    again = resend or (lambda: client.invoke_stream(body, session_id, retry_safe=True))
    return ChatStream(client.invoke_stream(body, session_id, retry_safe=True), session_id=session_id, resend=again)


class ChatSession:
    """A server session used through the chat dialect: every call sends the whole conversation.

    Opened by :meth:`SessionClient.chat_session` (``{"requestType": "NEW_SESSION"}``); ``close()``
    (or leaving the ``with`` block) sends ``{"requestType": "CLOSE"}``.

    Attributes:
        session_id: the server's session id.
    """

    def __init__(self, client: BaseClient, session_id: str) -> None:
        self._client = client
        self.session_id = session_id
        self.closed = False

    def __enter__(self) -> ChatSession:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ChatSession({self.session_id!r})"

    def complete(self, messages: list[dict[str, Any]], **params: Any) -> ChatReply:
        """Answer the conversation's last user message (``params``: OpenAI's, e.g. ``max_tokens``).
        A session the server lost is opened again and the conversation resent, once (logged).

        Raises:
            SessionGone: the session was lost twice in a row. APIStatusError, APIConnectionError: as any call.
        """
        return self.complete_body(chat_request(messages, False, params))

    def stream(self, messages: list[dict[str, Any]], **params: Any) -> ChatStream:
        """As :meth:`complete`, a :class:`ChatStream` of the answer (sent now)."""
        return self.stream_body(chat_request(messages, True, params))

    def complete_body(self, body: dict[str, Any]) -> ChatReply:
        """As :meth:`complete`, for a whole request body."""
        return self._reopening(lambda session_id: complete_body(self._client, body, session_id))

    def stream_body(self, body: dict[str, Any], resend_body: dict[str, Any] | None = None) -> ChatStream:
        """As :meth:`stream`, for a whole request body (``resend_body``: what to send if a dead worker
        cut the answer, default ``body``; the session, lost with the worker, is reopened for it)."""
        client = self._client

        def resend() -> LineStream:
            again = resend_body or body
            return self._reopening(lambda session_id: client.invoke_stream(again, session_id, retry_safe=True))

        return self._reopening(lambda session_id: stream_body(client, body, session_id, resend))

    def _reopening(self, send: Callable[[str], _T]) -> _T:
        """``send(session_id)``; if the server lost the session, once more in a new one (logged).

        Raises:
            SessionGone: the new session was lost too.
        """
        try:
            return send(self.session_id)
        except SessionGone as gone:
            old = self.session_id
            self.session_id, _, _ = self._client.invoke_open({"requestType": "NEW_SESSION"}, "NEW_SESSION")
            log.warning(
                "chat session %s is gone on the server (%s); reopened as %s, resending the conversation",
                old,
                gone.code or gone.status_code,
                self.session_id,
            )
        return send(self.session_id)

    def close(self) -> None:
        """Close the session on the server (``{"requestType": "CLOSE"}``); a session already gone is fine."""
        if self.closed:
            return
        self.closed = True
        try:
            self._client.invoke({"requestType": "CLOSE"}, self.session_id, retry_safe=True)
        except SessionGone:
            pass
