"""A local TorchServe serving the handler: :class:`LocalServer` (start, wait until ready, supervise, stop).

``LocalServer`` builds a no-archive model folder from ``model-config.yaml`` and the handler
(:mod:`.torchserve_files`), writes a ``config.properties`` with free loopback ports, starts
``torchserve --foreground`` in its own process group with its own ``TMPDIR`` and working directory
(so pid file, unix sockets and ``./logs`` are its own), waits until the model's worker is READY, and
on :meth:`LocalServer.stop` ends exactly that process group. It never calls ``torchserve --stop``
(which acts on a pid file) and never kills by name. The ``llava-serve`` command line is :mod:`.cli`.

Usage::

    with LocalServer("models/tiny", overrides={"max_sessions": 4}) as server:
        requests.post(server.url + "/invocations", json=...)
"""

from __future__ import annotations

import atexit
import errno
import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import yaml

from llava_sessions.wire.contract import IMAGE_RELAY_ENV

from ..cli import checkpoint_folder_problem
from ..processes import (
    connect_host,
    load_psutil,
    pick_ports,
    stop_process_group,
    temp_base,
)
from . import torchserve_files as ts_files
from .front import OPENAI_PREFIX, OpenAIFront
from .image_relay import ImageRelay
from .slot_queue import SlotQueue
from .supervisor import Supervised
from .torchserve_files import (
    KEY_FILE,
    ServerStartError,
    default_handler_path,
    default_log_config_path,
    default_model_config_path,
)

if TYPE_CHECKING:
    from llava_sessions.config import Settings

__all__ = ["API_KEY_ENV", "DEFAULT_STOP_GRACE_S", "LocalServer", "ServerStartError"]

#: The environment variable ``llava-serve``, ``llava-local-endpoint`` and the container read the API key from.
API_KEY_ENV = "LLAVA_API_KEY"

#: Seconds between SIGTERM to the process group and SIGKILL.
DEFAULT_STOP_GRACE_S = 20.0


