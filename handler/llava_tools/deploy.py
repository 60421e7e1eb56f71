"""Deploy the LLaVA session server to a SageMaker stateful endpoint: the ``llava-deploy`` CLI.

Steps (each printed; ``--dry-run`` prints them and calls nothing):

1. package: TorchServe's no-archive layout, the handler beside the checkpoint::

       <prefix>/llava/MAR-INF/MANIFEST.json     (what torch-model-archiver --archive-format no-archive writes)
       <prefix>/llava/llava_handler.py
       <prefix>/llava/llava_sessions/...        (the worker core, the one package the handler imports)
       <prefix>/llava/model-config.yaml         (the repository's, with --set values; handler.model_dir "")
       <prefix>/llava/config.json, *.safetensors, tokenizer files, ...   (the --model-dir files)

   uploaded uncompressed under ``s3://bucket/prefix/`` (``--s3-uri``). SageMaker copies it to
   ``/opt/ml/model/`` (``S3DataType: S3Prefix``, ``CompressionType: None``: no tar.gz to pack or to
   unpack, each file downloaded as is); the container's ``serve`` finds ``/opt/ml/model/llava/``
   and uses its checkpoint and ``model-config.yaml`` (llava_tools/container.py). The handler and
   package in the artifact also make it loadable by a stock TorchServe
   (``--model-store /opt/ml/model``); our image runs its own copy of the code.
2. ``create_model``: the image (``build_and_push.sh`` prints its URI), the execution role, the
   model data above, and the environment (the TorchServe sequence header names, the response
   timeout, ``--env`` values such as ``LLAVA_SESSION_TTL_S``).
3. ``create_endpoint_config``: one ``AllTraffic`` variant (instance type and count, container
   start-up health check and model download timeouts).
4. ``create_endpoint`` (``update_endpoint`` when the endpoint exists: its open sessions are lost),
   then wait until ``InService`` (botocore waiter).

``--delete`` removes the endpoint, its endpoint config and its model(s).

No torch here: this module imports only the standard library, boto3, yaml and pydantic.

Usage::

    llava-deploy --endpoint-name llava-chat --model-dir models/llava-1.5-7b-hf \\
        --s3-uri s3://my-bucket/llava/v1 --image-uri 123456789012.dkr.ecr.us-east-1.amazonaws.com/llava-sessions:abc \\
        --role-arn arn:aws:iam::123456789012:role/SageMakerExecution --instance-type ml.g5.2xlarge
    llava-deploy --endpoint-name llava-chat --delete
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TextIO

import yaml

import llava_sessions
from llava_sessions.config import Settings, job_groups

from .container import PACKAGED_MODEL_NAME, llava_home
from .serve import (
    _SEQUENCE_HEADER_KEYS,
    _parse_assignment,
    _parse_raw_assignment,
    default_handler_path,
    default_model_config_path,
)

__all__ = [
    "ARCHIVER_VERSION",
    "INSTANCE_GPUS",
    "SCALING_METRICS",
    "CapacityPlan",
    "DeployError",
    "DeploySpec",
    "Deployer",
    "PackageFile",
    "build_package",
    "capacity_plan",
    "endpoint_config_request",
    "main",
    "model_request",
    "parse_s3_uri",
    "scaling_requests",
    "write_package",
]

#: ``archiverVersion`` written to MANIFEST.json (the torch-model-archiver the image pins).
ARCHIVER_VERSION = "0.12.0"
VARIANT_NAME = "AllTraffic"
DEFAULT_INSTANCE_TYPE = "ml.g5.2xlarge"
#: Seconds SageMaker waits for /ping after the container starts (loading 7B fp16 weights takes minutes).
DEFAULT_STARTUP_TIMEOUT_S = 1200
#: Seconds SageMaker allows to download the model data (about 14 GB for a 7B checkpoint).
DEFAULT_DOWNLOAD_TIMEOUT_S = 1800
#: TorchServe ``responseTimeout`` passed as SAGEMAKER_MODEL_SERVER_TIMEOUT (model-config.yaml's value).
DEFAULT_RESPONSE_TIMEOUT_S = 120
#: Waiter pacing for ``endpoint_in_service`` / ``endpoint_deleted`` (botocore's defaults: 30 s x 120).
WAIT_DELAY_S = 30
WAIT_MAX_ATTEMPTS = 120

_NAME_RE = re.compile(r"^[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}$")  # endpoint / config / model names
_ROLE_RE = re.compile(r"^arn:aws[a-z\-]*:iam::\d{12}:role/?[a-zA-Z_0-9+=,.@\-_/]+$")
_ENV_KEY_RE = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
_S3_URI_RE = re.compile(r"^s3://([a-z0-9][a-z0-9.\-]{1,61}[a-z0-9])(?:/(.*))?$")
_MAX_ENV_ENTRIES = 100
_SKIP_DIRS = {"__pycache__", ".cache", ".git"}


class DeployError(RuntimeError):
    """A deployment step failed or its input is invalid; the message says what to fix."""


# ---- capacity --------------------------------------------------------------------------------

#: GPUs per instance and GiB of memory per GPU, of the SageMaker instance types people serve LLaVA
#: on (AWS's instance type pages: G5 = NVIDIA A10G 24 GB, G6 = L4 24 GB, G6e = L40S 48 GB,
#: P4d = A100 40 GB, P4de = A100 80 GB, P5 = H100 80 GB).
INSTANCE_GPUS: dict[str, tuple[int, int]] = {
    **{f"ml.g5.{size}": (1, 24) for size in ("xlarge", "2xlarge", "4xlarge", "8xlarge", "16xlarge")},
    "ml.g5.12xlarge": (4, 24),
    "ml.g5.24xlarge": (4, 24),
    "ml.g5.48xlarge": (8, 24),
    **{f"ml.g6.{size}": (1, 24) for size in ("xlarge", "2xlarge", "4xlarge", "8xlarge", "16xlarge")},
    "ml.g6.12xlarge": (4, 24),
    "ml.g6.24xlarge": (4, 24),
    "ml.g6.48xlarge": (8, 24),
    **{f"ml.g6e.{size}": (1, 48) for size in ("xlarge", "2xlarge", "4xlarge", "8xlarge", "16xlarge")},
    "ml.g6e.12xlarge": (4, 48),
    "ml.g6e.24xlarge": (4, 48),
    "ml.g6e.48xlarge": (8, 48),
    "ml.p4d.24xlarge": (8, 40),
    "ml.p4de.24xlarge": (8, 80),
    "ml.p5.48xlarge": (8, 80),
}
#: Context tokens a session is planned at (the image's 576 + system prompt + a few turns).
PLANNED_SESSION_TOKENS = 1024
#: Host memory (MiB) an inference component copy asks for by default (``MinMemoryRequiredInMb``):
#: room to load a 7B fp16 checkpoint's 14 GB of weights on their way to the GPU.
DEFAULT_COPY_MEMORY_MB = 16384
_DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}


@dataclass(frozen=True)
class CapacityPlan:
    """What one instance of a type holds: ``replicas`` (one per GPU, ``devices=auto``), and per
    replica the KV budget (bytes) and the sessions it holds in the KV tier at
    :data:`PLANNED_SESSION_TOKENS` tokens each, capped by ``max_sessions`` (per replica);
    ``sessions`` is the instance's total."""

    instance_type: str
    replicas: int
    gpu_bytes: int
    weights_bytes: int
    kv_budget_bytes: int
    session_bytes: int
    sessions_per_replica: int
    sessions: int
    max_sessions: int

    def describe(self) -> str:
        """Two lines for the deploy output."""
        gib = 2**30
        return (
            f"{self.instance_type}: {self.replicas} GPU(s) of {self.gpu_bytes / gib:.0f} GiB -> {self.replicas} "
            f"replica(s) (devices=auto), each {self.weights_bytes / gib:.1f} GiB of weights and a "
            f"{self.kv_budget_bytes / gib:.1f} GiB KV budget\n"
            f"expected capacity: {self.sessions_per_replica} sessions per replica at {PLANNED_SESSION_TOKENS} tokens "
            f"({self.session_bytes / 2**20:.0f} MiB each; max_sessions {self.max_sessions} per replica), "
            f"{self.sessions} per instance; more instances (--max-instances) hold more"
        )


