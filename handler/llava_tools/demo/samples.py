"""Sample photographs for demos and benchmarks: scikit-image's bundled pictures as JPEG bytes."""

from __future__ import annotations

import io

__all__ = ["sample_photo"]


def sample_photo(name: str = "astronaut", *, quality: int = 90) -> bytes:
    """Return ``skimage.data.<name>()`` (e.g. ``astronaut``, ``chelsea``, ``coffee``, ``rocket``,
    ``cat``) encoded as an RGB JPEG of the given ``quality``.

    Raises:
        AttributeError: scikit-image has no picture of that name.
    """
    from PIL import Image
    from skimage import data

    buf = io.BytesIO()
    Image.fromarray(getattr(data, name)()).convert("RGB").save(buf, format="JPEG", quality=quality)
    return buf.getvalue()
