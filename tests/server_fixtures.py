"""Helpers to run a real local TorchServe in tests (import from conftest.py or a test module).

- :func:`start_local_server` starts a :class:`~llava_tools.serve.server.LocalServer` and registers its
  stop with a finalizer (``request.addfinalizer``), so a failing test never leaks a TorchServe.
- ``local_server_factory`` (function scope) and ``session_server_factory`` (session scope) are
  fixtures returning ``factory(model_dir, **LocalServer_kwargs) -> LocalServer``; every server they
  started is stopped at teardown. Re-export them from conftest.py to use them::

      from server_fixtures import local_server_factory, session_server_factory  # noqa: F401

- :data:`ECHO_HANDLER_SOURCE` / :func:`write_echo_handler`: a model-free TorchServe handler that
  does sequence continuous batching the way ours does, for tests of the serving plumbing.
- :class:`ImageHost`: an image host on 127.0.0.1 that can be slow or fail, and counts its fetches.
"""

from __future__ import annotations

import http.server
import os
import queue
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlencode, urlsplit

import pytest
import requests

from llava_tools.serve import LocalServer

__all__ = [
    "ECHO_HANDLER_SOURCE",
    "ImageHost",
    "OutputLines",
    "stop_process",
    "local_server_factory",
    "prometheus_text",
    "worker_metric",
    "session_server_factory",
    "start_local_server",
    "write_echo_handler",
]


class ImageHost:
    """An image host on 127.0.0.1 (a real HTTP server in a thread): ``GET <path>?delay=S&status=N``
    answers ``payload`` after S seconds with status N (200 by default). ``hits``: the paths asked, in
    order. Use as a context manager (it stops on exit)."""

    def __init__(self, payload: bytes) -> None:
        self.payload = payload
        self.hits: list[str] = []
        host = self

        class _Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                host.hits.append(urlsplit(self.path).path)
                query = parse_qs(urlsplit(self.path).query)
                time.sleep(float(query.get("delay", ["0"])[0]))
                status = int(query.get("status", ["200"])[0])
                body = host.payload if status == 200 else b"no"
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "image/png")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except OSError:
                    pass  # the fetch gave up first

            def log_message(self, *args: Any) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def url(self, path: str = "/photo.png", **query: Any) -> str:
        """The URL of ``path`` with ``query`` (``delay``, ``status``)."""
        tail = "?" + urlencode(query) if query else ""
        return f"http://127.0.0.1:{self._server.server_address[1]}{path}{tail}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> ImageHost:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def start_local_server(
    model_dir: str | os.PathLike,
    *,
    addfinalizer: Callable[[Callable[[], None]], Any] | None = None,
    **kwargs: Any,
) -> LocalServer:
    """Start a LocalServer (its own temp dir, free ports) and register its stop.

    Args:
        model_dir: checkpoint directory (any existing directory for the echo handler).
        addfinalizer: e.g. ``request.addfinalizer``; registered BEFORE start so a half-started
            server is cleaned up too. Without it the caller must call ``stop()``.
        **kwargs: keyword arguments of :class:`LocalServer` (``overrides``, ``handler``, ...).

    Raises:
        ServerStartError: TorchServe did not become ready (the message holds a log tail).
    """
    server = LocalServer(model_dir, **kwargs)
    if addfinalizer is not None:
        addfinalizer(server.stop)
    return server.start()


def prometheus_text(metrics_url: str, until: Callable[[str], bool], timeout_s: float = 10.0) -> str:
    """The metrics port's Prometheus text once ``until(text)`` holds (or at ``timeout_s``).

    The handler writes its metric lines after the answer went out (llava_sessions.metrics) and
    TorchServe's frontend parses them from the worker's stdout, so a reply can arrive before its
    metrics are there.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        text = requests.get(metrics_url + "/metrics", timeout=10).text
        if until(text) or time.monotonic() > deadline:
            return text
        time.sleep(0.1)


def worker_metric(
    server: LocalServer,
    name: str,
    until: Callable[[dict[str, float]], bool] = lambda values: True,
    timeout_s: float = 10.0,
) -> dict[str, float]:
    """The worker's metric ``name`` (``llava_OpenSessions``, ...) by replica, from the metrics port once
    ``until(values)`` holds (or after ``timeout_s``: :func:`prometheus_text`)."""

    def values(text: str) -> dict[str, float]:
        return {
            m.group(1): float(m.group(2))
            for m in re.finditer(rf'^{name}{{[^}}]*Replica="(\d+)"[^}}]*}} ([0-9.e+-]+)$', text, re.M)
        }

    return values(prometheus_text(server.metrics_url, lambda text: until(values(text)), timeout_s))


def wait_until_answering(url: str, session_id: str, timeout_s: float = 30) -> None:
    """Wait until ``session_id`` is answering a question on the server at ``url``: a reset then gets
    409 ``session_busy`` at once (before the answer starts, a reset of a session with no history yet
    changes nothing). Unlike a metric, which the worker reports on its own cadence, this is exact.

    Raises:
        AssertionError: the session did not start answering within ``timeout_s`` seconds.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        reset = requests.post(
            f"{url}/invocations",
            json={"type": "reset"},
            headers={"X-Amzn-SageMaker-Session-Id": session_id},
            timeout=10,
        )
        if reset.status_code == 409:
            return
    raise AssertionError(f"session {session_id} never started answering")


def _factory(addfinalizer: Callable[[Callable[[], None]], Any]) -> Callable[..., LocalServer]:
    def factory(model_dir: str | os.PathLike, **kwargs: Any) -> LocalServer:
        return start_local_server(model_dir, addfinalizer=addfinalizer, **kwargs)

    return factory


