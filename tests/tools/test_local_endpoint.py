"""End to end: unmodified boto3 → ``llava-local-endpoint`` → 2 real TorchServes (tiny model, CPU).

Pins the SageMaker-runtime behaviour the router reproduces: sticky sessions by
``X-Amzn-SageMaker-Session-Id`` (``NEW_SESSION`` opens on the least-loaded backend, which mints the
id), ``NewSessionId`` / ``ClosedSessionId``, container errors as ``ModelError`` (424 with
``OriginalStatusCode``), ``invoke_endpoint_with_response_stream`` as AWS event-stream
``PayloadPart`` events, and a backend that dies: its sessions fail fast with 404 and
``llava_client`` recovers them onto the other backend.
"""

from __future__ import annotations

import http.client
import http.server
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import boto3
import botocore.session
import psutil
import pytest
import requests
from botocore.eventstream import ChecksumMismatch, EventStream, EventStreamBuffer
from botocore.exceptions import ClientError, EventStreamError
from botocore.parsers import EventStreamJSONParser

from aws_readers import LineIterator, lmi_reader_text, tgi_reader_text
from llava_tools.local_endpoint import (
    BackendRef,
    LocalEndpoint,
    Router,
    RouterServer,
    encode_event,
    payload_part_event,
    stream_error_event,
)
from llava_tools.local_endpoint.sagemaker_wire import read_frame
from server_fixtures import OutputLines, stop_process, write_echo_handler

SM_RUNTIME = botocore.session.get_session().get_service_model("sagemaker-runtime")
NEW_SESSION_ID_RE = re.compile(SM_RUNTIME.shape_for("NewSessionResponseHeader").metadata["pattern"])
SESSION_ID_RE = re.compile(SM_RUNTIME.shape_for("SessionIdHeader").metadata["pattern"])
JSON = "application/json"


# ---- event-stream framing, checked against botocore's own decoder and parser ------------------------


class _RawStream:
    def __init__(self, data: bytes, piece: int = 7) -> None:
        self._chunks = [data[i : i + piece] for i in range(0, len(data), piece)]

    def stream(self):
        yield from self._chunks

    def close(self) -> None:
        pass


def _botocore_events(data: bytes):
    output = SM_RUNTIME.operation_model("InvokeEndpointWithResponseStream").output_shape.members["Body"]
    return EventStream(_RawStream(data), output, EventStreamJSONParser(), "InvokeEndpointWithResponseStream")


def test_cli_forwards_new_session_as_no_header_unless_told_to_pass_the_literal() -> None:
    from llava_tools.local_endpoint.endpoint import _build_parser

    assert _build_parser().parse_args(["--model-dir", "m"]).pass_new_session is False
    assert _build_parser().parse_args(["--model-dir", "m", "--new-session-literal"]).pass_new_session is True


def test_payload_part_frames_decode_with_botocore() -> None:
    payloads = [b'{"token": {"text": "caf', '\u00e9"}}\n'.encode(), b"", bytes(range(256)) * 300]
    data = b"".join(payload_part_event(p) for p in payloads)
    buffer = EventStreamBuffer()
    buffer.add_data(data)
    messages = list(buffer)
    assert [m.payload for m in messages] == payloads
    assert messages[0].headers == {
        ":event-type": "PayloadPart",
        ":content-type": "application/octet-stream",
        ":message-type": "event",
    }
    # The sagemaker-runtime parser: PayloadPart.Bytes is an eventpayload blob = the raw payload bytes.
    assert [event["PayloadPart"]["Bytes"] for event in _botocore_events(data)] == payloads


