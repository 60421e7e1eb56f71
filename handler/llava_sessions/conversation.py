"""The conversation as the chat template sees it: remembered turns, their images, the next question.

Plain data, no torch: the engine, the dialects and the store share it. Token-id helpers that need no
model (:func:`common_prefix_len`) live here too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Chat", "ChatTarget", "ImageInput", "Turn", "common_prefix_len", "image_starts"]


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
    """

    system_prompt: str | None
    turns: tuple[Turn, ...] = ()
    pending_images: int = 1
    image_tokens: tuple[int, ...] = field(default=())

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
        return Chat(self.system_prompt, tuple(kept), pending, self.image_tokens)


@dataclass(frozen=True)
class ImageInput:
    """An image of a resent conversation: its content ``key`` (:func:`~llava_sessions.images.fetch.image_key`), the encoded
    ``data``, its (height, width) ``size`` in pixels and the ``image`` decoded (RGB PIL), or None when
    the worker already holds its features or bytes (then it is decoded only if it must be encoded)."""

    key: str
    data: bytes
    size: tuple[int, int]
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
