"""The chat dialect's wire without a model: request mapping, stop sequences in streams, logprobs, errors.

Every reply and chunk is validated with the ``openai`` package's own models.
"""

from __future__ import annotations

import json

import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from llava_sessions.chat.protocol import chat_command, parse_chat_body
from llava_sessions.chat.responses import ChatStream, encode_completion
from llava_sessions.config import Settings
from llava_sessions.errors import ErrorCode, ServiceError
from llava_sessions.results import Answer, TokenEvent

SETTINGS = Settings()


def command(**body):
    request = parse_chat_body(
        {"messages": [{"role": "user", "content": "hi"}], **body}, max_new_tokens_cap=1024, max_prompt_chars=10_000
    )
    return chat_command(request, SETTINGS, "llava-test")


def answer(events: list[TokenEvent], finish="stop") -> Answer:
    return Answer(
        text="".join(e.text for e in events),
        finish_reason=finish,
        prompt_tokens=10,
        cached_tokens=4,
        generated_tokens=len(events),
        tokens=events,
        timings={},
    )


def test_defaults_follow_openai():
    cmd = command()
    assert cmd.params.temperature == 1.0 and cmd.params.sampling  # OpenAI's default temperature samples
    assert cmd.clip_max_new_tokens and cmd.params.max_new_tokens == SETTINGS.default_max_new_tokens
    assert not command(temperature=0).params.sampling
    cmd = command(max_completion_tokens=7, max_tokens=99, stop="END", seed=3, logprobs=True, top_logprobs=2)
    assert cmd.params.max_new_tokens == 7 and cmd.params.stop == ("END",) and cmd.params.seed == 3
    assert cmd.params.logprobs and cmd.params.top_logprobs == 2 and not cmd.clip_max_new_tokens
    assert command(model="gpt-4o").model == "llava-test"  # accepted; the reply names the served model


def test_message_order_and_image_urls_are_checked_by_name():
    request = parse_chat_body(
        {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]},
        max_new_tokens_cap=1024,
        max_prompt_chars=100,
    )
    with pytest.raises(ServiceError) as err:
        chat_command(request, SETTINGS, "m")
    assert err.value.param == "messages[1].role" and err.value.code is ErrorCode.INVALID_REQUEST
    request = parse_chat_body(
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "s3://b"}}]}]},
        max_new_tokens_cap=1024,
        max_prompt_chars=100,
    )
    with pytest.raises(ServiceError) as err:
        chat_command(request, SETTINGS, "m")
    assert err.value.param == "messages[0].content[0].image_url.url"


def test_a_stop_sequence_is_held_back_and_left_out_of_streams_and_replies():
    cmd = command(stop=["STOP"])
    stream = ChatStream(cmd, sse=True, token_text=str)
    events = [
        TokenEvent(1, "Hel", None),
        TokenEvent(2, "lo S", None),
        TokenEvent(3, "TO", None),
        TokenEvent(4, "P!", None),
    ]
    frames, text = [], ""
    for e in events[:-1]:
        text += e.text
        frames.append(stream.tokens([e], text))
    frames += stream.end(answer(events), [events[-1]])
    chunks = [json.loads(f[len(b"data: ") :]) for f in frames if f and f != b"data: [DONE]\n\n"]
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert content == "Hello "  # the stop sequence and what followed it never went out
    for c in chunks:
        ChatCompletionChunk.model_validate(c)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert frames[-1] == b"data: [DONE]\n\n"
    whole = ChatCompletion.model_validate_json(encode_completion(cmd, answer(events), str))
    assert whole.choices[0].message.content == "Hello "


def test_logprobs_in_openai_shape():
    cmd = command(logprobs=True, top_logprobs=2)
    events = [TokenEvent(5, "a", -0.1, top=((5, -0.1), (6, -2.5))), TokenEvent(2, "", -0.2, special=True)]
    reply = ChatCompletion.model_validate_json(encode_completion(cmd, answer(events), lambda i: f"<{i}>"))
    content = reply.choices[0].logprobs.content
    assert [t.token for t in content] == ["<5>"]  # the end-of-sequence token is not listed
    assert [t.token for t in content[0].top_logprobs] == ["<5>", "<6>"] and content[0].bytes == list(b"<5>")


def test_a_stream_that_fails_ends_in_an_openai_error_event():
    err = ServiceError(ErrorCode.OVERLOADED, "not enough device memory", retry_after_s=2)
    sse = ChatStream(command(), sse=True, token_text=str).error(err)
    assert sse[-1] == b"data: [DONE]\n\n"
    body = json.loads(sse[0][len(b"data: ") :])
    assert body == {
        "error": {"message": "not enough device memory", "type": "server_error", "param": None, "code": "overloaded"}
    }
    lines = ChatStream(command(), sse=False, token_text=str).error(err)
    assert len(lines) == 1 and json.loads(lines[0])["error"]["code"] == "overloaded"


def test_usage_chunk_when_asked():
    cmd = command(stream=True, stream_options={"include_usage": True})
    stream = ChatStream(cmd, sse=False, token_text=str)
    events = [TokenEvent(1, "x", None)]
    frames = stream.end(answer(events, "length"), events)
    chunks = [ChatCompletionChunk.model_validate_json(f) for f in frames]
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens_details.cached_tokens == 4
    assert chunks[0].choices[0].finish_reason == "length" and chunks[0].usage is None
