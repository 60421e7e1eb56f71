"""``llava-deploy`` against real boto3 clients with botocore's ``Stubber``: every S3 key uploaded and the
exact parameters of create_model / create_endpoint_config / create_endpoint / update_endpoint /
delete_*, plus the packaged TorchServe layout (checked against torch-model-archiver's own output)."""

from __future__ import annotations

import datetime as dt
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import boto3
import pytest
import yaml
from botocore.stub import ANY, Stubber

from llava_sessions.wire.in_flight import GENERATION_SLOTS
from llava_tools.deploy import DeployError, build_package, derived_name, main

REPO = Path(__file__).resolve().parents[2]
PACKAGE_DIR = REPO / "handler" / "llava_sessions"
ACCOUNT = "123456789012"
ROLE = f"arn:aws:iam::{ACCOUNT}:role/SageMakerExecution"
IMAGE = f"{ACCOUNT}.dkr.ecr.us-east-1.amazonaws.com/llava-sessions:abc123"
NOW = dt.datetime(2026, 11, 22, 9, 0, tzinfo=dt.timezone.utc)
SEQUENCE_ENV = {
    "TS_REQUEST_SEQUENCE_ID": "X-Amzn-SageMaker-Session-Id",
    "TS_REQUEST_SEQUENCE_START": "X-Amzn-SageMaker-New-Session-Id",
    "TS_REQUEST_SEQUENCE_END": "X-Llava-Sequence-End",
}


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    """A stand-in llava-hf folder: a few files, a sub-folder, and hub cache files to leave out."""
    root = tmp_path / "ckpt"
    (root / "sub").mkdir(parents=True)
    (root / ".cache" / "huggingface").mkdir(parents=True)
    (root / "config.json").write_text('{"model_type": "llava"}')
    (root / "model.safetensors").write_bytes(b"\0" * 64)
    (root / "tokenizer.json").write_text("{}")
    (root / "sub" / "extra.txt").write_text("x")
    (root / ".cache" / "huggingface" / "download.lock").write_text("")
    return root


def package_keys() -> list[str]:
    return sorted(
        f"llava/llava_sessions/{p.relative_to(PACKAGE_DIR).as_posix()}"
        for p in PACKAGE_DIR.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
    )


def expected_keys() -> list[str]:
    fixed = [
        "llava/MAR-INF/MANIFEST.json",
        "llava/config.json",
        "llava/llava_handler.py",
        "llava/model-config.yaml",
        "llava/model.safetensors",
        "llava/sub/extra.txt",
        "llava/tokenizer.json",
    ]
    return sorted(fixed + package_keys())


def clients():
    """Real boto3 clients (no credentials needed: every call is stubbed)."""
    kwargs = {"region_name": "us-east-1", "aws_access_key_id": "x", "aws_secret_access_key": "x"}
    return {
        "sagemaker": boto3.client("sagemaker", **kwargs),
        "s3": boto3.client("s3", **kwargs),
        "application-autoscaling": boto3.client("application-autoscaling", **kwargs),
    }


def not_found(stub: Stubber, operation: str, params: dict) -> None:
    stub.add_client_error(
        operation,
        service_error_code="ValidationException",
        service_message=f'Could not find endpoint "{params.get("EndpointName")}".',
        http_status_code=400,
        expected_params=params,
    )


def stub_scalable_targets(stub: Stubber, scalable: dict, targets: list) -> None:
    """The ``describe_scalable_targets`` call that looks for ``scalable``'s target, answering ``targets``."""
    stub.add_response(
        "describe_scalable_targets",
        {"ScalableTargets": targets},
        {
            "ServiceNamespace": "sagemaker",
            "ResourceIds": [scalable["ResourceId"]],
            "ScalableDimension": scalable["ScalableDimension"],
        },
    )


def describe_endpoint_response(name: str, status: str, config: str = "cfg") -> dict:
    return {
        "EndpointName": name,
        "EndpointArn": f"arn:aws:sagemaker:us-east-1:{ACCOUNT}:endpoint/{name}",
        "EndpointConfigName": config,
        "EndpointStatus": status,
        "CreationTime": NOW,
        "LastModifiedTime": NOW,
        **({"FailureReason": "CannotStartContainerError: /ping did not answer"} if status == "Failed" else {}),
    }


# ---- packaging -----------------------------------------------------------------------------------


def test_package_is_torchserve_no_archive_layout_plus_the_checkpoint(checkpoint: Path, tmp_path: Path) -> None:
    files = build_package(checkpoint, overrides={"session_ttl_s": 600}, created_on=NOW.replace(tzinfo=None))
    assert [f.key for f in files] == expected_keys()
    by_key = {f.key: f for f in files}
    manifest = json.loads(by_key["llava/MAR-INF/MANIFEST.json"].data)
    config = yaml.safe_load(by_key["llava/model-config.yaml"].data)
    assert config["handler"]["session_ttl_s"] == 600 and config["handler"]["model_dir"] == ""
    assert config["sequenceBatching"] is True and config["batchSize"] == 136  # the rest is the repository's
    assert by_key["llava/config.json"].source == checkpoint / "config.json"

    # The same MANIFEST.json torch-model-archiver 0.12 writes for this handler and config file.
    archiver = shutil.which("torch-model-archiver", path=str(Path(sys.executable).parent))
    if archiver is None:
        pytest.skip("torch-model-archiver not installed")
    out = tmp_path / "store"
    out.mkdir()
    subprocess.run(
        [
            archiver,
            "--model-name",
            "llava",
            "--version",
            "1.0",
            "--handler",
            str(REPO / "handler" / "llava_handler.py"),
            "--config-file",
            str(REPO / "model-config.yaml"),
            "--archive-format",
            "no-archive",
            "--export-path",
            str(out),
        ],
        check=True,
        capture_output=True,
    )
    reference = json.loads((out / "llava" / "MAR-INF" / "MANIFEST.json").read_text())
    assert {k: v for k, v in manifest.items() if k != "createdOn"} == {
        k: v for k, v in reference.items() if k != "createdOn"
    }
    assert manifest["createdOn"] == "22/11/2026 09:00:00"


