"""Image intake from a URL, an S3 object or base64, with its safety limits.

Two steps, both raising :class:`~llava_sessions.errors.ServiceError` with a stable code:

- :func:`fetch_image_bytes` gets the encoded file, never more than ``Settings.max_image_bytes``.
  URLs are vetted hop by hop against SSRF (scheme, host allowlist, every resolved address) and
  the connection goes to the vetted address itself, so a DNS answer cannot change in between
  (no rebinding window).
- :func:`decode_image` (``llava_sessions.images.decode``, re-exported here) turns those bytes into
  one loaded RGB ``PIL.Image.Image``, refusing decompression bombs before any pixel is decoded.

No torch here. Error messages never contain internal addresses or exception text; the details
go to this module's logger at DEBUG level.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import logging
import re
import socket
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urljoin, urlsplit

import requests
import urllib3
from requests.adapters import HTTPAdapter

from ..errors import ErrorCode, ServiceError
from .decode import DECODE_FORMATS, decode_image
from .s3 import fetch_s3

if TYPE_CHECKING:
    from ..config import Settings
    from ..wire.inbound import ImageSource

__all__ = ["DECODE_FORMATS", "decode_image", "fetch_image_bytes"]

logger = logging.getLogger(__name__)


_IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

# Refused even with allow_private_networks: nothing legitimate serves images there.
#   0.0.0.0/8     "this network" (connecting to 0.0.0.0 reaches the local host on Linux)
#   169.254/16, fe80::/10  link-local, incl. the EC2 instance metadata service 169.254.169.254
#   fd00:ec2::254 the EC2 instance metadata service over IPv6 (AWS EC2 user guide, IMDS)
_ALWAYS_FORBIDDEN = tuple(
    ipaddress.ip_network(net) for net in ("0.0.0.0/8", "169.254.0.0/16", "fe80::/10", "fd00:ec2::254/128", "fec0::/10")
)
_REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
_CHUNK_BYTES = 64 * 1024
_MAX_ADDRESSES_TRIED = 3
_HOST_CHARS_RE = re.compile(r"^[a-z0-9._-]{1,253}\Z")
_BAD_URL_CHARS_RE = re.compile(r"[\x00-\x20\x7f]")
_WHITESPACE = str.maketrans("", "", " \t\r\n")
_USER_AGENT = "llava-sessions-image-fetch/0.1"


# ============================================================================================
# Public API
# ============================================================================================


def fetch_image_bytes(source: ImageSource, settings: Settings, *, s3_client: Any = None) -> bytes:
    """Return the encoded image bytes named by ``source``, at most ``settings.max_image_bytes``.

    - ``base64``: strict alphabet (ASCII whitespace and a ``data:image/...;base64,`` prefix are
      tolerated); the decoded size is checked from the length before decoding.
    - ``url``: fetched with ``requests`` (``stream=True``, byte cap while reading, connect and
      read timeouts from settings, at most ``max_redirects`` redirects followed by hand). Each hop
      is vetted: ``https`` only unless ``allow_http``; no credentials in the URL; the host must
      pass ``url_allowlist`` when one is set; the host is resolved with ``socket.getaddrinfo``
      and refused if ANY address is loopback, private, link-local (incl. 169.254.169.254 and
      fd00:ec2::254, the EC2 metadata service), multicast, reserved, unspecified or otherwise
      not globally routable (IPv4-mapped and 6to4 IPv6 are unwrapped). ``allow_private_networks``
      lifts the loopback/private part only: link-local, metadata, ``0.0.0.0/8``, multicast and
      reserved stay refused. DNS rebinding: the request is sent to the vetted address itself
      (the URL's host is replaced by the IP; ``Host`` header, TLS SNI and certificate
      verification still use the original name through a pinned ``HTTPAdapter``), so no second
      DNS lookup happens. Environment proxies and ``.netrc`` are not used (``trust_env=False``).
      The whole fetch, redirects included, must finish within ``fetch_total_timeout_s``; each
      connect within ``fetch_connect_timeout_s`` and each socket read within
      ``fetch_read_timeout_s``. The DNS lookup itself (``getaddrinfo``) is bounded by the system
      resolver's timeouts, not these. Errors name the URL's host, never its path or query.
    - ``s3_uri`` (``s3://bucket/key``): ``head_object`` first (``ContentLength`` over the cap is
      refused), then ``get_object`` with ``Range: bytes=0-<cap>`` and a capped read within the
      total deadline (:func:`~llava_sessions.images.s3.fetch_s3`). ``s3_client``
      is a boto3 S3 client; by default one is created (and reused) with the settings' timeouts
      and the container's credentials.

    Args:
        source: a validated :class:`~llava_sessions.wire.inbound.ImageSource`.
        settings: limits and fetch policy (:class:`~llava_sessions.config.Settings`).
        s3_client: optional boto3 S3 client (tests pass one wrapped in botocore's Stubber).

    Returns:
        The encoded image file, ``1..max_image_bytes`` bytes.

    Raises:
        ServiceError: ``image_too_large`` (413) over ``max_image_bytes``; ``image_invalid`` (400)
            for bad base64 or an empty file; ``image_url_forbidden`` (400) for a refused scheme,
            host or address; ``image_fetch_failed`` (400) when the URL or object cannot be
            fetched (DNS, connection, timeout, HTTP status, S3 error, too many redirects).
    """
    cap = settings.max_image_bytes
    if source.base64 is not None:
        data = _decode_base64(source.base64, cap)
    elif source.url is not None:
        data = _fetch_url(source.url, settings)
    elif source.s3_uri is not None:
        data = fetch_s3(source.s3_uri, settings, s3_client)
    else:  # ImageSource validation makes this unreachable
        raise ServiceError(ErrorCode.INVALID_REQUEST, "image: give exactly one of url, s3_uri, base64")
    if not data:
        raise ServiceError(ErrorCode.IMAGE_INVALID, "the image is empty (0 bytes)")
    return data


# ============================================================================================
# base64
# ============================================================================================


_NOT_BASE64 = "image.base64 is not valid base64"


def _decode_base64(text: str, cap: int) -> bytes:
    if text.startswith("data:"):
        header, sep, text = text.partition(",")
        if not sep or not header.endswith(";base64"):
            raise ServiceError(ErrorCode.IMAGE_INVALID, _NOT_BASE64)
    text = text.translate(_WHITESPACE)
    padding = len(text) - len(text.rstrip("="))
    if len(text) // 4 * 3 - padding > cap:
        raise ServiceError(ErrorCode.IMAGE_TOO_LARGE, f"the image is over {cap} bytes")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ServiceError(ErrorCode.IMAGE_INVALID, _NOT_BASE64) from None


# ============================================================================================
# URL
# ============================================================================================


@dataclass(frozen=True)
class _Target:
    """A vetted URL: where to connect and what to say."""

    scheme: str
    host: str  # IDNA/ASCII host name or IP literal, lower case, no brackets
    port: int
    path_query: str
    addresses: tuple[_IPAddress, ...]  # every resolved address, all vetted

    @property
    def host_header(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        default = 443 if self.scheme == "https" else 80
        return host if self.port == default else f"{host}:{self.port}"

    def url_for(self, address: _IPAddress) -> str:
        ip = f"[{address}]" if address.version == 6 else str(address)
        return f"{self.scheme}://{ip}:{self.port}{self.path_query}"


def _forbidden(message: str) -> ServiceError:
    return ServiceError(ErrorCode.IMAGE_URL_FORBIDDEN, message)


def _fetch_failed(message: str) -> ServiceError:
    return ServiceError(ErrorCode.IMAGE_FETCH_FAILED, message)


def _timed_out(where: str, limit: str) -> ServiceError:
    """``image_fetch_timeout`` naming ``where`` (a host or bucket, never a path or query) and ``limit``."""
    return ServiceError(ErrorCode.IMAGE_FETCH_TIMEOUT, f"fetching the image from {where} timed out ({limit})")


def _total(settings: Settings) -> str:
    return f"the {settings.fetch_total_timeout_s:g} s fetch deadline"


def _read(settings: Settings) -> str:
    return f"no bytes for the {settings.fetch_read_timeout_s:g} s read timeout"


def _address_allowed(address: _IPAddress, *, allow_private: bool) -> bool:
    """Whether an image may be fetched from ``address`` (see :func:`fetch_image_bytes`)."""
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return _address_allowed(address.ipv4_mapped, allow_private=allow_private)
        if address.sixtofour is not None and not _address_allowed(address.sixtofour, allow_private=allow_private):
            return False
        if address.scope_id:
            address = ipaddress.IPv6Address(str(address).split("%", 1)[0])
    if any(address in net for net in _ALWAYS_FORBIDDEN if net.version == address.version):
        return False
    if address.is_multicast or address.is_unspecified or address.is_reserved or address.is_link_local:
        return False
    if address.is_global and not (address.is_private or address.is_loopback):
        return True
    return allow_private  # loopback, RFC 1918, unique-local, CGNAT and other non-global ranges


def _host_allowed(host: str, allowlist: tuple[str, ...]) -> bool:
    """Exact entries match the host; entries starting with "." match any subdomain of the rest."""
    return any(host == entry or (entry.startswith(".") and host.endswith(entry)) for entry in allowlist)


def _vet_url(url: str, settings: Settings) -> _Target:
    """Check one hop's URL and resolve its host; every address must pass."""
    if _BAD_URL_CHARS_RE.search(url):
        raise _forbidden("the image URL contains whitespace or control characters")
    try:
        parts = urlsplit(url)
        port = parts.port
        hostname = parts.hostname
    except ValueError:
        raise _forbidden("the image URL is malformed") from None
    scheme = parts.scheme.lower()
    if scheme not in ("https", "http"):
        raise _forbidden("image URLs must use https" + (" or http" if settings.allow_http else ""))
    if scheme == "http" and not settings.allow_http:
        raise _forbidden("image URLs must use https (plain http is disabled on this endpoint)")
    if parts.username is not None or parts.password is not None:
        raise _forbidden("image URLs must not contain credentials")
    if not hostname:
        raise _forbidden("the image URL has no host")
    if port == 0:
        raise _forbidden("the image URL's port is invalid")
    port = port or (443 if scheme == "https" else 80)

    literal: _IPAddress | None
    try:
        literal = ipaddress.ip_address(hostname.split("%", 1)[0])
        host = str(literal)
    except ValueError:
        literal = None
        try:
            host = hostname.encode("idna").decode("ascii").lower().rstrip(".")
        except UnicodeError:
            raise _forbidden("the image URL's host name is invalid") from None
        if not _HOST_CHARS_RE.match(host):
            raise _forbidden("the image URL's host name is invalid") from None
    if settings.url_allowlist and not _host_allowed(host, settings.url_allowlist):
        raise _forbidden("the image URL's host is not on this endpoint's allowlist")

    if literal is not None:
        addresses: tuple[_IPAddress, ...] = (literal,)
    else:
        addresses = _resolve(host, port)
    for address in addresses:
        if not _address_allowed(address, allow_private=settings.allow_private_networks):
            logger.debug("image URL host resolves to a refused address")
            raise _forbidden("the image URL's host resolves to a private or reserved address")

    path_query = parts.path or "/"
    if parts.query:
        path_query += "?" + parts.query
    return _Target(scheme=scheme, host=host, port=port, path_query=path_query, addresses=addresses)


def _resolve(host: str, port: int) -> tuple[_IPAddress, ...]:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError) as exc:
        logger.debug("image URL host resolution failed: %r", exc)
        raise _fetch_failed(f"could not resolve the image URL's host {host}") from None
    seen: dict[_IPAddress, None] = {}
    for family, _type, _proto, _canon, sockaddr in infos:
        if family not in (socket.AF_INET, socket.AF_INET6):
            continue
        try:
            seen.setdefault(ipaddress.ip_address(str(sockaddr[0]).split("%", 1)[0]), None)
        except ValueError:
            continue
    if not seen:
        raise _fetch_failed(f"could not resolve the image URL's host {host}")
    return tuple(seen)


