"""The AWS side of a deployment: :class:`Deployer` runs (or, dry, prints) the S3, SageMaker and
Application Auto Scaling calls: upload, model, endpoint config, endpoint or inference component,
autoscaling, waits, delete.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

from .capacity import scalable_target
from .package import PackageFile
from .spec import (
    WAIT_DELAY_S,
    WAIT_MAX_ATTEMPTS,
    DeployError,
    DeploySpec,
    endpoint_config_request,
    inference_component_request,
    model_request,
    parse_s3_uri,
)


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
        resource, dimension = scalable_target(endpoint_name, component)
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
