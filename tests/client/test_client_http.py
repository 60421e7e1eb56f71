"""llava_client over plain HTTP against a real local TorchServe (tiny model, CPU). No mocks.

One server for the module. ``step_max_tokens=2`` makes every answer of 3+ tokens span several
handler calls, so streams arrive in several chunks.
"""

from __future__ import annotations

import http.server
import io
import json
import logging
import os
import re
import socket
import threading
import time
from datetime import datetime, timezone

import psutil
import pytest
import requests
from PIL import Image

from llava_client import (
    APIConnectionError,
    APITimeoutError,
    ContextLengthExceeded,
    HttpTransport,
    InvalidRequest,
    LlavaError,
    PayloadTooLarge,
    SessionBusy,
    SessionClient,
    SessionNotFound,
)
from server_fixtures import start_local_server, stop_process

pytestmark = pytest.mark.integration

SID = "X-Amzn-SageMaker-Session-Id"
GREEDY = {"max_new_tokens": 8}


@pytest.fixture(scope="module")
def server(request, tiny_model_dir):
    # one torch thread: these tests exercise the client, and the server's two default intra-op threads
    # share this 2-core machine with the client, TorchServe's JVM and the proxy. With one core kept busy
    # (issue 46's stress-ng run) each of their parallel regions waited for a descheduled thread: a 180-token
    # answer took 45 s instead of under 1 s, and llava-chat ran past its 120 s timeout
    return start_local_server(
        tiny_model_dir,
        addfinalizer=request.addfinalizer,
        overrides={"step_max_tokens": 2, "allow_http": True, "allow_private_networks": True, "torch_threads": 1},
        model_config_overrides={"batchSize": 8, "maxNumSequence": 8},
    )


@pytest.fixture(scope="module")
def client(server):
    with SessionClient.from_url(server.url, timeout=(5.0, 60.0)) as c:
        yield c


@pytest.fixture(scope="module")
def photo_path(tmp_path_factory, photos) -> str:
    path = tmp_path_factory.mktemp("img") / "astronaut.jpg"
    Image.open(io.BytesIO(photos["astronaut"])).convert("RGB").save(path, format="JPEG", quality=90)
    return str(path)


def raw_post(server, body, session_id):
    return requests.post(server.url + "/invocations", data=json.dumps(body), headers={SID: session_id}, timeout=30)


def test_session_lifecycle(client, server, photo_path):
    with client.open_session(photo_path) as session:
        assert session.id.startswith("ts-seq-") and session.image_tokens == 576
        left_s = (session.expires_at - datetime.now(timezone.utc)).total_seconds()
        assert session.expires_at.tzinfo is not None and 1100 < left_s <= 1200  # the TTL of model-config.yaml

        first = session.ask("What is in this image?", details=True, **GREEDY)
        assert first.finish_reason in ("stop", "length") and 1 <= first.usage.generated_tokens <= 8
        assert first.usage.cached_tokens > 500 and first.usage.prompt_tokens > first.usage.cached_tokens
        assert "".join(t.text for t in first.tokens) == first.text and len(first.tokens) == first.usage.generated_tokens
        assert {"ttft_ms", "prefill_ms", "total_ms"} <= set(first.timings) and first.ttft_ms is not None
        assert first.client_ttft_ms == first.client_total_ms > 0

        with session.stream("What color is it?", **GREEDY) as stream:
            pieces = list(stream)
        second = stream.answer
        assert second is not None and "".join(pieces) == second.text == stream.text
        assert len(second.tokens) == second.usage.generated_tokens
        assert second.usage.cached_tokens >= first.usage.prompt_tokens  # the first turn was reused
        assert 0 < second.client_ttft_ms <= second.client_total_ms

        aside = session.ask("Is it daytime?", remember=False, max_new_tokens=4)
        assert aside.usage.generated_tokens <= 4
        assert [p for p, _ in session.history] == ["What is in this image?", "What color is it?"]
        assert [a for _, a in session.history] == [first, second]

        session.reset()
        assert session.history == []
        again = session.ask("What is in this image?", details=True, **GREEDY)
        assert again.text == first.text  # greedy, and the history is really gone on the server
        sid = session.id
    assert session.closed
    session.close()  # idempotent
    with pytest.raises(LlavaError, match="closed"):
        session.ask("Hello?")
    r = raw_post(server, {"type": "generate", "prompt": "Hi"}, sid)
    assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"


