"""``llava-deploy``: the command line over :mod:`.package`, :mod:`.spec`, :mod:`.capacity` and :mod:`.aws`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import replace
from datetime import datetime, timezone
from typing import Any

from llava_sessions.config import Settings

from ..cli import add_setting_arguments, checkpoint_folder_problem, parse_raw_assignment
from .aws import Deployer
from .capacity import SCALING_METRICS, capacity_plan, scaling_requests
from .package import build_package
from .spec import (
    DEFAULT_COPY_MEMORY_MB,
    DEFAULT_DOWNLOAD_TIMEOUT_S,
    DEFAULT_INSTANCE_TYPE,
    DEFAULT_RESPONSE_TIMEOUT_S,
    DEFAULT_STARTUP_TIMEOUT_S,
    INSTANCE_GPUS,
    ROUTING_STRATEGIES,
    DeployError,
    DeploySpec,
    check_instance_type,
    default_environment,
    derived_name,
    parse_s3_uri,
)


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
    add_setting_arguments(
        parser, handler_help="handler setting written into the packaged model-config.yaml, e.g. --set session_ttl_s=600"
    )
    parser.add_argument(
        "--env",
        dest="environment",
        action="append",
        default=[],
        type=parse_raw_assignment,
        metavar="KEY=VALUE",
        help="container environment variable, e.g. --env LLAVA_LOG_LEVEL=INFO",
    )
    _add_scaling_arguments(parser)
    parser.add_argument("--model-name", default="", help="default <endpoint>-<UTC timestamp>")
    parser.add_argument("--endpoint-config-name", default="", help="default <endpoint>-<UTC timestamp>")
    parser.add_argument("--region", default=None, help="AWS region (default: the boto3 session's)")
    parser.add_argument("--profile", default=None, help="AWS profile")
    parser.add_argument("--no-wait", action="store_true", help="do not wait for InService / deletion")
    parser.add_argument("--dry-run", action="store_true", help="print the API calls and uploads; call nothing")
    return parser


def _add_scaling_arguments(parser: argparse.ArgumentParser) -> None:
    """The inference-component, autoscaling and routing options of ``llava-deploy``."""
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
    _add_routing_arguments(parser)


def _add_routing_arguments(parser: argparse.ArgumentParser) -> None:
    """``--routing`` and its PREFIX_AWARE options (the production variant's ``RoutingConfig``)."""
    routing = parser.add_argument_group("routing (the production variant's RoutingConfig)")
    routing.add_argument(
        "--routing",
        choices=sorted(ROUTING_STRATEGIES),
        default="",
        help="RoutingStrategy: prefix-aware sends a request without a session to the instance that served its "
        "body's first --prefix-length bytes, so a stateless conversation (LiteLLM, LangChain, the openai package) "
        "finds its conversation cache; sessions stay sticky whatever it is (default: SageMaker's)",
    )
    routing.add_argument(
        "--prefix-length", type=int, default=None, help="PREFIX_AWARE's PrefixLength, 1024..65536 bytes"
    )
    routing.add_argument(
        "--concurrency-threshold", type=int, default=None, help="PREFIX_AWARE's ConcurrencyThreshold, 1..1024"
    )


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
        _check_arguments(parser, args)
    try:
        if args.delete:
            if clients is None and not args.dry_run:
                check_aws_setup(args.profile, args.region)
            _deployer(args, clients, need_s3=False).delete(args.endpoint_name, wait=not args.no_wait)
            return 0
        environment = default_environment(args.response_timeout)
        environment.update(dict(args.environment))
        try:  # before any AWS call: a typo in --set, --env or --instance-type, or a bad value, is named here
            Settings.check_names(dict(args.overrides), "in --set")
            Settings.from_sources(dict(args.overrides), environment)
            check_instance_type(args.instance_type)
            problem = checkpoint_folder_problem(args.model_dir) if args.model_dir else None
            if problem is not None:
                raise DeployError(problem)
        except (ValueError, DeployError) as exc:
            print(f"llava-deploy: {exc}", file=sys.stderr)
            return 2
        if clients is None and not args.dry_run:  # before the plan prints or a file uploads
            check_aws_setup(args.profile, args.region)
        spec = _spec(args, environment)
        scaling = _scaling(args, spec)
        _deploy(args, spec, scaling, clients)
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


def _check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exit 2 (argparse's ``error``) on a deployment's missing or conflicting options."""
    if bool(args.model_dir) == bool(args.model_data_uri):
        parser.error("give exactly one of --model-dir (with --s3-uri) and --model-data-uri")
    if args.model_dir and not args.s3_uri:
        parser.error("--model-dir needs --s3-uri (where to upload the artifact)")
    if args.model_data_uri and args.overrides:
        parser.error("--set applies to a packaged --model-dir; with --model-data-uri use --env LLAVA_<KEY>=...")
    for option in ("image_uri", "role_arn"):
        if not getattr(args, option):
            parser.error(f"--{option.replace('_', '-')} is required to deploy")


def _spec(args: argparse.Namespace, environment: dict[str, str]) -> DeploySpec:
    """The validated :class:`DeploySpec` of the arguments (before packaging and uploading gigabytes).

    Raises:
        DeployError: an invalid name, role, URI or size.
    """
    now = datetime.now(timezone.utc)
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
        routing=args.routing,
        prefix_length=args.prefix_length,
        concurrency_threshold=args.concurrency_threshold,
    )
    spec.validate()
    return spec


def _scaling(args: argparse.Namespace, spec: DeploySpec) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """The autoscaling requests the arguments ask for (copies of an inference component, or
    instances), or None; sets ``args.scaling_metric``'s default.

    Raises:
        DeployError: scaling options that do not fit the deployment.
    """
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
    most = max(args.instance_count, args.max_instances or 0)
    if args.routing == "prefix-aware" and most < 2 and not spec.inference_component:
        print(
            "llava-deploy: warning: prefix-aware routing acts only when two or more instances can serve a request "
            f"(SageMaker's RoutingStrategy documentation); this endpoint has {most}: give --instance-count 2 or "
            "--max-instances 2 or more",
            file=sys.stderr,
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
    return scaling


def _deploy(
    args: argparse.Namespace,
    spec: DeploySpec,
    scaling: tuple[dict[str, Any], dict[str, Any]] | None,
    clients: Callable[[str], Any] | None,
) -> None:
    """Print the capacity plan, package and upload a ``--model-dir``, deploy ``spec``, autoscale."""
    overrides = dict(args.overrides)
    gpus_here = (
        args.accelerators_per_copy if args.inference_component else INSTANCE_GPUS.get(args.instance_type, (1, 0))[0]
    )
    if args.model_dir:
        settings = Settings.from_sources(overrides, spec.environment)
        given = "tensor_parallel_size" in overrides or "LLAVA_TENSOR_PARALLEL_SIZE" in spec.environment
        plan = capacity_plan(
            args.instance_type,
            args.model_dir,
            fraction=settings.device_budget_fraction,
            max_sessions=settings.max_sessions,
            tensor_parallel_size=settings.tensor_parallel_size if given else None,
        )
        if plan is None:
            print(f"{args.instance_type}: capacity not planned (unknown type or checkpoint)")
        elif args.inference_component:  # its copies' GPUs, not the whole instance's
            print(plan.describe_component(args.copies, args.accelerators_per_copy))
        else:
            print(plan.describe())
        if plan is not None and plan.tensor_parallel_size > 1:  # the worker's replicas span that many GPUs each
            overrides.setdefault("tensor_parallel_size", plan.tensor_parallel_size)
            gpus_here //= plan.tensor_parallel_size
    files = build_package(args.model_dir, overrides=overrides, replicas=gpus_here) if args.model_dir else None
    if files is not None:
        parse_s3_uri(args.s3_uri)
    deployer = _deployer(args, clients, need_s3=files is not None)
    model_data_uri = spec.model_data_uri
    if files is not None:
        model_data_uri = deployer.upload(files, args.s3_uri)
    deployer.deploy(replace(spec, model_data_uri=model_data_uri), wait=not args.no_wait)
    if scaling is not None:
        deployer.autoscale(*scaling)


def check_aws_setup(profile: str | None, region: str | None) -> None:
    """Refuse, before any plan or upload, a deployment boto3 could not make: no region, no credentials,
    an unknown profile (boto3's own lookup: its environment, config files and instance role; no call).

    Raises:
        DeployError: what is missing and what to set.
    """
    import boto3
    from botocore.exceptions import ProfileNotFound

    try:
        session = boto3.Session(profile_name=profile, region_name=region)
        region, credentials = session.region_name, session.get_credentials()
    except ProfileNotFound as exc:
        raise DeployError(f"{exc}: name a profile of ~/.aws/config (--profile or AWS_PROFILE)") from None
    if not region:
        raise DeployError("no AWS region: pass --region, or set AWS_DEFAULT_REGION (--dry-run plans without one)")
    if credentials is None:
        raise DeployError(
            "no AWS credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE, or run where an "
            "instance role gives them (--dry-run plans without them)"
        )


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
