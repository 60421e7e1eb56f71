"""What every inbound body of both dialects shares: the body's size and JSON (:func:`load_body`), its
dialect (:func:`is_chat_body`), its ``cache_salt`` (:func:`request_salt`), the rules of their models
(:class:`Inbound`, :func:`check_text`), where an image comes from (:class:`ImageSource`: a URL,
vetted when fetched by ``images/fetch.py``; an S3 URI of the shape ``s3://bucket/key``; or base64,
a ``data:image/...;base64,`` prefix accepted), and how a refused body is worded (pydantic's
validation errors as one typed ServiceError: :func:`validation_error`).

Messages name the field (``parameters.top_p: must be > 0 and <= 1``) and are built from the error
type and the limits only, never from the input, so a prompt or image bytes never echo back. A wrong
shape is ``invalid_request``; a bad value is ``invalid_parameter``. No torch.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from ..errors import ErrorCode, ServiceError
from ..sampling.params import SAMPLING_BOUNDS

__all__ = [
    "CACHE_SALT_HINT",
    "CHAT_LARGE_IMAGE_HINT",
    "LARGE_IMAGE_HINT",
    "SAFE_KEY_RE",
    "S3_URI_RE",
    "CacheSalt",
    "ImageSource",
    "ImageUuid",
    "Inbound",
    "VideoSource",
    "check_text",
    "for_chat",
    "invalid",
    "is_chat_body",
    "load_body",
    "names_chat_keys",
    "request_salt",
    "salt_of_attributes",
    "too_large",
    "validation_error",
]

#: What a ``cache_salt`` must be: printable ASCII (spaces included), 1 to 256 characters.
CACHE_SALT_HINT = "must be a string of 1 to 256 printable ASCII characters"
#: vLLM's top-level ``cache_salt``: requests share cached state only when their salts are equal.
CacheSalt = Annotated[str, Field(min_length=1, max_length=256, pattern=r"^[\x20-\x7e]+$")]
#: vLLM's per-image ``uuid``: a client's name for an image, so later turns may send the name alone.
ImageUuid = Annotated[str, Field(min_length=1, max_length=256, pattern=r"^[\x21-\x7e]+$")]

# Error types that mean "wrong shape" (400 invalid_request) rather than "bad value" (invalid_parameter).
_STRUCTURAL = frozenset(
    {
        "missing",
        "extra_forbidden",
        "model_type",
        "model_attributes_type",
        "dict_type",
        "union_tag_invalid",
        "union_tag_not_found",
        "image_source",
        "image_reference",
        "open_medium",
    }
)

# What to say for a bad value of these fields, whatever pydantic's error type.
_FIELD_HINTS = {
    **{name: bound.message for name, bound in SAMPLING_BOUNDS.items()},
    "do_sample": "must be true or false",
    "details": "must be true or false",
    "stream": "must be true or false",
    "remember": "must be true or false",
    "cache_salt": CACHE_SALT_HINT,
    "uuid": "must be a string of 1 to 256 printable ASCII characters without spaces",
}

_GENERIC = {
    "missing": "field required",
    "extra_forbidden": "unknown field",
    "model_type": "must be a JSON object",
    "model_attributes_type": "must be a JSON object",
    "dict_type": "must be a JSON object",
    "string_type": "must be a string",
    "bool_type": "must be true or false",
    "int_type": "must be an integer",
    "float_type": "must be a number",
    "finite_number": "must be a finite number",
    "list_type": "must be a list",
    "string_too_short": "must not be empty",
    "string_unicode": "must be valid Unicode text",
}
_MAX_MESSAGES = 5
SAFE_KEY_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}\Z")


def _loc_text(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            key = part if SAFE_KEY_RE.match(part) else "<field>"
            out += f".{key}" if out else key
    return out or "body"


def _error_message(err: Any, hints: dict[str, str]) -> str:
    """One field-level message; built from the error type and limits only, never the input."""
    etype = err["type"]
    loc = tuple(err["loc"])
    field = next((p for p in reversed(loc) if isinstance(p, str)), "")
    if etype not in _STRUCTURAL and field in hints and (not loc or loc[-1] == field):
        text = hints[field]
    elif field == "stop" and isinstance(loc[-1], int) and etype in ("string_too_short", "string_too_long"):
        text = "each stop string must be 1 to 64 characters"
    elif field == "stop" and etype == "too_long":
        text = "at most 4 stop strings"
    elif etype == "extra_forbidden" and field == "session_id":
        text = "unknown field; the session travels in the X-Amzn-SageMaker-Session-Id header (boto3: SessionId=)"
    elif etype in _GENERIC:
        text = _GENERIC[etype]
    elif etype in ("string_too_long",):
        text = f"must be at most {err.get('ctx', {}).get('max_length')} characters"
    elif etype == "literal_error":
        text = f"must be {err.get('ctx', {}).get('expected')}"
    else:
        # pydantic's own message and our PydanticCustomError messages name limits, not inputs.
        text = err["msg"].removeprefix("Value error, ")
    return f"{_loc_text(loc)}: {text}"


class Inbound(BaseModel):
    """Base of inbound models (both dialects): unknown fields refused, no type coercion, no NaN/Infinity."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, frozen=True)


