"""``make demo`` end to end, as the README's quick start runs it (``python -m llava_tools.demo`` on the
embedded tiny model, a real TorchServe), and ``make demo MODEL_DIR=...`` on another checkpoint."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from tests.server_fixtures import OutputLines, stop_process

pytestmark = pytest.mark.integration


ROOT = Path(__file__).resolve().parents[2]


def _make_demo(*args: str) -> subprocess.CompletedProcess:
    """``make demo ARGS`` in the repository, as a reader runs it."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run(
        ["make", "--no-print-directory", "demo", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        stdin=subprocess.DEVNULL,
    )


def test_demo_runs_a_scripted_session():
    done = _make_demo()
    out = done.stdout
    assert done.returncode == 0, f"stdout:\n{out}\nstderr:\n{done.stderr[-4000:]}"
    head = out[:1500]
    assert "RANDOM weights" in head and "gibberish" in head and "make demo MODEL_DIR=" in head
    # each question and answer once (no transcript again after the server stops)
    assert [out.count(f"{q} (") for q in ("Q1", "Q2", "Q3")] == [1, 1, 1]
    assert [out.count(f"{a}: ") for a in ("A1", "A2", "A3")] == [1, 1, 1]
    # a streamed answer's first token as this client saw it; a whole answer's time is the whole answer's
    streamed = re.findall(
        r"time to first token: (\d+) ms measured here, (\d+) ms reported by the server \| "
        r"reused tokens: (\d+) of (\d+) prompt tokens",
        out,
    )
    whole = re.findall(
        r"whole answer in (\d+) ms measured here \(not streamed\), first token (\d+) ms reported by the server \| "
        r"reused tokens: (\d+) of (\d+) prompt tokens",
        out,
    )
    assert len(streamed) == 1 and len(whole) == 2 and "time to first token" not in out[out.index("Q2 (") :]
    turns = streamed + whole
    reused = [int(r) for _, _, r, _ in turns]
    assert all(r > 500 for r in reused)  # the image prefix, cached at open, is reused by every turn
    assert reused[1] > reused[0]  # turn 2 also reuses turn 1
    assert "stopped the server" in out and "closed session" in out
    # it ends with what to run next: a server of one's own and the clients
    tail = out[out.index("Next steps") :]
    assert "llava-serve --model-dir" in tail and "llava-chat --url" in tail and "llava-web --url" in tail
    assert "--out ./" not in tail  # run in the repository, the next steps leave nothing untracked there
    # the commands live in the venv make installed: a fresh shell is told to activate it first
    assert "source .venv/bin/activate" in tail and (ROOT / ".venv" / "bin" / "llava-serve").exists()
    # the --image it suggests exists (issue 60 item 6: no photo.jpg shipped)
    photo = re.search(r"llava-chat --url \S+ --image (\S+)", tail).group(1)
    assert (ROOT / photo).is_file() and (ROOT / photo).read_bytes()[:2] == b"\xff\xd8"  # a JPEG


def test_demo_runs_on_the_checkpoint_model_dir_names(tmp_path):
    """The README's ``make demo MODEL_DIR=/path/to/llava-1.5-7b-hf``, its placeholder a tiny
    LLaVA-NeXT folder (one of the families the README names)."""
    from llava_tools.tiny_model import write_checkpoint

    model_dir = write_checkpoint("tiny", tmp_path / "next", seed=0, arch="llava-next")
    done = _make_demo(f"MODEL_DIR={model_dir}")
    assert done.returncode == 0, f"stdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-3000:]}"
    assert str(model_dir) in done.stdout and "RANDOM weights" not in done.stdout[:1500]
    assert "Q3 (independent" in done.stdout and "stopped the server" in done.stdout


@pytest.fixture
def short_tmp():
    """A TMPDIR short enough that the server's temp dir goes in it (``processes.temp_base``), removed after."""
    import shutil
    import tempfile

    from llava_tools.processes import MAX_TEMP_BASE_CHARS

    path = Path(tempfile.mkdtemp(prefix="ctrl-c-", dir="/tmp"))
    assert len(str(path)) <= MAX_TEMP_BASE_CHARS
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("when", ["starting", "serving"])
def test_ctrl_c_during_the_demo_leaves_nothing_behind(short_tmp, when):
    """Ctrl-C (SIGINT to the demo's process group, as a terminal sends it) while TorchServe starts, or
    once it serves: the demo says it was interrupted, and leaves no process, no temp folder and no kept
    log folder in its TMPDIR (a failed start keeps its logs; a stopped one has nothing to read)."""
    tmp_path = short_tmp  # TorchServe's temp dir goes there only when its unix sockets' paths fit
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", "TMPDIR": str(tmp_path)}
    demo = subprocess.Popen(
        [sys.executable, "-m", "llava_tools.demo"],
        cwd=ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    out = OutputLines(demo.stdout, demo)
    seen: dict[int, psutil.Process] = {}
    try:
        if when == "serving":
            out.wait_for(re.compile(r"\[2/4\] TorchServe is serving"), 240)
        else:
            out.wait_for(re.compile(r"\[1/4\]"), 120)
            deadline = time.monotonic() + 120
            while not list(tmp_path.glob("llava-serve-*/logs/*.log")) and time.monotonic() < deadline:
                time.sleep(0.05)
        for child in psutil.Process(demo.pid).children(recursive=True):
            seen.setdefault(child.pid, child)
        assert demo.poll() is None, out.drain()
        os.killpg(demo.pid, signal.SIGINT)
        demo.wait(timeout=120)
    finally:
        stop_process(demo, 5)
    text = out.drain()
    if when == "starting":
        assert "[2/4]" not in text, "the start finished before the signal: nothing was interrupted"
    assert demo.returncode == 130 and "demo: interrupted" in text and "Traceback" not in text, text[-3000:]
    left = sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("torchinductor_"))  # torch's cache
    assert left == [], "left behind in TMPDIR"
    assert [p.pid for p in seen.values() if p.is_running() and p.status() != psutil.STATUS_ZOMBIE] == []
