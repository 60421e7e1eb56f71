"""Run the LLaVA session handler in a local TorchServe: the ``llava-serve`` CLI and :class:`LocalServer`.

``LocalServer`` builds a no-archive model folder from ``model-config.yaml`` and the handler, writes a
``config.properties`` with free loopback ports, starts ``torchserve --foreground`` in its own process
group with its own ``TMPDIR`` and working directory (so pid file, unix sockets and ``./logs`` are its
own), waits until the model's worker is READY, and on :meth:`LocalServer.stop` ends exactly that
process group. It never calls ``torchserve --stop`` (which acts on a pid file) and never kills by name.

Usage::

    llava-serve --model-dir models/tiny --port 8080
    llava-serve --model-dir models/tiny --set session_ttl_s=60 --set max_sessions=8

    with LocalServer("models/tiny", overrides={"max_sessions": 4}) as server:
        requests.post(server.url + "/invocations", json=...)
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any

import yaml

import llava_sessions
from llava_sessions.wire.contract import CLOSED_SESSION_ID_HEADER, NEW_SESSION_ID_HEADER, SESSION_ID_HEADER

__all__ = [
    "MODEL_NAME",
    "LocalServer",
    "ServerStartError",
    "main",
]

#: Name the model is registered under (``/predictions/llava``; ``/invocations`` needs no name).
MODEL_NAME = "llava"

#: Frontend keys (config.properties) -> the env var the Python worker reads the same name from
#: (ts/context.py, Context.__init__). Both sides must name the same header: SageMaker's session
#: headers double as TorchServe's sequence header keys (id / start / end).
_SEQUENCE_HEADER_KEYS = (
    ("ts_header_key_sequence_id", "TS_REQUEST_SEQUENCE_ID", SESSION_ID_HEADER),
    ("ts_header_key_sequence_start", "TS_REQUEST_SEQUENCE_START", NEW_SESSION_ID_HEADER),
    ("ts_header_key_sequence_end", "TS_REQUEST_SEQUENCE_END", CLOSED_SESSION_ID_HEADER),
)

#: SageMaker's body limit is 6,291,456 bytes; TorchServe's own limit sits just above it.
_MAX_BODY_BYTES = 6_553_600
#: Why more than one TorchServe worker per model is refused (docs/design.md, "One worker").
MULTI_WORKER_REFUSAL = (
    "more than one TorchServe worker per model is refused: TorchServe does not keep a session on one "
    "worker when clients send the literal id NEW_SESSION (one shared job group; their follow-ups reach "
    "the other worker and get 404), and it does not balance sessions over workers. Run one worker; for "
    "more model copies run llava-local-endpoint --backends N"
)
#: Seconds between SIGTERM to the process group and SIGKILL.
DEFAULT_STOP_GRACE_S = 20.0
#: Longest temp-dir path we accept: TorchServe puts unix sockets (<= 107 bytes) in it.
_MAX_TEMP_BASE_CHARS = 60
_POLL_S = 0.25

#: The worker core (the only package the TorchServe worker imports) and the handler folder beside it.
_CORE_DIR = Path(llava_sessions.__file__).resolve().parent
_REPO_ROOT = _CORE_DIR.parent.parent


def default_handler_path() -> Path:
    """Return the path of the TorchServe entry ``handler/llava_handler.py``."""
    return _CORE_DIR.parent / "llava_handler.py"


def default_model_config_path() -> Path:
    """Return the path of the repository's ``model-config.yaml``."""
    return _REPO_ROOT / "model-config.yaml"


def default_log_config_path(home: Path | None = None) -> Path | None:
    """TorchServe's log4j2 configuration: ``$LLAVA_TS_LOG_CONFIG``, else the quiet
    ``config/log4j2.xml`` of ``home`` (default: the repository), else None (TorchServe's own,
    which logs every request at DEBUG)."""
    named = os.environ.get("LLAVA_TS_LOG_CONFIG", "").strip()
    if named:
        return Path(named)
    path = (home or _REPO_ROOT) / "config" / "log4j2.xml"
    return path if path.is_file() else None


