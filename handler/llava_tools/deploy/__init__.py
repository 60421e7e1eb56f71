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
   and uses its checkpoint and ``model-config.yaml`` (llava_tools/serve/container.py). The handler and
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

from .aws import Deployer
from .capacity import INSTANCE_GPUS, SCALING_METRICS, CapacityPlan, capacity_plan, scaling_requests
from .cli import main
from .package import ARCHIVER_VERSION, PackageFile, build_package, write_package
from .spec import DeployError, DeploySpec, derived_name, endpoint_config_request, model_request, parse_s3_uri

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
    "derived_name",
    "main",
    "model_request",
    "parse_s3_uri",
    "scaling_requests",
    "write_package",
]
