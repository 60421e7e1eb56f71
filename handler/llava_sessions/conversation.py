"""The conversation as the chat template sees it: remembered turns, their images, the next question.

Plain data, no torch: the engine, the codec and the store share it. Token-id helpers that need no
model (:func:`common_prefix_len`) live here too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Chat", "Turn", "common_prefix_len"]


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