def test_a_chunk_that_arrives_in_pieces_is_one_payload_part() -> None:
    """A container's stream event (one HTTP chunk) whose bytes reach the socket in two pieces, the second
    after a pause (as under load), is read whole (``read_frame``): one PayloadPart per event, as the
    docs' boto3 reader and LiteLLM's parse them; ``read1`` alone returned its first piece."""
    event = b'data: {"choices": [{"delta": {"content": "' + b"x" * 200 + b'"}}]}\n\n'
    server, client = socket.socketpair()

    def container() -> None:
        server.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        framed = f"{len(event):x}\r\n".encode() + event + b"\r\n"
        for _ in range(2):  # two events, each split in the middle
            server.sendall(framed[:60])
            time.sleep(0.2)
            server.sendall(framed[60:])
        server.sendall(b"0\r\n\r\n")

    writer = threading.Thread(target=container)
    writer.start()
    response = http.client.HTTPResponse(client)
    response.begin()
    frames = [read_frame(response), read_frame(response), read_frame(response)]
    writer.join()
    server.close()
    client.close()
    assert frames == [event, event, b""]


def test_frame_crcs_are_checked_and_stream_errors_raise() -> None:
    frame = bytearray(payload_part_event(b"hello"))
    frame[-6] ^= 0xFF  # a payload byte: the message CRC no longer matches
    buffer = EventStreamBuffer()
    buffer.add_data(bytes(frame))
    with pytest.raises(ChecksumMismatch):
        list(buffer)
    prelude = bytearray(encode_event([("a", "b")], b"x"))
    prelude[9] ^= 0x01  # the prelude CRC
    buffer = EventStreamBuffer()
    buffer.add_data(bytes(prelude))
    with pytest.raises(ChecksumMismatch):
        list(buffer)

    events = _botocore_events(payload_part_event(b"part") + stream_error_event("backend 1 broke off"))
    iterator = iter(events)
    assert next(iterator) == {"PayloadPart": {"Bytes": b"part"}}
    with pytest.raises(EventStreamError) as caught:
        next(iterator)
    assert caught.value.response["Error"] == {"Code": "ModelStreamError", "Message": "backend 1 broke off"}


# ---- the router over stand-in backends (failure paths that a real TorchServe does not show on cue) ----


class _StandIn(http.server.BaseHTTPRequestHandler):
    """A container stand-in: the body's "mode" says how to misbehave."""

    protocol_version = "HTTP/1.1"

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if body.get("mode") == "break-stream":  # one chunk, then the connection drops
            self.send_response(200)
            self.send_header("Content-Type", "application/jsonlines")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            self.wfile.write(b"8\r\npartial\n\r\n")
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)
            self.close_connection = True
            return
        if body.get("mode") == "slow":
            time.sleep(1.5)
        seen = {"seen_session": self.headers.get("X-Amzn-SageMaker-Session-Id")}
        if self.headers.get("Authorization"):  # a keyed router's bearer token
            seen["seen_authorization"] = self.headers["Authorization"]
        data = json.dumps(seen).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if self.headers.get("X-Amzn-SageMaker-Session-Id") in (None, "NEW_SESSION"):  # an open
            self.send_header("X-Amzn-SageMaker-New-Session-Id", "stand-in-1; Expires=2030-01-01T00:00:00Z")
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):  # noqa: N802
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def stand_in_router():
    """A RouterServer over [a port nobody listens on, a stand-in container]."""
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    dead_port = closed.getsockname()[1]
    closed.close()
    backend = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _StandIn)
    threading.Thread(target=backend.serve_forever, daemon=True).start()
    router = Router(
        [BackendRef(0, f"http://127.0.0.1:{dead_port}"), BackendRef(1, f"http://127.0.0.1:{backend.server_address[1]}")]
    )
    front = RouterServer(("127.0.0.1", 0), router, read_timeout_s=0.5).start()
    rt = boto3.client(
        "sagemaker-runtime",
        endpoint_url=front.url,
        region_name="us-east-1",
        aws_access_key_id="x",
        aws_secret_access_key="x",
    )
    yield router, front, rt
    front.stop()
    backend.shutdown()
    backend.server_close()


