"""llava_client over SageMaker: a real boto3 ``sagemaker-runtime`` client, stubbed at botocore's edge.

- ``invoke_endpoint`` calls go through botocore's :class:`~botocore.stub.Stubber`, which checks the
  exact parameters sent (``SessionId``, ``Body``, ...) and returns parsed responses.
- Streaming cannot go through the Stubber: it validates a stubbed ``Body`` against the
  ``ResponseStream`` shape and refuses anything but a dict, so no event iterable can be queued.
  Those tests answer at the HTTP layer instead (botocore's ``before-send`` event) with real
  ``application/vnd.amazon.eventstream`` bytes, which botocore's own parser decodes; that also
  checks the real header and error-body parsing (``NewSessionId`` header, ``ModelError`` fields).
"""

from __future__ import annotations

import binascii
import io
import json
import struct
from datetime import datetime, timezone

import boto3
import pytest
import urllib3
from botocore.awsrequest import AWSResponse
from botocore.response import StreamingBody
from botocore.stub import ANY, Stubber

from llava_client import (
    ContextLengthExceeded,
    InternalServerError,
    InvalidRequest,
    Overloaded,
    PayloadTooLarge,
    RateLimited,
    SageMakerTransport,
    SessionBusy,
    SessionClient,
    SessionEvicted,
    SessionExpired,
    SessionNotFound,
)

ENDPOINT = "llava-test"
EXPIRES = "2030-01-02T03:04:05Z"


@pytest.fixture
def runtime():
    return boto3.client(
        "sagemaker-runtime", region_name="us-east-1", aws_access_key_id="testing", aws_secret_access_key="testing"
    )


def body_of(obj) -> StreamingBody:
    data = json.dumps(obj).encode()
    return StreamingBody(io.BytesIO(data), len(data))


def wire(request: dict) -> bytes:
    """The exact body the client sends for ``request`` (compact JSON; parameters in the order of
    ``GenerationParams``: max_new_tokens, temperature, top_p, top_k, repetition_penalty, do_sample,
    seed, details, stop)."""
    return json.dumps(request, ensure_ascii=False, separators=(",", ":")).encode()


def params(session_id, request=None):
    return {
        "EndpointName": ENDPOINT,
        "Body": wire(request) if request is not None else ANY,
        "ContentType": "application/json",
        "Accept": "application/json",
        "SessionId": session_id,
    }


def generate(prompt, remember=True, **parameters):
    return {"type": "generate", "prompt": prompt, "parameters": parameters, "stream": False, "remember": remember}


def answer(text, generated_tokens=3):
    return {
        "generated_text": text,
        "details": {
            "finish_reason": "length",
            "prompt_tokens": 600,
            "cached_tokens": 584,
            "generated_tokens": generated_tokens,
            "tokens": None,
            "timings": {"ttft_ms": 5.0},
        },
    }


def opened(session_id):
    return {
        "Body": body_of({"session_id": session_id, "expires_at": EXPIRES, "image_tokens": 576, "timings": {}}),
        "ContentType": "application/json",
        "NewSessionId": f"{session_id}; Expires={EXPIRES}",
    }


def model_error(stub, status, body):
    stub.add_client_error(
        "invoke_endpoint",
        service_error_code="ModelError",
        service_message="container error",
        http_status_code=424,
        modeled_fields={
            "OriginalStatusCode": status,
            "OriginalMessage": json.dumps(body),
            "LogStreamArn": "arn:aws:logs:us-east-1:123456789012:log-group:x",
        },
    )


IMAGE = {"type": "open_session", "image": {"s3_uri": "s3://bucket/photo.jpg"}}


def test_session_ids_sent_and_parsed(runtime):
    client = SessionClient(SageMakerTransport(ENDPOINT, client=runtime), max_retries=0)
    with Stubber(runtime) as stub:
        stub.add_response("invoke_endpoint", opened("sess-1"), params("NEW_SESSION", IMAGE))
        stub.add_response(
            "invoke_endpoint",
            {"Body": body_of(answer("An astronaut."))},
            params("sess-1", generate("What is it?", max_new_tokens=4)),
        )
        stub.add_response(
            "invoke_endpoint",
            {"Body": body_of(answer("Space.")), "ContentType": "application/json"},
            params("sess-1", generate("Where?", remember=False, temperature=0.0)),
        )
        closed = {"session_id": "sess-1", "closed": True, "success": True}
        stub.add_response(
            "invoke_endpoint",
            {"Body": body_of(closed), "ClosedSessionId": "sess-1"},
            params("sess-1", {"type": "close_session"}),
        )
        with client.open_session("s3://bucket/photo.jpg") as session:
            assert session.id == "sess-1"
            assert session.expires_at == datetime(2030, 1, 2, 3, 4, 5, tzinfo=timezone.utc)
            assert session.image_tokens == 576
            first = session.ask("What is it?", max_new_tokens=4)
            assert first.text == "An astronaut." and first.usage.cached_tokens == 584 and first.ttft_ms == 5.0
            assert session.ask("Where?", remember=False, temperature=0.0).text == "Space."
            assert [p for p, _ in session.history] == ["What is it?"]
        assert session.closed
        stub.assert_no_pending_responses()


