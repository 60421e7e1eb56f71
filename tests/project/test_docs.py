"""The docs stay true: generated tables in sync with the code, and every Python and shell snippet in
``README.md`` and ``docs/`` run by a test as written (issue 32 item 8), against the local SageMaker
endpoint (boto3 pointed at it by ``AWS_ENDPOINT_URL_SAGEMAKER_RUNTIME``, as a reader's environment
would point it at AWS), with only the reader's own placeholders filled in (``EP``, ``/path/to/...``,
``data:image/jpeg;base64,...``, ``<URI>``, the port of the endpoint this test started)."""

from __future__ import annotations

import ast
import base64
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from llava_sessions.config import Settings

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

#: Every runnable snippet (its file and first line) and the test that runs it, as ``file::function``.
#: A new snippet must be added here with its test: ``test_every_snippet_is_run_by_a_test`` fails
#: otherwise, and when a named test does not exist (or, in this file, does not read that snippet).
SNIPPETS: dict[tuple[str, str], str] = {
    (
        "README.md",
        "make demo    # install, build a tiny random-weight LLaVA, start llava-serve, run a scripted session",
    ): "tests/tools/test_demo.py::test_demo_runs_a_scripted_session",  # `make test` is the suite itself (CI runs it)
    (
        "README.md",
        "make demo MODEL_DIR=/path/to/llava-1.5-7b-hf      # or llava-v1.6-mistral-7b-hf, llava-onevision-qwen2-7b-ov-hf",
    ): "tests/tools/test_demo.py::test_demo_runs_on_the_checkpoint_model_dir_names",
    ("README.md", "from llava_client import SessionClient"): (
        "tests/project/test_docs.py::test_python_snippets_run_against_the_local_endpoint"
    ),
    ("serving.md", "import boto3"): "tests/project/test_docs.py::test_python_snippets_run_against_the_local_endpoint",
    (
        "README.md",
        "./build_and_push.sh --repository llava-sessions --region us-east-1        # prints the image URI",
    ): "tests/project/test_docs.py::test_the_readme_s_gpu_path_runs_as_written",
    (
        "deploy.md",
        "./build_and_push.sh --repository llava-sessions --region us-east-1          # prints the image URI",
    ): "tests/project/test_docs.py::test_the_deploy_snippet_runs_with_dry_run",
    ("deploy.md", "llava-compile-cache --model-dir /path/to/llava-1.5-7b-hf"): (
        "tests/tools/test_compile_cache.py::test_the_cache_written_once_makes_a_fresh_start_find_every_graph_compiled"
    ),
    ("api.md", "import boto3, json"): "tests/project/test_docs.py::test_python_snippets_run_against_the_local_endpoint",
    ("api.md", 'chat = client.conversation(cache_salt="tenant-42")   # no session; or session=client.chat_session()'): (
        "tests/project/test_docs.py::test_python_snippets_run_against_the_local_endpoint"
    ),
}


def snippets() -> list[tuple[str, str, str]]:
    """``(file name, language, body)`` of every fenced ``python`` / ``bash`` block of the docs
    (indented ones in lists too, dedented)."""
    found = []
    for path in DOCS:
        for indent, lang, body in re.findall(r"^( *)```(python|bash|sh)\n(.*?)^\1```", path.read_text(), re.M | re.S):
            lines = [line[len(indent) :] for line in body.splitlines()]
            found.append((path.name, lang, "\n".join(lines) + "\n"))
    return found


def snippet(name: str, first_line: str) -> str:
    (body,) = [b for n, _, b in snippets() if n == name and b.splitlines()[0] == first_line]
    return body


