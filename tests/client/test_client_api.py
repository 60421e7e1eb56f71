"""The public API of llava_client, pinned; and its pure pieces (error mapping, retry rule, parsing)."""

from __future__ import annotations

import json
import os
from datetime import datetime, timezone

import pytest

import llava_client
from llava_client import (
    APIConnectionError,
    APIStatusError,
    APITimeoutError,
    ContextLengthExceeded,
    GenerationParams,
    InternalServerError,
    InvalidRequest,
    LlavaError,
    Overloaded,
    PayloadTooLarge,
    RateLimited,
    SessionBusy,
    SessionEvicted,
    SessionExpired,
    SessionGone,
    SessionNotFound,
    error_class,
    parse_session_header,
    should_retry,
)
from llava_client._exceptions import CODE_STATUS, status_error_from_body
from llava_client._transport import LineBuffer

PUBLIC_API = [
    "DEFAULT_MAX_RETRIES",
    "DEFAULT_RESTART_WAIT_S",
    "DEFAULT_TIMEOUT",
    "INITIAL_RETRY_DELAY_S",
    "MAX_BODY_BYTES",
    "MAX_RETRY_DELAY_S",
    "APIConnectionError",
    "APIStatusError",
    "APITimeoutError",
    "AddedImage",
    "Answer",
    "AnswerStream",
    "AuthenticationError",
    "ChatReply",
    "ChatSession",
    "ChatStream",
    "ChatStreamEvent",
    "ChatUsage",
    "ContextLengthExceeded",
    "Conversation",
    "GenerationParams",
    "HttpTransport",
    "ImageInput",
    "ImageLimitExceeded",
    "InternalServerError",
    "InvalidRequest",
    "LlavaError",
    "Overloaded",
    "PayloadTooLarge",
    "RateLimited",
    "RawResponse",
    "Recovery",
    "SageMakerTransport",
    "Session",
    "SessionBusy",
    "SessionClient",
    "SessionEvicted",
    "SessionExpired",
    "SessionGone",
    "SessionNotFound",
    "Token",
    "Transport",
    "Usage",
    "error_class",
    "image_part",
    "video_part",
    "parse_session_header",
    "should_retry",
]


def test_public_api_is_pinned():
    assert llava_client.__all__ == PUBLIC_API
    for name in PUBLIC_API:
        assert getattr(llava_client, name) is not None


def test_exception_hierarchy():
    for cls in (APIConnectionError, APIStatusError):
        assert issubclass(cls, LlavaError)
    assert issubclass(APITimeoutError, APIConnectionError)
    for cls in (
        InvalidRequest,
        SessionGone,
        SessionBusy,
        PayloadTooLarge,
        ContextLengthExceeded,
        RateLimited,
        Overloaded,
        InternalServerError,
    ):
        assert issubclass(cls, APIStatusError)
    for cls in (SessionNotFound, SessionExpired, SessionEvicted):
        assert issubclass(cls, SessionGone)


def test_code_statuses_match_the_server():
    from llava_sessions.errors import HTTP_STATUS

    assert {code.value: status for code, status in HTTP_STATUS.items()} == CODE_STATUS


@pytest.mark.parametrize(
    ("status", "code", "expected"),
    [
        (400, "invalid_parameter", InvalidRequest),
        (400, "image_invalid", InvalidRequest),
        (400, "missing_session_id", InvalidRequest),
        (404, "session_not_found", SessionNotFound),
        (404, "session_expired", SessionExpired),
        (404, "session_evicted", SessionEvicted),
        (404, None, APIStatusError),  # a wrong URL is not a lost session
        (404, "ResourceNotFoundException", APIStatusError),
        (409, "session_busy", SessionBusy),
        (413, "payload_too_large", PayloadTooLarge),
        (413, "image_too_large", PayloadTooLarge),
        (422, "context_length_exceeded", ContextLengthExceeded),
        (422, "image_limit_exceeded", llava_client.ImageLimitExceeded),
        (400, "context_length_exceeded", ContextLengthExceeded),  # the chat dialect's status, OpenAI's
        (400, "image_limit_exceeded", llava_client.ImageLimitExceeded),
        (429, "ThrottlingException", RateLimited),
        (503, "overloaded", Overloaded),
        (503, "ServiceUnavailableException", Overloaded),
        (500, "internal_error", InternalServerError),
        (507, "InternalServerException", InternalServerError),
        (418, None, APIStatusError),
    ],
)
def test_error_class(status, code, expected):
    assert error_class(status, code) is expected