class LocalServer(Supervised):
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
        openai_routes: serve OpenAI's ``/v1/chat/completions`` and ``/v1/models`` on the public port
            beside TorchServe's own paths. Either way the public port is the proxy's
            (:class:`~llava_tools.serve.front.OpenAIFront`): it answers ``/ping`` itself, 200 only
            while the worker serves, and a request while it does not with a typed 503 and
            ``Retry-After``; TorchServe listens on a loopback port of its own (:attr:`torchserve_url`).
        api_key: the public port requires ``Authorization: Bearer <api_key>`` on every request but
            ``/ping`` (``401 invalid_api_key`` otherwise); None or empty: no key (the default).

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
        openai_routes: bool = True,
        api_key: str | None = None,
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
        self._launched_at = self._start_s = 0.0  # TorchServe's last launch (monotonic), its start's seconds
        self._watched: set[int] = set()
        self._supervisor: threading.Thread | None = None
        self.supervise = supervise
        self.supervise_interval_s = 0.5
        #: How many times the supervisor relaunched TorchServe after a worker died.
        self.restarts = 0
        self.keep_logs = keep_logs
        self.openai_routes = openai_routes
        #: The key every request but ``/ping`` must carry as ``Authorization: Bearer <key>`` (None: open).
        self.api_key = api_key or None
        self._front: OpenAIFront | None = None  # the public port's proxy
        self._settings: Settings | None = None  # the handler settings the worker will read
        #: Where the logs were kept when the server stopped (``keep_logs``, or a failed start), or None.
        self.kept_logs: Path | None = None

    # ---- public surface -------------------------------------------------------------------

    @property
    def url(self) -> str:
        """Inference base URL (``/ping``, ``/invocations``, ``/predictions/llava``; ``/v1/...`` with ``openai_routes``)."""
        return f"http://{connect_host(self.host)}:{self._port('public')}"

    @property
    def bind_url(self) -> str:
        """The public port as bound: ``http://<host>:<port>`` (``0.0.0.0`` for every interface)."""
        return f"http://{self.host}:{self._port('public')}"

    @property
    def openai_base_url(self) -> str:
        """The ``base_url`` for the ``openai`` package (``<url>/v1``). Raises RuntimeError without ``openai_routes``."""
        if not self.openai_routes:
            raise RuntimeError("this server was started without openai_routes")
        return self.url + OPENAI_PREFIX

    @property
    def torchserve_url(self) -> str:
        """TorchServe's own inference base URL (loopback; the public :attr:`url` is the proxy's)."""
        return f"http://127.0.0.1:{self._port('inference')}"

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

    def torchserve_keys(self) -> dict[str, str]:
        """TorchServe's own ``inference`` and ``management`` keys while its token authorization is on
        (with an API key: then no port answers an inference or management request without a key;
        the proxy sends the inference key), read from the ``key_file.json`` of its current launch
        (:func:`~llava_tools.serve.torchserve_files.token_keys`); {} without an API key."""
        return ts_files.token_keys(self.temp_dir / KEY_FILE) if self.api_key and self._temp_dir else {}

    def worker_pids(self) -> list[int]:
        """Return the pids of TorchServe's Python worker processes (children of the frontend)."""
        frontend = self._frontend_process()
        return [] if frontend is None else ts_files.worker_pids_of(frontend)

    def tail_logs(self, n: int = 50) -> str:
        """The last ``n`` lines of TorchServe's frontend log and of the handler's log
        (:func:`~llava_tools.serve.torchserve_files.tail_logs`); "" before a start."""
        return "" if self._temp_dir is None else ts_files.tail_logs(self._temp_dir, n)

    def start(self) -> LocalServer:
        """Build the model folder, start TorchServe and wait until the worker serves.

        Returns:
            self.

        Raises:
            ServerStartError: the archiver failed, TorchServe exited, or no READY worker and
                ``/ping`` 200 within ``startup_timeout_s`` (the server is stopped first).
            FileNotFoundError: ``model_dir``, the config or the handler file does not exist, or
                (with our handler) ``model_dir`` holds no ``config.json``.
            RuntimeError: already started.
        """
        with self._lock:
            if self._proc is not None:
                raise RuntimeError("server already started")
            self.check()
            self._temp_dir = Path(tempfile.mkdtemp(prefix="llava-serve-", dir=temp_base()))
            atexit.register(self.stop)
        try:
            self._prepare_and_launch()
            self._wait_ready()
            if self.supervise:
                self._start_supervisor()
        except BaseException as exc:
            tail = self.tail_logs(40)
            # a failed start keeps its logs to read; one the user stopped (Ctrl-C, a signal) leaves nothing
            self.stop(keep_logs=not (isinstance(exc, KeyboardInterrupt) or self._abort.is_set()))
            if isinstance(exc, ServerStartError):
                kept = f"\nlogs kept in {self.kept_logs}" if self.kept_logs else ""
                raise ServerStartError(f"{exc}\n{tail}{kept}") from None
            raise
        return self

    def check(self) -> None:
        """What a start would be refused for, said before anything starts (the CLIs call it before their
        "starting" line; :meth:`start` calls it first): the folders and files exist, the model folder is a
        checkpoint, the handler settings are valid, and the public port is free (the proxy binds it now,
        not ready until the worker serves). Idempotent.

        Raises:
            FileNotFoundError: as :meth:`start`. ServerStartError: a setting is invalid, or the port is taken.
        """
        problem = checkpoint_folder_problem(self.model_dir)
        if problem is not None and (self.handler_path == default_handler_path() or not self.model_dir.exists()):
            raise FileNotFoundError(problem)  # said now, not after TorchServe's start and the worker's failed load
        for path, what in (
            (self.config_path, "model config"),
            (self.handler_path, "handler file"),
            (self.log_config_path, "log config"),
        ):
            if path is not None and not path.exists():
                raise FileNotFoundError(f"{what} not found: {path}")
        if self._settings is None:  # the handler settings the worker will read, validated before anything starts
            self._settings = ts_files.check_settings(
                self.config_path, self.overrides, {**os.environ, **self.env}, self.model_config_overrides
            )
        self._bind_front()

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
            stop_process_group(proc, self.stop_grace_s)
        front, self._front = self._front, None
        if front is not None:
            front.stop()
        if self._console is not None:
            self._console.close()
            self._console = None
        if temp_dir is not None:
            if keep_logs or self.keep_logs:
                self.kept_logs = ts_files.keep_logs(temp_dir) or self.kept_logs
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

    def _bind_ports(self) -> None:
        """Bind the proxy on the public port first (not ready: ``/ping`` 503 until the worker
        serves), then pick TorchServe's own loopback ports.

        Raises:
            ServerStartError: the public port is taken.
        """
        self._bind_front()
        assert self._front is not None
        self._ports = pick_ports("127.0.0.1", 0)
        self._front.backend = ("127.0.0.1", self._ports["inference"])
        self._front.metrics = ("127.0.0.1", self._ports["metrics"])
        self._ports["public"] = self._front.port

    def _bind_front(self) -> None:
        """Bind the proxy on the public port, once (not ready: ``/ping`` 503 until the worker serves).

        Raises:
            ServerStartError: the port is taken (the message says to choose another).
        """
        if self._front is not None:
            return
        served = self._settings.served_model_name if self._settings is not None else ()
        settings = self._settings
        images = ImageRelay(settings) if settings is not None else None
        queue = SlotQueue(settings.queue_max_requests, settings.queue_timeout_s) if settings else None
        try:
            front = OpenAIFront(
                (self.host, self._requested_port),
                ("127.0.0.1", 0),
                served or (self.model_dir.name,),
                routes=self.openai_routes,
                images=images,
                api_key=self.api_key,
                queue=queue,
            )
            self._front = front.start()
        except OSError as exc:
            hint = " (choose another with --port; 0 picks a free one)" if exc.errno == errno.EADDRINUSE else ""
            raise ServerStartError(f"cannot listen on {self.host}:{self._requested_port}: {exc}{hint}") from None

    def _prepare_and_launch(self) -> None:
        temp = self.temp_dir
        tmp = temp / "tmp"
        store = temp / "model-store"
        tmp.mkdir()
        store.mkdir()
        self._bind_ports()

        model_config = self._write_model_config(temp / "model-config.yaml")
        relay = {IMAGE_RELAY_ENV: f"http://{connect_host(self.host)}:{self._port('public')}"}
        self._child_env_cache = env = ts_files.child_env({**self.env, **relay}, tmp)
        ts_files.archive(self.handler_path, model_config, store, temp, env)
        ts_config = temp / "config.properties"
        ts_config.write_text(self._config_properties(store))
        self._command = [
            ts_files.console_script("torchserve"),
            "--start",
            "--foreground",
            "--ts-config",
            str(ts_config),
            "--model-store",
            str(store),
            "--ncs",
        ]
        if not self.api_key:  # with a key, TorchServe's own ports want theirs too (torchserve_keys)
            self._command.append("--disable-token-auth")
        if self.log_config_path is not None:
            self._command += ["--log-config", str(self.log_config_path)]
        self._launch()

    def _launch(self) -> None:
        temp = self.temp_dir
        (temp / KEY_FILE).unlink(missing_ok=True)  # each launch writes new keys: never read the last one's
        self._console = open(temp / "console.log", "ab")  # noqa: SIM115 - closed in stop()
        self._launched_at = time.monotonic()
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

    def _write_model_config(self, path: Path) -> Path:
        """Write this server's model-config.yaml (:func:`~llava_tools.serve.torchserve_files.model_config`) to ``path``."""
        config = ts_files.model_config(
            self.config_path,
            model_dir=self.model_dir,
            workers=self.workers,
            overrides=self.overrides,
            model_config_overrides=self.model_config_overrides,
            env={**os.environ, **self.env},
        )
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        return path

    def _config_properties(self, store: Path) -> str:
        return ts_files.config_properties("127.0.0.1", self._ports, store, self.workers, token_auth=bool(self.api_key))

    def _frontend_process(self):
        psutil = load_psutil()
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
