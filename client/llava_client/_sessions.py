"""A native image chat session: :class:`Session` (ask, stream, add_image, reset, close, recovery).

Recovery (``auto_recover=True``): when a call fails because the session is gone from the server
(:class:`SessionGone`: closed behind our back, expired, evicted, or lost with a restarted worker),
the client reopens a session on the same image (it keeps the image it was opened with) and hands
the server its remembered turns (``open_session`` with ``history``: the server remembers them as
its own and prefills them with the image), then retries the failed call once. The conversation is
restored exactly, sampled answers included, at the cost of one prefill; nothing is regenerated.
A WARNING is logged, :attr:`Session.recoveries` counts the recoveries and
:attr:`Session.last_recovery` (a :class:`Recovery`) says what happened.

A session is not thread-safe: use it from one thread at a time (the server answers a second
concurrent request on a session with 409 :class:`SessionBusy`).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeVar, Unpack

from . import _chat
from ._base_client import BaseClient
from ._chat import ChatReply
from ._exceptions import LlavaError, SessionGone
from ._images import Downsized, ImageInput, VideoInput, video_payload
from ._streaming import AnswerStream, ms_since
from ._transport import LineStream
from ._types import AddedImage, Answer, GenerationParams, Recovery, Sampling, warnings_of

__all__ = ["Opened", "Session", "open_session_request"]

log = logging.getLogger("llava_client")

T = TypeVar("T")


@dataclass(frozen=True)
class Opened:
    """What an open answered: the id, its expiry, the image's tokens, the server's timings (ms), and its
    ``warnings`` (what it did otherwise than asked)."""

    session_id: str
    expires_at: datetime | None
    image_tokens: int | None
    timings: dict[str, float]
    warnings: tuple[str, ...] = ()


@dataclass(frozen=True)
class _Turn:
    """A remembered turn and the images added before its question."""

    prompt: str
    answer: Answer
    images: tuple[
        dict[str, Any], ...
    ] = ()  # media added before this question (the first aside); a video as {"video": payload}


def medium_request(kind: str, medium: dict[str, Any]) -> dict[str, Any]:
    """The body's medium: ``{"image": payload}``, or ``{"video": ...}`` for a video (a medium the
    session keeps as ``{"video": payload}``; an image's payload never has that key)."""
    return {"video": medium["video"]} if "video" in medium else {kind: medium}


def open_session_request(
    client: BaseClient, payload: dict[str, Any], system_prompt: str | None, history: list[dict[str, Any]] | None = None
) -> Opened:
    """Open a session on the image ``payload``, or the video of ``{"video": payload}`` (with
    ``history`` restored: a recovery).

    Raises:
        LlavaError: the reply named no session id. APIStatusError, APIConnectionError: as any call.
    """
    request: dict[str, Any] = {"type": "open_session", **medium_request("image", payload)}
    if system_prompt is not None:
        request["system_prompt"] = system_prompt
    if history:
        request["history"] = history
    session_id, expires_at, data = client.invoke_open(request, "open_session")
    timings = dict(data.get("timings") or {})
    return Opened(session_id, expires_at, data.get("image_tokens"), timings, warnings_of(data))


def _generate_request(
    prompt: str, params: GenerationParams, *, stream: bool, remember: bool, context_policy: str | None
) -> dict[str, Any]:
    request: dict[str, Any] = {
        "type": "generate",
        "prompt": prompt,
        "parameters": params.to_wire(),
        "stream": stream,
        "remember": remember,
    }
    if context_policy is not None:
        request["context_policy"] = context_policy
    return request