def test_ask_n_answers_gives_every_choice_and_remembers_the_chosen_one(client, photo_path):
    sampled = {"max_new_tokens": 6, "temperature": 2.0}
    with client.open_session(photo_path) as session:
        alone = [session.ask("What is it?", remember=False, seed=5 + i, **sampled).text for i in range(3)]
        answer = session.ask("What is it?", n=3, session_choice=1, seed=5, **sampled)
        assert [c.text for c in answer.choices] == alone and [c.seed for c in answer.choices] == [5, 6, 7]
        assert answer.text == alone[1] and session.history == [("What is it?", answer)]
        again = session.ask("And then?", max_new_tokens=4)
        assert again.usage.cached_tokens >= answer.usage.prompt_tokens  # the session kept its KV


def test_stream_equals_plain_answer_and_arrives_in_pieces(client, photos):
    with client.open_session(photos["chelsea"]) as session:  # bytes
        q = "Describe the image in detail."
        plain = session.ask(q, remember=False, max_new_tokens=16)
        with session.stream(q, remember=False, max_new_tokens=16) as stream:
            stamps, pieces = [], []
            for piece in stream:
                stamps.append(time.perf_counter())
                pieces.append(piece)
        assert "".join(pieces) == plain.text == stream.answer.text
        assert stream.answer.usage.generated_tokens == plain.usage.generated_tokens == len(stream.answer.tokens)
        assert len(pieces) >= 3 and stamps[-1] > stamps[0]  # several pieces, not one block at the end
        assert session.history == []


def _established_to(port: int) -> set[int]:
    """Local ports of this process's open TCP connections to ``port``."""
    return {
        c.laddr.port
        for c in psutil.Process().net_connections(kind="tcp")
        if c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED
    }


def test_early_break_closes_the_response(server, photos):
    port = int(server.url.rsplit(":", 1)[1])
    others = _established_to(port)  # idle keep-alive connections of the module's client
    with SessionClient.from_url(server.url, timeout=(5.0, 60.0)) as client:
        session = client.open_session(Image.open(io.BytesIO(photos["rocket"])))  # a PIL image
        with session.stream("Describe the image in detail.", max_new_tokens=8) as stream:
            first = next(stream)
            assert first and _established_to(port) - others  # the response is open
        assert stream.answer is None and session.history == []  # abandoned, not remembered
        assert _established_to(port) - others == set()  # leaving the block closed the connection
        with pytest.raises(StopIteration):
            next(stream)
        # TorchServe dropped the job on disconnect; the handler drops it with the session's next
        # request (test_session_is_usable_after_an_early_break).


def test_session_is_usable_after_an_early_break(server, photos):
    with SessionClient.from_url(server.url, timeout=(5.0, 60.0)) as client:
        session = client.open_session(photos["rocket"])
        with session.stream("Describe the image in detail.", max_new_tokens=8) as stream:
            next(stream)
        # a call that finds the session still busy (409) is retried with backoff (about 1.5 s)
        assert session.ask("What is in this image?", max_new_tokens=4).usage.generated_tokens >= 1
        session.close()


def test_a_stream_that_ends_in_its_first_step_arrives(server, photos):
    with (
        SessionClient.from_url(server.url, timeout=(5.0, 3.0), max_retries=0) as client,
        client.open_session(photos["coffee"]) as session,
    ):
        with session.stream("What is in this image?", remember=False, max_new_tokens=1) as stream:
            list(stream)
        assert stream.answer.usage.generated_tokens == 1


