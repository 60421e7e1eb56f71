"""Wire protocol: every request type (incl. the AWS sample's), every error path, responses, headers."""

from __future__ import annotations

import json
import re

import botocore.session
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from pydantic import ValidationError

from llava_sessions.errors import ErrorCode, ServiceError
from llava_sessions.native import protocol, responses
from llava_sessions.native.protocol import (
    REQUEST_TYPES,
    AddImageRequest,
    CloseSessionRequest,
    GenerateParameters,
    GenerateRequest,
    ImageSource,
    OpenSessionRequest,
    ResetRequest,
    SendTextPromptRequest,
    StartSessionRequest,
    parse_request,
)
from llava_sessions.native.responses import (
    CloseResponse,
    ErrorBody,
    GenerateResponse,
    GenerationDetails,
    OpenSessionResponse,
    ResetResponse,
    SendTextPromptResponse,
    StartSessionResponse,
    StreamLine,
    TokenInfo,
)
from llava_sessions.wire.contract import (
    CLOSED_SESSION_ID_HEADER,
    NEW_SESSION_ID_HEADER,
    NEW_SESSION_LITERAL,
    SESSION_ID_HEADER,
    SESSION_ID_RE,
    format_expires,
    session_header_value,
)

LIMITS = {"max_body_bytes": 4096, "max_prompt_chars": 100, "max_new_tokens_cap": 512}
SECRET = "SECRETxyzzy"
REQUEST_CLASSES = (
    OpenSessionRequest,
    GenerateRequest,
    AddImageRequest,
    ResetRequest,
    CloseSessionRequest,
    StartSessionRequest,
    SendTextPromptRequest,
)


def parse(body):
    return parse_request(body, **LIMITS)


def fail(body, **limits) -> ServiceError:
    with pytest.raises(ServiceError) as info:
        parse_request(body, **{**LIMITS, **limits})
    return info.value


def test_public_api_is_pinned() -> None:
    assert sorted(protocol.__all__) == sorted(
        [
            "AddImageCommand",
            "CloseCommand",
            "Command",
            "GenerateCommand",
            "OpenCommand",
            "ResetCommand",
            "AddImageRequest",
            "AddVideoRequest",
            "REQUEST_TYPES",
            "SAMPLING_BOUNDS",
            "CloseSessionRequest",
            "GenerateParameters",
            "GenerateRequest",
            "HistoryTurn",
            "ImageSource",
            "OpenSessionRequest",
            "Request",
            "ResetRequest",
            "SamplingBound",
            "SendTextPromptRequest",
            "StartSessionRequest",
            "VideoSource",
            "parse_request",
            "validate_request",
        ]
    )
    assert sorted(responses.__all__) == sorted(
        [
            "AddImageResponse",
            "CloseResponse",
            "ErrorBody",
            "ErrorDetail",
            "GenerateResponse",
            "GenerationDetails",
            "OpenSessionResponse",
            "ResetResponse",
            "SendTextPromptResponse",
            "StartSessionResponse",
            "StreamLine",
            "TokenInfo",
            "encode_add_image",
            "encode_answer",
            "encode_close",
            "encode_error",
            "encode_open",
            "encode_reset",
            "encode_stream_end",
            "encode_stream_error",
            "encode_tokens",
            "error_status",
        ]
    )
    for module in (protocol, responses):
        for name in module.__all__:
            assert hasattr(module, name)


# --- requests ------------------------------------------------------------------------------


@pytest.mark.parametrize("form", ["bytes", "bytearray", "str", "dict"])
def test_every_body_form_is_accepted(form: str) -> None:
    obj = {"type": "generate", "prompt": "What is in the picture?"}
    text = json.dumps(obj)
    body = {"bytes": text.encode(), "bytearray": bytearray(text.encode()), "str": text, "dict": obj}[form]
    request = parse(body)
    assert isinstance(request, GenerateRequest)
    assert request.prompt == "What is in the picture?"


