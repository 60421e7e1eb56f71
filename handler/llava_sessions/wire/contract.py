"""The SageMaker stateful-session contract: header names, ``NEW_SESSION``, the id pattern, ``Expires``.

The one place these facts are written on the server side; the worker core (protocol, service) and
the tools (local server, container entrypoint, local SageMaker endpoint) import them from here.
``llava_client`` keeps its own copy (it installs without the server), held equal by
``tests/project/test_layout.py``.

Sources: botocore's ``sagemaker-runtime`` service model (``SessionIdHeader``,
``NewSessionResponseHeader``, ``SessionIdOrNewSessionConstantAllowList``) and the AWS TorchServe
LLaVA sample; see docs/platform.md. No third-party imports here.
"""

from __future__ import annotations

import re
from datetime import datetime, timezone

__all__ = [
    "CLOSED_SESSION_ID_HEADER",
    "CUSTOM_ATTRIBUTES_HEADER",
    "EXPIRES_FORMAT",
    "IMAGE_RELAY_ENV",
    "IMAGE_RELAY_PATH",
    "IMAGE_TICKET_HEADER",
    "OPENAI_ROUTE_HEADER",
    "MAX_SESSION_HEADER_CHARS",
    "NEW_SESSION_ID_HEADER",
    "NEW_SESSION_LITERAL",
    "SESSION_ID_HEADER",
    "SESSION_ID_PATTERN",
    "SESSION_ID_RE",
    "SEQUENCE_END_HEADER",
    "SLOT_WAIT_HEADER",
    "format_expires",
    "opened_headers",
    "session_header_value",
    "session_id_of",
]

#: Request header carrying the session id (``NEW_SESSION`` on open); also the open reply header.
SESSION_ID_HEADER = "X-Amzn-SageMaker-Session-Id"
#: Response header boto3 reads as ``NewSessionId``: ``<id>; Expires=<UTC>``.
NEW_SESSION_ID_HEADER = "X-Amzn-SageMaker-New-Session-Id"
#: Response header boto3 reads as ``ClosedSessionId``.
CLOSED_SESSION_ID_HEADER = "X-Amzn-SageMaker-Closed-Session-Id"
#: TorchServe's sequence-end key (``ts_header_key_sequence_end`` / ``TS_REQUEST_SEQUENCE_END``): a
#: handler response header of this name ends the request's job group at once. Our own name, not
#: SageMaker's closed-session header: a job group TorchServe minted for a sessionless request or a refused open
#: is no session the client had, so its end must not read as ``ClosedSessionId`` (TorchServe sends
#: every handler header on to the client).
SEQUENCE_END_HEADER = "X-Llava-Sequence-End"
#: SageMaker's pass-through request header (boto3 ``CustomAttributes``); may carry ``cache_salt=<salt>``.
CUSTOM_ATTRIBUTES_HEADER = "X-Amzn-SageMaker-Custom-Attributes"
#: Our own request header from the public port's proxy to the worker: the id of the image fetches
#: the proxy made for this request before relaying it (``llava_tools.serve.image_relay``). The proxy drops
#: it from what clients send; the worker asks the proxy for those images by it.
IMAGE_TICKET_HEADER = "X-Llava-Image-Ticket"
#: Set (``1``) by the proxy on a request it relays from OpenAI's ``/v1/chat/completions``: the worker
#: then answers it in the chat dialect even when its body cannot be read, and checks its ``model``
#: against ``served_model_name`` (``/invocations`` accepts any). A client's own is not relayed.
OPENAI_ROUTE_HEADER = "X-Llava-Openai-Route"
#: Response header (worker -> proxy, never relayed) of a ``503 overloaded`` refused only for want of a
#: generation slot, before anything of the request was done: the proxy may hold the request and send
#: it again once a slot frees (``llava_tools.serve.slot_queue``).
SLOT_WAIT_HEADER = "X-Llava-Slot-Wait"
#: The worker's environment variable naming the proxy's base URL (``http://127.0.0.1:<port>``) that
#: answers ``GET <IMAGE_RELAY_PATH><ticket>?source=<url>`` with the fetched image or the fetch's error.
IMAGE_RELAY_ENV = "LLAVA_IMAGE_RELAY"
#: The proxy's path prefix of those image lookups.
IMAGE_RELAY_PATH = "/_llava/images/"
#: The ``SessionId`` a client passes to ``invoke_endpoint`` to open a session.
NEW_SESSION_LITERAL = "NEW_SESSION"
#: botocore's ``SessionIdHeader`` pattern, as botocore writes it (and quotes it in its errors).
SESSION_ID_PATTERN = "^[a-zA-Z0-9](-*[a-zA-Z0-9])*$"
#: :data:`SESSION_ID_PATTERN` with its 256-character limit. Use ``SESSION_ID_RE.match(s)``;
#: ``\\Z`` (not ``$``) so a trailing newline does not match.
SESSION_ID_RE = re.compile(r"^(?=[a-zA-Z0-9-]{1,256}\Z)[a-zA-Z0-9](?:-*[a-zA-Z0-9])*\Z")
#: ``Expires`` value format: UTC, whole seconds (botocore's NewSessionId pattern allows no fraction).
EXPIRES_FORMAT = "%Y-%m-%dT%H:%M:%SZ"
#: botocore's maximum length of the ``NewSessionId`` header value, characters.
MAX_SESSION_HEADER_CHARS = 256


