"""The service's chat-completions part: admit a ``messages`` request or an AWS session body, emit its frames.

A chat request names its session in the ``X-Amzn-SageMaker-Session-Id`` header as any other:

- an open session's id: the session comes to hold the resent conversation and answers its last user
  message (:meth:`SessionEngine.start_chat`);
- ``NEW_SESSION``: a session is opened for it (the reply carries the new-session headers);
- none (TorchServe minted an id, or there is no sequence batching): a one-shot request. It runs in a
  session of its own that is removed when it ends (its images and prefix may come from other
  sessions with ``share_images``); TorchServe's job group is ended with the last frame.

``{"requestType": "NEW_SESSION"}`` opens a session with no image (:meth:`SessionEngine.open_empty`).
Images are fetched once per session per URL (the session remembers which content a URL gave, and an
inline image's content by the hash of its base64 text), hashed, and decoded only when no session
holds them. Errors are OpenAI's error object.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from typing import TYPE_CHECKING

from .chat_codec import ChatCommand, ChatStream, encode_completion
from .contract import NEW_SESSION_ID_HEADER, NEW_SESSION_LITERAL, SESSION_ID_HEADER, session_header_value
from .conversation import ChatTarget, ImageInput, Turn, image_key
from .engine import Generation
from .errors import ServiceError
from .images import decode_image
from .jobs import Job, Row, RowResult
from .protocol import ImageSource
from .results import elapsed_ms

if TYPE_CHECKING:
    from .service import SessionService

__all__ = ["ChatJobs"]

#: The ``Accept`` value that asks a chat stream in JSON lines (LMI's form) rather than server-sent events.
JSON_LINES_ACCEPT = "application/jsonlines"


def _name_of(source: ImageSource) -> str:
    """What a session remembers an image source by: its URL or S3 URI (fetched once per session), or
    for inline data the SHA-256 of the base64 text (the same text is the same bytes: a resent image is
    neither base64-decoded nor hashed again)."""
    if source.base64 is not None:
        return "sha256:" + hashlib.sha256(source.base64.encode()).hexdigest()
    return source.url or source.s3_uri or ""


class ChatJobs:
    """Admission and emission of chat requests for a :class:`~.service.SessionService` (module docstring).

    Args:
        service: the service whose engine, codec, fetch, jobs and metrics are used.
    """

    def __init__(self, service: SessionService) -> None:
        self.service = service

    # ------------------------------------------------------------------ admission
    def open_session(self, row: Row) -> RowResult:
        """Answer ``{"requestType": "NEW_SESSION"}``: a session with no image, the new-session headers.

        Raises:
            ServiceError: invalid_request (an id already open or not valid), overloaded.
        """
        svc = self.service
        sid = svc.session_id_for_open(row)
        result = svc.engine.open_empty(sid)
        value = session_header_value(sid, result.expires_at)
        return RowResult(
            svc.codec.encode_new_session(sid, result.expires_at),
            headers={SESSION_ID_HEADER: value, NEW_SESSION_ID_HEADER: value},
        )

    def admit(self, row: Row, command: ChatCommand, now: float) -> Job:
        """Admit a chat request: resolve its images, then start its answer in its session.

        Raises:
            ServiceError: in OpenAI's dialect: the session's (gone, busy), the images' (fetch,
                decode, limits), the conversation's (context, placeholder), overloaded.
        """
        try:
            return self._admit(row, command, now)
        except ServiceError as err:
            err.dialect = "openai"
            raise

    def _admit(self, row: Row, command: ChatCommand, now: float) -> Job:
        svc, engine = self.service, self.service.engine
        sid = row.session_id
        opens = sid == NEW_SESSION_LITERAL
        one_shot = row.minted or not sid
        svc.check_generation_slot()
        if not (opens or one_shot):
            assert sid is not None
            engine.check_idle(sid)  # a gone or busy session is the more precise answer, before any fetch
        own_sid = None if (opens or one_shot) else sid
        t0 = time.perf_counter()
        target, urls = self._target(own_sid, command)
        intake = elapsed_ms(t0)
        if own_sid is None:
            own_sid = sid if row.minted and sid else f"llava-{uuid.uuid4()}"
            engine.open_empty(own_sid)
        try:
            gen = engine.start_chat(own_sid, target, command.params, clip_max_new_tokens=command.clip_max_new_tokens)
        except ServiceError:
            if own_sid != sid or one_shot:
                svc.close_quietly(own_sid)
            raise
        engine.remember_urls(own_sid, urls)
        job = Job(row.request_id, own_sid, command, now, work=gen, own_group=not opens and bool(sid), t0=t0)
        job.one_shot, job.urls, job.intake_timings = one_shot, urls, {"intake": intake}
        job.opened = opens
        if command.stream:
            sse = JSON_LINES_ACCEPT not in (row.accept or "").lower()
            job.stream = ChatStream(command, sse=sse, token_text=svc.token_text)
        return job

    def _target(self, sid: str | None, command: ChatCommand) -> tuple[ChatTarget, dict[str, str]]:
        """The conversation as the engine takes it: every image as content key, bytes and size (fetched
        unless the session fetched its URL before; decoded unless a session holds it)."""
        svc, engine, settings = self.service, self.service.engine, self.service.settings
        inputs: list[ImageInput] = []
        urls: dict[str, str] = {}
        for source in command.images:
            name = _name_of(source)
            key = engine.url_key(sid, name)
            held = engine.image_held(sid, key) if key else None
            if held is not None and key is not None:
                inputs.append(ImageInput(key, held[0], held[1]))
                continue
            data = svc.fetch(source, settings)
            key = image_key(data)
            urls[name] = key
            held = engine.image_held(sid, key)
            if held is not None:
                inputs.append(ImageInput(key, data, held[1]))
                continue
            image = decode_image(data, max_pixels=settings.max_image_pixels)
            inputs.append(ImageInput(key, data, (int(image.height), int(image.width)), image))
        conv = command.conversation
        turns = tuple(Turn(t.prompt, t.answer, len(t.image_urls)) for t in conv.turns)
        system = conv.system_prompt if conv.system_prompt is not None else settings.system_prompt
        return ChatTarget(system, turns, conv.question, len(conv.question_images), tuple(inputs)), urls

    # ------------------------------------------------------------------ output
    def emit(self, job: Job) -> RowResult:
        """The row's output for this call: nothing until a whole answer is ready (or the stream's
        next chunk), then the answer; a stream's last events go out one per call."""
        gen = job.work
        assert isinstance(gen, Generation) and isinstance(job.command, ChatCommand)
        if job.error is not None:
            job.error.dialect = "openai"  # found in a step (the vision tower, a forward pass): same dialect
        if job.frames:
            return self._frame(job, job.frames.pop(0), last=not job.frames)
        finished = gen.done or job.error is not None
        svc = self.service
        if job.stream is None:
            if not finished:
                return RowResult(b"", headers=self._headers(job, last=False), stop=False)
            svc.forget(job)
            if job.error is not None:
                return svc.error_result(job.session_id if job.own_group else None, job.error, chunk=job.calls > 1)
            assert gen.answer is not None
            svc.metrics.observe_answer(gen.answer)
            body = encode_completion(job.command, gen.answer, svc.token_text)
            return RowResult(body, headers=self._headers(job, last=True), stop=True if job.calls > 1 else None)
        new = gen.events[job.emitted :]
        job.emitted = len(gen.events)
        if not finished:
            return self._frame(job, job.stream.tokens(new, gen.detokenizer.text), last=False)
        if job.error is None:
            assert gen.answer is not None
            svc.metrics.observe_answer(gen.answer)
            job.frames = job.stream.end(gen.answer, new)
        elif not job.sent:
            svc.forget(job)
            return svc.error_result(job.session_id if job.own_group else None, job.error, chunk=job.calls > 1)
        else:
            svc.metrics.count_error(job.error)
            job.frames = job.stream.error(job.error)
        if job.one_shot:  # its session is done with: freed now, not when the last event has gone out
            svc.close_quietly(job.session_id)
        return self._frame(job, job.frames.pop(0), last=not job.frames)

    def _frame(self, job: Job, body: bytes, *, last: bool) -> RowResult:
        """One stream frame. A stream that ends in its first frame is one whole response (TorchServe
        sends no response head for a first frame that is also the last chunk)."""
        if last:
            self.service.forget(job)
        stop: bool | None = (True if job.sent else None) if last else False
        headers = self._headers(job, last=last)
        job.sent = True
        assert job.stream is not None
        return RowResult(body, headers=headers, content_type=job.stream.content_type, stop=stop)

    def _headers(self, job: Job, *, last: bool) -> dict[str, str]:
        """A session's id (with its ``Expires`` on a new one); a one-shot request's last frame ends
        the TorchServe job group TorchServe minted for it (headers after the first frame reach
        TorchServe, not the client)."""
        if job.one_shot:
            return {self.service.end_header: job.session_id} if last and job.own_group else {}
        if job.opened:
            session = self.service.engine.store.peek(job.session_id)
            if session is not None:
                value = session_header_value(job.session_id, session.expires_at)
                return {SESSION_ID_HEADER: value, NEW_SESSION_ID_HEADER: value}
        return {SESSION_ID_HEADER: job.session_id}
