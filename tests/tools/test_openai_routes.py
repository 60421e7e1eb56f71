"""OpenAI's routes, driven by the ``openai`` package itself: ``llava-serve``'s ``/v1`` and the local
SageMaker endpoint's ``/endpoints/<name>/openai/v1``, a real TorchServe behind each (tiny model, CPU).

Every reply is validated with the package's own models (``ChatCompletion``, ``ChatCompletionChunk``,
``Model``) from the raw JSON, and answers are compared with ``model.generate`` from scratch.
"""

from __future__ import annotations

import base64
import json

import openai
import pytest
import requests
from openai.types import Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from server_fixtures import start_local_server
from test_chat_engine import reference

N = 8


@pytest.fixture(scope="module")
def server(request, tiny_model_dir):
    overrides = {"served_model_name": ["llava", "llava-1.5-7b-hf"]}  # vLLM's served names, with an alias
    return start_local_server(
        tiny_model_dir, addfinalizer=request.addfinalizer, startup_timeout_s=120, overrides=overrides
    )


@pytest.fixture(scope="module")
def local_endpoint(request, tiny_model_dir):
    """Two backends with SageMaker's PREFIX_AWARE routing. While no session is open, every request
    without one goes to backend 0 (least loaded, ties to the lowest index) or where its prefix went:
    the tests before the last keep it that way."""
    from llava_tools.local_endpoint import LocalEndpoint

    ep = LocalEndpoint(tiny_model_dir, backends=2, endpoint_name="llava", routing="prefix-aware", startup_timeout_s=120)
    request.addfinalizer(ep.stop)
    return ep.start()


def data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def text_of(llava, ids: list[int]) -> str:
    return llava.tokenizer.decode(ids, skip_special_tokens=True)


def clients(server, local_endpoint) -> dict[str, openai.OpenAI]:
    return {
        "llava-serve": openai.OpenAI(base_url=server.openai_base_url, api_key="unused", max_retries=0),
        "local endpoint": openai.OpenAI(
            base_url=f"{local_endpoint.url}/endpoints/llava/openai/v1", api_key="unused", max_retries=0
        ),
    }


def create(client: openai.OpenAI, **kw) -> ChatCompletion:
    """A completion, validated from the raw JSON by the package's own model."""
    raw = client.chat.completions.with_raw_response.create(model="llava", **{"temperature": 0, "max_tokens": N, **kw})
    return ChatCompletion.model_validate(json.loads(raw.http_response.text))


def stream_chunks(client: openai.OpenAI, messages: list[dict], **kw) -> list[ChatCompletionChunk]:
    """A streamed completion's chunks, as the package's stream reader gives them."""
    return list(client.chat.completions.create(model="llava", messages=messages, stream=True, **kw))


def test_models_lists_the_served_model(server, tiny_model_dir):
    client = openai.OpenAI(base_url=server.openai_base_url, api_key="unused", max_retries=0)
    models = client.models.list().data
    assert [Model.model_validate(m.to_dict()).id for m in models] == ["llava", "llava-1.5-7b-hf"]
    assert client.models.retrieve("llava-1.5-7b-hf").id == "llava-1.5-7b-hf"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-5")


def test_an_unknown_model_is_vllms_404_and_invocations_take_any_name(server):
    """Issue 45 item 5, as vLLM: on ``/v1`` a model the server does not serve is ``404
    model_not_found`` (a misconfigured client notices); each ``served_model_name`` alias is served
    and its reply carries it; ``/invocations`` answers whatever ``model`` a SageMaker client sends."""
    client = openai.OpenAI(base_url=server.openai_base_url, api_key="unused", max_retries=0)
    chat = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.NotFoundError) as raised:
        client.chat.completions.create(model="gpt-4o", messages=chat, max_tokens=2)
    assert raised.value.code == "model_not_found" and raised.value.body["param"] == "model"
    assert "gpt-4o" in raised.value.message and "`llava`" in raised.value.message
    for name in ("llava", "llava-1.5-7b-hf"):
        assert client.chat.completions.create(model=name, messages=chat, max_tokens=2).model == name
    anywhere = requests.post(
        server.url + "/invocations", json={"model": "gpt-4o", "messages": chat, "max_tokens": 2}, timeout=60
    )
    assert anywhere.status_code == 200 and anywhere.json()["model"] == "llava"


