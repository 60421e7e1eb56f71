"""Process and loopback helpers of the local servers: free ports, process groups, HTTP probes.

Used by :mod:`.serve` (TorchServe under ``llava-serve``) and the other tools that start or stop
processes. Nothing here knows TorchServe's configuration.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import socketserver
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from typing import Any, TypeVar

__all__ = [
    "OPENER",
    "BackgroundServing",
    "alive",
    "bearer",
    "connect_host",
    "exited",
    "is_loopback",
    "group_members",
    "http_status",
    "load_psutil",
    "pick_ports",
    "stop_process_group",
    "temp_base",
]

#: Longest temp-dir path we accept: TorchServe puts unix sockets (<= 107 bytes) in it.
MAX_TEMP_BASE_CHARS = 60

OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never a proxy


def alive(psutil, pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not); ``psutil``: :func:`load_psutil`'s module."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def exited(psutil, pids: set[int], timeout_s: float) -> list[int]:
    """Wait up to ``timeout_s`` for any of ``pids`` to exit; return those that are gone (empty: all
    still run). On Linux the wait is on pid file descriptors (``os.pidfd_open``, Linux 5.3), so a
    death is seen the moment it happens, not at the next poll; elsewhere it polls at the end of
    ``timeout_s``. ``psutil``: :func:`load_psutil`'s module."""
    fds: dict[int, int] = {}
    gone = [pid for pid in pids if not alive(psutil, pid)]
    try:
        if not gone and hasattr(os, "pidfd_open"):
            for pid in pids:
                try:
                    fds[os.pidfd_open(pid)] = pid
                except OSError:  # gone already (or no pidfd here: polled below)
                    fds.clear()
                    break
            if len(fds) == len(pids):
                readable, _, _ = select.select(list(fds), [], [], timeout_s)
                return sorted(fds[fd] for fd in readable)
        if not gone:
            time.sleep(timeout_s)
            gone = [pid for pid in pids if not alive(psutil, pid)]
        return sorted(gone)
    finally:
        for fd in fds:
            os.close(fd)


def load_psutil():
    """The ``psutil`` module (imported on first use)."""
    import psutil  # optional dependency (extras "serve"/"dev"); only needed to find processes

    return psutil


def is_loopback(host: str) -> bool:
    """Whether a server bound to ``host`` is reachable from this machine only."""
    return host in ("localhost", "::1") or host.startswith("127.")


def connect_host(host: str) -> str:
    """The address a client connects to for a server bound to ``host`` (a wildcard: loopback)."""
    return "127.0.0.1" if host in ("", "0.0.0.0") else host


def bearer(key: str | None) -> dict[str, str]:
    """The ``Authorization: Bearer <key>`` header (RFC 6750) as a dict; {} without a key."""
    return {"Authorization": f"Bearer {key}"} if key else {}


def http_status(url: str, key: str | None = None) -> int | None:
    """The HTTP status of a GET of ``url`` within 2 s (with ``key`` as a bearer token), or None (no answer)."""
    try:
        with OPENER.open(urllib.request.Request(url, headers=bearer(key)), timeout=2) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None


def temp_base() -> str:
    """Where a server's temp dir goes: the system's, unless too long for TorchServe's unix sockets."""
    base = tempfile.gettempdir()
    return base if len(base) <= MAX_TEMP_BASE_CHARS else "/tmp"


def pick_ports(host: str, inference_port: int) -> dict[str, int]:
    """Return free ports: inference on ``host`` (unless given), the rest on 127.0.0.1."""
    names = ["inference", "management", "metrics", "grpc_inference", "grpc_management"]
    sockets = []
    ports: dict[str, int] = {}
    try:
        for name in names:
            if name == "inference" and inference_port:
                ports[name] = inference_port
                continue
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((host if name == "inference" else "127.0.0.1", 0))
            sockets.append(sock)  # hold all until every port is picked: no duplicates
            ports[name] = sock.getsockname()[1]
    finally:
        for sock in sockets:
            sock.close()
    return ports


def group_members(pgid: int) -> list[int]:
    """Return the live (non-zombie) pids of process group ``pgid``."""
    psutil = load_psutil()
    members = []
    for process in psutil.process_iter():
        try:
            if os.getpgid(process.pid) == pgid and process.status() != psutil.STATUS_ZOMBIE:
                members.append(process.pid)
        except (OSError, psutil.Error):
            continue
    return members


def stop_process_group(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM the process group led by ``proc``, SIGKILL what is left after ``grace_s``.

    ``proc`` was started with ``start_new_session=True``, so its pid is the group id and the group
    holds exactly the launcher, the Java frontend and the Python workers. Descendants that left the
    group are also tracked by pid (snapshot before signalling).
    """
    psutil = load_psutil()
    pgid = proc.pid
    try:
        tracked = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        tracked = []

    def alive() -> list:
        left = []
        for process in tracked:
            try:
                if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                    left.append(process)
            except psutil.Error:
                continue
        return left

    def signal_all(signum: int) -> None:
        try:
            os.killpg(pgid, signum)
        except (ProcessLookupError, PermissionError):
            pass
        for process in alive():
            try:
                process.send_signal(signum)
            except psutil.Error:
                pass

    signal_all(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if proc.poll() is not None and not alive() and not group_members(pgid):
            break
        time.sleep(0.1)
    else:
        signal_all(signal.SIGKILL)
        psutil.wait_procs(tracked, timeout=5)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


_Serving = TypeVar("_Serving", bound="BackgroundServing")


class BackgroundServing(socketserver.BaseServer):
    """``start()`` / ``stop()`` for a ``socketserver`` server served from a daemon thread; mix it in
    before the server class (``class S(BackgroundServing, ThreadingHTTPServer)``). ``thread_name``
    names the thread."""

    thread_name = "llava-server"
    _thread: threading.Thread | None = None

    def start(self: _Serving) -> _Serving:
        """Serve in a daemon thread; return self."""
        self._thread = threading.Thread(target=self.serve_forever, name=self.thread_name, daemon=True)
        self._thread.start()
        return self

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that left mid-request (a reset, a broken pipe, a timeout) is no error: nothing is
        printed; anything else is printed as ``socketserver`` does (a traceback on stderr)."""
        if isinstance(sys.exc_info()[1], ConnectionError | TimeoutError):
            return
        super().handle_error(request, client_address)

    def stop(self) -> None:
        """Stop serving and close the listening socket. Idempotent."""
        if self._thread is not None:
            self.shutdown()
            self._thread.join(timeout=5)
            self._thread = None
        self.server_close()