def test_package_refuses_bad_settings_and_folders(checkpoint: Path, tmp_path: Path) -> None:
    with pytest.raises(DeployError, match="unknown key"):
        build_package(checkpoint, overrides={"bogus": 1})
    with pytest.raises(DeployError, match="max_sessions"):
        build_package(checkpoint, overrides={"max_sessions": 0})
    with pytest.raises(DeployError, match="no config.json"):
        build_package(tmp_path)
    (checkpoint / "MAR-INF").mkdir()
    (checkpoint / "MAR-INF" / "MANIFEST.json").write_text("{}")
    with pytest.raises(DeployError, match="collides"):
        build_package(checkpoint)


def test_deploy_module_does_not_import_torch() -> None:
    code = "import sys, llava_tools.deploy, llava_tools.serve.container; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_derived_names_fit_sagemaker() -> None:
    assert derived_name("llava-chat", NOW) == "llava-chat-20261122090000"
    long = derived_name("a" * 63, NOW)
    assert len(long) == 63 and long.endswith("-20261122090000")
    assert derived_name("x" * 47 + "-yy", NOW) == "x" * 47 + "-20261122090000"  # no "--"


# ---- deploy / update / delete with Stubber ------------------------------------------------------


def deploy_args(checkpoint: Path, *extra: str) -> list[str]:
    return [
        "--endpoint-name",
        "llava-chat",
        "--model-dir",
        str(checkpoint),
        "--s3-uri",
        "s3://my-bucket/llava/v1",
        "--image-uri",
        IMAGE,
        "--role-arn",
        ROLE,
        "--instance-type",
        "ml.g5.2xlarge",
        "--instance-count",
        "2",
        "--model-name",
        "llava-chat-m1",
        "--endpoint-config-name",
        "llava-chat-c1",
        "--set",
        "session_ttl_s=600",
        "--env",
        "LLAVA_LOG_LEVEL=INFO",
        "--startup-timeout",
        "900",
        "--download-timeout",
        "1200",
        *extra,
    ]


EXPECTED_MODEL = {
    "ModelName": "llava-chat-m1",
    "ExecutionRoleArn": ROLE,
    "PrimaryContainer": {
        "Image": IMAGE,
        "ModelDataSource": {
            "S3DataSource": {"S3Uri": "s3://my-bucket/llava/v1/", "S3DataType": "S3Prefix", "CompressionType": "None"}
        },
        "Environment": {**SEQUENCE_ENV, "SAGEMAKER_MODEL_SERVER_TIMEOUT": "120", "LLAVA_LOG_LEVEL": "INFO"},
    },
}
EXPECTED_CONFIG = {
    "EndpointConfigName": "llava-chat-c1",
    "ProductionVariants": [
        {
            "VariantName": "AllTraffic",
            "ModelName": "llava-chat-m1",
            "InstanceType": "ml.g5.2xlarge",
            "InitialInstanceCount": 2,
            "ContainerStartupHealthCheckTimeoutInSeconds": 900,
            "ModelDataDownloadTimeoutInSeconds": 1200,
        }
    ],
}


def stub_uploads(s3_stub: Stubber, files: list[str]) -> None:
    for key in files:
        s3_stub.add_response(
            "put_object",
            {},
            {
                "Bucket": "my-bucket",
                "Key": f"llava/v1/{key}",
                "Body": ANY,
                **({} if key in GENERATED else {"ChecksumAlgorithm": ANY}),
            },
        )


GENERATED = {"llava/MAR-INF/MANIFEST.json", "llava/model-config.yaml"}


def test_deploy_uploads_every_key_and_creates_model_config_endpoint(checkpoint: Path, capsys) -> None:
    c = clients()
    uploaded: dict[str, bytes] = {}

    def record(params, **_):  # returns None: a provide-client-params handler's value would replace params
        uploaded[params["Key"]] = params["Body"] if isinstance(params["Body"], bytes) else b""

    c["s3"].meta.events.register("provide-client-params.s3.PutObject", record)
    with Stubber(c["s3"]) as s3_stub, Stubber(c["sagemaker"]) as sm_stub:
        stub_uploads(s3_stub, expected_keys())
        sm_stub.add_response(
            "create_model", {"ModelArn": f"arn:aws:sagemaker:us-east-1:{ACCOUNT}:model/llava-chat-m1"}, EXPECTED_MODEL
        )
        sm_stub.add_response(
            "create_endpoint_config",
            {"EndpointConfigArn": f"arn:aws:sagemaker:us-east-1:{ACCOUNT}:endpoint-config/llava-chat-c1"},
            EXPECTED_CONFIG,
        )
        not_found(sm_stub, "describe_endpoint", {"EndpointName": "llava-chat"})
        sm_stub.add_response(
            "create_endpoint",
            {"EndpointArn": f"arn:aws:sagemaker:us-east-1:{ACCOUNT}:endpoint/llava-chat"},
            {"EndpointName": "llava-chat", "EndpointConfigName": "llava-chat-c1"},
        )
        sm_stub.add_response(
            "describe_endpoint",
            describe_endpoint_response("llava-chat", "InService", "llava-chat-c1"),
            {"EndpointName": "llava-chat"},
        )  # the endpoint_in_service waiter's poll
        assert main(deploy_args(checkpoint), clients=c.__getitem__) == 0
        s3_stub.assert_no_pending_responses()
        sm_stub.assert_no_pending_responses()
    assert sorted(uploaded) == [f"llava/v1/{k}" for k in expected_keys()]
    config = yaml.safe_load(uploaded["llava/v1/llava/model-config.yaml"])
    assert config["handler"]["session_ttl_s"] == 600 and config["handler"]["model_dir"] == ""
    assert json.loads(uploaded["llava/v1/llava/MAR-INF/MANIFEST.json"])["model"]["handler"] == "llava_handler.py"
    assert "endpoint llava-chat is InService" in capsys.readouterr().out