def capacity_plan(
    instance_type: str, model_dir: str | os.PathLike, *, fraction: float = 0.8, max_sessions: int = 64
) -> CapacityPlan | None:
    """Plan one instance of ``instance_type`` for the checkpoint in ``model_dir`` (its config.json
    and weight files), or None when the type is not in :data:`INSTANCE_GPUS` or the folder has no
    readable config. Weights count their file bytes; a session's KV is 2 x layers x kv_heads x
    head_dim x dtype bytes per token at :data:`PLANNED_SESSION_TOKENS` tokens, plus its image
    features (image tokens x hidden x dtype bytes); the budget is ``fraction`` of what the weights
    leave on a GPU (``device_budget_fraction``)."""
    gpus = INSTANCE_GPUS.get(instance_type)
    root = Path(model_dir)
    try:
        config = json.loads((root / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if gpus is None:
        return None
    text = config.get("text_config") or {}
    hidden = int(text.get("hidden_size", 4096))
    layers = int(text.get("num_hidden_layers", 32))
    heads = int(text.get("num_attention_heads", 32))
    kv_heads = int(text.get("num_key_value_heads", heads))
    dtype_bytes = _DTYPE_BYTES.get(str(config.get("torch_dtype") or text.get("torch_dtype") or "float16"), 2)
    dtype_bytes = 2 if dtype_bytes == 4 else dtype_bytes  # the container serves fp16 on a GPU (dtype auto)
    image_tokens = (int(config.get("vision_config", {}).get("image_size", 336)) // 14) ** 2
    weights = sum(p.stat().st_size for p in root.glob("*.safetensors")) or sum(
        p.stat().st_size for p in root.glob("*.bin")
    )
    count, gib = gpus
    gpu_bytes = gib * 2**30
    budget = max(0, int((gpu_bytes - weights) * fraction))
    session_bytes = 2 * layers * kv_heads * (hidden // heads) * dtype_bytes * PLANNED_SESSION_TOKENS
    session_bytes += image_tokens * hidden * dtype_bytes
    per_replica = budget // session_bytes
    return CapacityPlan(
        instance_type=instance_type,
        replicas=count,
        gpu_bytes=gpu_bytes,
        weights_bytes=weights,
        kv_budget_bytes=budget,
        session_bytes=session_bytes,
        sessions_per_replica=min(per_replica, max_sessions),
        sessions=min(per_replica, max_sessions) * count,
        max_sessions=max_sessions,
    )


# ---- autoscaling ------------------------------------------------------------------------------

#: ``--scaling-metric`` → the target-tracking metric (Application Auto Scaling, SageMaker variants).
SCALING_METRICS: dict[str, dict[str, Any]] = {
    # invocations per instance per minute (AWS's predefined SageMaker metric)
    "invocations": {
        "PredefinedMetricSpecification": {"PredefinedMetricType": "SageMakerVariantInvocationsPerInstance"}
    },
    # an inference component's invocations per copy per minute, and requests in flight per copy
    "invocations-per-copy": {
        "PredefinedMetricSpecification": {"PredefinedMetricType": "SageMakerInferenceComponentInvocationsPerCopy"}
    },
    "concurrent-requests-per-copy": {
        "PredefinedMetricSpecification": {
            "PredefinedMetricType": "SageMakerInferenceComponentConcurrentRequestsPerCopyHighResolution"
        }
    },
    # average GPU memory utilisation in percent: grows with the sessions held (their KV caches)
    "gpu-memory": {
        "CustomizedMetricSpecification": {
            "MetricName": "GPUMemoryUtilization",
            "Namespace": "/aws/sagemaker/Endpoints",
            "Statistic": "Average",
        }
    },
}


def scaling_requests(
    endpoint_name: str,
    *,
    min_instances: int,
    max_instances: int,
    metric: str,
    target: float,
    cooldown_s: int = 300,
    gpus: int = 1,
    component: str = "",
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The ``register_scalable_target`` and ``put_scaling_policy`` parameters of a target-tracking
    policy on the endpoint's ``AllTraffic`` variant (AWS: "Automatic scaling of Amazon SageMaker
    models").

    ``target`` of ``gpu-memory`` is per GPU (0-100 %): SageMaker's ``GPUMemoryUtilization`` sums an
    instance's GPUs (0-100 x GPUs %; AWS: "Monitor Amazon SageMaker with CloudWatch", endpoint
    instance metrics), so the policy's value is ``target x gpus``. With ``component`` (an inference
    component's name) the copies scale (``sagemaker:inference-component:DesiredCopyCount``) on a
    per-copy metric, and ``min_instances`` / ``max_instances`` count copies.

    Raises:
        DeployError: a bad range, metric or target, or a metric of the other kind of resource.
    """
    if not 1 <= min_instances <= max_instances:
        raise DeployError(f"need 1 <= --min-instances <= --max-instances, got {min_instances}..{max_instances}")
    if metric not in SCALING_METRICS:
        raise DeployError(f"--scaling-metric must be one of {sorted(SCALING_METRICS)}, got {metric!r}")
    if target <= 0 or (metric == "gpu-memory" and target > 100):
        raise DeployError(f"--scaling-target {target} out of range for {metric}")
    if (metric in COMPONENT_METRICS) != bool(component):
        raise DeployError(
            f"--scaling-metric {metric} scales "
            + ("an inference component's copies: add --inference-component" if not component else "instances")
            + (f"; with --inference-component use one of {sorted(COMPONENT_METRICS)}" if component else "")
        )
    resource, dimension = _scalable(endpoint_name, component)
    common = {"ServiceNamespace": "sagemaker", "ResourceId": resource, "ScalableDimension": dimension}
    spec = json.loads(json.dumps(SCALING_METRICS[metric]))
    custom = spec.get("CustomizedMetricSpecification")
    if custom is not None:
        custom["Dimensions"] = [
            {"Name": "EndpointName", "Value": endpoint_name},
            {"Name": "VariantName", "Value": VARIANT_NAME},
        ]
    register = {**common, "MinCapacity": min_instances, "MaxCapacity": max_instances}
    policy = {
        **common,
        "PolicyName": f"{component or endpoint_name}-{metric}",
        "PolicyType": "TargetTrackingScaling",
        "TargetTrackingScalingPolicyConfiguration": {
            "TargetValue": float(target) * (gpus if metric == "gpu-memory" else 1),
            **spec,
            "ScaleInCooldown": cooldown_s,
            "ScaleOutCooldown": cooldown_s,
        },
    }
    return register, policy


#: ``--scaling-metric`` values that scale an inference component's copies (per-copy metrics).
COMPONENT_METRICS = frozenset({"invocations-per-copy", "concurrent-requests-per-copy"})


def _scalable(endpoint_name: str, component: str = "") -> tuple[str, str]:
    """The Application Auto Scaling resource id and dimension of the endpoint's variant (instances)
    or of an inference component (copies)."""
    if component:
        return f"inference-component/{component}", "sagemaker:inference-component:DesiredCopyCount"
    return f"endpoint/{endpoint_name}/variant/{VARIANT_NAME}", "sagemaker:variant:DesiredInstanceCount"


# ---- packaging ---------------------------------------------------------------------------------


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
        if any(part in _SKIP_DIRS or part.startswith(".") for part in relative.parts):
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
    if not (model_dir / "config.json").is_file():
        raise DeployError(f"{model_dir} has no config.json: not a llava-hf checkpoint folder")
    handler = Path(handler) if handler is not None else _default_handler()
    model_config = Path(model_config) if model_config is not None else _default_model_config()
    package_dir = Path(llava_sessions.__file__).resolve().parent  # the worker core, nothing of the tools
    for path, what in ((handler, "handler file"), (model_config, "model config")):
        if not path.is_file():
            raise DeployError(f"{what} not found: {path}")

    config = yaml.safe_load(model_config.read_text()) or {}
    if not isinstance(config, dict):
        raise DeployError(f"{model_config}: expected a YAML mapping")
    section = dict(config.get("handler") or {})
    section.update(overrides or {})
    section["model_dir"] = ""  # the handler falls back to TorchServe's model folder (this one)
    try:
        settings = Settings.from_sources(section)
    except (ValueError, TypeError) as exc:
        raise DeployError(f"invalid handler setting: {exc}") from None
    # every replica's sessions get a job group, and 8 spare (design.md, "Spare job groups")
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


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """Split ``s3://bucket/some/prefix/`` into ``("bucket", "some/prefix")`` (no trailing slash).

    Raises:
        DeployError: not an ``s3://bucket[/prefix]`` URI.
    """
    match = _S3_URI_RE.match(uri.strip())
    if not match:
        raise DeployError(f"not an S3 URI: {uri!r} (expected s3://bucket/prefix)")
    return match.group(1), (match.group(2) or "").strip("/")


# ---- requests --------------------------------------------------------------------------------


@dataclass(frozen=True)
class DeploySpec:
    """Everything one deployment creates; names are derived from the endpoint's when not given."""

    endpoint_name: str
    image_uri: str
    role_arn: str
    model_data_uri: str
    instance_type: str = DEFAULT_INSTANCE_TYPE
    instance_count: int = 1
    environment: Mapping[str, str] = field(default_factory=dict)
    startup_timeout_s: int = DEFAULT_STARTUP_TIMEOUT_S
    download_timeout_s: int = DEFAULT_DOWNLOAD_TIMEOUT_S
    model_name: str = ""
    endpoint_config_name: str = ""
    inference_component: str = ""  # the inference component's name; empty: the model sits in the variant
    copies: int = 1  # the component's copies (CopyCount)
    accelerators_per_copy: int = 1  # GPUs per copy (NumberOfAcceleratorDevicesRequired)
    memory_per_copy_mb: int = DEFAULT_COPY_MEMORY_MB  # host memory per copy (MinMemoryRequiredInMb)

    def validate(self) -> None:
        """Raise :class:`DeployError` naming the first invalid field."""
        if self.inference_component:
            if not _NAME_RE.match(self.inference_component):
                raise DeployError(f"invalid inference component name {self.inference_component!r}")
            if self.copies < 1 or self.accelerators_per_copy < 1 or self.memory_per_copy_mb < 128:
                raise DeployError("--copies and --accelerators-per-copy must be >= 1, --memory-per-copy-mb >= 128")
            gpus = INSTANCE_GPUS.get(self.instance_type, (0, 0))[0]
            if gpus and self.accelerators_per_copy > gpus:
                raise DeployError(
                    f"{self.instance_type} has {gpus} GPU(s); a copy cannot take {self.accelerators_per_copy}"
                )
        for name, value in (
            ("endpoint name", self.endpoint_name),
            ("model name", self.model_name),
            ("endpoint config name", self.endpoint_config_name),
        ):
            if not _NAME_RE.match(value):
                raise DeployError(f"invalid {name} {value!r}: 1-63 letters, digits and '-', no leading/trailing '-'")
        if not self.image_uri or re.search(r"\s", self.image_uri):
            raise DeployError(f"invalid image URI {self.image_uri!r}")
        if not _ROLE_RE.match(self.role_arn):
            raise DeployError(f"invalid role ARN {self.role_arn!r} (expected arn:aws:iam::<account>:role/<name>)")
        parse_s3_uri(self.model_data_uri)
        if not self.model_data_uri.endswith("/"):
            raise DeployError(f"model data URI {self.model_data_uri!r} must end with '/' (an S3 prefix)")
        if self.instance_count < 1:
            raise DeployError(f"instance count must be >= 1, got {self.instance_count}")
        if not re.match(r"^ml\.[a-z0-9]+\.[a-z0-9]+$", self.instance_type):
            raise DeployError(f"invalid instance type {self.instance_type!r} (expected e.g. ml.g5.2xlarge)")
        for what, seconds in (("start-up", self.startup_timeout_s), ("download", self.download_timeout_s)):
            if not 60 <= seconds <= 3600:
                raise DeployError(f"{what} timeout must be 60..3600 s (SageMaker's range), got {seconds}")
        if len(self.environment) > _MAX_ENV_ENTRIES:
            raise DeployError(f"at most {_MAX_ENV_ENTRIES} environment variables, got {len(self.environment)}")
        for key, value in self.environment.items():
            if not _ENV_KEY_RE.match(key) or len(key) > 1024 or len(value) > 1024:
                raise DeployError(
                    f"invalid environment entry {key!r}: names [A-Za-z_][A-Za-z0-9_]*, values <= 1024 chars"
                )


def derived_name(endpoint_name: str, now: datetime) -> str:
    """Return ``<endpoint>-<UTC yyyymmddHHMMSS>``, cut to SageMaker's 63 characters."""
    suffix = now.astimezone(timezone.utc).strftime("%Y%m%d%H%M%S")
    return f"{endpoint_name[: 63 - len(suffix) - 1].rstrip('-')}-{suffix}"


def default_environment(response_timeout_s: int = DEFAULT_RESPONSE_TIMEOUT_S) -> dict[str, str]:
    """Return the container environment every deployment gets (``--env`` adds to / overrides it).

    The sequence header names must match TorchServe's config keys (the container exports them
    too); SAGEMAKER_MODEL_SERVER_TIMEOUT becomes TorchServe's ``responseTimeout``.
    """
    env = {env_name: header for _, env_name, header in _SEQUENCE_HEADER_KEYS}
    env["SAGEMAKER_MODEL_SERVER_TIMEOUT"] = str(response_timeout_s)
    return env


def model_request(spec: DeploySpec) -> dict[str, Any]:
    """Return the ``create_model`` parameters for ``spec``."""
    return {
        "ModelName": spec.model_name,
        "ExecutionRoleArn": spec.role_arn,
        "PrimaryContainer": {
            "Image": spec.image_uri,
            "ModelDataSource": {
                "S3DataSource": {
                    "S3Uri": spec.model_data_uri,
                    "S3DataType": "S3Prefix",
                    "CompressionType": "None",
                }
            },
            "Environment": dict(spec.environment),
        },
    }


def endpoint_config_request(spec: DeploySpec) -> dict[str, Any]:
    """Return the ``create_endpoint_config`` parameters for ``spec``. With an inference component the
    variant holds no model (the component does, with its start-up timeouts) and the config carries the
    execution role (AWS: "Deploy models with inference components")."""
    if spec.inference_component:
        return {
            "EndpointConfigName": spec.endpoint_config_name,
            "ExecutionRoleArn": spec.role_arn,
            "ProductionVariants": [
                {
                    "VariantName": VARIANT_NAME,
                    "InstanceType": spec.instance_type,
                    "InitialInstanceCount": spec.instance_count,
                    "RoutingConfig": {"RoutingStrategy": "LEAST_OUTSTANDING_REQUESTS"},
                }
            ],
        }
    return {
        "EndpointConfigName": spec.endpoint_config_name,
        "ProductionVariants": [
            {
                "VariantName": VARIANT_NAME,
                "ModelName": spec.model_name,
                "InstanceType": spec.instance_type,
                "InitialInstanceCount": spec.instance_count,
                "ContainerStartupHealthCheckTimeoutInSeconds": spec.startup_timeout_s,
                "ModelDataDownloadTimeoutInSeconds": spec.download_timeout_s,
            }
        ],
    }


def inference_component_request(spec: DeploySpec) -> dict[str, Any]:
    """Return the ``create_inference_component`` parameters for ``spec``: the model, the GPUs and
    host memory one copy takes, the start-up timeouts, and the copy count."""
    return {
        "InferenceComponentName": spec.inference_component,
        "EndpointName": spec.endpoint_name,
        "VariantName": VARIANT_NAME,
        "Specification": {
            "ModelName": spec.model_name,
            "StartupParameters": {
                "ModelDataDownloadTimeoutInSeconds": spec.download_timeout_s,
                "ContainerStartupHealthCheckTimeoutInSeconds": spec.startup_timeout_s,
            },
            "ComputeResourceRequirements": {
                "NumberOfAcceleratorDevicesRequired": spec.accelerators_per_copy,
                "MinMemoryRequiredInMb": spec.memory_per_copy_mb,
            },
        },
        "RuntimeConfig": {"CopyCount": spec.copies},
    }


# ---- the AWS side ------------------------------------------------------------------------------


def _is_not_found(exc: Exception) -> bool:
    from botocore.exceptions import ClientError

    if not isinstance(exc, ClientError):
        return False
    error = exc.response.get("Error", {})
    return error.get("Code") in ("ValidationException", "ResourceNotFound") and "Could not find" in error.get(
        "Message", ""
    )


class Deployer:
    """Run (or, with ``dry_run``, print) the S3 and SageMaker calls of a deployment.

    Args:
        sagemaker: a boto3 ``sagemaker`` client (None with ``dry_run``).
        s3: a boto3 ``s3`` client (None with ``dry_run`` or when nothing is uploaded).
        dry_run: print each call as ``service.operation(params)`` and call nothing.
        out: where progress and dry-run calls are printed.
        wait_delay_s / wait_max_attempts: waiter pacing.
    """

    def __init__(
        self,
        sagemaker: Any = None,
        s3: Any = None,
        *,
        autoscaling: Any = None,
        dry_run: bool = False,
        out: TextIO | None = None,
        wait_delay_s: float = WAIT_DELAY_S,
        wait_max_attempts: int = WAIT_MAX_ATTEMPTS,
    ) -> None:
        self.sagemaker = sagemaker
        self.s3 = s3
        self.autoscaling = autoscaling
        self.dry_run = dry_run
        self.out = out if out is not None else sys.stdout
        self.wait_config = {"Delay": wait_delay_s, "MaxAttempts": wait_max_attempts}

    def _say(self, text: str) -> None:
        print(text, file=self.out, flush=True)

    def _done(self, done: str, would: str) -> None:
        """Say what happened, or in a dry run what would happen (a dry run never says it did anything)."""
        self._say(f"would {would}" if self.dry_run else done)

    def _call(self, service: str, operation: str, **params: Any) -> Any:
        if self.dry_run:
            shown = json.dumps(params, indent=2, default=str)
            self._say(f"would call {service}.{operation}({shown})")
            return None
        client = {"sagemaker": self.sagemaker, "s3": self.s3, "application-autoscaling": self.autoscaling}[service]
        return getattr(client, operation)(**params)

    def autoscale(self, register: Mapping[str, Any], policy: Mapping[str, Any]) -> None:
        """Register the variant as a scalable target and attach the target-tracking policy."""
        self._call("application-autoscaling", "register_scalable_target", **register)
        self._call("application-autoscaling", "put_scaling_policy", **policy)
        unit = "copies" if register["ScalableDimension"].endswith("DesiredCopyCount") else "instances"
        what = (
            f"autoscaling {register['ResourceId']}: {register['MinCapacity']}..{register['MaxCapacity']} {unit}, "
            f"policy {policy['PolicyName']} (target {policy['TargetTrackingScalingPolicyConfiguration']['TargetValue']})"
        )
        self._done(what, f"set {what}")

    def remove_autoscaling(self, endpoint_name: str, *, component: str = "") -> None:
        """Deregister the endpoint variant's scalable target (or the inference ``component``'s copy
        count), if there is one (before deleting it)."""
        resource, dimension = _scalable(endpoint_name, component)
        target = {"ServiceNamespace": "sagemaker", "ResourceId": resource, "ScalableDimension": dimension}
        if self.dry_run:
            self._call("application-autoscaling", "deregister_scalable_target", **target)
            return
        if self.autoscaling is None:
            return
        found = self.autoscaling.describe_scalable_targets(
            ServiceNamespace="sagemaker", ResourceIds=[resource], ScalableDimension=dimension
        )
        if found.get("ScalableTargets"):
            self._call("application-autoscaling", "deregister_scalable_target", **target)
            self._say(f"removed autoscaling of {resource}")

    def upload(self, files: Sequence[PackageFile], s3_uri: str) -> str:
        """Upload the artifact under ``s3_uri``; return the prefix URI (ends with ``/``)."""
        bucket, prefix = parse_s3_uri(s3_uri)
        base = f"{prefix}/" if prefix else ""
        total = sum(item.size_bytes for item in files)
        what = f"{len(files)} files ({total / 1e6:.1f} MB) to s3://{bucket}/{base}"
        self._done(f"uploading {what}", f"upload {what}")
        for item in files:
            key = base + item.key
            if self.dry_run:
                source = str(item.source) if item.source is not None else f"<{item.size_bytes} generated bytes>"
                self._say(f"would call s3.upload_file({source!r}, {bucket!r}, {key!r})")
            elif item.source is not None:
                self.s3.upload_file(str(item.source), bucket, key)
            else:
                self.s3.put_object(Bucket=bucket, Key=key, Body=item.data)
        return f"s3://{bucket}/{base}"

    def _endpoint_exists(self, endpoint_name: str) -> bool:
        if self.dry_run:
            self._say(
                f"would call sagemaker.describe_endpoint({{'EndpointName': {endpoint_name!r}}})"
                "  # create, or update if it exists"
            )
            return False
        try:
            self.sagemaker.describe_endpoint(EndpointName=endpoint_name)
        except Exception as exc:  # noqa: BLE001 - only "not found" means absent
            if _is_not_found(exc):
                return False
            raise
        return True

    def deploy(self, spec: DeploySpec, *, wait: bool = True) -> None:
        """Create the model and endpoint config, create (or update) the endpoint, wait for InService.

        Raises:
            DeployError: invalid spec, or the endpoint ended ``Failed`` (the message holds
                SageMaker's FailureReason).
            botocore.exceptions.ClientError: an API call was refused.
        """
        spec.validate()
        self._call("sagemaker", "create_model", **model_request(spec))
        self._done(f"created model {spec.model_name}", f"create model {spec.model_name}")
        self._call("sagemaker", "create_endpoint_config", **endpoint_config_request(spec))
        self._done(
            f"created endpoint config {spec.endpoint_config_name}",
            f"create endpoint config {spec.endpoint_config_name}",
        )
        if self._endpoint_exists(spec.endpoint_name):
            self._say(f"endpoint {spec.endpoint_name} exists: updating it (its open sessions will be lost)")
            self._call(
                "sagemaker",
                "update_endpoint",
                EndpointName=spec.endpoint_name,
                EndpointConfigName=spec.endpoint_config_name,
            )
        else:
            self._call(
                "sagemaker",
                "create_endpoint",
                EndpointName=spec.endpoint_name,
                EndpointConfigName=spec.endpoint_config_name,
            )
        if wait:
            self._wait("endpoint_in_service", spec.endpoint_name)
            self._done(f"endpoint {spec.endpoint_name} is InService", f"wait until {spec.endpoint_name} is InService")
        if spec.inference_component:
            self._deploy_component(spec)

    def _deploy_component(self, spec: DeploySpec) -> None:
        """Create (or update) the inference component on the InService endpoint and wait for it."""
        name = spec.inference_component
        request = inference_component_request(spec)
        if self._component_exists(name):
            self._call(
                "sagemaker",
                "update_inference_component",
                InferenceComponentName=name,
                Specification=request["Specification"],
                RuntimeConfig=request["RuntimeConfig"],
            )
        else:
            self._call("sagemaker", "create_inference_component", **request)
        self._wait_component(name, "InService")
        self._done(
            f"inference component {name} is InService: {spec.copies} copies of {spec.accelerators_per_copy} GPU(s)",
            f"create inference component {name}: {spec.copies} copies of {spec.accelerators_per_copy} GPU(s)",
        )

    def _component_exists(self, name: str) -> bool:
        if self.dry_run:
            self._say(f"would call sagemaker.describe_inference_component({{'InferenceComponentName': {name!r}}})")
            return False
        try:
            self.sagemaker.describe_inference_component(InferenceComponentName=name)
        except Exception as exc:  # noqa: BLE001 - only "not found" means absent
            if _is_not_found(exc):
                return False
            raise
        return True

    def _wait_component(self, name: str, until: str) -> None:
        """Poll ``describe_inference_component`` until its status is ``until`` (``InService``) or it is
        gone (``until`` "Deleted"), with the endpoint waiter's pacing.

        Raises:
            DeployError: it ended ``Failed`` (with SageMaker's FailureReason), or the polls ran out.
        """
        if self.dry_run:
            self._say(f"would wait until inference component {name} is {until}")
            return
        self._say(f"waiting for inference component {name} ({until}) ...")
        for attempt in range(int(self.wait_config["MaxAttempts"])):
            try:
                described = self.sagemaker.describe_inference_component(InferenceComponentName=name)
            except Exception as exc:  # noqa: BLE001
                if until == "Deleted" and _is_not_found(exc):
                    return
                raise
            status = described.get("InferenceComponentStatus")
            if status == until:
                return
            if status == "Failed":
                raise DeployError(f"inference component {name}: {described.get('FailureReason', 'Failed')}")
            if attempt + 1 < int(self.wait_config["MaxAttempts"]):
                time.sleep(float(self.wait_config["Delay"]))
        raise DeployError(f"inference component {name} is not {until} after the waiter's attempts")

    def _wait(self, waiter_name: str, endpoint_name: str) -> None:
        if self.dry_run:
            self._say(
                f"would call sagemaker.get_waiter({waiter_name!r}).wait(EndpointName={endpoint_name!r}, "
                f"WaiterConfig={self.wait_config})"
            )
            return
        from botocore.exceptions import WaiterError

        self._say(f"waiting for {endpoint_name} ({waiter_name}) ...")
        try:
            self.sagemaker.get_waiter(waiter_name).wait(EndpointName=endpoint_name, WaiterConfig=self.wait_config)
        except WaiterError as exc:
            reason = (exc.last_response or {}).get("FailureReason") or str(exc)
            raise DeployError(f"endpoint {endpoint_name}: {reason}") from None

    def _delete_components(self, endpoint_name: str) -> None:
        """Delete the endpoint's inference components (and their copy autoscaling) and wait until
        they are gone: an endpoint with components cannot be deleted."""
        listed = self.sagemaker.list_inference_components(EndpointNameEquals=endpoint_name)
        for item in listed.get("InferenceComponents", []):
            name = item["InferenceComponentName"]
            self.remove_autoscaling(endpoint_name, component=name)
            self._call("sagemaker", "delete_inference_component", InferenceComponentName=name)
            self._wait_component(name, "Deleted")
            self._say(f"deleted inference component {name}")

    def delete(self, endpoint_name: str, *, wait: bool = True) -> None:
        """Delete the endpoint, its endpoint config and the model(s) its variants use.

        Raises:
            DeployError: the endpoint does not exist.
            botocore.exceptions.ClientError: an API call was refused.
        """
        if self.dry_run:
            self._say(f"would call sagemaker.describe_endpoint({{'EndpointName': {endpoint_name!r}}})")
            self._say(
                f"would call sagemaker.list_inference_components({{'EndpointNameEquals': {endpoint_name!r}}}) "
                "and delete each (with its copy autoscaling) first"
            )
            self._say("would call sagemaker.describe_endpoint_config({'EndpointConfigName': <from describe_endpoint>})")
            self.remove_autoscaling(endpoint_name)
            self._call("sagemaker", "delete_endpoint", EndpointName=endpoint_name)
            if wait:
                self._wait("endpoint_deleted", endpoint_name)
            self._say("would call sagemaker.delete_endpoint_config({'EndpointConfigName': <from describe_endpoint>})")
            self._say("would call sagemaker.delete_model({'ModelName': <each variant's ModelName>})")
            return
        try:
            described = self.sagemaker.describe_endpoint(EndpointName=endpoint_name)
        except Exception as exc:  # noqa: BLE001
            if _is_not_found(exc):
                raise DeployError(f"endpoint {endpoint_name} not found") from None
            raise
        config_name = described["EndpointConfigName"]
        self._delete_components(endpoint_name)
        self.remove_autoscaling(endpoint_name)
        config = self.sagemaker.describe_endpoint_config(EndpointConfigName=config_name)
        models = [variant["ModelName"] for variant in config.get("ProductionVariants", []) if variant.get("ModelName")]
        self._call("sagemaker", "delete_endpoint", EndpointName=endpoint_name)
        self._say(f"deleting endpoint {endpoint_name}")
        if wait:
            self._wait("endpoint_deleted", endpoint_name)
        self._call("sagemaker", "delete_endpoint_config", EndpointConfigName=config_name)
        self._say(f"deleted endpoint config {config_name}")
        for model_name in dict.fromkeys(models):
            self._call("sagemaker", "delete_model", ModelName=model_name)
            self._say(f"deleted model {model_name}")


# ---- CLI -------------------------------------------------------------------------------------


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llava-deploy",
        description="Package the LLaVA session handler with a checkpoint, upload it to S3 and create "
        "(or update, or --delete) a SageMaker endpoint.",
    )
    parser.add_argument("--endpoint-name", required=True, help="SageMaker endpoint name")
    parser.add_argument("--delete", action="store_true", help="delete the endpoint, its config and model(s)")
    source = parser.add_argument_group("model data (one of)")
    source.add_argument("--model-dir", help="llava-hf checkpoint folder to package and upload (with --s3-uri)")
    source.add_argument("--model-data-uri", help="an already uploaded artifact prefix s3://bucket/prefix/")
    parser.add_argument("--s3-uri", help="where to upload the artifact: s3://bucket/prefix")
    parser.add_argument("--image-uri", help="container image (build_and_push.sh prints it)")
    parser.add_argument("--role-arn", help="SageMaker execution role ARN (reads the S3 prefix and pulls the image)")
    parser.add_argument("--instance-type", default=DEFAULT_INSTANCE_TYPE, help=f"default {DEFAULT_INSTANCE_TYPE}")
    parser.add_argument("--instance-count", type=int, default=1, help="default 1")
    parser.add_argument(
        "--startup-timeout",
        type=int,
        default=DEFAULT_STARTUP_TIMEOUT_S,
        help=f"ContainerStartupHealthCheckTimeoutInSeconds (default {DEFAULT_STARTUP_TIMEOUT_S})",
    )
    parser.add_argument(
        "--download-timeout",
        type=int,
        default=DEFAULT_DOWNLOAD_TIMEOUT_S,
        help=f"ModelDataDownloadTimeoutInSeconds (default {DEFAULT_DOWNLOAD_TIMEOUT_S})",
    )
    parser.add_argument(
        "--response-timeout",
        type=int,
        default=DEFAULT_RESPONSE_TIMEOUT_S,
        help="SAGEMAKER_MODEL_SERVER_TIMEOUT: TorchServe responseTimeout in seconds "
        f"(default {DEFAULT_RESPONSE_TIMEOUT_S})",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        type=_parse_assignment,
        metavar="KEY=VALUE",
        help="handler setting written into the packaged model-config.yaml, e.g. --set session_ttl_s=600",
    )
    parser.add_argument(
        "--env",
        dest="environment",
        action="append",
        default=[],
        type=_parse_raw_assignment,
        metavar="KEY=VALUE",
        help="container environment variable, e.g. --env LLAVA_LOG_LEVEL=INFO",
    )
    component = parser.add_argument_group(
        "inference component (the endpoint config holds no model; one component places copies of it on the "
        "instances' GPUs)"
    )
    component.add_argument("--inference-component", metavar="NAME", default="", help="create this inference component")
    component.add_argument("--copies", type=int, default=1, help="copies of the model (CopyCount, default 1)")
    component.add_argument(
        "--accelerators-per-copy", type=int, default=1, help="GPUs each copy takes (default 1; one replica per GPU)"
    )
    component.add_argument(
        "--memory-per-copy-mb",
        type=int,
        default=DEFAULT_COPY_MEMORY_MB,
        help=f"host memory each copy needs, MiB (default {DEFAULT_COPY_MEMORY_MB})",
    )
    component.add_argument("--min-copies", type=int, default=None, help="least copies (with --max-copies)")
    component.add_argument("--max-copies", type=int, default=None, help="most copies; enables copy autoscaling")
    scaling = parser.add_argument_group("autoscaling (Application Auto Scaling target tracking)")
    scaling.add_argument("--min-instances", type=int, default=None, help="least instances (with --max-instances)")
    scaling.add_argument("--max-instances", type=int, default=None, help="most instances; enables autoscaling")
    scaling.add_argument(
        "--scaling-metric",
        default=None,
        choices=sorted(SCALING_METRICS),
        help="gpu-memory: average GPU memory use in percent, which grows with the sessions held (default); "
        "invocations: requests per instance per minute; with --inference-component: invocations-per-copy "
        "(default) or concurrent-requests-per-copy",
    )
    scaling.add_argument(
        "--scaling-target",
        type=float,
        default=70.0,
        help="the metric's target value (default 70); for gpu-memory, percent per GPU (llava-deploy multiplies "
        "it by the instance's GPUs: SageMaker's GPUMemoryUtilization is their sum)",
    )
    parser.add_argument("--model-name", default="", help="default <endpoint>-<UTC timestamp>")
    parser.add_argument("--endpoint-config-name", default="", help="default <endpoint>-<UTC timestamp>")
    parser.add_argument("--region", default=None, help="AWS region (default: the boto3 session's)")
    parser.add_argument("--profile", default=None, help="AWS profile")
    parser.add_argument("--no-wait", action="store_true", help="do not wait for InService / deletion")
    parser.add_argument("--dry-run", action="store_true", help="print the API calls and uploads; call nothing")
    return parser


def main(argv: list[str] | None = None, *, clients: Callable[[str], Any] | None = None) -> int:
    """Run ``llava-deploy``; returns the exit code.

    Args:
        argv: command-line arguments (default ``sys.argv[1:]``).
        clients: ``clients("sagemaker" | "s3")`` returning boto3 clients (tests pass stubbed ones);
            default: from ``boto3.Session(profile_name=--profile, region_name=--region)``.
    """
    parser = _build_parser()
    args = parser.parse_args(argv)
    if not args.delete:
        if bool(args.model_dir) == bool(args.model_data_uri):
            parser.error("give exactly one of --model-dir (with --s3-uri) and --model-data-uri")
        if args.model_dir and not args.s3_uri:
            parser.error("--model-dir needs --s3-uri (where to upload the artifact)")
        if args.model_data_uri and args.overrides:
            parser.error("--set applies to a packaged --model-dir; with --model-data-uri use --env LLAVA_<KEY>=...")
        for option in ("image_uri", "role_arn"):
            if not getattr(args, option):
                parser.error(f"--{option.replace('_', '-')} is required to deploy")
    try:
        if args.delete:
            _deployer(args, clients, need_s3=False).delete(args.endpoint_name, wait=not args.no_wait)
            return 0
        now = datetime.now(timezone.utc)
        environment = default_environment(args.response_timeout)
        environment.update(dict(args.environment))
        try:  # before any AWS call: a typo in --set or --env, or a bad value, is named here
            Settings.check_names(dict(args.overrides), "in --set")
            Settings.from_sources(dict(args.overrides), environment)
        except ValueError as exc:
            print(f"llava-deploy: {exc}", file=sys.stderr)
            return 2
        model_data_uri = args.model_data_uri
        if model_data_uri and not model_data_uri.endswith("/"):
            model_data_uri += "/"  # an S3Prefix URI ends with "/"
        spec = DeploySpec(
            endpoint_name=args.endpoint_name,
            image_uri=args.image_uri,
            role_arn=args.role_arn,
            model_data_uri=model_data_uri or "s3://placeholder/prefix/",
            instance_type=args.instance_type,
            instance_count=args.instance_count,
            environment=environment,
            startup_timeout_s=args.startup_timeout,
            download_timeout_s=args.download_timeout,
            model_name=args.model_name or derived_name(args.endpoint_name, now),
            endpoint_config_name=args.endpoint_config_name or derived_name(args.endpoint_name, now),
            inference_component=args.inference_component,
            copies=args.copies,
            accelerators_per_copy=args.accelerators_per_copy,
            memory_per_copy_mb=args.memory_per_copy_mb,
        )
        spec.validate()  # before packaging and uploading gigabytes
        if spec.inference_component and args.no_wait:
            raise DeployError("an inference component is created on the InService endpoint: drop --no-wait")
        if not spec.inference_component and (args.min_copies is not None or args.max_copies is not None):
            raise DeployError("--min-copies / --max-copies scale an inference component: add --inference-component")
        if spec.inference_component and (args.min_instances is not None or args.max_instances is not None):
            raise DeployError(
                "with --inference-component, scale the copies (--min-copies / --max-copies); the instances of an "
                "inference-component endpoint scale with SageMaker's managed instance scaling, not set up here"
            )
        if args.scaling_metric is None:
            args.scaling_metric = "invocations-per-copy" if spec.inference_component else "gpu-memory"
        scaling = None
        if spec.inference_component and (args.min_copies is not None or args.max_copies is not None):
            scaling = scaling_requests(
                args.endpoint_name,
                min_instances=args.min_copies if args.min_copies is not None else args.copies,
                max_instances=args.max_copies if args.max_copies is not None else args.copies,
                metric=args.scaling_metric,
                target=args.scaling_target,
                component=spec.inference_component,
            )
        if args.max_instances is not None or args.min_instances is not None:
            if args.no_wait:
                raise DeployError("autoscaling needs the endpoint InService: drop --no-wait")
            gpus = INSTANCE_GPUS.get(args.instance_type, (1, 0))[0]
            if args.scaling_metric == "gpu-memory" and args.instance_type not in INSTANCE_GPUS:
                print(
                    f"llava-deploy: warning: {args.instance_type} is not in the GPU table: --scaling-target is "
                    "used as given (GPUMemoryUtilization sums an instance's GPUs: give the sum)",
                    file=sys.stderr,
                )
            scaling = scaling_requests(
                args.endpoint_name,
                min_instances=args.min_instances if args.min_instances is not None else args.instance_count,
                max_instances=args.max_instances if args.max_instances is not None else args.instance_count,
                metric=args.scaling_metric,
                target=args.scaling_target,
                gpus=gpus,
            )
        overrides = dict(args.overrides)
        gpus_here = (
            args.accelerators_per_copy if args.inference_component else INSTANCE_GPUS.get(args.instance_type, (1, 0))[0]
        )
        if args.model_dir:
            settings = Settings.from_sources(overrides)
            plan = capacity_plan(
                args.instance_type,
                args.model_dir,
                fraction=settings.device_budget_fraction,
                max_sessions=settings.max_sessions,
            )
            print(
                plan.describe() if plan else f"{args.instance_type}: capacity not planned (unknown type or checkpoint)"
            )
        files = build_package(args.model_dir, overrides=overrides, replicas=gpus_here) if args.model_dir else None
        if files is not None:
            parse_s3_uri(args.s3_uri)
        deployer = _deployer(args, clients, need_s3=files is not None)
        if files is not None:
            model_data_uri = deployer.upload(files, args.s3_uri)
        deployer.deploy(replace(spec, model_data_uri=model_data_uri), wait=not args.no_wait)
        if scaling is not None:
            deployer.autoscale(*scaling)
        return 0
    except DeployError as exc:
        print(f"llava-deploy: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # noqa: BLE001 - botocore errors: one line, not a traceback
        from botocore.exceptions import BotoCoreError, ClientError

        if isinstance(exc, (ClientError, BotoCoreError)):
            print(f"llava-deploy: {exc}", file=sys.stderr)
            return 1
        raise


def _deployer(args: argparse.Namespace, clients: Callable[[str], Any] | None, *, need_s3: bool) -> Deployer:
    """Make the :class:`Deployer` (no clients with ``--dry-run``)."""
    if args.dry_run:
        return Deployer(dry_run=True)
    if clients is None:
        import boto3

        clients = boto3.Session(profile_name=args.profile, region_name=args.region).client
    scales = args.delete or any(
        value is not None for value in (args.max_instances, args.min_instances, args.max_copies, args.min_copies)
    )
    return Deployer(
        clients("sagemaker"),
        clients("s3") if need_s3 else None,
        autoscaling=clients("application-autoscaling") if scales else None,
    )


if __name__ == "__main__":
    sys.exit(main())
