"""The tests' own clean-up: ``server_fixtures.stop_process`` ends what a test started on every path.

A CLI that ignores its signal is killed after the timeout, and so is every process it started in a
session of its own (as the CLIs start TorchServe), which a kill of the CLI alone would orphan.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import psutil

from server_fixtures import stop_process

#: A parent that ignores SIGTERM and SIGINT and starts a child in a session of its own, then prints its pid.
STUBBORN = textwrap.dedent(
    """
    import signal, subprocess, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
    print(child.pid, flush=True)
    time.sleep(300)
    """
)

#: A parent that stops on SIGINT and leaves its own-session child running.
LEAVES_A_CHILD = STUBBORN.replace("signal.signal(signal.SIGINT, signal.SIG_IGN)", "")


def _start(script: str) -> tuple[subprocess.Popen, int]:
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    return parent, child


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_process_that_ignores_its_signal_is_killed_with_the_sessions_it_started():
    parent, child = _start(STUBBORN)
    try:
        t0 = time.monotonic()
        assert stop_process(parent, 1.0) is False  # the signal did not stop it: SIGKILL did
        assert parent.returncode == -signal.SIGKILL and time.monotonic() - t0 < 20
        assert _gone(child), "the child in its own session outlived the parent"
    finally:
        for pid in (parent.pid, child):
            if not _gone(pid):
                psutil.Process(pid).kill()


def test_a_child_left_behind_by_a_process_that_stopped_on_its_signal_is_killed():
    parent, child = _start(LEAVES_A_CHILD)
    try:
        assert stop_process(parent, 20.0, signal.SIGINT) is True
        assert _gone(child), "the child in its own session outlived the parent"
    finally:
        if not _gone(child):
            psutil.Process(child).kill()
