"""Sampling parameters, next-token selection and incremental detokenization.

The logits processors are transformers' own (the ones ``model.generate`` uses), so greedy and
seeded sampling follow the library's semantics exactly.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from .errors import ErrorCode, ServiceError
from .protocol import SAMPLING_BOUNDS


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

    def __post_init__(self) -> None:
        """Check the ranges of :data:`~llava_sessions.protocol.SAMPLING_BOUNDS` (the wire's rules).

        Raises:
            ServiceError: invalid_parameter, naming the parameter and its range.
        """
        for name, bound in SAMPLING_BOUNDS.items():
            value = getattr(self, name)
            if value is not None and not bound.allows(value):
                raise ServiceError(ErrorCode.INVALID_PARAMETER, f"{name} {bound.message}")
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


class Sampler:
    """Pick next tokens for one answer: repetition penalty, then greedy or temperature/top-k/top-p sampling.

    Args:
        params: the answer's parameters.
        device: where logits live (the generator is created there).
        prompt_ids: the prompt's token ids (the repetition penalty covers them, as in ``generate``).
    """

    def __init__(self, params: SamplingParams, device: torch.device, prompt_ids: list[int]) -> None:
        from transformers.generation.logits_process import (
            LogitsProcessorList,
            RepetitionPenaltyLogitsProcessor,
            TemperatureLogitsWarper,
            TopKLogitsWarper,
            TopPLogitsWarper,
        )

        self.params = params
        self.device = device
        penalty = params.repetition_penalty
        self._penalty = penalty is not None and penalty != 1.0
        self._ids = torch.tensor([prompt_ids], device=device) if self._penalty else None
        procs = LogitsProcessorList()
        if penalty is not None and penalty != 1.0:
            procs.append(RepetitionPenaltyLogitsProcessor(penalty))
        self.seed: int | None = None
        self._generator: torch.Generator | None = None
        if params.sampling:
            if params.temperature not in (None, 1.0):
                procs.append(TemperatureLogitsWarper(params.temperature))
            if params.top_k:
                procs.append(TopKLogitsWarper(params.top_k))
            if params.top_p is not None and params.top_p < 1.0:
                procs.append(TopPLogitsWarper(params.top_p))
            self.seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(4), "little")
            self._generator = torch.Generator(device=device).manual_seed(self.seed)
        self._procs = procs

    def next_token(self, logits: torch.Tensor) -> tuple[int, float | None]:
        """Choose the next token from ``logits [vocab]`` (float32).

        Returns:
            ``(token_id, logprob)``; logprob is the log-probability under the processed
            distribution when ``params.logprobs``, else None.
        """
        scores = logits.unsqueeze(0)
        if len(self._procs):
            ids = self._ids if self._ids is not None else torch.empty(1, 0, dtype=torch.long, device=self.device)
            scores = self._procs(cast(torch.LongTensor, ids), scores)
        if self._generator is not None:
            probs = torch.softmax(scores, dim=-1)
            token = int(torch.multinomial(probs[0], 1, generator=self._generator))
        else:
            token = int(scores[0].argmax())
        logprob = float(torch.log_softmax(scores[0], dim=-1)[token]) if self.params.logprobs else None
        if self._ids is not None:
            self._ids = torch.cat([self._ids, torch.tensor([[token]], device=self.device)], dim=1)
        return token, logprob


class IncrementalDetokenizer:
    """Turn generated token ids into text deltas whose concatenation is the answer text.

    The two-window method of TGI and vLLM: decode ``ids[prefix:]`` and ``ids[prefix:read]`` and emit
    the difference once it no longer ends in an incomplete UTF-8 sequence (U+FFFD), so no multi-byte
    character is broken and tokenizers that strip a leading space (SentencePiece) lose no space.
    Special tokens (EOS) contribute no text.

    Args:
        tokenizer: a transformers tokenizer (``decode`` with ``skip_special_tokens``).
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        self.ids: list[int] = []
        self.text = ""
        self._prefix = 0
        self._read = 0

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def push(self, token_id: int) -> str:
        """Add one token; return the new text it completes (possibly empty)."""
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self._prefix : self._read])
        new_text = self._decode(self.ids[self._prefix :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            delta = new_text[len(prefix_text) :]
            self._prefix, self._read = self._read, len(self.ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """Return the text still held back (an incomplete character at the end is emitted as U+FFFD)."""
        prefix_text = self._decode(self.ids[self._prefix : self._read])
        new_text = self._decode(self.ids[self._prefix :])
        delta = new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""
        self._prefix = self._read = len(self.ids)
        self.text += delta
        return delta
