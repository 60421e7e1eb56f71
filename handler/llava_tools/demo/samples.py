"""Sample media for demos, tests and benchmarks: scikit-image's bundled pictures as JPEG bytes, and
clips panning across them (H.264 MP4, written by PyAV)."""

from __future__ import annotations

import io

__all__ = ["sample_clip", "sample_photo"]


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


def sample_clip(
    name: str = "astronaut",
    *,
    num_frames: int = 16,
    fps: int = 8,
    size: tuple[int, int] = (96, 64),
    step: tuple[int, int] = (10, 8),
) -> bytes:
    """An H.264 MP4 of ``num_frames`` crops of ``skimage.data.<name>()``, ``size`` (width, height)
    pixels, the crop moving ``step`` (x, y) pixels a frame across the photograph, at ``fps``.

    Raises:
        AttributeError: scikit-image has no picture of that name.
        ValueError: the last crop would leave the photograph.
    """
    from fractions import Fraction

    import av
    import numpy as np
    from skimage import data

    photo = getattr(data, name)()
    (w, h), (dx, dy) = size, step
    if (num_frames - 1) * dx + w > photo.shape[1] or (num_frames - 1) * dy + h > photo.shape[0]:
        raise ValueError(f"{num_frames} crops of {w}x{h} moving {step} leave the {name} photograph")
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        stream = out.add_stream("h264", rate=fps)
        stream.width, stream.height = size
        stream.pix_fmt = "yuv420p"
        for i in range(num_frames):
            crop = np.ascontiguousarray(photo[i * dy : i * dy + h, i * dx : i * dx + w, :3])
            frame = av.VideoFrame.from_ndarray(crop, format="rgb24").reformat(format="yuv420p")
            frame.pts, frame.time_base = i, Fraction(1, fps)
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()