@pytest.mark.parametrize(
    ("image", "kind"),
    [
        ({"url": "https://example.com/cat.jpg"}, "url"),
        ({"s3_uri": "s3://my-bucket/images/cat 1.jpg"}, "s3_uri"),
        ({"base64": "aGVsbG8="}, "base64"),
    ],
)
def test_open_session(image: dict, kind: str) -> None:
    request = parse({"type": "open_session", "image": image, "system_prompt": "Be terse."})
    assert isinstance(request, OpenSessionRequest)
    assert request.image.kind == kind
    assert getattr(request.image, kind) == image[kind]
    assert request.system_prompt == "Be terse."
    assert request.canonical() is request and not request.legacy


def test_open_session_system_prompt_is_optional() -> None:
    request = parse(b'{"type": "open_session", "image": {"url": "https://example.com/a.png"}}')
    assert request.system_prompt is None


def test_generate_defaults() -> None:
    request = parse({"type": "generate", "prompt": "hi"})
    assert isinstance(request, GenerateRequest)
    assert (request.stream, request.remember) == (False, True)
    assert request.parameters == GenerateParameters()
    p = request.parameters
    assert (p.max_new_tokens, p.temperature, p.top_p, p.top_k, p.repetition_penalty, p.seed) == (None,) * 6
    assert (p.do_sample, p.stop, p.details) == (False, [], False)


def test_generate_null_parameters_mean_defaults() -> None:
    assert parse({"type": "generate", "prompt": "hi", "parameters": None}).parameters == GenerateParameters()


def test_generate_with_every_parameter() -> None:
    parameters = {
        "max_new_tokens": 512,
        "temperature": 0,  # an integer is a valid number
        "top_p": 1,
        "top_k": 0,
        "repetition_penalty": 1.1,
        "do_sample": True,
        "seed": 0,
        "stop": ["\n\n", "x" * 64, "a", "b"],
        "details": True,
        "n": 3,
        "session_choice": 2,
    }
    request = parse({"type": "generate", "prompt": "hi", "parameters": parameters, "stream": True, "remember": False})
    assert request.parameters.model_dump() == {**parameters, "temperature": 0.0, "top_p": 1.0}
    assert (request.stream, request.remember) == (True, False)


def test_reset_and_close() -> None:
    assert isinstance(parse('{"type": "reset"}'), ResetRequest)
    close = parse('{"type": "close_session"}')
    assert isinstance(close, CloseSessionRequest) and close.session_id is None


def test_aws_sample_bodies_work_unchanged() -> None:
    # What the sample's dataclasses_json classes send (aws-samples/sagemaker-genai-hosting-examples,
    # LLava/torchserve/workspace/llava_stateful_deploy_infer.ipynb): session_id null on start.
    start = parse(b'{"type": "start_session", "session_id": null, "path": "https://images.example.com/p.jpeg"}')
    assert isinstance(start, StartSessionRequest) and start.legacy
    assert start.canonical() == OpenSessionRequest(
        type="open_session", image=ImageSource(url="https://images.example.com/p.jpeg")
    )

    start_s3 = parse({"type": "start_session", "path": "s3://bucket/dir/img.png"})
    assert start_s3.canonical().image == ImageSource(s3_uri="s3://bucket/dir/img.png")

    prompt = parse(b'{"type": "send_text_prompt", "session_id": "ts-seq-1a2b", "prompt_text": "describe the picture"}')
    assert isinstance(prompt, SendTextPromptRequest) and prompt.legacy
    canonical = prompt.canonical()
    assert isinstance(canonical, GenerateRequest)
    assert (canonical.prompt, canonical.stream, canonical.remember) == ("describe the picture", False, True)

    close = parse(b'{"type": "close_session", "session_id": "ts-seq-1a2b"}')
    assert isinstance(close, CloseSessionRequest) and close.session_id == "ts-seq-1a2b"
    assert close.canonical() is close