def test_transport_reads_new_and_closed_session_ids(runtime):
    transport = SageMakerTransport(ENDPOINT, client=runtime)
    with Stubber(runtime) as stub:
        stub.add_response("invoke_endpoint", opened("sess-9"), params("NEW_SESSION"))
        stub.add_response(
            "invoke_endpoint",
            {"Body": body_of({"session_id": "sess-9", "closed": True}), "ClosedSessionId": "sess-9"},
            params("sess-9"),
        )
        assert transport.invoke(wire(IMAGE), session_id=None).new_session_id == f"sess-9; Expires={EXPIRES}"
        assert transport.invoke(b'{"type":"close_session"}', session_id="sess-9").closed_session_id == "sess-9"
    with pytest.raises(ValueError, match="NEW_SESSION"):
        transport.invoke_stream(b"{}", session_id="NEW_SESSION")


@pytest.mark.parametrize(
    ("status", "body", "error_type", "code"),
    [
        (
            404,
            {"error": {"code": "session_not_found", "message": "unknown session"}},
            SessionNotFound,
            "session_not_found",
        ),
        (404, {"error": {"code": "session_expired", "message": "expired"}}, SessionExpired, "session_expired"),
        (404, {"error": {"code": "session_evicted", "message": "evicted"}}, SessionEvicted, "session_evicted"),
        (
            400,
            {"error": {"code": "invalid_parameter", "message": "parameters.top_p: must be > 0 and <= 1"}},
            InvalidRequest,
            "invalid_parameter",
        ),
        (409, {"error": {"code": "session_busy", "message": "busy"}}, SessionBusy, "session_busy"),
        (413, {"error": {"code": "image_too_large", "message": "too many pixels"}}, PayloadTooLarge, "image_too_large"),
        (
            422,
            {"error": {"code": "context_length_exceeded", "message": "too long"}},
            ContextLengthExceeded,
            "context_length_exceeded",
        ),
        (503, {"error": {"code": "overloaded", "message": "retry later"}}, Overloaded, "overloaded"),
        (
            500,
            {"error": {"code": "internal_error", "message": "internal error"}},
            InternalServerError,
            "internal_error",
        ),
        (
            507,
            {"code": 507, "type": "InternalServerException", "message": "Worker died."},
            InternalServerError,
            "InternalServerException",
        ),
    ],
)
def test_model_error_maps_by_original_status_code(runtime, status, body, error_type, code):
    transport = SageMakerTransport(ENDPOINT, client=runtime)
    with Stubber(runtime) as stub:
        model_error(stub, status, body)
        with pytest.raises(error_type) as info:
            transport.invoke(b"{}", session_id="sess-1")
    assert info.value.status_code == status and info.value.code == code and info.value.message


def test_throttling_is_retried_even_for_a_remembered_question(runtime):
    client = SessionClient(SageMakerTransport(ENDPOINT, client=runtime), max_retries=2)
    with Stubber(runtime) as stub:
        stub.add_response("invoke_endpoint", opened("sess-1"), params("NEW_SESSION"))
        stub.add_client_error("invoke_endpoint", "ThrottlingException", "Rate exceeded", 400)
        stub.add_client_error("invoke_endpoint", "ModelNotReadyException", "not ready", 429)
        stub.add_response("invoke_endpoint", {"Body": body_of(answer("Hi."))}, params("sess-1"))
        session = client.open_session("s3://bucket/photo.jpg")
        assert session.ask("Hello?").text == "Hi."
        stub.assert_no_pending_responses()
    with Stubber(runtime) as stub:  # without retries left, the typed error surfaces
        stub.add_client_error("invoke_endpoint", "ThrottlingException", "Rate exceeded", 400)
        with pytest.raises(RateLimited):
            SessionClient(SageMakerTransport(ENDPOINT, client=runtime), max_retries=0).open_session("s3://b/k.jpg")


def test_a_remembered_question_is_not_retried_after_a_failure_that_may_have_run_it(runtime):
    client = SessionClient(SageMakerTransport(ENDPOINT, client=runtime), max_retries=2)
    with Stubber(runtime) as stub:
        stub.add_response("invoke_endpoint", opened("sess-1"), params("NEW_SESSION"))
        model_error(stub, 500, {"error": {"code": "internal_error", "message": "boom"}})
        session = client.open_session("s3://bucket/photo.jpg")
        with pytest.raises(InternalServerError):
            session.ask("Hello?")
        stub.assert_no_pending_responses()  # one attempt only


