"""OpenAI chat completions and AWS's session bodies, end to end: plain boto3 → ``llava-local-endpoint`` →
a real TorchServe (tiny model, CPU), every reply and every stream line validated with the ``openai``
package's own models (``ChatCompletion``, ``ChatCompletionChunk``) and read with AWS's stream loops.
"""

from __future__ import annotations

import base64
import http.server
import json
import threading

import pytest
from botocore.exceptions import ClientError
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from aws_readers import LineIterator, chat_reader_chunks, chat_reader_text
from llava_tools.local_endpoint import LocalEndpoint
from test_chat_engine import reference
from test_local_endpoint import runtime_client

JSON = "application/json"
N = 12


@pytest.fixture(scope="module")
def endpoint(request, tiny_model_dir):
    ep = LocalEndpoint(
        tiny_model_dir,
        backends=1,
        overrides={"step_max_tokens": 2, "allow_http": True, "allow_private_networks": True},
        model_config_overrides={"batchSize": 8, "maxNumSequence": 16},
        startup_timeout_s=120,
    )
    request.addfinalizer(ep.stop)
    return ep.start()


@pytest.fixture(scope="module")
def runtime(endpoint):
    return runtime_client(endpoint.url)


#: Tokens of an answer a close must interrupt: on the 2-core VM on a fast day 300 were all made before
#: the close arrived (three tries in a row), so those answers run on an endpoint of their own over a
#: checkpoint with llava-1.5's 4,096 positions.
CLOSED_ANSWER_TOKENS = 3000


@pytest.fixture(scope="module")
def long_runtime(request, tmp_path_factory):
    """boto3 on a local endpoint of its own over a tiny checkpoint with 4,096 positions."""
    from llava_tools.tiny_model import write_checkpoint

    ep = LocalEndpoint(
        write_checkpoint("tiny", tmp_path_factory.mktemp("tiny-4096"), seed=0),
        backends=1,
        overrides={"step_max_tokens": 2, "max_new_tokens_cap": CLOSED_ANSWER_TOKENS},
        model_config_overrides={"batchSize": 8, "maxNumSequence": 16},
        startup_timeout_s=120,
    )
    request.addfinalizer(ep.stop)
    return runtime_client(ep.start().url)


def data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def user(text: str, *images: bytes) -> dict:
    parts = [{"type": "image_url", "image_url": {"url": data_uri(b)}} for b in images]
    return {"role": "user", "content": [*parts, {"type": "text", "text": text}]}


def invoke(runtime, body: dict, session_id: str | None = None, **kw):
    extra = {"SessionId": session_id} if session_id else {}
    return runtime.invoke_endpoint(EndpointName="llava", Body=json.dumps(body), ContentType=JSON, **extra, **kw)


def new_session(runtime) -> str:
    """AWS's pattern: ``SessionId="NEW_SESSION"``, body ``{"requestType": "NEW_SESSION"}``; the id is
    the part of the new-session header before ``;``."""
    reply = invoke(runtime, {"requestType": "NEW_SESSION"}, "NEW_SESSION")
    session_id = reply["NewSessionId"].split(";")[0]
    assert json.loads(reply["Body"].read())["session_id"] == session_id
    return session_id


def complete(runtime, messages: list[dict], session_id: str | None = None, **params) -> ChatCompletion:
    reply = invoke(runtime, {"messages": messages, "max_tokens": N, "temperature": 0, **params}, session_id)
    assert reply["ContentType"] == JSON
    return ChatCompletion.model_validate_json(reply["Body"].read())


def stream(runtime, messages: list[dict], session_id: str | None, accept: str | None = None, **params):
    """Every PayloadPart, each one whole event; returns (parts, lines)."""
    kw = {"Accept": accept} if accept else {}
    extra = {"SessionId": session_id} if session_id else {}
    body = {"messages": messages, "max_tokens": N, "temperature": 0, "stream": True, **params}
    reply = runtime.invoke_endpoint_with_response_stream(
        EndpointName="llava", Body=json.dumps(body), ContentType=JSON, **extra, **kw
    )
    parts = [event["PayloadPart"]["Bytes"] for event in reply["Body"] if "PayloadPart" in event]
    lines = list(LineIterator({"PayloadPart": {"Bytes": p}} for p in parts))
    return reply, parts, lines


