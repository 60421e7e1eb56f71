"""The proxy's image fetches: a request's URL and S3 images are fetched before it reaches TorchServe.

TorchServe fixes a reply's status with its first frame. A worker that fetched an image itself had
to send that frame (200) after ``image_fetch_wait_ms`` while other answers were generating, and a
fetch that failed later could only arrive as a 200 whose body was the typed error. So the public
port's proxy (:mod:`llava_tools.serve.front`, in ``llava-serve``, the container and the local
endpoint's instances) fetches first, as vLLM fetches in its API server beside the engine:

1. :meth:`ImageRelay.prefetch` finds the URL and S3 images a body names with a light pass of its
   own over the decoded JSON (:func:`image_sources`: the places each dialect reads an image from;
   no field is validated, no grammar built: the dialects' validation is the worker's), fetches
   them in a thread pool with the worker's own :func:`~llava_sessions.images.fetch.fetch_image_bytes`
   under the worker's own settings (SSRF guard on every hop, allowlist, connect / read / total
   deadlines, byte cap: a video's, ``video_url`` parts and native ``video`` sources, under
   ``max_video_bytes``), and waits for all of them; only this request's connection thread waits.
2. The request goes on to TorchServe with a ticket (``X-Llava-Image-Ticket``); the worker asks for
   each source by it (``GET /_llava/images/<ticket>?source=<url>``, :meth:`ImageRelay.answer`):
   the bytes, or the fetch's error, which the worker answers as any error of that request, in its
   dialect, with its status and headers, before its first frame. A ticket is an unguessable random
   id, valid until the request's reply was relayed (:meth:`ImageRelay.release`).
3. What was fetched is kept by ``(cache_salt, source)`` up to ``image_memory_bytes`` for
   ``image_memory_ttl_s`` (least recently used first out), so a conversation resent turn after turn
   (the openai package, LiteLLM) fetches its images once, as it does inside a session (which
   remembers a source for its life). Keyed by the request's salt (the body's ``cache_salt`` or the
   custom attributes' one), so one salt's fetch is never another's hit (no timing side channel
   across salts; a native ``add_image`` has no salt field: its salt is the header's). Failures are
   not kept.

No torch here.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from pydantic import ValidationError

from llava_sessions.config import Settings
from llava_sessions.errors import ServiceError
from llava_sessions.images.fetch import fetch_image_bytes
from llava_sessions.wire.inbound import ImageSource, VideoSource, is_chat_body, load_body, request_salt

__all__ = ["ImageRelay", "image_sources"]

log = logging.getLogger(__name__)

#: Quoted JSON strings that may name a fetched image: base64 has no quote, so image bytes never match.
_MAY_NAME_A_SOURCE = (b'"http', b'"HTTP', b'"s3://', b'"S3://')

_Key = tuple[str | None, str]


class ImageRelay:
    """A request's URL and S3 images fetched before it is relayed, kept for the worker (module docstring).

    Args:
        settings: the worker's settings (fetch limits and guard, ``image_memory_bytes``,
            ``image_memory_ttl_s``, body and prompt limits).
        fetch: ``(ImageSource, Settings) -> bytes``, raising ServiceError (``fetch_image_bytes``).
        workers: threads fetching at once (all requests together).
        clock: seconds for the TTL (``time.monotonic``; a test passes one it controls).
    """

    def __init__(
        self,
        settings: Settings,
        *,
        fetch: Callable[..., bytes] = fetch_image_bytes,
        workers: int = 8,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self._fetch = fetch
        self._clock = clock
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="llava-front-fetch")
        self._lock = threading.Lock()
        self._memory: OrderedDict[_Key, tuple[float, bytes]] = OrderedDict()  # key -> (kept at, bytes)
        self._memory_bytes = 0
        self._inflight: dict[_Key, Future] = {}
        self._tickets: dict[str, dict[str, Future]] = {}
        #: Fetches made from an image's host (memory hits and shared in-flight fetches not counted).
        self.fetches = 0

    def prefetch(self, body: bytes, custom_attributes: str | None) -> str | None:
        """Fetch every URL and S3 image ``body`` names (or find it kept), wait for all of them.

        Args:
            body: the request body as it came (JSON).
            custom_attributes: its ``X-Amzn-SageMaker-Custom-Attributes`` header (a ``cache_salt``).

        Returns:
            The ticket the worker asks for them by, or None: the body names no such image, or its
            dialect refuses it (the worker answers that).
        """
        if not any(marker in body for marker in _MAY_NAME_A_SOURCE):
            return None
        salt, sources = self._sources(body, custom_attributes)
        if not sources:
            return None
        fetches = {name: self._start((salt, name), source) for name, source in sources.items()}
        futures.wait(list(fetches.values()))
        ticket = secrets.token_urlsafe(18)
        with self._lock:
            self._tickets[ticket] = fetches
        return ticket

    def answer(self, ticket: str, source: str) -> tuple[int, bytes | dict[str, Any]]:
        """The worker's lookup of ``source`` under ``ticket``: ``(200, the image's bytes)``, or
        ``(the error's status, {"error": {"code", "message", "param"}})`` of its failed fetch; an
        unknown ticket or source is ``(404, ...)`` with a code that is none of the worker's (it
        then fetches the source itself)."""
        with self._lock:
            future = self._tickets.get(ticket, {}).get(source)
        if future is None:
            return 404, {"error": {"code": "unknown_image_ticket", "message": "no such ticket or source"}}
        exc = future.exception()
        if exc is None:
            return 200, future.result()
        if isinstance(exc, ServiceError):
            return exc.status, {"error": {"code": exc.code.value, "message": exc.message, "param": exc.param}}
        return 500, {"error": {"code": "front_fetch_error", "message": "the proxy's fetch failed"}}

    def release(self, ticket: str) -> None:
        """Forget ``ticket`` (its request's reply was relayed); what was fetched stays kept."""
        with self._lock:
            self._tickets.pop(ticket, None)

    @property
    def kept_bytes(self) -> int:
        """Bytes of fetched images kept now."""
        return self._memory_bytes

    # ---------------------------------------------------------------------------------------
    def _sources(self, body: bytes, custom_attributes: str | None) -> tuple[str | None, dict[str, ImageSource]]:
        """The request's ``cache_salt`` and its URL and S3 sources by name (:func:`image_sources`)."""
        return image_sources(body, custom_attributes, self.settings.max_body_bytes)

    def _start(self, key: _Key, source: ImageSource) -> Future:
        """The fetch of ``source``: kept (done at once), in flight for another request, or started."""
        now = self._clock()
        with self._lock:
            kept = self._memory.get(key)
            if kept is not None and now - kept[0] < self.settings.image_memory_ttl_s:
                self._memory.move_to_end(key)
                done: Future = Future()
                done.set_result(kept[1])
                return done
            future = self._inflight.get(key)
            if future is None:
                future = self._inflight[key] = self._pool.submit(self._fetch_and_keep, key, source)
            return future

    def _fetch_and_keep(self, key: _Key, source: ImageSource) -> bytes:
        settings = self.settings  # a video's under the videos' byte cap, as the worker fetches it
        if isinstance(source, VideoSource):
            settings = settings.model_copy(update={"max_image_bytes": settings.max_video_bytes})
        try:
            data = self._fetch(source, settings)
            with self._lock:
                self.fetches += 1
                self._keep(key, data, self._clock())
            return data
        finally:
            with self._lock:
                self._inflight.pop(key, None)

    def _keep(self, key: _Key, data: bytes, now: float) -> None:
        """Keep ``data`` under ``key``: expired entries out, then the least recently used until it
        fits ``image_memory_bytes`` (an image larger than that is not kept). Holds the lock."""
        budget, ttl = self.settings.image_memory_bytes, self.settings.image_memory_ttl_s
        old = self._memory.pop(key, None)
        if old is not None:
            self._memory_bytes -= len(old[1])
        for stale in [k for k, (at, _) in self._memory.items() if now - at >= ttl]:
            self._memory_bytes -= len(self._memory.pop(stale)[1])
        if len(data) > budget:
            return
        while self._memory and self._memory_bytes + len(data) > budget:
            self._memory_bytes -= len(self._memory.popitem(last=False)[1][1])
        self._memory[key] = (now, data)
        self._memory_bytes += len(data)


def image_sources(
    body: bytes, custom_attributes: str | None, max_body_bytes: int
) -> tuple[str | None, dict[str, ImageSource]]:
    """The URL and S3 image sources a request body names, by name (the URL or URI), and its
    ``cache_salt`` (the body's, else the custom attributes' one): a light pass over the decoded JSON
    that reads only where each dialect takes an image from (a chat ``image_url`` part of any message;
    a native ``open_session``'s image and its history's, an ``add_image``'s, the AWS sample's
    ``start_session`` path). Nothing else of the body is checked: a field the dialect would refuse,
    or a source it would not take, is the worker's to answer, and costs here at most a fetch.

    Returns:
        ``(salt, {name: source})``; no sources for a body that is not JSON, is over
        ``max_body_bytes`` or has a malformed salt.
    """
    try:
        data = load_body(body, max_body_bytes)
        if not isinstance(data, dict):
            return None, {}
        body_salt = data.get("cache_salt")
        salt = request_salt(body_salt if isinstance(body_salt, str) else None, custom_attributes)
    except ServiceError:
        return None, {}
    named = _chat_image_names(data) if is_chat_body(data) else _native_image_names(data)
    sources: dict[str, ImageSource] = {}
    for name, s3, video in named:
        kind = VideoSource if video else ImageSource
        try:
            sources[name] = kind(s3_uri=name) if s3 else kind(url=name)
        except ValidationError:  # the dialect refuses it: the worker says so
            continue
    return salt, sources


def _chat_image_names(data: dict[str, Any]) -> list[tuple[str, bool, bool]]:
    """``(url or s3 URI, is S3, is a video)`` of every ``image_url`` and ``video_url`` part of every message."""
    found = []
    messages = data.get("messages")
    for message in messages if isinstance(messages, list) else ():
        content = message.get("content") if isinstance(message, dict) else None
        for part in content if isinstance(content, list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            medium = part.get(kind) if kind in ("image_url", "video_url") else None
            url = medium.get("url") if isinstance(medium, dict) else medium
            if isinstance(url, str) and url[:8].lower().startswith(("http://", "https://", "s3://")):
                found.append((url, url.startswith("s3://"), kind == "video_url"))
    return found


def _native_image_names(data: dict[str, Any]) -> list[tuple[str, bool, bool]]:
    """``(url or s3 URI, is S3, is a video)`` of a native request's images and videos: an open's and its
    history's, an added image or video, the AWS sample's ``start_session`` path."""
    kind, media = data.get("type"), []
    if kind == "open_session":
        history = data.get("history")
        turns = [t for t in history if isinstance(t, dict)] if isinstance(history, list) else []
        media = [(data.get("image"), False), (data.get("video"), True)]
        media += [
            (m, video) for t in turns for key, video in (("images", False), ("videos", True)) for m in t.get(key) or []
        ]
    elif kind in ("add_image", "add_video"):
        media = [(data.get(kind[4:]), kind == "add_video")]
    elif kind == "start_session" and isinstance(data.get("path"), str):
        path = data["path"]
        return [(path, path.startswith("s3://"), False)] if path.startswith(("http", "s3://")) else []
    found = []
    for medium, video in media:
        if isinstance(medium, dict):
            for field, s3 in (("url", False), ("s3_uri", True)):
                if isinstance(medium.get(field), str):
                    found.append((medium[field], s3, video))
    return found
