"""The container's ``serve`` entrypoint, run on this machine without Docker (tiny model, CPU).

``docker/serve`` (``/usr/local/bin/serve`` in the image) is run as SageMaker's ``docker run IMAGE
serve`` would, with the model folder and port given through the environment instead of
``/opt/ml/model`` and 8080. The model folder is the artifact ``llava-deploy`` uploads, written
locally, so this also checks that the uploaded layout serves.
"""

from __future__ import annotations

import base64
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import requests

from llava_tools.deploy import build_package, write_package
from llava_tools.serve import ServerStartError
from llava_tools.serve.container import ContainerServer, ModelNotFoundError, _parse_properties, resolve_model
from server_fixtures import OutputLines, prometheus_text, stop_process

REPO = Path(__file__).resolve().parents[2]
TS_CONFIG = REPO / "config" / "config.properties"
SID = "X-Amzn-SageMaker-Session-Id"
NEW = "X-Amzn-SageMaker-New-Session-Id"
CLOSED = "X-Amzn-SageMaker-Closed-Session-Id"
READY = re.compile(r"ready at (http://\S+) \(metrics (\S+)/metrics; logs (\S+);")


# ---- model lookup and config.properties ---------------------------------------------------------


def test_resolve_model_prefers_sagemaker_then_baked_and_reads_the_artifact(tmp_path: Path) -> None:
    sagemaker, baked = tmp_path / "ml-model", tmp_path / "baked"
    sagemaker.mkdir()
    (baked / "config.json").parent.mkdir()
    (baked / "config.json").write_text("{}")
    assert resolve_model(candidates=(sagemaker, baked)) == (baked.resolve(), None)  # /opt/ml/model empty
    packaged = sagemaker / "llava"
    packaged.mkdir()
    (packaged / "config.json").write_text("{}")
    (packaged / "model-config.yaml").write_text("handler: {}\n")
    assert resolve_model(candidates=(sagemaker, baked)) == (
        packaged.resolve(),
        (packaged / "model-config.yaml").resolve(),
    )
    (sagemaker / "config.json").write_text("{}")  # a plain checkpoint at the root wins
    assert resolve_model(candidates=(sagemaker, baked)) == (sagemaker.resolve(), None)
    with pytest.raises(ModelNotFoundError, match="no model: none of .*empty/config.json"):
        resolve_model(tmp_path / "empty")


def _container_properties(tmp_path: Path, ts_config: Path, api_key: str | None = None) -> dict[str, str]:
    server = ContainerServer(tmp_path, ts_config=ts_config, host="0.0.0.0", port=8080, api_key=api_key)
    server._ports = {
        "inference": 40000,  # TorchServe's own, on loopback (the proxy holds 8080)
        "management": 40001,
        "metrics": 40002,
        "grpc_inference": 40003,
        "grpc_management": 40004,
    }
    return _parse_properties(server._config_properties(tmp_path / "store"))


def test_container_config_is_the_image_file_with_this_runs_addresses(tmp_path: Path) -> None:
    written = _container_properties(tmp_path, TS_CONFIG)
    from_file = _parse_properties(TS_CONFIG.read_text())
    assert written["inference_address"] == "http://127.0.0.1:40000"  # behind the proxy on 0.0.0.0:8080
    assert written["management_address"] == "http://127.0.0.1:40001"  # loopback only
    assert written["metrics_address"] == "http://127.0.0.1:40002"
    assert written["model_store"] == str(tmp_path / "store") and written["load_models"] == "ALL"
    for key in (
        "metrics_mode",
        "disable_token_authorization",
        "max_request_size",
        "max_response_size",
        "ts_header_key_sequence_id",
        "ts_header_key_sequence_start",
        "ts_header_key_sequence_end",
    ):
        assert written[key] == from_file[key], key
    assert written["metrics_mode"] == "prometheus" and "disable_system_metrics" not in written

    # with the container's key, TorchServe's own token authorization is on whatever the file says
    keyed = _container_properties(tmp_path, TS_CONFIG, api_key="k-" + "7" * 30)
    assert "disable_token_authorization" not in keyed and int(keyed["token_expiration_min"]) > 10**7

    bad = tmp_path / "bad.properties"
    bad.write_text(
        TS_CONFIG.read_text().replace(
            "ts_header_key_sequence_id=X-Amzn-SageMaker-Session-Id",
            "ts_header_key_sequence_id=x-amzn-sagemaker-session-id",
        )
    )
    with pytest.raises(ServerStartError, match="ts_header_key_sequence_id"):
        _container_properties(tmp_path, bad)