def test_status_error_from_bodies():
    err = status_error_from_body(200, json.dumps({"error": {"code": "overloaded", "message": "later"}}).encode())
    assert isinstance(err, Overloaded) and err.status_code == 503 and err.message == "later"  # error in a 200 body
    err = status_error_from_body(
        503,
        b'{"code": 503, "type": "ServiceUnavailableException", "message": "no worker"}',
        headers={"Retry-After": "2"},
    )
    assert isinstance(err, Overloaded) and err.code == "ServiceUnavailableException" and err.retry_after == 2.0
    err = status_error_from_body(502, b"<html>bad gateway</html>")
    assert isinstance(err, InternalServerError) and "bad gateway" in err.message


def _overloaded(code):
    return Overloaded("x", status_code=503, code=code)


@pytest.mark.parametrize(
    ("error", "retry_safe", "expected"),
    [
        (APIConnectionError(request_sent=False), False, True),  # refused: nothing ran
        (APIConnectionError(request_sent=True), False, False),  # may have appended a turn
        (APIConnectionError(request_sent=True), True, True),
        (APITimeoutError(request_sent=True), False, False),
        (APITimeoutError(request_sent=True), True, True),
        (_overloaded("overloaded"), False, True),  # the handler refused it before any work
        (_overloaded("ServiceUnavailableException"), False, False),
        (_overloaded("ServiceUnavailableException"), True, True),
        (RateLimited("x", status_code=429), False, True),
        (SessionBusy("x", status_code=409, code="session_busy"), False, True),
        (InternalServerError("x", status_code=500), True, False),
        (SessionNotFound("x", status_code=404, code="session_not_found"), True, False),
        (InvalidRequest("x", status_code=400), True, False),
    ],
)
def test_retry_rule(error, retry_safe, expected):
    assert should_retry(error, retry_safe=retry_safe) is expected


def test_parse_session_header():
    assert parse_session_header("ts-seq-1; Expires=2030-01-02T03:04:05Z") == (
        "ts-seq-1",
        datetime(2030, 1, 2, 3, 4, 5, tzinfo=timezone.utc),
    )
    assert parse_session_header("abc") == ("abc", None)
    assert parse_session_header("") == (None, None) and parse_session_header(None) == (None, None)


def test_line_buffer_splits_anywhere():
    data = '{"t":"日本"}\n{"t":"ok"}\n'.encode()
    for cut in range(len(data) + 1):
        buffer = LineBuffer()
        lines = buffer.feed(data[:cut]) + buffer.feed(data[cut:]) + buffer.flush()
        assert [json.loads(line) for line in lines] == [{"t": "日本"}, {"t": "ok"}]
    buffer = LineBuffer()
    assert buffer.feed(b'{"a":1}') == [] and buffer.flush() == [b'{"a":1}']  # an unterminated last line


def test_generation_params_wire():
    params = GenerationParams(max_new_tokens=64, temperature=0.7, seed=5, stop=("\n",), details=True)
    assert params.to_wire() == {"max_new_tokens": 64, "temperature": 0.7, "seed": 5, "details": True, "stop": ["\n"]}
    assert GenerationParams().to_wire() == {}
    # Session.ask's and Session.stream's keywords, one type: a stop string is a one-item tuple
    keywords = GenerationParams.of({"max_new_tokens": 8, "stop": "END", "n": 3, "session_choice": 1})
    assert keywords == GenerationParams(max_new_tokens=8, stop=("END",), n=3, session_choice=1)
    assert keywords.to_wire() == {"max_new_tokens": 8, "n": 3, "session_choice": 1, "stop": ["END"]}


@pytest.mark.parametrize(
    "command", ["llava-chat", "llava-web", "llava-serve", "llava-deploy", "llava-local-endpoint", "llava-tiny-model"]
)
def test_cli_help_is_plain_text_and_says_what_every_option_is(command):
    """``--help`` of every CLI the README names, as the user runs it: exit 0, no reST markup, and no
    option without a description."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    done = subprocess.run(
        [str(Path(sys.executable).parent / command), "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "200"},  # one line an option: its description beside it
    )
    assert done.returncode == 0, done.stderr
    assert "usage:" in done.stdout and "``" not in done.stdout and ":class:" not in done.stdout
    lines = done.stdout.splitlines() + [""]
    options = [i for i, line in enumerate(lines) if re.match(r"^  -", line)]
    described = [  # its description beside it, or on the next line (a long option), indented deeper
        re.match(r"^  \S.*?\S  +\S", lines[i]) or re.match(r"^ {4,}\S", lines[i + 1]) for i in options
    ]
    bare = [lines[i].strip() for i, ok in zip(options, described, strict=True) if not ok]
    assert options and bare == [], bare
    if command == "llava-serve":
        assert "default: 8080" in done.stdout and "default: 600" in done.stdout
    if command == "llava-tiny-model":
        assert all(f"{size}:" in done.stdout for size in ("tiny", "bench", "7b"))


class _Lines:
    """A streamed reply's lines held in memory (what the transports hand the streams)."""

    def __init__(self, *lines: dict | str) -> None:
        self.lines = [line.encode() if isinstance(line, str) else json.dumps(line).encode() for line in lines]
        self.closed = False

    def __iter__(self):
        return iter(self.lines)

    def close(self) -> None:
        self.closed = True


