"""SageMaker transport: ``invoke_endpoint`` / ``invoke_endpoint_with_response_stream`` with session ids.

Facts it relies on (botocore's sagemaker-runtime model; see docs/api.md):

- open: ``invoke_endpoint(SessionId="NEW_SESSION")``; the reply's ``NewSessionId`` is
  ``"<id>; Expires=YYYY-MM-DDTHH:MM:SSZ"``; every later call passes ``SessionId=<id>``.
- close: the reply's ``ClosedSessionId`` names the closed session.
- streaming: ``invoke_endpoint_with_response_stream`` takes ``SessionId`` but not ``NEW_SESSION``
  (so opens and closes always use ``invoke_endpoint``). Its body is an event stream of
  ``{"PayloadPart": {"Bytes": ...}}`` events; a JSON line may be split across events anywhere,
  even inside a multi-byte UTF-8 character, so bytes are reassembled before decoding.
- a 4xx/5xx from the container reaches boto3 as ``ModelError`` (HTTP 424) with the container's
  ``OriginalStatusCode`` and body (``OriginalMessage``): mapped to the same typed errors as over HTTP.
- throttling (``ThrottlingException``, ``ModelNotReadyException``, HTTP 429) → :class:`RateLimited`
  (retried by the client); ``ServiceUnavailable`` → :class:`Overloaded`.

Unverified (no live endpoint was available): how SageMaker itself reports an unknown or expired
session id before reaching the container. A ``ValidationError`` whose message says the session was
not found / expired / closed is mapped to :class:`SessionNotFound` so that recovery can kick in.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from typing import Any

from ._exceptions import (
    APIConnectionError,
    APIStatusError,
    APITimeoutError,
    InternalServerError,
    LlavaError,
    make_status_error,
    status_error_from_body,
)
from ._transport import DEFAULT_TIMEOUT, NEW_SESSION_LITERAL, LineBuffer, RawResponse

__all__ = ["NEW_SESSION", "SageMakerTransport", "map_client_error"]

#: The ``SessionId`` that asks SageMaker to open a new session.
NEW_SESSION = NEW_SESSION_LITERAL
_JSON = "application/json"
_SESSION_GONE_RE = re.compile(r"session.*(not found|expired|closed|does not exist|invalid session)", re.I | re.S)
_THROTTLING = {"ThrottlingException", "Throttling", "TooManyRequestsException", "ModelNotReadyException"}


class SageMakerTransport:
    """Invoke a SageMaker endpoint with stateful sessions.

    Args:
        endpoint_name: the endpoint.
        client: a boto3 ``sagemaker-runtime`` client (e.g. with a botocore ``Stubber``). Used as is.
        session: a ``boto3.Session`` to make the client from (default: a new one).
        region_name: region for the client made here.
        timeout: seconds, or ``(connect, read)`` seconds, for the client made here.
        target_variant: optional ``TargetVariant`` sent with every call.
        inference_component_name: optional ``InferenceComponentName`` sent with every call.
        prefix_aware_id: sent as ``PrefixAwareId`` with every call: the application's id, so that
            ``PREFIX_AWARE`` routing keeps apart applications whose prompts start alike (botocore's
            ``sagemaker-runtime`` model: ``X-Amzn-SageMaker-Prefix-Aware-Id``, 1 to 64 characters).
        endpoint_url: the SageMaker runtime's URL for the client made here (``llava-local-endpoint``'s
            ``http://127.0.0.1:8090``); botocore still signs requests, so it needs credentials, dummy
            ones for a local endpoint (``AWS_ACCESS_KEY_ID=x AWS_SECRET_ACCESS_KEY=x``).

    A client made here has botocore's own retries off (``total_max_attempts=1``): retries are the
    :class:`~llava_client.SessionClient`'s, which knows which requests may be repeated.
    """

    def __init__(
        self,
        endpoint_name: str,
        *,
        client: Any = None,
        session: Any = None,
        region_name: str | None = None,
        timeout: float | tuple[float, float] = DEFAULT_TIMEOUT,
        target_variant: str | None = None,
        inference_component_name: str | None = None,
        endpoint_url: str | None = None,
        prefix_aware_id: str | None = None,
    ) -> None:
        if not endpoint_name:
            raise ValueError("endpoint_name is required")
        self.endpoint_name = endpoint_name
        if client is None:
            import boto3
            from botocore.config import Config

            connect, read = timeout if isinstance(timeout, tuple) else (timeout, timeout)
            config = Config(connect_timeout=connect, read_timeout=read, retries={"total_max_attempts": 1})
            client = (session or boto3.Session()).client(
                "sagemaker-runtime", region_name=region_name, config=config, endpoint_url=endpoint_url
            )
        self.client = client
        self._extra: dict[str, str] = {}
        if target_variant:
            self._extra["TargetVariant"] = target_variant
        if inference_component_name:
            self._extra["InferenceComponentName"] = inference_component_name
        if prefix_aware_id:
            self._extra["PrefixAwareId"] = prefix_aware_id

    def __repr__(self) -> str:
        return f"SageMakerTransport({self.endpoint_name!r})"

    def invoke(self, body: bytes, *, session_id: str | None) -> RawResponse:
        """``invoke_endpoint`` with ``SessionId`` (``NEW_SESSION`` when ``session_id`` is None; none
        at all when it is ``""``: a request outside any session)."""
        kwargs = {
            "EndpointName": self.endpoint_name,
            "Body": body,
            "ContentType": _JSON,
            "Accept": _JSON,
            **self._extra,
        }
        if session_id != "":
            kwargs["SessionId"] = session_id if session_id is not None else NEW_SESSION
        response = _call(self.client.invoke_endpoint, kwargs)
        try:
            content = response["Body"].read()
        except Exception as exc:  # noqa: BLE001 - botocore/urllib3 read errors
            raise _connection_error(exc, "reading the reply") from exc
        meta = response.get("ResponseMetadata") or {}
        return RawResponse(
            content,
            status_code=200,
            new_session_id=response.get("NewSessionId"),
            closed_session_id=response.get("ClosedSessionId"),
            headers=dict(meta.get("HTTPHeaders") or {}),
            request_id=meta.get("RequestId"),
        )

    def invoke_stream(self, body: bytes, *, session_id: str) -> _EventLineStream:
        """``invoke_endpoint_with_response_stream`` with ``SessionId`` (none when it is ``""``: a
        request outside any session); returns reassembled JSON lines."""
        if session_id == NEW_SESSION:
            raise ValueError("streaming needs an open session id (SageMaker refuses NEW_SESSION here)")
        kwargs = {
            "EndpointName": self.endpoint_name,
            "Body": body,
            "ContentType": _JSON,
            "Accept": "application/jsonlines",
            **self._extra,
        }
        if session_id:
            kwargs["SessionId"] = session_id
        response = _call(self.client.invoke_endpoint_with_response_stream, kwargs)
        meta = response.get("ResponseMetadata") or {}
        return _EventLineStream(response["Body"], meta.get("RequestId"))

    def close(self) -> None:
        """Close the boto3 client's connection pool."""
        close = getattr(self.client, "close", None)
        if close is not None:
            close()