def test_requests_are_immutable() -> None:
    request = parse({"type": "generate", "prompt": "hi"})
    with pytest.raises(ValidationError):
        request.prompt = "other"  # type: ignore[misc]


# --- request errors ------------------------------------------------------------------------

VALID_TYPES = (
    "valid types: open_session, generate, add_image, add_video, reset, close_session, start_session, send_text_prompt"
)


@pytest.mark.parametrize(
    ("body", "code", "message"),
    [
        (b"", ErrorCode.INVALID_REQUEST, "request body is empty"),
        (b"{not json", ErrorCode.INVALID_REQUEST, "not valid JSON"),
        (b"\xff\xfe\x00garbage", ErrorCode.INVALID_REQUEST, "not valid JSON"),
        (b'{"type": "generate", "prompt": NaN}', ErrorCode.INVALID_REQUEST, "not valid JSON"),
        (b"[1, 2]", ErrorCode.INVALID_REQUEST, "must be a JSON object"),
        (b'"open_session"', ErrorCode.INVALID_REQUEST, "must be a JSON object"),
        (b"{}", ErrorCode.INVALID_REQUEST, f"missing field 'type'; {VALID_TYPES}"),
        ({"prompt": "hi"}, ErrorCode.INVALID_REQUEST, f"missing field 'type'; {VALID_TYPES}"),
        ({"type": "chat"}, ErrorCode.INVALID_REQUEST, f"unknown type 'chat'; {VALID_TYPES}"),
        ({"type": "<script>"}, ErrorCode.INVALID_REQUEST, f"unknown type; {VALID_TYPES}"),
        ({"type": 3}, ErrorCode.INVALID_REQUEST, "field 'type' must be a string"),
        ({"type": "generate"}, ErrorCode.INVALID_REQUEST, "prompt: field required"),
        (
            {"type": "generate", "prompt": "hi", "temperature": 0.5},
            ErrorCode.INVALID_REQUEST,
            "temperature: unknown field",
        ),
        (
            {"type": "generate", "prompt": "hi", "parameters": {"beam": 2}},
            ErrorCode.INVALID_REQUEST,
            "parameters.beam: unknown field",
        ),
        (
            {"type": "generate", "prompt": "hi", "parameters": [1]},
            ErrorCode.INVALID_REQUEST,
            "parameters: must be a JSON object",
        ),
        ({"type": "reset", "session_id": "x"}, ErrorCode.INVALID_REQUEST, "session_id: unknown field"),
        ({"type": "open_session"}, ErrorCode.INVALID_REQUEST, "give exactly one of image, video"),
        (
            {"type": "open_session", "video": {"base64": "aGk=", "num_frames": 2, "fps": 1}},
            ErrorCode.INVALID_PARAMETER,
            "video: give num_frames or fps, not both",
        ),
        (
            {"type": "open_session", "image": {}},
            ErrorCode.INVALID_REQUEST,
            "image: give exactly one of url, s3_uri, base64",
        ),
        (
            {"type": "open_session", "image": {"url": "https://a.example/x.png", "base64": "aGk="}},
            ErrorCode.INVALID_REQUEST,
            "image: give exactly one of url, s3_uri, base64",
        ),
        (
            {"type": "open_session", "image": {"path": "/etc/passwd"}},
            ErrorCode.INVALID_REQUEST,
            "image.path: unknown field",
        ),
        (
            {"type": "open_session", "image": "https://a.example/x.png"},
            ErrorCode.INVALID_REQUEST,
            "image: must be a JSON object",
        ),
        ({"type": "start_session"}, ErrorCode.INVALID_REQUEST, "path: field required"),
        ({"type": "send_text_prompt", "prompt": "hi"}, ErrorCode.INVALID_REQUEST, "prompt_text: field required"),
        # value errors
        ({"type": "generate", "prompt": ""}, ErrorCode.INVALID_PARAMETER, "prompt: must not be empty"),
        ({"type": "generate", "prompt": " \n\t"}, ErrorCode.INVALID_PARAMETER, "prompt: must not be blank"),
        ({"type": "generate", "prompt": 42}, ErrorCode.INVALID_PARAMETER, "prompt: must be a string"),
        ({"type": "generate", "prompt": "\ud800"}, ErrorCode.INVALID_PARAMETER, "prompt: must be valid Unicode text"),
        (
            {"type": "generate", "prompt": "hi", "stream": "yes"},
            ErrorCode.INVALID_PARAMETER,
            "stream: must be true or false",
        ),
        (
            {"type": "generate", "prompt": "hi", "parameters": {"top_p": 0}},
            ErrorCode.INVALID_PARAMETER,
            "parameters.top_p: must be > 0 and <= 1",
        ),
        (
            {"type": "generate", "prompt": "hi", "parameters": {"top_p": 1.01}},
            ErrorCode.INVALID_PARAMETER,
            "parameters.top_p: must be > 0 and <= 1",
        ),
        (
            {"type": "generate", "prompt": "hi", "parameters": {"top_p": "0.5"}},
            ErrorCode.INVALID_PARAMETER,
            "parameters.top_p: must be > 0 and <= 1",
        ),
        (
            {"type": "generate", "prompt": "hi", "parameters": {"temperature": -0.1}},
            ErrorCode.INVALID_PARAMETER,
            "parameters.temperature: must be a number >= 0",
        ),
        (
            {"type": "generate", "prompt": "hi", "parameters": {"max_new_tokens": 0}},
            ErrorCode.INVALID_PARAMETER,
            "parameters.max_new_tokens: must be an integer >= 1",
        ),
        (
            {"type": "generate", "prompt": "hi", "parameters": {"max_new_tokens": 2.5}},
            ErrorCode.INVALID_PARAMETER,
            "parameters.max_new_tokens: must be an integer >= 1",
        ),
        (
            {"type": "generate", "prompt": "hi", "parameters": {"max_new_tokens": 513}},
            ErrorCode.INVALID_PARAMETER,
            "parameters.max_new_tokens: must be <= 512",
        ),
        (
            {"type": "generate", "prompt": "hi", "parameters": {"top_k": -1}},
            ErrorCode.INVALID_PARAMETER,
            "parameters.top_k: must be an integer >= 0 (0 = off)",
        ),
        (
            {"type": "generate", "prompt": "hi", "parameters": {"repetition_penalty": 0}},
            ErrorCode.INVALID_PARAMETER,
            "parameters.repetition_penalty: must be a number > 0",
        ),
        (
            {"type": "generate", "prompt": "hi", "parameters": {"seed": -1}},
            ErrorCode.INVALID_PARAMETER,
            "parameters.seed: must be an integer between 0 and",
        ),
        (
            {"type": "generate", "prompt": "hi", "parameters": {"do_sample": 1}},
            ErrorCode.INVALID_PARAMETER,
            "parameters.do_sample: must be true or false",
        ),
        (
            {"type": "generate", "prompt": "hi", "parameters": {"stop": ["a"] * 5}},
            ErrorCode.INVALID_PARAMETER,
            "parameters.stop: at most 4 stop strings",
        ),
        (
            {"type": "generate", "prompt": "hi", "parameters": {"stop": [""]}},
            ErrorCode.INVALID_PARAMETER,
            "parameters.stop[0]: each stop string must be 1 to 64 characters",
        ),
        (
            {"type": "generate", "prompt": "hi", "parameters": {"stop": ["a", "x" * 65]}},
            ErrorCode.INVALID_PARAMETER,
            "parameters.stop[1]: each stop string must be 1 to 64 characters",
        ),
        (
            {"type": "generate", "prompt": "hi", "parameters": {"stop": "\n"}},
            ErrorCode.INVALID_PARAMETER,
            "parameters.stop: must be a list",
        ),
        (
            b'{"type": "generate", "prompt": "hi", "parameters": {"temperature": 1e999}}',
            ErrorCode.INVALID_PARAMETER,
            "parameters.temperature: must be a number >= 0",
        ),
        (
            {"type": "generate", "prompt": "x" * 101},
            ErrorCode.INVALID_PARAMETER,
            "prompt: longer than 100 characters (101 given)",
        ),
        (
            {"type": "send_text_prompt", "prompt_text": "x" * 101},
            ErrorCode.INVALID_PARAMETER,
            "prompt_text: longer than 100 characters",
        ),
        (
            {"type": "open_session", "image": {"url": "https://a.example/x.png"}, "system_prompt": "x" * 101},
            ErrorCode.INVALID_PARAMETER,
            "system_prompt: longer than 100 characters",
        ),
        (
            {"type": "open_session", "image": {"s3_uri": "s3://bucket-only"}},
            ErrorCode.INVALID_PARAMETER,
            "image.s3_uri: must look like s3://bucket/key",
        ),
        ({"type": "open_session", "image": {"url": ""}}, ErrorCode.INVALID_PARAMETER, "image.url: must not be empty"),
        (
            {"type": "start_session", "path": "s3://b"},
            ErrorCode.INVALID_PARAMETER,
            "path: must be an image URL or look like s3://bucket/key",
        ),
    ],
)
def test_request_errors(body, code: ErrorCode, message: str) -> None:
    error = fail(body)
    assert error.code == code
    assert error.status == 400
    assert message in error.message


