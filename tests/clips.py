"""Video clips for the tests: real photographs (``skimage.data``) panned across frames, encoded by PyAV."""

from __future__ import annotations

import io
from fractions import Fraction

import av
import numpy as np

__all__ = ["pan_clip"]


def pan_clip(photo: np.ndarray, *, num_frames: int = 16, fps: int = 8, size: tuple[int, int] = (96, 64)) -> bytes:
    """An H.264 MP4 of ``num_frames`` crops of ``photo`` (``size`` = width, height), moving across it."""
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        stream = out.add_stream("h264", rate=fps)
        stream.width, stream.height = size
        stream.pix_fmt = "yuv420p"
        for i in range(num_frames):
            crop = np.ascontiguousarray(photo[i * 8 : i * 8 + size[1], i * 10 : i * 10 + size[0], :3])
            frame = av.VideoFrame.from_ndarray(crop, format="rgb24").reformat(format="yuv420p")
            frame.pts, frame.time_base = i, Fraction(1, fps)
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()
