"""SageMaker runtime's wire, as the local endpoint speaks it: limits, header names, the AWS event
stream of ``InvokeEndpointWithResponseStream``, and the ``ModelError`` bodies a container error becomes.

Sources: botocore's ``sagemaker-runtime`` service model (shapes, header names, the 6 MiB limit) and
the AWS event-stream encoding (prelude, string headers, CRC32s).
"""

from __future__ import annotations

import http.client
import json
import struct
import zlib
from collections.abc import Sequence
from typing import Any

__all__ = [
    "EVENT_STREAM_CONTENT_TYPE",
    "HEADER_CUSTOM_ATTRIBUTES",
    "HEADER_STREAM_ACCEPT",
    "HEADER_STREAM_CONTENT_TYPE",
    "MAX_BODY_BYTES",
    "MAX_EVENT_PAYLOAD_BYTES",
    "MODEL_ERROR_TYPE",
    "TIMEOUT_MESSAGE",
    "VARIANT_NAME",
    "encode_event",
    "model_error_body",
    "payload_part_event",
    "read_frame",
    "session_gone_body",
    "stream_error_event",
]

#: SageMaker's request body limit (InvokeEndpoint), bytes.
MAX_BODY_BYTES = 6_291_456
VARIANT_NAME = "AllTraffic"
MODEL_ERROR_TYPE = "ModelError:http://internal.amazon.com/coral/com.amazon.sagemaker/"
HEADER_CUSTOM_ATTRIBUTES = "X-Amzn-SageMaker-Custom-Attributes"
HEADER_STREAM_ACCEPT = "X-Amzn-SageMaker-Accept"
HEADER_STREAM_CONTENT_TYPE = "X-Amzn-SageMaker-Content-Type"
EVENT_STREAM_CONTENT_TYPE = "application/vnd.amazon.eventstream"
#: Largest payload of one PayloadPart event, bytes (a container chunk larger than this is split).
MAX_EVENT_PAYLOAD_BYTES = 64 * 1024
#: What SageMaker says of an invocation that timed out.
TIMEOUT_MESSAGE = (
    "Your invocation timed out while waiting for a response from container primary. Review the latency "
    "metrics for each container in Amazon CloudWatch, resolve the issue, and try again."
)


def encode_event(headers: Sequence[tuple[str, str]], payload: bytes) -> bytes:
    """Encode one AWS event-stream message (string headers only).

    Layout: ``total_length:u32 headers_length:u32 prelude_crc:u32 headers payload message_crc:u32``
    (big-endian), each header ``name_len:u8 name type:u8(7=string) value_len:u16 value``; the prelude
    CRC32 covers the first 8 bytes, the message CRC32 everything before it.
    """
    encoded = b""
    for name, value in headers:
        name_bytes, value_bytes = name.encode(), value.encode()
        encoded += struct.pack(">B", len(name_bytes)) + name_bytes
        encoded += struct.pack(">BH", 7, len(value_bytes)) + value_bytes
    total = 12 + len(encoded) + len(payload) + 4
    prelude = struct.pack(">II", total, len(encoded))
    message = prelude + struct.pack(">I", zlib.crc32(prelude)) + encoded + payload
    return message + struct.pack(">I", zlib.crc32(message))


def payload_part_event(data: bytes) -> bytes:
    """A ``PayloadPart`` event carrying ``data`` (botocore: ``{"PayloadPart": {"Bytes": data}}``)."""
    return encode_event(
        [(":event-type", "PayloadPart"), (":content-type", "application/octet-stream"), (":message-type", "event")],
        data,
    )


def stream_error_event(message: str, error_code: str = "StreamBroken") -> bytes:
    """A ``ModelStreamError`` exception event (botocore raises ``EventStreamError`` for it)."""
    body = json.dumps({"Message": message, "ErrorCode": error_code}).encode()
    return encode_event(
        [
            (":exception-type", "ModelStreamError"),
            (":content-type", "application/json"),
            (":message-type", "exception"),
        ],
        body,
    )


def model_error_body(
    original_status: int, original_body: bytes, *, endpoint: str, backend: int, log_hint: str = ""
) -> dict[str, Any]:
    """Return SageMaker's ``ModelError`` JSON for a container reply with status >= 400.

    ``original_status`` 0 stands for "no reply in time" (SageMaker reports a timed-out invocation
    as a server error with status 0).
    """
    text = original_body.decode("utf-8", "replace")
    client_side = 400 <= original_status < 500
    kind = "client" if client_side else "server"
    see = f" See {log_hint} for more information." if log_hint else ""
    return {
        "ErrorCode": "CLIENT_ERROR_FROM_MODEL" if client_side else "INTERNAL_FAILURE_FROM_MODEL",
        "Message": f'Received {kind} error ({original_status}) from primary with message "{text}".{see}',
        "OriginalStatusCode": original_status,
        "OriginalMessage": text,
        "LogStreamArn": f"arn:aws:logs:local:000000000000:log-group:/aws/sagemaker/Endpoints/{endpoint}"
        f":log-stream:{VARIANT_NAME}/backend-{backend}",
    }


def session_gone_body(session_id: str, reason: str) -> bytes:
    """The ``session_not_found`` error body of a session whose backend is gone (``reason``)."""
    return json.dumps(
        {"error": {"code": "session_not_found", "message": f"session {session_id} is gone: {reason}"}}
    ).encode()


def read_frame(response: http.client.HTTPResponse, limit: int = MAX_EVENT_PAYLOAD_BYTES) -> bytes:
    """The next frame of the container's chunked reply, whole: the rest of its current chunk, up to
    ``limit`` bytes (b"" at the end). ``read1`` alone returns what the socket holds, which under load can
    be part of a chunk: a stream event would then reach the client split across two PayloadParts, where
    the server writes each event in a frame of its own for the clients that parse one event per part.

    Raises:
        http.client.HTTPException, OSError: the container broke off the reply.
    """
    piece = response.read1(limit)
    while piece and len(piece) < limit:
        left = getattr(response, "chunk_left", None)  # http.client's count of the current chunk's unread bytes
        if not left:
            break
        piece += response.read1(min(left, limit - len(piece)))  # the chunk's rest is on its way
    return piece
