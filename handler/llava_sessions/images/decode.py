"""Decoding an encoded image into one RGB image, under a pixel cap (no torch, no network).

Decompression bombs are refused before any pixel is decoded; orientation, palettes, transparency
and odd modes are normalised to RGB (:func:`decode_image`).
"""

from __future__ import annotations

import functools
import logging
import warnings
from io import BytesIO
from typing import cast

from PIL import Image, ImageOps

from ..errors import ErrorCode, ServiceError

__all__ = ["DECODE_FORMATS", "decode_image"]

logger = logging.getLogger(__name__)

#: Pillow formats :func:`decode_image` opens (MPO is how Pillow opens many phone JPEGs).
DECODE_FORMATS: tuple[str, ...] = ("JPEG", "MPO", "PNG", "GIF", "WEBP", "BMP", "TIFF")


def decode_image(data: bytes, *, max_pixels: int) -> Image.Image:
    """Decode an encoded image into one loaded RGB image.

    The pixel count (width x height from the header) is checked before any pixel is decoded;
    Pillow's own ``DecompressionBombWarning``/``Error`` (``Image.MAX_IMAGE_PIXELS``, about 89 M
    pixels; the error at twice that, whatever ``max_pixels`` says) are also turned into
    ``image_too_large`` (the warning through ``warnings.catch_warnings``, which briefly changes
    the process's warning filters: harmless for a handler that decodes on one thread). Only :data:`DECODE_FORMATS` are opened. EXIF orientation is
    applied (``ImageOps.exif_transpose``); animations give their first frame; palette, grey,
    16-bit, CMYK and other modes become RGB; transparency is composited on white. Embedded ICC
    profiles are ignored (pixel values are taken as sRGB).

    Args:
        data: the encoded file.
        max_pixels: most pixels (width x height) accepted.

    Returns:
        A loaded ``PIL.Image.Image`` in mode ``"RGB"``, independent of ``data``.

    Raises:
        ServiceError: ``image_too_large`` (413) over ``max_pixels``; ``image_invalid`` (400) for
            an empty, unrecognised, truncated or corrupt file, or an unsupported colour mode.
    """
    if not data:
        raise ServiceError(ErrorCode.IMAGE_INVALID, "the image is empty (0 bytes)")
    too_large = ServiceError(
        ErrorCode.IMAGE_TOO_LARGE, f"the image has more than {max_pixels} pixels; send a smaller image"
    )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(BytesIO(data), formats=_open_formats())
            width, height = image.size
            if width <= 0 or height <= 0:
                raise ServiceError(ErrorCode.IMAGE_INVALID, "the image has no pixels")
            if width * height > max_pixels:
                raise too_large
            image.seek(0)  # first frame of an animation
            image.load()
            _apply_orientation(image)
            return _to_rgb(image)
    except ServiceError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise too_large from None
    except Image.UnidentifiedImageError:
        raise ServiceError(
            ErrorCode.IMAGE_INVALID, f"not a recognised image file (accepted: {', '.join(DECODE_FORMATS)})"
        ) from None
    except MemoryError:
        raise too_large from None
    except Exception as exc:  # Pillow raises many types (OSError, SyntaxError, ValueError, ...) on bad input  # noqa: BLE001
        logger.debug("image decode failed: %r", exc)
        raise ServiceError(ErrorCode.IMAGE_INVALID, "the image file is truncated or corrupt") from None


# ============================================================================================
# Pixel modes
# ============================================================================================


@functools.lru_cache(maxsize=1)
def _open_formats() -> tuple[str, ...]:
    """The :data:`DECODE_FORMATS` this Pillow build can open (registers every plugin once)."""
    Image.init()
    return tuple(fmt for fmt in DECODE_FORMATS if fmt in Image.OPEN)


def _apply_orientation(image: Image.Image) -> None:
    """Rotate/flip ``image`` in place per its EXIF Orientation; unreadable EXIF is ignored."""
    try:
        ImageOps.exif_transpose(image, in_place=True)
    except Exception as exc:  # a bad EXIF block should not cost the user the image  # noqa: BLE001
        logger.debug("EXIF orientation ignored: %r", exc)


def _on_white(image: Image.Image) -> Image.Image:
    rgba = image.convert("RGBA")
    background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    background.alpha_composite(rgba)
    return background.convert("RGB")


def _to_rgb(image: Image.Image) -> Image.Image:
    """Return ``image`` as a new, loaded RGB image (a copy even when already RGB)."""
    mode = image.mode
    if mode == "RGB":
        return image.copy()
    if mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        return _on_white(image)
    if mode == "P":
        if "transparency" in image.info:
            return _on_white(image)
        return image.convert("RGB")
    if mode.startswith("I;16") or mode == "I":
        wide = image.convert("I") if mode != "I" else image
        _low, high = cast("tuple[float, float]", wide.getextrema())
        if high > 255:  # 16-bit samples: scale 0..65535 onto 0..255
            wide = wide.point(lambda v: v * (255.0 / 65535.0))
        return wide.convert("L").convert("RGB")
    if mode == "F":
        low, high = cast("tuple[float, float]", image.getextrema())
        if high <= 1.0 and low >= 0.0:  # float samples in 0..1
            image = image.point(lambda v: v * 255.0)
        return image.convert("L").convert("RGB")
    try:
        return image.convert("RGB")  # 1, L, CMYK, YCbCr, HSV, ...
    except ValueError:
        raise ServiceError(ErrorCode.IMAGE_INVALID, f"unsupported colour mode {mode}") from None
