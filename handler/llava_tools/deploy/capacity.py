"""How many sessions an instance holds (:func:`capacity_plan`) and the Application Auto Scaling
requests that scale instances or inference-component copies on them (:func:`scaling_requests`).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llava_sessions.sessions.budget import GraphShapes, graph_reserve_bytes

from .spec import DTYPE_BYTES, INSTANCE_GPUS, PLANNED_SESSION_TOKENS, VARIANT_NAME, DeployError

#: Sessions a replica should hold for ``tensor_parallel_size`` to be planned as small as that: the
#: smallest size whose replicas hold this many at :data:`PLANNED_SESSION_TOKENS` is chosen, else the
#: size that holds the most (a size holding none is refused).
MIN_PLANNED_SESSIONS = 8
#: ``tensor_parallel_size`` values planned: powers of two up to an instance's 8 GPUs.
PLANNED_SIZES = (1, 2, 4, 8)


@dataclass(frozen=True)
class CapacityPlan:
    """What one instance of a type holds: ``replicas`` (its GPUs / ``tensor_parallel_size``, each a
    replica of that many ranks), and per replica the KV budget (bytes, across its GPUs) and the
    sessions it holds in the KV tier at :data:`PLANNED_SESSION_TOKENS` tokens each, capped by
    ``max_sessions`` (per replica); ``sessions`` is the instance's total."""

    instance_type: str
    replicas: int
    gpu_bytes: int
    weights_bytes: int
    kv_budget_bytes: int
    session_bytes: int
    sessions_per_replica: int
    sessions: int
    max_sessions: int
    tensor_parallel_size: int = 1
    graph_reserve_bytes: int = 0

    def describe(self) -> str:
        """Two lines for the deploy output."""
        gib, tp = 2**30, self.tensor_parallel_size
        shape = (
            f"{self.replicas} replica(s) of {tp} GPU(s) (tensor_parallel_size={tp})"
            if tp > 1
            else (f"{self.replicas} replica(s) (devices=auto)")
        )
        gpus = self.replicas * tp
        return (
            f"{self.instance_type}: {gpus} GPU(s) of {self.gpu_bytes / gib:.0f} GiB -> {shape}, each "
            f"{self.weights_bytes / gib:.1f} GiB of weights, {self.graph_reserve_bytes / gib:.1f} GiB kept for CUDA "
            f"graphs and a {self.kv_budget_bytes / gib:.1f} GiB KV budget\n"
            f"expected capacity: {self.sessions_per_replica} sessions per replica at {PLANNED_SESSION_TOKENS} tokens "
            f"({self.session_bytes / 2**20:.0f} MiB each; max_sessions {self.max_sessions} per replica), "
            f"{self.sessions} per instance; more instances (--max-instances) hold more"
        )

    def describe_component(self, copies: int, gpus_per_copy: int) -> str:
        """Two lines for an inference component's deploy output: ``copies`` copies of ``gpus_per_copy``
        GPUs each (``--copies``, ``--accelerators-per-copy``), each copy's replicas and sessions, and the
        component's total; the instance's other GPUs are not this component's."""
        gib, tp = 2**30, self.tensor_parallel_size
        per_copy = max(1, gpus_per_copy // tp)
        sessions = self.sessions_per_replica * per_copy
        return (
            f"{self.instance_type}: inference component of {copies} copy(ies) x {gpus_per_copy} GPU(s) of "
            f"{self.gpu_bytes / gib:.0f} GiB -> {per_copy} replica(s) per copy, each "
            f"{self.weights_bytes / gib:.1f} GiB of weights, {self.graph_reserve_bytes / gib:.1f} GiB kept for CUDA "
            f"graphs and a {self.kv_budget_bytes / gib:.1f} GiB KV budget\n"
            f"expected capacity: {self.sessions_per_replica} sessions per replica at {PLANNED_SESSION_TOKENS} tokens "
            f"({self.session_bytes / 2**20:.0f} MiB each; max_sessions {self.max_sessions} per replica), {sessions} per "
            f"copy, {sessions * copies} over the "
            f"{copies} copy(ies); more copies (--max-copies) hold more"
        )


def image_feature_rows(config: dict[str, Any]) -> int:
    """The most feature rows one image gives a checkpoint of ``config`` (its ``config.json``), what a
    session's image features take at most: llava-1.5's ``(image_size / patch_size)**2`` (576); with
    ``image_grid_pinpoints`` (LLaVA-NeXT, OneVision) the base tile's plus the largest grid's patches and
    a newline row per patch row (llava-v1.6 at 672 x 672: 576 + 48 x 48 + 48 = 2,928); OneVision's
    ``anyres_max_N`` downsamples a grid over ``N`` tiles' patches to about that many (about 7,300 rows
    for ``anyres_max_9``), as transformers' ``pack_image_features`` does."""
    vision = config.get("vision_config") or {}
    size, patch = int(vision.get("image_size", 336)), int(vision.get("patch_size", 14))
    side = size // patch  # patches per tile side
    grids = config.get("image_grid_pinpoints") or []
    if not grids:
        return side * side
    most = 0
    for h, w in grids:
        rows, cols = int(h) // size * side, int(w) // size * side
        grid = rows * cols
        limit = re.fullmatch(r"anyres_max_(\d+)", str(config.get("vision_aspect_ratio") or ""))
        if limit and grid > int(limit[1]) * side * side:  # downsampled to about N tiles' patches
            scale = (int(limit[1]) * side * side / grid) ** 0.5
            rows, cols = int(rows * scale), int(cols * scale)
            grid = rows * cols
        most = max(most, grid + rows)
    return side * side + most


def capacity_plan(
    instance_type: str,
    model_dir: str | os.PathLike,
    *,
    fraction: float = 0.8,
    max_sessions: int = 128,
    tensor_parallel_size: int | None = None,
) -> CapacityPlan | None:
    """Plan one instance of ``instance_type`` for the checkpoint in ``model_dir`` (its config.json
    and weight files), or None when the type is not in :data:`INSTANCE_GPUS` or the folder has no
    readable config. Weights count their file bytes; a session's KV is 2 x layers x kv_heads x
    head_dim x dtype bytes per token at :data:`PLANNED_SESSION_TOKENS` tokens, plus its image
    features (image tokens x hidden x dtype bytes); the budget is ``fraction`` of what the weights
    and, on a replica of one GPU, the CUDA graphs' estimated memory leave on a GPU
    (``device_budget_fraction``; :func:`~llava_sessions.sessions.budget.graph_reserve_bytes`, as the
    worker counts it). A replica of ``tensor_parallel_size`` GPUs holds
    1/size of the weights and of each session's KV on each (the features on its first); None plans
    the size (:data:`MIN_PLANNED_SESSIONS`) among those that divide the heads and the GPUs.

    Raises:
        DeployError: no size fits one session on this instance type (or the size given does not),
            with the weights and the GPUs named.
    """
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
    dtype_bytes = DTYPE_BYTES.get(str(config.get("torch_dtype") or text.get("torch_dtype") or "float16"), 2)
    dtype_bytes = 2 if dtype_bytes == 4 else dtype_bytes  # a GPU serves 16-bit weights (dtype auto: bf16 or fp16)
    image_tokens = image_feature_rows(config)
    weights = sum(p.stat().st_size for p in root.glob("*.safetensors")) or sum(
        p.stat().st_size for p in root.glob("*.bin")
    )
    count, gib = gpus
    kv = 2 * layers * kv_heads * (hidden // heads) * dtype_bytes * PLANNED_SESSION_TOKENS
    features = image_tokens * hidden * dtype_bytes
    sizes = [tensor_parallel_size] if tensor_parallel_size else PLANNED_SIZES
    plans = []
    for tp in sizes:
        if tp > count or count % tp or heads % tp or kv_heads % tp:
            continue
        graphs = graph_reserve_bytes(GraphShapes.from_config(config), dtype_bytes) if tp == 1 else 0  # TP: eager
        per_gpu = max(0, int((gib * 2**30 - weights / tp - graphs) * fraction))  # the KV budget of each of its GPUs
        per_replica = min(per_gpu // (kv // tp + features), max_sessions)
        plans.append(
            CapacityPlan(
                instance_type=instance_type,
                replicas=count // tp,
                gpu_bytes=gib * 2**30,
                weights_bytes=weights,
                kv_budget_bytes=per_gpu * tp,
                session_bytes=kv + features,
                sessions_per_replica=per_replica,
                sessions=per_replica * (count // tp),
                max_sessions=max_sessions,
                tensor_parallel_size=tp,
                graph_reserve_bytes=graphs,
            )
        )
    fitting = [p for p in plans if p.sessions_per_replica >= 1]
    if not fitting:
        asked = (
            f"tensor_parallel_size {tensor_parallel_size} leaves no room"
            if tensor_parallel_size
            else f"no tensor_parallel_size of {', '.join(map(str, PLANNED_SIZES))} leaves room"
        )
        raise DeployError(
            f"{instance_type} cannot hold this model: {weights / 2**30:.1f} GiB of weights, {count} GPU(s) of "
            f"{gib} GiB; {asked} for one session ({(kv + features) / 2**20:.0f} MiB at "
            f"{PLANNED_SESSION_TOKENS} tokens); pick an instance type with more GPU memory (ml.p4de.24xlarge, "
            "ml.p5.48xlarge)"
        )
    enough = [p for p in fitting if p.sessions_per_replica >= min(MIN_PLANNED_SESSIONS, max_sessions)]
    return enough[0] if enough else max(fitting, key=lambda p: p.sessions)


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
    resource, dimension = scalable_target(endpoint_name, component)
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


def scalable_target(endpoint_name: str, component: str = "") -> tuple[str, str]:
    """The Application Auto Scaling resource id and dimension of the endpoint's variant (instances)
    or of an inference component (copies)."""
    if component:
        return f"inference-component/{component}", "sagemaker:inference-component:DesiredCopyCount"
    return f"endpoint/{endpoint_name}/variant/{VARIANT_NAME}", "sagemaker:variant:DesiredInstanceCount"