def test_existing_endpoint_is_updated(tmp_path: Path) -> None:
    c = clients()
    args = [
        "--endpoint-name",
        "llava-chat",
        "--model-data-uri",
        "s3://my-bucket/llava/v1",
        "--image-uri",
        IMAGE,
        "--role-arn",
        ROLE,
        "--model-name",
        "llava-chat-m2",
        "--endpoint-config-name",
        "llava-chat-c2",
    ]
    with Stubber(c["sagemaker"]) as sm_stub:
        sm_stub.add_response(
            "create_model",
            {"ModelArn": "arn:aws:sagemaker:us-east-1:1:model/m"},
            {
                **EXPECTED_MODEL,
                "ModelName": "llava-chat-m2",
                "PrimaryContainer": {
                    **EXPECTED_MODEL["PrimaryContainer"],
                    "Environment": {**SEQUENCE_ENV, "SAGEMAKER_MODEL_SERVER_TIMEOUT": "120"},
                },
            },
        )
        sm_stub.add_response(
            "create_endpoint_config",
            {"EndpointConfigArn": "arn:aws:sagemaker:us-east-1:1:endpoint-config/c"},
            {
                "EndpointConfigName": "llava-chat-c2",
                "ProductionVariants": [
                    {
                        **EXPECTED_CONFIG["ProductionVariants"][0],
                        "ModelName": "llava-chat-m2",
                        "InitialInstanceCount": 1,
                        "ContainerStartupHealthCheckTimeoutInSeconds": 1200,
                        "ModelDataDownloadTimeoutInSeconds": 1800,
                    }
                ],
            },
        )
        sm_stub.add_response(
            "describe_endpoint",
            describe_endpoint_response("llava-chat", "InService", "llava-chat-c1"),
            {"EndpointName": "llava-chat"},
        )
        sm_stub.add_response(
            "update_endpoint",
            {"EndpointArn": "arn:aws:sagemaker:us-east-1:1:endpoint/llava-chat"},
            {"EndpointName": "llava-chat", "EndpointConfigName": "llava-chat-c2"},
        )
        assert main([*args, "--no-wait"], clients=c.__getitem__) == 0
        sm_stub.assert_no_pending_responses()


def test_prefix_aware_routing_writes_the_variants_routing_config(capsys) -> None:
    """``--routing prefix-aware``: the variant's ``RoutingConfig``, checked by the Stubber against
    botocore's own ``sagemaker`` model (its parameter names and ranges)."""
    c = clients()
    base = ["--endpoint-name", "llava-chat", "--model-data-uri", "s3://my-bucket/llava/v1/", "--image-uri", IMAGE]
    base += ["--role-arn", ROLE, "--model-name", "llava-chat-m1", "--endpoint-config-name", "llava-chat-c1"]
    routing = {
        "RoutingStrategy": "PREFIX_AWARE",
        "PrefixAwareRoutingConfig": {"PrefixLength": 4096, "ConcurrencyThreshold": 8},
    }
    with Stubber(c["sagemaker"]) as sm_stub:
        sm_stub.add_response("create_model", {"ModelArn": "arn:aws:sagemaker:us-east-1:1:model/m"}, None)
        sm_stub.add_response(
            "create_endpoint_config",
            {"EndpointConfigArn": "arn:aws:sagemaker:us-east-1:1:endpoint-config/c"},
            {
                "EndpointConfigName": "llava-chat-c1",
                "ProductionVariants": [
                    {
                        **EXPECTED_CONFIG["ProductionVariants"][0],
                        "InitialInstanceCount": 1,
                        "ContainerStartupHealthCheckTimeoutInSeconds": 1200,
                        "ModelDataDownloadTimeoutInSeconds": 1800,
                        "RoutingConfig": routing,
                    }
                ],
            },
        )
        not_found(sm_stub, "describe_endpoint", {"EndpointName": "llava-chat"})
        sm_stub.add_response(
            "create_endpoint",
            {"EndpointArn": "arn:aws:sagemaker:us-east-1:1:endpoint/llava-chat"},
            {"EndpointName": "llava-chat", "EndpointConfigName": "llava-chat-c1"},
        )
        args = [*base, "--routing", "prefix-aware", "--prefix-length", "4096", "--concurrency-threshold", "8"]
        assert main([*args, "--no-wait"], clients=c.__getitem__) == 0
        sm_stub.assert_no_pending_responses()
    for bad, message in (
        (["--routing", "prefix-aware", "--prefix-length", "100"], "--prefix-length must be 1024..65536"),
        (["--prefix-length", "2048"], "go with --routing prefix-aware"),
        (["--routing", "prefix-aware", "--concurrency-threshold", "0"], "--concurrency-threshold must be 1..1024"),
    ):
        assert main([*base, *bad, "--no-wait"], clients=c.__getitem__) == 1
        assert message in capsys.readouterr().err


def test_prefix_aware_routing_always_carries_the_fields_botocores_model_documents_as_required(capsys) -> None:
    """Issue 45 item 3: AWS rejects ``PREFIX_AWARE`` without ``PrefixLength`` and ``ConcurrencyThreshold``.
    botocore's model marks them required only in their documentation ("Required when RoutingStrategy
    is PREFIX_AWARE"), so the members that say so are read from it, and each ``RoutingConfig`` the
    dry run writes must carry them and pass botocore's own validation of ``CreateEndpointConfig``."""
    import re

    import botocore.session
    from botocore.validate import ParamValidator

    model = botocore.session.get_session().get_service_model("sagemaker")
    shape = model.shape_for("ProductionVariantRoutingConfig").members["PrefixAwareRoutingConfig"]
    documented = re.compile(r"Required when <code>RoutingStrategy</code> is <code>PREFIX_AWARE</code>")
    required = {name for name, member in shape.members.items() if documented.search(member.documentation)}
    assert required == {"PrefixLength", "ConcurrencyThreshold"}
    base = ["--endpoint-name", "llava-chat", "--model-data-uri", "s3://my-bucket/llava/v1/", "--image-uri", IMAGE]
    base += ["--role-arn", ROLE, "--dry-run"]
    written = []
    for extra, gpus in ((["--instance-type", "ml.g5.12xlarge"], 4), (["--prefix-length", "2048"], 1)):
        assert main([*base, "--routing", "prefix-aware", *extra]) == 0
        out, err = capsys.readouterr()
        assert "prefix-aware routing acts only when two or more instances" in err  # one instance here
        at = out.index('"RoutingConfig": ') + len('"RoutingConfig": ')
        config, _ = json.JSONDecoder().raw_decode(out[at:])
        written.append(config)
        assert config["RoutingStrategy"] == "PREFIX_AWARE" and set(config["PrefixAwareRoutingConfig"]) == required
        assert config["PrefixAwareRoutingConfig"]["ConcurrencyThreshold"] == GENERATION_SLOTS["cuda"] * gpus
        request = {
            "EndpointConfigName": "c",
            "ProductionVariants": [
                {"VariantName": "v", "ModelName": "m", "InstanceType": "ml.g5.2xlarge", "RoutingConfig": config}
            ],
        }
        report = ParamValidator().validate(request, model.operation_model("CreateEndpointConfig").input_shape)
        assert not report.has_errors(), report.generate_report()
    assert [c["PrefixAwareRoutingConfig"]["PrefixLength"] for c in written] == [1024, 2048]
    assert main([*base, "--routing", "prefix-aware", "--instance-count", "2"]) == 0
    assert "two or more instances" not in capsys.readouterr().err


