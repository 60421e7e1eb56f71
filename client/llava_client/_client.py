"""Multi-turn image chat sessions: :class:`SessionClient`, :class:`Session`, :class:`AnswerStream`.

Usage::

    from llava_client import SessionClient

    client = SessionClient.from_url("http://127.0.0.1:8080")          # llava-serve / TorchServe
    # client = SessionClient.from_endpoint("my-llava-endpoint")        # SageMaker stateful endpoint
    with client.open_session("photo.jpg") as session:                 # path, bytes, PIL image, URL, s3:// URI
        answer = session.ask("What is in this image?", max_new_tokens=64)
        print(answer.text, answer.usage.cached_tokens)

        with session.stream("Describe it in detail.") as stream:      # iterator of text pieces
            for piece in stream:
                print(piece, end="", flush=True)
        print(stream.answer.timings["ttft_ms"])                       # the Answer, once complete

        session.ask("Is it daytime?", remember=False)                 # not added to the history
        session.reset()                                                # forget the history, keep the image
    # leaving the block closes the session (close() is idempotent)

Streams: :meth:`Session.stream` sends the request at once (errors before the first token raise
there) and returns an :class:`AnswerStream`, an iterator of text pieces and a context manager.
Leaving the ``with`` block (or calling ``close()``) early closes the HTTP response / event stream.
An error reported mid-stream raises from the iteration. ``stream.answer`` is the :class:`Answer`
once the last line arrived (None before). An answer cut short is abandoned: it is not added to
:attr:`Session.history`, and TorchServe drops the job when its client disconnects, so the server
does not remember it either (what SageMaker's front end does on a client disconnect is unverified).
Until the handler notices the dropped job, the session may answer 409 :class:`SessionBusy`.

Retries (:func:`should_retry`): at most ``max_retries`` times, with capped jittered exponential
backoff honouring ``Retry-After``, and only where a repeat cannot duplicate work:

- opens, resets, closes and ``remember=False`` questions: on connection errors and timeouts,
  503, 429 and 409 ``session_busy``;
- a remembered question (it appends a turn): only when the server surely did not run it, i.e.
  the connection was never established, the handler refused it before any work (503
  ``overloaded``, 409 ``session_busy``), or SageMaker throttled (429);
- a stream only before its response started (never once a token arrived).

A restarting server refuses connections for a few seconds (docs/api.md, "When a worker dies"):
once the server has answered this client, a request that could not connect at all is retried for up
to ``restart_wait_s`` seconds (default :data:`DEFAULT_RESTART_WAIT_S`) from its first refusal, past
``max_retries``, with the same backoff capped at :data:`MAX_RESTART_RETRY_DELAY_S`; nothing ran, so
any request may be repeated. A server that never answered (a wrong port, a server not started) gets
only ``max_retries``: the error, naming the URL, comes within a few seconds.

Recovery (``auto_recover=True``): when a call fails because the session is gone from the server
(:class:`SessionGone`: closed behind our back, expired, evicted, or lost with a restarted worker),
the client reopens a session on the same image (it keeps the image it was opened with) and hands
the server its remembered turns (``open_session`` with ``history``: the server remembers them as
its own and prefills them with the image), then retries the failed call once. The conversation is
restored exactly, sampled answers included, at the cost of one prefill; nothing is regenerated.
A WARNING is logged, :attr:`Session.recoveries` counts the recoveries and
:attr:`Session.last_recovery` (a :class:`Recovery`) says what happened.

Neither class is thread-safe: use one session from one thread at a time (the server answers a
second concurrent request on a session with 409 :class:`SessionBusy`).
"""

from __future__ import annotations

import itertools
import json
import logging
import random
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeVar

from . import _chat
from ._chat import ChatReply, ChatSession
from ._exceptions import (
    APIConnectionError,
    LlavaError,
    Overloaded,
    PayloadTooLarge,
    RateLimited,
    SessionBusy,
    SessionGone,
    status_error_from_body,
)
from ._images import MAX_BODY_BYTES, Downsized, ImageInput, describe_image, fit_payload, image_budget, image_payload
from ._transport import (
    DEFAULT_TIMEOUT,
    HttpTransport,
    LineStream,
    RawResponse,
    Transport,
    parse_expires,
    parse_session_header,
)
from ._types import AddedImage, Answer, GenerationParams, Recovery, Token

