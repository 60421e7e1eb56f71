"""Plain data returned by the client: answers, usage, tokens, generation parameters, recoveries."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypedDict

__all__ = ["AddedImage", "Answer", "GenerationParams", "Recovery", "Token", "Usage"]


@dataclass(frozen=True)
class Token:
    """One generated token: vocabulary ``id``, its text delta and natural-log probability (or None)."""

    id: int
    text: str
    logprob: float | None = None


@dataclass(frozen=True)
class Usage:
    """Token accounting of one answer.

    Attributes:
        prompt_tokens: tokens of the templated conversation the answer was generated from.
        cached_tokens: of those, how many the server reused from the session's KV cache.
        generated_tokens: tokens generated (the end-of-sequence token included when it ended the answer).
    """

    prompt_tokens: int
    cached_tokens: int
    generated_tokens: int


@dataclass(frozen=True)
class Answer:
    """A finished answer.

    Attributes:
        text: the answer text.
        finish_reason: ``"stop"`` (end of sequence or a stop string) or ``"length"`` (``max_new_tokens``).
        usage: token counts (:class:`Usage`).
        timings: the server's measurements: ``ttft_ms``, ``prefill_ms``, ``restore_ms``, ``total_ms``
            (milliseconds) and ``decode_tokens_per_s``.
        tokens: per-token list (streams always; ``ask`` with ``details=True``), else None.
        client_ttft_ms: milliseconds from the call until the first token reached this client (a
            non-streamed answer arrives whole, so there it equals ``client_total_ms``).
        client_total_ms: milliseconds from the call until the answer was complete here.
        max_new_tokens: the limit the server generated under (the request's, its default, or that
            default clipped to the room left in the context), or None if it did not say.
        truncated_turns: how many of the oldest remembered turns left the context (and the
            session's history) so that this turn fits; 0 when none did.
        seed: the sampler's seed (given or drawn; pass it back to repeat a sampled answer), or
            None for greedy answers.
        choices: with ``n`` > 1, every answer by index (this one, the session's, among them); else empty.
    """

    text: str
    finish_reason: str
    usage: Usage
    timings: Mapping[str, float] = field(default_factory=dict)
    tokens: tuple[Token, ...] | None = None
    client_ttft_ms: float | None = None
    client_total_ms: float | None = None
    max_new_tokens: int | None = None
    truncated_turns: int = 0
    seed: int | None = None
    choices: tuple[Answer, ...] = ()

    @property
    def ttft_ms(self) -> float | None:
        """The server's time to first token in milliseconds (``timings["ttft_ms"]``), or None."""
        value = self.timings.get("ttft_ms")
        return float(value) if value is not None else None

    def __str__(self) -> str:
        return self.text

    @classmethod
    def from_wire(
        cls,
        generated_text: str,
        details: Mapping[str, Any] | None,
        *,
        tokens: list[Token] | None = None,
        client_ttft_ms: float | None = None,
        client_total_ms: float | None = None,
        choices: tuple[Answer, ...] = (),
    ) -> Answer:
        """Build from a reply's ``generated_text`` and ``details`` (streamed ``tokens`` win over details')."""
        details = details or {}
        if tokens is None and details.get("tokens") is not None:
            tokens = [Token(int(t["id"]), str(t["text"]), t.get("logprob")) for t in details["tokens"]]
        return cls(
            text=generated_text,
            finish_reason=str(details.get("finish_reason", "stop")),
            usage=Usage(
                int(details.get("prompt_tokens", 0)),
                int(details.get("cached_tokens", 0)),
                int(details.get("generated_tokens", 0)),
            ),
            timings=dict(details.get("timings") or {}),
            tokens=tuple(tokens) if tokens is not None else None,
            client_ttft_ms=client_ttft_ms,
            client_total_ms=client_total_ms,
            max_new_tokens=_int_or_none(details.get("max_new_tokens")),
            truncated_turns=int(details.get("truncated_turns") or 0),
            seed=_int_or_none(details.get("seed")),
            choices=choices,
        )


def warnings_of(data: Mapping[str, Any]) -> tuple[str, ...]:
    """A reply's (or a chunk's) ``warnings``: what the server did otherwise than asked, in its words
    (a video with fewer frames than asked); empty when it says nothing."""
    return tuple(str(w) for w in data.get("warnings") or ())


def _int_or_none(value: Any) -> int | None:
    return int(value) if value is not None else None


class Sampling(TypedDict, total=False):
    """The sampling keywords of :meth:`Session.ask <llava_client.Session.ask>` and
    :meth:`Session.stream <llava_client.Session.stream>` (the fields of :class:`GenerationParams`;
    None or absent: the server's default; greedy unless sampling is asked for).

    Keys:
        max_new_tokens, temperature, top_p, top_k, repetition_penalty, do_sample, seed, stop: as TGI's
            parameters (``stop``: a string or several).
        details: include the per-token list (``answer.tokens``) with log-probabilities.
        n: answers to sample from the one prompt (prefilled once; answer ``i`` uses ``seed + i``); the
            answer returned is the session's turn, ``answer.choices`` holds all ``n`` (``ask`` only).
        session_choice: which answer (0 to ``n - 1``; default 0) becomes the session's turn.
    """

    max_new_tokens: int | None
    temperature: float | None
    top_p: float | None
    top_k: int | None
    repetition_penalty: float | None
    do_sample: bool | None
    seed: int | None
    stop: str | Sequence[str] | None
    details: bool | None
    n: int | None
    session_choice: int | None


@dataclass(frozen=True)
class GenerationParams:
    """Sampling parameters of one answer; None means the server's default.

    Greedy unless ``do_sample`` is true or (as in TGI) ``temperature`` (> 0, != 1), ``top_p`` (< 1)
    or ``top_k`` (> 0) is set; ``temperature=0`` is always greedy (same rule as the server).
    """

    max_new_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None
    do_sample: bool | None = None
    seed: int | None = None
    stop: tuple[str, ...] | None = None
    details: bool | None = None
    n: int | None = None
    session_choice: int | None = None

    @classmethod
    def of(cls, sampling: Sampling) -> GenerationParams:
        """The parameters of :class:`Sampling` keywords (a ``stop`` string becomes a one-item tuple)."""
        stop = sampling.get("stop")
        fields = {k: v for k, v in sampling.items() if k != "stop"}
        return cls(**fields, stop=((stop,) if isinstance(stop, str) else tuple(stop)) if stop else None)  # type: ignore[arg-type]

    def to_wire(self) -> dict[str, Any]:
        """The ``parameters`` object of a generate request (unset fields left out)."""
        out: dict[str, Any] = {}
        for name in (
            "max_new_tokens",
            "temperature",
            "top_p",
            "top_k",
            "repetition_penalty",
            "do_sample",
            "seed",
            "details",
            "n",
            "session_choice",
        ):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        if self.stop:
            out["stop"] = list(self.stop)
        return out


@dataclass(frozen=True)
class AddedImage:
    """What the server reported for :meth:`Session.add_image <llava_client.Session.add_image>`.

    Attributes:
        image_tokens: context positions the new image occupies (by its size for anyres models).
        images: images the session holds now (the first one included).
        prefix_tokens: tokens of the conversation up to the next question (now cached on the server).
        cached_tokens: of those, how many were reused from the server's KV cache.
        timings: the server's timings in milliseconds (``encode_ms``, ``prefill_ms``, ``total_ms``, ...).
        downsized: what the client did to fit an inline image in the request limit
            (:class:`~llava_client._images.Downsized`), or None when it was sent as given.
        warnings: what the server did otherwise than asked, in its words (a video with fewer frames
            than asked); empty when nothing.
    """

    image_tokens: int
    images: int
    prefix_tokens: int
    cached_tokens: int
    timings: dict[str, float]
    downsized: Any = None
    warnings: tuple[str, ...] = ()


@dataclass(frozen=True)
class Recovery:
    """What one automatic recovery did.

    Attributes:
        reason: the error code that triggered it (``session_not_found``, ``session_expired``, ...).
        old_session_id: the id the server no longer knew.
        new_session_id: the id of the reopened session.
        replayed_turns: remembered turns handed to the reopened session (``open_session`` history),
            restored exactly: the server remembers their texts and prefills them with the image.
    """

    reason: str
    old_session_id: str
    new_session_id: str
    replayed_turns: int