def test_router_failure_paths(stand_in_router):
    router, front, rt = stand_in_router
    # A new session whose least-loaded backend refuses the connection is placed on the next one,
    # with no session header (NEW_SESSION as the AWS sample shows SageMaker delivers it), and the
    # refusing backend is taken out of rotation; the endpoint stays healthy while one backend serves.
    reply = rt.invoke_endpoint(EndpointName="e", Body=b"{}", ContentType=JSON, SessionId="NEW_SESSION")
    assert reply["NewSessionId"].startswith("stand-in-1;")
    assert json.loads(reply["Body"].read()) == {"seen_session": None}
    snapshot = requests.get(front.url + "/ping", timeout=5)
    assert snapshot.status_code == 200 and snapshot.json()["backends"] == [None, 200]
    snapshot = requests.get(front.url + "/debug/sessions", timeout=5).json()
    assert snapshot["sessions"] == {"stand-in-1": 1} and [b["healthy"] for b in snapshot["backends"]] == [False, True]
    reply = rt.invoke_endpoint(EndpointName="e", Body=b"{}", ContentType=JSON, SessionId="stand-in-1")
    assert json.loads(reply["Body"].read()) == {"seen_session": "stand-in-1"}

    # No reply within the read timeout: SageMaker's "timed out" ModelError (status 0).
    with pytest.raises(rt.exceptions.ModelError) as caught:
        rt.invoke_endpoint(EndpointName="e", Body=b'{"mode": "slow"}', ContentType=JSON, SessionId="stand-in-1")
    assert caught.value.response["OriginalStatusCode"] == 0
    assert "timed out" in caught.value.response["OriginalMessage"]

    # The container drops the connection mid-stream: what arrived, then a ModelStreamError event.
    reply = rt.invoke_endpoint_with_response_stream(
        EndpointName="e", Body=b'{"mode": "break-stream"}', ContentType=JSON, SessionId="stand-in-1"
    )
    events = iter(reply["Body"])
    assert next(events) == {"PayloadPart": {"Bytes": b"partial\n"}}
    with pytest.raises(EventStreamError) as caught:
        next(events)
    assert caught.value.response["Error"]["Code"] == "ModelStreamError"
    assert "broke off the stream" in caught.value.response["Error"]["Message"]

    # Malformed session ids and oversized bodies are refused as SageMaker does, before any backend sees them.
    with pytest.raises(ClientError) as caught:
        rt.invoke_endpoint(EndpointName="e", Body=b"{}", ContentType=JSON, SessionId="bad_id")
    assert caught.value.response["Error"]["Code"] == "ValidationError"
    with pytest.raises(ClientError) as caught:
        rt.invoke_endpoint(EndpointName="e", Body=b"x" * (6 * 1024 * 1024 + 1), ContentType=JSON)
    assert caught.value.response["Error"]["Code"] == "ValidationError"


# ---- the endpoint ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def endpoint(request, tiny_model_dir):
    ep = LocalEndpoint(  # --new-session-literal: this module's opens share the NEW_SESSION job group
        tiny_model_dir,  # (the default, no header, is what tests/core/test_chat_api.py's endpoint runs)
        backends=2,
        overrides={"step_max_tokens": 2},
        model_config_overrides={"batchSize": 8, "maxNumSequence": 8},
        startup_timeout_s=120,
        pass_new_session=True,
    )
    request.addfinalizer(ep.stop)
    return ep.start()


def runtime_client(url: str):
    """Plain boto3 ``sagemaker-runtime`` pointed at a local endpoint (dummy credentials)."""
    return boto3.client(
        "sagemaker-runtime",
        endpoint_url=url,
        region_name="us-east-1",
        aws_access_key_id="x",
        aws_secret_access_key="x",
    )


@pytest.fixture(scope="module")
def runtime(endpoint):
    return runtime_client(endpoint.url)


def sessions_map(endpoint) -> dict[str, int]:
    return requests.get(endpoint.url + "/debug/sessions", timeout=10).json()["sessions"]


