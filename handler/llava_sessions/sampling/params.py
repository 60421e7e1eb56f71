"""Sampling parameters and their ranges: plain data, no torch (the dialects build them, the sampler reads them).

:data:`SAMPLING_BOUNDS` is the one statement of the numeric ranges: the wire models
(``llava_sessions.native.protocol``) take their pydantic constraints from it and :class:`SamplingParams`
checks it, so a value refused on the wire is refused in the engine with the same words.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from ..errors import ErrorCode, ServiceError

__all__ = ["SAMPLING_BOUNDS", "UNTIL_CONTEXT_END", "SamplingBound", "SamplingParams"]

_MAX_SEED = 2**63 - 1
#: ``max_new_tokens`` of an answer the request gave no limit (vLLM's and OpenAI's: until the context
#: ends); admission lowers it to the room the context leaves (``clip_max_new_tokens``).
UNTIL_CONTEXT_END = 2**31 - 1


@dataclass(frozen=True)
class SamplingBound:
    """The allowed range of one numeric sampling parameter and what to say when a value is outside it.

    The one statement of the sampling rules: the wire model (:class:`GenerateParameters`) takes its
    pydantic constraints from it and :class:`~llava_sessions.sampling.sampler.SamplingParams` checks it.
    """

    message: str
    ge: float | None = None
    gt: float | None = None
    le: float | None = None

    def allows(self, value: float) -> bool:
        """True when ``value`` is inside the range."""
        return (
            (self.ge is None or value >= self.ge)
            and (self.gt is None or value > self.gt)
            and (self.le is None or value <= self.le)
        )

    def field(self) -> Any:
        """The pydantic ``Field`` with these constraints (for the wire models)."""
        from pydantic import Field

        return Field(ge=self.ge, gt=self.gt, le=self.le)


#: Ranges of the numeric sampling parameters, by parameter name.
SAMPLING_BOUNDS: dict[str, SamplingBound] = {
    "max_new_tokens": SamplingBound("must be an integer >= 1", ge=1),
    "temperature": SamplingBound("must be a number >= 0", ge=0.0),
    "top_p": SamplingBound("must be > 0 and <= 1", gt=0.0, le=1.0),
    "top_k": SamplingBound("must be an integer >= 0 (0 = off)", ge=0),
    "repetition_penalty": SamplingBound("must be a number > 0", gt=0.0),
    "seed": SamplingBound(f"must be an integer between 0 and {_MAX_SEED}", ge=0, le=_MAX_SEED),
    "frequency_penalty": SamplingBound("must be a number between -2 and 2", ge=-2.0, le=2.0),
    "presence_penalty": SamplingBound("must be a number between -2 and 2", ge=-2.0, le=2.0),
    "top_logprobs": SamplingBound("must be an integer between 0 and 20", ge=0, le=20),
    "min_p": SamplingBound("must be a number between 0 and 1", ge=0.0, le=1.0),
    "min_tokens": SamplingBound("must be an integer >= 0", ge=0),
    "n": SamplingBound("must be an integer >= 1", ge=1),
    "session_choice": SamplingBound("must be an integer >= 0, below n", ge=0),
}


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one answer.

    Sampling is on when ``do_sample`` is true, or (as in TGI) when ``temperature`` (> 0 and != 1),
    ``top_p`` (< 1) or ``top_k`` (> 0) is set; ``temperature == 0`` always means greedy.

    Attributes:
        max_new_tokens: most tokens to generate (tokens).
        temperature: logits divisor (> 0) or 0 for greedy.
        top_p: nucleus mass, 0 < top_p <= 1 (1 = off).
        top_k: keep the k most likely tokens (0 = off).
        repetition_penalty: CTRL penalty (> 0; 1 = off), over prompt and answer tokens.
        do_sample: force sampling.
        seed: seed of the sampler's generator; None draws one (returned in the details).
        stop: stop sequences; the answer ends once its text contains one (kept in the text, as TGI does).
        logprobs: compute each token's log-probability under the (processed) distribution.
        frequency_penalty / presence_penalty: OpenAI's penalties (-2..2; 0 or None = off): a token's
            logit is lowered by ``count * frequency_penalty + (count > 0) * presence_penalty``, where
            ``count`` is how often it was generated so far in this answer (the formula of OpenAI's
            API reference, "Frequency and presence penalties"; vLLM applies it the same way).
        top_logprobs: with ``logprobs``, also give this many most likely tokens at each position.
        min_p: drop tokens whose probability is under ``min_p`` x the most likely one's (0 or None =
            off; transformers' ``MinPLogitsWarper``, vLLM's ``min_p``); sampling only.
        min_tokens: the answer's end-of-sequence and ``stop_token_ids`` tokens are masked until this
            many tokens are generated (vLLM's ``min_tokens``).
        ignore_eos: an end-of-sequence token does not end the answer (vLLM's ``ignore_eos``).
        stop_token_ids: token ids that end the answer (``stop``) besides end-of-sequence (vLLM's).
        logit_bias: ``(token id, bias)`` pairs added to the logits before anything else (OpenAI's
            ``logit_bias``, -100..100: -100 bans a token, 100 all but forces it). An id outside the
            model's vocabulary (here or in ``stop_token_ids``) has no effect.
        skip_special_tokens: the answer's text leaves special tokens out (True, vLLM's default);
            False writes them (vLLM's ``skip_special_tokens``).
        grammar: structured output: the answer must match this llguidance grammar (its JSON text,
            :mod:`.grammar`; a JSON schema, any JSON object, a regex or a choice); None: free text.
        n: answers sampled from the one prompt (OpenAI's and vLLM's ``n``; :meth:`for_sample`).
        session_choice: the answer (0 to ``n - 1``) that becomes the session's turn; the others are
            not remembered.
    """

    max_new_tokens: int = 256
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None
    do_sample: bool = False
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    logprobs: bool = False
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    top_logprobs: int = 0
    min_p: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    logit_bias: tuple[tuple[int, float], ...] = ()
    skip_special_tokens: bool = True
    grammar: str | None = None
    n: int = 1
    session_choice: int = 0

    def __post_init__(self) -> None:
        """Check the ranges of :data:`SAMPLING_BOUNDS` (the wire's rules).

        Raises:
            ServiceError: invalid_parameter, naming the parameter and its range.
        """
        for name, bound in SAMPLING_BOUNDS.items():
            value = getattr(self, name)
            if value is not None and not bound.allows(value):
                raise ServiceError(ErrorCode.INVALID_PARAMETER, f"{name} {bound.message}")
        if self.session_choice >= self.n:
            raise ServiceError(ErrorCode.INVALID_PARAMETER, "session_choice must be below n", param="session_choice")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ServiceError(ErrorCode.INVALID_PARAMETER, "stop sequences must be non-empty strings")

    @property
    def sampling(self) -> bool:
        """True when tokens are sampled rather than picked greedily."""
        if self.temperature == 0:
            return False
        return bool(
            self.do_sample
            or (self.temperature is not None and self.temperature != 1.0)
            or (self.top_p is not None and self.top_p < 1.0)
            or (self.top_k is not None and self.top_k > 0)
        )

    def for_sample(self, index: int) -> SamplingParams:
        """The parameters of answer ``index`` of :attr:`n`: a given ``seed`` becomes ``seed + index``
        (wrapping at the largest seed), so each answer is reproducible on its own: answer ``i`` of a
        request with seed ``s`` is the answer of the same request with ``n`` = 1 and seed ``s + i``."""
        seed = None if self.seed is None else (self.seed + index) % (_MAX_SEED + 1)
        return replace(self, seed=seed, n=1, session_choice=0)
