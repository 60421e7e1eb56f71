"""What the tools' command lines share: ``KEY=VALUE`` arguments and the foreground loop of a server.

``llava-serve``, ``llava-container-serve``, ``llava-local-endpoint``, ``llava-deploy`` and the web
demo import these by name.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

__all__ = [
    "StartError",
    "add_setting_arguments",
    "parse_assignment",
    "parse_raw_assignment",
    "port_number",
    "run_until_signal",
]


class StartError(RuntimeError):
    """A server could not be prepared or did not become ready; the message says why."""


def parse_assignment(text: str, *, typed: bool = True) -> tuple[str, Any]:
    """Parse a ``KEY=VALUE`` argument; the value as YAML (``typed``: numbers, booleans) or raw text."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    if not typed:
        return key.strip(), value
    return key.strip(), yaml.safe_load(value) if value.strip() else ""


def port_number(text: str) -> int:
    """An argparse ``type`` for a TCP port, 0..65535 (0: any free port)."""
    if not text.strip().isdigit() or not 0 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"a port is a number from 0 to 65535, got {text!r}")
    return int(text)


def parse_raw_assignment(text: str) -> tuple[str, str]:
    """Parse a ``KEY=VALUE`` argument keeping the value as text (environment variables)."""
    return parse_assignment(text, typed=False)


def add_setting_arguments(
    parser: argparse.ArgumentParser, *, handler_help: str, torchserve_help: str | None = None
) -> None:
    """Add the repeatable ``--set KEY=VALUE`` (a key of model-config.yaml's ``handler:`` section, into
    ``args.overrides``) and, where ``torchserve_help`` is given, ``--ts-set KEY=VALUE`` (a top-level
    TorchServe key, into ``args.model_config_overrides``); each a list of ``(key, value)`` pairs with the
    value parsed as YAML (:func:`parse_assignment`)."""
    assignments: dict[str, Any] = {"action": "append", "default": [], "type": parse_assignment, "metavar": "KEY=VALUE"}
    parser.add_argument("--set", dest="overrides", help=handler_help, **assignments)
    if torchserve_help is not None:
        parser.add_argument("--ts-set", dest="model_config_overrides", help=torchserve_help, **assignments)


def checkpoint_folder_problem(model_dir: str | Path) -> str | None:
    """What is wrong with ``model_dir`` as a llava-hf checkpoint folder, in the one sentence every tool
    says (``llava-serve``, ``make demo``, ``llava-deploy``), or None when it holds a config.json."""
    path = Path(model_dir)
    fix = "give the folder 'hf download' wrote, or build one with llava-tiny-model"
    if not path.exists():
        return f"the model folder {path} does not exist: {fix}"
    if not (path / "config.json").is_file():
        return f"{path} is not a llava-hf checkpoint folder (no config.json): {fix}"
    return None


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
        check = getattr(server, "check", None)
        if check is not None:  # what it would be refused for is said before the "starting" line
            check()
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
    except (StartError, FileNotFoundError) as exc:
        if stop_requested.is_set():
            print(f"{prog}: signal {received[0]} during start-up, stopped", flush=True)
            return 0
        print(f"{prog}: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        server.stop()
        kept = getattr(server, "kept_logs", None)
        print(f"{prog}: stopped" + (f"; logs kept in {kept}" if kept else ""), flush=True)