def invoke(runtime, body: dict, session_id: str | None = None):
    kwargs = {"SessionId": session_id} if session_id else {}
    return runtime.invoke_endpoint(
        EndpointName="llava-local", Body=json.dumps(body), ContentType=JSON, Accept=JSON, **kwargs
    )


def open_session(runtime, image: bytes) -> str:
    import base64

    reply = invoke(
        runtime, {"type": "open_session", "image": {"base64": base64.b64encode(image).decode()}}, "NEW_SESSION"
    )
    assert NEW_SESSION_ID_RE.match(reply["NewSessionId"]), reply["NewSessionId"]
    session_id = reply["NewSessionId"].split(";")[0]
    # the literal NEW_SESSION is forwarded (--new-session-literal), so the handler, not TorchServe, mints the id
    assert SESSION_ID_RE.match(session_id) and session_id.startswith("llava-")
    assert json.loads(reply["Body"].read())["session_id"] == session_id
    return session_id


def close(runtime, session_id: str) -> None:
    reply = invoke(runtime, {"type": "close_session"}, session_id)
    assert reply["ClosedSessionId"] == session_id


def generate(runtime, session_id: str, prompt: str, **params) -> dict:
    reply = invoke(runtime, {"type": "generate", "prompt": prompt, "parameters": params}, session_id)
    assert reply["InvokedProductionVariant"] == "AllTraffic" and reply["ContentType"] == JSON
    return json.loads(reply["Body"].read())


def test_ping_and_sessions_stick_to_their_backend(endpoint, runtime, photos):
    assert requests.get(endpoint.url + "/ping", timeout=10).status_code == 200
    ids = [open_session(runtime, photos[name]) for name in ("astronaut", "chelsea", "coffee", "rocket")]
    placed = sessions_map(endpoint)
    assert {placed[s] for s in ids} == {0, 1}  # least-loaded: both backends hold sessions
    assert sorted(placed[s] for s in ids) == [0, 0, 1, 1]
    for turn in range(3):  # a request routed to the other backend would get 404 session_not_found
        for session_id in ids:
            out = generate(runtime, session_id, f"Question {turn}?", max_new_tokens=3, details=True)
            assert out["details"]["cached_tokens"] > 500  # the session's own KV cache was reused
    assert {s: sessions_map(endpoint)[s] for s in ids} == {s: placed[s] for s in ids}
    for session_id in ids:
        close(runtime, session_id)
    assert not set(ids) & set(sessions_map(endpoint))


def test_simultaneous_new_session_opens_all_open(endpoint, runtime, photos):
    """Opens forwarded as the literal ``NEW_SESSION`` share TorchServe's one ``NEW_SESSION`` job group
    per backend: eight at once must all open (with model-config.yaml's maxSequenceJobQueueSize of 2,
    3 of 6 got TorchServe's own 503), each with its own id, and each answers its follow-up."""
    from concurrent.futures import ThreadPoolExecutor

    names = ("astronaut", "chelsea", "coffee", "rocket") * 2
    with ThreadPoolExecutor(len(names)) as pool:
        ids = list(pool.map(lambda name: open_session(runtime, photos[name]), names))
    assert len(set(ids)) == len(names)
    for session_id in ids:
        assert generate(runtime, session_id, "What is it?", max_new_tokens=2)["generated_text"] is not None
        close(runtime, session_id)


