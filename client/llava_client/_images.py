"""Turn what the caller gives as an image into the wire's ``image`` object."""

from __future__ import annotations

import base64
import io
import os
from pathlib import Path
from typing import Any, Union

__all__ = ["ImageInput", "image_payload"]

#: A local path (``str`` / ``PathLike``), image file bytes, a PIL image, an ``http(s)://`` URL,
#: an ``s3://bucket/key`` URI, or a ``data:image/...;base64,`` URI.
ImageInput = Union[str, "os.PathLike[str]", bytes, bytearray, memoryview, Any]


def image_payload(image: ImageInput) -> dict[str, str]:
    """Return ``{"url": ...}``, ``{"s3_uri": ...}`` or ``{"base64": ...}`` for ``image``.

    URLs and S3 URIs are passed by reference (the server fetches them); local data goes inline,
    base64-encoded: file bytes unchanged, a PIL image as PNG (lossless).

    Raises:
        FileNotFoundError: a path that does not exist.
        TypeError: an unsupported type.
    """
    if isinstance(image, str):
        lowered = image[:16].lower()
        if lowered.startswith(("http://", "https://")):
            return {"url": image}
        if lowered.startswith("s3://"):
            return {"s3_uri": image}
        if lowered.startswith("data:"):
            return {"base64": image}
        return {"base64": _b64(Path(image).expanduser().read_bytes())}
    if isinstance(image, os.PathLike):
        return {"base64": _b64(Path(image).expanduser().read_bytes())}
    if isinstance(image, (bytes, bytearray, memoryview)):
        return {"base64": _b64(bytes(image))}
    if hasattr(image, "save") and hasattr(image, "mode"):  # a PIL image, without importing PIL here
        buf = io.BytesIO()
        rgb = image if image.mode in ("RGB", "RGBA", "L") else image.convert("RGB")
        rgb.save(buf, format="PNG")
        return {"base64": _b64(buf.getvalue())}
    raise TypeError(
        f"image must be a path, bytes, a PIL image, an http(s) URL or an s3:// URI, not {type(image).__name__}"
    )


def describe_image(payload: dict[str, str]) -> str:
    """A short description of an image payload for logs and messages (never the data)."""
    if "url" in payload:
        return payload["url"]
    if "s3_uri" in payload:
        return payload["s3_uri"]
    return f"inline image ({len(payload['base64']) * 3 // 4:,} bytes)"


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")
