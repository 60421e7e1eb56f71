"""The native dialect's serving: a decoded body → its command → the engine → this dialect's frames.

Replies are JSON bodies, or JSON lines in the SageMaker LMI / TGI shape for a streamed answer
(:mod:`.responses`). TorchServe fixes status and headers with a request's first frame, so everything
that decides a status happens at admission: for an open or an added image the fetch, the decode,
the id and the room for it (the vision tower and the prefix prefill then run in scheduler steps);
for a question the session and context checks. An error found later is the body: the last JSON
line of a stream, or the JSON error body of a whole answer (status 200).
"""

from __future__ import annotations

import time
from typing import Any

from ..config import Settings
from ..conversation import Turn, VideoBytes
from ..engine import ImagePrefill, Sequence
from ..errors import ServiceError
from ..images.decode import decode_image
from ..results import AddImageResult, OpenResult, elapsed_ms
from ..sampling.params import SamplingParams
from ..video import SampledVideo
from ..wire.contract import NEW_SESSION_LITERAL, SESSION_ID_HEADER, opened_headers
from ..wire.fetches import decode_video_bytes, fetch_video
from ..wire.framing import JSON_LINES, BatchRequest, Reply
from ..wire.in_flight import RequestState, Serving
from ..wire.inbound import VideoSource, request_salt
from . import responses
from .protocol import (
    AddImageCommand,
    AddImageRequest,
    AddVideoRequest,
    CloseCommand,
    CloseSessionRequest,
    Command,
    GenerateCommand,
    GenerateRequest,
    OpenCommand,
    OpenSessionRequest,
    ResetCommand,
    validate_request,
)

__all__ = ["NativeServing", "decode_command"]


def decode_command(data: Any, settings: Settings) -> Command:
    """Validate one decoded native body (:func:`.protocol.validate_request`) and return its command,
    with the server's defaults applied.

    Raises:
        ServiceError: ``invalid_request`` / ``invalid_parameter`` (400).
    """
    s = settings
    request = validate_request(data, max_prompt_chars=s.max_prompt_chars, max_new_tokens_cap=s.max_new_tokens_cap)
    legacy = request.legacy
    canonical = request.canonical()
    if isinstance(canonical, OpenSessionRequest):
        history = tuple(Turn(t.prompt, t.answer, len(t.images) + len(t.videos)) for t in canonical.history)
        images = tuple(medium for t in canonical.history for medium in (*t.images, *t.videos))
        system = canonical.system_prompt or s.system_prompt
        return OpenCommand(canonical.medium, system, history, legacy, images, canonical.cache_salt)
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
            n=p.n,
            session_choice=p.session_choice,
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
    if isinstance(canonical, AddVideoRequest):
        return AddImageCommand(canonical.video)
    if isinstance(canonical, CloseSessionRequest):
        return CloseCommand()
    return ResetCommand()


