"""The chat dialect's wire without a model: request mapping, stop sequences in streams, logprobs, errors.

Every reply and chunk is validated with the ``openai`` package's own models.
"""

from __future__ import annotations

import json

import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from llava_sessions.chat.command import chat_command
from llava_sessions.chat.protocol import parse_chat_body
from llava_sessions.chat.responses import ChatStream, encode_completion
from llava_sessions.config import Settings
from llava_sessions.errors import ErrorCode, ServiceError
from llava_sessions.results import Answer, TokenEvent
from llava_sessions.sampling.params import UNTIL_CONTEXT_END

SETTINGS = Settings()


def command(**body):
    request = parse_chat_body({"messages": [{"role": "user", "content": "hi"}], **body}, max_prompt_chars=10_000)
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
    assert cmd.clip_max_new_tokens and cmd.params.max_new_tokens == UNTIL_CONTEXT_END  # until the context ends
    assert not command(temperature=0).params.sampling
    cmd = command(max_completion_tokens=7, max_tokens=99, stop="END", seed=3, logprobs=True, top_logprobs=2)
    assert cmd.params.max_new_tokens == 7 and cmd.params.stop == ("END",) and cmd.params.seed == 3
    assert cmd.params.logprobs and cmd.params.top_logprobs == 2 and not cmd.clip_max_new_tokens
    assert command(model="gpt-4o").model == "llava-test"  # accepted; the reply names the served model


def test_message_order_and_image_urls_are_checked_by_name():
    request = parse_chat_body(
        {"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]},
        max_prompt_chars=100,
    )
    with pytest.raises(ServiceError) as err:
        chat_command(request, SETTINGS, "m")
    assert err.value.param == "messages[1].role" and err.value.code is ErrorCode.INVALID_REQUEST
    request = parse_chat_body(
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "s3://b"}}]}]},
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
        part = stream.tokens(0, [e], text)
        frames.append(stream.chunk([part]) if part else b"")
    frames += stream.end([stream.finish(0, answer(events), [events[-1]])], [answer(events)])
    chunks = [json.loads(f[len(b"data: ") :]) for f in frames if f and f != b"data: [DONE]\n\n"]
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert content == "Hello "  # the stop sequence and what followed it never went out
    for c in chunks:
        ChatCompletionChunk.model_validate(c)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert frames[-1] == b"data: [DONE]\n\n"
    whole = ChatCompletion.model_validate_json(encode_completion(cmd, [answer(events)], str))
    assert whole.choices[0].message.content == "Hello "


def test_every_token_gets_a_chunk_its_text_empty_or_not_and_the_role_goes_with_the_first():
    """vLLM's stream: nothing before the first token (a client's time to first token is the first
    token's), the role in its chunk, and a chunk for a token whose text is empty (a special token), so
    an answer of such tokens streams as it is made instead of all at its end."""
    stream = ChatStream(command(stream=True), sse=True, token_text=str)
    assert stream.content_type == "text/event-stream; charset=utf-8"
    assert stream.tokens(0, [], "") is None  # no token yet: no chunk, not even the role's
    bos = stream.tokens(0, [TokenEvent(1, "", None, special=True)], "")
    assert bos is not None and (bos.delta.role, bos.delta.content) == ("assistant", "")
    word = stream.tokens(0, [TokenEvent(7, "Hi", None)], "Hi")
    assert word is not None and (word.delta.role, word.delta.content) == (None, "Hi")
    assert stream.tokens(0, [], "Hi") is None


def test_logprobs_in_openai_shape():
    cmd = command(logprobs=True, top_logprobs=2)
    events = [TokenEvent(5, "a", -0.1, top=((5, -0.1), (6, -2.5))), TokenEvent(2, "", -0.2, special=True)]
    reply = ChatCompletion.model_validate_json(encode_completion(cmd, [answer(events)], lambda i: f"<{i}>"))
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
    frames = stream.end([stream.finish(0, answer(events, "length"), events)], [answer(events, "length")])
    chunks = [ChatCompletionChunk.model_validate_json(f) for f in frames]
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens_details.cached_tokens == 4
    assert chunks[0].choices[0].finish_reason == "length" and chunks[0].usage is None


def test_a_stream_of_several_choices_carries_each_by_index_and_counts_every_choice_in_the_usage():
    cmd = command(stream=True, stream_options={"include_usage": True})
    stream = ChatStream(cmd, sse=False, token_text=str)
    a, b = [TokenEvent(1, "x", None)], [TokenEvent(2, "y", None), TokenEvent(3, "z", None)]
    first = ChatCompletionChunk.model_validate_json(
        stream.chunk([stream.tokens(0, a, "x"), stream.tokens(1, b[:1], "y")])
    )
    assert [(c.index, c.delta.role, c.delta.content) for c in first.choices] == [
        (0, "assistant", "x"),
        (1, "assistant", "y"),
    ]
    ended = stream.finish(0, answer(a, "stop"), [])
    last = [ended, stream.finish(1, answer(b, "length"), b[1:])]
    frames = stream.end(last, [answer(a, "stop"), answer(b, "length")], ["the video has 3 frames"])
    chunks = [ChatCompletionChunk.model_validate_json(f) for f in frames]
    assert json.loads(frames[0])["warnings"] == ["the video has 3 frames"] and "warnings" not in json.loads(frames[-1])
    assert [(c.index, c.delta.role, c.finish_reason) for c in chunks[0].choices] == [
        (0, None, "stop"),
        (1, None, "length"),
    ]
    assert chunks[-1].usage.completion_tokens == 3 and chunks[-1].usage.prompt_tokens == answer(a).prompt_tokens