__all__ = [
    "DEFAULT_MAX_RETRIES",
    "DEFAULT_RESTART_WAIT_S",
    "INITIAL_RETRY_DELAY_S",
    "MAX_BODY_BYTES",
    "MAX_RETRY_DELAY_S",
    "AnswerStream",
    "Session",
    "SessionClient",
    "should_retry",
]

log = logging.getLogger("llava_client")

#: Retries after the first attempt.
DEFAULT_MAX_RETRIES = 2
#: First backoff delay; doubles per retry, capped at :data:`MAX_RETRY_DELAY_S`, times a 0.75–1.0 jitter.
INITIAL_RETRY_DELAY_S = 0.5
MAX_RETRY_DELAY_S = 8.0
#: Seconds a request that could not connect keeps being retried (a server restart's window).
DEFAULT_RESTART_WAIT_S = 30.0
#: Longest wait between two connection attempts inside that window.
MAX_RESTART_RETRY_DELAY_S = 2.0


T = TypeVar("T")


def should_retry(error: LlavaError, *, retry_safe: bool) -> bool:
    """Whether ``error`` may be retried.

    Args:
        error: what the attempt raised.
        retry_safe: the request cannot append a turn twice (open, reset, close, ``remember=False``).

    Connection errors and timeouts: when ``retry_safe``, or when the request surely never left
    (``request_sent`` false). 429: always. 409 ``session_busy``: always (the handler refuses it
    before any work while another request of the session is in flight). 503: when ``retry_safe``,
    or when the handler refused it before any work (code ``overloaded``). Nothing else.
    """
    if isinstance(error, APIConnectionError):
        return retry_safe or not error.request_sent
    if isinstance(error, (RateLimited, SessionBusy)):
        return True
    if isinstance(error, Overloaded):
        return retry_safe or error.code == "overloaded"
    return False


def retry_delay(attempt: int, error: LlavaError) -> float:
    """Seconds to wait before retry number ``attempt + 1``: ``Retry-After`` if given, else backoff."""
    hint = getattr(error, "retry_after", None)
    if hint is not None:
        return min(float(hint), MAX_RETRY_DELAY_S)
    delay = min(INITIAL_RETRY_DELAY_S * 2.0**attempt, MAX_RETRY_DELAY_S)
    return delay * (1.0 - 0.25 * random.random())


@dataclass(frozen=True)
class _Opened:
    session_id: str
    expires_at: datetime | None
    image_tokens: int | None
    timings: dict[str, float]


@dataclass(frozen=True)
class _Turn:
    prompt: str
    answer: Answer
    images: tuple[dict[str, str], ...] = ()  # images added before this question (the first image aside)