def test_value_and_structure_errors_together_are_invalid_request() -> None:
    error = fail({"type": "generate", "prompt": "hi", "parameters": {"top_p": 2, "beams": 3}})
    assert error.code == ErrorCode.INVALID_REQUEST
    assert "parameters.top_p: must be > 0 and <= 1" in error.message
    assert "parameters.beams: unknown field" in error.message


def test_many_errors_are_summarised() -> None:
    bad = {f"k{i}": i for i in range(9)}
    error = fail({"type": "generate", "prompt": "hi", "parameters": bad})
    assert error.message.count("unknown field") == 5
    assert error.message.endswith("and 4 more")


@pytest.mark.parametrize(
    ("body", "chat"),
    [
        (b'{"messages": [{"role": "user", "content": "hi"}]}', True),
        (b'{"model": "x", "messages"  : []}', True),
        (b'{"requestType": "CLOSE"}', True),
        ({"requestType": "CLOSE"}, True),
        ('{"messages":[]}', True),
        (b'{"type": "open_session", "image": {"base64": "QUJD"}}', False),
        (b'{"type": "generate", "prompt": "quote \\"messages\\": here"}', False),  # inside a string
        (b'{"type": "generate", "prompt": "messages"}', False),  # a value, not a key
        (b"\xff\xfe not json", False),
    ],
)
def test_a_body_too_large_to_decode_gets_its_dialect_from_its_raw_keys(body, chat) -> None:
    from llava_sessions.wire.inbound import names_chat_keys

    assert names_chat_keys(body) is chat


