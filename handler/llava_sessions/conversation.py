"""The conversation as the chat template sees it: remembered turns, their images, the next question.

Plain data, no torch: the engine, the dialects and the store share it. Token-id helpers that need no
model (:func:`common_prefix_len`) live here too.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "Chat",
    "ChatTarget",
    "ImageInput",
    "Turn",
    "VideoBytes",
    "common_prefix_len",
    "image_key",
    "image_starts",
    "is_video_size",
    "media_size",
    "still_images",
    "video_indexes",
    "video_sampling",
]


class VideoBytes(bytes):
    """An encoded video clip (its bytes as received) and how its frames are sampled.

    A session keeps its media as bytes in conversation order, the images' and the videos' alike
    (a video is one of the session's "images" to the store, the tiers and the sharing); this type
    tells a video apart and carries its sampling, so the bytes tier restores exactly the frames first
    sampled, and two requests sampling one clip differently never share features
    (:func:`image_key` hashes the sampling with the bytes).

    Attributes:
        num_frames: frames sampled uniformly (None: ``fps`` or the server's default).
        fps: frames sampled per second of the clip (None: ``num_frames`` or the server's default).
    """

    num_frames: int | None
    fps: float | None

    def __new__(cls, data: bytes, num_frames: int | None = None, fps: float | None = None) -> VideoBytes:
        out = super().__new__(cls, data)
        out.num_frames, out.fps = num_frames, fps
        return out

    @property
    def sampling(self) -> str:
        """The sampling as text (:func:`video_sampling`), hashed into the key."""
        return video_sampling(self.num_frames, self.fps)

    def __reduce__(self) -> Any:
        return (VideoBytes, (bytes(self), self.num_frames, self.fps))


def video_sampling(num_frames: int | None, fps: float | None) -> str:
    """How a video's frames are sampled, as text: ``"num_frames=8"``, ``"fps=1.0"`` or ``"default"``."""
    if num_frames is not None:
        return f"num_frames={num_frames}"
    if fps is not None:
        return f"fps={float(fps)!r}"
    return "default"


def media_size(item: Any) -> tuple[int, ...]:
    """The size of a decoded medium as the layout counts it: ``(height, width)`` pixels for an image
    (a PIL image), ``(frames, height, width)`` for a sampled video (anything with ``num_frames``)."""
    frames = getattr(item, "num_frames", None)
    if frames is not None:
        return (int(frames), int(item.height), int(item.width))
    return (int(item.height), int(item.width))


def is_video_size(size: tuple[int, ...]) -> bool:
    """Whether a layout size (:func:`media_size`) is a video's ``(frames, height, width)``."""
    return len(size) == 3


def still_images(sizes: Any) -> int:
    """How many of the media of ``sizes`` (:func:`media_size`) are still images: what decides
    LLaVA-OneVision's several-image layout (its processor counts images alone, videos apart)."""
    return sum(1 for size in sizes if not is_video_size(size))


def video_indexes(sizes: Any) -> frozenset[int]:
    """The conversation-order indexes of the videos among media of ``sizes`` (:attr:`Chat.videos`)."""
    return frozenset(i for i, size in enumerate(sizes) if is_video_size(size))


@dataclass(frozen=True)
class Turn:
    """One remembered exchange: the user's ``prompt`` and the assistant's ``answer`` text;
    ``images``: how many of the session's images open that user message (before its text)."""

    prompt: str
    answer: str
    images: int = 0


@dataclass(frozen=True)
class Chat:
    """A conversation apart from its next question: what the chat template renders.

    Attributes:
        system_prompt: optional system message.
        turns: remembered exchanges, oldest first (each carries the images opening its message).
        pending_images: images not yet asked about: they open the next user message.
        image_tokens: placeholder tokens of every image, in conversation order
            (``len == sum(t.images for t in turns) + pending_images``).
        videos: the conversation-order indexes of the media that are videos (the rest are images);
            a video is counted among a turn's ``images`` as any medium and rendered as the template's
            video part.
    """

    system_prompt: str | None
    turns: tuple[Turn, ...] = ()
    pending_images: int = 1
    image_tokens: tuple[int, ...] = field(default=())
    videos: frozenset[int] = field(default=frozenset())

    def image_after_video(self) -> bool:
        """Whether a user message holds an image after a video: the llava-hf chat templates render a
        message's images before its videos, so such a conversation cannot be rendered in its order."""
        index = 0
        for n in [t.images for t in self.turns] + [self.pending_images]:
            kinds = [i in self.videos for i in range(index, index + n)]
            index += n
            if kinds != sorted(kinds):
                return True
        return False

    def without_oldest(self, n: int) -> Chat:
        """The chat with its ``n`` oldest turns dropped; their images move to the first turn kept
        (or to the next question when none is), so no image ever leaves the context."""
        if n <= 0:
            return self
        moved = sum(t.images for t in self.turns[:n])
        kept = list(self.turns[n:])
        pending = self.pending_images
        if kept:
            first = kept[0]
            kept[0] = Turn(first.prompt, first.answer, first.images + moved)
        else:
            pending += moved
        return Chat(self.system_prompt, tuple(kept), pending, self.image_tokens, self.videos)


@dataclass(frozen=True)
class ImageInput:
    """An image of a resent conversation: its content ``key`` (:func:`image_key`), the encoded
    ``data``, its (height, width) ``size`` in pixels and the ``image`` decoded (RGB PIL), or None when
    the worker already holds its features or bytes (then it is decoded only if it must be encoded).
    A video is one too: ``data`` a :class:`VideoBytes`, ``size`` its ``(frames, height, width)``."""

    key: str
    data: bytes
    size: tuple[int, ...]
    image: Any = None


@dataclass(frozen=True)
class ChatTarget:
    """A whole conversation a client sent (OpenAI ``messages``) as the session should hold it.

    Attributes:
        system_prompt: optional system message.
        turns: the remembered exchanges (each carries the number of images opening its message).
        question: the last user message's text.
        pending_images: images opening the question.
        images: every image in conversation order (``len == sum(t.images) + pending_images``).
    """

    system_prompt: str | None
    turns: tuple[Turn, ...]
    question: str
    pending_images: int
    images: tuple[ImageInput, ...]


def image_starts(ids: list[int], image_token_id: int, limit: int | None = None) -> list[int]:
    """Positions where each image's run of placeholder tokens starts in ``ids`` (before ``limit``),
    in order: the n-th start is the n-th image of the conversation."""
    end = len(ids) if limit is None else min(limit, len(ids))
    starts: list[int] = []
    pos = 0
    while True:
        try:
            pos = ids.index(image_token_id, pos, end)
        except ValueError:
            return starts
        starts.append(pos)
        while pos < end and ids[pos] == image_token_id:
            pos += 1


def common_prefix_len(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token-id lists.

    Slices are compared (in C), not items one by one in Python: the whole shorter length first (a
    resent conversation usually extends the cached one), else a binary search over the first
    difference, each probe comparing only the slice not yet known equal (O(n) work in all, ~600
    tokens of an image prefix in microseconds).
    """
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def image_key(data: bytes) -> str:
    """The content key of an encoded image: SHA-256 of its bytes, hex (64 characters).

    Images are recognised by their exact bytes, never by URL or token ids alone (cross-request
    caches keyed without the image content have served one image's answers for another: vLLM issue
    20261, docs/platform.md). A video's key (``data`` a
    :class:`~llava_sessions.conversation.VideoBytes`) hashes its sampling after its bytes, so one clip
    sampled two ways is two keys, and never an image's.
    """
    digest = hashlib.sha256(data)
    if isinstance(data, VideoBytes):
        digest.update(b"\x00video:" + data.sampling.encode())
    return digest.hexdigest()