def test_v1_errors_and_replies_are_openais_alone(server):
    """A body that is not JSON on ``/v1`` gets OpenAI's whole error object (``type``, ``param``, ``code``,
    ``message``), and a non-streamed reply carries none of TorchServe's own headers."""
    r = requests.post(server.url + "/v1/chat/completions", data=b"{not json", timeout=60)
    error = r.json()["error"]
    assert r.status_code == 400 and set(error) == {"message", "type", "param", "code"}, r.text
    assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_request")
    reply = requests.post(
        server.url + "/v1/chat/completions",
        json={"model": "llava", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        timeout=60,
    )
    assert reply.status_code == 200 and reply.json()["object"] == "chat.completion"
    internal = {"ts_stream_next", "pragma", "cache-control", "expires"}
    assert not internal & {name.lower() for name in reply.headers}, dict(reply.headers)


def test_plain_image_and_streamed_turns_through_the_openai_package(server, local_endpoint, llava, photos):
    cat = photos["chelsea"]
    want = text_of(llava, reference(llava, None, [], "What is it?", [cat])[:N])
    for where, client in clients(server, local_endpoint).items():
        messages = [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": data_uri(cat)}, "uuid": "cat"},
                    {"type": "text", "text": "What is it?"},
                ],
            }
        ]
        first = create(client, messages=messages, extra_body={"cache_salt": where})
        assert first.choices[0].message.content == want, where
        assert first.usage is not None and first.usage.prompt_tokens_details is not None
        chunks = stream_chunks(client, messages, temperature=0, max_tokens=N, stream_options={"include_usage": True})
        for chunk in chunks:
            ChatCompletionChunk.model_validate(chunk.to_dict())
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want, where
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1
        # the next turn resent without a session, the image named by its uuid alone
        follow = [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": None, "uuid": "cat"},
                    {"type": "text", "text": "What is it?"},
                ],
            },
            {"role": "assistant", "content": want},
            {"role": "user", "content": "And its colour?"},
        ]
        second = create(client, messages=follow, extra_body={"cache_salt": where})
        assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens, where
        turns = [("What is it?", want, [cat])]
        assert second.choices[0].message.content == text_of(
            llava, reference(llava, None, turns, "And its colour?", [])[:N]
        )


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk_as_vllm_does(server, photos):
    """``stream_options.continuous_usage_stats`` (vLLM's, with ``include_usage``): every chunk carries
    ``usage`` with the tokens generated so far; without it only the last chunk does."""
    client = openai.OpenAI(base_url=server.openai_base_url, api_key="unused", max_retries=0)
    content = [{"type": "image_url", "image_url": {"url": data_uri(photos["coffee"])}}, {"type": "text", "text": "Hi"}]
    messages = [{"role": "user", "content": content}]
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = stream_chunks(client, messages, max_tokens=12, stream_options=options, extra_body={"min_tokens": 12})
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk.to_dict())
    assert all(c.usage is not None for c in chunks)
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counts == sorted(counts) and counts[-1] == 12 and len(set(counts)) > 2
    # no chunk before the first token (the role goes with it), and every chunk brings tokens, their text
    # empty or not (the last may only end the answer)
    assert counts[0] == 1 and [c for c in chunks if c.choices][0].choices[0].delta.role == "assistant"
    assert all(a < b for a, b in zip(counts[:-2], counts[1:-1], strict=True))
    prompt = {c.usage.prompt_tokens for c in chunks}
    assert len(prompt) == 1 and chunks[-1].usage.total_tokens == prompt.pop() + 12
    chunks = stream_chunks(client, messages, max_tokens=4, stream_options={"include_usage": True})
    assert chunks[-1].usage is not None and all(c.usage is None for c in chunks[:-1])