def test_errors_are_typed(client, photo_path):
    with client.open_session(photo_path) as session:
        with pytest.raises(InvalidRequest) as info:
            session.ask("x", top_p=0)
        assert info.value.status_code == 400 and info.value.code == "invalid_parameter"
        assert "top_p" in info.value.message
        with pytest.raises(ContextLengthExceeded) as info:
            session.ask("x", max_new_tokens=1024)
        assert info.value.status_code == 422 and info.value.code == "context_length_exceeded"
        assert session.ask("Still here?", max_new_tokens=2).usage.generated_tokens >= 1  # errors left it intact
    with pytest.raises(InvalidRequest) as info:
        client.open_session(b"not an image")
    assert info.value.code == "image_invalid"


def test_unknown_session_raises_session_not_found_without_recovery(server, photo_path):
    with SessionClient.from_url(server.url, auto_recover=False) as client:
        session = client.open_session(photo_path)
        raw_post(server, {"type": "close_session"}, session.id)  # closed behind the client's back
        with pytest.raises(SessionNotFound) as info:
            session.ask("Hello?", max_new_tokens=2)
        assert info.value.status_code == 404 and info.value.code == "session_not_found"
        assert session.recoveries == 0
        session.close()  # a session already gone counts as closed
        assert session.closed


def test_payload_too_large_is_refused_before_sending(client):
    blob = os.urandom(4_800_000)  # 6.4 MB once base64-encoded
    with pytest.raises(PayloadTooLarge) as info:
        client.open_session(blob)
    assert info.value.status_code == 413 and "s3://" in info.value.message and "before sending" in info.value.message


def test_image_by_url(client, photos):
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(photos["coffee"])))
            self.end_headers()
            self.wfile.write(photos["coffee"])

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}/coffee.png"
        with client.open_session(url) as by_url, client.open_session(photos["coffee"]) as inline:
            q = "What is in this image?"
            assert by_url.ask(q, **GREEDY).text == inline.ask(q, **GREEDY).text
    finally:
        httpd.shutdown()


def test_recovery_replays_history_exactly_with_greedy_answers(client, server, photo_path, caplog):
    turns = ["What is in this image?", "What color is it?", "Describe it in one word."]
    with client.open_session(photo_path) as session, client.open_session(photo_path) as twin:
        for q in turns[:2]:
            session.ask(q, **GREEDY)
            twin.ask(q, **GREEDY)
        before = session.history
        old_id = session.id
        assert raw_post(server, {"type": "close_session"}, old_id).status_code == 200  # dropped behind its back
        with caplog.at_level(logging.WARNING, logger="llava_client"):
            answer = session.ask(turns[2], **GREEDY)
        assert session.recoveries == 1 and session.id != old_id
        assert session.history[:2] == before  # same turns, same answer objects
        recovery = session.last_recovery
        assert recovery.replayed_turns == 2 and recovery.old_session_id == old_id
        assert "restored as" in caplog.text
        expected = twin.ask(turns[2], **GREEDY)
        assert answer.text == expected.text
        assert answer.usage.prompt_tokens == expected.usage.prompt_tokens


def test_recovery_of_a_stream_and_of_a_reset(client, server, photo_path):
    with client.open_session(photo_path) as session:
        session.ask("What is in this image?", **GREEDY)
        raw_post(server, {"type": "close_session"}, session.id)
        with session.stream("What color is it?", **GREEDY) as stream:
            text = "".join(stream)
        assert session.recoveries == 1 and text == stream.answer.text and len(session.history) == 2
        raw_post(server, {"type": "close_session"}, session.id)
        session.reset()  # gone: reopened with an empty history, nothing replayed
        assert session.recoveries == 2 and session.history == [] and session.last_recovery.replayed_turns == 0
        assert session.ask("Hello?", max_new_tokens=2).usage.generated_tokens >= 1