@pytest.mark.parametrize("form", ["bytes", "str", "dict"])
def test_body_over_the_limit_is_413(form: str) -> None:
    obj = {"type": "open_session", "image": {"base64": "A" * 5000}}
    text = json.dumps(obj)
    body = {"bytes": text.encode(), "str": text, "dict": obj}[form]
    error = fail(body)
    assert (error.code, error.status) == (ErrorCode.PAYLOAD_TOO_LARGE, 413)
    assert re.match(r"request body is 5,0\d\d bytes, over the 4,096-byte limit", error.message), error.message
    # exactly at the limit is fine
    at_limit = json.dumps({"type": "open_session", "image": {"base64": ""}})
    pad = 4096 - len(at_limit)
    assert parse(json.dumps({"type": "open_session", "image": {"base64": "A" * pad}}).encode()).image.kind == "base64"


@pytest.mark.parametrize(
    "body",
    [
        {"type": "generate", "prompt": SECRET * 20},  # too long
        {"type": "generate", "prompt": SECRET, "parameters": {"top_p": SECRET}},
        {"type": "generate", "prompt": SECRET, f"{SECRET} as a key": SECRET},  # only identifier-like keys are named
        {"type": "open_session", "image": {"url": SECRET, "base64": SECRET}},
        {"type": "open_session", "image": {"s3_uri": SECRET}},
        {"type": "open_session", "image": {"base64": SECRET, "extra": 1}},
        {"type": "open_session", "image": {"url": "https://a.example/"}, "system_prompt": SECRET * 20},
        {"type": SECRET + "!"},
        {"type": "generate", "prompt": "hi", "stream": SECRET},
        {"type": "generate", "prompt": "hi", "parameters": {"stop": [SECRET * 10]}},
    ],
)
def test_messages_never_echo_content(body: dict) -> None:
    error = fail(body)
    assert SECRET not in error.message
    assert SECRET.lower() not in error.message.lower()


