"""Hostile input, memory pressure and faults, against a real TorchServe (tiny model, CPU).

Every hostile request is checked for its status and error code, with a healthy session asked the
same greedy question before and after each one: nothing a bad request does may touch it.
"""

from __future__ import annotations

import base64
import http.server
import io
import json
import threading
import uuid

import pytest
import requests
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from PIL import Image

from llava_sessions.engine import EngineLimits, SessionEngine
from llava_sessions.errors import ErrorCode, ServiceError
from llava_sessions.images.fetch import decode_image
from llava_sessions.sampling.sampler import SamplingParams
from llava_sessions.sessions.store import SessionStore
from server_fixtures import prometheus_text, start_local_server

SID = "X-Amzn-SageMaker-Session-Id"
Q = {"type": "generate", "prompt": "What is in this image?", "remember": False, "parameters": {"max_new_tokens": 6}}


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def png_bomb() -> bytes:
    """A 20000 x 20000 one-bit PNG: a few kB on the wire, 400 M pixels decoded."""
    buf = io.BytesIO()
    Image.new("1", (20000, 20000)).save(buf, format="PNG")
    return buf.getvalue()


class _Redirector(http.server.BaseHTTPRequestHandler):
    """Redirects every GET to the instance-metadata address (an SSRF attempt by redirect)."""

    def do_GET(self):  # noqa: N802
        self.send_response(302)
        self.send_header("Location", "http://169.254.169.254/latest/meta-data/iam/security-credentials/")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def redirector():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Redirector)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/cat.jpg"
    httpd.shutdown()


@pytest.fixture(scope="module")
def server(request, tiny_model_dir):
    # loopback allowed so that a local redirector can be the first hop; link-local, metadata,
    # multicast, reserved and unspecified addresses stay refused (loopback refusal: test_images.py)
    return start_local_server(
        tiny_model_dir,
        addfinalizer=request.addfinalizer,
        overrides={"allow_http": True, "allow_private_networks": True, "max_image_pixels": 40_000_000},
    )


def post(server, body, session_id=None, raw: bytes | None = None):
    headers = {SID: session_id} if session_id else {}
    data = raw if raw is not None else json.dumps(body).encode()
    return requests.post(server.url + "/invocations", data=data, headers=headers, timeout=60)