def text_of(llava, ids: list[int]) -> str:
    return llava.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def test_aws_sticky_session_pattern_with_images(runtime, llava, photos, tiny_model_dir):
    session_id = new_session(runtime)
    cat = photos["chelsea"]
    messages = [{"role": "system", "content": "Answer briefly."}, user("What is in the picture?", cat)]
    first = complete(runtime, messages, session_id)
    assert first.object == "chat.completion" and first.model == tiny_model_dir.name  # the served model
    expected = reference(llava, "Answer briefly.", [], "What is in the picture?", [cat])
    assert first.choices[0].message.content == text_of(llava, expected)
    assert first.choices[0].message.role == "assistant" and first.choices[0].finish_reason in ("stop", "length")
    assert first.usage.prompt_tokens_details.cached_tokens < 10  # at most the text before the image
    assert first.usage.total_tokens == first.usage.prompt_tokens + first.usage.completion_tokens
    answer = first.choices[0].message.content
    # the reply's message appended as it came (refusal, tool_calls, ... null), as OpenAI's examples do
    messages += [first.choices[0].message.model_dump(), user("What colour is it?")]
    second = complete(runtime, messages, session_id)
    turns = [("What is in the picture?", answer, [cat])]
    assert second.choices[0].message.content == text_of(
        llava, reference(llava, "Answer briefly.", turns, "What colour is it?", [])
    )
    # the resent history came from the session's cache: the image was not re-encoded nor re-prefilled
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
    reply = invoke(runtime, {"requestType": "CLOSE"}, session_id)
    assert reply["ClosedSessionId"] == session_id
    with pytest.raises(ClientError) as err:
        complete(runtime, messages, session_id)
    assert err.value.response["OriginalStatusCode"] == 404
    body = json.loads(err.value.response["OriginalMessage"])
    assert body["error"]["code"] == "session_not_found" and body["error"]["type"] == "invalid_request_error"


def test_streams_are_openai_chunks_in_sse_and_json_lines(runtime, llava, photos):
    session_id = new_session(runtime)
    messages = [user("Describe the image.", photos["coffee"])]
    whole = complete(runtime, messages, session_id, logprobs=True, top_logprobs=2)
    assert whole.choices[0].logprobs is not None and whole.choices[0].logprobs.content
    for token in whole.choices[0].logprobs.content:
        assert len(token.top_logprobs) == 2 and token.top_logprobs[0].logprob >= token.logprob - 1e-4
    reply, parts, lines = stream(runtime, messages, session_id, stream_options={"include_usage": True})
    assert lines[-1] == b"" or parts[-1] == b"data: [DONE]\n\n"
    for part in parts:  # one whole event per PayloadPart
        assert part.startswith(b"data: ") and part.endswith(b"\n\n") and part.count(b"\n\n") == 1
    chunks = chat_reader_chunks(lines)
    models = [ChatCompletionChunk.model_validate(c) for c in chunks]
    assert models[0].choices[0].delta.role == "assistant"
    assert [m.choices[0].finish_reason for m in models if m.choices][-1] in ("stop", "length")
    assert models[-1].choices == [] and models[-1].usage is not None
    assert all(m.usage is None for m in models[:-1])
    assert chat_reader_text(lines) == whole.choices[0].message.content  # the same greedy answer
    assert models[-1].usage.prompt_tokens_details.cached_tokens >= whole.usage.prompt_tokens - 1
    assert len({m.id for m in models}) == 1
    # LMI's form: JSON lines, one chunk per line, no [DONE]
    _, parts, lines = stream(runtime, messages, session_id, accept="application/jsonlines")
    assert all(p.endswith(b"\n") and p.count(b"\n") == 1 and not p.startswith(b"data:") for p in parts)
    assert b"[DONE]" not in b"".join(parts)
    for line in lines:
        if line:
            ChatCompletionChunk.model_validate_json(line)
    assert chat_reader_text(lines) == whole.choices[0].message.content


