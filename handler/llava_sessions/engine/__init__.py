"""The session engine, in a serving engine's shape (nano-vllm's ``engine/``, vLLM v1's core).

================= ==============================================================================
module            owns
================= ==============================================================================
``scheduler``     ``schedule()`` → ``StepPlan``: what one step runs (plain data, no torch)
``costs``         ``CostModel``: what each kind of forward pass costs, measured (the scheduler's input)
``sequence``      ``Sequence`` (an answer), ``ImagePrefill`` (an image): requests in flight, as state
``admission``     checks a request and makes its sequences or image prefill (one path for an image)
``model_runner``  ``ModelRunner``: executes a plan's forward passes (vision, prefill, batched decode)
``runners``       ``StepRunners``: the one place a pass is chosen (the static step, the static prefill, eager)
``paged_batch``   ``PagedDecodeBatch``: the running answers' decode step over their sessions' KV pages
``executor``      ``StepExecutor``: carries out a plan (chunks, the decode step, its room and preemptions)
``inputs``        ``StepInputs``: before a chunk (an answer's start: restore, crop; an image's tower)
``outputs``       ``StepOutputs``: after a pass (sample, append, finish) and rollback on failure
``ahead``         ``StepAhead``: async scheduling, the next decode step launched before this one's tokens are read
``memory``        the default device budget, one retry after an out-of-memory error
``engine``        ``SessionEngine``: the public API; ``step`` = schedule → execute → update
================= ==============================================================================

Imports point down: ``engine`` → ``admission`` / ``executor`` → ``ahead`` → ``inputs`` / ``outputs`` →
``model_runner`` → ``paged_batch`` → ``runners`` / ``memory``; ``sequence`` → ``scheduler`` → ``costs``; none of them imports ``engine`` at run time.
"""

from __future__ import annotations

from .costs import CostModel, StepCost
from .engine import EngineLimits, SessionEngine
from .memory import available_host_bytes, default_device_budget
from .scheduler import MIN_PREFILL_TOKENS, StepPlan, TimeBudget, schedule
from .sequence import ImagePrefill, Sequence

__all__ = [
    "MIN_PREFILL_TOKENS",
    "CostModel",
    "EngineLimits",
    "Sequence",
    "ImagePrefill",
    "SessionEngine",
    "StepCost",
    "StepPlan",
    "TimeBudget",
    "available_host_bytes",
    "default_device_budget",
    "schedule",
]