def test_every_snippet_is_run_by_a_test():
    listed = {(n, b.splitlines()[0]) for n, _, b in snippets()}
    assert sorted(listed - set(SNIPPETS)) == [], "a new snippet: run it in a test and list it in SNIPPETS"
    assert sorted(set(SNIPPETS) - listed) == [], "a snippet listed here is gone from the docs"
    for (name, first_line), node in SNIPPETS.items():
        path, function = node.split("::")
        tree = ast.parse((ROOT / path).read_text())
        tests = {f.name: f for f in tree.body if isinstance(f, ast.FunctionDef) and f.name.startswith("test_")}
        assert function in tests, f"{node} (named for {name}'s {first_line!r}) is not a test"
        if path == "tests/project/test_docs.py":  # this file's tests pick their snippet by its first line
            read = {
                (a.args[0].value, a.args[1].value)
                for a in ast.walk(tests[function])
                if isinstance(a, ast.Call) and getattr(a.func, "id", "") == "snippet" and len(a.args) == 2
                if all(isinstance(x, ast.Constant) for x in a.args)
            }
            assert (name, first_line) in read, f"{node} does not read {name}'s {first_line!r}"


def test_configuration_table_matches_settings():
    text = (ROOT / "docs" / "configuration.md").read_text()
    assert Settings.env_table().strip() in text


@pytest.fixture(scope="module")
def endpoint(request, tmp_path_factory):
    """The local SageMaker endpoint on the model ``make demo`` builds (several images need its 4,096
    positions), boto3 pointed at it as a reader's environment points it at AWS."""
    from llava_tools.local_endpoint import LocalEndpoint
    from llava_tools.tiny_model import write_checkpoint

    model_dir = write_checkpoint("tiny", tmp_path_factory.mktemp("tiny"), seed=0)
    ep = LocalEndpoint(model_dir, backends=1, startup_timeout_s=120)
    request.addfinalizer(ep.stop)
    return ep.start()