def test_serve_without_a_model_exits_1_with_what_to_do(tmp_path: Path) -> None:
    env = {**os.environ, "LLAVA_CONTAINER_MODEL_DIR": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, "-m", "llava_tools.serve.container", "serve"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert "no model" in result.stderr and "BAKE_MODEL_ID" in result.stderr


def test_serve_refuses_more_than_one_worker(tmp_path: Path, tiny_model_dir: Path) -> None:
    """SAGEMAKER_MODEL_SERVER_WORKERS=2 would lose NEW_SESSION follow-ups: refused with the reason."""
    env = {**os.environ, "SAGEMAKER_MODEL_SERVER_WORKERS": "2", "LLAVA_CONTAINER_MODEL_DIR": str(tiny_model_dir)}
    result = subprocess.run(
        [sys.executable, "-m", "llava_tools.serve.container", "serve"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert "more than one TorchServe worker" in result.stderr and "NEW_SESSION" in result.stderr


# ---- the entrypoint, end to end -------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_the_container_s_api_key_guards_every_port_and_left_requests_are_freed(tmp_path, tiny_model_dir, photos):
    """Issue 60 item 5: with ``LLAVA_API_KEY`` set in the container, its port answers ``/ping`` alone
    without the key (SageMaker's health check), everything else wants ``Authorization: Bearer <key>``,
    and no other listening port answers an inference or management request without a key. Then, on
    the same container, requests their clients left are freed (:func:`_left_requests_are_freed`)."""
    key = "k-" + "3" * 30
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "LLAVA_CONTAINER_MODEL_DIR": str(tiny_model_dir),
        "LLAVA_CONTAINER_PORT": "0",
        "LLAVA_API_KEY": key,
        "LLAVA_MAX_CONCURRENT_GENERATIONS": "1",  # for _left_requests_are_freed: a slot still taken
        "LLAVA_QUEUE_MAX_REQUESTS": "0",  # shows as a 503 (a refusal is not held)
    }
    serve = subprocess.Popen(
        [str(REPO / "docker" / "serve")], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        output = OutputLines(serve.stdout, serve)
        ready = output.wait_for(re.compile(r"ready at (http://\S+) \(API key required\) \(metrics "), timeout_s=120)
        url = ready.group(1)
        assert requests.get(url + "/ping", timeout=2).status_code == 200
        opening = {"type": "open_session", "image": {"base64": base64.b64encode(photos["rocket"]).decode()}}
        refused = requests.post(url + "/invocations", json=opening, timeout=60)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        auth = {"Authorization": f"Bearer {key}"}
        opened = requests.post(url + "/invocations", json=opening, headers=auth, timeout=60)
        assert opened.status_code == 200, opened.text
        public = int(url.rsplit(":", 1)[1])
        others = {
            c.laddr.port
            for p in psutil.Process(serve.pid).children(recursive=True)
            for c in p.net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr.port != public
        }
        assert len(others) >= 3, others
        for other in sorted(others):
            for path in ("/invocations", "/predictions/llava", "/models"):
                try:
                    r = requests.post(f"http://127.0.0.1:{other}{path}", json=opening, timeout=10)
                except requests.ConnectionError:
                    continue  # a gRPC port: HTTP/1.1 is no request there
                assert r.status_code == 404 or "Token Authorization failed" in r.text, (other, path, r.text[:200])
        _left_requests_are_freed(url, auth, photos)
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=30) == 0
    finally:
        stop_process(serve)


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_serve_entrypoint_serves_the_deploy_artifact_and_stops_on_sigterm(tmp_path, tiny_model_dir, photos):
    artifact = write_package(
        build_package(tiny_model_dir, overrides={"session_ttl_s": 600, "step_max_tokens": 2}), tmp_path / "opt-ml-model"
    )
    assert (artifact / "llava" / "MAR-INF" / "MANIFEST.json").is_file()
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "LLAVA_CONTAINER_MODEL_DIR": str(artifact),  # instead of /opt/ml/model
        "LLAVA_CONTAINER_PORT": "0",  # a free port instead of 8080 (still bound on 0.0.0.0)
    }
    serve = subprocess.Popen(
        [str(REPO / "docker" / "serve")], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        output = OutputLines(serve.stdout, serve)
        ready = output.wait_for(READY, timeout_s=120)
        url, metrics_url, log_dir = ready.group(1), ready.group(2), Path(ready.group(3))
        processes = psutil.Process(serve.pid).children(recursive=True)
        assert any(p.name().startswith("java") for p in processes)
        written = (log_dir.parent / "config.properties").read_text()
        # TorchServe on loopback; the public port (bound on 0.0.0.0) is the proxy's, whose /ping is truthful
        assert (
            written.startswith("# Written by llava-container-serve from")
            and "inference_address=http://127.0.0.1:" in written
            and f"inference_address=http://127.0.0.1:{url.rsplit(':', 1)[1]}" not in written
        )
        java = next(p for p in processes if p.name().startswith("java"))
        assert f"-Dlog4j.configurationFile=file://{REPO / 'config' / 'log4j2.xml'}" in java.cmdline()

        assert requests.get(url + "/ping", timeout=2).status_code == 200  # within SageMaker's 2 s /ping deadline

        image = base64.b64encode(photos["astronaut"]).decode()
        opened = requests.post(
            url + "/invocations",
            json={"type": "open_session", "image": {"base64": image}},
            headers={SID: "NEW_SESSION"},
            timeout=60,
        )
        assert opened.status_code == 200, opened.text
        session_id = opened.json()["session_id"]
        assert opened.headers[NEW].startswith(session_id + "; Expires=")
        expires = time.mktime(time.strptime(opened.json()["expires_at"], "%Y-%m-%dT%H:%M:%SZ")) - time.timezone
        assert 500 < expires - time.time() <= 600  # the artifact's model-config.yaml (--set session_ttl_s=600)
        answer = requests.post(
            url + "/invocations",
            headers={SID: session_id},
            timeout=60,
            json={
                "type": "generate",
                "prompt": "What is in this image?",
                "parameters": {"max_new_tokens": 4, "details": True},
            },
        )
        assert answer.status_code == 200 and answer.json()["details"]["cached_tokens"] > 500
        closed = requests.post(
            url + "/invocations", json={"type": "close_session"}, headers={SID: session_id}, timeout=60
        )
        assert closed.status_code == 200 and closed.headers[CLOSED] == session_id
        assert "llava_OpenSessions" in prometheus_text(metrics_url, lambda text: "llava_OpenSessions" in text)

        # a worker that dies does not take the container down: its supervisor restarts TorchServe
        workers = [
            p
            for p in psutil.Process(serve.pid).children(recursive=True)
            if "model_service_worker" in " ".join(p.cmdline())
        ]
        assert len(workers) == 1
        workers[0].kill()
        output.wait_for(re.compile(r"died; restarting TorchServe"), timeout_s=30)
        assert requests.get(url + "/ping", timeout=2).status_code == 503  # restarting: SageMaker sees it
        # a request meanwhile is held until the worker serves again, and answered (none raises)
        reopened = requests.post(
            url + "/invocations", json={"type": "open_session", "image": {"base64": image}}, timeout=60
        )
        assert reopened.status_code == 200, reopened.text
        assert requests.get(url + "/ping", timeout=2).status_code == 200
        output.wait_for(re.compile(r"ready again at "), timeout_s=30)

        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=30) == 0  # within SageMaker's 30 s before its SIGKILL
        _, alive = psutil.wait_procs(processes, timeout=5)
        assert not alive, alive
        assert not log_dir.parent.exists()  # its temp dir is removed
        output.wait_for(re.compile(r"llava-container-serve: stopped"), timeout_s=5)
    finally:
        stop_process(serve)


def _left_requests_are_freed(url: str, auth: dict, photos) -> None:
    """Issue 60 item 0 through the container's proxy: with one generation slot and no queue, a stream
    left after its first chunk and a whole answer left while it is generated, in both dialects, each
    free the slot: the next request is answered within seconds (before, ``503 overloaded`` for 600 s)."""
    import http.client
    import json

    port = int(url.rsplit(":", 1)[1])
    opening = {"type": "open_session", "image": {"base64": base64.b64encode(photos["rocket"]).decode()}}
    sid = requests.post(url + "/invocations", json=opening, headers=auth, timeout=60).json()["session_id"]
    chat = {"messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 300, "ignore_eos": True}
    native = {"type": "generate", "prompt": "Tell me a long story.", "parameters": {"max_new_tokens": 300}}
    cases = [({**chat, "stream": True}, {}), (chat, {}), ({**native, "stream": True}, {SID: sid}), (native, {SID: sid})]
    for body, headers in cases:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request("POST", "/invocations", json.dumps(body), {"Content-Type": "application/json", **auth, **headers})
        if body.get("stream"):
            reply = conn.getresponse()
            assert reply.status == 200 and reply.fp.readline()  # its first chunk arrived
        else:
            time.sleep(0.5)  # being generated: no byte of the reply sent yet
        conn.close()
        t0, status = time.monotonic(), 0
        while status != 200 and time.monotonic() - t0 < 10:
            quick = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            status = requests.post(url + "/invocations", json=quick, headers=auth, timeout=60).status_code
            if status != 200:
                assert status == 503
                time.sleep(0.2)
        assert status == 200 and time.monotonic() - t0 < 10, body
    # the session whose questions were left is as it was: it answers
    short = {**native, "parameters": {"max_new_tokens": 2}}
    again = requests.post(url + "/invocations", json=short, headers={SID: sid, **auth}, timeout=60)
    assert again.status_code == 200, again.text
