"""Next-token selection and incremental detokenization (the parameters: :mod:`.params`).

The logits processors are transformers' own (the ones ``model.generate`` uses), so greedy and
seeded sampling follow the library's semantics exactly.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, cast

import torch

from .params import SamplingParams
from .rows import race

if TYPE_CHECKING:
    from .grammar import GrammarMatcher

__all__ = ["IncrementalDetokenizer", "Sampler", "SamplingParams"]


class Sampler:
    """Pick next tokens for one answer: a structured output's grammar mask, logit bias, ``min_tokens``'
    mask, OpenAI's penalties, repetition penalty, then greedy or temperature/top-k/top-p/min-p sampling.

    Args:
        params: the answer's parameters.
        device: where logits live (the generator is created there).
        prompt_ids: the prompt's token ids (the repetition penalty covers them, as in ``generate``).
        eos_token_ids: the model's end-of-sequence ids (masked with ``stop_token_ids`` while fewer than
            ``params.min_tokens`` tokens are generated).
        grammar: structured output (``params.grammar``'s matcher): only the tokens it allows are
            candidates, before anything else; None: free.
    """

    def __init__(
        self,
        params: SamplingParams,
        device: torch.device,
        prompt_ids: list[int],
        eos_token_ids: frozenset[int] = frozenset(),
        grammar: GrammarMatcher | None = None,
    ) -> None:
        from transformers.generation.logits_process import (
            LogitsProcessorList,
            MinPLogitsWarper,
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
        if params.sampling:  # the warps :attr:`warping` gives, the ones the rows sampled together apply
            temperature, top_k, top_p, min_p = self.warping
            if temperature != 1.0:
                procs.append(TemperatureLogitsWarper(temperature))
            if top_k:
                procs.append(TopKLogitsWarper(top_k))
            if top_p < 1.0:
                procs.append(TopPLogitsWarper(top_p))
            if min_p:
                procs.append(MinPLogitsWarper(min_p))
            self.seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(4), "little")
            self._generator = torch.Generator(device=device).manual_seed(self.seed)
        self._procs = procs
        self._freq = params.frequency_penalty or 0.0
        self._presence = params.presence_penalty or 0.0
        self._counts: torch.Tensor | None = None  # [vocab] float32: times each token was generated
        self._bias = params.logit_bias
        self._ends = sorted(set(eos_token_ids) | set(params.stop_token_ids)) if params.min_tokens else []
        self._generated = 0
        self.grammar = grammar

    @property
    def plain(self) -> bool:
        """Nothing but greedy or the warpers decides the next token, and nothing but its own logprob is
        asked of it: no penalty, logit bias, active ``min_tokens`` mask, grammar or top logprobs. Such a
        token is chosen on the device with the step's other plain rows (:attr:`plain_greedy` or
        :attr:`plain_sampled`)."""
        masking = bool(self._ends) and self._generated < self.params.min_tokens
        return not (
            self._penalty
            or self._bias
            or masking
            or self.grammar is not None
            or self._freq
            or self._presence
            or (self.params.logprobs and self.params.top_logprobs)
        )

    @property
    def plain_greedy(self) -> bool:
        """Whether the next token is the argmax of the raw logits and nothing else is computed for it
        but its logprob: greedy, no penalty, logit bias, active ``min_tokens`` mask, grammar or top
        logprobs. Such rows of a step take their tokens (and logprobs) from one argmax (and one
        ``log_softmax``) over the whole batch (:meth:`took` records each)."""
        return self._generator is None and self.plain

    @property
    def plain_sampled(self) -> bool:
        """Whether the next token is sampled with temperature, top-k, top-p and min-p alone (no
        penalty, logit bias, active ``min_tokens`` mask, grammar or top logprobs). Such rows of a step are
        sampled together (:func:`~.rows.sample_rows` over :attr:`warping` and :meth:`noise`; :meth:`took`
        records each), drawing what :meth:`next_token` would."""
        return self._generator is not None and self.plain

    @property
    def warping(self) -> tuple[float, int, float, float]:
        """``(temperature, top_k, top_p, min_p)`` of a sampled answer, each neutral where it is off
        (1.0, 0, 1.0, 0.0): :func:`~.rows.warp_rows`' values for its row."""
        p = self.params
        temperature = p.temperature if p.temperature not in (None, 0) else 1.0
        return (
            float(temperature),
            int(p.top_k or 0),
            float(p.top_p if p.top_p is not None else 1.0),
            float(p.min_p or 0.0),
        )

    def noise(self, vocab: int) -> torch.Tensor:
        """This answer's next ``[vocab]`` float32 Exp(1) draws from its generator, on its device (what
        :func:`~.rows.race` divides the probabilities by). Raises ValueError for a greedy answer."""
        if self._generator is None:
            raise ValueError("a greedy answer has no generator")
        return torch.empty(vocab, dtype=torch.float32, device=self.device).exponential_(generator=self._generator)

    def took(self, token_id: int) -> None:
        """Record ``token_id``, chosen outside :meth:`next_token` while :attr:`plain_greedy` (the argmax
        of this answer's row of a step's logits): the answer has one more generated token."""
        self._generated += 1

    def _shape(self, scores: torch.Tensor) -> torch.Tensor:
        """The grammar's mask, logit bias and ``min_tokens``' mask on ``scores [1, vocab]`` (a new
        tensor when changed; token ids outside the vocabulary change nothing). ``min_tokens`` yields
        to the grammar: where the grammar allows only an end, the answer ends."""
        masking = bool(self._ends) and self._generated < self.params.min_tokens
        if not self._bias and not masking and self.grammar is None:
            return scores
        scores = scores.clone()
        vocab = scores.shape[-1]
        if self.grammar is not None:
            allowed = self.grammar.allowed(scores.device)
            scores[0, : allowed.shape[0]].masked_fill_(~allowed, float("-inf"))
            scores[0, allowed.shape[0] :] = float("-inf")
        for token, bias in self._bias:
            if token < vocab:
                scores[0, token] += bias
        if masking:
            ends = [t for t in self._ends if t < vocab]
            allowed = torch.isfinite(scores[0])
            if self.grammar is None or bool(allowed.sum() > allowed[ends].sum()):  # something besides an end
                scores[0, ends] = float("-inf")
        return scores

    def _penalize(self, scores: torch.Tensor) -> torch.Tensor:
        """OpenAI's frequency and presence penalties on ``scores [1, vocab]`` (a new tensor)."""
        if self._counts is None:
            return scores
        counts = self._counts
        return scores - (counts * self._freq + (counts > 0).to(scores.dtype) * self._presence).unsqueeze(0)

    def next_token(self, logits: torch.Tensor) -> tuple[int, float | None, tuple[tuple[int, float], ...]]:
        """Choose the next token from ``logits [vocab]`` (float32).

        Returns:
            ``(token_id, logprob, top)``; logprob is the log-probability under the processed
            distribution when ``params.logprobs``, else None; ``top``: the ``params.top_logprobs``
            most likely ``(token_id, logprob)`` pairs, most likely first (empty unless asked for).
        """
        scores = self._penalize(self._shape(logits.unsqueeze(0)))
        if len(self._procs):
            ids = self._ids if self._ids is not None else torch.empty(1, 0, dtype=torch.long, device=self.device)
            scores = self._procs(cast(torch.LongTensor, ids), scores)
        if self._generator is not None:  # the exponential race, as the step's rows sampled together draw
            token = int(race(torch.softmax(scores[0], dim=-1), self.noise(scores.shape[-1])))
        else:
            token = int(scores[0].argmax())
        logprob: float | None = None
        top: tuple[tuple[int, float], ...] = ()
        if self.params.logprobs:
            logprobs = torch.log_softmax(scores[0], dim=-1)
            logprob = float(logprobs[token])
            if self.params.top_logprobs:
                values, ids = torch.topk(logprobs, min(self.params.top_logprobs, logprobs.shape[0]))
                top = tuple(zip(ids.tolist(), values.tolist(), strict=True))
        if self._ids is not None:
            self._ids = torch.cat([self._ids, torch.tensor([[token]], device=self.device)], dim=1)
        if self._freq or self._presence:
            if self._counts is None:
                self._counts = torch.zeros(logits.shape[-1], dtype=logits.dtype, device=logits.device)
            self._counts[token] += 1
        self._generated += 1
        if self.grammar is not None:
            self.grammar.consume(token)
        return token, logprob, top


class IncrementalDetokenizer:
    """Turn generated token ids into text deltas whose concatenation is the answer text.

    The two-window method of TGI and vLLM: decode ``ids[prefix:]`` and ``ids[prefix:read]`` and emit
    the difference once it no longer ends in an incomplete UTF-8 sequence (U+FFFD), so no multi-byte
    character is broken and tokenizers that strip a leading space (SentencePiece) lose no space.
    Special tokens (EOS) contribute no text unless ``skip_special_tokens`` is False.

    Args:
        tokenizer: a transformers tokenizer (``decode`` with ``skip_special_tokens``).
        skip_special_tokens: leave special tokens' text out (vLLM's default, and ``generate``'s
            usual decoding); False writes them (``</s>``) as vLLM's ``skip_special_tokens: false`` does.
    """

    def __init__(self, tokenizer: Any, *, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""
        self._prefix = 0
        self._read = 0

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip, clean_up_tokenization_spaces=False)

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