def test_failed_endpoint_reports_the_failure_reason(capsys) -> None:
    c = clients()
    args = [
        "--endpoint-name",
        "llava-chat",
        "--model-data-uri",
        "s3://my-bucket/llava/v1/",
        "--image-uri",
        IMAGE,
        "--role-arn",
        ROLE,
        "--model-name",
        "m",
        "--endpoint-config-name",
        "c",
    ]
    with Stubber(c["sagemaker"]) as sm_stub:
        sm_stub.add_response("create_model", {"ModelArn": "arn:aws:sagemaker:us-east-1:1:model/m"}, None)
        sm_stub.add_response(
            "create_endpoint_config", {"EndpointConfigArn": "arn:aws:sagemaker:us-east-1:1:endpoint-config/c"}, None
        )
        not_found(sm_stub, "describe_endpoint", {"EndpointName": "llava-chat"})
        sm_stub.add_response(
            "create_endpoint", {"EndpointArn": "arn:aws:sagemaker:us-east-1:1:endpoint/llava-chat"}, None
        )
        sm_stub.add_response("describe_endpoint", describe_endpoint_response("llava-chat", "Failed", "c"), None)
        assert main(args, clients=c.__getitem__) == 1
    assert "CannotStartContainerError: /ping did not answer" in capsys.readouterr().err


SCALABLE = {
    "ServiceNamespace": "sagemaker",
    "ResourceId": "endpoint/llava-chat/variant/AllTraffic",
    "ScalableDimension": "sagemaker:variant:DesiredInstanceCount",
}


@pytest.mark.parametrize("autoscaled", [False, True])
def test_delete_removes_endpoint_config_and_models(autoscaled: bool) -> None:
    c = clients()
    with Stubber(c["sagemaker"]) as sm_stub, Stubber(c["application-autoscaling"]) as as_stub:
        sm_stub.add_response(
            "describe_endpoint",
            describe_endpoint_response("llava-chat", "InService", "llava-chat-c1"),
            {"EndpointName": "llava-chat"},
        )
        sm_stub.add_response(
            "list_inference_components", {"InferenceComponents": []}, {"EndpointNameEquals": "llava-chat"}
        )
        target = {**SCALABLE, "MinCapacity": 1, "MaxCapacity": 4, "RoleARN": ROLE, "CreationTime": NOW}
        stub_scalable_targets(as_stub, SCALABLE, [target] if autoscaled else [])
        if autoscaled:  # the scalable target goes before the endpoint
            as_stub.add_response("deregister_scalable_target", {}, SCALABLE)
        sm_stub.add_response(
            "describe_endpoint_config",
            {
                "EndpointConfigName": "llava-chat-c1",
                "EndpointConfigArn": "arn:aws:sagemaker:us-east-1:1:endpoint-config/c",
                "CreationTime": NOW,
                "ProductionVariants": [{"VariantName": "AllTraffic", "ModelName": "llava-chat-m1"}],
            },
            {"EndpointConfigName": "llava-chat-c1"},
        )
        sm_stub.add_response("delete_endpoint", {}, {"EndpointName": "llava-chat"})
        not_found(sm_stub, "describe_endpoint", {"EndpointName": "llava-chat"})  # endpoint_deleted waiter: gone
        sm_stub.add_response("delete_endpoint_config", {}, {"EndpointConfigName": "llava-chat-c1"})
        sm_stub.add_response("delete_model", {}, {"ModelName": "llava-chat-m1"})
        assert main(["--endpoint-name", "llava-chat", "--delete"], clients=c.__getitem__) == 0
        sm_stub.assert_no_pending_responses()
        as_stub.assert_no_pending_responses()

    with Stubber(c["sagemaker"]) as sm_stub:
        not_found(sm_stub, "describe_endpoint", {"EndpointName": "nope"})
        assert main(["--endpoint-name", "nope", "--delete"], clients=c.__getitem__) == 1


def test_dry_run_prints_the_calls_and_calls_nothing(checkpoint: Path, capsys) -> None:
    assert main([*deploy_args(checkpoint), "--dry-run"], clients=None) == 0
    out = capsys.readouterr().out
    for key in expected_keys():
        assert f"'my-bucket', 'llava/v1/{key}')" in out
    assert "sagemaker.create_model(" in out and '"CompressionType": "None"' in out
    assert '"S3Uri": "s3://my-bucket/llava/v1/"' in out and '"InitialInstanceCount": 2' in out
    assert "sagemaker.create_endpoint(" in out and "endpoint_in_service" in out
    # a dry run never says it did anything: every line is a call it would make or what would happen
    lines = [line for line in out.splitlines() if line and not line.startswith((" ", "}", "]"))]
    said = [line for line in lines if not line.startswith(("would ", "ml.", "expected capacity"))]
    assert said == [], said
    assert "would create model llava-chat-m1" in out and "would wait until llava-chat is InService" in out
    assert main(["--endpoint-name", "llava-chat", "--delete", "--dry-run"], clients=None) == 0
    out = capsys.readouterr().out
    assert "sagemaker.delete_endpoint(" in out and "delete_model" in out
    assert all(line.startswith(("would ", " ", "}")) for line in out.splitlines() if line)


