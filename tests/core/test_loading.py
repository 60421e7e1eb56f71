"""Loading on a CPU device: the process's allocator keeps what a forward pass frees for the next one.

Each case runs in a fresh interpreter (glibc's thresholds are per process and set once).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

#: A pass's activations: ten 4 MiB tensors written, alive together, then freed; twenty passes. Prints
#: whether the thresholds were set and the minor page faults of the twenty passes.
PASSES = """
import resource, torch
from llava_sessions.model.loading import keep_freed_cpu_memory
applied = keep_freed_cpu_memory()
def passes(n):
    for _ in range(n):
        activations = [torch.ones(2**20) for _ in range(10)]
        del activations
passes(2)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
passes(20)
print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _run(script: str, *args: str, **env: str) -> list[str]:
    """``script`` in a fresh interpreter (no ``MALLOC_*`` variables but ``env``'s); its printed words."""
    run = subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={
            **{k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")},
            "PYTHONPATH": str(REPO / "handler"),
            **env,
        },
    )
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout.split()


def _passes(**env: str) -> tuple[bool, int]:
    applied, faults = _run(PASSES, **env)
    return applied == "True", int(faults)


@pytest.mark.parametrize("hash_seed", ["0", "2", "3"])
def test_freed_activations_are_reused_without_faulting_their_pages_in_again(hash_seed: str) -> None:
    """Kept: at most one pass's worth of faults in all (0 measured). With glibc's defaults the heap's
    top is trimmed, and every pass faults its 40 MiB in again (10,240 pages a pass), only when no small
    allocation happens to lie above the freed blocks: that depends on the interpreter's heap layout
    (here ``PYTHONHASHSEED`` 0 and 2 trimmed, 204,160 faults; 3 did not, 1,024; a CI machine 11,233),
    so the baseline that always faults is the operator's own trim threshold, the next test."""
    applied, faults = _passes(PYTHONHASHSEED=hash_seed)
    assert applied and faults <= 10 * 1024


def test_the_operators_glibc_variables_win() -> None:
    """``MALLOC_TRIM_THRESHOLD_`` in the environment: nothing is changed (here: trim everything, so
    every pass faults its 40 MiB in again, whatever the heap's layout)."""
    applied, faults = _passes(MALLOC_TRIM_THRESHOLD_="0")
    assert not applied and faults >= 20 * 10 * 1024 * 0.9


#: A footprint that grows: sessions' KV held one after another (120 tensors of 2 MiB, 240 MiB in
#: all, every one written), after reserving the given MiB. Prints the bytes reserved and the minor
#: page faults of the growth.
GROWTH = """
import resource, sys, torch
from llava_sessions.model.loading import reserve_cpu_memory
reserved = reserve_cpu_memory(int(sys.argv[1]) * 2**20)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
held = [torch.ones(2**19) for _ in range(120)]
print(reserved, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _growth(reserve_mib: int, **env: str) -> tuple[int, int]:
    reserved, faults = _run(GROWTH, str(reserve_mib), **env)
    return int(reserved), int(faults)


def test_a_reserve_lets_a_growing_footprint_reuse_pages_instead_of_faulting_them_in() -> None:
    """A CPU replica reserves heap at start (``cpu_memory_reserve_bytes``): 240 MiB of KV accumulated
    afterwards fault in (almost) nothing with 512 MiB reserved, and every page (61,440) without; the
    operator's glibc variables still win (nothing reserved)."""
    reserved, faults = _growth(512)
    assert reserved == 512 * 2**20 and faults <= 1024
    none, faults_without = _growth(0)
    assert none == 0 and faults_without >= 0.9 * 240 * 256
    assert _growth(512, MALLOC_TRIM_THRESHOLD_="0")[0] == 0
