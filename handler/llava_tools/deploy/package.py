"""The model package: TorchServe's no-archive layout with the handler, the worker core, the
model config and the checkpoint (:func:`build_package`), written locally or uploaded to S3.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

import llava_sessions
from llava_sessions.config import Settings, job_groups

from ..cli import checkpoint_folder_problem
from ..serve.container import PACKAGED_MODEL_NAME, llava_home
from ..serve.torchserve_files import default_handler_path, default_model_config_path, read_model_config
from .spec import DeployError

#: ``archiverVersion`` written to MANIFEST.json (the torch-model-archiver the image pins).
ARCHIVER_VERSION = "0.12.0"


SKIP_DIRS = {"__pycache__", ".cache", ".git"}


@dataclass(frozen=True)
class PackageFile:
    """One object of the artifact: ``key`` relative to the prefix, from ``source`` or ``data``."""

    key: str
    source: Path | None = None
    data: bytes | None = None

    @property
    def size_bytes(self) -> int:
        """Size of the object in bytes."""
        return len(self.data) if self.data is not None else self._source().stat().st_size

    def read(self) -> bytes:
        """The object's bytes (``data``, or the ``source`` file's content)."""
        return self.data if self.data is not None else self._source().read_bytes()

    def _source(self) -> Path:
        if self.source is None:
            raise DeployError(f"{self.key}: the package file has neither a source file nor data")
        return self.source


def _files_under(root: Path) -> Iterable[Path]:
    for path in sorted(root.rglob("*")):
        relative = path.relative_to(root)
        if any(part in SKIP_DIRS or part.startswith(".") for part in relative.parts):
            continue  # e.g. huggingface_hub's .cache/ in a local_dir download
        if path.is_file() and path.suffix != ".pyc":
            yield path


def _default_handler() -> Path:
    handler = llava_home() / "handler" / "llava_handler.py"
    return handler if handler.is_file() else default_handler_path()


def _default_model_config() -> Path:
    config = llava_home() / "model-config.yaml"
    return config if config.is_file() else default_model_config_path()


def build_package(
    model_dir: str | os.PathLike,
    *,
    overrides: Mapping[str, Any] | None = None,
    model_config: str | os.PathLike | None = None,
    handler: str | os.PathLike | None = None,
    created_on: datetime | None = None,
    replicas: int = 1,
) -> list[PackageFile]:
    """List the artifact's files (TorchServe no-archive layout + checkpoint), sorted by key.

    Args:
        model_dir: the llava-hf checkpoint folder (must hold ``config.json``).
        overrides: values for the ``handler:`` section of model-config.yaml (validated here).
        model_config: model-config.yaml to start from (default: the repository's / image's).
        handler: the TorchServe handler file (default: ``handler/llava_handler.py``).
        created_on: MANIFEST.json ``createdOn`` (default: now).
        replicas: the worker's replicas where it will run (one per GPU of an instance or of an
            inference component copy): TorchServe's ``batchSize`` and ``maxNumSequence`` are written
            for ``max_sessions`` (per replica) x this + the spare job groups
            (:func:`~llava_sessions.config.job_groups`), so a stock TorchServe gets them right too.

    Returns:
        The files; keys are relative to the artifact root (``llava/...``).

    Raises:
        DeployError: no ``config.json``, a missing handler/config, an invalid setting, or a
            checkpoint file whose name collides with a packaged file.
    """
    model_dir = Path(model_dir)
    problem = checkpoint_folder_problem(model_dir)
    if problem is not None:
        raise DeployError(problem)
    handler = Path(handler) if handler is not None else _default_handler()
    model_config = Path(model_config) if model_config is not None else _default_model_config()
    package_dir = Path(llava_sessions.__file__).resolve().parent  # the worker core, nothing of the tools
    for path, what in ((handler, "handler file"), (model_config, "model config")):
        if not path.is_file():
            raise DeployError(f"{what} not found: {path}")

    try:
        config = read_model_config(model_config)
    except ValueError as exc:
        raise DeployError(str(exc)) from None
    section = {**config["handler"], **(overrides or {})}
    section["model_dir"] = ""  # the handler falls back to TorchServe's model folder (this one)
    try:
        settings = Settings.from_sources(section)
    except (ValueError, TypeError) as exc:
        raise DeployError(f"invalid handler setting: {exc}") from None
    # every replica's sessions get a job group, and 8 spare (docs/decisions/43-spare-job-groups.md)
    config["batchSize"] = config["maxNumSequence"] = job_groups(settings.max_sessions, replicas)
    config["handler"] = section

    manifest = {
        "createdOn": (created_on or datetime.now()).strftime("%d/%m/%Y %H:%M:%S"),
        "runtime": "python",
        "model": {
            "modelName": PACKAGED_MODEL_NAME,
            "handler": handler.name,
            "modelVersion": "1.0",
            "configFile": "model-config.yaml",
        },
        "archiverVersion": ARCHIVER_VERSION,
    }
    root = PACKAGED_MODEL_NAME
    files = {
        f"{root}/MAR-INF/MANIFEST.json": PackageFile(
            f"{root}/MAR-INF/MANIFEST.json", data=(json.dumps(manifest, indent=2) + "\n").encode()
        ),
        f"{root}/{handler.name}": PackageFile(f"{root}/{handler.name}", source=handler),
        f"{root}/model-config.yaml": PackageFile(
            f"{root}/model-config.yaml", data=yaml.safe_dump(config, sort_keys=False).encode()
        ),
    }
    for path in _files_under(package_dir):
        key = f"{root}/{package_dir.name}/{path.relative_to(package_dir).as_posix()}"
        files[key] = PackageFile(key, source=path)
    for path in _files_under(model_dir):
        key = f"{root}/{path.relative_to(model_dir).as_posix()}"
        if key in files or key.startswith(f"{root}/{package_dir.name}/") or key.startswith(f"{root}/MAR-INF/"):
            raise DeployError(f"checkpoint file {path} collides with the packaged {key}; rename or remove it")
        files[key] = PackageFile(key, source=path)
    return [files[key] for key in sorted(files)]


def write_package(files: Sequence[PackageFile], dest: str | os.PathLike) -> Path:
    """Write the artifact to a local folder (what SageMaker would put in /opt/ml/model); return it."""
    dest = Path(dest)
    for item in files:
        target = dest / item.key
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(item.read())
    return dest