def test_invalid_arguments_fail_before_any_call(checkpoint: Path, capsys) -> None:
    assert main([*deploy_args(checkpoint), "--role-arn", "not-a-role", "--dry-run"], clients=None) == 1
    assert "invalid role ARN" in capsys.readouterr().err
    assert main([*deploy_args(checkpoint), "--instance-type", "g5.2xlarge", "--dry-run"], clients=None) == 2
    assert "(did you mean ml.g5.2xlarge?)" in capsys.readouterr().err  # a usage error, as a --set typo
    assert main([*deploy_args(checkpoint), "--endpoint-name", "bad_name", "--dry-run"], clients=None) == 1
    assert main([*deploy_args(checkpoint), "--startup-timeout", "5", "--dry-run"], clients=None) == 1
    with pytest.raises(SystemExit):
        main(["--endpoint-name", "x", "--image-uri", IMAGE, "--role-arn", ROLE], clients=None)  # no model data


@pytest.mark.parametrize(("instance_type", "policy_target"), [("ml.g5.2xlarge", 60.0), ("ml.g6e.12xlarge", 240.0)])
def test_deploy_with_autoscaling_registers_the_variant_and_a_target_tracking_policy(
    capsys, instance_type, policy_target
) -> None:
    """--scaling-target is per GPU: SageMaker's GPUMemoryUtilization sums an instance's GPUs, so on the
    4-GPU g6e.12xlarge 60 % per GPU is a policy target of 240."""
    c = clients()
    args = [
        "--endpoint-name", "llava-chat", "--model-data-uri", "s3://my-bucket/llava/v1", "--image-uri", IMAGE,
        "--role-arn", ROLE, "--model-name", "llava-chat-m1", "--endpoint-config-name", "llava-chat-c1",
        "--instance-type", instance_type,
        "--min-instances", "1", "--max-instances", "4", "--scaling-target", "60",
    ]  # fmt: skip
    with Stubber(c["sagemaker"]) as sm_stub, Stubber(c["application-autoscaling"]) as as_stub:
        sm_stub.add_response("create_model", {"ModelArn": "arn:aws:sagemaker:us-east-1:1:model/m"}, None)
        sm_stub.add_response("create_endpoint_config", {"EndpointConfigArn": "arn:aws:sagemaker:us-east-1:1:c/c"}, None)
        not_found(sm_stub, "describe_endpoint", {"EndpointName": "llava-chat"})
        sm_stub.add_response("create_endpoint", {"EndpointArn": "arn:aws:sagemaker:us-east-1:1:endpoint/e"}, None)
        sm_stub.add_response(
            "describe_endpoint",
            describe_endpoint_response("llava-chat", "InService", "llava-chat-c1"),
            {"EndpointName": "llava-chat"},
        )
        as_stub.add_response("register_scalable_target", {}, {**SCALABLE, "MinCapacity": 1, "MaxCapacity": 4})
        as_stub.add_response(
            "put_scaling_policy",
            {"PolicyARN": "arn:aws:autoscaling:us-east-1:1:scalingPolicy:p", "Alarms": []},
            {
                **SCALABLE,
                "PolicyName": "llava-chat-gpu-memory",
                "PolicyType": "TargetTrackingScaling",
                "TargetTrackingScalingPolicyConfiguration": {
                    "TargetValue": policy_target,
                    "CustomizedMetricSpecification": {
                        "MetricName": "GPUMemoryUtilization",
                        "Namespace": "/aws/sagemaker/Endpoints",
                        "Statistic": "Average",
                        "Dimensions": [
                            {"Name": "EndpointName", "Value": "llava-chat"},
                            {"Name": "VariantName", "Value": "AllTraffic"},
                        ],
                    },
                    "ScaleInCooldown": 300,
                    "ScaleOutCooldown": 300,
                },
            },
        )
        assert main(args, clients=c.__getitem__) == 0
        sm_stub.assert_no_pending_responses()
        as_stub.assert_no_pending_responses()
    assert "autoscaling endpoint/llava-chat/variant/AllTraffic: 1..4 instances" in capsys.readouterr().out
    assert main([*args[:-6], "--min-instances", "3", "--max-instances", "2"], clients=c.__getitem__) == 1
    assert main([*args, "--no-wait"], clients=c.__getitem__) == 1  # autoscaling needs InService


def test_capacity_plan_of_llava_7b_on_common_instance_types(tmp_path: Path) -> None:
    from llava_sessions.sessions.budget import GraphShapes, graph_reserve_bytes
    from llava_tools.deploy import capacity_plan

    folder = tmp_path / "llava-1.5-7b-hf"
    folder.mkdir()
    config = {  # llava-hf/llava-1.5-7b-hf's config.json, the fields the plan reads
        "torch_dtype": "float16",
        "text_config": {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32},
        "vision_config": {"image_size": 336},
    }
    (folder / "config.json").write_text(json.dumps(config))
    with open(folder / "model.safetensors", "wb") as f:  # a sparse file of 7B fp16 weights' size
        f.truncate(14_126_000_000)
    g5 = capacity_plan("ml.g5.2xlarge", folder)
    assert g5 is not None and g5.replicas == 1
    assert g5.session_bytes == 2 * 32 * 4096 * 2 * 1024 + 576 * 4096 * 2  # 512 MiB KV + 4.5 MiB features
    assert 10 <= g5.sessions <= 20  # (24 GiB - 14.1 GB) x 0.8 / 517 MiB
    big = capacity_plan("ml.g5.12xlarge", folder)
    assert big is not None and big.replicas == 4 and big.sessions == 4 * g5.sessions_per_replica
    p5 = capacity_plan("ml.p5.48xlarge", folder)
    # memory caps it here, not max_sessions (128); the CUDA graphs' estimate comes out of each GPU first
    assert p5 is not None and p5.replicas == 8 and p5.sessions_per_replica == 105 and p5.sessions == 840
    reserve = graph_reserve_bytes(GraphShapes.from_config(config), 2)
    assert p5.graph_reserve_bytes == g5.graph_reserve_bytes == reserve > 0
    assert p5.kv_budget_bytes == int((80 * 2**30 - 14_126_000_000 - reserve) * 0.8)
    assert f"{reserve / 2**30:.1f} GiB kept for CUDA graphs" in p5.describe()
    assert capacity_plan("ml.p5.48xlarge", folder, max_sessions=1000).sessions > 8 * 100  # type: ignore[union-attr]
    assert "replica(s)" in big.describe() and "per instance" in big.describe()
    assert capacity_plan("ml.m5.xlarge", folder) is None


