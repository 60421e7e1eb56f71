"""Transports: how a request body reaches ``POST /invocations`` and how the reply comes back.

A transport knows the wire (HTTP to TorchServe, or boto3 to a SageMaker endpoint) and nothing of
sessions' meaning. It has two calls:

- ``invoke(body, session_id=...)``: one request, one whole reply (:class:`RawResponse`);
  ``session_id=None`` opens a new session (no header over HTTP, ``NEW_SESSION`` on SageMaker);
  ``session_id=""`` is a request outside any session (a sessionless chat request: no header, no
  ``SessionId``);
- ``invoke_stream(body, session_id=...)``: a streamed reply as complete JSON lines (:class:`LineStream`).

Both raise :class:`APIConnectionError` / :class:`APITimeoutError` when no response came, and the
typed :class:`APIStatusError` for an error status. Neither retries: that is the client's policy.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Protocol, runtime_checkable
from urllib.parse import urlsplit

from ._exceptions import APIConnectionError, APITimeoutError, status_error_from_body

__all__ = [
    "CLOSED_SESSION_ID_HEADER",
    "DEFAULT_TIMEOUT",
    "NEW_SESSION_ID_HEADER",
    "SESSION_ID_HEADER",
    "HttpTransport",
    "LineBuffer",
    "LineStream",
    "RawResponse",
    "Transport",
    "aws_setup_hint",
    "check_base_url",
    "parse_session_header",
]

log = logging.getLogger("llava_client")

# The client's copy of the SageMaker session contract (the server's is llava_sessions.wire.contract; the
# client installs without the server, and tests/project/test_layout.py keeps the two equal).
#: Request header naming the session (and the open reply's ``<id>; Expires=<UTC>``).
SESSION_ID_HEADER = "X-Amzn-SageMaker-Session-Id"
#: Open reply header boto3 reads as ``NewSessionId``.
NEW_SESSION_ID_HEADER = "X-Amzn-SageMaker-New-Session-Id"
#: Close reply header boto3 reads as ``ClosedSessionId``.
CLOSED_SESSION_ID_HEADER = "X-Amzn-SageMaker-Closed-Session-Id"
#: The ``SessionId`` that asks SageMaker for a new session.
NEW_SESSION_LITERAL = "NEW_SESSION"
#: ``(connect, read)`` seconds. The read timeout bounds the wait for the whole reply (or, when
#: streaming, for the next chunk); an open runs the vision tower, a long answer decodes for a while.
DEFAULT_TIMEOUT: tuple[float, float] = (10.0, 120.0)
_JSON = "application/json"


def parse_session_header(value: str | None) -> tuple[str | None, datetime | None]:
    """Split ``"<id>; Expires=YYYY-MM-DDTHH:MM:SSZ"`` into ``(id, expiry as an aware UTC datetime)``.

    A value without ``Expires`` gives ``(id, None)``; None or empty gives ``(None, None)``.
    """
    if not value or not value.strip():
        return None, None
    parts = [p.strip() for p in value.split(";")]
    session_id = parts[0] or None
    expires = None
    for part in parts[1:]:
        key, _, raw = part.partition("=")
        if key.strip().lower() == "expires":
            expires = parse_expires(raw.strip())
    return session_id, expires


def parse_expires(text: str | None) -> datetime | None:
    """Parse ``YYYY-MM-DDTHH:MM:SSZ`` (UTC) into an aware datetime; None if it does not parse."""
    if not text:
        return None
    try:
        return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc)
    except ValueError:
        try:
            parsed = datetime.fromisoformat(text.replace("Z", "+00:00"))
        except ValueError:
            return None
        return parsed if parsed.tzinfo else parsed.replace(tzinfo=timezone.utc)


@dataclass
class RawResponse:
    """A whole 2xx reply.

    Attributes:
        body: the reply body (JSON bytes).
        status_code: HTTP status (200 on SageMaker, which raises for anything else).
        new_session_id: the ``NewSessionId`` / open reply header value ``"<id>; Expires=..."``, or None.
        closed_session_id: the ``ClosedSessionId`` header value, or None.
        headers: other response headers (may be empty).
        request_id: the transport's request id, or None.
    """

    body: bytes
    status_code: int = 200
    new_session_id: str | None = None
    closed_session_id: str | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    request_id: str | None = None


class LineStream(Protocol):
    """Complete JSON lines (bytes, no newline) of a streamed reply; ``close()`` releases the connection."""

    def __iter__(self) -> Iterator[bytes]: ...

    def close(self) -> None: ...


@runtime_checkable
class Transport(Protocol):
    """What :class:`~llava_client.SessionClient` needs from a wire (see the module docstring)."""

    def invoke(self, body: bytes, *, session_id: str | None) -> RawResponse: ...

    def invoke_stream(self, body: bytes, *, session_id: str) -> LineStream: ...

    def close(self) -> None: ...


class LineBuffer:
    """Reassemble ``\\n``-separated lines from byte chunks split anywhere.

    Splitting happens on bytes, so a chunk boundary inside a multi-byte UTF-8 character is harmless:
    a line is decoded only once it is complete.
    """

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        """Add ``data``; return the lines it completed (without their ``\\n``; blank lines dropped)."""
        if not data:
            return []
        start = len(self._buf)
        self._buf += data
        lines: list[bytes] = []
        cut = 0
        pos = self._buf.find(b"\n", start)
        while pos >= 0:
            line = bytes(self._buf[cut:pos]).strip()
            if line:
                lines.append(line)
            cut = pos + 1
            pos = self._buf.find(b"\n", cut)
        if cut:
            del self._buf[:cut]
        return lines

    def flush(self) -> list[bytes]:
        """Return the unterminated rest as a last line (if not blank) and empty the buffer."""
        rest = bytes(self._buf).strip()
        self._buf.clear()
        return [rest] if rest else []


# --------------------------------------------------------------------------------------------
# Plain HTTP (TorchServe, `llava-serve`, a local container)
# --------------------------------------------------------------------------------------------


def _is_loopback(host: str | None) -> bool:
    if not host:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def aws_setup_hint(exc: BaseException) -> str | None:
    """One line for an error of boto3's configuration, with what to set: no region (``NoRegionError``),
    no or partial credentials, an unknown profile; None for any other error."""
    name = type(exc).__name__
    if name == "NoRegionError":
        return f"{exc} (pass --region, or set AWS_DEFAULT_REGION)"
    if name in ("NoCredentialsError", "PartialCredentialsError", "ProfileNotFound"):
        return (
            f"{exc} (set AWS credentials: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or an instance role)"
        )
    return None


def check_base_url(base_url: str) -> str:
    """``base_url`` when it is an http(s) URL with a host (``http://127.0.0.1:8080``).

    Raises:
        ValueError: anything else, with what to write instead: ``localhost:8080`` (no scheme), or the
            OpenAI base URL ``http://127.0.0.1:8080/v1`` that llava-serve's ready line prints for the
            ``openai`` package (this client speaks to the server's root).
    """
    parts = urlsplit(base_url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        hint = f"; did you mean http://{base_url}?" if "://" not in base_url else ""
        raise ValueError(f"the URL must be http(s) like http://127.0.0.1:8080, got {base_url!r}{hint}")
    if parts.path.rstrip("/").endswith("/v1"):
        root = base_url.rstrip("/").removesuffix("/v1")
        raise ValueError(f"{base_url} is the OpenAI base URL (for the openai package); give the server's own: {root}")
    return base_url


def url_argument(text: str) -> str:
    """An argparse ``type`` for a server URL (:func:`check_base_url`): a bad one is a one-line usage error."""
    import argparse

    try:
        return check_base_url(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def port_argument(text: str) -> int:
    """An argparse ``type`` for a TCP port, 0..65535 (0: any free port)."""
    import argparse

    if not text.strip().isdigit() or not 0 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"a port is a number from 0 to 65535, got {text!r}")
    return int(text)


class HttpTransport:
    """``POST {base_url}/invocations`` with ``requests`` (TorchServe or a SageMaker container on port 8080).

    Args:
        base_url: e.g. ``http://127.0.0.1:8080``.
        timeout: seconds, or ``(connect, read)`` seconds (:data:`DEFAULT_TIMEOUT`).
        headers: extra headers sent with every request (e.g. authorization).
        session: a ``requests.Session`` to use (default: a new one, closed by :meth:`close`).

    Proxies from the environment are ignored for loopback hosts.
    """

    def __init__(
        self,
        base_url: str,
        *,
        timeout: float | tuple[float, float] = DEFAULT_TIMEOUT,
        headers: Mapping[str, str] | None = None,
        session=None,
    ) -> None:
        import requests

        parts = urlsplit(check_base_url(base_url))
        self.base_url = base_url.rstrip("/")
        self.url = self.base_url + "/invocations"
        self.timeout = timeout
        self._owns_session = session is None
        self._http = session if session is not None else requests.Session()
        if self._owns_session and _is_loopback(parts.hostname):
            self._http.trust_env = False  # never send loopback traffic through an HTTP(S)_PROXY
        self._headers = dict(headers or {})

    def __repr__(self) -> str:
        return f"HttpTransport({self.base_url!r})"

    def _post(self, body: bytes, session_id: str | None, *, stream: bool):
        import requests

        headers = {
            "Content-Type": _JSON,
            "Accept": "application/jsonlines, application/json" if stream else _JSON,
            **self._headers,
        }
        if session_id:  # None opens a session, "" is a request outside any: no header either way
            headers[SESSION_ID_HEADER] = session_id
        try:
            return self._http.post(self.url, data=body, headers=headers, timeout=self.timeout, stream=stream)
        except requests.exceptions.ConnectTimeout as exc:
            raise APITimeoutError(f"connect timeout: {self.url}", request_sent=False) from exc
        except requests.exceptions.Timeout as exc:
            raise APITimeoutError(f"no reply within the read timeout: {self.url}") from exc
        except requests.exceptions.ConnectionError as exc:
            raise APIConnectionError(
                f"connection to {self.url} failed: {_reason(exc)}", request_sent=not _never_connected(exc)
            ) from exc
        except requests.exceptions.RequestException as exc:
            raise APIConnectionError(f"request to {self.url} failed: {exc}") from exc

    @staticmethod
    def _raise_for_status(response) -> None:
        if response.status_code >= 400:
            try:
                content = response.content
            except Exception:  # noqa: BLE001 - a broken error body still gives a typed error
                content = b""
            finally:
                response.close()
            raise status_error_from_body(
                response.status_code, content, headers=response.headers, request_id=response.headers.get("x-request-id")
            )

    def invoke(self, body: bytes, *, session_id: str | None) -> RawResponse:
        """Send one request and read the whole reply (see :class:`Transport`)."""
        import requests

        response = self._post(body, session_id, stream=False)
        self._raise_for_status(response)
        try:
            content = response.content
        except requests.exceptions.RequestException as exc:
            raise APIConnectionError(f"reply from {self.url} broke off: {exc}") from exc
        headers = response.headers
        new = headers.get(NEW_SESSION_ID_HEADER) or (headers.get(SESSION_ID_HEADER) if session_id is None else None)
        return RawResponse(
            content,
            status_code=response.status_code,
            new_session_id=new,
            closed_session_id=headers.get(CLOSED_SESSION_ID_HEADER),
            headers=dict(headers),
            request_id=headers.get("x-request-id"),
        )

    def invoke_stream(self, body: bytes, *, session_id: str) -> _HttpLineStream:
        """Send a streaming request; return its JSON lines as they arrive (see :class:`Transport`)."""
        response = self._post(body, session_id, stream=True)
        self._raise_for_status(response)
        return _HttpLineStream(response, self.url)

    def close(self) -> None:
        """Close the connection pool (only if this transport created the ``requests.Session``)."""
        if self._owns_session:
            self._http.close()


class _HttpLineStream:
    """JSON lines of a chunked reply, yielded as soon as each line is complete."""

    def __init__(self, response, url: str) -> None:
        self._response = response
        self._url = url

    def __iter__(self) -> Iterator[bytes]:
        import requests
        import urllib3

        buffer = LineBuffer()
        try:
            # chunk_size=None: each chunk as it arrives (iter_lines would wait for 512 bytes)
            for chunk in self._response.iter_content(chunk_size=None):
                yield from buffer.feed(chunk)
            yield from buffer.flush()
        except (requests.exceptions.Timeout, urllib3.exceptions.ReadTimeoutError) as exc:
            raise APITimeoutError(f"stream from {self._url} stalled past the read timeout") from exc
        except (requests.exceptions.RequestException, urllib3.exceptions.HTTPError, OSError) as exc:
            raise APIConnectionError(f"stream from {self._url} broke off: {exc}") from exc

    def close(self) -> None:
        self._response.close()


def _reason(exc: BaseException) -> str:
    """The innermost cause of a requests ConnectionError, for messages."""
    inner = exc.args[0] if exc.args else exc
    reason = getattr(inner, "reason", None)
    return str(reason or inner)


def _never_connected(exc: BaseException) -> bool:
    """True when the connection was never established (refused, DNS), so nothing was sent."""
    import urllib3

    inner = exc.args[0] if exc.args else None
    reason = getattr(inner, "reason", None)
    return isinstance(reason, (urllib3.exceptions.NewConnectionError, urllib3.exceptions.ConnectTimeoutError)) or (
        isinstance(inner, urllib3.exceptions.NewConnectionError)
    )