def test_fields_nobody_defines_are_ignored_and_named_once_in_a_warning(caplog):
    """Issue 32 item 4, as vLLM does: LiteLLM's ``sagemaker_base_url`` and Strands' ``format`` inside
    ``image_url`` are ignored; each name is logged once at WARNING, never its value."""
    import uuid

    from llava_sessions.chat.messages import ignored_names

    fresh = f"client_field_{uuid.uuid4().hex[:12]}"  # a name no earlier test can have logged
    part = {"type": "image_url", "image_url": {"url": "https://example.com/a.png", "format": "image/png"}}
    body = {
        "messages": [{"role": "user", "content": [part, {"type": "text", "text": "hi"}]}],
        "sagemaker_base_url": "https://secret.example/value-1",
        fresh: "secret-value-2",
    }
    with caplog.at_level("WARNING", logger="llava_sessions.chat.messages"):
        for _ in range(3):
            request = parse_chat_body(body, max_prompt_chars=100)
    cmd = chat_command(request, SETTINGS, "m")
    assert cmd.conversation.question == "hi" and cmd.conversation.question_images == 1
    assert {"sagemaker_base_url", "messages[].content[].image_url.format", fresh} <= ignored_names()
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    logged = [r.getMessage() for r in warnings]
    assert logged.count(f"ignored request field: {fresh}") == 1  # logged, once, over three requests
    # once per process: an earlier test may have logged the other names already, never twice
    assert all(logged.count(line) == 1 for line in logged)
    assert not any("secret" in line or "image/png" in line for line in logged)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("echo", True),
        ("use_beam_search", True),
        ("guided_json", {}),
        ("guided_choice", ["a"]),
        ("add_special_tokens", False),
    ],
)
def test_vllm_fields_we_do_not_honour_are_refused_by_name_unless_they_ask_what_we_do(field, value):
    with pytest.raises(ServiceError) as err:
        command(**{field: value})
    assert err.value.code is ErrorCode.INVALID_PARAMETER and err.value.param == field
    assert "vLLM's" in err.value.message
    with pytest.raises(ServiceError) as err:
        command(prediction={"type": "content", "content": "x"})  # OpenAI's, refused too
    assert err.value.param == "prediction"
    assert command(response_format={"type": "json_object"}).params.grammar  # honoured (test_structured_outputs)
    same = command(
        echo=False, best_of=1, skip_special_tokens=True, spaces_between_special_tokens=True, add_special_tokens=True
    )
    assert same.params.max_new_tokens == UNTIL_CONTEXT_END and same.clip_max_new_tokens  # no limit: the context's


def conversation_of(messages: list[dict]):
    request = parse_chat_body({"messages": messages}, max_prompt_chars=1000)
    return chat_command(request, SETTINGS, "m")


def test_messages_as_vllm_takes_them_map_onto_one_conversation():
    """Issue 32 item 5: system and developer messages lead (merged), consecutive messages of one role
    are one message, an assistant's content may be null, an image URL may be a bare string, in an
    ``input_image`` part, or a part without ``type``."""
    url = "https://example.com/a.png"
    cmd = conversation_of(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "developer", "content": [{"type": "input_text", "text": "Answer in English."}]},
            {"role": "user", "content": [{"type": "image_url", "image_url": url}]},
            {"role": "user", "content": [{"text": "What is it?"}, {"image_url": url + "?2"}]},
            {"role": "assistant", "content": None},
            {"role": "assistant", "content": "A cat."},
            {
                "role": "user",
                "content": [{"type": "input_image", "image_url": url + "?3"}, {"type": "input_text", "text": "And?"}],
            },
        ]
    )
    conv = cmd.conversation
    assert conv.system_prompt == "Be brief.\nAnswer in English."
    assert [(t.prompt, t.answer, t.images) for t in conv.turns] == [("\nWhat is it?", "\nA cat.", 2)]
    assert (conv.question, conv.question_images) == ("And?", 1)
    assert [(i.source.url, i.param) for i in cmd.images] == [
        (url, "messages[2].content[0]"),
        (url + "?2", "messages[3].content[1]"),
        (url + "?3", "messages[6].content[0]"),
    ]


@pytest.mark.parametrize(
    ("messages", "param", "says"),
    [
        (
            [{"role": "user", "content": "a"}, {"role": "system", "content": "late"}, {"role": "user", "content": "b"}],
            "messages[1].role",
            "may only lead",
        ),
        ([{"role": "user", "content": None}], "messages[0].content", "required"),
        ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], "messages", "last message"),
        (
            [{"role": "system", "content": [{"type": "image_url", "image_url": "https://example.com/a.png"}]}],
            "messages[0].content",
            "text only",
        ),
    ],
)
def test_what_the_chat_template_cannot_express_is_a_typed_400(messages, param, says):
    with pytest.raises(ServiceError) as err:
        conversation_of(messages)
    assert err.value.status == 400 and err.value.param == param and says in err.value.message