def test_the_plan_counts_an_anyres_image_s_most_feature_rows(tmp_path: Path) -> None:
    """llava-v1.6's image is its base tile and up to a 2 x 2 grid with a newline per row: 2,928 rows, as
    the README says, not llava-1.5's 576; OneVision's anyres_max_9 about 7,300."""
    from llava_tools.deploy import capacity_plan
    from llava_tools.deploy.capacity import image_feature_rows

    folder = tmp_path / "llava-v1.6-mistral-7b-hf"
    folder.mkdir()
    pinpoints = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]
    text = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8}
    config = {"vision_config": {"image_size": 336, "patch_size": 14}, "image_grid_pinpoints": pinpoints}
    (folder / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16", "text_config": text}))
    with open(folder / "model.safetensors", "wb") as f:
        f.truncate(15_100_000_000)
    assert image_feature_rows(config) == 2928 and image_feature_rows({}) == 576
    plan = capacity_plan("ml.g5.2xlarge", folder)
    assert plan is not None and plan.session_bytes == 2 * 32 * 8 * 128 * 2 * 1024 + 2928 * 4096 * 2
    onevision = {"vision_config": {"image_size": 384, "patch_size": 14}, "vision_aspect_ratio": "anyres_max_9"}
    onevision["image_grid_pinpoints"] = [[384 * a, 384 * b] for a in range(1, 7) for b in range(1, 7)]
    assert 7000 < image_feature_rows(onevision) < 7600


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["--set", "session_tl_s=600"], "unknown key(s) in --set: session_tl_s (did you mean session_ttl_s?)"),
        (["--env", "LLAVA_SESION_TTL_S=600"], "LLAVA_SESION_TTL_S (did you mean LLAVA_SESSION_TTL_S?)"),
        (["--env", "LLAVA_MAX_SESSIONS=abc"], "LLAVA_MAX_SESSIONS"),
        (["--set", "max_sessions=0"], "max_sessions"),
        (  # SageMaker's own list of endpoint instance types (botocore's): a typo plans and uploads nothing
            ["--instance-type", "ml.g5.2xlarg", "--dry-run"],
            "--instance-type ml.g5.2xlarg is not a SageMaker endpoint instance type (did you mean ml.g5.2xlarge?)",
        ),
    ],
)
def test_a_typo_in_a_setting_is_named_before_any_call_by_the_cli(checkpoint: Path, extra, says) -> None:
    """``llava-deploy`` as the user runs it: one line naming the setting (and the closest valid one),
    exit status 2, no traceback, no AWS call (no credentials here: a call would fail otherwise)."""
    deploy = Path(sys.executable).parent / "llava-deploy"
    done = subprocess.run(
        [str(deploy), *deploy_args(checkpoint), *extra],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": "", "AWS_CONFIG_FILE": "/dev/null"},
    )
    assert done.returncode == 2, done.stderr
    assert says in done.stderr and "Traceback" not in done.stderr
    assert done.stderr.startswith("llava-deploy: ") and len(done.stderr.strip().splitlines()) == 1
    assert done.stdout == ""  # no plan, no upload notice before the refusal


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({}, "llava-deploy: no AWS region: pass --region, or set AWS_DEFAULT_REGION (--dry-run plans without one)"),
        ({"AWS_DEFAULT_REGION": "us-east-1"}, "llava-deploy: no AWS credentials: set AWS_ACCESS_KEY_ID and"),
        (
            {"AWS_DEFAULT_REGION": "us-east-1", "AWS_PROFILE": "nobody"},
            "llava-deploy: The config profile (nobody) could not be found: name a profile of ~/.aws/config",
        ),
    ],
)
def test_a_deployment_boto3_cannot_make_is_refused_before_the_plan_or_an_upload(checkpoint, tmp_path, env, says):
    """No region, no credentials, an unknown profile: one line naming what to set, before the capacity
    plan prints or a file uploads (boto3's own lookup, no AWS call)."""
    deploy = Path(sys.executable).parent / "llava-deploy"
    clean = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    clean |= {"AWS_CONFIG_FILE": str(tmp_path / "none"), "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none")}
    clean |= {"AWS_EC2_METADATA_DISABLED": "true", **env}
    done = subprocess.run(
        [str(deploy), *deploy_args(checkpoint)], capture_output=True, text=True, timeout=60, env=clean
    )
    assert done.returncode == 1 and done.stderr.startswith(says) and done.stdout == ""
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr


def test_capacity_grows_with_the_instance_s_gpus(checkpoint: Path, capsys) -> None:
    """``max_sessions`` is per replica (one per GPU): the package for an N-GPU instance keeps it and
    gives TorchServe job groups for N x max_sessions + 8 (batchSize = maxNumSequence), so a stock
    TorchServe serving the artifact holds them all too."""
    files = {f.key: f for f in build_package(checkpoint, overrides={"max_sessions": 32}, replicas=4)}
    config = yaml.safe_load(files["llava/model-config.yaml"].read())
    assert config["handler"]["max_sessions"] == 32 and config["batchSize"] == config["maxNumSequence"] == 136
    assert main([*deploy_args(checkpoint, "--instance-type", "ml.p5.48xlarge"), "--dry-run"], clients=None) == 0
    out = capsys.readouterr().out
    assert "126 sessions per replica" in out and "max_sessions 128 per replica), 1008 per instance" in out
    assert main([*deploy_args(checkpoint), "--dry-run"], clients=None) == 0  # one GPU: the default 128
    assert "max_sessions 128 per replica), " in capsys.readouterr().out


COMPONENT_SCALABLE = {
    "ServiceNamespace": "sagemaker",
    "ResourceId": "inference-component/llava-ic",
    "ScalableDimension": "sagemaker:inference-component:DesiredCopyCount",
}


def test_an_inference_component_s_plan_is_its_copies_not_the_instance(checkpoint: Path, capsys) -> None:
    """--inference-component --dry-run plans the GPUs its copies take (2 copies of 1 GPU: a replica
    each), not the whole instance's four replicas."""
    args = [*deploy_args(checkpoint, "--instance-type", "ml.g5.12xlarge"), "--inference-component", "llava-ic"]
    assert main([*args, "--copies", "2", "--accelerators-per-copy", "1", "--dry-run"], clients=None) == 0
    out = capsys.readouterr().out
    assert "ml.g5.12xlarge: inference component of 2 copy(ies) x 1 GPU(s) of 24 GiB -> 1 replica(s) per copy" in out
    assert "37 per copy, 74 over the 2 copy(ies); more copies (--max-copies) hold more" in out
    assert "4 replica(s) (devices=auto)" not in out and "per instance" not in out