class _EventLineStream:
    """Complete JSON lines from a SageMaker response event stream (``PayloadPart`` events)."""

    def __init__(self, events: Iterable[dict], request_id: str | None) -> None:
        self._events = events
        self._request_id = request_id

    def __iter__(self) -> Iterator[bytes]:
        buffer = LineBuffer()
        iterator = iter(self._events)
        while True:
            try:
                event = next(iterator)
            except StopIteration:
                break
            except LlavaError:
                raise
            except Exception as exc:  # noqa: BLE001 - EventStreamError (a ClientError), read errors
                raise _map_exception(exc) from exc
            if "PayloadPart" in event:
                yield from buffer.feed(event["PayloadPart"].get("Bytes") or b"")
            elif "ModelStreamError" in event:
                raise _model_stream_error(event["ModelStreamError"], self._request_id)
            elif "InternalStreamFailure" in event:
                message = (event["InternalStreamFailure"] or {}).get("Message", "internal stream failure")
                raise InternalServerError(
                    message, status_code=500, code="InternalStreamFailure", request_id=self._request_id
                )
        yield from buffer.flush()

    def close(self) -> None:
        close = getattr(self._events, "close", None)
        if close is not None:
            close()


def _call(method, kwargs: dict) -> dict:
    try:
        return method(**kwargs)
    except LlavaError:
        raise
    except Exception as exc:  # noqa: BLE001 - ClientError and botocore connection errors
        raise _map_exception(exc) from exc


