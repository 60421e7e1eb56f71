"""Model replicas inside one worker (``devices``): placement, routing, metrics, a replica's death.

The integration test runs a real TorchServe with ``devices=cpu,cpu`` (two replica processes, each
with its own copy of the tiny model).
"""

from __future__ import annotations

import base64
import json
import os
import time

import psutil
import pytest
import requests

from llava_client import SessionClient
from llava_sessions.config import Settings
from llava_sessions.replicas import ReplicaRouter, replica_environment, replica_settings, resolve_devices
from server_fixtures import start_local_server, worker_metric

SID = "X-Amzn-SageMaker-Session-Id"
CLOSED = "X-Amzn-SageMaker-Closed-Session-Id"


def test_devices_resolve_to_one_replica_per_gpu_or_the_list_given():
    auto = Settings.from_sources({})
    assert resolve_devices(auto, cuda_count=0) == [""]  # one replica, the model's own device choice
    assert resolve_devices(auto, cuda_count=1) == [""]
    assert resolve_devices(auto, cuda_count=4) == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    assert resolve_devices(Settings.from_sources({"device": "cpu"}), cuda_count=4) == [""]
    assert resolve_devices(Settings.from_sources({"gpu_id": 2}), cuda_count=4) == [""]
    assert resolve_devices(Settings.from_sources({}, {"LLAVA_DEVICES": "cpu, cpu"})) == ["cpu", "cpu"]
    with pytest.raises(ValueError, match="devices"):
        Settings.from_sources({"devices": "tpu:0"})


def test_each_replica_gets_its_device_its_own_max_sessions_and_a_share_of_host_memory():
    base = Settings.from_sources({"max_sessions": 9, "host_budget_bytes": 1000})
    one = replica_settings(base, "cuda:1", 2)
    assert (one.device, one.gpu_id, one.max_sessions, one.host_budget_bytes) == ("cuda", 1, 9, 500)
    cpu = replica_settings(base, "cpu", 2)
    assert cpu.device == "cpu" and cpu.gpu_id is None and cpu.torch_threads >= 1
    assert replica_settings(base, "", 1) == base.model_copy(update={"devices": "auto"})


def test_a_replica_sees_only_its_gpus_and_runs_on_cuda_0_inside_its_process():
    """CUDA reads ``CUDA_VISIBLE_DEVICES`` once; a replica on ``cuda:k`` sees GPU k alone (k to k + N - 1
    with N-way tensor parallel), counted within the worker's own list, and names it ``cuda:0``."""
    assert replica_environment("cuda:1", 1, None) == ("1", "cuda:0")
    assert replica_environment("cuda", 1, None) == ("0", "cuda:0")
    assert replica_environment("cuda:2", 2, None) == ("2,3", "cuda:0")
    assert replica_environment("cuda:1", 1, "4, 6") == ("6", "cuda:0")
    assert replica_environment("cpu", 1, "0,1") == ("", "cpu")
    assert replica_environment("", 1, "0") == (None, "")
    with pytest.raises(ValueError, match="lists 2 GPU"):
        replica_environment("cuda:1", 2, "4,6")


class _Probe:
    """What a replica process saw, in place of its service (the router asks only these two)."""

    def __init__(self, seen: dict) -> None:
        self.seen = seen

    def placement_stats(self) -> dict:
        return {"free_bytes": 0, "num_sessions": 0, "new_session_bytes": 1, **self.seen}

    def run_ahead(self) -> bool:
        return False


def probe_replica(*, replica, num_replicas, handler_section, origin, device):
    """A replica's builder that reports, from inside the spawned process, its GPUs and its device."""
    settings = replica_settings(Settings.from_sources(dict(handler_section), origin.env), device, num_replicas)
    seen = {"visible": os.environ.get("CUDA_VISIBLE_DEVICES"), "device": device, "gpu_id": settings.gpu_id}
    return _Probe(seen)


