"""The ``llava-serve`` CLI against a real TorchServe, with a model-free echo handler.

Pins the TorchServe 0.12 behaviour our session handler relies on: minted ``ts-seq-<uuid>`` ids,
exact-case sequence headers (Java config keys == Python ``TS_REQUEST_SEQUENCE_*`` env), the
Closed-Session-Id response header ending the job group, and a clean stop on SIGTERM.
"""

from __future__ import annotations

import base64
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests
import torch

from llava_tools.processes import pick_ports
from llava_tools.serve.torchserve_files import JVM_ARGS
from server_fixtures import OutputLines, stop_process, wait_until_answering, write_echo_handler

psutil = pytest.importorskip("psutil")


SESSION = "X-Amzn-SageMaker-Session-Id"
NEW_SESSION = "X-Amzn-SageMaker-New-Session-Id"
CLOSED_SESSION = "X-Amzn-SageMaker-Closed-Session-Id"
SEQUENCE_END = "X-Llava-Sequence-End"  # TorchServe's sequence-end key: our own, not SageMaker's closed header
READY = re.compile(r"llava-serve: ready at (http://\S+) .*logs (\S+);")
MINTED_ID = re.compile(r"^ts-seq-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


def _llava_serve() -> list[str]:
    """Return the installed ``llava-serve`` console script (as a user runs it)."""
    script = Path(sys.executable).parent / "llava-serve"
    found = str(script) if script.exists() else shutil.which("llava-serve")
    return [found] if found else [sys.executable, "-m", "llava_tools.serve"]


def _invoke(url: str, body: dict, headers: dict | None = None, timeout_s: float = 10) -> requests.Response:
    return requests.post(f"{url}/invocations", json=body, headers=headers or {}, timeout=timeout_s)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_cli_sessions_round_trip_and_clean_sigterm(tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    handler = write_echo_handler(tmp_path)
    command = [
        *_llava_serve(),
        "--model-dir", str(model_dir),
        "--port", "0",
        "--handler", str(handler),
        # One open sequence at most, so a refused second session shows the first one's job
        # group is alive, and an accepted one after the close shows the group was dropped.
        "--ts-set", "batchSize=1",
        "--ts-set", "maxNumSequence=1",
        # TorchServe's refusal is held at the proxy this long before it goes out, shaped
        "--set", "queue_timeout_s=1",
        "--startup-timeout", "60",
    ]  # fmt: skip
    cli = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(os.environ))
    try:
        output = OutputLines(cli.stdout)
        ready = output.wait_for(READY, timeout_s=75)
        url, log_dir = ready.group(1), Path(ready.group(2))
        temp_dir = log_dir.parent
        assert temp_dir.is_dir() and temp_dir.name.startswith("llava-serve-")
        torchserve_pids = [p.pid for p in psutil.Process(cli.pid).children(recursive=True)]
        java = [psutil.Process(pid) for pid in torchserve_pids if psutil.Process(pid).name().startswith("java")]
        assert java, torchserve_pids
        assert set(JVM_ARGS.split()) <= set(java[0].cmdline())  # config.properties' vmargs reached the JVM

        # No session header: the frontend mints the id and flags the start; the worker sees both
        # under our header names because its TS_REQUEST_SEQUENCE_* env matches the Java keys.
        opened = _invoke(url, {"turn": 1})
        assert opened.status_code == 200, opened.text
        first = opened.json()
        session_id = first["session_id"]
        assert MINTED_ID.match(session_id), session_id
        assert first["start"] == "true"
        assert first["env"] == {
            "TS_REQUEST_SEQUENCE_ID": SESSION,
            "TS_REQUEST_SEQUENCE_START": NEW_SESSION,
            "TS_REQUEST_SEQUENCE_END": SEQUENCE_END,
        }
        assert SESSION in first["headers"] and NEW_SESSION in first["headers"]

        # Exact-case header: same sequence, same worker, no start flag.
        again = _invoke(url, {"turn": 2}, {SESSION: session_id})
        assert again.status_code == 200, again.text
        assert again.json()["session_id"] == session_id
        assert again.json()["start"] is None
        assert again.json()["pid"] == first["pid"]

        # Through the proxy header names are case-blind: it forwards the session header in the case
        # TorchServe looks it up by. TorchServe's own lookup is case-sensitive: on its own port a
        # lower-case key is no session header, so that is a NEW sequence, refused because the one
        # allowed sequence is open.
        lower = _invoke(url, {"turn": 3}, {SESSION.lower(): session_id})
        assert lower.status_code == 200 and lower.json()["session_id"] == session_id, lower.text
        torchserve = re.search(r"TorchServe itself at (\S+?)\)", ready.group(0))
        assert torchserve, ready.group(0)
        direct = _invoke(torchserve.group(1), {"turn": 3}, {SESSION.lower(): session_id})
        assert direct.status_code == 503 or direct.json()["session_id"] != session_id
        refused = _invoke(url, {"turn": 1})
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "overloaded" and refused.headers["Retry-After"] == "1"

        # The handler sets the sequence-end header: it reaches the client with its exact name, and
        # TorchServe drops the job group at once, so a new session is accepted right after.
        closed = _invoke(url, {"close": True}, {SESSION: session_id})
        assert closed.status_code == 200, closed.text
        assert closed.headers.get(SEQUENCE_END) == session_id
        assert SEQUENCE_END in list(closed.headers.keys())
        reopened = _invoke(url, {"turn": 1})
        assert reopened.status_code == 200, reopened.text
        assert MINTED_ID.match(reopened.json()["session_id"])
        assert reopened.json()["session_id"] != session_id

        cli.send_signal(signal.SIGTERM)
        assert cli.wait(timeout=40) == 0, "".join(output.lines)
    finally:
        stop_process(cli)  # after a failed assertion: llava-serve stops its TorchServe

    deadline = time.monotonic() + 5
    while any(_alive(pid) for pid in torchserve_pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in torchserve_pids if _alive(pid)], "TorchServe processes left behind"
    assert first["pid"] in torchserve_pids
    assert not temp_dir.exists()


# ---- static checks of the shipped configs (no TorchServe) -------------------------------------

REPO = Path(__file__).resolve().parents[2]


def _properties(path: Path) -> dict[str, str]:
    return _properties_text(path.read_text())


def _properties_text(text: str) -> dict[str, str]:
    pairs = (line.split("=", 1) for line in text.splitlines() if "=" in line)
    return {key.strip(): value.strip() for key, value in pairs if not key.lstrip().startswith("#")}


_PORTS = {
    name: 9000 + i for i, name in enumerate(("inference", "management", "metrics", "grpc_inference", "grpc_management"))
}


def test_torchserve_s_worker_died_reply_is_known_by_its_body_whatever_its_status() -> None:
    """TorchServe 0.12's worker threads answer a request whose worker died with ``"Worker died."`` as
    500, 413 (after a SIGKILL) or 507; the proxy treats each as a request cut by the death (sent
    again, or a typed 503), and a 500 of anything else as the reply it is."""
    from llava_tools.serve.http_wire import worker_died

    died = b'{"code": 500, "type": "InternalServerException", "message": "Worker died."}'
    assert all(worker_died(status, died) for status in (b"500", b"413", b"507"))
    assert not worker_died(b"500", b'{"error": {"code": "internal_error", "message": "internal error"}}')
    assert not worker_died(b"200", died)


def test_container_config_names_the_sagemaker_session_headers() -> None:
    from llava_sessions.wire.contract import NEW_SESSION_ID_HEADER, SEQUENCE_END_HEADER, SESSION_ID_HEADER

    props = _properties(REPO / "config" / "config.properties")
    assert props["ts_header_key_sequence_id"] == SESSION_ID_HEADER == SESSION
    assert props["ts_header_key_sequence_start"] == NEW_SESSION_ID_HEADER == NEW_SESSION
    assert props["ts_header_key_sequence_end"] == SEQUENCE_END_HEADER == SEQUENCE_END
    assert props["inference_address"] == "http://0.0.0.0:8080"
    assert props["disable_token_authorization"] == "true"
    assert int(props["max_request_size"]) == 64 << 20 and int(props["max_response_size"]) > 6_291_456


def test_the_log_config_is_the_quiet_one_unless_named(tmp_path: Path, monkeypatch) -> None:
    """TorchServe's log4j2 configuration: ``LLAVA_TS_LOG_CONFIG``, else ``config/log4j2.xml`` of the
    home (the repository, or the image's $LLAVA_HOME), else TorchServe's own."""
    import xml.etree.ElementTree as ET

    from llava_tools.serve.torchserve_files import default_log_config_path

    monkeypatch.delenv("LLAVA_TS_LOG_CONFIG", raising=False)
    assert default_log_config_path() == REPO / "config" / "log4j2.xml"
    assert default_log_config_path(tmp_path) is None
    monkeypatch.setenv("LLAVA_TS_LOG_CONFIG", str(tmp_path / "mine.xml"))
    assert default_log_config_path() == default_log_config_path(REPO) == tmp_path / "mine.xml"
    loggers = {e.get("name"): e.get("level") for e in ET.parse(REPO / "config" / "log4j2.xml").getroot().iter("Logger")}
    assert loggers["org.pytorch.serve"] == "warn" and loggers["MODEL_LOG"] == "info"


def test_model_config_keeps_torchserve_limits_above_the_handlers() -> None:
    import yaml

    config = yaml.safe_load((REPO / "model-config.yaml").read_text())
    handler = config["handler"]
    assert config["sequenceBatching"] is True and config["continuousBatching"] is True
    assert config["batchSize"] >= handler["max_sessions"] + 8  # one replica's sessions and the spare groups
    assert config["maxNumSequence"] >= (handler["max_sessions"] + 8) * config["maxWorkers"]
    assert 0 < config["sequenceMaxIdleMSec"] <= 60_000  # short: frees parked poll threads (model-config.yaml)
    assert config["minWorkers"] == config["maxWorkers"] == 1


def test_local_model_config_applies_workers_and_overrides(tmp_path: Path) -> None:
    import yaml

    from llava_tools.cli import parse_assignment as _parse_assignment
    from llava_tools.serve import LocalServer

    server = LocalServer(
        tmp_path,
        workers=2,
        overrides=dict([_parse_assignment("max_sessions=8"), _parse_assignment("dtype=float32")]),
        model_config_overrides={"batchSize": 8},
    )
    written = yaml.safe_load(server._write_model_config(tmp_path / "m.yaml").read_text())
    assert written["minWorkers"] == written["maxWorkers"] == 2
    assert written["batchSize"] == 8
    assert written["handler"]["model_dir"] == str(tmp_path.resolve())
    assert written["handler"]["max_sessions"] == 8 and written["handler"]["dtype"] == "float32"
    assert written["handler"]["session_ttl_s"] == 1200  # untouched keys keep the shipped values


def test_job_groups_follow_the_replicas_sessions(tmp_path: Path, monkeypatch) -> None:
    """``max_sessions`` is per replica: the written model-config.yaml gives TorchServe job groups for
    every replica's sessions plus 8 spare (4 GPUs x 64 + 8 = 264, as on an ml.g6e.12xlarge), never
    fewer than the file's own, and keeps a ``batchSize`` the caller set."""
    import yaml

    import llava_tools.serve as serve
    import llava_tools.serve.torchserve_files as ts_files
    from llava_sessions.config import job_groups

    def written(**kw) -> dict:
        return yaml.safe_load(serve.LocalServer(tmp_path, **kw)._write_model_config(tmp_path / "m.yaml").read_text())

    assert job_groups(64, 4) == 264
    one = written()  # this machine: no GPU, one replica, the shipped 136
    assert (one["batchSize"], one["maxNumSequence"]) == (136, 136)
    two = written(overrides={"devices": "cpu,cpu", "max_sessions": 80})
    assert (two["batchSize"], two["maxNumSequence"]) == (168, 168)
    kept = written(overrides={"devices": "cpu,cpu", "max_sessions": 80}, model_config_overrides={"batchSize": 24})
    assert (kept["batchSize"], kept["maxNumSequence"]) == (24, 168)
    assert ts_files.visible_gpus() == 0  # no NVIDIA driver here; a GPU count cannot run here for real:
    monkeypatch.setattr(ts_files, "visible_gpus", lambda env=None: 4)  # what torch would count on 4 GPUs
    four = written()
    assert (four["batchSize"], four["maxNumSequence"]) == (520, 520)
    assert written(overrides={"device": "cpu"})["batchSize"] == 136  # device cpu: one replica whatever the GPUs
    assert written(env={"LLAVA_MAX_SESSIONS": "100"})["batchSize"] == 408  # the worker reads the env too


def test_a_cpu_worker_gets_the_longer_batch_delay_and_the_frontend_its_jvm_options(tmp_path: Path, monkeypatch) -> None:
    """TorchServe's dispatcher wakes every ``maxBatchDelay`` ms: a worker whose replicas all run on the
    CPU gets ``CPU_MAX_BATCH_DELAY_MS``, a GPU worker the file's 1 ms, a caller's value stays; the
    written config.properties gives the JVM its options, as the container's file does."""
    import yaml

    import llava_tools.serve as serve
    import llava_tools.serve.torchserve_files as ts_files

    def delay(**kw) -> int:
        path = serve.LocalServer(tmp_path, **kw)._write_model_config(tmp_path / "m.yaml")
        return yaml.safe_load(path.read_text())["maxBatchDelay"]

    shipped = yaml.safe_load((REPO / "model-config.yaml").read_text())["maxBatchDelay"]
    assert shipped == 1 < ts_files.CPU_MAX_BATCH_DELAY_MS
    assert delay() == ts_files.CPU_MAX_BATCH_DELAY_MS  # this machine: no GPU, device auto
    assert delay(overrides={"devices": "cpu,cpu"}) == ts_files.CPU_MAX_BATCH_DELAY_MS
    assert delay(model_config_overrides={"maxBatchDelay": 1}) == 1
    monkeypatch.setattr(ts_files, "visible_gpus", lambda env=None: 1)  # what torch would count on one GPU
    assert delay() == 1
    assert delay(overrides={"device": "cpu"}) == ts_files.CPU_MAX_BATCH_DELAY_MS
    assert delay(overrides={"devices": "cuda:0,cpu"}) == 1
    written = _properties_text(ts_files.config_properties("127.0.0.1", _PORTS, tmp_path, 1))
    assert written["vmargs"] == ts_files.JVM_ARGS == _properties(REPO / "config" / "config.properties")["vmargs"]


def test_cli_refuses_more_than_one_worker(tmp_path: Path) -> None:
    result = subprocess.run(
        [*_llava_serve(), "--model-dir", str(tmp_path), "--workers", "2"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2
    assert "more than one TorchServe worker" in result.stderr and "llava-local-endpoint" in result.stderr


@pytest.mark.parametrize(
    ("extra", "env", "says"),
    [
        (["--set", "session_tl_s=600"], {}, "unknown key(s) in --set: session_tl_s (did you mean session_ttl_s?)"),
        ([], {"LLAVA_SESION_TTL_S": "600"}, "LLAVA_SESION_TTL_S (did you mean LLAVA_SESSION_TTL_S?)"),
        ([], {"LLAVA_MAX_SESSIONS": "abc"}, "LLAVA_MAX_SESSIONS"),
        (["--set", "kv_pool=on"], {}, "the kv_pool setting is gone (every session's KV is in the KV pool on"),
        ([], {"LLAVA_DECODE_LAYOUT": "paged"}, "the decode_layout setting is gone"),
    ],
)
def test_cli_refuses_a_mistyped_setting_at_once_naming_the_closest_key(
    tmp_path: Path, tiny_model_dir: Path, extra: list[str], env: dict[str, str], says: str
) -> None:
    """A typo in ``--set`` or an ``LLAVA_*`` variable (or a value that does not parse) is refused before
    TorchServe starts (it used to wait out the start-up timeout, or pass silently)."""
    result = subprocess.run(
        [*_llava_serve(), "--model-dir", str(tiny_model_dir), "--port", "0", *extra],
        capture_output=True,
        text=True,
        timeout=60,  # against a hang (a start-up timeout waited out would also not name the setting)
        env={**os.environ, "TMPDIR": str(tmp_path), **env},
    )
    assert result.returncode == 1
    assert says in result.stdout + result.stderr


@pytest.mark.integration
@pytest.mark.timeout(120)
@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cli_exits_within_seconds_with_the_worker_s_own_error(tmp_path: Path, tiny_model_dir: Path) -> None:
    """A worker whose handler raises while loading (not a RuntimeError, which TorchServe reports as
    "Failed to load model") dies and TorchServe restarts it forever: llava-serve stops with its error."""
    result = subprocess.run(  # restarting the worker forever would run into the timeout
        [*_llava_serve(), "--model-dir", str(tiny_model_dir), "--port", "0", "--set", "device=cuda"],
        capture_output=True,
        text=True,
        timeout=100,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    out = result.stdout + result.stderr
    assert result.returncode == 1, out[-2000:]
    assert "the handler failed to load the model: ValueError: device=cuda but CUDA is not available" in out
    # the logs of a failed start are kept, and where is said
    kept = re.search(r"logs kept in (\S+)", out)
    assert kept and (Path(kept.group(1)) / "model_log.log").is_file(), out[-2000:]
    shutil.rmtree(kept.group(1), ignore_errors=True)


def _worker_pids(cli_pid: int) -> list[int]:
    """The live TorchServe workers under ``cli_pid`` (a killed one can linger as a zombie of the old
    frontend while it shuts down: killing that again would kill nothing)."""
    pids = []
    for p in psutil.Process(cli_pid).children(recursive=True):
        try:
            if any("model_service_worker" in part for part in p.cmdline()) and _alive(p.pid):
                pids.append(p.pid)
        except psutil.Error:
            continue
    return pids


def _poll_ping_until_healthy(url: str, cli: subprocess.Popen, output, timeout_s: float) -> list[dict]:
    """Poll ``/ping`` (and send an invocation while it is not 200) every 0.1 s from the CLI's start
    until ``/ping`` says 200; returns what each poll before that saw."""
    seen = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert cli.poll() is None, "".join(output.lines)
        try:
            ping = requests.get(url + "/ping", timeout=2).status_code
        except (requests.ConnectionError, requests.Timeout):  # not listening yet, or a core busy elsewhere
            ping = None
        if ping == 200:
            return seen
        invoke = None
        if ping is not None:
            r = _invoke(url, {"type": "generate", "prompt": "hi"}, {SESSION: "early-1"}, timeout_s=5)
            if r.status_code != 503:  # it began to serve between the two (the id is unknown: 404)
                assert r.json()["error"]["code"] == "session_not_found", r.text
                continue  # the next /ping says 200
            invoke = (r.status_code, r.json()["error"]["code"], "Retry-After" in r.headers)
        seen.append({"ping": ping, "invoke": invoke})
        time.sleep(0.1)
    raise AssertionError(f"/ping not 200 within {timeout_s} s")


def _kill_worker(cli_pid: int) -> None:
    """SIGKILL the one TorchServe worker under ``cli_pid`` (as an out-of-memory kill would)."""
    workers = _worker_pids(cli_pid)
    assert len(workers) == 1
    os.kill(workers[0], signal.SIGKILL)


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_a_killed_worker_costs_no_error(tmp_path: Path, tiny_model_dir: Path, photos) -> None:
    """Issue 45 item 1: SIGKILL the worker of a running ``llava-serve``, twice. The CLI keeps serving
    and says when it is ready again; a stream cut mid-answer goes on, a request in flight gets a typed
    retryable 503, and requests sent at once after the kill through llava_client (a session, a
    stateless conversation, a chat session), the openai package and raw HTTP are all answered."""
    import openai

    from llava_client import SessionClient

    port = pick_ports("127.0.0.1", 0)["inference"]
    command = [*_llava_serve(), "--model-dir", str(tiny_model_dir), "--port", str(port), "--startup-timeout", "120"]
    cli = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(os.environ))
    try:
        output = OutputLines(cli.stdout)
        url = f"http://127.0.0.1:{port}"
        # SageMaker's health check from the first second: no 200 until a request would be served; a
        # request meanwhile gets a typed 503 with Retry-After; the first request after the first 200
        # is answered (before, /ping said Healthy seconds before the model was loaded)
        refusals = _poll_ping_until_healthy(url, cli, output, timeout_s=150)
        assert refusals, "the proxy answered nothing before the model served"
        assert {r["ping"] for r in refusals} <= {503, None} and any(r["ping"] == 503 for r in refusals)
        assert all(r["invoke"] in (None, (503, "model_not_ready", True)) for r in refusals), refusals
        sent = time.monotonic()
        first = _invoke(url, {"type": "open_session", "image": {"base64": base64.b64encode(photos["rocket"]).decode()}})
        assert first.status_code == 200, first.text
        print(f"first open after the first /ping 200: {time.monotonic() - sent:.2f} s")
        assert url == output.wait_for(READY, timeout_s=30).group(1)
        client = SessionClient.from_url(url)  # the default rides out the restart (Retry-After)
        session = client.open_session(photos["coffee"])
        session.ask("What is in this image?", max_new_tokens=6, temperature=0)
        before = session.ask("And the colours?", remember=False, max_new_tokens=6, temperature=0).text
        question = "Describe the picture in detail."
        long_answer = session.ask(question, remember=False, max_new_tokens=400, temperature=0, details=True)
        assert len(long_answer.tokens) == 400  # long enough to be mid-answer at the kill
        oai = openai.OpenAI(base_url=url + "/v1", api_key="unused")  # its default retries
        chat = [{"role": "user", "content": "Say something."}]
        oai_before = oai.chat.completions.create(model=tiny_model_dir.name, messages=chat, max_tokens=5, temperature=0)

        # kill 1, while a stream is mid-answer and a session's question is in flight: the stream goes on
        # where it stopped (sent again in the session restored from its history), the question in flight
        # gets one typed, retryable 503 with Retry-After (never TorchServe's 507 or a bare 502)
        # (the long stream starts last and the kill follows its second chunk at once: the tiny model
        # decodes 400 tokens in a few seconds, so anything slow between them, as on a loaded machine,
        # could let the stream end before the kill)
        old_id = session.id
        other = client.open_session(photos["rocket"])
        raw_session = other.id
        # a stateless conversation's stream, sampled (OpenAI's default temperature, no seed given)
        conversation = client.conversation()
        pieces = conversation.ask_stream("What is it?", images=[photos["chelsea"]], max_tokens=150)
        given_chat = next(pieces)
        in_flight: dict = {}
        raw = {"type": "generate", "prompt": "Tell a long story.", "parameters": {"max_new_tokens": 400}}
        sender = threading.Thread(target=lambda: in_flight.update(r=_invoke(url, raw, {SESSION: raw_session}, 60)))
        sender.start()
        wait_until_answering(url, raw_session)  # the question is sent and being answered
        stream = session.stream(question, remember=False, max_new_tokens=400, temperature=0)
        given = next(stream) + next(stream)
        _kill_worker(cli.pid)
        rest = "".join(stream)
        chat_text = given_chat + "".join(pieces)
        assert conversation.messages[-1] == {"role": "assistant", "content": chat_text}
        sender.join(90)
        assert given + rest == long_answer.text and stream.resumes == 1 and stream.answer is not None
        assert session.recoveries == 1 and session.id != old_id
        cut = in_flight["r"]
        assert cut.status_code == 503 and cut.json()["error"]["code"] == "model_not_ready", cut.text
        assert 1 <= int(cut.headers["Retry-After"]) <= 30
        output.wait_for(re.compile(r"llava-serve: ready again at " + re.escape(url)), timeout_s=60)

        # kill 2, then at once three requests each through llava_client and the openai package, and
        # raw HTTP on /v1: each is held while the worker restarts (or sent again if it was cut), and
        # answered; none raises, none sees a 502 or a 507
        _kill_worker(cli.pid)
        again = session.ask("And the colours?", remember=False, max_new_tokens=6, temperature=0)
        assert session.recoveries == 2 and again.text == before
        assert conversation.ask("And then?", max_tokens=4, temperature=0).text  # its images were sent again
        with client.chat_session() as chat_session:
            assert chat_session.complete(chat, max_tokens=4, temperature=0).text
        for _ in range(3):
            reply = oai.chat.completions.create(model=tiny_model_dir.name, messages=chat, max_tokens=5, temperature=0)
            assert reply.choices[0].message.content == oai_before.choices[0].message.content
        direct = requests.post(url + "/v1/chat/completions", json={"messages": chat, "max_tokens": 2}, timeout=60)
        assert direct.status_code == 200, direct.text
        output.wait_for(re.compile(r"llava-serve: ready again at "), timeout_s=60)
        assert "backend_unavailable" not in "".join(output.lines)
        other.close()
        session.close()
        client.close()
        assert cli.poll() is None  # still serving after two kills
    finally:
        stop_process(cli)
    assert cli.returncode == 0


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_an_api_key_guards_every_route_but_ping_and_ready_at_names_the_bind_address(
    tmp_path: Path, tiny_model_dir: Path, photos
) -> None:
    """Issue 45 item 2, as vLLM's ``--api-key``: ``llava-serve --host 0.0.0.0 --api-key K`` says it is
    ready at its real bind address; ``/ping`` needs no key; ``/invocations`` and ``/v1`` without the
    key, or with another, get a typed 401 in their dialect; with it (``llava_client`` reads
    ``LLAVA_API_KEY``, the openai package its ``api_key``) they are served. Without a key, binding
    beyond loopback is warned about."""
    import openai

    from llava_client import AuthenticationError, SessionClient

    key = "k-" + "5" * 30
    port = pick_ports("127.0.0.1", 0)["inference"]
    command = [*_llava_serve(), "--model-dir", str(tiny_model_dir), "--port", str(port), "--host", "0.0.0.0"]
    cli = subprocess.Popen(
        [*command, "--api-key", key], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(os.environ)
    )
    try:
        output = OutputLines(cli.stdout)
        line = output.wait_for(READY, timeout_s=150).group(0)
        assert line.startswith(f"llava-serve: ready at http://0.0.0.0:{port} (from this machine: http://127.0.0.1:")
        assert "(API key required)" in line and "WARNING" not in "".join(output.lines)
        assert "TorchServe itself" not in line and f"(metrics http://127.0.0.1:{port}/metrics;" in line
        url = f"http://127.0.0.1:{port}"
        assert requests.get(url + "/ping", timeout=5).status_code == 200
        opening = {"type": "open_session", "image": {"base64": base64.b64encode(photos["rocket"]).decode()}}
        assert requests.get(url + "/metrics", timeout=10).status_code == 401
        metrics = requests.get(url + "/metrics", headers={"Authorization": f"Bearer {key}"}, timeout=10)
        assert metrics.status_code == 200 and "ts_inference_requests_total" in metrics.text
        # no other port answers an inference or management request without a key (TorchServe's own
        # token authorization; its gRPC ports check the same keys: GRPCInterceptor). The ports are
        # read from the config.properties the CLI gave TorchServe, each checked for what it serves.
        props = _torchserve_properties(cli.pid)
        ports = _torchserve_ports(props)
        assert sorted(ports) == ["grpc_inference", "grpc_management", "inference", "management", "metrics"]
        assert port not in ports.values()
        checks = {
            "inference": [("POST", "/invocations"), ("POST", "/predictions/llava"), ("GET", "/models")],
            "management": [("GET", "/models"), ("POST", "/models?url=llava")],
        }
        for name, routes in checks.items():
            for method, path in routes:
                r = requests.request(method, f"http://127.0.0.1:{ports[name]}{path}", json=opening, timeout=10)
                assert r.status_code == 400 and "Token Authorization failed" in r.text, (name, path, r.status_code)
        # TorchServe's metrics API takes no token: it listens on loopback only, as the key's port relays it
        assert props["metrics_address"] == f"http://127.0.0.1:{ports['metrics']}"
        for name in ("grpc_inference", "grpc_management"):  # HTTP/2 only: an HTTP/1.1 request gets nothing
            with pytest.raises(requests.ConnectionError):
                requests.post(f"http://127.0.0.1:{ports[name]}/invocations", json=opening, timeout=10)
        for auth in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": key}):
            refused = requests.post(url + "/invocations", json=opening, headers=auth, timeout=30)
            assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
            assert refused.headers["WWW-Authenticate"] == "Bearer"
        with pytest.raises(openai.AuthenticationError) as raised:
            openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
        assert raised.value.code == "invalid_api_key"
        chat = [{"role": "user", "content": "Hi"}]
        served = openai.OpenAI(base_url=url + "/v1", api_key=key).chat.completions.create(
            model=tiny_model_dir.name, messages=chat, max_tokens=2
        )
        assert served.choices[0].message.content is not None
        with pytest.raises(AuthenticationError) as typed:
            SessionClient.from_url(url).open_session(photos["rocket"])
        assert typed.value.status_code == 401 and typed.value.code == "invalid_api_key"
        os.environ["LLAVA_API_KEY"] = key
        try:
            with SessionClient.from_url(url) as client:
                client.open_session(photos["rocket"]).close()
        finally:
            del os.environ["LLAVA_API_KEY"]
        # a restart writes TorchServe new keys: a request cut by the worker's death is sent again with them
        processes = psutil.Process(cli.pid).children(recursive=True)
        (worker,) = [p for p in processes if any("model_service_worker" in arg for arg in p.cmdline())]
        worker.kill()
        again = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0).chat.completions.create(
            model=tiny_model_dir.name, messages=chat, max_tokens=2
        )
        assert again.choices[0].message.content is not None
    finally:
        stop_process(cli)
    assert cli.returncode == 0
    # beyond loopback without a key: said before anything starts (here the folder is not a model)
    bare = subprocess.run(
        [*_llava_serve(), "--model-dir", str(tmp_path), "--port", "0", "--host", "0.0.0.0"],
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if k != "LLAVA_API_KEY"} | {"TMPDIR": str(tmp_path)},
    )
    assert "WARNING: serving on 0.0.0.0 without --api-key" in bare.stderr, bare.stderr


def test_argument_mistakes_are_one_line_errors_said_at_once(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Issue 60 item 6: a port out of range, a server URL without its scheme, and a taken router port
    are each one line on stderr (no traceback), said before anything starts."""
    import socket

    scripts = Path(sys.executable).parent
    env = dict(os.environ) | {"TMPDIR": str(tmp_path)}

    def run(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env, stdin=subprocess.DEVNULL)

    def run_watching(names: set[str], *argv: str) -> subprocess.CompletedProcess:
        """:func:`run`, adding to ``names`` the name of every process it starts (a look every 20 ms)."""
        import psutil

        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        reader = threading.Thread(target=lambda: outputs.append(proc.communicate(timeout=60)))
        outputs: list[tuple[str, str]] = []
        reader.start()
        while reader.is_alive():
            try:
                for child in psutil.Process(proc.pid).children(recursive=True):
                    names.add(child.name())
            except psutil.Error:
                pass
            time.sleep(0.02)
        reader.join()
        stop_process(proc, 5)
        return subprocess.CompletedProcess(argv, proc.returncode, *outputs[0])

    for script in ("llava-serve", "llava-local-endpoint"):
        bad = run(str(scripts / script), "--model-dir", str(tiny_model_dir), "--port", "99999")
        assert bad.returncode == 2 and "a port is a number from 0 to 65535, got '99999'" in bad.stderr
        assert "Traceback" not in bad.stderr
    chat = run(str(scripts / "llava-chat"), "--url", "localhost:8080", "--image", "x.jpg")
    assert chat.returncode == 2 and "did you mean http://localhost:8080?" in chat.stderr
    assert "Traceback" not in chat.stderr
    typo = run(str(scripts / "llava-chat"), "--url", "http://127.0.0.1:8080", "--imge", "x.jpg")  # names the typo
    assert typo.returncode == 2 and typo.stderr.strip().endswith("unrecognized option --imge (did you mean --image?)")
    for where in (["--set", "session_tl_s=5"], ["--ts-set", "batchSize=8", "--set", "max_sesions=2"]):
        short = run(str(scripts / "llava-serve"), "--model-dir", str(tiny_model_dir), "--port", "0", *where)
        assert short.returncode == 1 and "(did you mean" in short.stderr and "valid keys" not in short.stderr
        assert "every setting: docs/configuration.md" in short.stderr and len(short.stderr) < 400, short.stderr
    # a TorchServe key misspelt (TorchServe itself ignores it without a word), in --ts-set or the yaml
    typo = run(
        str(scripts / "llava-serve"), "--model-dir", str(tiny_model_dir), "--port", "0", "--ts-set", "batchSze=8"
    )
    assert (
        typo.returncode == 1
        and "unknown TorchServe key(s) in --ts-set: batchSze (did you mean batchSize?)" in typo.stderr
    )
    config = tmp_path / "model-config.yaml"
    config.write_text("maxBatchDelai: 5\nhandler: {}\n")
    typo = run(str(scripts / "llava-serve"), "--model-dir", str(tiny_model_dir), "--port", "0", "--config", str(config))
    assert typo.returncode == 1 and "maxBatchDelai (did you mean maxBatchDelay?)" in typo.stderr
    assert "Traceback" not in typo.stderr
    # a folder that is no checkpoint: said before TorchServe starts (it took TorchServe's start and ~85
    # log lines): no "starting TorchServe" line (below)
    empty = run(str(scripts / "llava-serve"), "--model-dir", str(tmp_path), "--port", "0")
    assert empty.returncode == 1 and "is not a llava-hf checkpoint folder (no config.json)" in empty.stderr
    assert len(empty.stderr.splitlines()) <= 2, empty.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        started: set[str] = set()  # the names of every process llava-local-endpoint ran
        busy = run_watching(
            started, str(scripts / "llava-local-endpoint"), "--model-dir", str(tiny_model_dir), "--port", port
        )
        serve = run(str(scripts / "llava-serve"), "--model-dir", str(tiny_model_dir), "--port", port)
    assert busy.returncode == 1 and f"cannot listen on 127.0.0.1:{port}" in busy.stderr
    assert "Traceback" not in busy.stderr and not {"java", "torchserve"} & started, started  # before any backend starts
    # llava-serve on a taken port: the fix named, and no "starting TorchServe" line before the refusal
    assert serve.returncode == 1 and "(choose another with --port; 0 picks a free one)" in serve.stderr
    assert "starting TorchServe" not in serve.stdout and "starting TorchServe" not in empty.stdout


def test_a_missing_model_folder_gets_one_sentence_from_every_tool(tmp_path: Path) -> None:
    """llava-serve, the demo (``make demo MODEL_DIR=...``) and llava-deploy, as the user runs them, say
    the same sentence for a folder that does not exist and for one without a config.json, before any start."""
    scripts, missing, empty = Path(sys.executable).parent, tmp_path / "nope", tmp_path / "empty"
    empty.mkdir()
    deploy = ["--endpoint-name", "e", "--s3-uri", "s3://b/p", "--image-uri", "1.dkr.ecr.us-east-1.amazonaws.com/x:1"]
    deploy += ["--role-arn", "arn:aws:iam::123456789012:role/r", "--dry-run"]
    fix = "give the folder 'hf download' wrote, or build one with llava-tiny-model"
    for folder, says in ((missing, f"the model folder {missing} does not exist: {fix}"),
                         (empty, f"{empty} is not a llava-hf checkpoint folder (no config.json): {fix}")):  # fmt: skip
        runs = {
            "llava-serve": [str(scripts / "llava-serve"), "--model-dir", str(folder), "--port", "0"],
            "demo": [sys.executable, "-m", "llava_tools.demo", "--model-dir", str(folder)],
            "llava-deploy": [str(scripts / "llava-deploy"), "--model-dir", str(folder), *deploy],
        }
        for prog, argv in runs.items():
            done = subprocess.run(argv, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
            assert done.returncode in (1, 2) and f"{prog}: {says}" in done.stderr.splitlines(), (prog, done.stderr)
            assert "Traceback" not in done.stderr and "capacity" not in done.stdout and "starting" not in done.stdout


def _torchserve_ports(props: dict[str, str]) -> dict[str, int]:
    """The ports in TorchServe's ``config.properties`` (:func:`_torchserve_properties`): name
    (``inference``, ``grpc_management``...) → port."""
    ports: dict[str, int] = {}
    for key, value in props.items():
        if key.endswith("_address") and value.startswith("http"):
            ports[key.removesuffix("_address")] = int(value.rsplit(":", 1)[1])
        elif key.endswith("_port"):
            ports[key.removesuffix("_port")] = int(value)
    return ports


def _torchserve_properties(cli_pid: int) -> dict[str, str]:
    """The ``config.properties`` the TorchServe under a ``llava-serve`` CLI runs with, as key → value."""
    import psutil

    for child in psutil.Process(cli_pid).children(recursive=True):
        command = child.cmdline()
        if "--ts-config" in command:
            text = Path(command[command.index("--ts-config") + 1]).read_text()
            break
    else:
        raise AssertionError("no TorchServe process with --ts-config under the CLI")
    pairs = (line.partition("=") for line in text.splitlines() if not line.startswith("#"))
    return {key: value for key, _, value in pairs}