def test_stream_is_payload_parts_that_join_to_the_plain_answer(endpoint, runtime, photos):
    session_id = open_session(runtime, photos["chelsea"])
    question = {
        "type": "generate",
        "prompt": "Describe the image in detail.",
        "remember": False,
        "parameters": {"max_new_tokens": 16},
    }
    plain = json.loads(invoke(runtime, question, session_id)["Body"].read())
    reply = runtime.invoke_endpoint_with_response_stream(
        EndpointName="llava-local",
        Body=json.dumps({**question, "stream": True}),
        ContentType=JSON,
        Accept="application/jsonlines",
        SessionId=session_id,
    )
    assert reply["ContentType"] == "application/jsonlines" and reply["InvokedProductionVariant"] == "AllTraffic"
    parts = [event["PayloadPart"]["Bytes"] for event in reply["Body"]]
    assert len(parts) >= 3  # step_max_tokens=2: the container's chunks arrive as separate events
    lines = [json.loads(line) for line in b"".join(parts).splitlines()]
    assert "".join(line["token"]["text"] for line in lines) == plain["generated_text"]
    assert lines[-1]["generated_text"] == plain["generated_text"]
    for reader in (tgi_reader_text, lmi_reader_text):  # AWS's LineIterator + the TGI / LMI notebooks' loops
        reply = runtime.invoke_endpoint_with_response_stream(
            EndpointName="llava-local",
            Body=json.dumps({**question, "stream": True}),
            ContentType=JSON,
            SessionId=session_id,
        )
        assert reader(LineIterator(reply["Body"])) == plain["generated_text"]
    with pytest.raises(ClientError) as caught:  # SageMaker refuses NEW_SESSION on the streaming API
        runtime.invoke_endpoint_with_response_stream(
            EndpointName="llava-local", Body=b"{}", ContentType=JSON, SessionId="NEW_SESSION"
        )
    assert caught.value.response["Error"]["Code"] == "ValidationError"
    close(runtime, session_id)


def test_container_errors_are_model_errors(endpoint, runtime, photos):
    session_id = open_session(runtime, photos["coffee"])
    with pytest.raises(runtime.exceptions.ModelError) as caught:
        generate(runtime, session_id, "x", top_p=0)
    error = caught.value.response
    assert error["Error"]["Code"] == "ModelError" and error["ResponseMetadata"]["HTTPStatusCode"] == 424
    assert error["OriginalStatusCode"] == 400  # an int, parsed by botocore's ModelError shape
    assert json.loads(error["OriginalMessage"])["error"]["code"] == "invalid_parameter"
    assert error["Error"]["Message"].startswith("Received client error (400) from primary with message")
    assert generate(runtime, session_id, "Still here?", max_new_tokens=2)["generated_text"] is not None

    with pytest.raises(runtime.exceptions.ModelError) as caught:  # an id no backend knows
        generate(runtime, "never-opened-1", "x")
    error = caught.value.response
    assert error["OriginalStatusCode"] == 404
    assert json.loads(error["OriginalMessage"])["error"]["code"] == "session_not_found"
    assert error["ResponseMetadata"]["HTTPHeaders"]["x-amzn-sagemaker-closed-session-id"] == "never-opened-1"

    close(runtime, session_id)
    assert session_id not in sessions_map(endpoint)
    with pytest.raises(runtime.exceptions.ModelError) as caught:  # closed: the container says so
        generate(runtime, session_id, "x")
    assert caught.value.response["OriginalStatusCode"] == 404


