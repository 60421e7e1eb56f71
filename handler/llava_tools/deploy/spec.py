"""What a deployment is made of: its limits and names, :class:`DeploySpec`, and the SageMaker requests
(model, endpoint config, inference component) built from it. No AWS calls here.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from ..serve.torchserve_files import SEQUENCE_HEADER_KEYS

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
_MAX_ENV_ENTRIES = 100
#: ``--routing`` values and the ``RoutingStrategy`` each writes (botocore's ``sagemaker`` model;
#: KV_AWARE is left out: only "supported containers such as the vLLM DLC", its protocol undocumented).
ROUTING_STRATEGIES = {
    "least-outstanding": "LEAST_OUTSTANDING_REQUESTS",
    "random": "RANDOM",
    "prefix-aware": "PREFIX_AWARE",
}
#: ``PrefixAwareRoutingConfig``'s ranges (botocore's ``sagemaker`` model, whose documentation says
#: both fields are "Required when RoutingStrategy is PREFIX_AWARE": they are always written).
PREFIX_LENGTH_RANGE = (1024, 65536)
CONCURRENCY_THRESHOLD_RANGE = (1, 1024)
#: ``PrefixLength`` when ``--prefix-length`` is not given: the smallest SageMaker takes. On
#: ``InvokeEndpoint`` it counts body bytes, which for our bodies hold the system prompt, the first
#: question and the start of the first image (a uuid reference changes them: docs/decisions/10-routing-a-stateless-conversation-to-its-cache.md); on
#: SageMaker's OpenAI-compatible route it counts characters of the messages' text content.
DEFAULT_PREFIX_LENGTH = 1024
#: ``ConcurrencyThreshold`` per GPU when ``--concurrency-threshold`` is not given: the handler's
#: ``max_concurrent_generations`` on a GPU (64 answers decode together per replica, one replica per GPU:
#: ``GENERATION_SLOTS`` in llava_sessions/wire/in_flight.py); past it an instance queues, so the next
#: stateless request goes to another instance.
DEFAULT_CONCURRENCY_PER_GPU = 64


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
DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}


class DeployError(RuntimeError):
    """A deployment step failed or its input is invalid; the message says what to fix."""


def endpoint_instance_types() -> frozenset[str]:
    """The instance types a SageMaker real-time endpoint takes, as botocore's own service model lists them
    (the ``ProductionVariantInstanceType`` enum of the ``sagemaker`` API, the boto3 installed)."""
    from botocore.loaders import create_loader  # the service model's file alone: no session, no profile

    shapes = create_loader().load_service_model("sagemaker", "service-2")["shapes"]
    return frozenset(shapes["ProductionVariantInstanceType"].get("enum", ()))


def check_instance_type(instance_type: str, known: frozenset[str] | None = None) -> None:
    """Refuse an instance type SageMaker does not have (``known``: :func:`endpoint_instance_types`).

    Raises:
        DeployError: one line naming the type and the closest known one.
    """
    known = endpoint_instance_types() if known is None else known
    if not known or instance_type in known:
        return
    close = difflib.get_close_matches(instance_type, sorted(known), n=1, cutoff=0.6)
    hint = (
        f" (did you mean {close[0]}?)" if close else f" (e.g. {DEFAULT_INSTANCE_TYPE}, ml.g6e.xlarge, ml.p5.48xlarge)"
    )
    raise DeployError(f"--instance-type {instance_type} is not a SageMaker endpoint instance type{hint}")


S3_URI_RE = re.compile(r"^s3://([a-z0-9][a-z0-9.\-]{1,61}[a-z0-9])(?:/(.*))?$")


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """Split ``s3://bucket/some/prefix/`` into ``("bucket", "some/prefix")`` (no trailing slash).

    Raises:
        DeployError: not an ``s3://bucket[/prefix]`` URI.
    """
    match = S3_URI_RE.match(uri.strip())
    if not match:
        raise DeployError(f"not an S3 URI: {uri!r} (expected s3://bucket/prefix)")
    return match.group(1), (match.group(2) or "").strip("/")


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
    routing: str = ""  # the variant's RoutingStrategy by its CLI name (ROUTING_STRATEGIES); empty: SageMaker's default
    prefix_length: int | None = None  # PREFIX_AWARE's PrefixLength (bytes of the body): 1024..65536
    concurrency_threshold: int | None = None  # PREFIX_AWARE's ConcurrencyThreshold: 1..1024

    def _validate_routing(self) -> None:
        if self.routing and self.routing not in ROUTING_STRATEGIES:
            raise DeployError(f"unknown routing {self.routing!r}; one of {', '.join(ROUTING_STRATEGIES)}")
        given = self.prefix_length is not None or self.concurrency_threshold is not None
        if given and self.routing != "prefix-aware":
            raise DeployError("--prefix-length and --concurrency-threshold go with --routing prefix-aware")
        for name, value, (low, high) in (
            ("--prefix-length", self.prefix_length, PREFIX_LENGTH_RANGE),
            ("--concurrency-threshold", self.concurrency_threshold, CONCURRENCY_THRESHOLD_RANGE),
        ):
            if value is not None and not low <= value <= high:
                raise DeployError(f"{name} must be {low}..{high} (SageMaker's range), got {value}")

    def validate(self) -> None:
        """Raise :class:`DeployError` naming the first invalid field."""
        self._validate_routing()
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
    env = {env_name: header for _, env_name, header in SEQUENCE_HEADER_KEYS}
    env["SAGEMAKER_MODEL_SERVER_TIMEOUT"] = str(response_timeout_s)
    return env


def routing_config(spec: DeploySpec) -> dict[str, Any] | None:
    """The variant's ``RoutingConfig`` (botocore's ``ProductionVariantRoutingConfig``) for ``spec``, or
    None for SageMaker's default. ``prefix-aware``: ``PREFIX_AWARE`` with its ``PrefixAwareRoutingConfig``
    (a request without a session goes to the instance that served its body's first ``PrefixLength``
    bytes, keeping a stateless conversation where the conversation cache holds it), both of its fields
    always given (:data:`DEFAULT_PREFIX_LENGTH`, :data:`DEFAULT_CONCURRENCY_PER_GPU` x the instance's GPUs)."""
    if not spec.routing:
        return None
    config: dict[str, Any] = {"RoutingStrategy": ROUTING_STRATEGIES[spec.routing]}
    if spec.routing == "prefix-aware":  # both fields, always: "Required when RoutingStrategy is PREFIX_AWARE"
        gpus = INSTANCE_GPUS.get(spec.instance_type, (1, 0))[0]
        threshold = spec.concurrency_threshold or min(
            CONCURRENCY_THRESHOLD_RANGE[1], DEFAULT_CONCURRENCY_PER_GPU * gpus
        )
        config["PrefixAwareRoutingConfig"] = {
            "PrefixLength": spec.prefix_length or DEFAULT_PREFIX_LENGTH,
            "ConcurrencyThreshold": threshold,
        }
    return config


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
                    "RoutingConfig": routing_config(spec) or {"RoutingStrategy": "LEAST_OUTSTANDING_REQUESTS"},
                }
            ],
        }
    routing = routing_config(spec)
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
                **({"RoutingConfig": routing} if routing else {}),
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
