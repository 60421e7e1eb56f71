"""Sampling a step's rows together on the device (issue 59 item 2): temperature, top-k, top-p and min-p
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
    if any(top_k):
        kept = [min(k, vocab) if k > 0 else vocab for k in top_k]
        largest = scores.topk(max(k for k in kept if k < vocab) if any(k < vocab for k in kept) else 1).values
        kth = largest.gather(1, column([min(k, largest.shape[1]) - 1 for k in kept], torch.long))
        cut_below = torch.where(column([k < vocab for k in kept], torch.bool), kth, float("-inf"))
        scores = scores.masked_fill(scores < cut_below, float("-inf"))
    if any(p < 1.0 for p in top_p):  # cut the least likely tokens within 1 - top_p of the mass, keep one
        ascending, order = scores.sort(dim=-1)
        cut = ascending.softmax(dim=-1).cumsum(dim=-1) <= 1 - column(top_p)
        cut[:, -1] = False
        scores = scores.masked_fill(cut.scatter(1, order, cut), float("-inf"))
    if any(min_p):
        probs = scores.softmax(dim=-1)
        scores = scores.masked_fill(probs < column(min_p) * probs.amax(dim=-1, keepdim=True), float("-inf"))
    return scores


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
) -> torch.Tensor:
    """Draw each row's next token from ``logits [R, V]`` warped by :func:`warp_rows` (its arguments),
    by :func:`race` with ``noise [R, V]`` (each row's Exp(1) draws from its own generator). Returns
    ``[R]`` int64 token ids on the logits' device (not read to the host here)."""
    return race(warp_rows(logits, temperature, top_k, top_p, min_p).softmax(dim=-1), noise)