def test_a_stream_names_its_charset_so_requests_reads_it_as_utf_8(server, photos):
    """Server-sent events are ``text/*``: without a charset ``requests`` decodes them as ISO-8859-1 (RFC
    2616's default) and a stateless client resends "naÃ¯ve" for "naïve"; vLLM names utf-8, and so do we."""
    content = [
        {"type": "image_url", "image_url": {"url": data_uri(photos["coffee"])}},
        {"type": "text", "text": "naïve?"},
    ]
    body = {"model": "llava", "messages": [{"role": "user", "content": content}], "max_tokens": 3, "stream": True}
    with requests.post(f"{server.openai_base_url}/chat/completions", json=body, stream=True, timeout=60) as reply:
        assert reply.status_code == 200 and reply.headers["Content-Type"] == "text/event-stream; charset=utf-8"
        assert reply.encoding == "utf-8"
        events = [line for line in reply.iter_lines(decode_unicode=True) if line]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)


def test_n_choices_through_the_openai_package_each_equal_to_its_seed_alone(server, llava, photos):
    """``n`` (OpenAI's and vLLM's): the prompt is prefilled once and each choice ``i`` of a request
    seeded ``s`` is the answer of the same request alone with seed ``s + i``; a stream interleaves
    the choices by index and ends each with its ``finish_reason``; ``usage`` counts every choice's
    tokens; greedy choices are all the reference answer."""
    client = openai.OpenAI(base_url=server.openai_base_url, api_key="unused", max_retries=0)
    content = [{"type": "image_url", "image_url": {"url": data_uri(photos["rocket"])}}, {"type": "text", "text": "Hi"}]
    messages = [{"role": "user", "content": content}]
    sampled = {"temperature": 2.0, "max_tokens": 10}
    many = create(client, messages=messages, n=3, seed=41, **sampled)
    assert [c.index for c in many.choices] == [0, 1, 2]
    singles = [create(client, messages=messages, seed=41 + i, **sampled) for i in range(3)]
    alone = [one.choices[0].message.content for one in singles]
    assert [c.message.content for c in many.choices] == alone
    assert many.usage.completion_tokens == sum(one.usage.completion_tokens for one in singles)
    assert many.usage.prompt_tokens == singles[0].usage.prompt_tokens
    chunks = stream_chunks(client, messages, n=3, seed=41, stream_options={"include_usage": True}, **sampled)
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk.to_dict())
    texts, reasons = ["", "", ""], [None, None, None]
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            assert reasons[choice.index] is None, "nothing follows a choice's finish_reason"
            reasons[choice.index] = choice.finish_reason
    assert texts == alone and all(reasons)
    assert chunks[-1].usage.completion_tokens == many.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == many.usage.prompt_tokens
    want = text_of(llava, reference(llava, None, [], "Hi", [photos["rocket"]])[:N])
    greedy = create(client, messages=messages, n=4)
    assert [c.message.content for c in greedy.choices] == [want] * 4


def test_a_session_closed_while_it_streams_ends_the_openai_package_s_stream_with_abort(server, photos):
    """vLLM's ``finish_reason`` for a stopped request, ``abort``, is past the package's Literal; its
    stream reader passes it through (it builds chunks without validating), so a client reads the
    aborted stream to its end. The close is AWS's body on the same session."""
    sid_header = "X-Amzn-SageMaker-Session-Id"
    opened = requests.post(
        server.url + "/invocations",
        json={"requestType": "NEW_SESSION"},
        headers={sid_header: "NEW_SESSION"},
        timeout=60,
    )
    sid = opened.json()["session_id"]
    client = openai.OpenAI(base_url=server.openai_base_url, api_key="unused", max_retries=0)
    content = [{"type": "image_url", "image_url": {"url": data_uri(photos["coffee"])}}, {"type": "text", "text": "Hi"}]
    chunks = client.chat.completions.create(
        model="llava",
        messages=[{"role": "user", "content": content}],
        max_tokens=300,
        stream=True,
        extra_body={"ignore_eos": True},
        extra_headers={sid_header: sid},
    )
    first = next(iter(chunks))  # the answer is streaming
    closed = requests.post(
        server.url + "/invocations", json={"requestType": "CLOSE"}, headers={sid_header: sid}, timeout=60
    )
    assert closed.status_code == 200 and closed.headers["X-Amzn-SageMaker-Closed-Session-Id"] == sid
    rest = list(chunks)
    assert isinstance(first, ChatCompletionChunk) and all(isinstance(c, ChatCompletionChunk) for c in rest)
    reasons = [c.choices[0].finish_reason for c in (first, *rest) if c.choices]
    assert reasons[-1] == "abort" and reasons.count("abort") == 1


