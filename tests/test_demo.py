"""``python -m llava_tools.demo`` (what ``make demo`` runs) end to end: tiny model, real TorchServe."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


def test_demo_runs_a_scripted_session():
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(
        [sys.executable, "-m", "llava_tools.demo", "--max-new-tokens", "12"],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        stdin=subprocess.DEVNULL,
    )
    out = done.stdout
    assert done.returncode == 0, f"stdout:\n{out}\nstderr:\n{done.stderr[-4000:]}"
    head = out[:1500]
    assert "RANDOM weights" in head and "gibberish" in head and "make demo MODEL_DIR=" in head
    transcript = out[out.index("Transcript") :]
    assert [q for q in ("Q1 (streamed)", "Q2 (uses history)", "Q3 (independent)") if q in transcript] == [
        "Q1 (streamed)",
        "Q2 (uses history)",
        "Q3 (independent)",
    ]
    turns = re.findall(
        r"time to first token: (\d+) ms measured here, (\d+) ms reported by the server \| "
        r"reused tokens: (\d+) of (\d+) prompt tokens",
        transcript,
    )
    assert len(turns) == 3
    reused = [int(r) for _, _, r, _ in turns]
    assert all(r > 500 for r in reused)  # the image prefix, cached at open, is reused by every turn
    assert reused[1] > reused[0]  # turn 2 also reuses turn 1
    assert "stopped the server" in out and "closed session" in out
    # it ends with what to run next: a server of one's own and the clients
    tail = out[out.index("Next steps") :]
    assert "llava-serve --model-dir" in tail and "llava-chat --url" in tail and "llava-web --url" in tail