class NativeServing(Serving):
    """Admission and emission of native requests (module docstring); built as :class:`Serving`."""

    encode_error = staticmethod(responses.encode_error)
    error_status = staticmethod(responses.error_status)

    def pending_frame(self, request: BatchRequest, data: Any) -> Reply:
        """The first frame of an open or an added image waiting for its image: the session headers
        its answer will have (an open's new id, expiring a TTL from now)."""
        if isinstance(decode_command(data, self.settings), OpenCommand):
            headers = opened_headers(
                self.requests.new_session_id(request), int(time.time()) + self.settings.session_ttl_s
            )
        else:
            headers = {SESSION_ID_HEADER: request.session_id or ""}
        return self.framing.frame(b"", continued=False, last=False, headers=headers)

    def late_error(self, request: BatchRequest, data: Any, err: ServiceError) -> Reply:
        """An open or added image refused after its first frame went out: the error as the reply's
        body; a refused open ends its own TorchServe job group."""
        sid = request.session_id if request.session_id != NEW_SESSION_LITERAL else None
        held = not isinstance(decode_command(data, self.settings), OpenCommand)
        return self.requests.error(self, sid, err, held=held, continued=True)

    # ------------------------------------------------------------------ admission
    def admit(self, request: BatchRequest, data: Any, now: float) -> Reply | RequestState:
        """Admit one decoded native body: an open, an added image or a question becomes a request; a
        reset or a close is answered at once.

        Raises:
            ServiceError: the body's (400), the session's (missing id, gone, busy), the image's,
                the engine's admission (context, limits, overloaded).
        """
        command = decode_command(data, self.settings)
        if isinstance(command, OpenCommand):
            return self._admit_open(request, command, now)
        sid = self.requests.session_of(request, command.kind)
        if isinstance(command, AddImageCommand):
            return self._admit_image(request, sid, command, now)
        if isinstance(command, ResetCommand):
            self.engine.reset(sid)
            return Reply(responses.encode_reset(sid), headers={SESSION_ID_HEADER: sid})
        if not isinstance(command, GenerateCommand):  # close: a running answer ends with "abort"
            self.requests.stop_session(sid)
            self.engine.close(sid)
            return Reply(responses.encode_close(sid), headers=self.framing.closed(sid))
        self.engine.check_idle(sid)  # a gone or busy session is the more precise answer
        self.requests.check_generation_slot(command.params.n)
        seq = self.engine.start(
            sid,
            command.prompt,
            command.params,
            remember=command.remember,
            context_policy=command.context_policy,
            clip_max_new_tokens=command.clip_max_new_tokens,
        )
        return RequestState(request.request_id, sid, self, command, now, work=seq)

    def _admit_open(self, request: BatchRequest, command: OpenCommand, now: float) -> Reply | RequestState:
        """Admit an open: the id, then the image path (:meth:`_admit_image`); a failed open leaves
        no session behind and ends its own TorchServe job group."""
        own_group = bool(request.session_id) and request.session_id != NEW_SESSION_LITERAL
        sid = self.requests.new_session_id(request)
        try:
            return self._admit_image(request, sid, command, now, own_group=own_group)
        except ServiceError as err:
            return self.requests.error(self, sid if own_group else None, err, held=False)

    def _admit_image(
        self,
        request: BatchRequest,
        sid: str,
        command: OpenCommand | AddImageCommand,
        now: float,
        *,
        own_group: bool = True,
    ) -> RequestState:
        """Admit an open or an added image: everything that decides its status happens here (the
        session's state, the fetch, the decode, room for it); the vision tower and the prefill
        then run in scheduler steps.

        Raises:
            ServiceError: from the fetch, the decode and the engine's admission.
        """
        if isinstance(command, AddImageCommand):
            self.engine.check_idle(sid)  # before any fetch: a gone or busy session is the precise answer
        t0 = time.perf_counter()
        sources = [command.image, *(command.history_images if isinstance(command, OpenCommand) else ())]
        if any(isinstance(s, VideoSource) for s in sources):
            self.engine.check_video()
        data = [
            fetch_video(self.fetch, s, self.settings) if isinstance(s, VideoSource) else self.fetch(s, self.settings)
            for s in sources
        ]
        t_fetched = time.perf_counter()
        images = [
            decode_video_bytes(b, self.settings)
            if isinstance(b, VideoBytes)
            else decode_image(b, max_pixels=self.settings.max_image_pixels)
            for b in data
        ]
        t_decoded = time.perf_counter()
        if isinstance(command, OpenCommand):
            prefill = self.engine.begin_open(
                sid,
                data[0],
                command.system_prompt,
                image=images[0],
                history=list(command.history),
                history_images=list(zip(data[1:], images[1:], strict=True)),
                salt=request_salt(command.salt, request.custom_attributes),
            )
        else:
            prefill = self.engine.begin_add_image(sid, data[0], image=images[0])
        held = not isinstance(command, OpenCommand)
        req = RequestState(
            request.request_id, sid, self, command, now, work=prefill, own_group=own_group, held=held, t0=t0
        )
        req.fetch_timings = {"fetch": elapsed_ms(t0, t_fetched), "decode": elapsed_ms(t_fetched, t_decoded)}
        req.warnings = [note for clip in images if isinstance(clip, SampledVideo) and (note := clip.shortfall)]
        return req

    # ------------------------------------------------------------------ output
    def emit(self, req: RequestState) -> Reply:
        """The request's frame for this call: an open's or an added image's (:meth:`_emit_image_prefill`),
        a streamed answer's new lines, or a whole answer once it is done."""
        if isinstance(req.work, ImagePrefill):
            return self._emit_image_prefill(req, req.work)
        seq, command = req.work, req.command
        assert isinstance(command, GenerateCommand) and isinstance(seq, Sequence)
        finished = req.done or req.error is not None
        headers = {SESSION_ID_HEADER: req.session_id}
        if command.stream:
            return self._emit_stream(req, seq, command, finished)
        if not finished:
            return self.framing.frame(b"", continued=req.continued, last=False, headers=headers)
        self.requests.forget(req)
        if req.error is not None:
            return self.requests.error(self, req.session_id, req.error, held=req.held, continued=req.continued)
        answers = [s.answer for s in seq.samples if s.answer is not None]
        for answer in answers:
            self.metrics.observe_answer(answer)
        body = responses.encode_answer(command, answers, seq.index)
        return self.framing.frame(body, continued=req.continued, last=True, headers=headers)

    def _emit_stream(self, req: RequestState, seq: Sequence, command: GenerateCommand, finished: bool) -> Reply:
        """A streamed answer's lines for this call; the last token goes out with ``generated_text``
        and ``details`` (TGI's shape); an error after the first frame is the last line. With ``n`` > 1
        each line carries its answer's ``index``, and each answer ends with a line of its own."""
        several, body = len(seq.samples) > 1, b""
        for sample in seq.samples:
            new, index = req.news(sample), sample.index if several else None
            if sample.index in req.ended:
                continue
            if sample.answer is not None and req.error is None:
                req.ended.add(sample.index)
                self.metrics.observe_answer(sample.answer)
                last = new[-1] if new else None  # none: aborted after its last token went out
                end = responses.encode_stream_end(command, sample.answer, last, index)
                body += responses.encode_tokens(new[:-1], index) + end
            else:
                body += responses.encode_tokens(new, index)
        if not finished:
            return self._lines(req, body, last=False)
        self.requests.forget(req)
        if req.error is None:
            return self._lines(req, body, last=True)
        if not req.continued and not body:
            return self.requests.error(self, req.session_id, req.error, held=req.held)
        self.metrics.count_error(req.error)
        return self._lines(req, body + responses.encode_stream_error(req.error), last=True)

    def _lines(self, req: RequestState, body: bytes, *, last: bool) -> Reply:
        headers = {SESSION_ID_HEADER: req.session_id}
        return self.framing.frame(body, continued=req.continued, last=last, headers=headers, content_type=JSON_LINES)

    def _emit_image_prefill(self, req: RequestState, prefill: ImagePrefill) -> Reply:
        """An open's or added image's output: empty frames (with the session headers and status 200)
        until it is done, then its body; an error after the first frame is the body (its status is
        already out). An open's headers carry the new session id and its ``Expires``."""
        if prefill.action == "open":
            headers = opened_headers(req.session_id, prefill.session.expires_at)
        else:
            headers = {SESSION_ID_HEADER: req.session_id}
        if not prefill.done and req.error is None:
            return self.framing.frame(b"", continued=req.continued, last=False, headers=headers)
        self.requests.forget(req)
        if req.error is not None:
            prefill.close()
            return self.requests.error(
                self, req.session_id if req.own_group else None, req.error, held=req.held, continued=req.continued
            )
        result = prefill.result
        assert result is not None
        timings = {**req.fetch_timings, **result.timings, "total": elapsed_ms(req.t0)}
        if isinstance(req.command, OpenCommand) and isinstance(result, OpenResult):
            body = responses.encode_open(req.command, result, timings, req.warnings)
        else:
            assert isinstance(result, AddImageResult)
            body = responses.encode_add_image(result, timings, req.warnings)
        return self.framing.frame(body, continued=req.continued, last=True, headers=headers)