def check_text(value: str) -> str:
    """Refuse strings that are not encodable Unicode (lone surrogates from ``\\ud800`` escapes)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise PydanticCustomError("invalid_unicode", "must be valid Unicode text") from None
    return value


#: What an S3 URI must look like: ``s3://<bucket of 3-255 characters>/<key>``.
S3_URI_RE = re.compile(r"^s3://[^/\s]{3,255}/[^\s].{0,1023}\Z", re.DOTALL)


class ImageSource(Inbound):
    """Where an image comes from: exactly one of ``url``, ``s3_uri`` or ``base64``.

    ``url`` is vetted when fetched (scheme, host, resolved address: see ``images/fetch.py``);
    ``s3_uri`` must look like ``s3://bucket/key``; ``base64`` is the encoded file (a
    ``data:image/...;base64,`` prefix is accepted).
    """

    url: Annotated[str, Field(min_length=1, max_length=8192)] | None = None
    s3_uri: Annotated[str, Field(min_length=1, max_length=1100)] | None = None
    base64: Annotated[str, Field(min_length=1)] | None = None

    @field_validator("url")
    @classmethod
    def _not_data(cls, value: str | None) -> str | None:
        if value is not None and value[:5].lower() == "data:":
            raise PydanticCustomError("data_uri_in_url", "a data: URI goes in image.base64 (url is fetched)")
        return value

    @field_validator("s3_uri")
    @classmethod
    def _s3_shape(cls, value: str | None) -> str | None:
        if value is not None and not S3_URI_RE.match(value):
            raise PydanticCustomError("s3_uri_format", "must look like s3://bucket/key")
        return value

    @model_validator(mode="after")
    def _exactly_one(self) -> ImageSource:
        given = [name for name in ("url", "s3_uri", "base64") if getattr(self, name) is not None]
        if len(given) != 1:
            raise PydanticCustomError("image_source", "give exactly one of url, s3_uri, base64")
        return self

    @property
    def kind(self) -> Literal["url", "s3_uri", "base64"]:
        """Which source is set: ``"url"``, ``"s3_uri"`` or ``"base64"``."""
        if self.url is not None:
            return "url"
        if self.s3_uri is not None:
            return "s3_uri"
        return "base64"


class VideoSource(ImageSource):
    """Where a video comes from (as an image: exactly one of ``url``, ``s3_uri`` or ``base64``, a
    ``data:video/...;base64,`` prefix accepted) and how its frames are sampled: ``num_frames`` (1 or
    more, capped by the server's ``max_video_frames``) or ``fps`` (frames per second of the clip),
    never both (as transformers' video processors); neither: the server's ``video_num_frames``.
    A video is fetched under the images' rules (SSRF guard, allowlist, timeouts) with its own byte
    cap (``max_video_bytes``)."""

    num_frames: Annotated[int, Field(ge=1)] | None = None
    fps: Annotated[float, Field(gt=0.0, le=240.0)] | None = None

    @model_validator(mode="after")
    def _one_sampling(self) -> VideoSource:
        if self.num_frames is not None and self.fps is not None:
            raise PydanticCustomError("video_sampling", "give num_frames or fps, not both")
        return self


def invalid(message: str) -> ServiceError:
    return ServiceError(ErrorCode.INVALID_REQUEST, message)


def validation_error(
    exc: ValidationError, *, strip_tag: bool = True, hints: dict[str, str] | None = None
) -> ServiceError:
    """One ServiceError for pydantic's errors: invalid_request for a wrong shape, else invalid_parameter;
    at most :data:`_MAX_MESSAGES` messages, each naming its field; ``param``: the first field.
    ``strip_tag``: the model was a tagged union (its tag is the first element of each location);
    ``hints``: what to say of a bad value of these fields, over the sampling parameters' own words."""
    errors = exc.errors(include_url=False, include_input=False)
    if strip_tag:  # so messages read "parameters.top_p", not "generate.parameters.top_p"
        errors = [{**e, "loc": tuple(e["loc"])[1:]} for e in errors]
    errors = _deepest([{**e, "loc": _without_union_members(tuple(e["loc"]))} for e in errors])
    structural = any(e["type"] in _STRUCTURAL for e in errors)
    all_hints = {**_FIELD_HINTS, **(hints or {})}
    messages = [_error_message(e, all_hints) for e in errors[:_MAX_MESSAGES]]
    if len(errors) > _MAX_MESSAGES:
        messages.append(f"and {len(errors) - _MAX_MESSAGES} more")
    code = ErrorCode.INVALID_REQUEST if structural else ErrorCode.INVALID_PARAMETER
    param = _loc_text(errors[0]["loc"]) if errors else None
    return ServiceError(code, "; ".join(messages), param=param)


def _without_union_members(loc: tuple[int | str, ...]) -> tuple[int | str, ...]:
    """Drop pydantic's union-member labels from a location: type labels (``str``, ``list[...]``,
    ``function-after[...]``) and a tagged union's tag where the field of that name follows it."""
    out: list[int | str] = []
    for part in loc:
        if isinstance(part, str) and (part in _TYPE_LABELS or not SAFE_KEY_RE.match(part)):
            continue
        if out and isinstance(part, str) and out[-1] == part:
            continue
        out.append(part)
    return tuple(out)


_TYPE_LABELS = frozenset(
    {"str", "int", "float", "bool", "list", "dict", "constrained-str", "constrained-int", "constrained-float"}
)


def _deepest(errors: list[Any]) -> list[Any]:
    """Drop a union member's error at a location when another member's error lies under it (the
    value had that member's shape: its own errors are the ones that help)."""
    locs = [tuple(e["loc"]) for e in errors]
    return [e for e, loc in zip(errors, locs, strict=True) if not any(o[: len(loc)] == loc and o != loc for o in locs)]


def load_body(body: bytes | bytearray | memoryview | str | dict, max_body_bytes: int) -> Any:
    """Size-check and JSON-decode a request body, before its dialect is known.

    Args:
        body: the raw body (bytes / bytearray / memoryview / str), or the dict TorchServe already
            decoded from an ``application/json`` body (measured as compact UTF-8 JSON).
        max_body_bytes: largest body in bytes.

    Returns:
        The decoded JSON value (any type: the dialect checks its shape).

    Raises:
        ServiceError: ``payload_too_large`` (413) over ``max_body_bytes``; ``invalid_request`` (400)
            for an empty body or one that is not JSON (UTF-8, no NaN / Infinity).
    """
    if isinstance(body, dict):
        try:
            size = len(json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "surrogatepass"))
        except (TypeError, ValueError, RecursionError):
            raise invalid("request body is not a JSON object") from None
        if size > max_body_bytes:
            raise too_large(size, max_body_bytes)
        return body
    if isinstance(body, str):
        size = len(body.encode("utf-8", "surrogatepass"))
    elif isinstance(body, (bytes, bytearray, memoryview)):
        body = bytes(body)
        size = len(body)
    else:
        raise invalid("request body must be a JSON object")
    if size > max_body_bytes:
        raise too_large(size, max_body_bytes)
    if size == 0:
        raise invalid("request body is empty; send a JSON object with a 'type' field")

    def _no_constants(name: str) -> Any:
        raise ValueError(f"{name} is not valid JSON")

    try:
        return json.loads(body, parse_constant=_no_constants)
    except (ValueError, RecursionError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise invalid("request body is not valid JSON (UTF-8)") from None


#: What a too-large body is told to do with its images, in each dialect's own fields (an OpenAI client
#: has no ``s3_uri``: its ``image_url.url`` takes an ``s3://`` URI).
LARGE_IMAGE_HINT = "send large images by url or s3_uri"
CHAT_LARGE_IMAGE_HINT = "send large images by URL (image_url.url: https://... or s3://bucket/key)"


def too_large(size: int, max_body_bytes: int) -> ServiceError:
    """``payload_too_large`` (413) for a ``size``-byte body over ``max_body_bytes``, both in the message."""
    return ServiceError(
        ErrorCode.PAYLOAD_TOO_LARGE,
        f"request body is {size:,} bytes, over the {max_body_bytes:,}-byte limit; {LARGE_IMAGE_HINT}",
    )


def for_chat(error: ServiceError) -> ServiceError:
    """``error`` as the chat dialect words it (a too-large body's hint names ``image_url.url``)."""
    if error.code is not ErrorCode.PAYLOAD_TOO_LARGE:
        return error
    return ServiceError(error.code, error.message.replace(LARGE_IMAGE_HINT, CHAT_LARGE_IMAGE_HINT))


#: A chat body's top-level keys as they appear in raw JSON.
_CHAT_KEYS = (b'"messages"', b'"requestType"')


def names_chat_keys(body: bytes | bytearray | memoryview | str | dict) -> bool:
    """Whether a body too large to decode is the chat dialect's: its raw JSON has a ``messages`` or
    ``requestType`` key (:func:`is_chat_body` once decoded): the quoted name, not escaped inside a
    string, then a colon. Base64 has no quote, so image bytes never match; a substring search
    scans tens of MB in milliseconds."""
    if isinstance(body, dict):
        return is_chat_body(body)
    raw = body.encode("utf-8", "surrogatepass") if isinstance(body, str) else bytes(body)
    for key in _CHAT_KEYS:
        at = raw.find(key)
        while at >= 0:
            if (at == 0 or raw[at - 1] != 0x5C) and raw[at + len(key) : at + len(key) + 64].lstrip()[
                :1
            ] == b":":  # 0x5C: backslash
                return True
            at = raw.find(key, at + 1)
    return False


def is_chat_body(data: Any) -> bool:
    """Whether a decoded body is the chat dialect's (``llava_sessions.chat``): an object with
    ``messages`` (OpenAI chat completions) or ``requestType`` (AWS's session bodies); any other body
    is the native dialect's. The one place a request's dialect is decided."""
    return isinstance(data, dict) and ("messages" in data or "requestType" in data)


def salt_of_attributes(custom_attributes: str | None) -> str | None:
    """The ``cache_salt=<salt>`` pair among the ``;``-separated ``key=value`` pairs of SageMaker's
    ``X-Amzn-SageMaker-Custom-Attributes`` header (boto3 ``CustomAttributes``), stripped; None when
    absent. Not checked here (:func:`request_salt` checks it)."""
    salt = None
    for pair in (custom_attributes or "").split(";"):
        key, sep, value = pair.partition("=")
        if sep and key.strip() == "cache_salt":
            salt = value.strip()
    return salt


_SALT_RE = re.compile(r"^[\x20-\x7e]{1,256}\Z")


def request_salt(body_salt: str | None, custom_attributes: str | None) -> str | None:
    """A request's ``cache_salt``: the body's field, or ``cache_salt=<salt>`` among the
    ``;``-separated ``key=value`` pairs of SageMaker's ``X-Amzn-SageMaker-Custom-Attributes`` header
    (boto3's ``CustomAttributes``, the one header SageMaker passes to the container), or None.

    Raises:
        ServiceError: invalid_parameter (``param`` ``cache_salt``): the header's salt is not 1 to 256
            printable ASCII characters, or the body and the header give different salts.
    """
    header_salt = salt_of_attributes(custom_attributes)
    if header_salt is not None and not _SALT_RE.match(header_salt):
        raise ServiceError(
            ErrorCode.INVALID_PARAMETER,
            f"cache_salt (X-Amzn-SageMaker-Custom-Attributes): {CACHE_SALT_HINT}",
            param="cache_salt",
        )
    if body_salt is not None and header_salt is not None and body_salt != header_salt:
        raise ServiceError(
            ErrorCode.INVALID_PARAMETER,
            "cache_salt: the body and X-Amzn-SageMaker-Custom-Attributes give different salts; give one",
            param="cache_salt",
        )
    return body_salt if body_salt is not None else header_salt
