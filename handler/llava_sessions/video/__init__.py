"""Videos: a clip's container read under caps and its frames sampled uniformly
(:mod:`.decode`). No torch, no network: the bytes come from the images' fetch rules.

Served as a session's media on LLaVA-OneVision and LLaVA-NeXT-Video (docs/decisions/03-a-video-is-one-of-a-session-s-media.md)."""

from .decode import VIDEO_CODECS, VIDEO_CONTAINERS, SampledVideo, VideoInfo, VideoLimits, decode_video, probe_video

__all__ = [
    "VIDEO_CODECS",
    "VIDEO_CONTAINERS",
    "SampledVideo",
    "VideoInfo",
    "VideoLimits",
    "decode_video",
    "probe_video",
]
