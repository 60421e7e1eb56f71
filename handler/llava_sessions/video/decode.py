"""Reading a video clip from memory with PyAV (FFmpeg) and sampling its frames uniformly, under caps.

What a hostile clip cannot do here:

- make a demuxer open anything: only the MP4/QuickTime and Matroska/WebM demuxers run, chosen from
  the file's own first bytes (never FFmpeg's probe, which would take an HLS or DASH playlist or an
  ``ffconcat`` list and open the URLs in it), and QuickTime's external data references stay off
  (``enable_drefs=0``, FFmpeg's default, set explicitly);
- make the server hold a large clip whole: the frame size is checked against the header before any
  frame is decoded, only the sampled frames are converted to RGB and kept, and the frames decoded to
  reach them are counted against a cap (a long clip is reached by seeking to each sample's keyframe);
- crash the worker: every FFmpeg failure (truncated, corrupt, no video stream, no frames, a codec
  outside :data:`VIDEO_CODECS`) is a typed :class:`~llava_sessions.errors.ServiceError`.

The sampled frame indices are transformers' own (``transformers.video_utils.default_sample_indices_fn``,
5.x): ``arange(n) * total // n`` for ``n`` frames, and with ``fps``, ``n = max(1, int(total / video_fps * fps))``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from io import BytesIO
from typing import Any

import numpy as np

from ..errors import ErrorCode, ServiceError

__all__ = [
    "VIDEO_CODECS",
    "VIDEO_CONTAINERS",
    "SampledVideo",
    "VideoInfo",
    "VideoLimits",
    "decode_video",
    "probe_video",
]

logger = logging.getLogger(__name__)

#: The containers read, by the FFmpeg demuxer that reads them: MP4 and QuickTime (``mov``), WebM and
#: Matroska (``matroska``). Anything else (AVI, FLV, MPEG-TS, playlists, images) is refused unopened.
VIDEO_CONTAINERS: dict[str, str] = {"mov": "mp4/mov", "matroska": "webm/mkv"}

#: The video codecs decoded (FFmpeg's decoder names), those of the clips phones, browsers and
#: encoders write; another codec is refused from the header.
VIDEO_CODECS: tuple[str, ...] = ("h264", "hevc", "vp8", "vp9", "av1", "mpeg4")

#: First bytes of a Matroska/WebM file: the EBML header's element id (RFC 8794, section 8.1).
_EBML_MAGIC = b"\x1a\x45\xdf\xa3"

#: Box types that begin an MP4/QuickTime file at bytes 4-8 (ISO/IEC 14496-12 section 4.2;
#: QuickTime files may begin with ``wide``/``free``/``mdat``/``moov`` instead of ``ftyp``).
_MP4_FIRST_BOXES = (b"ftyp", b"moov", b"mdat", b"wide", b"free", b"skip")

#: Seek to a sample's keyframe when it lies more than this far past the last decoded frame (seconds);
#: nearer samples are reached by decoding on.
_SEEK_GAP_S = 1.0


@dataclass(frozen=True)
class VideoLimits:
    """The caps a video is read under (the video input's settings).

    Attributes:
        max_bytes: most bytes of one encoded clip (64 MiB).
        max_frame_pixels: most pixels (width x height) of a frame, checked against the header before
            any frame is decoded: 1920 x 1088 covers 1080p (a sampled RGB frame is then at most 6 MB;
            the vision towers resize frames to 336-384 px, so 4K buys nothing).
        max_frames: most frames sampled from one clip (each costs the vision tower and 144-197
            tokens of context on LLaVA-NeXT-Video / OneVision).
        default_num_frames: frames sampled when the request names neither ``num_frames`` nor ``fps``.
        max_decoded_frames: most frames decoded to reach the sampled ones: 32 samples x a 256-frame
            keyframe interval (x264's default is 250), each sample costing at most a decode from its
            keyframe; a clip whose keyframes are too sparse to seek costs a decode of everything before
            its last sample, and is refused past this.
    """

    max_bytes: int = 64 * 1024 * 1024
    max_frame_pixels: int = 1920 * 1088
    max_frames: int = 32
    default_num_frames: int = 8
    max_decoded_frames: int = 32 * 256

    @classmethod
    def from_settings(cls, settings: Any) -> VideoLimits:
        """The limits a server's :class:`~llava_sessions.config.Settings` set: ``max_video_bytes``,
        ``max_video_frames`` and ``video_num_frames`` (capped by ``max_video_frames``); the frame-size
        and decoded-frame caps keep their defaults."""
        return cls(
            max_bytes=settings.max_video_bytes,
            max_frames=settings.max_video_frames,
            default_num_frames=min(settings.video_num_frames, settings.max_video_frames),
        )


@dataclass(frozen=True)
class VideoInfo:
    """What a clip's header says, read before any frame is decoded.

    Attributes:
        container: ``"mp4/mov"`` or ``"webm/mkv"`` (:data:`VIDEO_CONTAINERS`).
        codec: FFmpeg's decoder name (``"h264"``, ``"vp9"``, ...).
        width: frame width in pixels.
        height: frame height in pixels.
        num_frames: frames in the clip: the header's count, or duration x frame rate where the header
            has none (WebM's is 0).
        duration_s: the clip's duration in seconds.
        fps: the average frame rate (frames per second).
    """

    container: str
    codec: str
    width: int
    height: int
    num_frames: int
    duration_s: float
    fps: float


@dataclass(frozen=True)
class SampledVideo:
    """A clip's sampled frames.

    Attributes:
        frames: ``[T, H, W, 3]`` uint8 RGB, T = the number sampled.
        indices: each frame's index in the clip (0-based, ascending), as transformers samples them.
        timestamps_s: each frame's presentation time in seconds.
        info: the header read first.
        num_decoded_frames: frames decoded to reach them (at most ``VideoLimits.max_decoded_frames``).
        num_asked_frames: frames the request asked for (``num_frames``, or ``fps`` over the clip's
            duration); more than the clip has gives every frame (:attr:`shortfall`). 0: it asked neither.
    """

    frames: np.ndarray
    indices: tuple[int, ...]
    timestamps_s: tuple[float, ...]
    info: VideoInfo
    num_decoded_frames: int
    num_asked_frames: int = 0

    @property
    def shortfall(self) -> str | None:
        """A sentence for the reply when the request asked more frames than the clip has (every
        frame is then used, as transformers' sampler does), else None."""
        if self.num_asked_frames <= self.num_frames:
            return None
        return (
            f"the video has {self.num_frames} frames and {self.num_asked_frames} were asked: "
            f"all {self.num_frames} are used"
        )

    @property
    def num_frames(self) -> int:
        """Frames sampled (T)."""
        return int(self.frames.shape[0])

    @property
    def height(self) -> int:
        """Frame height, pixels."""
        return int(self.frames.shape[1])

    @property
    def width(self) -> int:
        """Frame width, pixels."""
        return int(self.frames.shape[2])


def probe_video(data: bytes, *, limits: VideoLimits | None = None) -> VideoInfo:
    """Read a clip's header (container, codec, size, frame count, duration) without decoding a frame.

    Args:
        data: the encoded clip.
        limits: the caps (:class:`VideoLimits` defaults when None).

    Returns:
        The :class:`VideoInfo`.

    Raises:
        ServiceError: ``video_too_large`` (413) over ``max_bytes`` or ``max_frame_pixels``;
            ``video_invalid`` (400) for an empty file, a container outside :data:`VIDEO_CONTAINERS`
            (playlists, images, other formats), a file FFmpeg cannot read, no video stream, no
            frames, or a codec outside :data:`VIDEO_CODECS`.
    """
    limits = limits or VideoLimits()
    with _open(data, limits) as (_, info):
        return info


def decode_video(
    data: bytes, *, num_frames: int | None = None, fps: float | None = None, limits: VideoLimits | None = None
) -> SampledVideo:
    """Sample a clip's frames uniformly and decode those alone to RGB.

    Args:
        data: the encoded clip.
        num_frames: frames to sample (1 to ``limits.max_frames``); exclusive with ``fps``.
        fps: frames to sample per second of the clip (> 0); exclusive with ``num_frames``. Neither:
            ``limits.default_num_frames``, or every frame of a shorter clip.
        limits: the caps (:class:`VideoLimits` defaults when None).

    Returns:
        The :class:`SampledVideo`: ``frames`` ``[T, H, W, 3]`` uint8.

    Raises:
        ServiceError: ``invalid_parameter`` (400) for both ``num_frames`` and ``fps``, a value out of
            range, or more frames than ``limits.max_frames`` (the message names the cap);
            ``video_too_large`` (413) as :func:`probe_video`, or when reaching the samples would decode
            more than ``limits.max_decoded_frames``; ``video_invalid`` (400) as :func:`probe_video`,
            and for a clip that is truncated or corrupt, or whose frames change size.
    """
    limits = limits or VideoLimits()
    with _open(data, limits) as (container, info):
        indices, asked = _sample_indices(info, num_frames=num_frames, fps=fps, limits=limits)
        stream = container.streams.video[0]
        start_s = float(stream.start_time * stream.time_base) if stream.start_time is not None else 0.0
        targets = [start_s + index / info.fps for index in indices]
        try:
            frames, times, num_decoded = _decode_at(container, stream, targets, info, limits)
        except ServiceError:
            raise
        except MemoryError:
            raise _too_large("the video's frames do not fit in memory") from None
        except Exception as exc:  # FFmpeg's errors (av.error.*), and ValueError/OSError from PyAV  # noqa: BLE001
            logger.debug("video decode failed: %r", exc)
            raise _invalid("the video is truncated or corrupt") from None
        return SampledVideo(np.stack(frames), tuple(indices), tuple(times), info, num_decoded, asked)


@contextmanager
def _open(data: bytes, limits: VideoLimits) -> Iterator[tuple[Any, VideoInfo]]:
    """``with _open(data, limits) as (container, info)``: the clip opened by its own demuxer, its
    header checked; the container is closed on leaving. Raises as :func:`probe_video`."""
    import av  # PyAV: imported on first use, so a worker that serves no video never loads FFmpeg

    if not data:
        raise _invalid("the video is empty (0 bytes)")
    if len(data) > limits.max_bytes:
        raise _too_large(f"the video is {len(data)} bytes, over the {limits.max_bytes}-byte limit")
    demuxer = _demuxer(data)
    if demuxer is None:
        accepted = ", ".join(VIDEO_CONTAINERS.values())
        raise _invalid(f"not a recognised video container (accepted: {accepted}; no playlists)")
    options = {"enable_drefs": "0", "use_absolute_path": "0"} if demuxer == "mov" else {}
    unreadable = _invalid(f"the {VIDEO_CONTAINERS[demuxer]} file is truncated or corrupt")
    try:
        container = av.open(BytesIO(data), format=demuxer, container_options=options, metadata_errors="ignore")
    except Exception as exc:  # av.error.* for unreadable input, and ValueError/OSError/IndexError  # noqa: BLE001
        logger.debug("video open failed: %r", exc)
        raise unreadable from None
    try:
        try:
            info = _info(container, VIDEO_CONTAINERS[demuxer])
        except ServiceError:
            raise
        except Exception as exc:  # a header PyAV reads but cannot describe  # noqa: BLE001
            logger.debug("video header unreadable: %r", exc)
            raise unreadable from None
        _check(info, limits)
        yield container, info
    finally:
        container.close()


def _demuxer(data: bytes) -> str | None:
    """The FFmpeg demuxer for ``data``'s first bytes (:data:`VIDEO_CONTAINERS`'s keys), or None."""
    if data[:4] == _EBML_MAGIC:
        return "matroska"
    if len(data) >= 8 and data[4:8] in _MP4_FIRST_BOXES:
        return "mov"
    return None


def _info(container: Any, name: str) -> VideoInfo:
    """The header of an opened container's first video stream (no frame decoded)."""
    if not container.streams.video:
        kinds = sorted({stream.type for stream in container.streams}) or ["none"]
        raise _invalid(f"the file has no video stream (its streams: {', '.join(kinds)})")
    stream = container.streams.video[0]
    codec = stream.codec_context.name if stream.codec_context is not None else "unknown"
    rate = stream.average_rate or stream.guessed_rate or stream.base_rate
    fps = float(rate) if rate else 0.0
    if stream.duration is not None and stream.time_base is not None:
        duration_s = float(stream.duration * stream.time_base)
    else:
        duration_s = container.duration / 1_000_000 if container.duration else 0.0  # AV_TIME_BASE
    num_frames = int(stream.frames) or (round(duration_s * fps) if fps > 0 else 0)
    width, height = int(stream.codec_context.width or 0), int(stream.codec_context.height or 0)
    return VideoInfo(name, codec, width, height, num_frames, duration_s, fps)


def _check(info: VideoInfo, limits: VideoLimits) -> None:
    """Refuse from the header: an unknown codec, no frames or size, frames over the pixel cap."""
    if info.codec not in VIDEO_CODECS:
        raise _invalid(f"the video codec {info.codec!r} is not accepted (accepted: {', '.join(VIDEO_CODECS)})")
    if info.width <= 0 or info.height <= 0 or info.num_frames <= 0 or info.fps <= 0:
        raise _invalid("the video has no frames")
    if info.width * info.height > limits.max_frame_pixels:
        raise _too_large(
            f"the video's frames are {info.width}x{info.height}, over the {limits.max_frame_pixels}-pixel "
            "frame limit (1080p fits); send it downscaled"
        )


def _sample_indices(
    info: VideoInfo, *, num_frames: int | None, fps: float | None, limits: VideoLimits
) -> tuple[list[int], int]:
    """The frame indices to keep, as transformers' ``default_sample_indices_fn``: ``arange(n) * total // n``
    for ``n`` from ``num_frames``, from ``fps`` (``total / info.fps * fps``),
    or ``limits.default_num_frames`` (at most ``total``); and the frames the request asked (0: neither
    ``num_frames`` nor ``fps``). Raises ``invalid_parameter`` (400)."""
    total = info.num_frames
    if num_frames is not None and fps is not None:
        raise _bad_parameter("give num_frames or fps, not both", "num_frames")
    if num_frames is not None:
        if isinstance(num_frames, bool) or not isinstance(num_frames, int) or num_frames < 1:
            raise _bad_parameter(f"num_frames must be a positive integer, got {num_frames!r}", "num_frames")
        wanted, asked = num_frames, f"num_frames={num_frames}"
    elif fps is not None:
        if isinstance(fps, bool) or not isinstance(fps, int | float) or not math.isfinite(fps) or fps <= 0:
            raise _bad_parameter(f"fps must be a positive number, got {fps!r}", "fps")
        wanted, asked = max(1, int(total / info.fps * fps)), f"fps={fps:g} over {info.duration_s:.1f} s"
    else:
        wanted, asked = min(limits.default_num_frames, total), ""
    if wanted > limits.max_frames:
        raise _bad_parameter(
            f"{asked} samples {wanted} frames, over the server's cap of {limits.max_frames} frames per video",
            "fps" if fps is not None else "num_frames",
        )
    chosen = min(wanted, total)
    return [i * total // chosen for i in range(chosen)], wanted if (num_frames is not None or fps is not None) else 0


def _decode_at(
    container: Any, stream: Any, targets: list[float], info: VideoInfo, limits: VideoLimits
) -> tuple[list[np.ndarray], list[float], int]:
    """Decode up to each target time (seconds, ascending) and keep the first frame at or past it
    (half a frame's tolerance), seeking to the target's keyframe when it lies more than
    :data:`_SEEK_GAP_S` ahead. Returns the frames ``[H, W, 3]`` uint8, their times, the count decoded."""
    frames: list[np.ndarray] = []
    times: list[float] = []
    half_frame_s = 0.5 / info.fps
    num_decoded, last_time, last_frame = 0, -math.inf, None
    decoded: Iterator[Any] | None = None
    for target in targets:
        if decoded is None or target - last_time > _SEEK_GAP_S:
            container.seek(max(0, int(target / stream.time_base)), stream=stream, backward=True)
            decoded = container.decode(stream)
        while last_time < target - half_frame_s:
            frame = next(decoded, None)
            if frame is None:
                break
            num_decoded += 1
            if num_decoded > limits.max_decoded_frames:
                raise _too_large(
                    f"reaching the sampled frames takes decoding more than {limits.max_decoded_frames} frames "
                    "(a long clip with too few keyframes); send a shorter clip"
                )
            if (frame.width, frame.height) != (info.width, info.height):  # the header's size passed _check
                raise _invalid(f"the video's frames change size ({frame.width}x{frame.height} after its header's)")
            last_time = frame.time if frame.time is not None else last_time + 1 / info.fps
            last_frame = frame
        if last_frame is None or last_time < target - 3 * half_frame_s:
            seen = f"{max(last_time, 0.0):.2f}" if last_frame is not None else "no frame"
            raise _invalid(
                f"the video is truncated: its frames end at {seen} s of the {info.duration_s:.2f} s it declares"
            )
        frames.append(last_frame.to_ndarray(format="rgb24"))
        times.append(float(last_time))
    return frames, times, num_decoded


def _invalid(message: str) -> ServiceError:
    return ServiceError(ErrorCode.VIDEO_INVALID, message)


def _too_large(message: str) -> ServiceError:
    return ServiceError(ErrorCode.VIDEO_TOO_LARGE, message)


def _bad_parameter(message: str, param: str) -> ServiceError:
    return ServiceError(ErrorCode.INVALID_PARAMETER, message, param=param)