def test_hostile_inputs_fail_alone_with_their_codes(server, photos, redirector):
    r = post(server, {"type": "open_session", "image": {"base64": b64(photos["astronaut"])}})
    healthy = r.json()["session_id"]
    baseline = post(server, Q, healthy).json()["generated_text"]
    truncated = photos["coffee"][: len(photos["coffee"]) // 3]
    jpeg = io.BytesIO()
    Image.open(io.BytesIO(photos["coffee"])).convert("RGB").save(jpeg, format="JPEG")
    cases = [
        # SSRF targets and a redirect to one
        (
            {"type": "open_session", "image": {"url": "http://169.254.169.254/latest/meta-data/"}},
            None,
            400,
            "image_url_forbidden",
        ),
        (
            {"type": "open_session", "image": {"url": "http://[fd00:ec2::254]/latest/meta-data/"}},
            None,
            400,
            "image_url_forbidden",
        ),
        ({"type": "open_session", "image": {"url": "http://0.0.0.0:8080/x.png"}}, None, 400, "image_url_forbidden"),
        ({"type": "open_session", "image": {"url": "http://224.0.0.1/x.png"}}, None, 400, "image_url_forbidden"),
        ({"type": "open_session", "image": {"url": "file:///etc/passwd"}}, None, 400, "image_url_forbidden"),
        ({"type": "open_session", "image": {"url": redirector}}, None, 400, "image_url_forbidden"),
        # images: bomb, truncated, corrupt, not base64
        ({"type": "open_session", "image": {"base64": b64(png_bomb())}}, None, 413, "image_too_large"),
        ({"type": "open_session", "image": {"base64": b64(jpeg.getvalue()[:2000])}}, None, 400, "image_invalid"),
        ({"type": "open_session", "image": {"base64": b64(truncated)}}, None, 400, "image_invalid"),
        (
            {"type": "open_session", "image": {"base64": b64(b"\x89PNG\r\n\x1a\n" + bytes(100))}},
            None,
            400,
            "image_invalid",
        ),
        ({"type": "open_session", "image": {"base64": "%%% not base64 %%%"}}, None, 400, "image_invalid"),
        # bodies and parameters
        (None, None, 400, "invalid_request"),  # raw: bad JSON
        ({"type": "generate", "prompt": "x", "parameters": {"temperature": -1}}, healthy, 400, "invalid_parameter"),
        ({"type": "generate", "prompt": "x", "parameters": {"top_p": 2}}, healthy, 400, "invalid_parameter"),
        ({"type": "generate", "prompt": "x", "parameters": {"max_new_tokens": 0}}, healthy, 400, "invalid_parameter"),
        (
            {"type": "generate", "prompt": "x", "parameters": {"max_new_tokens": 10**6}},
            healthy,
            400,
            "invalid_parameter",
        ),
        ({"type": "generate", "prompt": "x", "parameters": {"stop": ["a"] * 9}}, healthy, 400, "invalid_parameter"),
        ({"type": "generate", "prompt": "x" * 20000}, healthy, 400, "invalid_parameter"),
        ({"type": "generate", "prompt": "x <image> y"}, healthy, 400, "invalid_parameter"),
        ({"type": "generate", "prompt": "x", "extra": True}, healthy, 400, "invalid_request"),
        ({"type": "generate", "prompt": 42}, healthy, 400, "invalid_parameter"),
        (
            {"type": "generate", "prompt": "x", "parameters": {"max_new_tokens": 1000}},
            healthy,
            422,
            "context_length_exceeded",
        ),
        ({"type": "open_session", "image": {"base64": "A" * 6_400_000}}, None, 413, "payload_too_large"),
        # foreign and malformed session ids
        ({"type": "generate", "prompt": "x"}, f"ts-seq-{uuid.uuid4()}", 404, "session_not_found"),
        ({"type": "close_session"}, f"ts-seq-{uuid.uuid4()}", 404, "session_not_found"),
        ({"type": "reset"}, "NEW_SESSION", 400, "missing_session_id"),
    ]
    for body, sid, status, code in cases:
        r = post(server, body, sid, raw=b"{'type': 'generate'" if body is None else None)
        assert (r.status_code, r.json()["error"]["code"]) == (status, code), (str(body)[:120], r.text[:300])
        assert "Traceback" not in r.text and "169.254" not in r.json()["error"]["message"]
        # the healthy session is untouched, and answers exactly as before
        again = post(server, Q, healthy)
        assert again.status_code == 200 and again.json()["generated_text"] == baseline
    assert post(server, {"type": "close_session"}, healthy).status_code == 200


@pytest.fixture(scope="module")
def pressed_server(request, tiny_model_dir, photos):
    """A device budget of about two sessions' KV + features (real bytes of the tiny model)."""
    return start_local_server(
        tiny_model_dir,
        addfinalizer=request.addfinalizer,
        overrides={"device_budget_bytes": 2 * 780_000, "max_sessions": 8},
        model_config_overrides={"batchSize": 8, "maxNumSequence": 8},
    )


def test_three_times_oversubscribed_budget_loses_nothing_and_never_leaks(pressed_server, photos):
    names = ["astronaut", "chelsea", "coffee", "rocket", "astronaut", "chelsea"]  # 6 sessions, budget ~2
    sids = []
    for n in names:
        r = post(pressed_server, {"type": "open_session", "image": {"base64": b64(photos[n])}})
        assert r.status_code == 200, r.text
        sids.append(r.json()["session_id"])
    first = {}
    for _round in range(2):  # every session asked twice, round robin: each comes back from a lower tier
        for n, sid in zip(names, sids, strict=True):
            r = post(pressed_server, Q, sid)
            assert r.status_code == 200, r.text  # none lost
            text = r.json()["generated_text"]
            # same image → same answer, whichever session and tier; different images → their own answers
            assert first.setdefault(n, text) == text
    assert len(set(first.values())) == 4

    def counts(text: str, name: str) -> list[float]:
        return [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{")]

    metrics = prometheus_text(
        pressed_server.metrics_url,
        lambda t: sum(counts(t, "llava_Restores")) >= 6 and sum(counts(t, "llava_Demotions")) >= 6,
    )
    restores, demotions = counts(metrics, "llava_Restores"), counts(metrics, "llava_Demotions")
    assert restores and restores[0] >= 6 and sum(demotions) >= 6
    for sid in sids:
        assert post(pressed_server, {"type": "close_session"}, sid).status_code == 200


def test_out_of_memory_demotes_others_retries_once_then_overloaded(llava, photos):
    eng = SessionEngine(
        llava,
        SessionStore(device_budget_bytes=10**10, host_budget_bytes=10**9, kv_bytes_per_token=llava.kv_bytes_per_token),
        lambda b: decode_image(b, max_pixels=40_000_000),
        EngineLimits(),
        check_invariants=True,
    )
    eng.open("other", photos["coffee"])
    eng.open("s", photos["astronaut"])
    real_prefill = llava.prefill
    failures = {"left": 1}

    def flaky_prefill(*args, **kwargs):  # the CUDA allocator's error, which CPU cannot produce
        if failures["left"] > 0:
            failures["left"] -= 1
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real_prefill(*args, **kwargs)

    llava.prefill = flaky_prefill
    try:
        a = eng.generate("s", "What is in this image?", SamplingParams(max_new_tokens=4))
        assert a.generated_tokens == 4 and eng.store.get("other").kv_cache is None  # demoted to make room
        failures["left"] = 2
        before = (list(eng.store.get("s").cached_ids), list(eng.store.get("s").history))
        with pytest.raises(ServiceError) as e:
            eng.generate("s", "And now?", SamplingParams(max_new_tokens=4))
        assert e.value.code is ErrorCode.OVERLOADED and e.value.status == 503 and e.value.retry_after_s
        s = eng.store.get("s")  # intact: same history, and it still answers
        assert s.history == before[1] and not s.busy and s.cached_ids == before[0][: len(s.cached_ids)]
    finally:
        llava.prefill = real_prefill
    assert eng.generate("s", "And now?", SamplingParams(max_new_tokens=4)).generated_tokens == 4


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.one_of(
        st.binary(max_size=4096),
        st.binary(max_size=2048).map(lambda b: b"\x89PNG\r\n\x1a\n" + b),
        st.binary(max_size=2048).map(lambda b: b"\xff\xd8\xff\xe0" + b),
        st.binary(max_size=2048).map(lambda b: b"GIF89a" + b),
    )
)
def test_fuzz_image_decoder_only_raises_service_errors(data):
    try:
        image = decode_image(data, max_pixels=4_000_000)
    except ServiceError as err:
        assert err.code in (ErrorCode.IMAGE_INVALID, ErrorCode.IMAGE_TOO_LARGE)
    else:
        assert image.mode == "RGB" and image.width * image.height <= 4_000_000