# --- fuzz ----------------------------------------------------------------------------------

_scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12)
_json = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=12,
)
_param_names = st.sampled_from(
    [
        "max_new_tokens",
        "temperature",
        "top_p",
        "top_k",
        "repetition_penalty",
        "do_sample",
        "seed",
        "stop",
        "details",
        "beam",
    ]
)
_requestish = st.fixed_dictionaries(
    {"type": st.sampled_from(REQUEST_TYPES + ("nope",))},
    optional={
        "prompt": st.text(max_size=150) | _json,
        "prompt_text": st.text(max_size=20),
        "path": st.sampled_from(["s3://b/k", "s3://x", "https://a.example/p.png", ""]),
        "session_id": _scalars,
        "parameters": st.dictionaries(_param_names, _json | st.lists(st.text(max_size=70), max_size=6), max_size=5),
        "image": st.dictionaries(st.sampled_from(["url", "s3_uri", "base64", "path"]), _scalars, max_size=3),
        "system_prompt": _scalars,
        "stream": _scalars,
        "remember": _scalars,
        "extra": _scalars,
    },
)
_bodies = st.one_of(
    st.binary(max_size=300),
    st.text(max_size=300),
    _json,
    _requestish,
    _requestish.map(json.dumps),
    _requestish.map(lambda d: json.dumps(d).encode()),
)


@settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(_bodies)
def test_fuzz_parse_request_returns_a_request_or_raises_service_error(body) -> None:
    try:
        request = parse(body)
    except ServiceError as error:
        assert error.code in (ErrorCode.INVALID_REQUEST, ErrorCode.INVALID_PARAMETER, ErrorCode.PAYLOAD_TOO_LARGE)
        assert error.message
        return
    assert isinstance(request, REQUEST_CLASSES)
    assert isinstance(request.canonical(), (OpenSessionRequest, GenerateRequest, ResetRequest, CloseSessionRequest))


def test_deeply_nested_json_is_refused_not_crashing() -> None:
    body = b'{"type": "generate", "prompt": "hi", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    assert fail(body, max_body_bytes=10**6).code == ErrorCode.INVALID_REQUEST
    nested: list = []
    for _ in range(5000):
        nested = [nested]
    assert fail({"type": "reset", "x": nested}).code == ErrorCode.INVALID_REQUEST


# --- responses -----------------------------------------------------------------------------