def test_closing_a_session_aborts_its_running_stream_as_vllm_does(long_runtime, photos):
    """AWS's close (``{"requestType": "CLOSE"}``) while the session's answer streams, from plain
    boto3: 200 with ``ClosedSessionId``, and the stream ends with ``finish_reason`` ``abort`` in
    OpenAI's chunk shape; a stream the client never read is aborted the same way."""
    runtime = long_runtime
    for read_first in (True, False):
        session_id, reasons = _close_while_streaming(runtime, photos["coffee"], read_first)
        assert reasons[-1] == "abort" and reasons.count("abort") == 1  # vLLM's, past OpenAI's list (test_openai_routes)
        with pytest.raises(ClientError) as err:
            complete(runtime, [user("Hi")], session_id)
        assert err.value.response["OriginalStatusCode"] == 404


def _close_while_streaming(runtime, photo: bytes, read_first: bool) -> tuple[str, list[str | None]]:
    """A new session streams a long answer (:data:`CLOSED_ANSWER_TOKENS`) and is closed (its first event
    read, or none); its id and the stream's finish reasons, every chunk before the last valid in OpenAI's
    shape."""
    session_id = new_session(runtime)
    body = {"messages": [user("Describe the image.", photo)], "stream": True, "ignore_eos": True}
    body["max_tokens"] = CLOSED_ANSWER_TOKENS
    reply = runtime.invoke_endpoint_with_response_stream(
        EndpointName="llava", Body=json.dumps(body), ContentType=JSON, SessionId=session_id
    )
    events = iter(reply["Body"])
    first = [next(events)] if read_first else []  # the answer is streaming
    closed = invoke(runtime, {"requestType": "CLOSE"}, session_id)
    assert closed["ClosedSessionId"] == session_id
    chunks = chat_reader_chunks(list(LineIterator([*first, *events])))
    for chunk in chunks[:-1]:
        ChatCompletionChunk.model_validate(chunk)
    return session_id, [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]


def test_sessionless_requests_keep_nothing_and_share_a_stored_prefix(endpoint, runtime, llava, photos):
    import requests

    before = set(requests.get(endpoint.url + "/debug/sessions", timeout=10).json()["sessions"])
    rocket = photos["rocket"]
    messages = [user("What is this?", rocket)]
    first = complete(runtime, messages)  # no SessionId: a sessionless request
    assert first.choices[0].message.content == text_of(llava, reference(llava, None, [], "What is this?", [rocket]))
    assert first.usage.prompt_tokens_details.cached_tokens < 10  # at most the text before the image
    assert set(requests.get(endpoint.url + "/debug/sessions", timeout=10).json()["sessions"]) == before
    session_id = new_session(runtime)
    complete(runtime, messages, session_id)  # a session now holds the image and the prefix
    again = complete(runtime, messages)  # a sessionless request starting the same way copies that prefix
    assert again.usage.prompt_tokens_details.cached_tokens >= again.usage.prompt_tokens - 1
    assert again.choices[0].message.content == first.choices[0].message.content
    _, _, lines = stream(runtime, messages, None)  # a sessionless request stream
    assert chat_reader_text(lines) == first.choices[0].message.content
    invoke(runtime, {"requestType": "CLOSE"}, session_id)


def test_both_dialects_in_one_session(runtime, llava, photos):
    session_id = new_session(runtime)
    cat = photos["chelsea"]
    first = complete(runtime, [user("What is this?", cat)], session_id)
    native = json.loads(
        invoke(
            runtime,
            {"type": "generate", "prompt": "And its colour?", "parameters": {"max_new_tokens": N, "details": True}},
            session_id,
        )["Body"].read()
    )
    turns = [("What is this?", first.choices[0].message.content, [cat])]
    assert native["generated_text"] == text_of(llava, reference(llava, None, turns, "And its colour?", []))
    assert native["details"]["cached_tokens"] > 500
    invoke(runtime, {"type": "close_session"}, session_id)