def test_errors_are_the_packages_exceptions(server, local_endpoint):
    for where, client in clients(server, local_endpoint).items():
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="llava", messages=[{"role": "user", "content": "hi"}], max_tokens=0)
        assert err.value.status_code == 400, where
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(
                model="llava",
                messages=[{"role": "user", "content": [{"type": "image_url", "image_url": None, "uuid": "nobody"}]}],
            )
        assert err.value.code == "image_uuid_not_found", where
        # a conversation too long for the context: OpenAI's and vLLM's 400 context_length_exceeded
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(
                model="llava", messages=[{"role": "user", "content": "hi " * 200}], max_tokens=1000
            )
        assert err.value.status_code == 400 and err.value.code == "context_length_exceeded", where
        assert err.value.body["type"] == "invalid_request_error"


def test_a_base_url_without_v1_is_told_to_add_it_and_our_client_told_to_drop_it(server):
    """The openai package pointed at the server's root asks for /chat/completions: an OpenAI 404 says
    the base_url ends in /v1 (not TorchServe's bare "Requested resource is not found"); llava-chat
    given the /v1 URL is told the server's own."""
    import subprocess
    import sys
    from pathlib import Path

    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="llava", messages=[{"role": "user", "content": "hi"}])
    assert "an OpenAI base_url ends in /v1 (this path is /v1/chat/completions)" in str(err.value)
    with pytest.raises(openai.NotFoundError, match="ends in /v1"):
        client.models.list()
    chat = subprocess.run(
        [str(Path(sys.executable).parent / "llava-chat"), "--url", server.openai_base_url, "--image", "x.jpg"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert chat.returncode == 2 and f"give the server's own: {server.url}" in chat.stderr
    assert "use POST /v1/chat/completions" not in chat.stderr


def test_torchserve_paths_still_answer_through_the_front(server):
    import requests

    assert requests.get(server.url + "/ping", timeout=10).json()["status"] == "Healthy"
    reply = requests.post(server.url + "/invocations", json={"type": "generate", "prompt": "hi"}, timeout=30)
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "missing_session_id"
    assert requests.post(server.url + "/v1/completions", json={}, timeout=10).status_code == 404
    # only POST /v1/chat/completions itself is relayed as a chat turn: a path that merely begins with
    # "/v1" goes to TorchServe as it is, which serves no such route
    chat = {"model": "llava", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    stray = requests.post(server.url + "/v1chat/completions", json=chat, timeout=30)
    assert stray.status_code == 404, stray.text


def test_our_client_resends_without_a_session_and_sends_each_image_once(server, local_endpoint, llava, photos):
    from llava_client import SessionClient
    from test_local_endpoint import runtime_client

    cat = photos["chelsea"]
    greedy = {"max_tokens": N, "temperature": 0}
    clients = {
        "http": SessionClient.from_url(server.url),
        "sagemaker": SessionClient.from_endpoint(
            "llava", client=runtime_client(local_endpoint.url), prefix_aware_id="app-1"
        ),
    }
    for where, client in clients.items():
        chat = client.conversation(cache_salt=f"client-{where}")
        first = chat.ask("What is it?", images=[cat], **greedy)
        with_bytes = chat.last_request_bytes
        second = chat.ask("And its colour?", **greedy)
        assert chat.last_request_bytes < 2_000 < with_bytes, where  # the image went as its uuid
        turns = [("What is it?", first.text, [cat])]
        assert second.text == text_of(llava, reference(llava, None, turns, "And its colour?", [])[:N]), where
        assert second.cached_tokens >= first.prompt_tokens, where
        third = "".join(chat.ask_stream("Where is it?", **greedy))
        turns.append(("And its colour?", second.text, []))
        assert third == text_of(llava, reference(llava, None, turns, "Where is it?", [])[:N]), where
        assert chat.messages[-1] == {"role": "assistant", "content": third}
        # under another salt the server holds no image of this conversation: the turn is sent once
        # more with the image's bytes, and answered
        chat.cache_salt = f"client-{where}-moved"
        fourth = chat.ask("Is it indoors?", **greedy)
        assert chat.last_request_bytes > with_bytes / 2 and fourth.cached_tokens == 0, where
        turns.append(("Where is it?", third, []))
        assert fourth.text == text_of(llava, reference(llava, None, turns, "Is it indoors?", [])[:N]), where
        # the same in a session: the image's bytes once, then its uuid (the session remembers it)
        with client.chat_session() as session:
            in_session = client.conversation(session=session)
            opened = in_session.ask("What is it?", images=[cat], **greedy)
            assert opened.text == first.text, where
            follow = in_session.ask("And its colour?", **greedy)
            assert in_session.last_request_bytes < 2_000 and follow.text == second.text, where
            assert follow.cached_tokens >= opened.prompt_tokens, where


def test_prefix_aware_id_is_botocores_own_parameter():
    import boto3
    from botocore.stub import Stubber

    from llava_client import SageMakerTransport

    runtime = boto3.client(
        "sagemaker-runtime", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x"
    )
    transport = SageMakerTransport("llava", client=runtime, prefix_aware_id="app-1")
    with Stubber(runtime) as stub:  # the stub validates the parameters against botocore's model
        stub.add_response(
            "invoke_endpoint",
            {"Body": _streaming_body(b"{}"), "ContentType": "application/json"},
            {
                "EndpointName": "llava",
                "Body": b"{}",
                "ContentType": "application/json",
                "Accept": "application/json",
                "PrefixAwareId": "app-1",
            },
        )
        transport.invoke(b"{}", session_id="")


def _streaming_body(data: bytes):
    import io

    from botocore.response import StreamingBody

    return StreamingBody(io.BytesIO(data), len(data))


def test_llava_chat_stateless_sends_the_image_once(server, photos, tmp_path):
    """``llava-chat --stateless`` as the user runs it: no session, the image's bytes in the first turn
    only, the second turn answered from the conversation cache; ``-v`` and ``/reset`` as in a session."""
    import re
    import subprocess
    import sys

    photo = tmp_path / "cat.png"
    photo.write_bytes(photos["chelsea"])
    args = ["--url", server.url, "--image", str(photo), "--stateless", "--cache-salt", "cli", "-v"]
    done = subprocess.run(
        [sys.executable, "-m", "llava_client.cli", *args, "--max-new-tokens", "4"],
        input="What is it?\nAnd its colour?\n/reset\nWhat is it?\n",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    sent = [int(n.replace(",", "")) for n in re.findall(r"([\d,]+) bytes sent\]", done.stderr)]
    assert len(sent) == 3 and sent[1] < 2_000 < sent[0], done.stderr
    assert len(done.stdout.strip().splitlines()) == 3
    # -v says what its help promises, as in a session: time to first token and reused prompt tokens
    stats = re.findall(r"\[time to first token (\d+) ms; reused (\d+) of (\d+) prompt tokens;", done.stderr)
    assert len(stats) == 3 and int(stats[1][1]) > 576, done.stderr  # turn 2 reused the first turn's prefix
    # /reset keeps the images, as in a session: the next question carries the image again (its
    # uuid: the server holds it), and is the first question's prompt again
    assert "[conversation forgotten; same images]" in done.stderr
    assert stats[2][2] == stats[0][2] and sent[2] < 2_000
    bad = subprocess.run(
        [sys.executable, "-m", "llava_client.cli", "--url", server.url, "--image", str(photo), "--cache-salt", "x"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "--cache-salt goes with --stateless" in bad.stderr


def test_the_front_s_ping_and_503s_follow_whether_the_worker_serves():
    """Nothing listens behind the proxy. Until it is told the worker serves, ``/ping`` answers 503 and
    a request a typed ``503 model_not_ready`` at once, whose ``Retry-After`` counts down a restart's
    expected duration; OpenAI's own routes answer without TorchServe. Told it serves while TorchServe
    still refuses, a request waits ``restart_wait_s``, then gets the same 503; told it does not serve
    after it did (a restart), a request waits ``restart_wait_s`` for it too."""
    import math
    import socket
    import time

    import requests

    from llava_tools.serve.front import OpenAIFront

    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    closed_port = probe.getsockname()[1]
    probe.close()
    wait_s = 3.0
    front = OpenAIFront(("127.0.0.1", 0), ("127.0.0.1", closed_port), "m", restart_wait_s=wait_s).start()
    try:
        url = f"http://127.0.0.1:{front.port}"
        ping = requests.get(url + "/ping", timeout=5)
        assert (ping.status_code, ping.json(), ping.headers["Retry-After"]) == (503, {"status": "Unhealthy"}, "5")
        t0 = time.monotonic()
        for path in ("/invocations", "/v1/chat/completions"):
            r = requests.post(url + path, json={"messages": []}, timeout=10)
            assert (
                r.status_code == 503
                and r.headers["Retry-After"] == "5"
                and r.json()["error"]["code"] == "model_not_ready"
            )
        at_once = time.monotonic() - t0  # neither waited restart_wait_s: set against a held one below
        told = time.monotonic()
        front.set_ready(False, expected_s=12.0)  # a restart whose last start took 12 s
        r = requests.post(url + "/invocations", json={}, timeout=10)
        counted_down = time.monotonic() - told  # the countdown is what is left of 12 s when it answered
        assert r.status_code == 503 and max(1, math.ceil(12 - counted_down)) <= int(r.headers["Retry-After"]) <= 12
        assert requests.get(url + "/v1/models", timeout=5).json()["data"][0]["id"] == "m"
        assert requests.post(url + "/v1/embeddings", json={}, timeout=5).status_code == 404

        front.set_ready(True)
        assert requests.get(url + "/ping", timeout=5).json() == {"status": "Healthy"}
        t0 = time.monotonic()
        r = requests.post(url + "/v1/chat/completions", json={"messages": []}, timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_not_ready"
        assert r.headers["Retry-After"] == "12"  # the last start's duration: what a restart takes
        held = time.monotonic() - t0
        assert held >= wait_s and at_once < held / 2, (at_once, held)  # a floor the code sets; a ratio
        # it served before: not serving now is a restart, which a request waits out (held, up to
        # restart_wait_s), then gets the same 503 counting down what is left of the restart
        front.set_ready(False, expected_s=20.0)
        t0 = time.monotonic()
        r = requests.post(url + "/invocations", json={}, timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_not_ready"
        assert time.monotonic() - t0 >= wait_s and int(r.headers["Retry-After"]) <= 20 - wait_s + 1
        with socket.create_connection(("127.0.0.1", front.port), timeout=5) as raw:
            raw.sendall(b"POST /invocations HTTP/1.1\r\nHost: x\r\nContent-Length: x\r\n\r\n{}")
            assert raw.recv(100).startswith(b"HTTP/1.1 400 ")
    finally:
        front.stop()


def test_the_local_endpoint_routes_sessionless_turns_as_prefix_aware_routing_does(local_endpoint, photos):
    """``llava-local-endpoint --routing prefix-aware``: a stateless conversation resent with its
    image's bytes goes back to the backend that served its first turn (the same first PrefixLength
    bytes), where its conversation cache is; least-loaded would send it to the other one here. (Last
    in this module: it leaves sessions open.)"""
    from llava_client import SessionClient
    from test_local_endpoint import runtime_client

    client = SessionClient.from_endpoint("llava", client=runtime_client(local_endpoint.url), prefix_aware_id="tests")
    assert [b["sessions"] for b in local_endpoint.router.snapshot()["backends"]] == [0, 0]
    client.open_session(photos["rocket"])  # a session on backend 0
    chat = client.conversation(references=False)
    first = chat.ask("What is it?", images=[photos["astronaut"]], max_tokens=8, temperature=0)  # least loaded: 1
    client.open_session(photos["coffee"])  # least loaded: backend 1, so least loaded is now 0 again
    assert [b["sessions"] for b in local_endpoint.router.snapshot()["backends"]] == [1, 1]
    second = chat.ask("And its colour?", max_tokens=8, temperature=0)
    assert second.cached_tokens >= first.prompt_tokens  # the backend that holds its first turn answered

    # SageMaker's OpenAI route keys on the messages' text characters: a turn naming its image by uuid
    # alone keeps the key of the turn that sent the bytes, so it reaches the backend holding the image
    # (another backend would answer image_uuid_not_found)
    import base64

    url = "data:image/png;base64," + base64.b64encode(photos["chelsea"]).decode()
    oai = openai.OpenAI(base_url=f"{local_endpoint.url}/endpoints/llava/openai/v1", api_key="x", max_retries=0)
    opening = [
        {"type": "image_url", "image_url": {"url": url}, "uuid": "cat-1"},
        {"type": "text", "text": "What animal is it?"},
    ]
    turn1 = oai.chat.completions.create(
        model="m", messages=[{"role": "user", "content": opening}], max_tokens=4, temperature=0
    )
    router = local_endpoint.router
    (served,) = [i for key, i in router._prefixes.items() if "What animal is it?" in str(key)]
    while router.least_loaded() == served:  # least loaded would now send the next turn elsewhere
        client.open_session(photos["coffee"])
    by_uuid = [{"type": "image_url", "image_url": None, "uuid": "cat-1"}, opening[1]]
    history = [
        {"role": "user", "content": by_uuid},
        {"role": "assistant", "content": turn1.choices[0].message.content},
        {"role": "user", "content": "And its colour?"},
    ]
    turn2 = oai.chat.completions.create(model="m", messages=history, max_tokens=4, temperature=0)
    assert turn2.usage.prompt_tokens_details.cached_tokens >= turn1.usage.prompt_tokens


def test_overload_is_a_503_the_openai_package_raises_and_retries_after_retry_after(request, tiny_model_dir):
    """Issue 32 item 6: with every generation slot taken and no request held at the proxy
    (``queue_max_requests`` 0; tests/tools/test_abandoned.py tests the held ones), a request gets
    ``503 overloaded`` with ``Retry-After``; the package raises its own ``InternalServerError`` for it
    (retries off), and with its retries on it waits the ``Retry-After`` and is answered once the slot
    is free."""
    import threading

    server = start_local_server(
        tiny_model_dir,
        addfinalizer=request.addfinalizer,
        startup_timeout_s=120,
        overrides={"max_concurrent_generations": 1, "queue_max_requests": 0, "served_model_name": ["llava"]},
    )
    strict = openai.OpenAI(base_url=server.openai_base_url, api_key="unused", max_retries=0)
    # Retry-After is 1 s; the long answer's 200 one-token calls take 5-20 s on 2 busy cores: the
    # patient client's 60 retries outlast it by far (the package waits Retry-After between them).
    patient = openai.OpenAI(base_url=server.openai_base_url, api_key="unused", max_retries=60)
    messages = [{"role": "user", "content": "Tell me a long story."}]
    started = threading.Event()
    finished: list[str] = []

    def long_answer() -> None:
        stream = strict.chat.completions.create(
            model="llava",
            messages=messages,
            max_tokens=200,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                started.set()
            if chunk.choices and chunk.choices[0].finish_reason:
                finished.append(chunk.choices[0].finish_reason)

    llava = threading.Thread(target=long_answer)
    llava.start()
    try:
        assert started.wait(60)
        with pytest.raises(openai.InternalServerError) as err:
            strict.chat.completions.create(model="llava", messages=messages, max_tokens=2)
        assert err.value.status_code == 503 and err.value.code == "overloaded"
        assert int(err.value.response.headers["retry-after"]) >= 1
        assert not finished  # the long answer still held the slot
        reply = patient.chat.completions.with_raw_response.create(model="llava", messages=messages, max_tokens=2)
        assert reply.retries_taken >= 1  # waited out the Retry-After, then answered
        ChatCompletion.model_validate_json(reply.http_response.text)
    finally:
        llava.join(120)
    assert finished == ["length"]