def visible_gpus(env: Mapping[str, str] | None = None) -> int:
    """CUDA devices a worker started with ``env`` would see: 0 where no NVIDIA driver is loaded
    (no ``/proc/driver/nvidia``), else ``torch.cuda.device_count()`` counted in a child process, so
    this supervisor never imports torch nor touches CUDA (``CUDA_VISIBLE_DEVICES`` in ``env``
    applies). 0 when the count fails."""
    if not Path("/proc/driver/nvidia").exists():
        return 0
    try:
        done = subprocess.run(
            [sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
            capture_output=True,
            text=True,
            timeout=120,
            env=dict(env) if env is not None else None,
        )
        return int(done.stdout.strip())
    except (OSError, ValueError, subprocess.SubprocessError):
        return 0


class ServerStartError(RuntimeError):
    """TorchServe could not be prepared or did not become ready; the message ends with a log tail."""


class _WorkerDied(ServerStartError):
    """A worker died before TorchServe was ready, and not of a failed load (``pids``)."""

    def __init__(self, pids: list[int]) -> None:
        super().__init__(f"worker {pids} died during start-up")
        self.pids = pids


class LocalServer:
    """One TorchServe instance on loopback serving the handler with one model directory.

    Args:
        model_dir: the checkpoint directory; its absolute path is written to ``handler.model_dir``.
        port: inference port; 0 picks a free one.
        host: inference bind address.
        workers: number of TorchServe workers (``minWorkers`` = ``maxWorkers``).
        config: model-config YAML to start from; default: the repository's ``model-config.yaml``.
        overrides: values for keys of the ``handler:`` section (validated by the handler).
        model_config_overrides: values for top-level TorchServe keys (``batchSize``,
            ``sequenceMaxIdleMSec``, ...), applied after ``workers``.
        startup_timeout_s: seconds to wait for a READY worker and ``/ping`` 200.
        env: extra environment variables for TorchServe and its workers.
        handler: the TorchServe handler file; default: ``handler/llava_handler.py``.
        log_config: TorchServe's log4j2 configuration (``torchserve --log-config``); default:
            :func:`default_log_config_path`.
        stop_grace_s: seconds between SIGTERM and SIGKILL in :meth:`stop`.
        supervise: restart TorchServe when a worker dies (see :meth:`_supervise`).
        keep_logs: keep TorchServe's ``logs`` folder when the server stops (moved to
            ``<tmp>/llava-serve-logs-<time>-<pid>``, :attr:`kept_logs`); a failed start always keeps it.

    Use as a context manager, or call :meth:`start` and :meth:`stop`.
    """

    def __init__(
        self,
        model_dir: str | os.PathLike,
        *,
        port: int = 0,
        host: str = "127.0.0.1",
        workers: int = 1,
        config: str | os.PathLike | None = None,
        overrides: Mapping[str, Any] | None = None,
        model_config_overrides: Mapping[str, Any] | None = None,
        startup_timeout_s: float = 120.0,
        env: Mapping[str, str] | None = None,
        handler: str | os.PathLike | None = None,
        log_config: str | os.PathLike | None = None,
        stop_grace_s: float = DEFAULT_STOP_GRACE_S,
        supervise: bool = True,
        keep_logs: bool = False,
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        if not 0 <= port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {port}")
        self.model_dir = Path(model_dir).resolve()
        self.host = host
        self.workers = workers
        self.config_path = Path(config) if config is not None else default_model_config_path()
        self.overrides = dict(overrides or {})
        self.model_config_overrides = dict(model_config_overrides or {})
        self.startup_timeout_s = startup_timeout_s
        self.env = dict(env or {})
        self.handler_path = Path(handler) if handler is not None else default_handler_path()
        self.log_config_path = Path(log_config) if log_config is not None else default_log_config_path()
        self.stop_grace_s = stop_grace_s
        self._requested_port = port
        self._ports: dict[str, int] = {}
        self._temp_dir: Path | None = None
        self._proc: subprocess.Popen | None = None
        self._console: IO[bytes] | None = None
        self._lock = threading.Lock()
        self._abort = threading.Event()
        self._stopping = threading.Event()
        self._command: list[str] = []
        self._child_env_cache: dict[str, str] = {}
        self._ready_pids: set[int] = set()  # worker pids READY when the last start became ready
        self._watched: set[int] = set()
        self._supervisor: threading.Thread | None = None
        self.supervise = supervise
        self.supervise_interval_s = 0.5
        #: How many times the supervisor relaunched TorchServe after a worker died.
        self.restarts = 0
        self.keep_logs = keep_logs
        #: Where the logs were kept when the server stopped (``keep_logs``, or a failed start), or None.
        self.kept_logs: Path | None = None

    # ---- public surface -------------------------------------------------------------------

    @property
    def url(self) -> str:
        """Inference base URL (``/ping``, ``/invocations``, ``/predictions/llava``)."""
        return f"http://{_connect_host(self.host)}:{self._port('inference')}"

    @property
    def management_url(self) -> str:
        """Management API base URL (``/models/llava``)."""
        return f"http://127.0.0.1:{self._port('management')}"

    @property
    def metrics_url(self) -> str:
        """Metrics API base URL (``/metrics``)."""
        return f"http://127.0.0.1:{self._port('metrics')}"

    @property
    def temp_dir(self) -> Path:
        """This server's private directory (TMPDIR, working dir, model store); removed by stop()."""
        if self._temp_dir is None:
            raise RuntimeError("server not started")
        return self._temp_dir

    @property
    def log_dir(self) -> Path:
        """TorchServe's ``logs`` directory (``model_log.log`` holds handler output)."""
        return self.temp_dir / "logs"

    @property
    def running(self) -> bool:
        """Whether TorchServe is up or being restarted by the supervisor (False: it died, or its
        restart failed). Waits while a restart swaps the process group, so a caller never sees the
        gap between the old launcher's exit and the new one's start."""
        with self._lock:
            return self._proc is not None and self._proc.poll() is None

    def frontend_pid(self) -> int | None:
        """Return the pid of TorchServe's Java frontend, or None if it is not running."""
        frontend = self._frontend_process()
        return frontend.pid if frontend is not None else None

    def worker_pids(self) -> list[int]:
        """Return the pids of TorchServe's Python worker processes (children of the frontend)."""
        psutil = _psutil()
        frontend = self._frontend_process()
        if frontend is None:
            return []
        pids = []
        try:
            children = frontend.children(recursive=True)
        except psutil.Error:
            return []
        for child in children:
            try:
                if any("model_service_worker" in part for part in child.cmdline()):
                    pids.append(child.pid)
            except psutil.Error:
                continue
        return sorted(pids)

    def tail_logs(self, n: int = 50) -> str:
        """Return the last ``n`` lines of TorchServe's frontend log and of the handler's log.

        ``ts_log.log`` is the frontend, ``model_log.log`` what the worker (our handler) printed;
        before the frontend has created ``logs/`` the launcher's console output is used.
        """
        if self._temp_dir is None:
            return ""
        files = [self.log_dir / "ts_log.log", self.log_dir / "model_log.log"]
        if not any(path.is_file() for path in files):
            files = [self._temp_dir / "console.log"]
        parts = []
        for path in files:
            if path.is_file():
                lines = path.read_text(errors="replace").splitlines()[-n:]
                parts.append(f"==> {path.name} <==\n" + "\n".join(lines))
        return "\n".join(parts)

    def start(self) -> LocalServer:
        """Build the model folder, start TorchServe and wait until the worker serves.

        Returns:
            self.

        Raises:
            ServerStartError: the archiver failed, TorchServe exited, or no READY worker and
                ``/ping`` 200 within ``startup_timeout_s`` (the server is stopped first).
            FileNotFoundError: ``model_dir``, the config or the handler file does not exist.
            RuntimeError: already started.
        """
        with self._lock:
            if self._proc is not None:
                raise RuntimeError("server already started")
            for path, what in (
                (self.model_dir, "model dir"),
                (self.config_path, "model config"),
                (self.handler_path, "handler file"),
                (self.log_config_path, "log config"),
            ):
                if path is not None and not path.exists():
                    raise FileNotFoundError(f"{what} not found: {path}")
            self._temp_dir = Path(tempfile.mkdtemp(prefix="llava-serve-", dir=_temp_base()))
            atexit.register(self.stop)
        try:
            self._check_settings()
            self._prepare_and_launch()
            self._wait_ready()
            if self.supervise:
                self._start_supervisor()
        except BaseException as exc:
            tail = self.tail_logs(40)
            self.stop(keep_logs=True)
            if isinstance(exc, ServerStartError):
                kept = f"\nlogs kept in {self.kept_logs}" if self.kept_logs else ""
                raise ServerStartError(f"{exc}\n{tail}{kept}") from None
            raise
        return self

    def abort_start(self) -> None:
        """Make a :meth:`start` in progress (another thread, a signal handler) give up soon."""
        self._abort.set()

    def stop(self, *, keep_logs: bool = False) -> None:
        """Stop the TorchServe process group this object started and remove its temp dir (its
        ``logs`` folder moved out first when ``keep_logs`` or the ``keep_logs`` setting says so:
        :attr:`kept_logs`).

        SIGTERM to the group, then SIGKILL to whatever is left after ``stop_grace_s``. Idempotent.
        """
        self._stopping.set()
        with self._lock:
            proc, self._proc = self._proc, None
            temp_dir, self._temp_dir = self._temp_dir, None
            atexit.unregister(self.stop)
        supervisor, self._supervisor = self._supervisor, None
        if supervisor is not None and supervisor is not threading.current_thread():
            supervisor.join(timeout=self.stop_grace_s + 5)
        if proc is not None:
            _stop_process_group(proc, self.stop_grace_s)
        if self._console is not None:
            self._console.close()
            self._console = None
        if temp_dir is not None:
            if (keep_logs or self.keep_logs) and (temp_dir / "logs").is_dir():
                kept = Path(tempfile.gettempdir()) / f"llava-serve-logs-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
                try:
                    shutil.move(str(temp_dir / "logs"), kept)
                    self.kept_logs = kept
                except OSError:
                    pass
            shutil.rmtree(temp_dir, ignore_errors=True)

    def __enter__(self) -> LocalServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = self.url if self.running else "stopped"
        return f"LocalServer({str(self.model_dir)!r}, {state})"

    # ---- start-up phases ------------------------------------------------------------------

    def _port(self, name: str) -> int:
        if name not in self._ports:
            raise RuntimeError("server not started")
        return self._ports[name]

    def _prepare_and_launch(self) -> None:
        temp = self.temp_dir
        tmp = temp / "tmp"
        store = temp / "model-store"
        tmp.mkdir()
        store.mkdir()
        self._ports = _pick_ports(self.host, self._requested_port)

        model_config = self._write_model_config(temp / "model-config.yaml")
        self._child_env_cache = env = self._child_env(tmp)
        self._archive(model_config, store, temp, env)
        ts_config = temp / "config.properties"
        ts_config.write_text(self._config_properties(store))

        self._command = [
            _console_script("torchserve"),
            "--start",
            "--foreground",
            "--ts-config",
            str(ts_config),
            "--model-store",
            str(store),
            "--ncs",
            "--disable-token-auth",
        ]
        if self.log_config_path is not None:
            self._command += ["--log-config", str(self.log_config_path)]
        self._launch()

    def _launch(self) -> None:
        temp = self.temp_dir
        self._console = open(temp / "console.log", "ab")  # noqa: SIM115 - closed in stop()
        self._proc = subprocess.Popen(
            self._command,
            cwd=temp,
            env=self._child_env_cache,
            stdin=subprocess.DEVNULL,
            stdout=self._console,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # own process group: stop() signals exactly this group
        )

    # ---- supervision ----------------------------------------------------------------------

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
        psutil = _psutil()
        while not self._stopping.wait(self.supervise_interval_s):
            with self._lock:
                proc = self._proc
            if proc is None:
                return
            dead = [pid for pid in self._watched if not _alive(psutil, pid)]
            # fewer watched workers than configured: one died between READY and the pid capture
            if not dead and len(self._watched) >= self.workers:
                continue
            print(
                f"llava-serve: worker {dead or '(one of them)'} died; restarting TorchServe (its sessions are lost)",
                file=sys.stderr,
                flush=True,
            )
            with self._lock:
                if self._proc is None or self._stopping.is_set():
                    return
                _stop_process_group(self._proc, self.stop_grace_s)
                if self._console is not None:
                    self._console.close()
                self._launch()
                self.restarts += 1
            try:
                self._wait_ready()
            except _WorkerDied as died:
                self._watched = set(died.pids)  # the next tick restarts again
                continue
            except ServerStartError as exc:
                if not self._stopping.is_set():  # stop() during the restart is no failure
                    print(f"llava-serve: restart failed: {exc}", file=sys.stderr, flush=True)
                    with self._lock:  # down for good: `running` turns False and the CLI exits 1
                        if self._proc is not None:
                            _stop_process_group(self._proc, self.stop_grace_s)
                return
            self._watched = self._ready_pids or set(self.worker_pids())

    def _write_model_config(self, path: Path) -> Path:
        config = yaml.safe_load(self.config_path.read_text()) or {}
        if not isinstance(config, dict):
            raise ServerStartError(f"{self.config_path}: expected a YAML mapping")
        config["minWorkers"] = self.workers
        config["maxWorkers"] = self.workers
        config.update(self.model_config_overrides)
        handler_section = dict(config.get("handler") or {})
        handler_section["model_dir"] = str(self.model_dir)
        handler_section.update(self.overrides)
        config["handler"] = handler_section
        self._size_job_groups(config)
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        return path

    def _size_job_groups(self, config: dict[str, Any]) -> None:
        """Raise ``batchSize`` and ``maxNumSequence`` to what the worker's replicas may hold
        (:func:`~llava_sessions.config.job_groups`): ``max_sessions`` is per replica, and
        ``devices: auto`` starts one replica per visible GPU (:func:`visible_gpus`), so a 4-GPU
        instance with the shipped 64 gets 264. Keys given in ``model_config_overrides`` stay as given."""
        from llava_sessions.config import Settings, job_groups, resolve_devices

        env = {**os.environ, **self.env}
        settings = Settings.from_sources(config["handler"], env)
        replicas = len(resolve_devices(settings, cuda_count=lambda: visible_gpus(env)))
        need = job_groups(settings.max_sessions, replicas)
        for key in ("batchSize", "maxNumSequence"):
            if key not in self.model_config_overrides and int(config.get(key) or 0) < need:
                config[key] = need

    def _child_env(self, tmp: Path) -> dict[str, str]:
        env = dict(os.environ)
        env.pop("TS_CONFIG_FILE", None)  # the launcher would prefer it over --ts-config
        env.update(self.env)
        for _, env_name, header in _SEQUENCE_HEADER_KEYS:
            env[env_name] = header
        # TMPDIR: archiver staging dir and the launcher's pid file; TEMP: java.io.tmpdir, where the
        # frontend puts the worker unix sockets (/.ts.sock.<port>, same ports in every instance).
        env["TMPDIR"] = str(tmp)
        env["TEMP"] = str(tmp)
        env.setdefault("PYTHONUNBUFFERED", "1")
        return env

    def _archive(self, model_config: Path, store: Path, temp: Path, env: dict[str, str]) -> None:
        # --extra-files copies a directory's CONTENTS into the model root; stage the package one
        # level down so it lands as <model>/llava_sessions/ and stays importable as a package.
        extra = temp / "extra"
        shutil.copytree(
            _CORE_DIR,
            extra / _CORE_DIR.name,
            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
        )
        command = [
            _console_script("torch-model-archiver"),
            "--model-name",
            MODEL_NAME,
            "--version",
            "1.0",
            "--handler",
            str(self.handler_path.resolve()),
            "--extra-files",
            str(extra),
            "--config-file",
            str(model_config),
            "--archive-format",
            "no-archive",
            "--export-path",
            str(store),
        ]
        result = subprocess.run(command, cwd=temp, env=env, capture_output=True, text=True)
        if result.returncode != 0:
            raise ServerStartError(f"torch-model-archiver failed ({result.returncode}): {result.stderr.strip()}")

    def _config_properties(self, store: Path) -> str:
        lines = [
            "# Written by llava-serve for one local run.",
            f"inference_address=http://{self.host}:{self._ports['inference']}",
            f"management_address=http://127.0.0.1:{self._ports['management']}",
            f"metrics_address=http://127.0.0.1:{self._ports['metrics']}",
            "grpc_inference_address=127.0.0.1",
            f"grpc_inference_port={self._ports['grpc_inference']}",
            "grpc_management_address=127.0.0.1",
            f"grpc_management_port={self._ports['grpc_management']}",
            "disable_token_authorization=true",
            "disable_system_metrics=true",
            # Prometheus on the metrics port, with the handler's own llava_* metrics registered
            # as they are first emitted (no metrics.yaml entry needed).
            "metrics_mode=prometheus",
            "model_metrics_auto_detect=true",
            f"model_store={store}",
            "load_models=ALL",
            f"default_workers_per_model={self.workers}",
            f"max_request_size={_MAX_BODY_BYTES}",
            f"max_response_size={_MAX_BODY_BYTES}",
        ]
        lines += [f"{key}={header}" for key, _, header in _SEQUENCE_HEADER_KEYS]
        return "\n".join(lines) + "\n"

    def _wait_ready(self) -> None:
        """Wait until every worker is READY and ``/ping`` answers 200.

        Raises:
            ServerStartError: TorchServe exited, the handler failed to load, the start-up timeout
                passed, or (:class:`_WorkerDied`) a worker died without a load failure (killed).
        """
        psutil = _psutil()
        deadline = time.monotonic() + self.startup_timeout_s
        status = "no answer from the management API"
        seen: set[int] = set()  # every worker pid this start reported, whatever its state
        while True:
            if self._abort.is_set():
                raise ServerStartError("start-up aborted")
            if self._proc is None or self._proc.poll() is not None:
                code = None if self._proc is None else self._proc.returncode
                raise ServerStartError(f"TorchServe exited during start-up (exit code {code})")
            if self._load_failed():
                raise ServerStartError(f"the handler failed to load the model: {self._worker_error()}")
            ready, status, workers = self._model_ready()
            seen |= workers.keys()
            dead = sorted(pid for pid in seen if not _alive(psutil, pid))
            if dead:
                # a worker that failed to load says so in its log as it exits (next turn raises that);
                # one killed (even the moment it turned READY) stays UNLOADING for good in TorchServe
                if not self._load_failed(wait_s=1.0):
                    raise _WorkerDied(dead)
                continue
            if ready and _http_status(self.url + "/ping") == 200:
                # the supervisor watches these: a worker killed right after is still seen dying
                self._ready_pids = {pid for pid, state in workers.items() if state == "READY"}
                return
            if time.monotonic() > deadline:
                raise ServerStartError(f"TorchServe not ready after {self.startup_timeout_s:.0f} s ({status})")
            time.sleep(_POLL_S)

    def _check_settings(self) -> None:
        """Validate the handler settings the worker will read (the config's ``handler:`` section, the
        overrides, ``LLAVA_*`` variables) before anything starts, as the worker would.

        Raises:
            ServerStartError: a setting is unknown (with the closest valid key) or out of range.
        """
        from llava_sessions.config import Settings

        config = yaml.safe_load(self.config_path.read_text()) or {}
        section = {**dict((config.get("handler") if isinstance(config, dict) else None) or {}), **self.overrides}
        try:
            Settings.check_names(self.overrides, "in --set")
            Settings.from_sources(section, {**os.environ, **self.env})
        except ValueError as exc:
            raise ServerStartError(f"invalid handler settings: {exc}") from None

    def _worker_error(self, wait_s: float = 5.0) -> str:
        """The worker's own error in model_log.log (``ValueError: ...``: the first exception line, the
        handler's; TorchServe's own follows it), or where to look. The frontend copies the worker's
        traceback a line at a time, after the line that says it died: wait up to ``wait_s`` for it."""
        model_log = self.log_dir / "model_log.log"
        deadline = time.monotonic() + wait_s
        while True:
            text = model_log.read_text(errors="replace") if model_log.is_file() else ""
            found = re.findall(r"MODEL_LOG - ((?:\w+\.)*\w*(?:Error|Exception): .*)$", text, re.M)
            if found:
                return found[0]
            if time.monotonic() > deadline:
                return f"see {model_log}"
            time.sleep(_POLL_S)

    def _load_failed(self, wait_s: float = 0.0) -> bool:
        """Whether the handler's log says it failed to load, waiting up to ``wait_s`` for it to."""
        # TorchServe would restart the worker with back-off forever; a local run fails fast. TorchServe
        # 0.12 logs "Failed to load model" for a RuntimeError only; any other exception from the
        # handler's initialize kills the worker process ("Backend worker process died.").
        model_log = self.log_dir / "model_log.log"
        deadline = time.monotonic() + wait_s
        while True:
            text = model_log.read_text(errors="replace") if model_log.is_file() else ""
            if "Failed to load model" in text or "Backend worker process died" in text:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(_POLL_S)

    def _model_ready(self) -> tuple[bool, str, dict[int, str]]:
        """(every worker READY, a status line, each reported worker's state by pid) from TorchServe's
        management API (a worker not started yet reports pid -1 and is left out)."""
        try:
            with _OPENER.open(f"{self.management_url}/models/{MODEL_NAME}", timeout=2) as response:
                described = json.loads(response.read())
        except (OSError, ValueError) as exc:
            return False, f"management API: {exc}", {}
        workers = described[0].get("workers", []) if described else []
        states = [w.get("status") for w in workers]
        by_pid = {int(w["pid"]): str(w.get("status")) for w in workers if int(w.get("pid") or -1) > 0}
        return states.count("READY") >= self.workers, f"worker states {states}", by_pid

    def _frontend_process(self):
        psutil = _psutil()
        proc = self._proc
        if not self.running or proc is None:
            return None
        try:
            for child in psutil.Process(proc.pid).children():
                if child.name().startswith("java"):
                    return child
        except psutil.Error:
            pass
        return None


# ---- process and network helpers ------------------------------------------------------------

_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never a proxy


def _alive(psutil, pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _psutil():
    import psutil  # optional dependency (extras "serve"/"dev"); only needed to find processes

    return psutil


def _connect_host(host: str) -> str:
    return "127.0.0.1" if host in ("", "0.0.0.0") else host


def _http_status(url: str) -> int | None:
    try:
        with _OPENER.open(url, timeout=2) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None


def _temp_base() -> str:
    base = tempfile.gettempdir()
    return base if len(base) <= _MAX_TEMP_BASE_CHARS else "/tmp"


def _console_script(name: str) -> str:
    """Return the console script ``name`` of this interpreter's environment, else from PATH."""
    candidate = Path(sys.executable).parent / name
    if candidate.exists():
        return str(candidate)
    found = shutil.which(name)
    if found is None:
        raise ServerStartError(f"{name} not found; install the 'serve' extra (torchserve 0.12.0)")
    return found


def _pick_ports(host: str, inference_port: int) -> dict[str, int]:
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


def _group_members(pgid: int) -> list[int]:
    """Return the live (non-zombie) pids of process group ``pgid``."""
    psutil = _psutil()
    members = []
    for process in psutil.process_iter():
        try:
            if os.getpgid(process.pid) == pgid and process.status() != psutil.STATUS_ZOMBIE:
                members.append(process.pid)
        except (OSError, psutil.Error):
            continue
    return members


def _stop_process_group(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM the process group led by ``proc``, SIGKILL what is left after ``grace_s``.

    ``proc`` was started with ``start_new_session=True``, so its pid is the group id and the group
    holds exactly the launcher, the Java frontend and the Python workers. Descendants that left the
    group are also tracked by pid (snapshot before signalling).
    """
    psutil = _psutil()
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
        if proc.poll() is not None and not alive() and not _group_members(pgid):
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


# ---- CLI ------------------------------------------------------------------------------------


def _parse_assignment(text: str, *, typed: bool = True) -> tuple[str, Any]:
    """Parse a ``KEY=VALUE`` argument; the value as YAML (``typed``: numbers, booleans) or raw text."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    if not typed:
        return key.strip(), value
    return key.strip(), yaml.safe_load(value) if value.strip() else ""


def _parse_raw_assignment(text: str) -> tuple[str, str]:
    """Parse a ``KEY=VALUE`` argument keeping the value as text (environment variables)."""
    return _parse_assignment(text, typed=False)


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llava-serve",
        description="Serve LLaVA image-chat sessions with a local TorchServe (Ctrl-C to stop).",
    )
    parser.add_argument("--model-dir", required=True, help="Hugging Face LLaVA checkpoint directory")
    parser.add_argument("--port", type=int, default=8080, help="inference port (0: any free port)")
    parser.add_argument("--host", default="127.0.0.1", help="inference bind address")
    parser.add_argument("--workers", type=int, default=1, help="TorchServe workers: 1 (more are refused)")
    parser.add_argument("--config", default=None, help="model-config.yaml to start from")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        type=_parse_assignment,
        metavar="KEY=VALUE",
        help="override a key of the handler: section (repeatable), e.g. --set max_sessions=8",
    )
    parser.add_argument(
        "--ts-set",
        dest="model_config_overrides",
        action="append",
        default=[],
        type=_parse_assignment,
        metavar="KEY=VALUE",
        help="override a top-level TorchServe key of model-config.yaml, e.g. --ts-set batchSize=8",
    )
    parser.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for a READY worker")
    parser.add_argument(
        "--keep-logs",
        action="store_true",
        help="keep TorchServe's logs folder when the server stops (its path is printed); a failed start keeps it",
    )
    parser.add_argument("--handler", default=None, help=argparse.SUPPRESS)  # dev/test: other handler
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``llava-serve``: start TorchServe, print the URL, stop it on SIGINT/SIGTERM."""
    args = _build_parser().parse_args(argv)
    if args.workers > 1:
        print(f"llava-serve: {MULTI_WORKER_REFUSAL}", file=sys.stderr)
        return 2
    server = LocalServer(
        args.model_dir,
        port=args.port,
        host=args.host,
        workers=args.workers,
        config=args.config,
        overrides=dict(args.overrides),
        model_config_overrides=dict(args.model_config_overrides),
        startup_timeout_s=args.startup_timeout,
        handler=args.handler,
        keep_logs=args.keep_logs,
    )
    return run_until_signal(
        "llava-serve",
        server,
        starting=f"starting TorchServe (model dir {server.model_dir})",
        ready=lambda: (
            f"ready at {server.url} (metrics {server.metrics_url}/metrics; model dir {server.model_dir}; "
            f"logs {server.log_dir}; "
            f"frontend pid {server.frontend_pid()}, worker pids {server.worker_pids()})"
        ),
    )


def run_until_signal(prog: str, server: Any, *, starting: str, ready: Callable[[], str]) -> int:
    """Start ``server``, print its ready line, serve until SIGINT/SIGTERM, stop it; return the exit code.

    The shared foreground loop of ``llava-serve``, ``llava-container-serve`` and
    ``llava-local-endpoint``. ``server`` has ``start()``, ``stop()``, ``abort_start()`` and a
    ``running`` property (False: it died; exit 1 with its ``tail_logs()`` if it has them). A signal
    during start-up aborts the start and exits 0; a failed start exits 1.
    """
    stop_requested = threading.Event()
    received: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        received.append(signum)
        stop_requested.set()
        server.abort_start()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        print(f"{prog}: {starting}", flush=True)
        server.start()
        if not stop_requested.is_set():
            print(f"{prog}: {ready()}", flush=True)
        while not stop_requested.wait(1.0):
            if not server.running:
                print(f"{prog}: the server exited unexpectedly", file=sys.stderr, flush=True)
                if hasattr(server, "tail_logs"):
                    print(server.tail_logs(40), file=sys.stderr, flush=True)
                return 1
        print(f"{prog}: signal {received[0]}, stopping", flush=True)
        return 0
    except (ServerStartError, FileNotFoundError) as exc:
        if stop_requested.is_set():
            print(f"{prog}: signal {received[0]} during start-up, stopped", flush=True)
            return 0
        print(f"{prog}: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        server.stop()
        kept = getattr(server, "kept_logs", None)
        print(f"{prog}: stopped" + (f"; logs kept in {kept}" if kept else ""), flush=True)


if __name__ == "__main__":
    sys.exit(main())