@pytest.mark.parametrize(
    ("body", "status", "code", "param"),
    [
        (
            {"messages": [{"role": "user", "content": "hi"}], "n": 2, "session_choice": 2},
            400,
            "invalid_parameter",
            "session_choice",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
            400,
            "invalid_parameter",
            "tools",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "xml"}},
            400,
            "invalid_parameter",
            "response_format.type",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
            400,
            "invalid_parameter",
            "messages[0].content[0].type",
        ),
        ({"messages": [{"role": "assistant", "content": "hi"}]}, 400, "invalid_request", "messages[0].role"),
        ({"messages": [{"role": "user", "content": "hi"}], "temperature": 5}, 400, "invalid_parameter", "temperature"),
        (
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**6},  # only the context bounds it
            400,
            "context_length_exceeded",
            None,
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "data:text/plain;base64,aGk="}}],
                    }
                ]
            },
            400,
            "invalid_parameter",
            "messages[0].content[0].image_url.url",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,aGk="}}],
                    }
                ]
            },
            400,
            "image_invalid",
            None,
        ),
        ({"requestType": "OPEN"}, 400, "invalid_parameter", "requestType"),
        ({"requestType": "CLOSE", "extra": 1}, 400, "invalid_request", "extra"),
        ({"messages": [{"role": "user", "content": "hi"}], "echo": True}, 400, "invalid_parameter", "echo"),
    ],
)
def test_refusals_are_openai_error_objects(runtime, body, status, code, param):
    with pytest.raises(ClientError) as err:
        invoke(runtime, body)
    response = err.value.response
    assert response["Error"]["Code"] == "ModelError" and response["OriginalStatusCode"] == status
    error = json.loads(response["OriginalMessage"])["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code and error["param"] == param and error["type"] == "invalid_request_error"


def test_the_client_speaks_the_chat_dialect_over_http_and_sagemaker(endpoint, runtime, llava, photos):
    from llava_client import ChatReply, SessionClient, image_part

    coffee = photos["coffee"]
    backend_url = endpoint.servers[0].url  # TorchServe itself, over plain HTTP
    for client in (SessionClient.from_url(backend_url), SessionClient.from_endpoint("llava", client=runtime)):
        with client:
            messages = [{"role": "user", "content": [image_part(coffee), {"type": "text", "text": "What is this?"}]}]
            sessionless = client.complete(messages, max_tokens=N, temperature=0)
            assert isinstance(sessionless, ChatReply)
            assert sessionless.text == text_of(llava, reference(llava, None, [], "What is this?", [coffee]))
            ChatCompletion.model_validate(sessionless.raw)
            with client.stream_chat(messages, max_tokens=N, temperature=0) as stream:
                events = list(stream)
            assert "".join(e.text for e in events) == stream.text == sessionless.text
            assert (events[-1].finish_reason, events[-1].usage) == (sessionless.finish_reason, stream.usage)
            assert stream.usage.completion_tokens == sessionless.completion_tokens
            assert all(e.finish_reason is None for e in events[:-1])
            with client.chat_session() as chat:
                first = chat.complete(messages, max_tokens=N, temperature=0)
                assert first.text == sessionless.text
                messages += [first.message, {"role": "user", "content": "Tell me more."}]
                streamed = chat.stream(messages, max_tokens=N, temperature=0).until_done()
                again = chat.complete(messages, max_tokens=N, temperature=0)
                assert streamed == again.text and again.cached_tokens >= first.prompt_tokens
            assert chat.closed
            with client.open_session(coffee) as session:  # a native session answers the chat dialect too
                reply = session.chat(messages, max_tokens=N, temperature=0)
                assert reply.text == again.text


def test_langchain_chat_sagemaker_endpoint_with_an_openai_messages_handler(runtime, llava, photos):
    """LangChain's ``ChatSagemakerEndpoint`` (langchain-aws) with the content handler its docs ask users
    to write for an OpenAI-messages endpoint; the session rides in ``endpoint_kwargs``."""
    from langchain_aws.chat_models.sagemaker_endpoint import ChatModelContentHandler, ChatSagemakerEndpoint
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage

    class OpenAIMessages(ChatModelContentHandler):
        content_type = "application/json"
        accepts = "application/json"

        def transform_input(self, prompt, model_kwargs):
            return json.dumps({"messages": prompt, **model_kwargs}).encode()

        def transform_output(self, output):
            if isinstance(output, bytes):  # a stream line: an SSE event or a JSON line
                text = output.decode().strip().removeprefix("data:").strip()
                if not text or text == "[DONE]":
                    return AIMessage(content="")
                choices = json.loads(text)["choices"]
                return AIMessage(content=(choices[0]["delta"].get("content") or "") if choices else "")
            return AIMessage(content=json.loads(output.read())["choices"][0]["message"]["content"])

    session_id = new_session(runtime)
    chat = ChatSagemakerEndpoint(
        endpoint_name="llava",
        client=runtime,
        content_handler=OpenAIMessages(),
        model_kwargs={"max_tokens": N, "temperature": 0},
        endpoint_kwargs={"SessionId": session_id},
    )
    cat = photos["chelsea"]
    question = HumanMessage(
        content=[{"type": "image_url", "image_url": {"url": data_uri(cat)}}, {"type": "text", "text": "What is it?"}]
    )
    first = chat.invoke([SystemMessage(content="Be brief."), question])
    assert first.content == text_of(llava, reference(llava, "Be brief.", [], "What is it?", [cat]))
    follow_up = [SystemMessage(content="Be brief."), question, first, HumanMessage(content="Where is it?")]
    streamed = "".join(chunk.content for chunk in chat.stream(follow_up, stream=True))  # kwargs join the body
    turns = [("What is it?", first.content, [cat])]
    assert streamed == text_of(llava, reference(llava, "Be brief.", turns, "Where is it?", []))
    invoke(runtime, {"requestType": "CLOSE"}, session_id)


def test_the_local_endpoint_from_code_and_from_llava_chat(endpoint, llava, photos, tmp_path):
    """``SessionClient.from_endpoint(..., endpoint_url=...)`` and ``llava-chat --endpoint-url``, with the
    dummy credentials boto3 needs for a local endpoint (the README's way)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from llava_client import SessionClient

    dummy = {"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x", "AWS_DEFAULT_REGION": "us-east-1"}
    image = tmp_path / "cat.png"
    image.write_bytes(photos["chelsea"])
    saved = {k: os.environ.get(k) for k in dummy}
    os.environ.update(dummy)
    try:
        with (
            SessionClient.from_endpoint("llava", endpoint_url=endpoint.url) as client,
            client.open_session(str(image)) as session,
        ):
            asked = session.ask("What is this?", max_new_tokens=N)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    assert asked.text == text_of(
        llava, __import__("test_engine").reference(llava, photos["chelsea"], [], "What is this?")
    )
    chat = Path(sys.executable).parent / "llava-chat"
    done = subprocess.run(
        [
            str(chat),
            "--endpoint",
            "llava",
            "--endpoint-url",
            endpoint.url,
            "--image",
            str(image),
            "-q",
            "What is this?",
            "--max-new-tokens",
            str(N),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **dummy},
    )
    assert done.returncode == 0, done.stderr
    assert asked.text in done.stdout
    refused = subprocess.run(
        [str(chat), "--url", endpoint.url, "--endpoint-url", endpoint.url, "--image", str(image)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 2 and "--endpoint-url goes with --endpoint" in refused.stderr


def phone_photo(path) -> int:
    """A phone-size photo: 4000x3000 JPEG of about 8 MB (detail everywhere, as a real photo has), with
    the EXIF orientation a phone held upright writes (6: rotate 90 degrees to show it)."""
    import numpy as np
    from PIL import Image
    from skimage import data

    base = Image.fromarray(data.astronaut()).resize((4000, 3000))
    noise = np.random.default_rng(0).integers(-40, 40, (3000, 4000, 3))
    pixels = np.clip(np.asarray(base).astype(int) + noise, 0, 255).astype("uint8")
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.fromarray(pixels).save(path, format="JPEG", quality=95, exif=exif)
    return path.stat().st_size


def test_a_phone_size_photo_is_downsized_by_the_client_and_said(endpoint, runtime, tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    from llava_client import MAX_BODY_BYTES, SessionClient, image_part

    photo = tmp_path / "phone.jpg"
    size = phone_photo(photo)
    assert size * 4 / 3 > MAX_BODY_BYTES  # inline (base64) it is over SageMaker's 6 MiB
    with SessionClient.from_endpoint("llava", client=runtime) as client:
        with client.open_session(str(photo)) as session:
            (done,) = session.downsized
            assert done.original_size == (3000, 4000) and done.sent_size == (1008, 1344)  # upright, 1344 px
            assert done.sent_bytes * 4 / 3 < MAX_BODY_BYTES and "downsized from 3000x4000" in str(done)
            assert session.ask("What is it?", max_new_tokens=3).usage.generated_tokens > 0
        reply = client.complete(
            [{"role": "user", "content": [image_part(str(photo)), {"type": "text", "text": "What is it?"}]}],
            max_tokens=3,
        )
        assert reply.completion_tokens > 0
        from llava_client.web import WebChat  # the page's logic: its status line says it too

        page = WebChat(client)
        _, status = page.open_image("tab", str(photo))
        assert "Note: the image was downsized from 3000x4000" in status
        page.open_image("tab", None)  # closes the tab's session
    dummy = {"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x", "AWS_DEFAULT_REGION": "us-east-1"}
    done = subprocess.run(
        [
            str(Path(sys.executable).parent / "llava-chat"),
            "--endpoint",
            "llava",
            "--endpoint-url",
            endpoint.url,
            "--image",
            str(photo),
            "-q",
            "What is it?",
            "--max-new-tokens",
            "3",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **dummy},
    )
    assert done.returncode == 0, done.stderr
    assert "[the image was downsized from 3000x4000" in done.stderr


def test_new_session_minted_by_torchserve_by_default_or_as_the_literal(endpoint, runtime, llava, photos):
    """What SageMaker forwards for ``SessionId="NEW_SESSION"`` decides who mints the id. The local
    endpoint forwards no header by default (what the AWS TorchServe sample's notebook asserts of a real
    endpoint): TorchServe mints ``ts-seq-<uuid>``, native opens and AWS's session bodies open as
    before, and a ``messages`` request sent with ``NEW_SESSION`` is sessionless (no session is left).
    With ``--new-session-literal`` the handler mints ``llava-<uuid>`` and that request opens its session."""
    opened = invoke(
        runtime,
        {"type": "open_session", "image": {"base64": base64.b64encode(photos["coffee"]).decode()}},
        "NEW_SESSION",
    )
    native_id = opened["NewSessionId"].split(";")[0]
    assert native_id.startswith("ts-seq-")
    follow = json.loads(
        invoke(runtime, {"type": "generate", "prompt": "What is it?", "parameters": {"max_new_tokens": 3}}, native_id)[
            "Body"
        ].read()
    )
    assert follow["details"]["cached_tokens"] > 500
    session_id = new_session(runtime)
    assert session_id.startswith("ts-seq-")
    first = complete(runtime, [user("What is this?", photos["rocket"])], session_id)
    assert first.choices[0].message.content
    reply = invoke(runtime, {"messages": [user("What is this?", photos["rocket"])], "max_tokens": N}, "NEW_SESSION")
    assert "NewSessionId" not in reply and "ClosedSessionId" not in reply  # sessionless: answered, nothing kept
    ChatCompletion.model_validate_json(reply["Body"].read())
    for sid in (native_id, session_id):
        assert invoke(runtime, {"requestType": "CLOSE"}, sid)["ClosedSessionId"] == sid
    endpoint._httpd.pass_new_session = True  # the same router, the other way of forwarding an open
    try:
        reply = invoke(runtime, {"messages": [user("What is this?", photos["rocket"])], "max_tokens": N}, "NEW_SESSION")
        opened_by_chat = reply["NewSessionId"].split(";")[0]
        assert opened_by_chat.startswith("llava-")  # minted by the handler, not TorchServe's ts-seq-
        ChatCompletion.model_validate_json(reply["Body"].read())
        again = complete(runtime, [user("What is this?", photos["rocket"])], opened_by_chat)
        assert again.usage.prompt_tokens_details.cached_tokens >= again.usage.prompt_tokens - 1
        assert invoke(runtime, {"requestType": "CLOSE"}, opened_by_chat)["ClosedSessionId"] == opened_by_chat
    finally:
        endpoint._httpd.pass_new_session = False


class _ImageHost(http.server.BaseHTTPRequestHandler):
    """A local image host on 127.0.0.1 (the sample's notebook names an image on the web)."""

    payload = b""

    def do_GET(self):  # noqa: N802
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(self.payload)))
        self.end_headers()
        self.wfile.write(self.payload)

    def log_message(self, *args):
        pass