def test_connection_refused_and_timeouts(caplog):
    """Each case is told by the retries the client logs (one INFO line per retry), not by a clock:
    lower bounds only check that a window or a timeout was waited out."""

    def retries() -> int:
        return sum(r.getMessage().startswith("retrying ") for r in caplog.records)

    caplog.set_level(logging.INFO, logger="llava_client")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again: nothing listens here
    refused = SessionClient(HttpTransport(f"http://127.0.0.1:{port}"), max_retries=0, restart_wait_s=0)
    with pytest.raises(APIConnectionError) as info:
        refused.open_session(b"x")
    assert not isinstance(info.value, APITimeoutError) and info.value.request_sent is False
    assert retries() == 0
    # a server that never answered (a wrong port): no restart window, the error names the URL at once
    patient = SessionClient(HttpTransport(f"http://127.0.0.1:{port}"), max_retries=0, restart_wait_s=1.5)
    with pytest.raises(APIConnectionError) as info:
        patient.open_session(b"x")
    assert retries() == 0 and f"127.0.0.1:{port}" in str(info.value)
    # one that answered before and now refuses (a restart): retried through the window, then raised
    reached = _answering_server(port)
    with pytest.raises(InvalidRequest):  # an answer (400): the client has reached the server
        patient.open_session(b"x")
    reached.shutdown()
    reached.server_close()
    t0 = time.monotonic()
    with pytest.raises(APIConnectionError):
        patient.open_session(b"x")
    assert time.monotonic() - t0 >= 1.5 and retries() >= 2  # the window waited out, in several retries

    with socket.socket() as silent:  # accepts connections, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(4)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        client = SessionClient(HttpTransport(url, timeout=(2.0, 0.3)), max_retries=1)
        before = retries()
        t0 = time.monotonic()
        with pytest.raises(APITimeoutError) as info:
            client.open_session(b"x")
        elapsed = time.monotonic() - t0
        assert info.value.request_sent is True
        assert retries() - before == 1 and elapsed >= 0.6  # two attempts of 0.3 s (max_retries=1)