def test_dead_backend_sessions_fail_fast_and_the_client_recovers(endpoint, runtime, photos):
    """Runs last in this module: it stops backend 1."""
    from llava_client import SageMakerTransport, SessionClient

    client = SessionClient(SageMakerTransport("llava-local", client=runtime), auto_recover=True)
    sessions = [client.open_session(photos[name]) for name in ("astronaut", "rocket")]
    placed = sessions_map(endpoint)
    by_backend = {placed[s.id]: s for s in sessions}
    assert set(by_backend) == {0, 1}
    victim, survivor = by_backend[1], by_backend[0]
    first = victim.ask("What is in this image?", max_new_tokens=6)
    raw_victim = open_session(runtime, photos["coffee"])  # least-loaded again: backend 0 or 1
    raw_on_1 = raw_victim if sessions_map(endpoint)[raw_victim] == 1 else open_session(runtime, photos["coffee"])
    assert sessions_map(endpoint)[raw_on_1] == 1

    endpoint.servers[1].stop()
    started = time.monotonic()
    with pytest.raises(runtime.exceptions.ModelError) as caught:
        generate(runtime, raw_on_1, "Hello?", max_new_tokens=2)
    assert time.monotonic() - started < 5
    error = caught.value.response
    assert error["OriginalStatusCode"] == 404
    assert json.loads(error["OriginalMessage"])["error"]["code"] == "session_not_found"
    assert error["ResponseMetadata"]["HTTPHeaders"]["x-amzn-sagemaker-closed-session-id"] == raw_on_1
    assert set(sessions_map(endpoint).values()) <= {0}  # the router forgot every session of backend 1

    assert survivor.ask("And the colors?", max_new_tokens=3).text is not None  # backend 0 unaffected
    old_id = victim.id
    again = victim.ask("What color is it?", max_new_tokens=3)  # 404 → reopen on backend 0, replay, retry
    assert again.text is not None
    assert victim.recoveries == 1 and victim.id != old_id
    recovery = victim.last_recovery
    assert recovery.old_session_id == old_id and recovery.new_session_id == victim.id
    assert recovery.replayed_turns == 1
    assert victim.history[0][1].text == first.text
    assert sessions_map(endpoint)[victim.id] == 0
    fresh = open_session(runtime, photos["chelsea"])
    assert sessions_map(endpoint)[fresh] == 0  # new sessions avoid the dead backend
    body = requests.get(endpoint.url + "/debug/sessions", timeout=10).json()
    assert [b["healthy"] for b in body["backends"]] == [True, False]
    ping = requests.get(endpoint.url + "/ping", timeout=10)  # the endpoint serves while one instance does
    assert ping.status_code == 200 and ping.json()["backends"][0] == 200 and ping.json()["backends"][1] != 200
    for session in sessions:
        session.close()


# ---- the CLI -----------------------------------------------------------------------------------


