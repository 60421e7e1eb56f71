"""The supervision of a local TorchServe (:class:`Supervised`, mixed into
:class:`~llava_tools.serve.server.LocalServer`): a start waited for until every worker is READY and
``/ping`` answers, and a worker's death seen the moment it happens (a pid file descriptor) and answered
by restarting TorchServe, with the proxy told at once (it holds new requests meanwhile).
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, TYPE_CHECKING

from ..processes import alive, exited, http_status, load_psutil, stop_process_group
from . import torchserve_files as ts_files
from .torchserve_files import ServerStartError

if TYPE_CHECKING:
    from .front import OpenAIFront

__all__ = ["Supervised", "WorkerDied"]

#: Seconds between two looks at a start in progress.
POLL_S = 0.25
#: Seconds a TorchServe whose worker died gets between SIGTERM and SIGKILL before the restart. It has
#: nothing left to drain (the dead worker's sessions are lost, and a restart cuts every other request
#: anyway), and its shutdown took 2.4 s of the 14.5 s restart (measured, tiny model, 2-core CPU).
RESTART_GRACE_S = 0.0


class WorkerDied(ServerStartError):
    """A worker died before TorchServe was ready, and not of a failed load (``pids``)."""

    def __init__(self, pids: list[int]) -> None:
        super().__init__(f"worker {pids} died during start-up")
        self.pids = pids


class Supervised:
    """What :class:`~llava_tools.serve.server.LocalServer` does for itself once launched: wait until a
    start serves (:meth:`_wait_ready`), and restart TorchServe when a worker dies (:meth:`_supervise`,
    on a thread of its own). The attributes below are the server's."""

    workers: int
    startup_timeout_s: float
    stop_grace_s: float
    supervise_interval_s: float
    restarts: int
    _proc: subprocess.Popen | None
    _console: IO[bytes] | None
    _lock: threading.Lock
    _abort: threading.Event
    _stopping: threading.Event
    _front: OpenAIFront | None
    _ready_pids: set[int]
    _watched: set[int]
    _supervisor: threading.Thread | None
    _launched_at: float
    _start_s: float

    @property
    def url(self) -> str:
        raise NotImplementedError

    @property
    def management_url(self) -> str:
        raise NotImplementedError

    @property
    def torchserve_url(self) -> str:
        raise NotImplementedError

    @property
    def log_dir(self) -> Path:
        raise NotImplementedError

    def worker_pids(self) -> list[int]:
        raise NotImplementedError

    def torchserve_keys(self) -> dict[str, str]:
        raise NotImplementedError

    def _launch(self) -> None:
        raise NotImplementedError

    def _start_supervisor(self) -> None:
        self._watched = self._ready_pids or set(self.worker_pids())
        self._supervisor = threading.Thread(target=self._supervise, name="llava-serve-supervisor", daemon=True)
        self._supervisor.start()

    def _supervise(self) -> None:
        """Restart TorchServe when one of its workers dies.

        TorchServe 0.12 with sequence continuous batching does not recover a killed worker: the
        dead worker stays UNLOADING and every request waits (pytorch/serve issues 2423 and 2870;
        reproduced here). A dead worker has lost its sessions anyway, so the supervisor stops
        this server's process group and starts it again on the same ports; clients then get
        ``404 session_not_found`` for the lost sessions (and reopen them) within seconds.
        """
        psutil = load_psutil()
        while not self._stopping.is_set():
            with self._lock:
                proc = self._proc
            if proc is None:
                return
            # a death is seen as it happens (pid file descriptors), so the proxy holds new requests at once
            dead = exited(psutil, set(self._watched), self.supervise_interval_s)
            if self._stopping.is_set():
                return
            # fewer watched workers than configured: one died between READY and the pid capture
            if not dead and len(self._watched) >= self.workers:
                continue
            died_at = time.monotonic()
            self._serving(False)  # until it is back: /ping 503, new requests held, cut ones a typed 503
            print(
                f"llava-serve: worker {dead or '(one of them)'} died; restarting TorchServe (its sessions are lost)",
                file=sys.stderr,
                flush=True,
            )
            with self._lock:
                if self._proc is None or self._stopping.is_set():
                    return
                stop_process_group(self._proc, RESTART_GRACE_S)
                if self._console is not None:
                    self._console.close()
                self._launch()
                self.restarts += 1
            try:
                self._wait_ready()
            except WorkerDied as died:
                self._watched = set(died.pids)  # the next tick restarts again
                continue
            except ServerStartError as exc:
                if not self._stopping.is_set():  # stop() during the restart is no failure
                    print(f"llava-serve: restart failed: {exc}", file=sys.stderr, flush=True)
                    with self._lock:  # down for good: `running` turns False and the CLI exits 1
                        if self._proc is not None:
                            stop_process_group(self._proc, self.stop_grace_s)
                return
            self._watched = self._ready_pids or set(self.worker_pids())
            print(
                f"llava-serve: ready again at {self.url} ({time.monotonic() - died_at:.1f} s after the worker "
                f"died; restart {self.restarts}; its sessions answer 404 session_not_found)",
                file=sys.stderr,
                flush=True,
            )

    def _wait_ready(self) -> None:
        """Wait until every worker is READY and ``/ping`` answers 200.

        Raises:
            ServerStartError: TorchServe exited, the handler failed to load, the start-up timeout
                passed, or (:class:`WorkerDied`) a worker died without a load failure (killed).
        """
        psutil = load_psutil()
        deadline = time.monotonic() + self.startup_timeout_s
        status = "no answer from the management API"
        seen: set[int] = set()  # every worker pid this start reported, whatever its state
        while True:
            if self._abort.is_set():
                raise ServerStartError("start-up aborted")
            if self._proc is None or self._proc.poll() is not None:
                code = None if self._proc is None else self._proc.returncode
                raise ServerStartError(f"TorchServe exited during start-up (exit code {code})")
            if ts_files.load_failed(self.log_dir):
                raise ServerStartError(f"the handler failed to load the model: {ts_files.worker_error(self.log_dir)}")
            keys = self.torchserve_keys()  # {} while its token authorization is off
            ready, status, workers = ts_files.model_status(self.management_url, self.workers, keys.get("management"))
            seen |= workers.keys()
            dead = sorted(pid for pid in seen if not alive(psutil, pid))
            if dead:
                # a worker that failed to load says so in its log as it exits (next turn raises that);
                # one killed (even the moment it turned READY) stays UNLOADING for good in TorchServe
                if not ts_files.load_failed(self.log_dir, wait_s=1.0):
                    raise WorkerDied(dead)
                continue
            if ready and http_status(self.torchserve_url + "/ping", keys.get("inference")) == 200:
                # the supervisor watches these: a worker killed right after is still seen dying
                self._ready_pids = {pid for pid, state in workers.items() if state == "READY"}
                if self._front is not None:
                    self._front.backend_key = keys.get("inference")
                self._start_s = time.monotonic() - self._launched_at
                self._serving(True)
                return
            if time.monotonic() > deadline:
                raise ServerStartError(f"TorchServe not ready after {self.startup_timeout_s:.0f} s ({status})")
            time.sleep(POLL_S)

    def _serving(self, ready: bool) -> None:
        """Tell the proxy whether the worker serves (its ``/ping`` and its 503s follow; a restart's
        ``Retry-After`` counts down from the last start's duration)."""
        if self._front is not None:
            self._front.set_ready(ready, self._start_s)
