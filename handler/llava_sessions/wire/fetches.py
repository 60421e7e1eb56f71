"""Image fetches beside the scheduling loop: a slow image host stalls only the request that named it.

A URL or S3 image used to be fetched inside ``handle()``: while one host took 4 s, every running
stream stopped for 4 s (TorchServe answers a batch's requests together, so one slow request holds them all).
Now the dialects' ``fetch`` is an :class:`ImageFetcher`: during an admission it hands a URL or S3
source to a small thread pool and raises :class:`FetchPending`; the service keeps the request as an
:class:`PendingRequest` and admits it again, from its decoded body, once the bytes are in (a second image
is then fetched the same way). Inline base64 images decode in place, as before.

TorchServe fixes a reply's status with its first frame, so the service waits for a fetch inside the
request's first ``handle()`` call as long as nothing else is generating (a failed fetch then gets
its typed 4xx), and at most ``image_fetch_wait_ms`` while answers are being generated; past that
the request's first frame goes out (status 200, the dialect's headers) and a failure arrives later
as the reply's body, in the dialect's shape, as any error after the first frame does.

Behind the public port's proxy (``llava-serve``, the container, the local endpoint's instances) a
request reaches the worker only once the proxy fetched its URL and S3 images
(``llava_tools.serve.image_relay``): its request carries the proxy's ticket, and the pool asks the proxy for
those bytes, or the fetch's error, over loopback (a millisecond, well inside the wait above), so a
failed fetch always gets its typed 4xx. A source the proxy did not fetch is fetched here as above.

No torch here; nothing here knows a dialect's shapes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import requests

from ..conversation import VideoBytes
from ..errors import ErrorCode, ServiceError
from ..video import SampledVideo, VideoLimits, decode_video
from .contract import IMAGE_RELAY_PATH
from .framing import BatchRequest
from .inbound import ImageSource, VideoSource

if TYPE_CHECKING:
    from ..config import Settings

__all__ = ["FetchPending", "ImageFetcher", "PendingRequest", "decode_video_bytes", "fetch_video"]

log = logging.getLogger(__name__)


class FetchPending(Exception):
    """The request being admitted needs an image that is still being fetched (``future``)."""

    def __init__(self, future: Future) -> None:
        super().__init__("image fetch pending")
        self.future = future


@dataclass
class PendingRequest:
    """A request waiting for its images, across ``handle()`` calls (keyed by TorchServe's request id).

    Attributes:
        request: the request as first sent (its body: a request's later calls come without one).
        dialect: the dialect its body was decided to be (``Dialect``).
        data: the decoded body, admitted again once the fetch is done.
        fetches: image source (URL or S3 URI) → its fetch (bytes, or the fetch's ServiceError).
        future: the fetch the last admission waited on.
        framed: its first frame went out (status 200 and headers): its answer continues the reply.
        last_seen: the last ``handle()`` call it was in (``time.monotonic()``).
    """

    request: BatchRequest
    dialect: Any
    data: Any
    fetches: dict[str, Future]
    future: Future
    framed: bool = False
    last_seen: float = 0.0


class ImageFetcher:
    """The dialects' ``fetch(source, settings) -> bytes``, fetching URL and S3 sources in a thread pool.

    Outside :meth:`admitting` it fetches in the calling thread (as before). Inside, a source of the
    request being admitted is looked up in that request's fetches: done, its bytes (or its error,
    raised); not there yet, submitted to the pool; not done, :class:`FetchPending` is raised.

    A request that came with the proxy's ticket gets its sources from the proxy (``relay``).

    Args:
        fetch: the fetch itself, ``(ImageSource, Settings) -> bytes`` (e.g. ``fetch_image_bytes``).
        workers: threads in the pool (``image_fetch_workers``).
        relay: the proxy's base URL (:data:`~llava_sessions.wire.contract.IMAGE_RELAY_ENV`), or None.
    """

    def __init__(self, fetch: Callable[..., bytes], workers: int, relay: str | None = None) -> None:
        self._fetch = fetch
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="llava-fetch")
        self._current: dict[str, Future] | None = None
        self._ticket: str | None = None
        self._relay = relay.rstrip("/") if relay else None

    @contextmanager
    def admitting(self, fetches: dict[str, Future], ticket: str | None = None) -> Iterator[None]:
        """Within this block, URL and S3 sources are served from (or added to) ``fetches``; new ones
        come from the proxy under ``ticket`` (the request's image ticket) when there is one."""
        self._current, self._ticket = fetches, ticket if self._relay else None
        try:
            yield
        finally:
            self._current = self._ticket = None

    def __call__(self, source: ImageSource, settings: Settings) -> bytes:
        """The encoded image ``source`` names (see the class docstring).

        Raises:
            FetchPending: inside :meth:`admitting`, its fetch is not done yet.
            ServiceError: the fetch's own errors (:func:`~llava_sessions.images.fetch.fetch_image_bytes`).
        """
        name = source.url or source.s3_uri  # inline base64 decodes in place
        fetches = self._current
        if fetches is None or not name:
            return self._fetch(source, settings)
        future = fetches.get(name)
        if future is None and self._ticket:
            future = fetches[name] = self._pool.submit(self._relayed, self._ticket, name, source, settings)
        elif future is None:
            future = fetches[name] = self._pool.submit(self._fetch, source, settings)
        if not future.done():
            raise FetchPending(future)
        return future.result()

    def _relayed(self, ticket: str, name: str, source: ImageSource, settings: Settings) -> bytes:
        """What the proxy fetched for ``name`` under ``ticket``: its bytes, or its error raised here;
        fetched here instead when the proxy does not know it (its error code is none of ours) or
        cannot be asked.

        Raises:
            ServiceError: the proxy's fetch failed (its code, message and param), or this one did.
        """
        url = f"{self._relay}{IMAGE_RELAY_PATH}{ticket}"
        try:
            reply = requests.get(url, params={"source": name}, timeout=(2.0, settings.fetch_total_timeout_s + 5.0))
            if reply.status_code == 200:
                return reply.content
            error = reply.json()["error"]
            code = ErrorCode(error["code"])  # ValueError: not a fetch's error (an unknown ticket or source)
        except (requests.RequestException, ValueError, KeyError, TypeError):
            log.debug("the proxy's image relay has no answer for this source; fetching here", exc_info=True)
            return self._fetch(source, settings)
        raise ServiceError(code, str(error.get("message", "")), param=error.get("param"))


#: A fetch's image codes and the video codes they become for a video source.
_VIDEO_CODES = {ErrorCode.IMAGE_TOO_LARGE: ErrorCode.VIDEO_TOO_LARGE, ErrorCode.IMAGE_INVALID: ErrorCode.VIDEO_INVALID}


def fetch_video(fetch: Callable[..., bytes], source: VideoSource, settings: Settings) -> VideoBytes:
    """The encoded video ``source`` names, fetched by a dialect's ``fetch`` under the images' rules
    with the videos' byte cap (``max_video_bytes``), with its sampling attached.

    Raises:
        FetchPending: as :class:`ImageFetcher`.
        ServiceError: ``video_too_large`` (413) over ``max_video_bytes``; ``video_invalid`` (400) for
            bad base64 or an empty file; the fetch's URL and S3 errors as for an image.
    """
    try:
        data = fetch(source, settings.model_copy(update={"max_image_bytes": settings.max_video_bytes}))
    except ServiceError as err:
        code = _VIDEO_CODES.get(err.code)
        if code is None:
            raise
        raise ServiceError(code, err.message.replace("image", "video"), param=err.param) from None
    return VideoBytes(data, source.num_frames, source.fps)


def decode_video_bytes(data: VideoBytes, settings: Settings) -> SampledVideo:
    """Sample ``data``'s frames as it asks, under the settings' video limits
    (:meth:`~llava_sessions.video.VideoLimits.from_settings`).

    Raises:
        ServiceError: as :func:`~llava_sessions.video.decode_video` (video_invalid, video_too_large,
            invalid_parameter for ``num_frames`` over ``max_video_frames``).
    """
    return decode_video(data, num_frames=data.num_frames, fps=data.fps, limits=VideoLimits.from_settings(settings))