@pytest.mark.integration
def test_python_snippets_run_against_the_local_endpoint(endpoint, photos, tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL_SAGEMAKER_RUNTIME", endpoint.url)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "x")
    (tmp_path / "photo.jpg").write_bytes(photos["chelsea"])
    (tmp_path / "second.jpg").write_bytes(photos["rocket"])
    monkeypatch.chdir(tmp_path)
    data_uri = "data:image/png;base64," + base64.b64encode(photos["coffee"]).decode()

    readme = snippet("README.md", "from llava_client import SessionClient")
    assert 'SessionClient.from_endpoint("my-llava-endpoint")' in readme  # as written: boto3 finds the endpoint
    exec(compile(readme, "README.md", "exec"), {})  # noqa: S102 - the docs' own code

    local = snippet("serving.md", "import boto3").replace("http://127.0.0.1:8090", endpoint.url)
    scope: dict = {}
    exec(compile(local, "serving.md", "exec"), scope)  # noqa: S102
    opened = scope["runtime"].invoke_endpoint(
        EndpointName="any",
        SessionId="NEW_SESSION",
        ContentType="application/json",
        Body=b'{"requestType": "NEW_SESSION"}',
    )
    assert opened["NewSessionId"]

    boto = snippet("api.md", "import boto3, json")
    assert "data:image/jpeg;base64,..." in boto
    exec(compile(boto.replace("data:image/jpeg;base64,...", data_uri), "api.md", "exec"), {"EP": "my-llava-endpoint"})  # noqa: S102

    from llava_client import SessionClient

    with SessionClient.from_endpoint("my-llava-endpoint") as client:
        conversation = snippet(
            "api.md",
            'chat = client.conversation(cache_salt="tenant-42")   # no session; or session=client.chat_session()',
        )
        scope = {"client": client}
        exec(compile(conversation, "api.md", "exec"), scope)  # noqa: S102
        assert len(scope["chat"].messages) == 4  # two questions, two answers


@pytest.mark.integration
def run_deploy_commands(body: str, model_dir: Path, placeholder: str) -> list[str]:
    """Run ``body``'s ``build_and_push.sh`` and ``llava-deploy`` lines as written, each with
    ``--dry-run`` (no Docker, no AWS here): the image URI the first prints fills the second's
    ``<URI>``, ``placeholder`` (the docs' checkpoint folder) becomes ``model_dir``. Returns the
    body's other commands, not run."""
    commands = [c.strip() for c in re.sub(r"\\\n\s*", " ", body).splitlines() if c.strip() and not c.startswith("#")]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    uri, rest = "", []
    for command in commands:
        command = command.split("  #")[0].replace(placeholder, str(model_dir)).replace("<URI>", uri)
        if not command.startswith(("./build_and_push.sh", "llava-deploy")):
            rest.append(command)
            continue
        done = subprocess.run(
            f"{command} --dry-run", shell=True, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, (command, done.stdout[-2000:], done.stderr[-2000:])
        if command.startswith("./build_and_push.sh"):
            uri = done.stdout.strip().splitlines()[-1].split()[-1]
            assert ".dkr.ecr.us-east-1.amazonaws.com/llava-sessions:" in uri, done.stdout[-500:]
    assert uri, "no build_and_push.sh line ran"
    return rest


def test_the_deploy_snippet_runs_with_dry_run(tmp_path):
    """The deploy commands as written, each with ``--dry-run``; the checkpoint placeholder is a tiny one."""
    from llava_tools.tiny_model import write_checkpoint

    model_dir = write_checkpoint("tiny", tmp_path / "tiny", seed=0)
    body = snippet(
        "deploy.md",
        "./build_and_push.sh --repository llava-sessions --region us-east-1          # prints the image URI",
    )
    assert run_deploy_commands(body, model_dir, "/path/to/llava-1.5-7b-hf") == []


@pytest.mark.integration
def test_the_readme_s_gpu_path_runs_as_written(endpoint, photos, tmp_path):
    """README's "Deploy on a GPU": its prerequisites named, then its three commands as a user runs
    them: the build and the deploy with ``--dry-run``, and ``llava-chat`` on the endpoint name, here
    the local endpoint (boto3 pointed at it as at AWS), answering a piped question on the photo."""
    from llava_tools.tiny_model import write_checkpoint

    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Deploy on a GPU") :]
    section = section[: section.index("\n## ", 3)]
    for needed in ("**Docker**", "**AWS CLI**", "**S3 bucket**", "**IAM role**", "iam:PassRole", "s3:PutObject"):
        assert needed in section, needed
    body = snippet(
        "README.md", "./build_and_push.sh --repository llava-sessions --region us-east-1        # prints the image URI"
    )
    assert body in section
    model_dir = write_checkpoint("tiny", tmp_path / "tiny", seed=0)
    (chat,) = run_deploy_commands(body, model_dir, "models/llava-1.5-7b-hf")
    assert chat == "llava-chat --endpoint llava-sessions --region us-east-1 --image photo.jpg"
    (tmp_path / "photo.jpg").write_bytes(photos["chelsea"])
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "AWS_ENDPOINT_URL_SAGEMAKER_RUNTIME": endpoint.url,
        "AWS_ACCESS_KEY_ID": "x",
        "AWS_SECRET_ACCESS_KEY": "x",
    }
    done = subprocess.run(
        chat + " --max-new-tokens 8",
        shell=True,
        cwd=tmp_path,
        env=env,
        input="What is in this image?\n",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-2000:])
    assert "Traceback" not in done.stderr and done.stdout.strip(), (done.stdout[-2000:], done.stderr[-2000:])


#: A measured speed (a rate, a time per token, a speed-up): quoted only by the results pages.
SPEED = re.compile(
    r"\d[\d,.]*\s*(tokens/s|ms a token|ms per token)|\b\d+(\.\d+)?x (faster|slower|the tokens/s|one session)"
)


def test_speed_figures_come_from_one_results_page():
    """README and docs/ (the decision records keep the measurement that decided them) quote no speed:
    they link the headline figures, which the results README lists."""
    quoted = [f"{p.name}: {m.group(0)}" for p in DOCS for m in SPEED.finditer(p.read_text())]
    assert quoted == [], quoted
    headline = ROOT / "benchmarks" / "results" / "headline-figures.md"
    assert SPEED.search(headline.read_text())
    assert "headline-figures.md" in (ROOT / "benchmarks" / "results" / "README.md").read_text()
    assert "benchmarks/results/headline-figures.md" in (ROOT / "README.md").read_text()