class Session:
    """One open image chat session (made by :meth:`~llava_client.SessionClient.open_session`).

    Attributes:
        id: the current session id (changes when a recovery reopened the session).
        expires_at: the session's expiry (aware UTC datetime) or None if the server gave none.
        image_tokens: context positions the image occupies, as the server reported.
        open_timings: the server's timings of the open (milliseconds).
        open_warnings: what the open did otherwise than asked, in the server's words (a video with
            fewer frames than asked); empty when nothing.
        recoveries: how many times the session was reopened and its history replayed.
        last_recovery: what the last recovery did (:class:`Recovery`), or None.
        downsized: the session's inline images the client downsized to fit the request limit
            (:class:`~llava_client._images.Downsized`, each says what was done), in order.
    """

    def __init__(self, client: BaseClient, opened: Opened, image: dict[str, Any], system_prompt: str | None) -> None:
        self._client = client
        self._image = image
        self._system_prompt = system_prompt
        self._turns: list[_Turn] = []
        self._pending_images: list[dict[str, Any]] = []  # added since the last remembered turn
        self._closed = False
        self.recoveries = 0
        self.last_recovery: Recovery | None = None
        self.downsized: list[Downsized] = []
        self._set_opened(opened)

    def _set_opened(self, opened: Opened) -> None:
        self.id = opened.session_id
        self.expires_at = opened.expires_at
        self.image_tokens = opened.image_tokens
        self.open_timings = opened.timings
        self.open_warnings = opened.warnings

    def __repr__(self) -> str:
        state = "closed" if self._closed else _turns(len(self._turns))
        return f"Session({self.id!r}, {state})"

    def __enter__(self) -> Session:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.close()
            return
        try:
            self.close()
        except LlavaError as err:  # do not hide the error that ended the block
            log.warning("closing session %s failed: %s", self.id, err)

    @property
    def history(self) -> list[tuple[str, Answer]]:
        """The remembered turns, oldest first, as ``(prompt, answer)`` (a copy)."""
        return [(t.prompt, t.answer) for t in self._turns]

    @property
    def closed(self) -> bool:
        """True once :meth:`close` succeeded."""
        return self._closed

    # ------------------------------------------------------------------ turns
    def ask(
        self,
        prompt: str,
        *,
        remember: bool = True,
        context_policy: str | None = None,
        **sampling: Unpack[Sampling],
    ) -> Answer:
        """Ask a question about the image and wait for the whole answer.

        Args:
            prompt: the question.
            remember: True: the turn joins the history (later questions see it); False: answered
                with the current history as context and forgotten.
            context_policy: when the turn does not fit the model's context: ``"truncate"`` (the
                oldest remembered turns leave it, here and on the server; ``answer.truncated_turns``
                says how many) or ``"error"`` (:class:`ContextLengthExceeded`); None: the server's
                setting (``truncate`` by default).
            sampling: the sampling keywords (:class:`~llava_client._types.Sampling`: ``max_new_tokens``,
                ``temperature``, ``top_p``, ``top_k``, ``repetition_penalty``, ``do_sample``, ``seed``,
                ``stop``, ``details``, ``n``, ``session_choice``).

        Raises:
            InvalidRequest: a bad parameter or prompt. ContextLengthExceeded: it does not fit.
            SessionBusy: another request of this session is in flight. SessionGone: the session
            is gone and could not be recovered (or ``auto_recover`` is off). Overloaded,
            APIConnectionError, APITimeoutError, InternalServerError: after the allowed retries.
            LlavaError: the session is closed.
        """
        params = GenerationParams.of(sampling)
        request = _generate_request(prompt, params, stream=False, remember=remember, context_policy=context_policy)
        t0 = time.perf_counter()
        data, _ = self._with_recovery(lambda: self._client.invoke(request, self.id, retry_safe=not remember))
        total_ms = ms_since(t0)
        choices = tuple(
            Answer.from_wire(str(c.get("generated_text", "")), c.get("details"), client_total_ms=total_ms)
            for c in data.get("choices") or ()
        )
        answer = Answer.from_wire(
            str(data.get("generated_text", "")),
            data.get("details"),
            client_ttft_ms=total_ms,
            client_total_ms=total_ms,
            choices=choices,
        )
        self._record(prompt, answer, remember)
        return answer

    def stream(
        self,
        prompt: str,
        *,
        remember: bool = True,
        context_policy: str | None = None,
        **sampling: Unpack[Sampling],
    ) -> AnswerStream:
        """Ask a question and stream the answer's text pieces as they are generated.

        The request is sent now: errors before the first token (and recovery) happen here.
        Use the result as ``with session.stream(q) as s: for piece in s: ...``; then ``s.answer``.
        Arguments and errors as :meth:`ask` (one answer: ``n`` above 1 raises ValueError); an error
        reported mid-stream raises from the iteration.
        """
        if (sampling.get("n") or 1) > 1:
            raise ValueError("a stream carries one answer: ask(..., n=...) gives several")
        temperature = sampling.get("temperature")
        sampled = bool(sampling.get("do_sample")) or (temperature is not None and temperature > 0)
        if sampled and sampling.get("seed") is None:  # a stream sent again after a dead worker comes out the same
            sampling = {**sampling, "seed": random.getrandbits(31)}
        params = GenerationParams.of(sampling)
        request = _generate_request(prompt, params, stream=True, remember=remember, context_policy=context_policy)
        t0 = time.perf_counter()

        def send() -> LineStream:  # a session lost with a dead worker is recovered here (its history replayed)
            return self._with_recovery(lambda: self._client.invoke_stream(request, self.id, retry_safe=not remember))

        return AnswerStream(
            send(),
            on_answer=lambda answer: self._record(prompt, answer, remember),
            t0=t0,
            session_id=self.id,
            resend=send,
        )

    def _record(self, prompt: str, answer: Answer, remember: bool) -> None:
        """Keep the local history equal to the server's: drop the turns that left the context (their
        images stay: they open the first turn kept), then remember this one with the images added
        before it (the history a recovery restores is what the model saw)."""
        if answer.truncated_turns:
            moved = [image for turn in self._turns[: answer.truncated_turns] for image in turn.images]
            del self._turns[: answer.truncated_turns]
            if self._turns:
                first = self._turns[0]
                self._turns[0] = _Turn(first.prompt, first.answer, (*moved, *first.images))
            else:
                self._pending_images[:0] = moved
        if remember:
            self._turns.append(_Turn(prompt, answer, tuple(self._pending_images)))
            self._pending_images = []

    def chat(self, messages: list[dict[str, Any]], **params: Any) -> ChatReply:
        """Answer a whole OpenAI ``messages`` conversation in this session (the chat dialect): the
        session comes to hold that conversation (its images are kept where they match by content, its
        cache up to the first difference). :attr:`history` keeps only what :meth:`ask` recorded.

        Raises:
            SessionGone: the server lost the session (no recovery here: resend to a new session).
            APIStatusError, APIConnectionError: as for any call.
        """
        self._check_open()
        return _chat.complete(self._client, messages, self.id, **params)

    def add_video(self, video: VideoInput, *, num_frames: int | None = None, fps: float | None = None) -> AddedImage:
        """Add a video to the conversation (a model with a video path: LLaVA-OneVision, LLaVA-NeXT-Video): the next
        question may refer to it and to every earlier image and video. The server reuses the cached
        conversation and encodes only the video's sampled frames.

        Args:
            video: as for :meth:`~llava_client.SessionClient.open_session`'s ``video``.
            num_frames, fps: how its frames are sampled (one or neither: the server's default).

        Returns:
            What the server reported (:class:`AddedImage`: ``image_tokens`` are the video's).

        Raises:
            InvalidRequest: ``video_unsupported`` (the model has no video path), ``video_invalid``.
            PayloadTooLarge: ``video_too_large``, or an inline video over ``max_body_bytes``.
            ImageLimitExceeded, ContextLengthExceeded: as :meth:`add_image`; others as :meth:`ask`.
        """
        medium = {"video": video_payload(video, num_frames=num_frames, fps=fps)}
        return self._add({"type": "add_video", **medium_request("video", medium)}, medium, None)

    def add_image(self, image: ImageInput) -> AddedImage:
        """Add an image to the conversation: the next question may refer to it and to every earlier
        image. The server reuses the cached conversation and encodes only the new image.

        Args:
            image: as for :meth:`~llava_client.SessionClient.open_session` (path, bytes, PIL image, URL, ``s3://``).

        Returns:
            What the server reported (:class:`AddedImage`).

        Raises:
            ImageLimitExceeded: the session holds the server's maximum of images (or image tokens).
            ContextLengthExceeded: the conversation with this image leaves no room for a question.
            PayloadTooLarge, InvalidRequest: as for :meth:`~llava_client.SessionClient.open_session`; others as :meth:`ask`.
        """
        payload, downsized = self._client.inline_image(image)
        return self._add({"type": "add_image", "image": payload}, payload, downsized)

    def _add(self, request: dict[str, Any], medium: dict[str, Any], downsized: Downsized | None) -> AddedImage:
        """Send an ``add_image`` / ``add_video`` ``request``; the session remembers ``medium`` (for a
        recovery) and what was ``downsized``; returns what the server reported."""
        data, _ = self._with_recovery(lambda: self._client.invoke(request, self.id, retry_safe=False))
        self._pending_images.append(medium)
        if downsized is not None:
            self.downsized.append(downsized)
        return AddedImage(
            image_tokens=int(data.get("image_tokens", 0)),
            images=int(data.get("images", 0)),
            prefix_tokens=int(data.get("prefix_tokens", 0)),
            cached_tokens=int(data.get("cached_tokens", 0)),
            timings=dict(data.get("timings") or {}),
            downsized=downsized,
            warnings=warnings_of(data),
        )

    @property
    def num_images(self) -> int:
        """Images in the session: the first one and every one added."""
        return 1 + sum(len(t.images) for t in self._turns) + len(self._pending_images)

    def reset(self) -> None:
        """Forget the history; keep the images (and the cached prefix on the server): every image
        opens the next question.

        Raises:
            as :meth:`ask`. A session found gone is reopened (with an empty history) when
            ``auto_recover`` is on.
        """
        self._check_open()
        images = [image for turn in self._turns for image in turn.images] + self._pending_images
        try:
            self._client.invoke({"type": "reset"}, self.id, retry_safe=True)
        except SessionGone as err:
            if not self._client.auto_recover:
                raise
            self._turns, self._pending_images = [], images
            self._recover(err)
        self._turns, self._pending_images = [], images

    def close(self) -> None:
        """Close the session on the server. Idempotent; a session already gone counts as closed.

        Raises:
            APIConnectionError, APIStatusError: the close could not be delivered (call again to retry).
        """
        if self._closed:
            return
        try:
            self._client.invoke({"type": "close_session"}, self.id, retry_safe=True)
        except SessionGone:
            pass
        self._closed = True

    # ------------------------------------------------------------------ recovery
    def _check_open(self) -> None:
        if self._closed:
            raise LlavaError(f"session {self.id} is closed; open a new one")

    def _with_recovery(self, call: Callable[[], T]) -> T:
        self._check_open()
        try:
            return call()
        except SessionGone as err:
            if not self._client.auto_recover:
                raise
            self._recover(err)
        return call()

    def _recover(self, error: SessionGone) -> None:
        """Reopen on the same image with the remembered turns (see the module docstring).

        On failure the error is raised; this session keeps its old id and history (a later call
        tries again).
        """
        client = self._client
        old_id = self.id
        log.warning(
            "session %s is gone (%s); reopening on the same image with its %s",
            old_id,
            error.code,
            _turns(len(self._turns), "remembered "),
        )
        history: list[dict[str, Any]] = []
        for turn in self._turns:
            entry: dict[str, Any] = {"prompt": turn.prompt, "answer": turn.answer.text}
            images = [m for m in turn.images if "video" not in m]
            videos = [m["video"] for m in turn.images if "video" in m]
            if images:
                entry["images"] = images
            if videos:
                entry["videos"] = videos
            history.append(entry)
        opened = open_session_request(client, self._image, self._system_prompt, history=history)
        for medium in self._pending_images:  # images and videos added since the last turn, added again
            request = {"type": "add_video" if "video" in medium else "add_image", **medium_request("image", medium)}
            client.invoke(request, opened.session_id, retry_safe=False)
        self._set_opened(opened)
        self.recoveries += 1
        self.last_recovery = Recovery(
            reason=error.code or "session_gone",
            old_session_id=old_id,
            new_session_id=opened.session_id,
            replayed_turns=len(self._turns),
        )
        log.warning(
            "session %s restored as %s with its %s", old_id, opened.session_id, _turns(len(self._turns), "remembered ")
        )


def _turns(n: int, kind: str = "") -> str:
    """``1 turn``, ``2 turns`` (``kind``: a word before the noun, e.g. ``"remembered "``)."""
    return f"{n} {kind}turn{'' if n == 1 else 's'}"
