"""``llava-serve``: serve LLaVA image-chat sessions with a local TorchServe until SIGINT / SIGTERM.

Usage::

    llava-serve --model-dir models/tiny --port 8080
    llava-serve --model-dir models/tiny --set session_ttl_s=60 --set max_sessions=8

Beside TorchServe's ``/ping``, ``/invocations`` and ``/predictions/llava``, the port serves OpenAI's
``/v1/chat/completions`` and ``/v1/models`` (:mod:`.front`): ``openai.OpenAI(base_url=
"http://127.0.0.1:8080/v1", api_key="unused")`` works as it is.

The server itself (start, supervision, stop) is :class:`~llava_tools.serve.server.LocalServer`, also
importable from here.
"""

from __future__ import annotations

import argparse
import os
import sys

from ..cli import add_setting_arguments, port_number, run_until_signal
from ..processes import is_loopback
from .server import API_KEY_ENV, LocalServer, ServerStartError
from .torchserve_files import MODEL_NAME, MULTI_WORKER_REFUSAL

__all__ = [
    "MODEL_NAME",
    "LocalServer",
    "ServerStartError",
    "main",
]


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llava-serve",
        description="Serve LLaVA image-chat sessions with a local TorchServe (Ctrl-C to stop).",
    )
    parser.add_argument("--model-dir", required=True, help="Hugging Face LLaVA checkpoint directory")
    parser.add_argument(
        "--port", type=port_number, default=8080, help="inference port (0: any free port; default: 8080)"
    )
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="bind address (default loopback only; 0.0.0.0: every interface, see --api-key)",
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV) or None,
        help=f"require 'Authorization: Bearer <key>' on every request but /ping (default: ${API_KEY_ENV}; "
        "none: anyone who reaches the port may use the model)",
    )
    parser.add_argument("--workers", type=int, default=1, help="TorchServe workers: 1 (more are refused)")
    parser.add_argument("--config", default=None, help="model-config.yaml to start from")
    add_setting_arguments(
        parser,
        handler_help="override a key of the handler: section (repeatable), e.g. --set max_sessions=8",
        torchserve_help="override a top-level TorchServe key of model-config.yaml, e.g. --ts-set batchSize=8",
    )
    parser.add_argument(
        "--startup-timeout", type=float, default=600.0, help="seconds to wait for a READY worker (default: 600)"
    )
    parser.add_argument(
        "--keep-logs",
        action="store_true",
        help="keep TorchServe's logs folder when the server stops (its path is printed); a failed start keeps it",
    )
    parser.add_argument(
        "--no-openai-routes",
        dest="openai_routes",
        action="store_false",
        help="serve only TorchServe's own paths on --port, without OpenAI's /v1/chat/completions and /v1/models",
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
        openai_routes=args.openai_routes,
        api_key=args.api_key,
    )
    if not args.api_key and not is_loopback(args.host):
        print(
            f"llava-serve: WARNING: serving on {args.host} without --api-key: anyone who reaches this port can "
            "use the model (docs/serving.md, Serving beyond localhost)",
            file=sys.stderr,
            flush=True,
        )
    return run_until_signal(
        "llava-serve",
        server,
        starting=f"starting TorchServe (model dir {server.model_dir})",
        ready=lambda: (
            f"ready at {server.bind_url}"
            + ("" if server.bind_url == server.url else f" (from this machine: {server.url})")
            + (" (API key required)" if server.api_key else "")
            + (f" (OpenAI base_url {server.openai_base_url})" if server.openai_routes else "")
            # with a key, TorchServe's own port is the proxy's alone (it wants a key of its own)
            + ("" if server.api_key else f" (TorchServe itself at {server.torchserve_url})")
            + f" (metrics {server.url}/metrics; model dir {server.model_dir}; "
            f"logs {server.log_dir}; "
            f"frontend pid {server.frontend_pid()}, worker pids {server.worker_pids()})"
        ),
    )


if __name__ == "__main__":
    sys.exit(main())