def test_inference_component_mode_creates_the_component_and_scales_its_copies(capsys) -> None:
    """--inference-component: an endpoint config without a model in the variant (and the role), the
    endpoint, then one inference component with GPUs and memory per copy and a copy count, waited
    for, and target tracking on its copies; every call checked by Stubber against the service models."""
    c = clients()
    args = [
        "--endpoint-name", "llava-chat", "--model-data-uri", "s3://my-bucket/llava/v1", "--image-uri", IMAGE,
        "--role-arn", ROLE, "--model-name", "llava-chat-m1", "--endpoint-config-name", "llava-chat-c1",
        "--instance-type", "ml.g6e.12xlarge", "--inference-component", "llava-ic", "--copies", "2",
        "--accelerators-per-copy", "2", "--min-copies", "1", "--max-copies", "4", "--scaling-target", "20",
    ]  # fmt: skip
    with Stubber(c["sagemaker"]) as sm_stub, Stubber(c["application-autoscaling"]) as as_stub:
        sm_stub.add_response("create_model", {"ModelArn": "arn:aws:sagemaker:us-east-1:1:model/m"}, None)
        sm_stub.add_response(
            "create_endpoint_config",
            {"EndpointConfigArn": "arn:aws:sagemaker:us-east-1:1:c/c"},
            {
                "EndpointConfigName": "llava-chat-c1",
                "ExecutionRoleArn": ROLE,
                "ProductionVariants": [
                    {
                        "VariantName": "AllTraffic",
                        "InstanceType": "ml.g6e.12xlarge",
                        "InitialInstanceCount": 1,
                        "RoutingConfig": {"RoutingStrategy": "LEAST_OUTSTANDING_REQUESTS"},
                    }
                ],
            },
        )
        not_found(sm_stub, "describe_endpoint", {"EndpointName": "llava-chat"})
        sm_stub.add_response("create_endpoint", {"EndpointArn": "arn:aws:sagemaker:us-east-1:1:endpoint/e"}, None)
        sm_stub.add_response(
            "describe_endpoint",
            describe_endpoint_response("llava-chat", "InService", "llava-chat-c1"),
            {"EndpointName": "llava-chat"},
        )
        not_found(sm_stub, "describe_inference_component", {"InferenceComponentName": "llava-ic"})
        sm_stub.add_response(
            "create_inference_component",
            {"InferenceComponentArn": "arn:aws:sagemaker:us-east-1:1:inference-component/llava-ic"},
            {
                "InferenceComponentName": "llava-ic",
                "EndpointName": "llava-chat",
                "VariantName": "AllTraffic",
                "Specification": {
                    "ModelName": "llava-chat-m1",
                    "StartupParameters": {
                        "ModelDataDownloadTimeoutInSeconds": 1800,
                        "ContainerStartupHealthCheckTimeoutInSeconds": 1200,
                    },
                    "ComputeResourceRequirements": {
                        "NumberOfAcceleratorDevicesRequired": 2,
                        "MinMemoryRequiredInMb": 16384,
                    },
                },
                "RuntimeConfig": {"CopyCount": 2},
            },
        )
        described = {
            "InferenceComponentName": "llava-ic",
            "InferenceComponentArn": "arn:aws:sagemaker:us-east-1:1:inference-component/llava-ic",
            "EndpointName": "llava-chat",
            "EndpointArn": "arn:aws:sagemaker:us-east-1:1:endpoint/e",
            "CreationTime": NOW,
            "LastModifiedTime": NOW,
            "InferenceComponentStatus": "InService",
        }
        sm_stub.add_response("describe_inference_component", described, {"InferenceComponentName": "llava-ic"})
        as_stub.add_response("register_scalable_target", {}, {**COMPONENT_SCALABLE, "MinCapacity": 1, "MaxCapacity": 4})
        as_stub.add_response(
            "put_scaling_policy",
            {"PolicyARN": "arn:aws:autoscaling:us-east-1:1:scalingPolicy:p", "Alarms": []},
            {
                **COMPONENT_SCALABLE,
                "PolicyName": "llava-ic-invocations-per-copy",
                "PolicyType": "TargetTrackingScaling",
                "TargetTrackingScalingPolicyConfiguration": {
                    "TargetValue": 20.0,
                    "PredefinedMetricSpecification": {
                        "PredefinedMetricType": "SageMakerInferenceComponentInvocationsPerCopy"
                    },
                    "ScaleInCooldown": 300,
                    "ScaleOutCooldown": 300,
                },
            },
        )
        assert main(args, clients=c.__getitem__) == 0
        sm_stub.assert_no_pending_responses()
        as_stub.assert_no_pending_responses()
    out = capsys.readouterr().out
    assert "inference component llava-ic is InService: 2 copies of 2 GPU(s)" in out
    assert "autoscaling inference-component/llava-ic: 1..4 copies" in out
    # what cannot go together is refused before any call
    assert main([*args, "--min-instances", "1", "--max-instances", "2"], clients=c.__getitem__) == 1
    assert main([*args, "--accelerators-per-copy", "8"], clients=c.__getitem__) == 1  # 4 GPUs on the instance
    assert main([*args[:-6], "--scaling-metric", "gpu-memory", "--min-copies", "1", "--max-copies", "2"],
                clients=c.__getitem__) == 1  # fmt: skip
    assert main([*args, "--no-wait"], clients=c.__getitem__) == 1