def test_recovery_reopens_with_new_session_and_restores_history(runtime, caplog):
    client = SessionClient(SageMakerTransport(ENDPOINT, client=runtime), max_retries=0)
    gone = {"error": {"code": "session_not_found", "message": "unknown session"}}
    with Stubber(runtime) as stub:
        stub.add_response("invoke_endpoint", opened("sess-1"), params("NEW_SESSION", IMAGE))
        stub.add_response(
            "invoke_endpoint",
            {"Body": body_of(answer("One two three", generated_tokens=3))},
            params("sess-1", generate("First?")),
        )
        stub.add_response(
            "invoke_endpoint",
            {"Body": body_of(answer("Sampled", generated_tokens=2))},
            params("sess-1", generate("Second?", max_new_tokens=5, do_sample=True, seed=7)),
        )
        model_error(stub, 404, gone)
        # recovery: reopen on the same image with both turns as history (one call, nothing regenerated)
        restore = {
            **IMAGE,
            "history": [{"prompt": "First?", "answer": "One two three"}, {"prompt": "Second?", "answer": "Sampled"}],
        }
        stub.add_response("invoke_endpoint", opened("sess-2"), params("NEW_SESSION", restore))
        stub.add_response(
            "invoke_endpoint", {"Body": body_of(answer("Third answer"))}, params("sess-2", generate("Third?"))
        )
        session = client.open_session("s3://bucket/photo.jpg")
        session.ask("First?")
        session.ask("Second?", max_new_tokens=5, do_sample=True, seed=7)
        assert session.ask("Third?").text == "Third answer"
        stub.assert_no_pending_responses()
    assert session.id == "sess-2" and session.recoveries == 1
    recovery = session.last_recovery
    assert recovery.old_session_id == "sess-1" and recovery.new_session_id == "sess-2"
    assert recovery.replayed_turns == 2
    assert [a.text for _, a in session.history] == ["One two three", "Sampled", "Third answer"]
    assert "restored as sess-2 with its 2 remembered turns" in caplog.text


# --------------------------------------------------------------------------------------------
# Streaming, at the HTTP layer (see the module docstring)
# --------------------------------------------------------------------------------------------


def _header(name: str, value: str) -> bytes:
    raw = value.encode()
    return struct.pack("B", len(name)) + name.encode() + b"\x07" + struct.pack(">H", len(raw)) + raw


def event_message(headers: dict[str, str], payload: bytes) -> bytes:
    """One AWS event-stream message (prelude, CRCs, string headers, payload)."""
    head = b"".join(_header(k, v) for k, v in headers.items())
    total = 12 + len(head) + len(payload) + 4
    prelude = struct.pack(">II", total, len(head))
    prelude += struct.pack(">I", binascii.crc32(prelude) & 0xFFFFFFFF)
    message = prelude + head + payload
    return message + struct.pack(">I", binascii.crc32(message) & 0xFFFFFFFF)


def payload_part(data: bytes) -> bytes:
    return event_message(
        {":event-type": "PayloadPart", ":content-type": "application/octet-stream", ":message-type": "event"}, data
    )


def stream_error(data: dict) -> bytes:
    return event_message(
        {":exception-type": "ModelStreamError", ":content-type": "application/json", ":message-type": "exception"},
        json.dumps(data).encode(),
    )


class WireSageMaker:
    """Answers a real boto3 client's HTTP requests with queued raw responses; records what was sent."""

    def __init__(self, client) -> None:
        self.queue: list[tuple[int, dict, bytes]] = []
        self.sent: list[tuple[str, dict, bytes]] = []
        client.meta.events.register("before-send.sagemaker-runtime.*", self._send)

    def add(self, status: int, headers: dict, body: bytes) -> None:
        self.queue.append((status, headers, body))

    def _send(self, request, **kwargs):
        self.sent.append((request.url, dict(request.headers), request.body))
        status, headers, body = self.queue.pop(0)
        raw = urllib3.HTTPResponse(body=io.BytesIO(body), headers=headers, status=status, preload_content=False)
        return AWSResponse(request.url, status, headers, raw)


def _line(obj) -> bytes:
    return json.dumps(obj, ensure_ascii=False).encode() + b"\n"


def _token_line(i, text):
    return _line({"token": {"id": i, "text": text, "logprob": -0.5}, "generated_text": None, "details": None})


def _open_over_wire(fake: WireSageMaker, session_id="sess-1") -> None:
    body = json.dumps({"session_id": session_id, "expires_at": EXPIRES, "image_tokens": 576, "timings": {}}).encode()
    headers = {
        "Content-Type": "application/json",
        "X-Amzn-SageMaker-New-Session-Id": f"{session_id}; Expires={EXPIRES}",
    }
    fake.add(200, headers, body)