@pytest.fixture
def local_server_factory(request: pytest.FixtureRequest) -> Callable[..., LocalServer]:
    """Return ``factory(model_dir, **kwargs) -> LocalServer``; servers stop after the test."""
    return _factory(request.addfinalizer)


@pytest.fixture(scope="session")
def session_server_factory(request: pytest.FixtureRequest) -> Callable[..., LocalServer]:
    """Return ``factory(model_dir, **kwargs) -> LocalServer``; servers stop after the session."""
    return _factory(request.addfinalizer)


#: A TorchServe handler without a model. Per row it answers JSON
#: ``{"session_id", "start", "pid", "headers", "body", "env"}`` where ``session_id`` is
#: ``ctx.get_sequence_id(i)`` and ``start`` the value of the sequence-start header. A JSON body
#: ``{"close": true}`` makes it set the sequence-end response header (ends the TorchServe job group);
#: ``{"status": N}`` sets that row's HTTP status. Like our handler it sets ``ctx.stopping_criteria``
#: (returning None: one complete answer per request) and never raises for one bad row.
ECHO_HANDLER_SOURCE = """\
import json
import os


class EchoHandler:
    def initialize(self, context):
        self.initialized = True

    def handle(self, data, context):
        outputs = []
        for idx, row in enumerate(data):
            body = row.get("body") if row.get("body") is not None else row.get("data")
            if isinstance(body, (bytes, bytearray)):
                try:
                    body = json.loads(body.decode("utf-8")) if body else {}
                except ValueError:
                    body = {"raw": body.decode("utf-8", "replace")}
            if not isinstance(body, dict):
                body = {"value": body}
            session_id = context.get_sequence_id(idx)
            start = context.get_request_header(idx, context.header_key_sequence_start)
            if body.get("close"):
                context.set_response_header(idx, context.header_key_sequence_end, session_id or "")
            if body.get("status"):
                context.set_response_status(int(body["status"]), "echo status", idx)
            context.set_response_content_type(idx, "application/json")
            outputs.append(json.dumps({
                "session_id": session_id,
                "start": start,
                "pid": os.getpid(),
                "headers": sorted(context.get_all_request_header(idx)),
                "body": body,
                "env": {k: v for k, v in os.environ.items() if k.startswith("TS_REQUEST_SEQUENCE")},
            }))
        context.stopping_criteria = [lambda _output: None for _ in data]
        return outputs
"""


def write_echo_handler(directory: str | os.PathLike) -> Path:
    """Write :data:`ECHO_HANDLER_SOURCE` to ``directory/echo_handler.py`` and return its path."""
    path = Path(directory) / "echo_handler.py"
    path.write_text(ECHO_HANDLER_SOURCE)
    return path


class OutputLines:
    """Collect a subprocess's stdout lines in a thread, so that waiting for a line can time out.

    Args:
        stream: the process's text stdout.
        process: the process; when given, waiting stops early once it exited and all it said was read.
    """

    def __init__(self, stream, process: subprocess.Popen | None = None) -> None:
        self.process = process
        self.lines: list[str] = []
        self._queue: queue.Queue[str] = queue.Queue()
        self._reader = threading.Thread(target=lambda: [self._queue.put(line) for line in stream], daemon=True)
        self._reader.start()

    def wait_for(self, pattern: re.Pattern, timeout_s: float) -> re.Match:
        """Return the first match of ``pattern`` in a new line; AssertionError with the output if none."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                line = self._queue.get(timeout=0.2)
            except queue.Empty:
                if self.process is not None and self.process.poll() is not None and not self._reader.is_alive():
                    break  # it exited and everything it said has been read
                continue
            self.lines.append(line)
            match = pattern.search(line)
            if match:
                return match
        raise AssertionError(f"no line matching {pattern.pattern!r}; output:\n{''.join(self.lines)}")

    def drain(self) -> str:
        """Everything the process said so far (the lines read and those still queued), as one text."""
        while True:
            try:
                self.lines.append(self._queue.get_nowait())
            except queue.Empty:
                return "".join(self.lines)


def stop_process(process: subprocess.Popen, timeout_s: float = 40.0, sig: int = signal.SIGTERM) -> bool:
    """Stop a process a test started and everything it started, whatever happens: ``sig`` (SIGTERM
    by default, so that a CLI stops the TorchServe process groups it started; SIGINT for Ctrl-C),
    then, after ``timeout_s``, SIGKILL to it and to every descendant seen while it ran (TorchServe's
    own sessions and process groups included, which a kill of the CLI alone would orphan). Any
    descendant still running after the process exited is killed too. Returns True when ``sig``
    stopped it (False: it had exited before, or needed the SIGKILL)."""
    import psutil

    tree: dict[int, psutil.Process] = {}
    by_sig = False

    def look() -> None:
        try:
            for child in psutil.Process(process.pid).children(recursive=True):
                tree.setdefault(child.pid, child)
        except psutil.NoSuchProcess:
            pass

    if process.poll() is None:
        look()
        process.send_signal(sig)
        deadline = time.monotonic() + timeout_s
        while process.poll() is None and time.monotonic() < deadline:
            look()  # what it starts while it stops is stopped too
            time.sleep(0.2)
        by_sig = process.poll() is not None
        if not by_sig:
            look()
            process.kill()
        process.wait()
    for child in tree.values():
        try:
            if child.is_running():  # the same process (psutil checks its start time), not a reused pid
                child.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(list(tree.values()), timeout=10)
    return by_sig
