"""TorchServe's framing, in one place: requests in from the worker's context, a dialect's frames out to it.

TorchServe's sequence + continuous batching (docs/platform.md, verified):

- a request's stopping criterion decides its framing: None, one whole response; False, a chunk whose
  request comes back (without its body) in a later ``handle()`` call; True, the last chunk;
- status, headers and content type go out with a request's FIRST frame, even an empty one; later ones
  reach TorchServe, not the client; an empty chunk sends nothing to the client;
- a first frame that is also the last chunk gets no response head (the client hangs): it must be a
  whole response;
- the sequence-end header (``ctx.header_key_sequence_end``) ends the request's job group at once;
- raising out of ``handle()`` fails every request of the batch, and ``send_intermediate_predict_response``
  crashes sequence continuous batching: neither is used.

:func:`read_requests` and :func:`write_replies` are the entry's two sides; :class:`Framing` is what the
service and both dialects build each request's answer with. No torch, no TorchServe import here.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .contract import (
    CLOSED_SESSION_ID_HEADER,
    CUSTOM_ATTRIBUTES_HEADER,
    IMAGE_TICKET_HEADER,
    OPENAI_ROUTE_HEADER,
    SEQUENCE_END_HEADER,
)

__all__ = [
    "EVENT_STREAM",
    "EVENT_STREAM_UTF8",
    "JSON",
    "JSON_LINES",
    "Framing",
    "BatchRequest",
    "Reply",
    "cut_stream_tail",
    "read_requests",
    "write_replies",
]

#: Content type of whole replies.
JSON = "application/json"
#: Content type of JSON-lines streams (SageMaker LMI / TGI; a chat stream when ``Accept`` asks for it).
JSON_LINES = "application/jsonlines"
#: Media type of server-sent events (OpenAI's chat streams).
EVENT_STREAM = "text/event-stream"
#: The content type a chat stream is sent with: its charset named, as vLLM's and OpenAI's are (without
#: it, ``requests`` decodes ``text/*`` as ISO-8859-1, RFC 2616's default, and "naïve" reads "naÃ¯ve").
EVENT_STREAM_UTF8 = f"{EVENT_STREAM}; charset=utf-8"


@dataclass
class BatchRequest:
    """One request of a TorchServe batch.

    Attributes:
        request_id: TorchServe's request id (stable across a request's continuations).
        session_id: the sequence id header's value (``X-Amzn-SageMaker-Session-Id``), or None.
        minted: TorchServe minted ``session_id`` because the request came without one.
        body: the request body (bytes, or the dict TorchServe decoded); None on continuations.
        accept: the request's ``Accept`` header (``application/jsonlines`` asks a chat stream in
            JSON lines rather than server-sent events), or None.
        custom_attributes: SageMaker's ``X-Amzn-SageMaker-Custom-Attributes`` header (it may carry
            ``cache_salt=<salt>``), or None.
        image_ticket: the proxy's ticket for the images it fetched for this request
            (:data:`~llava_sessions.wire.contract.IMAGE_TICKET_HEADER`), or None.
        openai_route: the proxy relayed it from OpenAI's ``/v1/chat/completions``
            (:data:`~llava_sessions.wire.contract.OPENAI_ROUTE_HEADER`).
    """

    request_id: str
    session_id: str | None
    minted: bool
    body: Any
    accept: str | None = None
    custom_attributes: str | None = None
    image_ticket: str | None = None
    openai_route: bool = False


@dataclass
class Reply:
    """What to answer for one request: ``body`` bytes, HTTP ``status``, response ``headers``,
    ``content_type``, and ``stop`` for the stopping criterion (None: whole response; False: a
    chunk, more follow; True: the last chunk)."""

    body: bytes
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    content_type: str = JSON
    stop: bool | None = None


class Framing:
    """Build each request's answer under TorchServe's framing rules (module docstring).

    Args:
        end_header: TorchServe's sequence-end response header name (``ctx.header_key_sequence_end``).
    """

    def __init__(self, end_header: str = SEQUENCE_END_HEADER) -> None:
        self.end_header = end_header

    @staticmethod
    def frame(
        body: bytes,
        *,
        continued: bool,
        last: bool,
        status: int = 200,
        headers: dict[str, str] | None = None,
        content_type: str = JSON,
    ) -> Reply:
        """One frame of a request's answer.

        Args:
            body: the frame's bytes (b"" sends nothing but keeps the request).
            continued: an earlier ``handle()`` call already sent this request a frame (its status and
                headers are out).
            last: the request's answer ends with this frame. A last frame that is also the first is
                one whole response (``stop`` None), else the last chunk (True); not last: False.
            status, headers, content_type: what the first frame fixes (ignored by TorchServe later).
        """
        stop: bool | None = (True if continued else None) if last else False
        return Reply(body, status=status, headers=dict(headers or {}), content_type=content_type, stop=stop)

    def end_sequence(self, session_id: str) -> dict[str, str]:
        """Headers that end ``session_id``'s TorchServe job group (the frontend frees it at once)."""
        return {self.end_header: session_id}

    def closed(self, session_id: str) -> dict[str, str]:
        """Headers of a reply whose session is gone: SageMaker's ``X-Amzn-SageMaker-Closed-Session-Id``
        (boto3's ``ClosedSessionId``) and the sequence end."""
        return {CLOSED_SESSION_ID_HEADER: session_id, **self.end_sequence(session_id)}


