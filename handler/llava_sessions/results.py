"""What the engine returns: token events, answers, opened sessions and added images (plain data, no torch).

The dialects render these and the metrics observe them, so neither needs the torch engine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "AddImageResult",
    "Answer",
    "ContextPolicy",
    "FinishReason",
    "OpenResult",
    "RestoredFrom",
    "TokenEvent",
    "elapsed_ms",
]

#: Why an answer ended: ``stop`` (EOS or a stop sequence), ``length`` (max_new_tokens reached) or
#: ``abort`` (its session was closed while it ran; vLLM's word for a request it stopped).
FinishReason = Literal["stop", "length", "abort"]
#: What happens when a turn does not fit the context (``SessionEngine.start``).
ContextPolicy = Literal["truncate", "error"]
#: The tier a demoted session was rebuilt from.
RestoredFrom = Literal["features", "image"]


def elapsed_ms(t0: float, t1: float | None = None) -> float:
    """Milliseconds from ``t0`` to ``t1`` (default: now), both ``time.perf_counter()`` seconds, to 3 decimals."""
    return round(((time.perf_counter() if t1 is None else t1) - t0) * 1000.0, 3)


@dataclass(frozen=True)
class TokenEvent:
    """One generated token: ``id``, the text it completes (a detokenization delta; may be ``""``),
    its ``logprob`` (None unless asked for), whether it is a ``special`` token (EOS), and ``top``:
    the most likely ``(token id, logprob)`` pairs at its position (empty unless asked for)."""

    id: int
    text: str
    logprob: float | None
    special: bool = False
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class Answer:
    """A finished answer.

    Attributes:
        text: the answer text (the concatenation of the events' texts).
        finish_reason: ``stop`` (EOS or a stop sequence), ``length`` (max_new_tokens reached) or
            ``abort`` (its session closed while it ran: the text is what it said until then).
        prompt_tokens: tokens of the templated conversation (system, image, history, question).
        cached_tokens: of those, how many came from the session's KV cache (not prefilled).
        generated_tokens: tokens generated (EOS included when it ended the answer).
        tokens: the token events.
        timings: ms — ``restore`` (re-encode/features work for a demoted session), ``prefill``,
            ``ttft`` (request start → first token), ``total``; and ``decode_tokens_per_s``.
        seed: the sampler's seed (None for greedy).
        restored_from: the tier the session was restored from, or None when it was a KV hit.
        max_new_tokens: the limit the answer ran under (possibly clipped to the room left).
        truncated_turns: oldest remembered turns that left the context (and the history) for it.
    """

    text: str
    finish_reason: FinishReason
    prompt_tokens: int
    cached_tokens: int
    generated_tokens: int
    tokens: list[TokenEvent]
    timings: dict[str, float]
    seed: int | None = None
    restored_from: RestoredFrom | None = None
    max_new_tokens: int = 0
    truncated_turns: int = 0


@dataclass(frozen=True)
class OpenResult:
    """A session opened: ``expires_at`` in epoch s; ``image_tokens`` placeholders of the image (they
    depend on its size for anyres models); ``prefix_tokens`` prefilled; ``timings`` in ms: ``encode``
    (vision tower + projector), ``prefill``, ``total``, and ``decode`` when the engine decoded the image."""

    session_id: str
    expires_at: int
    image_tokens: int
    prefix_tokens: int
    timings: dict[str, float]


@dataclass(frozen=True)
class AddImageResult:
    """An image added: ``image_tokens`` placeholders of the new image; ``images`` the session holds
    now; ``prefix_tokens`` of the conversation up to the next question; ``cached_tokens`` of those
    reused from the KV cache (not prefilled); ``timings`` in ms: ``encode`` (vision tower +
    projector), ``prefill``, ``total``, and ``decode`` when the engine decoded the image."""

    session_id: str
    image_tokens: int
    images: int
    prefix_tokens: int
    cached_tokens: int
    timings: dict[str, float]