def test_cli_serves_boto3_and_stops_every_backend_on_sigterm(tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    handler = write_echo_handler(tmp_path)
    script = Path(sys.executable).parent / "llava-local-endpoint"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "llava_tools.local_endpoint"]
    cli = subprocess.Popen(
        [
            *command,
            "--model-dir",
            str(model_dir),
            "--backends",
            "2",
            "--port",
            "0",
            "--handler",
            str(handler),
            "--startup-timeout",
            "90",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ),
    )
    output = []
    try:
        deadline = time.monotonic() + 100
        url = None
        while url is None and time.monotonic() < deadline:
            line = cli.stdout.readline()
            if not line:
                break
            output.append(line)
            match = re.search(r"ready at (http://\S+) ", line)
            url = match.group(1) if match else None
        assert url, "".join(output)
        torchserve = psutil.Process(cli.pid).children(recursive=True)
        assert sum(p.name().startswith("java") for p in torchserve) == 2
        assert requests.get(url + "/ping", timeout=10).status_code == 200
        rt = runtime_client(url)
        reply = rt.invoke_endpoint(EndpointName="any", Body=b'{"turn": 1}', ContentType=JSON)
        echoed = json.loads(reply["Body"].read())
        assert echoed["body"] == {"turn": 1} and echoed["session_id"].startswith("ts-seq-")

        cli.send_signal(signal.SIGTERM)
        assert cli.wait(timeout=40) == 0
        gone, alive = psutil.wait_procs(torchserve, timeout=5)
        assert not alive, alive
    finally:
        stop_process(cli)


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_cli_keeps_serving_when_a_backend_worker_dies(tiny_model_dir: Path, photos) -> None:
    """SIGKILL the workers of a running ``llava-local-endpoint``'s backends: the CLI keeps serving, three
    requests of plain boto3 sent at once are answered (none raises: each waits out its backend's
    restart), and llava_client over boto3 restores the session it lost with the same greedy answer."""
    from llava_client import SageMakerTransport, SessionClient

    script = Path(sys.executable).parent / "llava-local-endpoint"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "llava_tools.local_endpoint"]
    args = ["--model-dir", str(tiny_model_dir), "--backends", "2", "--port", "0", "--startup-timeout", "150"]
    cli = subprocess.Popen([*command, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output = OutputLines(cli.stdout, cli)
        url = output.wait_for(re.compile(r"ready at (http://\S+) "), timeout_s=200).group(1)
        rt = runtime_client(url)
        client = SessionClient(SageMakerTransport("llava-local", client=rt), auto_recover=True, max_retries=6)
        session = client.open_session(photos["rocket"])
        session.ask("What is in this image?", max_new_tokens=6, temperature=0)
        before = session.ask("Anything else?", remember=False, max_new_tokens=6, temperature=0).text
        old_id = session.id
        workers = [
            p
            for p in psutil.Process(cli.pid).children(recursive=True)
            if "model_service_worker" in " ".join(p.cmdline())
        ]
        assert len(workers) == 2
        chat = json.dumps({"messages": [{"role": "user", "content": "Say something."}], "max_tokens": 4})
        for worker in workers:  # whichever backend holds the session, its worker dies
            worker.kill()
        # at once, plain boto3: each request is held while its backend restarts, and answered
        for _ in range(3):
            try:
                reply = rt.invoke_endpoint(
                    EndpointName="llava-local", Body=chat.encode(), ContentType="application/json"
                )
            except ClientError as err:  # with what the backends' supervisors said (deaths, restarts and their times)
                raise AssertionError(f"{err}\nllava-local-endpoint said:\n{output.drain()}") from err
            assert json.loads(reply["Body"].read())["choices"][0]["message"]["content"] is not None
        again = session.ask("Anything else?", remember=False, max_new_tokens=6, temperature=0)
        assert session.id != old_id and session.recoveries == 1 and again.text == before
        session.close()
        assert cli.poll() is None
    finally:
        stop_process(cli)
    assert cli.returncode == 0


def test_a_client_that_resets_mid_request_prints_no_traceback(stand_in_router, capfd):
    """Issue 60 item 6: a client that resets its connection while sending (a load tool cancelling, a
    browser closing) is no error of the router's: nothing on stderr (it printed a
    ``ConnectionResetError`` traceback)."""
    import struct

    _, front, rt = stand_in_router
    host, port = front.server_address[:2]
    for _ in range(3):
        client = socket.create_connection((host, port))
        client.sendall(b"POST /endpoints/e/invocations HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n{")
        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with a reset
        client.close()
    time.sleep(0.5)  # the handler threads meet the reset
    assert requests.get(front.url + "/ping", timeout=10).status_code == 200
    err = capfd.readouterr().err
    assert "Traceback" not in err and "ConnectionResetError" not in err, err


def test_an_api_key_is_presented_by_boto3_as_its_access_key_and_by_openai_as_bearer(endpoint, photos):
    """``llava-local-endpoint --api-key K``: boto3 signing with ``aws_access_key_id=K`` and the openai
    package with ``api_key=K`` are served; another key gets a typed 401 (boto3's ``ClientError``
    ``UnrecognizedClientException``, OpenAI's ``invalid_api_key``); ``/ping`` needs none."""
    import botocore.exceptions
    import openai

    from llava_tools.local_endpoint.runtime_front import RouterServer

    keyed = RouterServer(("127.0.0.1", 0), endpoint.router, api_key="local-key").start()
    try:
        body = json.dumps({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}).encode()
        good = boto3.client(
            "sagemaker-runtime",
            endpoint_url=keyed.url,
            region_name="us-east-1",
            aws_access_key_id="local-key",
            aws_secret_access_key="x",
        )
        reply = good.invoke_endpoint(EndpointName="e", Body=body, ContentType="application/json")
        assert json.loads(reply["Body"].read())["choices"]
        with pytest.raises(botocore.exceptions.ClientError) as refused:
            runtime_client(keyed.url).invoke_endpoint(EndpointName="e", Body=body, ContentType="application/json")
        assert refused.value.response["Error"]["Code"] == "UnrecognizedClientException"
        assert refused.value.response["ResponseMetadata"]["HTTPStatusCode"] == 401
        base = keyed.url + "/endpoints/e/openai/v1"
        chat = [{"role": "user", "content": "Hi"}]
        assert (
            openai.OpenAI(base_url=base, api_key="local-key")
            .chat.completions.create(model="m", messages=chat, max_tokens=2)
            .choices
        )
        with pytest.raises(openai.AuthenticationError) as raised:
            openai.OpenAI(base_url=base, api_key="other", max_retries=0).chat.completions.create(
                model="m", messages=chat, max_tokens=2
            )
        assert raised.value.code == "invalid_api_key"
        assert requests.get(keyed.url + "/ping", timeout=10).status_code == 200
        assert requests.get(keyed.url + "/debug/sessions", timeout=10).status_code == 401
    finally:
        keyed.stop()


def test_an_endpoint_s_key_is_wanted_by_its_backends_and_sent_to_them(stand_in_router, tiny_model_dir):
    """Issue 60 item 5: ``LocalEndpoint(api_key=K)`` gives each backend (a ``LocalServer``) the key, so
    their ports and their TorchServe's want it too (tests/tools/test_serve.py tries every port of such
    a server), and the router sends it to them as a bearer token, whatever credentials the caller signed with."""
    key = "k-" + "9" * 30
    assert [s.api_key for s in LocalEndpoint(tiny_model_dir, backends=2, api_key=key).servers] == [key, key]
    router = stand_in_router[0]
    keyed = RouterServer(("127.0.0.1", 0), router, api_key=key).start()
    try:
        signed = boto3.client(
            "sagemaker-runtime",
            endpoint_url=keyed.url,
            region_name="us-east-1",
            aws_access_key_id=key,
            aws_secret_access_key="x",
        )
        reply = signed.invoke_endpoint(
            EndpointName="e", Body=json.dumps({"mode": "ok"}), ContentType="application/json"
        )
        assert json.loads(reply["Body"].read())["seen_authorization"] == f"Bearer {key}"
    finally:
        keyed.stop()


def test_web_page_over_the_sagemaker_runtime(endpoint, runtime, photos, tmp_path):
    """The page's logic (``WebChat``) through boto3's sagemaker-runtime, and ``llava-web --endpoint
    --endpoint-url`` serving the page against this endpoint until SIGTERM."""
    from llava_client import SageMakerTransport, SessionClient
    from llava_client.web import WebChat

    chat = WebChat(SessionClient(SageMakerTransport("llava-local", client=runtime)))
    _, status = chat.open_image("tab-1", photos["astronaut"])
    assert "opened" in status, status
    session_id = chat.tab("tab-1").session.id
    *_, (messages, status) = chat.ask("tab-1", "What is in this image?", 8, 0.0)
    assert "finish_reason" in status and messages[-1]["role"] == "assistant", status
    *_, (_, status) = chat.ask("tab-1", "And the background?", 8, 0.0)
    assert int(re.search(r"reused (\d+) of", status).group(1)) > 576, status
    chat.leave("tab-1")
    with pytest.raises(ClientError) as info:  # leaving the tab closed its session
        invoke(runtime, {"type": "generate", "prompt": "hi"}, session_id)
    assert info.value.response["OriginalStatusCode"] == 404

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x", "GRADIO_TEMP_DIR": str(tmp_path)}
    command = [sys.executable, "-m", "llava_client.web", "--endpoint", "llava-local", "--endpoint-url", endpoint.url]
    web = subprocess.Popen(
        [*command, "--region", "us-east-1", "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        output = OutputLines(web.stdout, web)
        output.wait_for(
            re.compile(r"llava-web: chat page at http://127\.0\.0\.1:\d+ \(server: SageMaker endpoint"), 120
        )
        assert requests.get(f"http://127.0.0.1:{port}", timeout=10).status_code == 200
        web.send_signal(signal.SIGTERM)
        assert web.wait(timeout=60) == 0
    finally:
        stop_process(web)
