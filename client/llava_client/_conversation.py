"""A chat conversation the client keeps and resends each turn, each image's bytes sent once.

The ecosystem's clients hold the conversation and resend all of it every turn (OpenAI chat
completions); the server serves the part it saw before from its cache: a session's, or, without a
session, its conversation cache (docs/api.md, "Stateless conversations"). What this adds to that:
every image carries a ``uuid`` (vLLM's per-part field; here the SHA-256 of its payload, so the same
image is the same uuid), its bytes go in the first request that has it, and later requests name it
by ``{"type": "image_url", "image_url": null, "uuid": ...}`` alone: a follow-up to a one-image chat
sends its new turn and a few hundred bytes, not the image again. A reference the server no longer
holds (evicted, or another instance answered) gets ``image_uuid_not_found``; the turn is then sent
once more with every image's bytes. ::

    from llava_client import SessionClient

    client = SessionClient.from_url("http://127.0.0.1:8080")
    chat = client.conversation(cache_salt="tenant-42")        # no session: the server's cache serves it
    print(chat.ask("What is this?", images=["photo.jpg"]).text)
    print(chat.ask("And the colours?").text)                   # the photo goes as its uuid alone
    with client.chat_session() as session:                     # the same inside a session
        chat = client.conversation(session=session)

``cache_salt`` (vLLM's field): the server shares cached state only between requests of an equal salt;
give each tenant its own (docs/api.md).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from . import _chat
from ._exceptions import APIStatusError

if TYPE_CHECKING:
    from ._base_client import BaseClient
    from ._chat import ChatReply, ChatSession
    from ._images import ImageInput, VideoInput
    from ._streaming import ChatUsage

__all__ = ["Conversation"]

#: The error code of a reference to an image the server does not hold.
UUID_MISS = "image_uuid_not_found"


class Conversation:
    """A conversation resent whole each turn, its images by reference once sent (module docstring).

    Args:
        client: the client (its transport, retries and image limits).
        session: a :class:`~llava_client.ChatSession` to send every turn in, or None (no session).
        system_prompt: an optional system message, first in the conversation.
        cache_salt: the salt sent with every request (None: none).
        references: send an image's bytes once, then its uuid alone (False: its bytes every turn,
            for SageMaker's ``PREFIX_AWARE`` routing over several instances, which keys on the body's
            first bytes: a reference changes them, resent bytes keep them).

    Attributes:
        messages: the conversation as OpenAI messages, images with their bytes (what a reader sees).
    """

    def __init__(
        self,
        client: BaseClient,
        *,
        session: ChatSession | None = None,
        system_prompt: str | None = None,
        cache_salt: str | None = None,
        references: bool = True,
    ) -> None:
        self._client = client
        self.references = references
        self.session = session
        self.cache_salt = cache_salt
        self.messages: list[dict[str, Any]] = []
        if system_prompt is not None:
            self.messages.append({"role": "system", "content": system_prompt})
        self._sent: set[str] = set()  # uuids the server received in an answered request
        self._last_body: dict[str, Any] | None = None
        #: The last streamed answer's usage (:class:`~llava_client.ChatUsage`: prompt, completion and
        #: cached tokens), or None before one (or when the server sent none).
        self.last_usage: ChatUsage | None = None
        #: What the server did otherwise than asked for the last answer (a video with fewer frames than
        #: asked), in its words; empty when nothing.
        self.last_warnings: tuple[str, ...] = ()

    def __repr__(self) -> str:
        where = f"session {self.session.session_id!r}" if self.session is not None else "no session"
        return f"Conversation({len(self.messages)} messages, {where})"

    def add_user(
        self, text: str, images: Sequence[ImageInput] = (), videos: Sequence[VideoInput | dict[str, Any]] = ()
    ) -> None:
        """Append a user message: ``images`` (paths, bytes, PIL images, URLs; :func:`~llava_client.image_part`),
        then ``videos`` (paths, bytes, URLs, sampled by the server's frame count; or a part of
        :func:`~llava_client.video_part` that names ``num_frames`` or ``fps``), then ``text``."""
        parts: list[dict[str, Any]] = []
        made = [v if isinstance(v, dict) else _chat.video_part(v) for v in videos]
        for part in [*map(_chat.image_part, images), *made]:
            kind = part["type"]
            url = part[kind]["url"]
            parts.append({**part, "uuid": hashlib.sha256(url.encode()).hexdigest()[:32]})
        self.messages.append({"role": "user", "content": [*parts, {"type": "text", "text": text}]})

    def ask(
        self,
        text: str,
        images: Sequence[ImageInput] = (),
        *,
        videos: Sequence[VideoInput | dict[str, Any]] = (),
        **params: Any,
    ) -> ChatReply:
        """Ask ``text`` (after ``images`` and ``videos``, if any) and return the reply; both join the
        conversation. ``params``: OpenAI's (``max_tokens``, ``temperature``, ...).

        Raises:
            APIStatusError, APIConnectionError: as any call (the question is then not kept).
        """
        self.add_user(text, images, videos)
        session = self.session
        try:
            reply = self._send(
                session.complete_body if session else lambda body: _chat.complete_body(self._client, body, ""), params
            )
        except BaseException:
            self.messages.pop()
            raise
        self.messages.append(reply.message)
        return reply

    def ask_stream(
        self,
        text: str,
        images: Sequence[ImageInput] = (),
        *,
        videos: Sequence[VideoInput | dict[str, Any]] = (),
        **params: Any,
    ) -> Iterator[str]:
        """As :meth:`ask`, the answer's text pieces as they come; the answer joins the conversation
        once the stream ends (a stream broken off leaves the question out)."""
        self.add_user(text, images, videos)
        pieces: list[str] = []
        try:
            try:
                for piece in self._stream(self._body(params, stream=True, references=True)):
                    pieces.append(piece)
                    yield piece
            except APIStatusError as err:
                if err.code != UUID_MISS or pieces:
                    raise
                self._sent.clear()  # the server lost an image: send them all again, once
                for piece in self._stream(self._body(params, stream=True, references=False)):
                    pieces.append(piece)
                    yield piece
        except BaseException:
            self.messages.pop()
            raise
        self._mark_sent()
        self.messages.append({"role": "assistant", "content": "".join(pieces)})

    def _send(self, call: Any, params: dict[str, Any]) -> ChatReply:
        """Send with references; on ``image_uuid_not_found``, once more with every image's bytes."""
        try:
            reply = call(self._body(params, stream=False, references=True))
        except APIStatusError as err:
            if err.code != UUID_MISS:
                raise
            self._sent.clear()
            reply = call(self._body(params, stream=False, references=False))
        self._mark_sent()
        return reply

    def _stream(self, body: dict[str, Any]) -> Iterator[str]:
        """The answer's text pieces (in the session, which reopens once if the server lost it). A dead
        worker's cut answer is sent again with every image's bytes (the restarted worker knows no uuid),
        the same seed, and goes on where it stopped."""
        session, client = self.session, self._client
        whole = {**body, "messages": self.messages} if self.references else body
        resend = None if session else (lambda: client.invoke_stream(whole, "", retry_safe=True))
        with session.stream_body(body, whole) if session else _chat.stream_body(client, body, "", resend) as stream:
            for event in stream:
                if event.text:
                    yield event.text
            self.last_usage, self.last_warnings = stream.usage, stream.warnings

    def _body(self, params: dict[str, Any], *, stream: bool, references: bool) -> dict[str, Any]:
        """The request: the conversation with each image already sent as its uuid alone (``references``)."""
        messages = [self._wire(m) if references and self.references else m for m in self.messages]
        body = _chat.chat_request(messages, stream, params)
        if self.cache_salt is not None:
            body["cache_salt"] = self.cache_salt
        self._last_body = body
        return body

    @property
    def last_request_bytes(self) -> int:
        """The size of the last request's body as compact JSON, bytes (0 before any); measured when asked."""
        if self._last_body is None:
            return 0
        return len(json.dumps(self._last_body, separators=(",", ":")).encode())

    def _wire(self, message: dict[str, Any]) -> dict[str, Any]:
        content = message.get("content")
        if not isinstance(content, list):
            return message
        parts = [
            {"type": p["type"], p["type"]: None, "uuid": p["uuid"]} if p.get("uuid") in self._sent else p
            for p in content
        ]
        return {**message, "content": parts}

    def _mark_sent(self) -> None:
        """Every image of the conversation has reached the server (in the request just answered)."""
        for message in self.messages:
            content = message.get("content")
            for part in content if isinstance(content, list) else ():
                if part.get("uuid"):
                    self._sent.add(part["uuid"])