class _PinnedAdapter(HTTPAdapter):
    """An adapter for URLs whose host is a vetted IP: TLS SNI and certificate checks use ``server_name``."""

    def __init__(self, server_name: str | None) -> None:
        self._server_name = server_name
        super().__init__(pool_connections=1, pool_maxsize=1, max_retries=0)

    def init_poolmanager(self, connections: int, maxsize: int, block: bool = False, **pool_kwargs: Any) -> None:
        if self._server_name is not None:
            pool_kwargs["server_hostname"] = self._server_name
            pool_kwargs["assert_hostname"] = self._server_name
        super().init_poolmanager(connections, maxsize, block=block, **pool_kwargs)


def _fetch_url(url: str, settings: Settings, *, verify: bool | str = True) -> bytes:
    """Fetch ``url`` hop by hop (see :func:`fetch_image_bytes`). ``verify`` is for tests' CAs."""
    deadline = time.monotonic() + settings.fetch_total_timeout_s
    current = url
    for _hop in range(settings.max_redirects + 1):
        target = _vet_url(current, settings)
        session, response = _open(target, settings, deadline, verify)
        try:
            if response.status_code in _REDIRECT_STATUSES:
                location = response.headers.get("Location")
                if not location:
                    raise _fetch_failed(f"the image URL's host {target.host} redirected without a Location")
                current = urljoin(current, location)
                continue
            if response.status_code != 200:
                raise _fetch_failed(f"the image URL's host {target.host} answered HTTP {response.status_code}")
            return _read_capped(response, settings, deadline, target.host)
        finally:
            response.close()
            session.close()
    raise _fetch_failed(f"the image URL's host {target.host} redirected more than {settings.max_redirects} times")