class SessionClient:
    """Opens image chat sessions over an injected transport.

    Args:
        transport: an :class:`~llava_client.HttpTransport`, a :class:`~llava_client.SageMakerTransport`,
            or anything with their ``invoke`` / ``invoke_stream`` / ``close``.
        max_retries: retries after the first attempt (see :func:`should_retry`).
        auto_recover: reopen and replay a session the server lost (see the module docstring).
        max_body_bytes: largest request body sent (SageMaker's limit by default).
        restart_wait_s: seconds a request that could not connect is retried (past ``max_retries``),
            to ride out a server restart, once the server has answered this client; 0 turns this off.

    Use :meth:`from_url` / :meth:`from_endpoint` for the common cases. ``with SessionClient(...)``
    closes the transport at the end.
    """

    def __init__(
        self,
        transport: Transport,
        *,
        max_retries: int = DEFAULT_MAX_RETRIES,
        auto_recover: bool = True,
        max_body_bytes: int = MAX_BODY_BYTES,
        restart_wait_s: float = DEFAULT_RESTART_WAIT_S,
    ) -> None:
        if max_retries < 0:
            raise ValueError("max_retries must be >= 0")
        if restart_wait_s < 0:
            raise ValueError("restart_wait_s must be >= 0")
        self.transport = transport
        self.max_retries = max_retries
        self.restart_wait_s = restart_wait_s
        self._reached = False  # the server answered once: a refused connection is then a restart
        self.auto_recover = auto_recover
        self.max_body_bytes = max_body_bytes

    @classmethod
    def from_url(
        cls, base_url: str, *, timeout: float | tuple[float, float] = DEFAULT_TIMEOUT, **kwargs: Any
    ) -> SessionClient:
        """A client for ``{base_url}/invocations`` over plain HTTP (``llava-serve``, a local container)."""
        return cls(HttpTransport(base_url, timeout=timeout), **kwargs)

    @classmethod
    def from_endpoint(
        cls,
        endpoint_name: str,
        *,
        region_name: str | None = None,
        client: Any = None,
        session: Any = None,
        timeout: float | tuple[float, float] = DEFAULT_TIMEOUT,
        endpoint_url: str | None = None,
        inference_component_name: str | None = None,
        **kwargs: Any,
    ) -> SessionClient:
        """A client for a SageMaker endpoint (see :class:`~llava_client.SageMakerTransport`);
        ``endpoint_url``: another SageMaker runtime URL (``llava-local-endpoint``: dummy credentials)."""
        from .sagemaker import SageMakerTransport

        transport = SageMakerTransport(
            endpoint_name,
            client=client,
            session=session,
            region_name=region_name,
            timeout=timeout,
            endpoint_url=endpoint_url,
            inference_component_name=inference_component_name,
        )
        return cls(transport, **kwargs)

    def __repr__(self) -> str:
        return f"SessionClient({self.transport!r})"

    def __enter__(self) -> SessionClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the transport (open sessions stay open on the server until closed or expired)."""
        self.transport.close()

    def open_session(self, image: ImageInput, *, system_prompt: str | None = None) -> Session:
        """Open a session on ``image`` and return it (use it as a context manager to close it).

        Args:
            image: a local path, image file bytes, a PIL image (sent inline, base64), an
                ``http(s)://`` URL or an ``s3://bucket/key`` URI (fetched by the server).
            system_prompt: replaces the server's default system prompt for this session.

        Raises:
            PayloadTooLarge: an inline image whose request would exceed ``max_body_bytes``
                (checked before sending: pass an S3 URI or URL instead).
            InvalidRequest: the server cannot use the image (``image_invalid``, ``image_fetch_failed``,
                ``image_url_forbidden``) or the request is malformed.
            APIStatusError, APIConnectionError: as for any call.
            FileNotFoundError: a local path that does not exist.
        """
        payload, downsized = self._inline(image)
        opened = self._open(payload, system_prompt)
        log.debug("opened session %s on %s", opened.session_id, describe_image(payload))
        session = Session(self, opened, payload, system_prompt)
        if downsized is not None:
            session.downsized.append(downsized)
        return session

    def _inline(self, image: ImageInput) -> tuple[dict[str, str], Downsized | None]:
        """The wire's image object for ``image``; an inline image over the request limit downsized
        (:func:`~llava_client._images.fit_payload`; said in the log and returned)."""
        payload, downsized = fit_payload(image_payload(image), image_budget(self.max_body_bytes))
        if downsized is not None:
            log.info("%s", downsized)
        return payload, downsized

    # ------------------------------------------------------------------ the chat dialect
    def chat_session(self) -> ChatSession:
        """Open a session for the chat dialect (AWS's ``{"requestType": "NEW_SESSION"}``): it holds no
        image until a conversation brings one. See :mod:`llava_client._chat`.

        Raises:
            APIStatusError, APIConnectionError: as for any call.
        """
        data, raw = self._invoke({"requestType": "NEW_SESSION"}, None, retry_safe=True)
        session_id, _ = parse_session_header(raw.new_session_id)
        session_id = session_id or data.get("session_id")
        if not session_id:
            raise LlavaError("the server's NEW_SESSION reply named no session id")
        return ChatSession(self, session_id)

    def complete(self, messages: list[dict[str, Any]], **params: Any) -> ChatReply:
        """A one-shot chat completion: ``messages`` (OpenAI's format; images as ``image_url`` parts,
        see :func:`~llava_client.image_part`) answered outside any session. ``params``: OpenAI's
        (``max_tokens``, ``temperature``, ``top_p``, ``stop``, ``seed``, ...).

        Raises:
            APIStatusError, APIConnectionError: as for any call.
        """
        return _chat.complete(self, messages, "", **params)

    def stream_chat(self, messages: list[dict[str, Any]], **params: Any) -> Iterator[str]:
        """As :meth:`complete`, the answer's text pieces as they come."""
        return _chat.stream(self, messages, "", **params)

    # ------------------------------------------------------------------ internals
    def _open(
        self, payload: dict[str, str], system_prompt: str | None, history: list[dict[str, Any]] | None = None
    ) -> _Opened:
        request: dict[str, Any] = {"type": "open_session", "image": payload}
        if system_prompt is not None:
            request["system_prompt"] = system_prompt
        if history:
            request["history"] = history
        data, raw = self._invoke(request, None, retry_safe=True)
        session_id, expires_at = parse_session_header(raw.new_session_id)
        session_id = session_id or data.get("session_id")
        if not session_id:
            raise LlavaError("the server's open_session reply named no session id")
        if expires_at is None:
            expires_at = parse_expires(data.get("expires_at"))
        return _Opened(session_id, expires_at, data.get("image_tokens"), dict(data.get("timings") or {}))

    def _encode(self, request: dict[str, Any]) -> bytes:
        body = json.dumps(request, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
        if len(body) > self.max_body_bytes:
            hint = (
                "upload the image to S3 and pass its s3:// URI (or an https URL) instead of inline data"
                if request.get("type") in ("open_session", "add_image") or "messages" in request
                else "shorten the prompt"
            )
            raise PayloadTooLarge(
                f"request body is {len(body):,} bytes, over the {self.max_body_bytes:,}-byte limit "
                f"(checked before sending); {hint}",
                status_code=413,
                code="payload_too_large",
            )
        return body

    def _retrying(self, call: Callable[[], T], *, retry_safe: bool, what: str) -> T:
        first_refusal: float | None = None
        for attempt in itertools.count():
            try:
                result = call()
                self._reached = True
                return result
            except LlavaError as err:
                refused = isinstance(err, APIConnectionError) and not err.request_sent
                if not isinstance(err, APIConnectionError):
                    self._reached = True  # it answered: a later refusal is a restart, not a wrong address
                if refused and first_refusal is None:
                    first_refusal = time.monotonic()
                in_window = (
                    refused
                    and self._reached
                    and first_refusal is not None
                    and time.monotonic() - first_refusal < self.restart_wait_s
                )
                if not in_window and (attempt >= self.max_retries or not should_retry(err, retry_safe=retry_safe)):
                    raise
                delay = retry_delay(attempt, err)
                if in_window:
                    delay = min(delay, MAX_RESTART_RETRY_DELAY_S)
                log.info(
                    "retrying %s in %.2f s after %s (retry %d of %d)", what, delay, err, attempt + 1, self.max_retries
                )
                time.sleep(delay)
        raise AssertionError("unreachable")

    def _invoke(self, request: dict[str, Any], session_id: str | None, *, retry_safe: bool) -> tuple[dict, RawResponse]:
        """Send ``request`` with retries; return (parsed JSON body, raw reply). Error bodies raise."""
        body = self._encode(request)

        def call() -> tuple[dict, RawResponse]:
            raw = self.transport.invoke(body, session_id=session_id)
            try:
                data = json.loads(raw.body)
            except ValueError:
                raise LlavaError(f"the server's reply is not JSON: {raw.body[:200]!r}") from None
            if not isinstance(data, dict):
                raise LlavaError("the server's reply is not a JSON object")
            if data.get("error"):  # an error found after the status went out (200)
                raise status_error_from_body(raw.status_code, data, headers=raw.headers, request_id=raw.request_id)
            return data, raw

        return self._retrying(call, retry_safe=retry_safe, what=str(request.get("type")))

    def _invoke_stream(self, request: dict[str, Any], session_id: str, *, retry_safe: bool) -> LineStream:
        body = self._encode(request)
        return self._retrying(
            lambda: self.transport.invoke_stream(body, session_id=session_id),
            retry_safe=retry_safe,
            what="streamed chat" if "messages" in request else "streamed generate",
        )


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


def _params(
    max_new_tokens: int | None,
    temperature: float | None,
    top_p: float | None,
    top_k: int | None,
    repetition_penalty: float | None,
    do_sample: bool | None,
    seed: int | None,
    stop: str | Sequence[str] | None,
    details: bool | None,
) -> GenerationParams:
    if isinstance(stop, str):
        stop = (stop,)
    return GenerationParams(
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        repetition_penalty=repetition_penalty,
        do_sample=do_sample,
        seed=seed,
        stop=tuple(stop) if stop else None,
        details=details,
    )


def _ms_since(t0: float) -> float:
    return round((time.perf_counter() - t0) * 1000.0, 3)


class Session:
    """One open image chat session (made by :meth:`SessionClient.open_session`).

    Attributes:
        id: the current session id (changes when a recovery reopened the session).
        expires_at: the session's expiry (aware UTC datetime) or None if the server gave none.
        image_tokens: context positions the image occupies, as the server reported.
        open_timings: the server's timings of the open (milliseconds).
        recoveries: how many times the session was reopened and its history replayed.
        last_recovery: what the last recovery did (:class:`Recovery`), or None.
        downsized: the session's inline images the client downsized to fit the request limit
            (:class:`~llava_client._images.Downsized`, each says what was done), in order.
    """

    def __init__(
        self, client: SessionClient, opened: _Opened, image: dict[str, str], system_prompt: str | None
    ) -> None:
        self._client = client
        self._image = image
        self._system_prompt = system_prompt
        self._turns: list[_Turn] = []
        self._pending_images: list[dict[str, str]] = []  # added since the last remembered turn
        self._closed = False
        self.recoveries = 0
        self.last_recovery: Recovery | None = None
        self.downsized: list[Downsized] = []
        self._set_opened(opened)

    def _set_opened(self, opened: _Opened) -> None:
        self.id = opened.session_id
        self.expires_at = opened.expires_at
        self.image_tokens = opened.image_tokens
        self.open_timings = opened.timings

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._turns)} turns"
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
        max_new_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        repetition_penalty: float | None = None,
        do_sample: bool | None = None,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        details: bool | None = None,
        context_policy: str | None = None,
    ) -> Answer:
        """Ask a question about the image and wait for the whole answer.

        Args:
            prompt: the question.
            remember: True: the turn joins the history (later questions see it); False: answered
                with the current history as context and forgotten.
            max_new_tokens, temperature, top_p, top_k, repetition_penalty, do_sample, seed, stop:
                sampling parameters (None: the server's default; greedy unless sampling is asked for).
            details: include the per-token list (``answer.tokens``) with log-probabilities.
            context_policy: when the turn does not fit the model's context: ``"truncate"`` (the
                oldest remembered turns leave it, here and on the server; ``answer.truncated_turns``
                says how many) or ``"error"`` (:class:`ContextLengthExceeded`); None: the server's
                setting (``truncate`` by default).

        Raises:
            InvalidRequest: a bad parameter or prompt. ContextLengthExceeded: it does not fit.
            SessionBusy: another request of this session is in flight. SessionGone: the session
            is gone and could not be recovered (or ``auto_recover`` is off). Overloaded,
            APIConnectionError, APITimeoutError, InternalServerError: after the allowed retries.
            LlavaError: the session is closed.
        """
        params = _params(max_new_tokens, temperature, top_p, top_k, repetition_penalty, do_sample, seed, stop, details)
        request = _generate_request(prompt, params, stream=False, remember=remember, context_policy=context_policy)
        t0 = time.perf_counter()
        data, _ = self._with_recovery(lambda: self._client._invoke(request, self.id, retry_safe=not remember))
        total_ms = _ms_since(t0)
        answer = Answer.from_wire(
            str(data.get("generated_text", "")), data.get("details"), client_ttft_ms=total_ms, client_total_ms=total_ms
        )
        self._record(prompt, answer, remember)
        return answer

    def stream(
        self,
        prompt: str,
        *,
        remember: bool = True,
        max_new_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        repetition_penalty: float | None = None,
        do_sample: bool | None = None,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        details: bool | None = None,
        context_policy: str | None = None,
    ) -> AnswerStream:
        """Ask a question and stream the answer's text pieces as they are generated.

        The request is sent now: errors before the first token (and recovery) happen here.
        Use the result as ``with session.stream(q) as s: for piece in s: ...``; then ``s.answer``.
        Arguments and errors as :meth:`ask`; an error reported mid-stream raises from the iteration.
        """
        params = _params(max_new_tokens, temperature, top_p, top_k, repetition_penalty, do_sample, seed, stop, details)
        request = _generate_request(prompt, params, stream=True, remember=remember, context_policy=context_policy)
        t0 = time.perf_counter()
        lines = self._with_recovery(lambda: self._client._invoke_stream(request, self.id, retry_safe=not remember))

        return AnswerStream(
            lines, on_answer=lambda answer: self._record(prompt, answer, remember), t0=t0, session_id=self.id
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

    def add_image(self, image: ImageInput) -> AddedImage:
        """Add an image to the conversation: the next question may refer to it and to every earlier
        image. The server reuses the cached conversation and encodes only the new image.

        Args:
            image: as for :meth:`SessionClient.open_session` (path, bytes, PIL image, URL, ``s3://``).

        Returns:
            What the server reported (:class:`AddedImage`).

        Raises:
            ImageLimitExceeded: the session holds the server's maximum of images (or image tokens).
            ContextLengthExceeded: the conversation with this image leaves no room for a question.
            PayloadTooLarge, InvalidRequest: as for :meth:`SessionClient.open_session`; others as :meth:`ask`.
        """
        payload, downsized = self._client._inline(image)
        request = {"type": "add_image", "image": payload}
        data, _ = self._with_recovery(lambda: self._client._invoke(request, self.id, retry_safe=False))
        self._pending_images.append(payload)
        if downsized is not None:
            self.downsized.append(downsized)
        return AddedImage(
            image_tokens=int(data.get("image_tokens", 0)),
            images=int(data.get("images", 0)),
            prefix_tokens=int(data.get("prefix_tokens", 0)),
            cached_tokens=int(data.get("cached_tokens", 0)),
            timings=dict(data.get("timings") or {}),
            downsized=downsized,
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
            self._client._invoke({"type": "reset"}, self.id, retry_safe=True)
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
            self._client._invoke({"type": "close_session"}, self.id, retry_safe=True)
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
            "session %s is gone (%s); reopening on the same image with its %d remembered turns",
            old_id,
            error.code,
            len(self._turns),
        )
        history: list[dict[str, Any]] = []
        for turn in self._turns:
            entry: dict[str, Any] = {"prompt": turn.prompt, "answer": turn.answer.text}
            if turn.images:
                entry["images"] = list(turn.images)
            history.append(entry)
        opened = client._open(self._image, self._system_prompt, history=history)
        for payload in self._pending_images:  # images added since the last turn, added again
            client._invoke({"type": "add_image", "image": payload}, opened.session_id, retry_safe=False)
        self._set_opened(opened)
        self.recoveries += 1
        self.last_recovery = Recovery(
            reason=error.code or "session_gone",
            old_session_id=old_id,
            new_session_id=opened.session_id,
            replayed_turns=len(self._turns),
        )
        log.warning(
            "session %s restored as %s with its %d remembered turns", old_id, opened.session_id, len(self._turns)
        )


class AnswerStream:
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
        self._lines = lines
        self._on_answer = on_answer
        self._t0 = t0
        self._ttft_ms: float | None = None
        self._pieces: list[str] = []
        self._tokens: list[Token] = []
        self._closed = False
        self._gen = self._iterate()
        self.answer: Answer | None = None
        self.session_id = session_id

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        return next(self._gen)

    def __enter__(self) -> AnswerStream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def text(self) -> str:
        """The text received so far."""
        return "".join(self._pieces)

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

    def close(self) -> None:
        """Stop reading and release the connection. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._gen.close()
        self._lines.close()
        if self.answer is None:
            log.info(
                "stream of session %s closed before its end: the answer is abandoned (not remembered)", self.session_id
            )

    def _iterate(self) -> Generator[str, None, None]:
        try:
            for raw in self._lines:
                try:
                    line = json.loads(raw)
                except ValueError:
                    raise LlavaError(f"malformed stream line from the server: {raw[:200]!r}") from None
                if not isinstance(line, dict):
                    raise LlavaError("malformed stream line from the server (not a JSON object)")
                if line.get("error"):
                    raise status_error_from_body(200, line)
                token = line.get("token")
                if token:  # every line of an answer has one; the last also has generated_text and details
                    if self._ttft_ms is None:
                        self._ttft_ms = _ms_since(self._t0)
                    text = str(token.get("text") or "")
                    self._tokens.append(Token(int(token.get("id", -1)), text, token.get("logprob")))
                    if text:
                        self._pieces.append(text)
                        yield text
                if line.get("generated_text") is not None or line.get("details") is not None:
                    total_ms = _ms_since(self._t0)
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
