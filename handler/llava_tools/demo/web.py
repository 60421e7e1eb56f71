"""The chat page on a local server: ``python -m llava_tools.demo.web [--model-dir DIR]`` (``make web``).

Like ``make demo``: without ``--model-dir`` it builds the ``tiny`` random-weight checkpoint (its
answers are gibberish; the serving path is the real one). It starts ``llava-serve``'s
:class:`~llava_tools.serve.server.LocalServer` on a free port and the ``llava-web`` page
(:class:`llava_client.web.ChatPage`) talking to it, prints the page's URL, and serves until
Ctrl-C (SIGINT) or SIGTERM, then closes the page's sessions and stops exactly the TorchServe it
started. Exit status 0 after a signal, 1 when the server or the page could not start or the server
died.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import tempfile
import threading
from pathlib import Path

from llava_client import SessionClient
from llava_client.web import ChatPage, WebChat

from ..cli import checkpoint_folder_problem, port_number, run_until_signal
from ..serve import LocalServer

__all__ = ["WebDemo", "main"]


class WebDemo:
    """A local server and the chat page in front of it, started and stopped as one.

    Has what :func:`llava_tools.cli.run_until_signal` drives: ``start``, ``stop``,
    ``abort_start``, ``running`` (the server's) and ``tail_logs``.

    Args:
        model_dir: the checkpoint folder, or None to build the ``tiny`` one in ``work_dir``.
        work_dir: where the tiny checkpoint is written.
        host, port: the page's bind address and port.
    """

    def __init__(self, model_dir: Path | None, work_dir: Path, *, host: str, port: int) -> None:
        self.model_dir = model_dir
        self.work_dir = work_dir
        self.host = host
        self.port = port
        self.server: LocalServer | None = None
        self.page: ChatPage | None = None
        self.client: SessionClient | None = None
        self._aborted = False

    def start(self) -> None:
        """Build the tiny checkpoint if needed, start the server, then the page.

        Raises:
            ServerStartError: TorchServe did not start. OSError: the page's port is taken.
        """
        if self.model_dir is None:
            from ..tiny_model import write_checkpoint

            print("webdemo: building the tiny random-weight checkpoint", flush=True)
            self.model_dir = Path(write_checkpoint("tiny", self.work_dir / "tiny-llava", seed=0))
        self.server = LocalServer(self.model_dir, startup_timeout_s=900.0)
        if self._aborted:
            return
        # the page's library takes seconds to import (6.4 s here): on a thread while TorchServe starts
        # in its own processes and this one waits on them, not after
        threading.Thread(target=importlib.import_module, args=("gradio",), name="import-gradio", daemon=True).start()
        self.server.start()
        if self._aborted:
            return
        self.client = SessionClient.from_url(self.server.url)
        self.page = ChatPage(WebChat(self.client), host=self.host, port=self.port, target=self.server.url)
        self.page.start()

    def abort_start(self) -> None:
        """A signal arrived during start-up: stop starting."""
        self._aborted = True
        if self.server is not None:
            self.server.abort_start()

    @property
    def running(self) -> bool:
        """True while the server runs (through a worker restart too)."""
        return self.server is not None and self.server.running

    def ready_line(self) -> str:
        """What the ready line says: the page's and the server's addresses."""
        assert self.page is not None and self.server is not None
        return f"chat page at {self.page.url} (server {self.server.url}); Ctrl-C stops"

    def tail_logs(self, n: int = 40) -> str:
        """The server's last log lines."""
        return self.server.tail_logs(n) if self.server is not None else ""

    def stop(self) -> None:
        """Close the page's sessions and the page, then stop the server. Idempotent."""
        if self.page is not None:
            self.page.stop()
            self.page = None
        if self.client is not None:
            self.client.close()
            self.client = None
        if self.server is not None:
            self.server.stop()


def main(argv: list[str] | None = None) -> int:
    """Run the web demo; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m llava_tools.demo.web", description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, help="a llava-hf checkpoint folder (default: build `tiny`)")
    parser.add_argument("--host", default="127.0.0.1", help="the page's bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=port_number, default=7860, help="the page's port (default 7860)")
    args = parser.parse_args(argv)
    problem = None if args.model_dir is None else checkpoint_folder_problem(args.model_dir)
    if problem is not None:
        print(f"webdemo: {problem}", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory(prefix="llava-webdemo-") as tmp:
        demo = WebDemo(args.model_dir, Path(tmp), host=args.host, port=args.port)
        try:
            return run_until_signal("webdemo", demo, starting="starting the server and the page", ready=demo.ready_line)
        except OSError as exc:  # the page's port is taken (run_until_signal has stopped the server)
            print(f"webdemo: cannot serve the page on {args.host}:{args.port}: {exc}", file=sys.stderr)
            return 1


if __name__ == "__main__":
    sys.exit(main())