def _open(
    target: _Target, settings: Settings, deadline: float, verify: bool | str
) -> tuple[requests.Session, requests.Response]:
    """Send the GET to the first reachable vetted address of ``target``."""
    headers = {
        "Host": target.host_header,
        "User-Agent": _USER_AGENT,
        "Accept": "image/*",
        "Accept-Encoding": "identity",
    }
    server_name = target.host if target.scheme == "https" else None
    for address in target.addresses[:_MAX_ADDRESSES_TRIED]:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise _timed_out(target.host, _total(settings))
        session = requests.Session()
        session.trust_env = False
        session.mount(f"{target.scheme}://", _PinnedAdapter(server_name))
        timeout = (min(settings.fetch_connect_timeout_s, remaining), min(settings.fetch_read_timeout_s, remaining))
        try:
            response = session.get(
                target.url_for(address),
                headers=headers,
                stream=True,
                allow_redirects=False,
                timeout=timeout,
                verify=verify,
            )
            return session, response
        except requests.exceptions.SSLError as exc:
            session.close()
            logger.debug("image URL TLS failure: %r", exc)
            raise _fetch_failed(
                f"the TLS certificate of the image URL's host {target.host} could not be verified"
            ) from None
        except requests.exceptions.Timeout as exc:
            session.close()
            logger.debug("image URL timeout: %r", exc)
            connect = isinstance(exc, requests.exceptions.ConnectTimeout)
            limit = f"the {settings.fetch_connect_timeout_s:g} s connect timeout" if connect else _read(settings)
            if remaining < (settings.fetch_connect_timeout_s if connect else settings.fetch_read_timeout_s):
                limit = _total(settings)  # what was left of the deadline was the shorter limit
            raise _timed_out(target.host, limit) from None
        except requests.exceptions.ConnectionError as exc:
            session.close()
            logger.debug("image URL connection to one address failed: %r", exc)
            continue  # try the next vetted address
        except requests.exceptions.RequestException as exc:
            session.close()
            logger.debug("image URL request failed: %r", exc)
            raise _fetch_failed(f"the image could not be fetched from {target.host}") from None
    raise _fetch_failed(f"could not connect to the image URL's host {target.host}")