def test_the_aws_sample_notebook_s_client_cells_run_unchanged(endpoint, photos):
    """Step 4 of the AWS TorchServe LLaVA sample's notebook (``llava_stateful_deploy_infer.ipynb``),
    its client code as written there, against the local endpoint through plain boto3: open with
    ``SessionId="NEW_SESSION"`` and ``assert open_response.session_id.startswith("ts-seq-")``, two
    prompts, close. Only ``endpoint_name``, ``smr`` and ``image_url`` are this machine's."""
    from aws_sample_data_types import (
        CloseSessionRequest,
        CloseSessionResponse,
        OpenSessionResponse,
        StartSessionRequest,
        TextPromptRequest,
        TextPromptResponse,
    )

    _ImageHost.payload = photos["rocket"]
    host = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _ImageHost)
    threading.Thread(target=host.serve_forever, daemon=True).start()
    smr = runtime_client(endpoint.url)
    endpoint_name = "llava"
    image_url = f"http://127.0.0.1:{host.server_address[1]}/pexels-photo.png"
    try:
        # ---- the notebook's cells from here (4.1 to 4.4) ----
        def send_and_check_request(r, seq_id):
            response = smr.invoke_endpoint(
                EndpointName=endpoint_name, Body=r.to_json(), ContentType="application/json", SessionId=seq_id
            )
            assert response["ResponseMetadata"]["HTTPStatusCode"] == 200, f"Sending request failed: {r}"
            return response["Body"].readlines()[0]

        open_request = StartSessionRequest(type="start_session", path=image_url)
        open_response = send_and_check_request(open_request, "NEW_SESSION")
        open_response = OpenSessionResponse.from_json(open_response)
        assert open_response.session_id.startswith("ts-seq-")

        text_prompt_request1 = TextPromptRequest(
            type="send_text_prompt", session_id=open_response.session_id, prompt_text="describe the picture"
        )
        text_prompt_response1 = send_and_check_request(text_prompt_request1, open_response.session_id)
        text_prompt_response1 = TextPromptResponse.from_json(text_prompt_response1)
        assert text_prompt_response1.response_text

        text_prompt_request2 = TextPromptRequest(
            type="send_text_prompt",
            session_id=open_response.session_id,
            prompt_text="is there a mountain in the picture, describe it",
        )
        text_prompt_response2 = send_and_check_request(text_prompt_request2, open_response.session_id)
        text_prompt_response2 = TextPromptResponse.from_json(text_prompt_response2)
        assert text_prompt_response2.response_text

        close_request = CloseSessionRequest(type="close_session", session_id=open_response.session_id)
        close_response = send_and_check_request(close_request, open_response.session_id)
        close_response = CloseSessionResponse.from_json(close_response)
        assert close_response.success
        # ---- end of the notebook's cells ----
    finally:
        host.shutdown()