EVENTSTREAM = {
    "Content-Type": "application/vnd.amazon.eventstream",
    "X-Amzn-SageMaker-Content-Type": "application/jsonlines",
}


def test_stream_reassembles_lines_split_across_payload_parts(runtime):
    fake = WireSageMaker(runtime)
    client = SessionClient(SageMakerTransport(ENDPOINT, client=runtime), max_retries=0)
    _open_over_wire(fake)
    final = _line({"token": None, "generated_text": "Café 日本 ok", "details": answer("", 3)["details"]})
    data = _token_line(1, "Café") + _token_line(2, " 日本") + _token_line(3, " ok") + final
    cut_in_char = data.index(" 日本".encode()) + 2  # inside the 3-byte UTF-8 encoding of 日
    cuts = sorted({5, data.index(b"\n") + 1, cut_in_char, cut_in_char + 1, len(data) - 3})
    parts = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]
    assert any(len(p) < 3 and p[0] >= 0x80 for p in parts if p)  # a piece of a multi-byte character alone
    fake.add(200, EVENTSTREAM, b"".join(payload_part(p) for p in parts))

    session = client.open_session("s3://bucket/photo.jpg")
    assert session.id == "sess-1" and session.expires_at.year == 2030  # NewSessionId from the real header
    with session.stream("Describe it.") as stream:
        pieces = list(stream)
    assert pieces == ["Café", " 日本", " ok"] and stream.answer.text == "Café 日本 ok"
    assert [t.id for t in stream.answer.tokens] == [1, 2, 3] and session.history[0][1] is stream.answer

    open_url, open_headers, _ = fake.sent[0]
    stream_url, stream_headers, stream_body = fake.sent[1]
    assert open_url.endswith(f"/endpoints/{ENDPOINT}/invocations")
    assert open_headers["X-Amzn-SageMaker-Session-Id"] == b"NEW_SESSION"
    assert stream_url.endswith(f"/endpoints/{ENDPOINT}/invocations-response-stream")
    assert stream_headers["X-Amzn-SageMaker-Session-Id"] == b"sess-1"
    assert json.loads(stream_body)["stream"] is True


def test_errors_in_and_before_a_stream(runtime):
    fake = WireSageMaker(runtime)
    client = SessionClient(SageMakerTransport(ENDPOINT, client=runtime), max_retries=0, auto_recover=False)
    _open_over_wire(fake)
    session = client.open_session("s3://bucket/photo.jpg")

    # an error line after tokens (TorchServe already sent status 200)
    fake.add(
        200,
        EVENTSTREAM,
        payload_part(
            _token_line(1, "An")
            + _line(
                {
                    "token": None,
                    "generated_text": None,
                    "details": None,
                    "error": {"code": "overloaded", "message": "out of memory mid-answer"},
                }
            )
        ),
    )
    with session.stream("Describe it.") as stream:
        assert next(stream) == "An"
        with pytest.raises(Overloaded) as info:
            next(stream)
    assert info.value.code == "overloaded" and info.value.status_code == 503 and session.history == []

    # SageMaker's own ModelStreamError event
    fake.add(
        200,
        EVENTSTREAM,
        payload_part(_token_line(1, "An"))
        + stream_error({"Message": "model stream broke", "ErrorCode": "ModelStreamError"}),
    )
    with pytest.raises(InternalServerError) as info, session.stream("Describe it.") as stream:
        list(stream)
    assert "model stream broke" in info.value.message

    # the container refused the stream at once: ModelError with the container's status and body
    original = json.dumps({"error": {"code": "session_expired", "message": "session expired"}})
    fake.add(
        424,
        {"Content-Type": "application/json", "x-amzn-ErrorType": "ModelError"},
        json.dumps(
            {
                "Message": "Received client error (404)",
                "OriginalStatusCode": 404,
                "OriginalMessage": original,
                "LogStreamArn": "arn:x",
            }
        ).encode(),
    )
    with pytest.raises(SessionExpired) as info:
        session.stream("Describe it.")
    assert info.value.status_code == 404


def test_from_endpoint_makes_a_client_without_botocore_retries():
    client = SessionClient.from_endpoint(ENDPOINT, region_name="eu-west-1", timeout=(3.0, 45.0))
    transport = client.transport
    assert isinstance(transport, SageMakerTransport) and transport.endpoint_name == ENDPOINT
    config = transport.client.meta.config
    assert transport.client.meta.region_name == "eu-west-1"
    assert (config.connect_timeout, config.read_timeout) == (3.0, 45.0)
    assert config.retries["total_max_attempts"] == 1  # retries are the SessionClient's own