def _read_capped(response: requests.Response, settings: Settings, deadline: float, host: str) -> bytes:
    """Read the body, refusing more than ``max_image_bytes`` or reading past ``deadline`` (monotonic s).

    ``read1`` returns whatever arrived (instead of waiting for a full chunk), so a server that
    drips bytes cannot hold the fetch past the deadline by more than one socket read timeout.
    """
    cap = settings.max_image_bytes
    declared = response.headers.get("Content-Length")
    if declared is not None and declared.strip().isdigit() and int(declared) > cap:
        raise ServiceError(ErrorCode.IMAGE_TOO_LARGE, f"the image is over {cap} bytes")
    raw = response.raw
    read = getattr(raw, "read1", None) or raw.read  # read1: urllib3 >= 2
    body = bytearray()
    try:
        while True:
            chunk = read(_CHUNK_BYTES, decode_content=True)
            if not chunk:
                break
            body += chunk
            if len(body) > cap:
                raise ServiceError(ErrorCode.IMAGE_TOO_LARGE, f"the image is over {cap} bytes")
            if time.monotonic() > deadline:
                raise _timed_out(host, _total(settings))
    except ServiceError:
        raise
    except (urllib3.exceptions.TimeoutError, TimeoutError) as exc:
        logger.debug("image URL body read timed out: %r", exc)
        raise _timed_out(host, _read(settings)) from None
    except Exception as exc:  # urllib3 ProtocolError / DecodeError, OSError, ...  # noqa: BLE001
        logger.debug("image URL body read failed: %r", exc)
        raise _fetch_failed(f"the image's body from {host} could not be read") from None
    return bytes(body)