def cut_stream_tail(content_type: str | bytes, message: str) -> bytes:
    """The last event of a stream whose worker (or model replica) died after its body began, in the
    stream's dialect, with the retryable code ``model_not_ready`` (``llava_client`` sends such a stream
    again and goes on where it stopped): an SSE ``data:`` event with OpenAI's error object, then
    ``data: [DONE]`` (``content_type`` :data:`EVENT_STREAM`, the chat dialect's); else one JSON line
    whose ``error`` both JSON-lines dialects read (the native stream's ``{"token": null, ..., "error":
    {...}}`` and the chat dialect's OpenAI error object). Written by the proxy (a dead worker) and the
    replica router (a dead replica)."""
    kind = content_type.decode("latin-1") if isinstance(content_type, bytes) else content_type
    error = {"message": message, "type": "server_error", "param": None, "code": "model_not_ready"}
    if kind.split(";")[0].strip().lower() == EVENT_STREAM:
        return b"data: %s\n\ndata: [DONE]\n\n" % json.dumps({"error": error}).encode()
    line = {"token": None, "generated_text": None, "details": None, "error": error}
    return json.dumps(line).encode() + b"\n"


def read_requests(data: Sequence[Any], context: Any) -> list[BatchRequest]:
    """TorchServe's batch as requests: each one's request id, sequence id, whether TorchServe minted it
    (its start header), body, ``Accept``, custom attributes and the proxy's image ticket
    (``context``: TorchServe's ``Context``)."""
    start = context.header_key_sequence_start
    return [
        BatchRequest(
            request_id=context.get_request_id(i),
            session_id=context.get_sequence_id(i),
            minted=bool(context.get_request_header(i, start)),
            body=(request or {}).get("body", (request or {}).get("data")),
            accept=context.get_request_header(i, "Accept") or context.get_request_header(i, "accept"),
            custom_attributes=context.get_request_header(i, CUSTOM_ATTRIBUTES_HEADER)
            or context.get_request_header(i, CUSTOM_ATTRIBUTES_HEADER.lower()),
            image_ticket=context.get_request_header(i, IMAGE_TICKET_HEADER),
            openai_route=bool(context.get_request_header(i, OPENAI_ROUTE_HEADER)),
        )
        for i, request in enumerate(data)
    ]


def write_replies(context: Any, results: Sequence[Reply]) -> list[bytes]:
    """Set each request's status, content type, headers and stopping criterion on TorchServe's
    ``context``; return the bodies, one per request, for ``handle()`` to return."""
    for i, result in enumerate(results):
        context.set_response_status(result.status, "", i)
        context.set_response_content_type(i, result.content_type)
        for key, value in result.headers.items():
            context.set_response_header(i, key, value)
    context.stopping_criteria = [lambda _output, stop=r.stop: stop for r in results]
    return [r.body for r in results]
