"""How a refused request body is worded: pydantic's validation errors as one typed ServiceError.

Messages name the field (``parameters.top_p: must be > 0 and <= 1``) and are built from the error
type and the limits only, never from the input, so a prompt or image bytes never echo back. A wrong
shape is ``invalid_request``; a bad value is ``invalid_parameter``. Used by ``llava_sessions.protocol``.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import ValidationError

from .errors import ErrorCode, ServiceError
from .sampling_params import SAMPLING_BOUNDS

__all__ = ["SAFE_KEY_RE", "invalid", "validation_error"]

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
    }
)

# What to say for a bad value of these fields, whatever pydantic's error type.
_FIELD_HINTS = {
    **{name: bound.message for name, bound in SAMPLING_BOUNDS.items()},
    "do_sample": "must be true or false",
    "details": "must be true or false",
    "stream": "must be true or false",
    "remember": "must be true or false",
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


def _error_message(err: Any) -> str:
    """One field-level message; built from the error type and limits only, never the input."""
    etype = err["type"]
    loc = tuple(err["loc"])
    field = next((p for p in reversed(loc) if isinstance(p, str)), "")
    if etype not in _STRUCTURAL and field in _FIELD_HINTS and (not loc or loc[-1] == field):
        text = _FIELD_HINTS[field]
    elif field == "stop" and isinstance(loc[-1], int) and etype in ("string_too_short", "string_too_long"):
        text = "each stop string must be 1 to 64 characters"
    elif field == "stop" and etype == "too_long":
        text = "at most 4 stop strings"
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


def invalid(message: str) -> ServiceError:
    return ServiceError(ErrorCode.INVALID_REQUEST, message)


def validation_error(exc: ValidationError) -> ServiceError:
    """One ServiceError for pydantic's errors: invalid_request for a wrong shape, else invalid_parameter;
    at most :data:`_MAX_MESSAGES` messages, each naming its field."""
    errors = exc.errors(include_url=False, include_input=False)
    # Strip the union tag (first loc element) so messages read "parameters.top_p".
    errors = [{**e, "loc": tuple(e["loc"])[1:]} for e in errors]
    structural = any(e["type"] in _STRUCTURAL for e in errors)
    messages = [_error_message(e) for e in errors[:_MAX_MESSAGES]]
    if len(errors) > _MAX_MESSAGES:
        messages.append(f"and {len(errors) - _MAX_MESSAGES} more")
    code = ErrorCode.INVALID_REQUEST if structural else ErrorCode.INVALID_PARAMETER
    return ServiceError(code, "; ".join(messages))