def test_delete_removes_the_endpoint_s_inference_components_first() -> None:
    c = clients()
    with Stubber(c["sagemaker"]) as sm_stub, Stubber(c["application-autoscaling"]) as as_stub:
        sm_stub.add_response(
            "describe_endpoint",
            describe_endpoint_response("llava-chat", "InService", "llava-chat-c1"),
            {"EndpointName": "llava-chat"},
        )
        sm_stub.add_response(
            "list_inference_components",
            {
                "InferenceComponents": [
                    {
                        "InferenceComponentName": "llava-ic",
                        "InferenceComponentArn": "arn:aws:sagemaker:us-east-1:1:inference-component/llava-ic",
                        "EndpointName": "llava-chat",
                        "EndpointArn": "arn:aws:sagemaker:us-east-1:1:endpoint/e",
                        "VariantName": "AllTraffic",
                        "CreationTime": NOW,
                        "LastModifiedTime": NOW,
                    }
                ]
            },
            {"EndpointNameEquals": "llava-chat"},
        )
        stub_scalable_targets(as_stub, COMPONENT_SCALABLE, [])
        sm_stub.add_response("delete_inference_component", {}, {"InferenceComponentName": "llava-ic"})
        not_found(sm_stub, "describe_inference_component", {"InferenceComponentName": "llava-ic"})  # gone
        stub_scalable_targets(as_stub, SCALABLE, [])
        sm_stub.add_response(
            "describe_endpoint_config",
            {
                "EndpointConfigName": "llava-chat-c1",
                "EndpointConfigArn": "arn:aws:sagemaker:us-east-1:1:endpoint-config/c",
                "CreationTime": NOW,
                "ProductionVariants": [{"VariantName": "AllTraffic"}],
            },
            {"EndpointConfigName": "llava-chat-c1"},
        )
        sm_stub.add_response("delete_endpoint", {}, {"EndpointName": "llava-chat"})
        not_found(sm_stub, "describe_endpoint", {"EndpointName": "llava-chat"})
        sm_stub.add_response("delete_endpoint_config", {}, {"EndpointConfigName": "llava-chat-c1"})
        assert main(["--endpoint-name", "llava-chat", "--delete"], clients=c.__getitem__) == 0
        sm_stub.assert_no_pending_responses()
        as_stub.assert_no_pending_responses()


def test_python_dash_m_runs_the_cli_as_the_console_script_does() -> None:
    """``python -m llava_tools.deploy`` (the package's ``__main__``) is ``llava-deploy``: a dry-run
    delete prints its calls and exits 0; a missing required option exits 2."""
    dry = subprocess.run(
        [sys.executable, "-m", "llava_tools.deploy", "--endpoint-name", "ep-1", "--delete", "--dry-run"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert dry.returncode == 0, dry.stderr
    assert "would call sagemaker.delete_endpoint(" in dry.stdout and '"EndpointName": "ep-1"' in dry.stdout
    missing = subprocess.run(
        [sys.executable, "-m", "llava_tools.deploy", "--delete"], capture_output=True, text=True, timeout=120
    )
    assert missing.returncode == 2 and "--endpoint-name" in missing.stderr


def onevision_72b(tmp_path: Path) -> Path:
    """llava-hf/llava-onevision-qwen2-72b-ov-hf as the plan reads it: its config.json's shape fields and
    a sparse weight file of its size (72.7 B parameters in bf16)."""
    folder = tmp_path / "llava-onevision-qwen2-72b-ov-hf"
    folder.mkdir()
    config = {
        "architectures": ["LlavaOnevisionForConditionalGeneration"],
        "torch_dtype": "bfloat16",
        "text_config": {
            "hidden_size": 8192,
            "num_hidden_layers": 80,
            "num_attention_heads": 64,
            "num_key_value_heads": 8,
        },
        "vision_config": {"image_size": 384},
    }
    (folder / "config.json").write_text(json.dumps(config))
    with open(folder / "model.safetensors", "wb") as f:
        f.truncate(145_500_000_000)
    return folder


def test_a_72b_model_is_planned_over_tensor_parallel_ranks_and_refused_where_it_cannot_fit(
    tmp_path: Path, capsys, monkeypatch
) -> None:
    """Issue 62: llava-deploy plans ``tensor_parallel_size`` from the weights and the session budget
    (the smallest size whose replicas hold 8 sessions), writes it into the package's handler settings
    with the job groups of the instance's replicas, and refuses an instance type that holds no
    session, before anything is packaged or called."""
    import yaml

    from llava_tools.deploy import capacity_plan

    folder = onevision_72b(tmp_path)
    p4d = capacity_plan("ml.p4d.24xlarge", folder)  # 8 x A100 40 GB: 2 x 4 GPUs (2 GPUs cannot hold 73 GB)
    p5 = capacity_plan("ml.p5.48xlarge", folder)  # 8 x H100 80 GB: 4 x 2 GPUs
    assert p4d is not None and (p4d.tensor_parallel_size, p4d.replicas) == (4, 2) and p4d.sessions_per_replica >= 8
    assert p5 is not None and (p5.tensor_parallel_size, p5.replicas) == (2, 4) and p5.sessions_per_replica >= 8
    assert capacity_plan("ml.p5.48xlarge", folder, tensor_parallel_size=8).replicas == 1  # type: ignore[union-attr]
    with pytest.raises(DeployError, match=r"ml.g5.2xlarge cannot hold this model: 135.5 GiB of weights, 1 GPU"):
        capacity_plan("ml.g5.2xlarge", folder)
    with pytest.raises(DeployError, match="tensor_parallel_size 2 leaves no room for one session"):
        capacity_plan("ml.p4d.24xlarge", folder, tensor_parallel_size=2)

    import llava_tools.deploy.cli as cli

    packaged: list = []
    monkeypatch.setattr(cli, "build_package", lambda *a, **k: packaged.extend(build_package(*a, **k)) or packaged)
    args = [*deploy_args(folder), "--dry-run"]
    at = args.index("ml.g5.2xlarge")
    assert main([*args[:at], "ml.p5.48xlarge", *args[at + 1 :]], clients=None) == 0
    out = capsys.readouterr().out
    assert "ml.p5.48xlarge: 8 GPU(s) of 80 GiB -> 4 replica(s) of 2 GPU(s) (tensor_parallel_size=2)" in out
    written = yaml.safe_load(next(f for f in packaged if f.key.endswith("model-config.yaml")).read())
    assert written["handler"]["tensor_parallel_size"] == 2
    assert written["batchSize"] == 4 * 128 + 8  # the job groups of 4 replicas' sessions, and 8 spare
    packaged.clear()
    assert main(args, clients=None) == 1  # ml.g5.2xlarge
    err = capsys.readouterr().err
    assert "ml.g5.2xlarge cannot hold this model" in err and "1 GPU(s) of 24 GiB" in err