def format_expires(epoch_s: int) -> str:
    """Format a Unix time (seconds) as SageMaker's ``Expires`` value, ``YYYY-MM-DDTHH:MM:SSZ`` in UTC.

    Fractions of a second are dropped (botocore's NewSessionId pattern allows none).
    """
    return datetime.fromtimestamp(int(epoch_s), tz=timezone.utc).strftime(EXPIRES_FORMAT)


def session_header_value(session_id: str, expires_epoch_s: int) -> str:
    """Return ``"<session_id>; Expires=<UTC>"``, the value of the open-session reply headers.

    This is what boto3 parses into ``NewSessionId`` (botocore pattern
    ``^(...); Expires=\\d{4}-\\d{2}-\\d{2}T\\d{2}:\\d{2}:\\d{2}Z$``).

    Args:
        session_id: the id; must match :data:`SESSION_ID_RE` and, with the 30-character
            ``; Expires=...`` suffix, fit botocore's 256-character limit (ids <= 226 characters;
            TorchServe's ``ts-seq-<uuid4>`` is 43).
        expires_epoch_s: the absolute expiry as Unix time in seconds.

    Raises:
        ValueError: ``session_id`` does not match the botocore id pattern, or the header value
            would be over 256 characters.
    """
    if not isinstance(session_id, str) or not SESSION_ID_RE.match(session_id):
        raise ValueError("session id must match ^[a-zA-Z0-9](-*[a-zA-Z0-9])*$ and be at most 256 characters")
    value = f"{session_id}; Expires={format_expires(expires_epoch_s)}"
    if len(value) > MAX_SESSION_HEADER_CHARS:
        raise ValueError(
            f"the NewSessionId header value may be at most {MAX_SESSION_HEADER_CHARS} characters; "
            f"session ids must be at most {MAX_SESSION_HEADER_CHARS - len(value) + len(session_id)} characters"
        )
    return value


def opened_headers(session_id: str, expires_epoch_s: int) -> dict[str, str]:
    """The headers of a reply that opened ``session_id``: ``X-Amzn-SageMaker-Session-Id`` and
    ``X-Amzn-SageMaker-New-Session-Id`` (boto3's ``NewSessionId``), both
    :func:`session_header_value`. Raises ValueError as it does."""
    value = session_header_value(session_id, expires_epoch_s)
    return {SESSION_ID_HEADER: value, NEW_SESSION_ID_HEADER: value}


def session_id_of(header_value: str | None) -> str | None:
    """Return the id of a session header value: ``"<id>; Expires=..."`` → ``"<id>"``; None if empty."""
    if not header_value:
        return None
    return header_value.split(";", 1)[0].strip() or None
