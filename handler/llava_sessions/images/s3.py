"""An image from S3 (``s3://bucket/key``) with the same limits as a URL's: byte cap, connect and read
timeouts, and a total deadline; every failure a typed :class:`~llava_sessions.errors.ServiceError`
naming the bucket only (:func:`~llava_sessions.images.fetch.fetch_image_bytes` calls it). No torch here.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from typing import TYPE_CHECKING, Any

from ..errors import ErrorCode, ServiceError

if TYPE_CHECKING:
    from ..config import Settings

__all__ = ["fetch_s3"]

logger = logging.getLogger(__name__)

_S3_URI_RE = re.compile(r"^s3://([^/\s]{3,255})/(.{1,1024})\Z", re.DOTALL)
#: An S3 error code as botocore reports it (``AccessDenied``, ``NoSuchKey``, ``403``): shown in messages.
_S3_CODE_RE = re.compile(r"^[A-Za-z0-9]{1,64}\Z")
_CHUNK_BYTES = 64 * 1024
_S3_CLIENTS: dict[tuple[float, float], Any] = {}
_S3_LOCK = threading.Lock()


def fetch_s3(uri: str, settings: Settings, s3_client: Any = None) -> bytes:
    """The bytes of the S3 object ``uri`` names: its size checked first (``head_object``), then at
    most ``max_image_bytes`` read (a ranged ``get_object``) within ``fetch_total_timeout_s``.

    Args:
        uri: ``s3://bucket/key``.
        settings: the byte cap and timeouts (connect and read: the S3 client's).
        s3_client: a boto3 S3 client (tests); None: one per timeout pair, created once.

    Raises:
        ServiceError: invalid_parameter (not an S3 URI), image_too_large, image_invalid (empty),
            image_fetch_failed (not found, denied, no credentials), image_fetch_timeout.
    """
    match = _S3_URI_RE.match(uri)
    if match is None:
        raise ServiceError(ErrorCode.INVALID_PARAMETER, "image.s3_uri: must look like s3://bucket/key")
    bucket, key = match.group(1), match.group(2)
    cap = settings.max_image_bytes
    deadline = time.monotonic() + settings.fetch_total_timeout_s
    try:
        client = s3_client if s3_client is not None else _default_s3_client(settings)
        head = client.head_object(Bucket=bucket, Key=key)
        size = int(head.get("ContentLength", 0))
        if size > cap:
            raise ServiceError(ErrorCode.IMAGE_TOO_LARGE, f"the image is over {cap} bytes")
        if size == 0:
            raise ServiceError(ErrorCode.IMAGE_INVALID, "the image is empty (0 bytes)")
        obj = client.get_object(Bucket=bucket, Key=key, Range=f"bytes=0-{cap}")
        stream = obj["Body"]
        try:
            data = _read_body(stream, cap, deadline, bucket, settings)
        finally:
            stream.close()
    except ServiceError:
        raise
    except Exception as exc:  # noqa: BLE001 - every S3 failure becomes a typed error
        raise _s3_error(exc, bucket) from None
    if len(data) > cap:
        raise ServiceError(ErrorCode.IMAGE_TOO_LARGE, f"the image is over {cap} bytes")
    return data


def _read_body(stream: Any, cap: int, deadline: float, bucket: str, settings: Settings) -> bytes:
    """An object's body (botocore's ``StreamingBody``), at most ``cap + 1`` bytes, and not past
    ``deadline`` (monotonic s). Its underlying urllib3 response's ``read1`` returns whatever arrived
    (``read(n)`` waits for n bytes), so an object that trickles is cut at the deadline, one socket
    read late at most, as a URL's body is.

    Raises:
        ServiceError: image_fetch_timeout naming the bucket.
    """
    raw = getattr(stream, "_raw_stream", stream)  # botocore keeps the urllib3 response there
    read = getattr(raw, "read1", None) or stream.read
    body = bytearray()
    while len(body) <= cap:
        chunk = read(_CHUNK_BYTES)
        if not chunk:
            break
        body += chunk
        if time.monotonic() > deadline:
            raise _timed_out(bucket, f"the {settings.fetch_total_timeout_s:g} s fetch deadline")
    return bytes(body)


def _default_s3_client(settings: Settings) -> Any:
    """One boto3 S3 client per timeout pair, created once (clients are thread-safe, creation is not)."""
    key = (settings.fetch_connect_timeout_s, settings.fetch_read_timeout_s)
    with _S3_LOCK:
        client = _S3_CLIENTS.get(key)
        if client is None:
            import boto3
            from botocore.config import Config

            config = Config(
                connect_timeout=key[0], read_timeout=key[1], retries={"max_attempts": 2, "mode": "standard"}
            )
            client = boto3.session.Session().client("s3", config=config)
            _S3_CLIENTS[key] = client
        return client


def _failed(message: str) -> ServiceError:
    return ServiceError(ErrorCode.IMAGE_FETCH_FAILED, message)


def _timed_out(bucket: str, limit: str) -> ServiceError:
    return ServiceError(
        ErrorCode.IMAGE_FETCH_TIMEOUT, f"fetching the image from S3 bucket {bucket} timed out ({limit})"
    )


def _s3_error(exc: Exception, bucket: str) -> ServiceError:
    """The typed error of a failed S3 fetch: not found / denied / no credentials / timed out (naming the
    bucket only) / could not be fetched."""
    from botocore.exceptions import (
        BotoCoreError,
        ClientError,
        ConnectTimeoutError,
        NoCredentialsError,
        ReadTimeoutError,
    )

    if isinstance(exc, ClientError):
        error = exc.response.get("Error", {})
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        code = str(error.get("Code", ""))
        shown = code if _S3_CODE_RE.match(code) else "an error"
        cause = f" (S3 answered {shown}, HTTP {status})" if status else f" (S3 answered {shown})"
        if code in ("404", "NoSuchKey", "NotFound", "NoSuchBucket") or status == 404:
            return _failed(f"the S3 image object was not found in bucket {bucket}{cause}")
        if code in ("403", "AccessDenied", "Forbidden") or status == 403:
            return _failed(
                f"access to the S3 image object in bucket {bucket} was denied{cause}: the server's role needs s3:GetObject on it"
            )
        return _failed(f"the S3 image object in bucket {bucket} could not be fetched{cause}")
    if isinstance(exc, NoCredentialsError):
        return _failed(
            f"the server has no AWS credentials to read S3 bucket {bucket} (NoCredentialsError): give its role or environment "
            "credentials, or send the image by URL or base64"
        )
    if isinstance(exc, (ConnectTimeoutError, ReadTimeoutError, TimeoutError)):
        return _timed_out(bucket, "the S3 client's connect or read timeout")
    if isinstance(exc, (BotoCoreError, OSError)):
        return _failed(f"the S3 image object in bucket {bucket} could not be fetched ({type(exc).__name__})")
    logger.debug("S3 image fetch failed: %r", exc)  # urllib3 errors from the body stream
    return _failed(f"the S3 image object in bucket {bucket} could not be fetched")
