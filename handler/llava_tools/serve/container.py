"""The container's ``serve`` entrypoint: TorchServe behind its proxy on 0.0.0.0:8080 for a SageMaker endpoint.

SageMaker starts a model container as ``docker run IMAGE serve`` and then expects ``GET /ping`` and
``POST /invocations`` on port 8080; it stops it with SIGTERM and sends SIGKILL 30 s later. The image
(``Dockerfile``) runs ``tini -- serve``; ``/usr/local/bin/serve`` execs ``llava-container-serve``,
which is :func:`main`:

1. find the checkpoint (:func:`resolve_model`): ``--model-dir`` / ``LLAVA_CONTAINER_MODEL_DIR``,
   else ``/opt/ml/model`` (what SageMaker downloaded), else the folder baked into the image at build
   time (``/opt/llava/model``). A folder counts when it holds ``config.json`` itself, or holds the
   ``llava/`` model folder that ``llava-deploy`` uploads (TorchServe's no-archive layout: handler,
   package, ``model-config.yaml`` and the checkpoint files side by side); then that
   ``model-config.yaml`` (with the deploy-time ``--set`` values) is used.
2. start TorchServe with :class:`ContainerServer`, a :class:`~llava_tools.serve.server.LocalServer`
   whose ``config.properties`` is the image's ``config/config.properties`` (token auth off, 6 MiB
   bodies, Prometheus metrics, the SageMaker session headers as sequence keys) with this run's
   addresses filled in: TorchServe's inference, management, metrics and gRPC on free loopback
   ports, and on ``0.0.0.0:8080`` the proxy (:mod:`llava_tools.serve.front`) whose ``/ping`` says
   200 only while the worker serves (TorchServe's own says Healthy before the model is loaded). Like every ``LocalServer`` it raises ``batchSize`` / ``maxNumSequence`` to fit
   ``max_sessions`` on every replica (one per GPU it sees). The handler code is always the image's
   own (``$LLAVA_HOME/handler``), so code and image never disagree; the ``llava_handler.py`` and
   ``llava_sessions/`` inside an uploaded artifact are there for a stock TorchServe and are not
   used here.
3. keep the supervisor on: TorchServe 0.12 with sequence continuous batching never recovers a
   killed worker while its own ``/ping`` keeps answering 200, so the supervisor restarts TorchServe
   (the dead worker's sessions then answer ``404 session_not_found``); meanwhile ``/ping`` answers
   503 and requests a typed ``503 overloaded`` with ``Retry-After``. If TorchServe exits on its own,
   this process exits 1 and SageMaker replaces the container.
4. on SIGTERM / SIGINT: stop TorchServe's process group (SIGTERM, SIGKILL after ``--stop-grace``,
   default 15 s) and exit 0, well inside SageMaker's 30 s.

SageMaker toolkit variables honoured: ``SAGEMAKER_BIND_TO_PORT`` (inference port),
``SAGEMAKER_MODEL_SERVER_TIMEOUT`` (TorchServe ``responseTimeout``, seconds) and
``SAGEMAKER_MODEL_SERVER_WORKERS`` (workers). Handler settings come from ``model-config.yaml`` and
the ``LLAVA_<SETTING>`` variables (docs/configuration.md).

Local use (no Docker; tests do this)::

    llava-container-serve --model-dir models/tiny --port 0
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..cli import run_until_signal
from .server import API_KEY_ENV, LocalServer
from .torchserve_files import (
    MULTI_WORKER_REFUSAL,
    SEQUENCE_HEADER_KEYS,
    ServerStartError,
    default_handler_path,
    default_log_config_path,
    default_model_config_path,
)

__all__ = [
    "BAKED_MODEL_DIR",
    "DEFAULT_PORT",
    "PACKAGED_MODEL_NAME",
    "SAGEMAKER_MODEL_DIR",
    "ContainerServer",
    "ModelNotFoundError",
    "main",
    "resolve_model",
]

#: Where SageMaker puts the model data (``ModelDataUrl`` / ``ModelDataSource``).
SAGEMAKER_MODEL_DIR = Path("/opt/ml/model")
#: Where the Dockerfile's optional bake step puts a checkpoint.
BAKED_MODEL_DIR = Path("/opt/llava/model")
#: The model folder name inside a ``llava-deploy`` artifact (``<prefix>/llava/MAR-INF/...``).
PACKAGED_MODEL_NAME = "llava"
#: SageMaker sends /ping and /invocations to this port.
DEFAULT_PORT = 8080
#: SIGTERM to SIGKILL for TorchServe's group; SageMaker kills the container 30 s after its SIGTERM.
CONTAINER_STOP_GRACE_S = 15.0
#: Keys of config.properties that belong to one run (addresses, ports, model store).
_PER_RUN_KEYS = (
    "inference_address",
    "management_address",
    "metrics_address",
    "grpc_inference_address",
    "grpc_inference_port",
    "grpc_management_address",
    "grpc_management_port",
    "model_store",
    "load_models",
)


#: Keys of config.properties that turn TorchServe's token authorization off or set its keys' life:
#: the run's (on with an API key), whatever the file says.
_TOKEN_AUTH_KEYS = ("disable_token_authorization", "token_expiration_min")


class ModelNotFoundError(FileNotFoundError):
    """No checkpoint folder (one with ``config.json``) in any of the places looked at."""


def llava_home() -> Path:
    """Return the folder holding ``config/``, ``model-config.yaml`` and ``handler/``.

    ``$LLAVA_HOME`` (``/opt/llava`` in the image), else the source checkout this module runs from.
    """
    home = os.environ.get("LLAVA_HOME")
    return Path(home) if home else default_model_config_path().parent


def resolve_model(
    explicit: str | os.PathLike | None = None,
    *,
    candidates: tuple[Path, ...] = (SAGEMAKER_MODEL_DIR, BAKED_MODEL_DIR),
) -> tuple[Path, Path | None]:
    """Find the checkpoint folder and, for a ``llava-deploy`` artifact, its ``model-config.yaml``.

    Args:
        explicit: a folder that must hold the model (``--model-dir``); ``candidates`` are then not
            looked at.
        candidates: folders tried in order when ``explicit`` is None.

    Returns:
        ``(model_dir, model_config)``: ``model_dir`` holds ``config.json``; ``model_config`` is the
        artifact's ``model-config.yaml`` when ``model_dir`` is an artifact's ``llava/`` folder that
        has one, else None (use the image's).

    Raises:
        ModelNotFoundError: no folder qualifies; the message lists what was looked at.
    """
    roots = [Path(explicit)] if explicit is not None else list(candidates)
    looked = []
    for root in roots:
        if (root / "config.json").is_file():
            return root.resolve(), None
        packaged = root / PACKAGED_MODEL_NAME
        if (packaged / "config.json").is_file():
            config = packaged / "model-config.yaml"
            return packaged.resolve(), (config.resolve() if config.is_file() else None)
        looked += [str(root / "config.json"), str(packaged / "config.json")]
    raise ModelNotFoundError(
        "no model: none of " + ", ".join(looked) + " exists. Give the endpoint model data "
        "(llava-deploy uploads <prefix>/llava/), bake one into the image (docker build "
        "--build-arg BAKE_MODEL_ID=... --build-arg BAKE_MODEL_REVISION=<commit>), or pass --model-dir"
    )


def _parse_properties(text: str) -> dict[str, str]:
    """Parse ``key=value`` lines of a Java properties file (comments and blanks skipped)."""
    values: dict[str, str] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line[0] in "#!":
            continue
        key, sep, value = line.partition("=")
        if sep:
            values[key.strip()] = value.strip()
    return values


class ContainerServer(LocalServer):
    """A :class:`LocalServer` whose ``config.properties`` comes from a file (the image's).

    Every key of ``ts_config`` is kept except the per-run ones (addresses, ports, model store),
    which :class:`LocalServer` fills in. The sequence header keys in the file must name the same
    headers as :mod:`llava_tools.serve.torchserve_files` exports to the workers (``TS_REQUEST_SEQUENCE_*``).

    Args:
        model_dir: the checkpoint folder.
        ts_config: the TorchServe ``config.properties`` to start from.
        **kwargs: keyword arguments of :class:`LocalServer`.
    """

    def __init__(self, model_dir: str | os.PathLike, *, ts_config: str | os.PathLike, **kwargs: Any) -> None:
        kwargs.setdefault("openai_routes", False)  # the proxy on 8080 serves /ping and relays /invocations
        super().__init__(model_dir, **kwargs)
        self.ts_config_path = Path(ts_config)
        if not self.ts_config_path.is_file():
            raise FileNotFoundError(f"TorchServe config not found: {self.ts_config_path}")

    def _config_properties(self, store: Path) -> str:
        generated = _parse_properties(super()._config_properties(store))
        from_file = _parse_properties(self.ts_config_path.read_text())
        for key, _, header in SEQUENCE_HEADER_KEYS:
            if from_file.get(key, header) != header:
                raise ServerStartError(
                    f"{self.ts_config_path}: {key}={from_file[key]} but the workers are told "
                    f"{header} (TS_REQUEST_SEQUENCE_*); make them the same"
                )
        merged = dict(from_file)
        for key in _PER_RUN_KEYS:
            merged[key] = generated[key]
        for key in _TOKEN_AUTH_KEYS:  # with an API key, TorchServe's own token authorization is on
            merged.pop(key, None)
            if key in generated:
                merged[key] = generated[key]
        for key, _, header in SEQUENCE_HEADER_KEYS:
            merged[key] = header
        lines = [f"# Written by llava-container-serve from {self.ts_config_path} (per-run addresses filled in)."]
        lines += [f"{key}={value}" for key, value in merged.items()]
        return "\n".join(lines) + "\n"


def _env_int(env: Mapping[str, str], name: str) -> int | None:
    text = env.get(name, "").strip()
    if not text:
        return None
    try:
        return int(text)
    except ValueError:
        raise SystemExit(f"llava-container-serve: {name}={text!r} is not an integer") from None


def _build_parser(env: Mapping[str, str]) -> argparse.ArgumentParser:
    home = llava_home()
    handler = home / "handler" / "llava_handler.py"
    parser = argparse.ArgumentParser(
        prog="llava-container-serve",
        description="SageMaker container entrypoint: TorchServe with the LLaVA session handler "
        "on 0.0.0.0:8080 until SIGTERM.",
    )
    parser.add_argument(
        "--model-dir",
        default=env.get("LLAVA_CONTAINER_MODEL_DIR") or None,
        help="checkpoint folder, or a llava-deploy artifact root (default: $LLAVA_CONTAINER_MODEL_DIR, "
        f"else {SAGEMAKER_MODEL_DIR}, else the baked {BAKED_MODEL_DIR})",
    )
    port = _env_int(env, "SAGEMAKER_BIND_TO_PORT") or _env_int(env, "LLAVA_CONTAINER_PORT")
    parser.add_argument(
        "--port",
        type=int,
        default=DEFAULT_PORT if port is None else port,
        help="inference port; 0 picks a free one (default: $SAGEMAKER_BIND_TO_PORT, "
        f"$LLAVA_CONTAINER_PORT, else {DEFAULT_PORT})",
    )
    parser.add_argument("--host", default=env.get("LLAVA_CONTAINER_HOST", "0.0.0.0"), help="inference bind address")
    parser.add_argument(
        "--ts-config",
        default=str(home / "config" / "config.properties"),
        help="TorchServe config.properties to start from (default: $LLAVA_HOME/config/config.properties)",
    )
    parser.add_argument(
        "--model-config",
        default=None,
        help="model-config.yaml (default: the artifact's, else $LLAVA_HOME/model-config.yaml)",
    )
    parser.add_argument(
        "--handler",
        default=str(handler if handler.is_file() else default_handler_path()),
        help="TorchServe handler file (default: $LLAVA_HOME/handler/llava_handler.py)",
    )
    workers = _env_int(env, "SAGEMAKER_MODEL_SERVER_WORKERS")
    parser.add_argument(
        "--workers", type=int, default=workers or 1,
        help="TorchServe workers (default: $SAGEMAKER_MODEL_SERVER_WORKERS, else 1); more than 1 is refused",
    )  # fmt: skip
    parser.add_argument(
        "--startup-timeout", type=float, default=3600.0,
        help="seconds to wait for a READY worker before giving up (SageMaker's own limit is "
        "ContainerStartupHealthCheckTimeoutInSeconds)",
    )  # fmt: skip
    parser.add_argument(
        "--stop-grace", type=float, default=CONTAINER_STOP_GRACE_S,
        help=f"seconds between SIGTERM and SIGKILL to TorchServe (default {CONTAINER_STOP_GRACE_S:.0f}; "
        "SageMaker's SIGKILL comes 30 s after its SIGTERM)",
    )  # fmt: skip
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the container entrypoint; returns the exit code (0 after SIGTERM/SIGINT).

    A first argument ``serve`` is accepted and ignored (``docker run IMAGE serve``).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:
        argv = argv[1:]
    env = os.environ
    args = _build_parser(env).parse_args(argv)
    if args.workers > 1:  # --workers or $SAGEMAKER_MODEL_SERVER_WORKERS
        print(f"llava-container-serve: {MULTI_WORKER_REFUSAL}", file=sys.stderr, flush=True)
        return 1
    try:
        model_dir, artifact_config = resolve_model(args.model_dir)
    except ModelNotFoundError as exc:
        print(f"llava-container-serve: {exc}", file=sys.stderr, flush=True)
        return 1
    model_config = args.model_config or artifact_config or (llava_home() / "model-config.yaml")
    if not Path(model_config).is_file():
        model_config = default_model_config_path()
    model_config_overrides: dict[str, Any] = {}
    response_timeout = _env_int(env, "SAGEMAKER_MODEL_SERVER_TIMEOUT")
    if response_timeout:
        model_config_overrides["responseTimeout"] = response_timeout

    try:
        server = ContainerServer(
            model_dir,
            ts_config=args.ts_config,
            port=args.port,
            host=args.host,
            workers=args.workers,
            config=model_config,
            model_config_overrides=model_config_overrides,
            handler=args.handler,
            log_config=default_log_config_path(llava_home()),
            startup_timeout_s=args.startup_timeout,
            stop_grace_s=args.stop_grace,
            supervise=True,
            env={"TOKENIZERS_PARALLELISM": env.get("TOKENIZERS_PARALLELISM", "false")},
            # off unless set: SageMaker authenticates every caller (SigV4) before the container
            api_key=env.get(API_KEY_ENV) or None,
        )
    except (FileNotFoundError, ValueError) as exc:
        print(f"llava-container-serve: {exc}", file=sys.stderr, flush=True)
        return 1
    return run_until_signal(
        "llava-container-serve",
        server,
        starting=(
            f"starting TorchServe (model {model_dir}, model config {model_config}, "
            f"handler {args.handler}, TorchServe config {args.ts_config})"
        ),
        ready=lambda: (
            f"ready at {server.bind_url}"
            + (" (API key required)" if server.api_key else "")
            + f" (metrics {server.url}/metrics; logs {server.log_dir}; "
            f"frontend pid {server.frontend_pid()}, worker pids {server.worker_pids()})"
        ),
    )


if __name__ == "__main__":
    sys.exit(main())
