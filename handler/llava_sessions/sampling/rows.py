"""Sampling a step's rows together on the device: temperature, top-k, top-p and min-p
over a ``[rows, vocab]`` block of logits at once, each row with its own values, then one draw per row by
the exponential race.

:func:`warp_rows` applies, row by row, what transformers' ``TemperatureLogitsWarper``,
``TopKLogitsWarper``, ``TopPLogitsWarper`` and ``MinPLogitsWarper`` apply to one row, in that order
(the order :class:`~.sampler.Sampler` chains them; transformers' ``generation/logits_process.py``), with
neutral values for what a row does not ask for (temperature 1, top-k 0, top-p 1, min-p 0).
:func:`race` draws each row's token as ``argmax(probs / q)`` with ``q`` exponential noise of the row's
own generator: a token is drawn with its probability (the exponential race, as vLLM's sampler draws),
and a seeded row draws the same tokens whether it is sampled alone or beside others, since its noise
comes from its generator alone. So a step's sampled rows cost one host read together with its greedy
rows, not one read each.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["race", "sample_rows", "warp_rows"]


def warp_rows(
    logits: torch.Tensor,
    temperature: Sequence[float],
    top_k: Sequence[int],
    top_p: Sequence[float],
    min_p: Sequence[float],
) -> torch.Tensor:
    """The rows' scores after temperature, top-k, top-p and min-p, ``-inf`` where a token is cut. A
    warp no row asks for is skipped; the values go to the logits' device without waiting.

    Args:
        logits: ``[R, V]`` float32, each row one answer's next-token logits.
        temperature: ``R`` divisors (> 0; 1: off).
        top_k: ``R`` counts of tokens kept (0: off).
        top_p: ``R`` nucleus masses (1: off).
        min_p: ``R`` least probabilities as a share of the most likely token's (0: off).

    Returns:
        ``[R, V]`` float32 (``logits`` itself when no row asks for any warp).
    """
    vocab, device = logits.shape[-1], logits.device

    def column(values: Sequence[float], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True).unsqueeze(1)

    scores = logits / column(temperature) if any(t != 1.0 for t in temperature) else logits
    kept = [min(k, vocab) if k > 0 else vocab for k in top_k]
    if any(k < vocab for k in kept):
        largest, order = scores.topk(max(k for k in kept if k < vocab))  # [R, K], descending
        kth = largest.gather(1, column([min(k, largest.shape[1]) - 1 for k in kept], torch.long))
        cut_below = torch.where(column([k < vocab for k in kept], torch.bool), kth, float("-inf"))
        scores = scores.masked_fill(scores < cut_below, float("-inf"))
        if all(p >= 1.0 or k < vocab for p, k in zip(top_p, kept, strict=True)):
            # every row that asks for top-p kept at most K tokens: the nucleus is found among them
            beyond = torch.arange(largest.shape[1], device=device)[None, :] >= column(kept, torch.long)
            candidates = largest.masked_fill(beyond, float("-inf")).flip(-1)
            return _min_p(_top_p(scores, candidates, order.flip(-1), top_p, column), min_p, column)
    if any(p < 1.0 for p in top_p):
        scores = _top_p(scores, *scores.sort(dim=-1), top_p, column)
    return _min_p(scores, min_p, column)


def _top_p(
    scores: torch.Tensor, ascending: torch.Tensor, ids: torch.Tensor, top_p: Sequence[float], column: Any
) -> torch.Tensor:
    """``scores [R, V]`` with the least likely tokens cut whose cumulative probability stays within
    ``1 - top_p`` (the most likely kept; transformers' ``TopPLogitsWarper``), from the rows' candidate
    scores ``ascending [R, C]``, least likely first, and their token ids ``ids [R, C]`` (every token
    outside them already ``-inf``: all ``V`` of them, or a top-k's)."""
    if not any(p < 1.0 for p in top_p):
        return scores
    cut = ascending.softmax(dim=-1).cumsum(dim=-1) <= 1 - column(top_p)
    cut[:, -1] = False
    removed = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, ids, cut)
    return scores.masked_fill(removed, float("-inf"))


def _min_p(scores: torch.Tensor, min_p: Sequence[float], column: Any) -> torch.Tensor:
    """``scores [R, V]`` with the tokens cut whose probability is under ``min_p`` x the most likely's."""
    if not any(min_p):
        return scores
    probs = scores.softmax(dim=-1)
    return scores.masked_fill(probs < column(min_p) * probs.amax(dim=-1, keepdim=True), float("-inf"))


def race(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Each row's token drawn with its probability: ``argmax(probs / noise)`` over the last dimension,
    ``probs`` and ``noise`` of one shape ``[..., V]`` (``noise`` Exp(1) draws). Returns ``[...]`` int64."""
    return (probs / noise).argmax(dim=-1)


def sample_rows(
    logits: torch.Tensor,
    temperature: Sequence[float],
    top_k: Sequence[int],
    top_p: Sequence[float],
    min_p: Sequence[float],
    noise: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw each row's next token from ``logits [R, V]`` warped by :func:`warp_rows` (its arguments),
    by :func:`race` with ``noise [R, V]`` (each row's Exp(1) draws from its own generator).

    Returns:
        ``(tokens [R] int64, warped [R, V])`` on the logits' device (not read to the host here): the
        drawn ids, and the warped scores they were drawn from (a token's logprob is theirs).
    """
    warped = warp_rows(logits, temperature, top_k, top_p, min_p)
    return race(warped.softmax(dim=-1), noise), warped
