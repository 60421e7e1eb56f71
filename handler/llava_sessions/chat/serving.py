"""The chat dialect's serving: a ``messages`` request or an AWS session body → the engine → OpenAI's frames.

A chat request names its session in the ``X-Amzn-SageMaker-Session-Id`` header as any other:

- an open session's id: the session comes to hold the resent conversation and answers its last user
  message (:meth:`SessionEngine.start_chat`);
- ``NEW_SESSION``: a session is opened for it (the reply carries the new-session headers);
- none (TorchServe minted an id, or there is no sequence batching): a stateless request. It runs in a
  session of its own (its images and prefix may come from sessions and conversation-cache entries of
  its ``cache_salt``), kept when it answered as a conversation-cache entry (``SessionEngine.retain``),
  so the same conversation resent with its next turn prefills only that turn; TorchServe's job group
  is ended with the last frame.

``{"requestType": "NEW_SESSION"}`` opens a session with no image (:meth:`SessionEngine.open_empty`),
``{"requestType": "CLOSE"}`` closes the header's. Images are fetched once per session per URL (the
session remembers which content a URL gave, and an inline image's content by the hash of its base64
text), hashed, and decoded only when no session of the salt holds them; an image part may name an
earlier image by its ``uuid`` alone. Every error is OpenAI's error object.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Callable
from typing import Any

from ..config import Settings
from ..conversation import (
    ChatTarget,
    ImageInput,
    Turn,
    VideoBytes,
    image_key,
    is_video_size,
    media_size,
    video_sampling,
)
from ..engine import Sequence, SessionEngine
from ..errors import ErrorCode, ServiceError
from ..images.decode import decode_image
from ..metrics import WorkerMetrics
from ..results import Answer
from ..video import SampledVideo
from ..wire.contract import NEW_SESSION_LITERAL, SESSION_ID_HEADER, opened_headers
from ..wire.fetches import decode_video_bytes, fetch_video
from ..wire.framing import JSON, BatchRequest, Reply
from ..wire.in_flight import RequestState, RequestTable, Serving
from ..wire.inbound import ImageSource, VideoSource, request_salt
from . import responses
from .command import ChatCommand, chat_command
from .protocol import parse_chat_body, parse_session_body

__all__ = ["JSON_LINES_ACCEPT", "ChatServing"]

#: The ``Accept`` value that asks a chat stream in JSON lines (LMI's form) rather than server-sent events.
JSON_LINES_ACCEPT = "application/jsonlines"


def _name_of(source: ImageSource) -> str:
    """What a session remembers an image source by: its URL or S3 URI (fetched once per session), or
    for inline data the SHA-256 of the base64 text (the same text is the same bytes: a resent image is
    neither base64-decoded nor hashed again). A video's name adds its sampling (one clip sampled two
    ways is two media)."""
    if source.base64 is not None:
        name = "sha256:" + hashlib.sha256(source.base64.encode()).hexdigest()
    else:
        name = source.url or source.s3_uri or ""
    if isinstance(source, VideoSource):
        name += "#" + video_sampling(source.num_frames, source.fps)
    return name


class ChatServing(Serving):
    """Admission and emission of chat requests (module docstring).

    Args:
        settings, engine, requests, fetch, metrics: as :class:`Serving`.
        model_names: the names the model answers to (``served_model_name``): a request on OpenAI's
            route naming another gets ``404 model_not_found``; a reply carries the name its request
            gave when it is one of them, else the first.
        token_text: token id → its text (``logprobs``).
    """

    def __init__(
        self,
        settings: Settings,
        engine: SessionEngine,
        requests: RequestTable,
        fetch: Callable[..., bytes],
        metrics: WorkerMetrics,
        *,
        model_names: tuple[str, ...],
        token_text: Callable[[int], str],
    ) -> None:
        super().__init__(settings, engine, requests, fetch, metrics)
        self.model_names = model_names
        self.token_text = token_text

    encode_error = staticmethod(responses.encode_error)
    error_status = staticmethod(responses.error_status)

    # ------------------------------------------------------------------ admission
    def admit(self, request: BatchRequest, data: Any, now: float) -> Reply | RequestState:
        """Admit a decoded chat body: AWS's session bodies are answered at once; a ``messages``
        request resolves its images, then starts its answer in its session.

        Raises:
            ServiceError: the body's (400), the session's (missing id, gone, busy), the images'
                (fetch, decode, limits), the conversation's (context, placeholder), overloaded.
        """
        if "messages" not in data:
            if parse_session_body(data).requestType == NEW_SESSION_LITERAL:
                return self._open_session(request)
            sid = self.requests.session_of(request, "close_session")
            self.requests.stop_session(sid)
            self.engine.close(sid)
            return Reply(responses.encode_closed(sid), headers=self.framing.closed(sid))
        command = self._command(request, data)
        salt = request_salt(command.salt, request.custom_attributes)
        return self._admit_chat(request, dataclasses.replace(command, salt=salt), now)

    def pending_frame(self, request: BatchRequest, data: Any) -> Reply:
        """The first frame of a ``messages`` request waiting for its images: the headers its answer
        will have (none without a session; the new session's on an open) and, for a stream, the
        stream's content type."""
        command = self._command(request, data)
        sid = request.session_id
        headers: dict[str, str] = {}
        if sid == NEW_SESSION_LITERAL:  # opens its session: the id it will get, expiring a TTL from now
            headers = opened_headers(
                self.requests.fresh_id(request.request_id), int(time.time()) + self.settings.session_ttl_s
            )
        elif sid and not request.minted:
            headers = {SESSION_ID_HEADER: sid}
        content_type = self._stream_of(request, command).content_type if command.stream else JSON
        return self.framing.frame(b"", continued=False, last=False, headers=headers, content_type=content_type)

    def late_error(self, request: BatchRequest, data: Any, err: ServiceError) -> Reply:
        """A ``messages`` request refused after its first frame went out: a stream's error events, or
        the error object as the reply's body; a sessionless request's TorchServe job group ends."""
        sid = request.session_id
        sessionless = request.minted or not sid
        group = sid if sid and sid != NEW_SESSION_LITERAL else None
        command = self._command(request, data)
        if not command.stream:
            return self.requests.error(self, group, err, held=not sessionless, continued=True)
        self.metrics.count_error(err)
        body = b"".join(self._stream_of(request, command).error(err))
        headers = self.framing.end_sequence(group) if group and sessionless else {}
        return self.framing.frame(body, continued=True, last=True, headers=headers)

    def _command(self, request: BatchRequest, data: Any) -> ChatCommand:
        """The ``messages`` body as the dialect's command.

        Raises:
            ServiceError: the body's (400); ``model_not_found`` (404) for a request on OpenAI's route
                naming a model this server does not serve (vLLM's rule; ``/invocations`` takes any
                name, as SageMaker clients send what they like).
        """
        s, names = self.settings, self.model_names
        parsed = parse_chat_body(data, max_prompt_chars=s.max_prompt_chars)
        if request.openai_route and parsed.model is not None and parsed.model not in names:
            served = ", ".join(f"`{n}`" for n in names)
            raise ServiceError(
                ErrorCode.MODEL_NOT_FOUND,
                f"The model `{parsed.model}` does not exist here; this server serves {served} (GET /v1/models)",
                param="model",
            )
        return chat_command(parsed, s, parsed.model if parsed.model in names else names[0])

    def _stream_of(self, request: BatchRequest, command: ChatCommand) -> responses.ChatStream:
        """The stream of a streamed answer: server-sent events unless ``Accept`` asks for JSON lines."""
        sse = JSON_LINES_ACCEPT not in (request.accept or "").lower()
        return responses.ChatStream(command, sse=sse, token_text=self.token_text)

    def _open_session(self, request: BatchRequest) -> Reply:
        """Answer ``{"requestType": "NEW_SESSION"}``: a session with no image, the new-session headers.

        Raises:
            ServiceError: invalid_request (an id already open or not valid), overloaded.
        """
        sid = self.requests.new_session_id(request)
        result = self.engine.open_empty(sid)
        return Reply(
            responses.encode_new_session(sid, result.expires_at),
            headers=opened_headers(sid, result.expires_at),
        )

    def _admit_chat(self, request: BatchRequest, command: ChatCommand, now: float) -> RequestState:
        engine = self.engine
        sid = request.session_id
        opens = sid == NEW_SESSION_LITERAL
        sessionless = request.minted or not sid
        self.requests.check_generation_slot(command.params.n)
        if not (opens or sessionless):
            assert sid is not None
            engine.check_idle(sid)  # a gone or busy session is the more precise answer, before any fetch
        own_sid = None if (opens or sessionless) else sid
        t0 = time.perf_counter()
        target, urls, uuids = self._target(own_sid, command)
        if own_sid is None:
            own_sid = sid if request.minted and sid else self.requests.fresh_id(request.request_id)
            engine.open_empty(own_sid, salt=command.salt)
        try:
            seq = engine.start_chat(
                own_sid, target, command.params, clip_max_new_tokens=command.clip_max_new_tokens, salt=command.salt
            )
        except ServiceError:
            if own_sid != sid or sessionless:
                self.requests.close_quietly(own_sid)
            raise
        engine.remember_urls(own_sid, urls, uuids)
        held = not (opens or sessionless)
        req = RequestState(
            request.request_id,
            own_sid,
            self,
            command,
            now,
            work=seq,
            own_group=not opens and bool(sid),
            held=held,
            t0=t0,
        )
        req.sessionless, req.urls = sessionless, urls
        req.opened = opens
        clips = [i.image for i in target.images if isinstance(i.image, SampledVideo)]
        req.warnings = [note for clip in clips if (note := clip.shortfall)]
        if command.stream:
            req.stream = self._stream_of(request, command)
        return req

    def _target(self, sid: str | None, command: ChatCommand) -> tuple[ChatTarget, dict[str, str], dict[str, str]]:
        """The conversation as the engine takes it: every image as content key, bytes and size (fetched
        unless the session fetched its URL before, found by ``uuid`` for a reference; decoded unless a
        session of the request's salt holds it); and what to remember: ``url → key``, ``uuid → key``.

        Raises:
            ServiceError: image_uuid_not_found (a reference nothing of the salt holds), the fetch's
                and the decode's errors.
        """
        settings, salt = self.settings, command.salt
        inputs: list[ImageInput] = []
        urls: dict[str, str] = {}
        uuids: dict[str, str] = {}
        if any(image.video for image in command.images):
            self.engine.check_video()
        for image in command.images:
            if image.source is None:
                inputs.append(self._referenced(sid, image.uuid or "", image.param, salt, video=image.video))
            else:
                inputs.append(self._image_input(sid, image.source, salt, urls))
            if image.uuid is not None:
                uuids[image.uuid] = inputs[-1].key
        conv = command.conversation
        turns = tuple(Turn(t.prompt, t.answer, t.images) for t in conv.turns)
        system = conv.system_prompt if conv.system_prompt is not None else settings.system_prompt
        return ChatTarget(system, turns, conv.question, conv.question_images, tuple(inputs)), urls, uuids

    def _referenced(self, sid: str | None, uuid: str, param: str, salt: str | None, *, video: bool) -> ImageInput:
        """The image (``video``: the video) a ``uuid`` names, as the session or a session or cache
        entry of ``salt`` holds it.

        Raises:
            ServiceError: image_uuid_not_found (also when the uuid names a video in an image part, or
                the reverse).
        """
        key = self.engine.uuid_key(sid, uuid, salt)
        held = self.engine.image_held(sid, key, salt) if key is not None else None
        if held is not None and is_video_size(held[1]) != video:
            raise ServiceError(
                ErrorCode.IMAGE_UUID_NOT_FOUND,
                f"{param}.uuid: {uuid!r} names {'an image' if video else 'a video'}, not "
                f"{'a video' if video else 'an image'}",
                param=f"{param}.uuid",
            )
        if key is None or held is None:
            raise ServiceError(
                ErrorCode.IMAGE_UUID_NOT_FOUND,
                f"{param}.uuid: no image {uuid!r} is held for this request (it was never sent with this "
                "cache_salt, or it was evicted); send the image_url with its uuid again",
                param=f"{param}.uuid",
            )
        return ImageInput(key, held[0], held[1])

    def _image_input(self, sid: str | None, source: ImageSource, salt: str | None, urls: dict[str, str]) -> ImageInput:
        """An image sent by URL, S3 URI or base64: fetched unless the session fetched it before (its
        ``url → key`` recorded in ``urls``), decoded unless a session of ``salt`` holds it. A video
        (``source`` a :class:`~llava_sessions.wire.inbound.VideoSource`) the same way: its key hashes
        its bytes and sampling before any frame is decoded, so a held one is never decoded again."""
        engine, settings = self.engine, self.settings
        name = _name_of(source)
        key = engine.url_key(sid, name)
        held = engine.image_held(sid, key, salt) if key else None
        if held is not None and key is not None:
            return ImageInput(key, held[0], held[1])
        data: bytes
        if isinstance(source, VideoSource):
            data = fetch_video(self.fetch, source, settings)
        else:
            data = self.fetch(source, settings)
        key = image_key(data)
        urls[name] = key
        held = engine.image_held(sid, key, salt)
        if held is not None:
            return ImageInput(key, data, held[1])
        if isinstance(data, VideoBytes):
            clip = decode_video_bytes(data, settings)
            return ImageInput(key, data, media_size(clip), clip)
        image = decode_image(data, max_pixels=settings.max_image_pixels)
        return ImageInput(key, data, (int(image.height), int(image.width)), image)

    # ------------------------------------------------------------------ output
    def emit(self, req: RequestState) -> Reply:
        """The request's frame for this call: nothing until a whole answer is ready (or the stream's
        next chunk), then the answer; a stream's last events go out one per call."""
        seq = req.work
        assert isinstance(seq, Sequence) and isinstance(req.command, ChatCommand)
        if req.frames:
            return self._frame(req, req.frames.pop(0), last=not req.frames)
        finished = req.done or req.error is not None
        if req.stream is None:
            if not finished:
                return self.framing.frame(b"", continued=req.continued, last=False, headers=self._headers(req, False))
            self.requests.forget(req)
            if req.error is not None:
                return self._error(req)
            answers = self._observe(req, seq)
            body = responses.encode_completion(req.command, answers, self.token_text, warnings=req.warnings)
            return self.framing.frame(body, continued=req.continued, last=True, headers=self._headers(req, True))
        stream, choices = req.stream, []
        for sample in seq.samples:  # each answer's news, by choice index; an answer that ended, its end
            new = req.news(sample)
            if sample.answer is not None and sample.index not in req.ended and req.error is None:
                choices.append(stream.finish(sample.index, sample.answer, new))
                req.ended.add(sample.index)
            elif sample.index not in req.ended and (part := stream.tokens(sample.index, new, sample.detokenizer.text)):
                choices.append(part)
        if not finished:
            usage = None
            if req.command.continuous_usage:  # vLLM's continuous_usage_stats: the usage so far
                made = sum(len(s.events) for s in seq.samples)
                usage = responses.usage_of(len(seq.prompt_ids), made, seq.num_reused_tokens)
            return self._frame(req, stream.chunk(choices, usage) if choices else b"", last=False)
        if req.error is None:
            req.frames = stream.end(choices, self._observe(req, seq), req.warnings)
        elif not req.continued:
            self.requests.forget(req)
            return self._error(req)
        else:
            self.metrics.count_error(req.error)
            req.frames = stream.error(req.error)
        if req.sessionless:  # its session is done with: cached or freed now, not when the last event has gone out
            self.requests.end_sessionless(req)
        return self._frame(req, req.frames.pop(0), last=not req.frames)

    def _observe(self, req: RequestState, seq: Sequence) -> list[Answer]:
        """Record a request's answers (and, without a session, whether the conversation cache served
        it); returns them, by choice index."""
        answers = [s.answer for s in seq.samples if s.answer is not None]
        for answer in answers:
            self.metrics.observe_answer(answer)
        if req.sessionless:
            self.metrics.observe_cache(hit=answers[0].cached_tokens > 0)
        return answers

    def _error(self, req: RequestState) -> Reply:
        assert req.error is not None
        sid = req.session_id if req.own_group else None
        return self.requests.error(self, sid, req.error, held=req.held, continued=req.continued)

    def _frame(self, req: RequestState, body: bytes, *, last: bool) -> Reply:
        """One stream frame (the request is forgotten with its last)."""
        if last:
            self.requests.forget(req)
        assert req.stream is not None, "frames one per call belong to a streamed answer"
        return self.framing.frame(
            body,
            continued=req.continued,
            last=last,
            headers=self._headers(req, last),
            content_type=req.stream.content_type,
        )

    def _headers(self, req: RequestState, last: bool) -> dict[str, str]:
        """A session's id (with its ``Expires`` on a new one); a sessionless request's last frame ends
        the TorchServe job group TorchServe minted for it (headers after the first frame reach
        TorchServe, not the client)."""
        if req.sessionless:
            return self.framing.end_sequence(req.session_id) if last and req.own_group else {}
        if req.opened:
            session = self.engine.store.peek(req.session_id)
            if session is not None:
                return opened_headers(req.session_id, session.expires_at)
        return {SESSION_ID_HEADER: req.session_id}