def _map_exception(exc: Exception) -> LlavaError:
    from botocore.exceptions import ClientError

    if isinstance(exc, ClientError):
        return map_client_error(exc)
    return _connection_error(exc, "calling the endpoint")


def _connection_error(exc: Exception, doing: str) -> APIConnectionError:
    from botocore import exceptions as bex

    if isinstance(exc, bex.ConnectTimeoutError):
        return APITimeoutError(f"connect timeout {doing}: {exc}", request_sent=False)
    if isinstance(exc, bex.ReadTimeoutError):
        return APITimeoutError(f"read timeout {doing}: {exc}")
    if isinstance(exc, bex.EndpointConnectionError):  # refused / unreachable: nothing was sent
        return APIConnectionError(f"could not connect {doing}: {exc}", request_sent=False)
    transport_errors = (
        bex.HTTPClientError,
        bex.ConnectionError,
        getattr(bex, "IncompleteReadError", bex.HTTPClientError),
        OSError,
    )
    if isinstance(exc, transport_errors) or type(exc).__module__.startswith("urllib3"):
        return APIConnectionError(f"connection failed {doing}: {exc}")
    raise exc  # not a transport failure (ParamValidationError, a stub mismatch, a bug): surface it as is


def _model_stream_error(fields: dict, request_id: str | None) -> APIStatusError:
    message = str((fields or {}).get("Message", ""))
    error_code = (fields or {}).get("ErrorCode")
    try:
        parsed = json.loads(message)
    except ValueError:
        parsed = None
    if isinstance(parsed, dict) and isinstance(parsed.get("error"), dict):
        return status_error_from_body(200, parsed, request_id=request_id)
    return InternalServerError(
        message or "model stream error", status_code=500, code=error_code or "ModelStreamError", request_id=request_id
    )


def map_client_error(exc: Any) -> APIStatusError:
    """Map a botocore ``ClientError`` (or ``EventStreamError``) to the client's typed error.

    ``ModelError``: the container's ``OriginalStatusCode`` and JSON body (``OriginalMessage``) decide,
    exactly as over HTTP. Throttling → :class:`RateLimited`; ``ServiceUnavailable`` → :class:`Overloaded`;
    ``ValidationError`` → :class:`InvalidRequest` (or :class:`SessionNotFound` when it says the session
    is gone); others by their HTTP status.
    """
    response = getattr(exc, "response", None) or {}
    error = response.get("Error") or {}
    aws_code = str(error.get("Code") or "")
    message = str(error.get("Message") or "")
    meta = response.get("ResponseMetadata") or {}
    request_id = meta.get("RequestId")
    http_status = int(meta.get("HTTPStatusCode") or 0)
    headers = meta.get("HTTPHeaders") or {}
    if aws_code == "ModelError":
        original_status = response.get("OriginalStatusCode")
        original = response.get("OriginalMessage")
        status = int(original_status) if original_status else 500
        if original is None:
            return make_status_error(
                status, "ModelError", message or "model error", body=response, request_id=request_id
            )
        return status_error_from_body(status, original, request_id=request_id)
    if aws_code == "ModelStreamError":
        return _model_stream_error({"Message": message, "ErrorCode": error.get("ErrorCode")}, request_id)
    if aws_code in _THROTTLING or http_status == 429:
        return make_status_error(
            429,
            aws_code or "throttled",
            message or "throttled",
            body=response,
            request_id=request_id,
            retry_after=headers.get("retry-after"),
        )
    if aws_code == "ServiceUnavailable" or http_status == 503:
        return make_status_error(
            503,
            aws_code or "ServiceUnavailable",
            message or "service unavailable",
            body=response,
            request_id=request_id,
            retry_after=headers.get("retry-after"),
        )
    if aws_code == "ValidationError" and _SESSION_GONE_RE.search(message):
        return make_status_error(404, "session_not_found", message, body=response, request_id=request_id)
    if aws_code == "ValidationError":
        return make_status_error(400, aws_code, message, body=response, request_id=request_id)
    return make_status_error(
        http_status or 500, aws_code or None, message or str(exc), body=response, request_id=request_id
    )