@pytest.mark.parametrize(("parent", "expected"), [(None, ["0", "1"]), ("3,5", ["3", "5"])])
def test_each_spawned_replica_process_sees_its_own_gpu_as_cuda_0(monkeypatch, parent, expected):
    """``devices: cuda:0,cuda:1`` on a machine with no GPU: each real replica process (multiprocessing
    spawn, as on a GPU instance) starts with its own GPU alone visible and its model on ``cuda:0``
    (gpu_id 0), and the worker's own environment is as it was."""
    from llava_sessions.worker import WorkerOrigin

    if parent is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", parent)
    settings = Settings.from_sources({"devices": "cuda:0,cuda:1"})
    build = {"handler_section": {"devices": "cuda:0,cuda:1"}, "origin": WorkerOrigin(env={})}
    router = ReplicaRouter(settings, ["cuda:0", "cuda:1"], build, builder=probe_replica)
    try:
        seen = [{k: r.stats[k] for k in ("visible", "device", "gpu_id")} for r in router.replicas]
    finally:
        router.close()
    assert seen == [{"visible": gpu, "device": "cuda:0", "gpu_id": 0} for gpu in expected]
    assert [r.device for r in router.replicas] == ["cuda:0", "cuda:1"]  # the worker's own names, for its logs
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == parent


def test_the_worker_warns_when_batch_size_is_below_its_sessions(tiny_model_dir, caplog):
    """A hand-made model-config.yaml whose batchSize cannot give every session a job group (TorchServe
    would serialise them): the worker starts, and says what to set."""
    import logging

    from llava_sessions.worker import WorkerOrigin, build_service

    section = {"model_dir": str(tiny_model_dir), "devices": "cpu", "max_sessions": 20}
    with caplog.at_level(logging.WARNING, logger="llava_sessions"):
        build_service(section, WorkerOrigin(env={}), batch_size=16)
    assert "batchSize 16 is below max_sessions 20 x 1 replica(s)" in caplog.text
    assert "set batchSize and maxNumSequence to 28" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="llava_sessions"):
        build_service(section, WorkerOrigin(env={}), batch_size=28)
    assert "batchSize" not in caplog.text


#: Tokens of the answer whose replicas die while it streams: on the 2-core VM on a fast day 120 were all
#: made before the kill (the stream then needs no resume), so the answer runs on a checkpoint with
#: llava-1.5's 4,096 positions.
STREAMED_TOKENS = 1500


