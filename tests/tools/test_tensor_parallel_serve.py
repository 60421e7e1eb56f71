"""A tensor-parallel replica served as users run it (issue 62): ``llava-serve`` with
``LLAVA_TENSOR_PARALLEL_SIZE=2`` on the CPU, its TorchServe worker rank 0 of 2 ranks over ``gloo``.

A rank's death costs no client error: SIGKILL of the other rank mid-answer ends rank 0 at once (the
replica restarts as one), and the stream, resumed by llava_client in the session restored from its
history, gives the answer the replica gave before; SIGKILL of rank 0 takes the other rank with it
(none is left behind), and the restarted replica answers again.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llava_tools.processes import pick_ports
from server_fixtures import OutputLines, stop_process

psutil = pytest.importorskip("psutil")

READY = re.compile(r"llava-serve: ready at (http://\S+) ")
READY_AGAIN = re.compile(r"llava-serve: ready again at ")


def _worker(cli_pid: int) -> psutil.Process:
    """The one live TorchServe worker (rank 0) under ``cli_pid``."""
    for p in psutil.Process(cli_pid).children(recursive=True):
        try:
            if any("model_service_worker" in part for part in p.cmdline()) and p.status() != psutil.STATUS_ZOMBIE:
                return p
        except psutil.Error:
            continue
    raise AssertionError("no live TorchServe worker")


def _rank(worker: psutil.Process) -> psutil.Process:
    """The worker's other rank: its child started by ``multiprocessing`` spawn."""
    ranks = [p for p in worker.children() if any("spawn_main" in part for part in p.cmdline())]
    assert len(ranks) == 1, [p.cmdline() for p in worker.children()]
    return ranks[0]


def _gone(process: psutil.Process, timeout_s: float) -> bool:
    try:
        process.wait(timeout_s)
        return True
    except psutil.TimeoutExpired:
        return False


@pytest.mark.integration
@pytest.mark.timeout(420)
def test_a_killed_rank_costs_no_client_error(tiny_model_dir: Path, photos) -> None:
    from llava_client import SessionClient

    port = pick_ports("127.0.0.1", 0)["inference"]
    script = Path(sys.executable).parent / "llava-serve"
    command = [str(script), "--model-dir", str(tiny_model_dir), "--port", str(port), "--startup-timeout", "180"]
    env = dict(os.environ, LLAVA_TENSOR_PARALLEL_SIZE="2", LLAVA_DEVICE="cpu")
    cli = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        output = OutputLines(cli.stdout)
        url = output.wait_for(READY, timeout_s=200).group(1)
        client = SessionClient.from_url(url)
        session = client.open_session(photos["coffee"])
        question = "Describe the picture in detail."
        whole = session.ask(question, remember=False, max_new_tokens=120, temperature=0, details=True)
        assert len(whole.tokens) == 120

        # kill the other rank mid-answer: rank 0 ends, the replica restarts, the stream goes on
        worker = _worker(cli.pid)
        rank = _rank(worker)
        stream = session.stream(question, remember=False, max_new_tokens=120, temperature=0)
        given = next(stream) + next(stream)
        rank.kill()
        rest = "".join(stream)
        assert given + rest == whole.text and stream.resumes == 1
        assert _gone(worker, 30), "rank 0 outlived its other rank"
        output.wait_for(READY_AGAIN, timeout_s=200)

        # kill rank 0: its other rank does not outlive it; the replica restarted answers the same
        worker = _worker(cli.pid)
        rank = _rank(worker)
        worker.kill()
        assert _gone(rank, 30), "the other rank outlived rank 0"
        t0 = time.monotonic()
        again = session.ask(question, remember=False, max_new_tokens=120, temperature=0)
        assert again.text == whole.text and session.recoveries >= 1
        print(f"answered {time.monotonic() - t0:.1f} s after rank 0 was killed")
    finally:
        stop_process(cli, 60)  # SIGTERM, then SIGKILL to it and the TorchServe groups it started
