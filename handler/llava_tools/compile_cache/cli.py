"""``llava-compile-cache``: compile a model folder's text layers as a worker would and write what
Inductor compiled into the folder (:mod:`llava_sessions.model.gpu.compile_cache`), so every later worker
start on a GPU of the same architecture finds it compiled.

Usage (on a GPU of the deployment's architecture, before ``llava-deploy`` packages the folder)::

    llava-compile-cache --model-dir models/7b --set device=cuda --set dtype=bfloat16
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from llava_sessions.model.gpu.compile_cache import cache_counts, compile_cache_file, save_compile_cache
from llava_sessions.model.gpu.regions import compiled_regions
from llava_sessions.worker import WorkerOrigin, build_local_service

from ..cli import add_setting_arguments
from ..serve.torchserve_files import default_model_config_path, read_model_config

__all__ = ["main"]


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llava-compile-cache",
        description="Compile the text layers as a worker does (compile: on) and write the compile cache "
        "into the model folder, for the device and dtype of the settings.",
    )
    parser.add_argument("--model-dir", required=True, help="Hugging Face LLaVA checkpoint directory")
    parser.add_argument("--config", default=None, help="model-config.yaml whose handler: section the worker reads")
    add_setting_arguments(parser, handler_help="override a key of the handler: section, e.g. --set dtype=bfloat16")
    parser.add_argument("--json", action="store_true", help="print what was done as one JSON object")
    return parser


def _handler_section(args: argparse.Namespace) -> dict[str, Any]:
    """The ``handler:`` section of ``--config`` (model-config.yaml), ``--set`` over it, the model folder
    and ``compile: on``. Raises ValueError, OSError: as :func:`read_model_config`."""
    section = read_model_config(Path(args.config or default_model_config_path()))["handler"]
    return {**section, **dict(args.overrides), "model_dir": str(args.model_dir), "compile": "on"}


def compile_and_save(args: argparse.Namespace) -> dict[str, Any]:
    """Build the worker's service from the settings (``compile: on``; the folder's compile cache loaded
    first when it has one), then write the cache. Returns the file, its bytes, the graphs found in a
    cache and compiled, and the build's seconds.

    Raises:
        RuntimeError: the layers did not compile (the worker's warning says why).
        ValueError, FileNotFoundError, OSError: as ``build_local_service``, and an unwritable folder.
    """
    start_s = time.perf_counter()
    service = build_local_service(_handler_section(args), WorkerOrigin())
    build_s = time.perf_counter() - start_s
    model = service.engine.model
    if not compiled_regions(model.model.model.language_model):
        raise RuntimeError("the text layers did not compile (see the warning above); no compile cache written")
    path = compile_cache_file(args.model_dir, model.device, model.dtype)
    size_bytes = save_compile_cache(path)
    return {"path": str(path), "size_bytes": size_bytes, **cache_counts(), "build_s": round(build_s, 1)}


def main(argv: list[str] | None = None) -> int:
    """CLI entry ``llava-compile-cache``: exit 0 with the cache written, 1 when the layers did not
    compile, 2 for settings or a folder it cannot use."""
    args = _build_parser().parse_args(argv)
    try:
        done = compile_and_save(args)
    except RuntimeError as exc:
        print(f"llava-compile-cache: {exc}", file=sys.stderr)
        return 1
    except (ValueError, OSError) as exc:  # FileNotFoundError is an OSError
        print(f"llava-compile-cache: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(done))
    else:
        print(
            f"llava-compile-cache: wrote {done['path']} ({done['size_bytes']:,} bytes): {done['cache_hits']} "
            f"graph(s) found in a cache, {done['cache_misses']} compiled; the worker built in {done['build_s']} s"
        )
    return 0