def test_fields_wrappers_add_are_ignored_as_vllm_ignores_them(runtime, llava, photos):
    """LiteLLM puts ``sagemaker_base_url`` in the body, Strands a ``format`` inside ``image_url``: the
    request is answered as without them (the same greedy tokens), not refused."""
    cat = photos["chelsea"]
    plain = complete(runtime, [user("What is in the picture?", cat)])
    wrapped = user("What is in the picture?", cat)
    wrapped["content"][0]["image_url"]["format"] = "image/png"
    body = {
        "messages": [wrapped],
        "max_tokens": N,
        "temperature": 0,
        "sagemaker_base_url": "https://runtime.sagemaker.us-east-1.amazonaws.com",
        "skip_special_tokens": True,  # vLLM's, set to what this server does anyway
    }
    reply = ChatCompletion.model_validate_json(invoke(runtime, body)["Body"].read())
    assert reply.choices[0].message.content == plain.choices[0].message.content


def test_messages_as_vllm_accepts_them_answer_as_their_merged_conversation(runtime, llava, photos):
    """Issue 32 item 5 end to end: two system messages, consecutive user messages, an assistant
    message with null content beside its text, an ``input_image`` part, a part without ``type``: the
    answer is ``model.generate``'s on the merged conversation (each run of one role joined with
    newlines, its images first), token for token."""
    cat = photos["chelsea"]
    messages = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "developer", "content": "Use English."},
        {"role": "user", "content": [{"type": "input_image", "image_url": data_uri(cat)}]},
        {"role": "user", "content": "What is in the picture?"},
        {"role": "assistant", "content": None},
        {"role": "assistant", "content": "A cat."},
        {"role": "user", "content": [{"text": "And its colour?"}]},
    ]
    reply = complete(runtime, messages)
    turns = [("\nWhat is in the picture?", "\nA cat.", [cat])]
    expected = reference(llava, "Answer briefly.\nUse English.", turns, "And its colour?", [])
    assert reply.choices[0].message.content == text_of(llava, expected)
