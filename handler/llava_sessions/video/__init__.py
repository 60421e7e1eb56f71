"""Videos (issue 44's intake): a clip's container read under caps and its frames sampled uniformly
(:mod:`.decode`). No torch, no network: the bytes come from the images' fetch rules.

Not served yet: no route takes a video until the engine's video path lands (docs/design.md)."""

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
