"""Image fetches beside the scheduling loop: a slow image host stalls only the request that named it.

A URL or S3 image used to be fetched inside ``handle()``: while one host took 4 s, every running
stream stopped for 4 s (TorchServe answers a batch's rows together, so one slow row holds them all).
Now the dialects' ``fetch`` is an :class:`ImageIntake`: during an admission it hands a URL or S3
source to a small thread pool and raises :class:`FetchPending`; the service keeps the request as an
:class:`Intake` and admits it again, from its decoded body, once the bytes are in (a second image
is then fetched the same way). Inline base64 images decode in place, as before.

TorchServe fixes a reply's status with its first frame, so the service waits for a fetch inside the
request's first ``handle()`` call as long as nothing else is generating (a failed fetch then gets
its typed 4xx), and at most ``image_fetch_wait_ms`` while answers are being generated; past that
the request's first frame goes out (status 200, the dialect's headers) and a failure arrives later
as the reply's body, in the dialect's shape, as any error after the first frame does.

No torch here; nothing here knows a dialect's shapes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..images.source import ImageSource
from .framing import Row

if TYPE_CHECKING:
    from ..config import Settings

__all__ = ["FetchPending", "ImageIntake", "Intake"]


class FetchPending(Exception):
    """The request being admitted needs an image that is still being fetched (``future``)."""

    def __init__(self, future: Future) -> None:
        super().__init__("image fetch pending")
        self.future = future


@dataclass
class Intake:
    """A request waiting for its images, across ``handle()`` calls (keyed by TorchServe's request id).

    Attributes:
        row: the request's first row (its body: later rows of the job come without one).
        dialect: the dialect its body was decided to be (``Dialect``).
        data: the decoded body, admitted again once the fetch is done.
        fetches: image source (URL or S3 URI) → its fetch (bytes, or the fetch's ServiceError).
        future: the fetch the last admission waited on.
        framed: its first frame went out (status 200 and headers): its answer continues the reply.
        last_seen: the last ``handle()`` call it was in (``time.monotonic()``).
    """

    row: Row
    dialect: Any
    data: Any
    fetches: dict[str, Future]
    future: Future
    framed: bool = False
    last_seen: float = 0.0


class ImageIntake:
    """The dialects' ``fetch(source, settings) -> bytes``, fetching URL and S3 sources in a thread pool.

    Outside :meth:`admitting` it fetches in the calling thread (as before). Inside, a source of the
    request being admitted is looked up in that request's fetches: done, its bytes (or its error,
    raised); not there yet, submitted to the pool; not done, :class:`FetchPending` is raised.

    Args:
        fetch: the fetch itself, ``(ImageSource, Settings) -> bytes`` (e.g. ``fetch_image_bytes``).
        workers: threads in the pool (``image_fetch_workers``).
    """

    def __init__(self, fetch: Callable[..., bytes], workers: int) -> None:
        self._fetch = fetch
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="llava-fetch")
        self._current: dict[str, Future] | None = None

    @contextmanager
    def admitting(self, fetches: dict[str, Future]) -> Iterator[None]:
        """Within this block, URL and S3 sources are served from (or added to) ``fetches``."""
        self._current = fetches
        try:
            yield
        finally:
            self._current = None

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
        if future is None:
            future = fetches[name] = self._pool.submit(self._fetch, source, settings)
        if not future.done():
            raise FetchPending(future)
        return future.result()