def test_response_shapes() -> None:
    details = GenerationDetails(
        finish_reason="length",
        prompt_tokens=12,
        cached_tokens=600,
        generated_tokens=3,
        seed=7,
        restored_from="features",
        tokens=[TokenInfo(id=5, text="a", logprob=-0.1)],
        timings={"ttft_ms": 41.5},
    )
    assert json.loads(GenerateResponse(generated_text="abc", details=details).model_dump_json()) == {
        "generated_text": "abc",
        "details": {
            "finish_reason": "length",
            "prompt_tokens": 12,
            "cached_tokens": 600,
            "generated_tokens": 3,
            "seed": 7,
            "restored_from": "features",
            "max_new_tokens": None,
            "truncated_turns": 0,
            "tokens": [{"id": 5, "text": "a", "logprob": -0.1, "special": False}],
            "timings": {"ttft_ms": 41.5},
        },
        "choices": None,  # encode_answer leaves it out unless there are several answers
    }
    opened = OpenSessionResponse(
        session_id="ts-seq-1", expires_at=format_expires(0), image_tokens=576, timings={"fetch_ms": 1.0}
    )
    assert opened.model_dump() == {
        "session_id": "ts-seq-1",
        "expires_at": "1970-01-01T00:00:00Z",
        "image_tokens": 576,
        "timings": {"fetch_ms": 1.0},
        "warnings": None,  # encode_open leaves it out unless there is one
    }
    assert CloseResponse(session_id="s").model_dump() == {"session_id": "s", "closed": True, "success": True}
    assert ResetResponse(session_id="s").model_dump() == {"session_id": "s", "reset": True}
    assert StartSessionResponse(session_id="s").model_dump() == {"session_id": "s"}
    assert SendTextPromptResponse(response_text="t").model_dump() == {"response_text": "t"}
    error = ServiceError(ErrorCode.SESSION_NOT_FOUND, "unknown session")
    assert ErrorBody.from_error(error).model_dump() == {"error": {"code": error.code.value, "message": error.message}}
    with pytest.raises(ValidationError):
        GenerationDetails(finish_reason="eos", prompt_tokens=1, cached_tokens=0, generated_tokens=1)


def test_stream_lines_follow_the_lmi_jsonlines_format() -> None:
    chunk = StreamLine(token=TokenInfo(id=7, text=" cat", logprob=None)).to_line()
    assert chunk.endswith(b"\n") and chunk.count(b"\n") == 1
    assert json.loads(chunk) == {
        "token": {"id": 7, "text": " cat", "logprob": None, "special": False},
        "generated_text": None,
        "details": None,
    }

    details = GenerationDetails(finish_reason="stop", prompt_tokens=3, cached_tokens=0, generated_tokens=1)
    eos = TokenInfo(id=2, text="", logprob=-0.1, special=True)  # the last token travels with the text (TGI)
    last = json.loads(StreamLine(token=eos, generated_text=" cat", details=details).to_line())
    assert last["token"] == {"id": 2, "text": "", "logprob": -0.1, "special": True} and last["generated_text"] == " cat"
    assert last["details"]["finish_reason"] == "stop" and "error" not in last

    err = json.loads(StreamLine.for_error(ServiceError(ErrorCode.INTERNAL_ERROR, "generation failed")).to_line())
    assert err == {
        "token": None,
        "generated_text": None,
        "details": None,
        "error": {"code": "internal_error", "message": "generation failed"},
    }


# --- session headers -----------------------------------------------------------------------


def _botocore_patterns() -> dict[str, tuple[str, int]]:
    model = botocore.session.get_session().get_service_model("sagemaker-runtime")
    out = {}
    for shape in (
        model.operation_model("InvokeEndpoint").input_shape,
        model.operation_model("InvokeEndpoint").output_shape,
    ):
        for name, member in shape.members.items():
            if "SessionId" in name:
                out[name] = (member.metadata["pattern"], member.metadata["max"])
    return out


def test_header_constants_match_botocore() -> None:
    model = botocore.session.get_session().get_service_model("sagemaker-runtime")
    out = model.operation_model("InvokeEndpoint").output_shape.members
    assert out["NewSessionId"].serialization["name"] == NEW_SESSION_ID_HEADER
    assert out["ClosedSessionId"].serialization["name"] == CLOSED_SESSION_ID_HEADER
    inp = model.operation_model("InvokeEndpoint").input_shape.members
    assert inp["SessionId"].serialization["name"] == SESSION_ID_HEADER
    assert re.match(inp["SessionId"].metadata["pattern"], NEW_SESSION_LITERAL)