def _post(url, body, session_id=None):
    headers = {SID: session_id} if session_id is not None else {}
    return requests.post(f"{url}/invocations", data=json.dumps(body), headers=headers, timeout=60)


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_two_replicas_place_route_and_survive_a_replica_death(request, tmp_path, photos):
    from llava_tools.tiny_model import write_checkpoint

    server = start_local_server(
        write_checkpoint("tiny", tmp_path / "tiny-4096", seed=0),  # 4,096 positions: a long answer to cut
        addfinalizer=request.addfinalizer,
        overrides={"devices": "cpu,cpu", "max_sessions": 8, "max_new_tokens_cap": STREAMED_TOKENS},
        model_config_overrides={"batchSize": 24, "maxNumSequence": 24},
    )
    image = {"base64": base64.b64encode(photos["coffee"]).decode()}
    ids = []
    for _ in range(8):  # no header and the literal NEW_SESSION, alike
        for literal in (None, "NEW_SESSION"):
            r = _post(server.url, {"type": "open_session", "image": image}, literal)
            assert r.status_code == 200, r.text
            ids.append(r.json()["session_id"])
    question = {"type": "generate", "prompt": "What is in this image?", "parameters": {"max_new_tokens": 4}}
    for _ in range(3):
        texts = set()
        for sid in ids:
            r = _post(server.url, question, sid)
            assert r.status_code == 200, r.text  # every follow-up reaches its session's replica
            texts.add(r.json()["generated_text"])
        assert len(texts) == 1  # the same greedy answer from either replica (same weights, image, history)
    held = worker_metric(server, "llava_OpenSessions", until=lambda v: sum(v.values()) == 16)
    assert sorted(held) == ["0", "1"] and all(7 <= n <= 9 for n in held.values()), held
    assert sum(held.values()) == 16

    # one replica process dies: its sessions are gone (a retryable 503, then 404 + Closed), the
    # other's keep answering; no request gets a 500
    worker = psutil.Process(server.worker_pids()[0])
    replicas = [p for p in worker.children() if "spawn_main" in " ".join(p.cmdline())]
    assert len(replicas) == 2
    replicas[1].kill()
    codes = {}
    for sid in ids:
        r = _post(server.url, question, sid)
        codes[sid] = r.status_code
        if r.status_code == 404:
            assert r.json()["error"]["code"] == "session_not_found" and r.headers[CLOSED] == sid
        if r.status_code == 503:  # the first request to reach the dead replica: retried, it gets the 404
            assert r.json()["error"]["code"] == "model_not_ready" and r.headers["Retry-After"] == "5", r.text
            assert _post(server.url, question, sid).status_code == 404
            codes[sid] = 404
    lost = [sid for sid, code in codes.items() if code == 404]
    assert 7 <= len(lost) <= 9 and all(code in (200, 404) for code in codes.values()), codes
    assert sum(code == 200 for code in codes.values()) >= 7
    deadline = time.monotonic() + 120
    while True:  # the dead replica is started again, empty; new sessions go to it (most free budget)
        r = _post(server.url, {"type": "open_session", "image": image})
        if r.status_code == 200:
            assert _post(server.url, question, r.json()["session_id"]).status_code == 200
            if worker_metric(server, "llava_OpenSessions").get("1", 99) < 5:  # a fresh replica 1 reported
                break
        else:  # while replica 1 restarts, replica 0 is full: overloaded, with Retry-After
            assert r.status_code == 503 and r.json()["error"]["code"] == "overloaded", r.text
        assert time.monotonic() < deadline, "the dead replica did not come back"
        time.sleep(1)
    alive = [p for p in worker.children() if "spawn_main" in " ".join(p.cmdline())]
    assert len(alive) == 2 and replicas[1].pid not in [p.pid for p in alive]

    # both die, one of them streaming an answer: once the worker knows, a new request no replica can
    # take gets a typed 503 with Retry-After (never a 500), until they are back. The first 30 of those
    # come back to back: more refused opens than TorchServe has job groups (maxNumSequence 24), so each
    # must end the group TorchServe minted for it, or TorchServe itself refuses the next ("has no worker
    # to serve"). The stream ends with model_not_ready, and llava_client goes on where it stopped
    session = SessionClient.from_url(server.url).open_session(photos["coffee"])
    ask = {"remember": False, "max_new_tokens": STREAMED_TOKENS, "temperature": 0}
    whole = session.ask("Describe the picture in detail.", details=True, **ask)
    assert len(whole.tokens) == STREAMED_TOKENS
    stream = session.stream("Describe the picture in detail.", **ask)
    given = next(stream) + next(stream)
    for process in alive:
        process.kill()
    seen = []
    burst = 30
    deadline = time.monotonic() + 120
    while True:
        r = _post(server.url, {"type": "open_session", "image": image})
        code = r.json().get("error", {}).get("code")
        seen.append((r.status_code, code))
        if r.status_code == 200:
            break
        assert r.status_code == 503, r.text
        if r.status_code == 503:
            assert code == "model_not_ready" and r.headers.get("Retry-After") == "5", (r.text, seen)
        assert time.monotonic() < deadline, seen
        if r.status_code == 503 and burst:
            burst -= 1
        else:
            time.sleep(0.5)
    assert (503, "model_not_ready") in seen and all(status != 500 for status, _ in seen), seen
    rest = "".join(stream)
    assert given + rest == whole.text and stream.resumes == 1
    assert server.restarts == 0  # the worker itself never died