def _answering_server(port: int):
    """An HTTP server on ``port`` that answers every POST with 400 (a reply, so the client has reached it)."""
    import http.server
    import threading

    class Answer(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            body = b'{"error": {"code": "invalid_request", "message": "no"}}'
            self.send_response(400)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _llava_chat(*args, stdin=""):
    import subprocess
    import sys

    return subprocess.run(
        [sys.executable, "-m", "llava_client.cli", *args], input=stdin, capture_output=True, text=True, timeout=120
    )


def test_llava_chat_single_question_and_piped_questions(server, photo_path):
    done = _llava_chat(
        "--url", server.url, "--image", photo_path, "-q", "What is in this image?", "--max-new-tokens", "6", "--verbose"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() and done.stdout.count("\n") >= 1
    assert "time to first token" in done.stderr
    reused = re.search(r"reused (\d+) of (\d+)", done.stderr)
    assert reused and 576 < int(reused.group(1)) < int(reused.group(2))  # the prefix (image) came from the cache

    questions = "What is in this image?\nWhat color?\n/reset\nWhat is in this image?\n/quit\nnever asked\n"
    done = _llava_chat(
        "--url", server.url, "--image", photo_path, "--max-new-tokens", "4", "--temperature", "0", "-v", stdin=questions
    )
    assert done.returncode == 0, done.stderr
    stats = [line for line in done.stderr.splitlines() if line.startswith("[time to first token")]
    assert len(stats) == 3 and "conversation forgotten" in done.stderr and done.stdout.strip()
    prompt_tokens = [int(line.split(" of ")[1].split()[0]) for line in stats]
    assert prompt_tokens[2] == prompt_tokens[0] < prompt_tokens[1]  # /reset really forgot the first turn

    done = _llava_chat("--url", server.url, "--image", photo_path + ".missing", "-q", "x")
    assert done.returncode == 1 and "could not open a session" in done.stderr


def test_truncation_keeps_the_client_history_equal_to_the_server_one(client, server, photo_path):
    """A chat that outgrows the tiny model's 1,024 positions: the server drops the oldest turns, the
    client drops the same ones, and a recovery then restores exactly what the model had seen."""
    long = {"max_new_tokens": 180}
    with client.open_session(photo_path) as session, client.open_session(photo_path) as twin:
        truncated = 0
        for i in range(4):
            q = f"Tell me about part {i} of the image."
            a = session.ask(q, **long)
            b = twin.ask(q, **long)
            assert a.text == b.text and a.truncated_turns == b.truncated_turns
            truncated += a.truncated_turns
            assert a.max_new_tokens == 180
        assert truncated >= 1 and len(session.history) == 4 - truncated
        with pytest.raises(ContextLengthExceeded):  # the same turn under the error policy
            session.ask("One more?", context_policy="error", **long)
        assert raw_post(server, {"type": "close_session"}, session.id).status_code == 200  # lost behind its back
        recovered = session.ask("And in one word?", remember=False, **GREEDY)
        assert session.recoveries == 1 and session.last_recovery.replayed_turns == len(session.history)
        expected = twin.ask("And in one word?", remember=False, **GREEDY)
        assert recovered.text == expected.text and recovered.usage.prompt_tokens == expected.usage.prompt_tokens


def test_llava_chat_says_when_the_oldest_turns_left_the_context(server, photo_path):
    questions = "".join(f"Tell me about part {i} of the image.\n" for i in range(4))
    done = _llava_chat("--url", server.url, "--image", photo_path, "--max-new-tokens", "180", stdin=questions)
    assert done.returncode == 0, done.stderr
    assert re.search(r"\[context full: the \d+ oldest turns? left the conversation", done.stderr), done.stderr


def _generated_tokens(server) -> float:
    """The worker's ``llava_GeneratedTokens`` counter (Prometheus text of TorchServe's metrics port),
    once settled: two reads 1.3 s apart agree (the handler writes metric lines after the reply, at
    most once per ``metrics_interval_ms``, 1 s by default)."""

    def read() -> float:
        text = requests.get(server.metrics_url + "/metrics", timeout=10).text
        found = re.search(r"^llava_GeneratedTokens\{[^}]*\} ([0-9.e+-]+)$", text, re.M)
        return float(found.group(1)) if found else 0.0

    value = read()
    for _ in range(10):
        time.sleep(1.3)
        again = read()
        if again == value:
            break
        value = again
    return value


def _ask_once_free(session, question: str, timeout_s: float = 30.0):
    """Ask ``question`` (2 tokens) as soon as the session is free: the server learns of a dropped
    stream only when its next frame fails to reach the client, so the session may still be answering
    (``SessionBusy``) for a step or two. A session waited out here shows in the token count instead."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return session.ask(question, max_new_tokens=2)
        except SessionBusy:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def test_a_dropped_stream_stops_decoding_within_a_step_and_leaves_no_turn(server, photos):
    """TorchServe stops polling the job of a closed connection, so its answer is not decoded further;
    the session's next request drops it and the history has none of that turn."""
    with SessionClient.from_url(server.url, timeout=(5.0, 60.0)) as client:
        fresh = client.open_session(photos["chelsea"])
        first_prompt_tokens = fresh.ask("What is in this image?", max_new_tokens=2, remember=False).usage.prompt_tokens
        fresh.close()
        session = client.open_session(photos["chelsea"])
        before = _generated_tokens(server)
        with session.stream("Describe the image in great detail.", max_new_tokens=400) as stream:
            next(stream)
            next(stream)
        answer = _ask_once_free(session, "What is in this image?")
        generated = _generated_tokens(server) - before
        assert generated >= 4  # the counter counts: two streamed pieces and the 2-token answer at least
        assert generated < 40, f"{generated} tokens were generated: the abandoned answer kept decoding"
        assert answer.usage.prompt_tokens == first_prompt_tokens  # the abandoned turn is not in the history
        assert len(session.history) == 1
        session.close()


def test_bodies_over_our_limit_get_typed_413s_the_client_raises_as_payload_too_large(server):
    """Over SageMaker's 6 MiB limit, just over it and past TorchServe's old 6,553,600: the handler's
    typed 413 each time, raised by the client as PayloadTooLarge."""
    client = SessionClient.from_url(server.url, max_retries=0, max_body_bytes=32 << 20)
    for size in (4_750_000, 5_300_000):  # about 6.33 MB and 7.07 MB of JSON once base64-encoded
        with pytest.raises(PayloadTooLarge) as info:
            client.open_session(os.urandom(size))
        assert info.value.status_code == 413 and info.value.code == "payload_too_large", info.value.body
        assert "6,291,456-byte limit" in str(info.value)
    client.close()


def test_llava_chat_at_a_terminal_recovers_from_an_error_and_exits_0(server, photo_path):
    """llava-chat with a terminal on stdin (a pty): /help, an error it shows and goes on from, a
    question, /quit: exit status 0 (piped input that runs out still gets 1 after an error: a script's
    failure)."""
    import os
    import pty
    import subprocess
    import sys

    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "llava_client.cli", "--url", server.url, "--image", photo_path, "--max-new-tokens", "3"],
        stdin=slave,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    os.close(slave)
    os.write(master, b"/help\n/add /no/such/image.png\nWhat is it?\n/quit\n")
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        os.close(master)
        stop_process(proc, 10)  # no-op once it exited; ended, with anything it started, if it did not
    assert proc.returncode == 0, err
    assert "/help, /quit" in err and "error:" in err and "No such file" in err
    assert "llava> " in out
    piped = _llava_chat("--url", server.url, "--image", photo_path, stdin="/add /no/such/image.png\n")
    assert piped.returncode == 1 and "error:" in piped.stderr
    # ...unless it ends with a clean /quit (issue 60 item 6: the user ended the chat)
    quit_ = _llava_chat("--url", server.url, "--image", photo_path, stdin="/add /no/such/image.png\n/quit\n")
    assert quit_.returncode == 0 and "error:" in quit_.stderr


# ---- the chat dialect's stream object and a lost chat session (issue 32 item 7) -------------------


def _chat_messages(photos) -> list[dict]:
    from llava_client import image_part

    return [{"role": "user", "content": [image_part(photos["coffee"]), {"type": "text", "text": "What is this?"}]}]


def test_a_chat_stream_is_events_then_its_end_and_closes_when_left_early(client, server, photos):
    from llava_client import ChatStream

    messages = _chat_messages(photos)
    whole = client.complete(messages, max_tokens=12, temperature=0)
    with client.stream_chat(messages, max_tokens=12, temperature=0) as stream:
        assert isinstance(stream, ChatStream)
        events = list(stream)
    assert [e.text for e in events[:-1]] and all(e.text and e.finish_reason is None for e in events[:-1])
    end = events[-1]
    assert (end.text, end.finish_reason) == ("", whole.finish_reason) and stream.text == whole.text
    assert end.usage == stream.usage and end.usage.completion_tokens == whole.completion_tokens
    assert end.usage.prompt_tokens == whole.prompt_tokens
    port = int(server.url.rsplit(":", 1)[1])
    others = _established_to(port)  # idle keep-alive connections of the module's client
    with SessionClient.from_url(server.url, timeout=(5.0, 60.0)) as fresh, fresh.chat_session() as chat:
        with chat.stream(messages, max_tokens=200, temperature=0, ignore_eos=True) as early:
            assert next(early).text and _established_to(port) - others  # the response is open
        assert _established_to(port) - others == set() and not early.done
        with pytest.raises(LlavaError):
            early.until_done()
        # the session answers again once the server dropped the abandoned answer (409s are retried)
        assert chat.complete(messages, max_tokens=4, temperature=0).completion_tokens == 4


def test_a_chat_session_the_server_lost_is_reopened_and_the_conversation_resent_once(client, server, photos, caplog):
    messages = _chat_messages(photos)
    with client.chat_session() as chat:
        first = chat.complete(messages, max_tokens=6, temperature=0)
        for call in ("complete", "stream"):
            old_id = chat.session_id
            assert raw_post(server, {"requestType": "CLOSE"}, old_id).status_code == 200  # behind its back
            with caplog.at_level(logging.WARNING, logger="llava_client"):
                caplog.clear()
                if call == "complete":
                    text = chat.complete(messages, max_tokens=6, temperature=0).text
                else:
                    text = chat.stream(messages, max_tokens=6, temperature=0).until_done()
            assert chat.session_id != old_id and text == first.text  # the same greedy answer, resent
            assert f"chat session {old_id} is gone" in caplog.text and chat.session_id in caplog.text