def test_session_header_value_matches_the_botocore_pattern() -> None:
    patterns = _botocore_patterns()
    pattern, max_len = patterns["NewSessionId"]
    value = session_header_value("ts-seq-0b8a4c8e-1f0e-4d8e-9a34-0c5d3f1e2a7b", 1_700_000_000)
    assert value == "ts-seq-0b8a4c8e-1f0e-4d8e-9a34-0c5d3f1e2a7b; Expires=2023-11-14T22:13:20Z"
    assert re.match(pattern, value) and len(value) <= max_len
    longest = session_header_value("a" * 226, 0)
    assert len(longest) == max_len and re.match(pattern, longest)
    with pytest.raises(ValueError, match="header"):
        session_header_value("a" * 227, 0)
    for bad in ["", "ts_seq_1", "-abc", "abc-", "NEW SESSION", "abc\n"]:
        with pytest.raises(ValueError):
            session_header_value(bad, 0)


def test_format_expires_is_utc() -> None:
    assert format_expires(0) == "1970-01-01T00:00:00Z"
    assert format_expires(1_700_000_000) == "2023-11-14T22:13:20Z"
    assert format_expires(1_700_000_000.9) == "2023-11-14T22:13:20Z"  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("value", "valid"),
    [
        ("ts-seq-0b8a4c8e-1f0e-4d8e-9a34-0c5d3f1e2a7b", True),
        ("a", True),
        ("a--b", True),
        ("A1" * 128, True),
        ("a" * 257, False),
        ("", False),
        ("-a", False),
        ("a-", False),
        ("a_b", False),
        ("a\n", False),
        ("NEW_SESSION", False),
        ("a" + "-" * 250 + "!", False),
    ],
)
def test_session_id_re_matches_botocore(value: str, valid: bool) -> None:
    pattern, max_len = _botocore_patterns()["ClosedSessionId"]
    botocore_says = bool(re.fullmatch(pattern.strip("^$"), value)) and len(value) <= max_len
    assert botocore_says == valid
    assert bool(SESSION_ID_RE.match(value)) == valid


def test_open_session_history_is_validated():
    from llava_sessions.native.protocol import OpenSessionRequest, parse_request

    limits = {"max_body_bytes": 6_291_456, "max_prompt_chars": 100, "max_new_tokens_cap": 1024}
    body = {
        "type": "open_session",
        "image": {"s3_uri": "s3://bucket/key.jpg"},
        "history": [{"prompt": "What is it?", "answer": "A cat."}],
    }
    request = parse_request(body, **limits)
    assert isinstance(request, OpenSessionRequest) and request.history[0].answer == "A cat."
    for bad, code in [
        ([{"prompt": "x"}], "invalid_request"),
        ([{"prompt": "x", "answer": "y", "extra": 1}], "invalid_request"),
        ([{"prompt": "", "answer": "y"}], "invalid_parameter"),
        ([{"prompt": "x" * 101, "answer": "y"}], "invalid_parameter"),
    ]:
        with pytest.raises(ServiceError) as e:
            parse_request({**body, "history": bad}, **limits)
        assert e.value.code.value == code, (bad, e.value.message)


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"type": "generate", "prompt": "x", "session_id": "abc"}, "X-Amzn-SageMaker-Session-Id header"),
        ({"type": "open_session", "image": {"url": "data:image/png;base64,AAAA"}}, "goes in image.base64"),
    ],
)
def test_a_misplaced_field_points_to_where_it_goes(body, says):
    with pytest.raises(ServiceError) as err:
        parse_request(json.dumps(body), max_body_bytes=10**7, max_prompt_chars=1000, max_new_tokens_cap=100)
    assert says in err.value.message
