"""Turn what the caller gives as an image into the wire's ``image`` object."""

from __future__ import annotations

import base64
import io
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

__all__ = [
    "BODY_ROOM_BYTES",
    "DOWNSIZE_MAX_SIDE",
    "MAX_BODY_BYTES",
    "Downsized",
    "ImageInput",
    "VideoInput",
    "fit_payload",
    "image_budget",
    "image_payload",
    "video_payload",
]

#: SageMaker's request body limit (6 MiB); bigger bodies are refused by the client before sending.
MAX_BODY_BYTES = 6_291_456
#: Bytes of a request body kept for what is around an inline image (JSON, a system prompt).
BODY_ROOM_BYTES = 65_536


def image_budget(max_body_bytes: int = MAX_BODY_BYTES) -> int:
    """Characters of base64 an inline image may take in a body of at most ``max_body_bytes``."""
    return max(1024, max_body_bytes - BODY_ROOM_BYTES)


#: The longest side (px) an inline image is downsized to when it would not fit the request limit:
#: LLaVA-NeXT's largest anyres side (two 672-px tiles; llava-1.5 itself sees 336 px), so the model
#: loses nothing it would have used. Halved again while the image still does not fit.
DOWNSIZE_MAX_SIDE = 1344
#: JPEG quality of a downsized image.
DOWNSIZE_JPEG_QUALITY = 90

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


#: A local video file (path), its bytes, an ``http(s)://`` URL, an ``s3://bucket/key`` URI or a
#: ``data:video/...;base64,`` URI. MP4/QuickTime and WebM/Matroska are what the server reads.
VideoInput = Union[str, "os.PathLike[str]", bytes, bytearray, memoryview]


def video_payload(video: VideoInput, *, num_frames: int | None = None, fps: float | None = None) -> dict[str, Any]:
    """Return the wire's ``video`` object for ``video``: ``{"url"}``, ``{"s3_uri"}`` or ``{"base64"}``
    (a local file inline as a ``data:video/...;base64,`` URI; never re-encoded: send a long clip by
    URL or S3), with ``num_frames`` or ``fps`` when given.

    Raises:
        FileNotFoundError: a path that does not exist.
        TypeError: an unsupported type. ValueError: both ``num_frames`` and ``fps``.
    """
    if num_frames is not None and fps is not None:
        raise ValueError("give num_frames or fps, not both")
    payload: dict[str, Any]
    if isinstance(video, str) and video[:16].lower().startswith(("http://", "https://", "s3://", "data:")):
        lowered = video[:16].lower()
        key = "s3_uri" if lowered.startswith("s3://") else "base64" if lowered.startswith("data:") else "url"
        payload = {key: video}
    elif isinstance(video, (str, os.PathLike)):
        payload = {"base64": video_data_uri(Path(video).expanduser().read_bytes())}
    elif isinstance(video, (bytes, bytearray, memoryview)):
        payload = {"base64": video_data_uri(bytes(video))}
    else:
        raise TypeError(f"video must be a path, bytes, an http(s) URL or an s3:// URI, not {type(video).__name__}")
    if num_frames is not None:
        payload["num_frames"] = num_frames
    if fps is not None:
        payload["fps"] = fps
    return payload


def video_data_uri(data: bytes) -> str:
    """``data:video/<type>;base64,...`` for a clip's bytes: ``webm`` for a Matroska/WebM file (its
    EBML magic), else ``mp4``."""
    kind = "webm" if data[:4] == b"\x1a\x45\xdf\xa3" else "mp4"
    return f"data:video/{kind};base64,{_b64(data)}"


@dataclass(frozen=True)
class Downsized:
    """An inline image the client made smaller to fit the request limit: sizes in pixels (width,
    height), bytes of the encoded file before and after."""

    original_size: tuple[int, int]
    original_bytes: int
    sent_size: tuple[int, int]
    sent_bytes: int

    def __str__(self) -> str:
        (w0, h0), (w1, h1) = self.original_size, self.sent_size
        return (
            f"the image was downsized from {w0}x{h0} ({self.original_bytes / 1e6:.1f} MB) to {w1}x{h1} "
            f"({self.sent_bytes / 1e6:.2f} MB JPEG) to fit the request limit; the model sees at most "
            f"{DOWNSIZE_MAX_SIDE} px anyway"
        )


def fit_payload(payload: dict[str, str], max_base64_chars: int) -> tuple[dict[str, str], Downsized | None]:
    """``payload``, or when its inline image is over ``max_base64_chars`` characters of base64, the
    image downsized (EXIF orientation applied, RGB, longest side :data:`DOWNSIZE_MAX_SIDE` px or less,
    JPEG) so it fits, with what was done. A URL or S3 URI, or data that is not an image Pillow opens,
    is returned as it is (the request limit then refuses it with its own advice)."""
    data_text = payload.get("base64")
    if data_text is None or len(data_text) <= max_base64_chars:
        return payload, None
    try:
        from PIL import Image, ImageOps

        raw = base64.b64decode(data_text.split(",", 1)[1] if data_text.startswith("data:") else data_text)
        with Image.open(io.BytesIO(raw)) as opened:
            image = ImageOps.exif_transpose(opened).convert("RGB")
    except Exception:  # noqa: BLE001 - not an image we can open: the server's checks and the limit decide
        return payload, None
    side = DOWNSIZE_MAX_SIDE
    while side >= 64:
        small = image.copy()
        small.thumbnail((side, side))
        buf = io.BytesIO()
        small.save(buf, format="JPEG", quality=DOWNSIZE_JPEG_QUALITY)
        text = _b64(buf.getvalue())
        if len(text) <= max_base64_chars:
            done = Downsized(image.size, len(raw), small.size, buf.tell())
            return {"base64": text}, done
        side //= 2
    return payload, None


def describe_image(payload: dict[str, Any]) -> str:
    """A short description of an image payload (or a session's ``{"video": payload}``) for logs and
    messages (never the data)."""
    if "video" in payload:
        return "video " + describe_image(payload["video"]).replace("inline image", "inline")
    if "url" in payload:
        return payload["url"]
    if "s3_uri" in payload:
        return payload["s3_uri"]
    return f"inline image ({len(payload['base64']) * 3 // 4:,} bytes)"


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")
