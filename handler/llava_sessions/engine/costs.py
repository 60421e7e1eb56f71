"""What a forward pass costs, measured as the runner runs: the input the scheduler sizes a step by.

Sarathi-Serve sizes a step's prefill share from a latency target and the measured cost of a forward
pass (Agrawal et al., "Taming Throughput-Latency Tradeoff in LLM Inference with Sarathi-Serve", OSDI
2024). Here a prefill pass of ``n`` tokens is modelled as ``fixed + n * per_token`` ms, fitted by
exponentially weighted least squares over the passes the model runner times; the decode step and the
vision tower are exponentially weighted means of their own timings. Plain Python, no torch: the
scheduler's rules are tested on a :class:`StepCost` alone (tests/core/test_scheduler.py), the fit on
numbers (tests/core/test_scheduler.py as well).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

__all__ = ["CostModel", "StepCost"]


@dataclass(frozen=True)
class StepCost:
    """The cost of one step's forward passes, in ms.

    Attributes:
        prefill_fixed_ms: a prefill pass's cost whatever its length (launch, weights read, the
            sampling of its last position).
        prefill_token_ms: what each prompt token adds to a prefill pass.
        decode_ms: one batched decode step of the running answers (a step that carries a prefill
            chunk attributes what its tokens do not explain to this: the step's share to plan by).
        vision_ms: one image (or one video frame) through the vision tower and the projector.
        decode_alone_ms: a decode step with no chunk riding it: the running answers' own
            inter-token gap, the reference a step with image work is held to (scheduler rule 8).

    The defaults are the bench model's on a 2-core CPU, fp32 (docs/decisions/15-scheduler-on-torchserve-continuous-batching.md); the model runner replaces
    them with its own measurements after its first passes.
    """

    prefill_fixed_ms: float = 20.0
    prefill_token_ms: float = 1.0
    decode_ms: float = 35.0
    vision_ms: float = 50.0
    decode_alone_ms: float = 35.0

    def prefill_ms(self, num_tokens: int, *, fused: bool = False) -> float:
        """The estimated ms of one prefill pass of ``num_tokens`` tokens (``fused``: of a chunk that
        rides the decode step's pass, which pays the fixed cost: its tokens only)."""
        return (0.0 if fused else self.prefill_fixed_ms) + num_tokens * self.prefill_token_ms

    def tokens_within(self, ms: float, *, fused: bool = False) -> int:
        """The most tokens one prefill pass (``fused``: a chunk riding the decode step) runs within
        ``ms`` (0 when not even its fixed cost fits)."""
        fixed = 0.0 if fused else self.prefill_fixed_ms
        if ms <= fixed:
            return 0
        return int((ms - fixed) / max(self.prefill_token_ms, 1e-6))


class CostModel:
    """Running estimates of :class:`StepCost` from timed passes.

    Args:
        prior: the estimate before any pass of a kind is timed.
        decay: each new timing multiplies the weight of the older ones by this (0.9: about the last
            ten passes count).

    The prefill line is refitted after every pass when the recent passes' lengths spread enough to
    tell the fixed cost from the per-token one (a standard deviation of at least a fifth of their
    mean); otherwise the last fixed cost so fitted (the prior's at first, at most half the recent
    mean) is kept and the rest of the recent mean is attributed to the tokens.
    """

    def __init__(self, prior: StepCost = StepCost(), decay: float = 0.9) -> None:
        self.decay = decay
        self._cost = prior
        self._fixed = prior.prefill_fixed_ms
        self._sums = [0.0] * 5  # weights, n, n^2, ms, n*ms

    def estimate(self) -> StepCost:
        """The current estimate."""
        return self._cost

    def prefill(self, num_tokens: int, ms: float) -> None:
        """Record a prefill pass of ``num_tokens`` tokens that took ``ms``."""
        if num_tokens <= 0 or not math.isfinite(ms) or ms < 0:
            return
        d = self.decay
        values = (1.0, float(num_tokens), float(num_tokens) ** 2, ms, num_tokens * ms)
        self._sums = [s * d + v for s, v in zip(self._sums, values, strict=True)]
        w, sn, snn, sm, snm = self._sums
        mean_n, mean_ms = sn / w, sm / w
        var_n = snn / w - mean_n**2
        if var_n >= max(1.0, (0.2 * mean_n) ** 2):
            slope = (snm / w - mean_n * mean_ms) / var_n
            if slope > 0 and mean_ms - slope * mean_n >= 0:
                self._fixed = mean_ms - slope * mean_n
        fixed = min(self._fixed, 0.5 * mean_ms)
        self._set(prefill_fixed_ms=fixed, prefill_token_ms=max((mean_ms - fixed) / mean_n, 1e-4))

    def decode(self, ms: float) -> None:
        """Record a batched decode step that took ``ms``."""
        if math.isfinite(ms) and ms >= 0:
            cost = self._cost
            self._set(decode_ms=self._mean(cost.decode_ms, ms), decode_alone_ms=self._mean(cost.decode_alone_ms, ms))

    def fused(self, num_tokens: int, ms: float) -> None:
        """Record a decode step that carried a prefill chunk of ``num_tokens`` tokens in ``ms``: the
        chunk's tokens at the current per-token cost, the rest is the decode step's share
        (``decode_ms``; ``decode_alone_ms`` is left as it was)."""
        if math.isfinite(ms) and ms >= 0:
            share = max(0.0, ms - num_tokens * self._cost.prefill_token_ms)
            self._set(decode_ms=self._mean(self._cost.decode_ms, share))

    def vision(self, num_images: int, ms: float) -> None:
        """Record ``num_images`` images through the vision tower in ``ms``."""
        if num_images > 0 and math.isfinite(ms) and ms >= 0:
            self._set(vision_ms=self._mean(self._cost.vision_ms, ms / num_images))

    def _mean(self, old: float, new: float) -> float:
        return old * self.decay + new * (1.0 - self.decay)

    def _set(self, **changes: float) -> None:
        self._cost = dataclasses.replace(self._cost, **changes)