def _token(text: str, last: str | None = None) -> dict:
    return {"token": {"id": 1, "text": text, "logprob": None}, "generated_text": last, "details": None}


_CUT = {"token": None, "generated_text": None, "details": None, "error": {"code": "model_not_ready", "message": "x"}}


def test_a_stream_cut_by_a_dead_worker_goes_on_where_it_stopped_or_raises_if_the_answer_differs():
    """The proxy ends a stream whose worker died with ``model_not_ready``; the stream sends the request
    again and gives only what comes after the text already given. The pieces of the resent answer
    may be cut elsewhere; an answer that differs raises the error, and other errors raise as before."""
    from llava_client import AnswerStream, ChatStream

    again = _Lines(_token("Hel"), _token("lo wor"), _token("ld", last="Hello world"))
    stream = AnswerStream(
        _Lines(_token("Hell"), _token("o"), _CUT), on_answer=None, t0=0.0, session_id="s", resend=lambda: again
    )
    sent = list(stream)
    assert sent == ["Hell", "o", " wor", "ld"] and stream.text == "Hello world" and stream.resumes == 1
    assert stream.answer is not None and [t.text for t in stream.answer.tokens] == ["Hel", "lo wor", "ld"]

    differs = AnswerStream(
        _Lines(_token("Hell"), _CUT), on_answer=None, t0=0.0, session_id="s", resend=lambda: _Lines(_token("Help"))
    )
    with pytest.raises(Overloaded) as raised:
        list(differs)
    assert raised.value.code == "model_not_ready"
    other = {"token": None, "generated_text": None, "details": None, "error": {"code": "overloaded", "message": "x"}}
    no_resend = AnswerStream(_Lines(_token("a"), other), on_answer=None, t0=0.0, session_id="s", resend=lambda: again)
    with pytest.raises(Overloaded) as raised:
        list(no_resend)
    assert raised.value.code == "overloaded" and no_resend.resumes == 0

    def chunk(text: str, finish: str | None = None) -> str:
        return "data: " + json.dumps({"choices": [{"delta": {"content": text}, "finish_reason": finish}]})

    cut = "data: " + json.dumps({"error": {"code": "model_not_ready", "message": "x", "type": "server_error"}})
    chat = ChatStream(
        _Lines(chunk("A b"), cut, "data: [DONE]"),
        session_id="",
        resend=lambda: _Lines(chunk("A"), chunk(" b c"), chunk("", "stop"), "data: [DONE]"),
    )
    assert [e.text for e in chat] == ["A b", " c", ""] and chat.finish_reason == "stop" and chat.resumes == 1


def test_llava_chat_without_aws_configuration_says_what_to_set_in_one_line(tmp_path):
    """``llava-chat --endpoint`` with no region, then no credentials: one line naming what to set, exit
    1, no traceback (it printed 49 to 79 lines)."""
    import os
    import subprocess
    import sys

    bare = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")} | {"HOME": str(tmp_path)}
    (tmp_path / "x.png").write_bytes(_png())
    command = [sys.executable, "-m", "llava_client.cli", "--endpoint", "my-llava", "--image", "x.png", "-q", "hi"]
    for extra, says in (([], "--region"), (["--region", "us-east-1"], "AWS_ACCESS_KEY_ID")):
        done = subprocess.run([*command, *extra], capture_output=True, text=True, timeout=60, env=bare, cwd=tmp_path)
        assert done.returncode == 1 and says in done.stderr, done.stderr
        assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


def _png() -> bytes:
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (8, 8), "white").save(out, "PNG")
    return out.getvalue()


def test_answers_reach_the_terminal_without_their_control_characters():
    """A model's answer may hold ``\\r``, a form feed or an escape sequence, which would overwrite the
    prompt or drive the terminal: llava-chat and the demo show each as U+FFFD, keeping new lines and tabs."""
    from llava_client.cli import terminal_text

    assert terminal_text("a\rb\x0cc\x1b[2Jd\ne\tf") == "a\ufffdb\ufffdc\ufffd[2Jd\ne\tf"
    assert terminal_text("naïve 日本") == "naïve 日本"
