"""A checkpoint's video path: which models have one, a video's placeholder count, its frames' pixels.

- **LLaVA-OneVision** encodes a video as its frames through the vision tower and projector, each
  frame's patch grid pooled bilinearly to half its side (rounded up), then one ``image_newline`` row
  (``LlavaOnevisionModel.get_video_features`` and ``apply_pooling``, transformers 5.x): ``frames x
  ceil(side / 2)**2 + 1`` rows, 196 per frame + 1 at 384 px with 14 px patches, the processor's count
  (``LlavaOnevisionProcessor._get_num_multimodal_tokens(video_sizes=...)``).
- **LLaVA-NeXT-Video** runs each frame through the CLIP tower, drops the CLS position, average-pools
  the patch grid by ``spatial_pool_stride`` (2) and projects (``LlavaNextVideoModel.get_video_features``):
  ``frames x (side // 2)**2`` rows, no newline, 144 per frame at 336 px, the processor's count
  (``LlavaNextVideoProcessor.replace_video_token``: ``(h // patch) x (w // patch) // 4`` per frame).

The video processors of transformers 5.x need torchvision, which does not install beside the CPU torch
wheel used here (its 0.28 wheel imports without its ``nms`` operator). The frames are preprocessed as
the checkpoint's video processor's settings say (``video_preprocessor_config.json``, else the class
defaults of ``LlavaOnevisionVideoProcessor``: 384 x 384, or ``LlavaNextVideoVideoProcessor``: shortest
edge 224 then a 224 x 224 center crop; bicubic, rescale 1/255, OpenAI CLIP mean and std), with Pillow's
resize, as the image processors' PIL backend resizes. No torch module state here.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

__all__ = [
    "VIDEO_ARCHITECTURES",
    "EncodedVideo",
    "VideoPreprocessing",
    "is_sampled_video",
    "preprocess_frames",
    "video_token_count",
]

_CLIP = {"image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711]}

#: The architectures whose video path is served (transformers class names) and their video
#: processors' class defaults (transformers 5.x ``video_processing_llava_onevision.py`` and
#: ``video_processing_llava_next_video.py``). llava-1.5 and LLaVA-NeXT have no video path.
VIDEO_DEFAULTS: dict[str, dict[str, Any]] = {
    "LlavaOnevisionForConditionalGeneration": {
        "size": {"height": 384, "width": 384},
        "crop_size": None,
        "resample": 3,  # PIL bicubic
        "rescale_factor": 1 / 255,
        **_CLIP,
    },
    "LlavaNextVideoForConditionalGeneration": {
        "size": {"shortest_edge": 224},
        "crop_size": {"height": 224, "width": 224},
        "resample": 3,
        "rescale_factor": 1 / 255,
        **_CLIP,
    },
}
VIDEO_ARCHITECTURES: tuple[str, ...] = tuple(VIDEO_DEFAULTS)

#: The checkpoint file transformers writes a video processor's settings to.
VIDEO_CONFIG_NAME = "video_preprocessor_config.json"


@dataclass(frozen=True)
class VideoPreprocessing:
    """How a checkpoint's video processor turns frames into pixels.

    Attributes:
        size: ``(height, width)`` to resize to, or None with ``shortest_edge``.
        shortest_edge: resize so the shorter side is this many pixels (aspect kept), or None.
        crop: ``(height, width)`` of the center crop after the resize, or None.
        resample: Pillow's resampling filter number (3: bicubic).
        rescale_factor: multiplies the uint8 values (1/255).
        image_mean, image_std: per channel (R, G, B), applied after rescaling.
    """

    size: tuple[int, int] | None
    shortest_edge: int | None
    crop: tuple[int, int] | None
    resample: int
    rescale_factor: float
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]

    @property
    def frame_size(self) -> tuple[int, int]:
        """``(height, width)`` of a preprocessed frame (the crop, or the fixed size).

        Raises:
            ValueError: neither a crop nor a fixed size (the frame's size would depend on the clip's).
        """
        if self.crop is not None:
            return self.crop
        if self.size is not None:
            return self.size
        raise ValueError("a shortest-edge resize without a crop: the frame size depends on the clip")

    @classmethod
    def from_settings(
        cls, settings: dict[str, Any], architecture: str = "LlavaOnevisionForConditionalGeneration"
    ) -> VideoPreprocessing:
        """Build from a video processor's settings (the keys of ``video_preprocessor_config.json``;
        missing keys take ``architecture``'s video processor's class defaults, :data:`VIDEO_DEFAULTS`)."""
        defaults = VIDEO_DEFAULTS.get(architecture, VIDEO_DEFAULTS["LlavaOnevisionForConditionalGeneration"])
        merged = {**defaults, **{k: v for k, v in settings.items() if v is not None}}
        size, crop = merged["size"], merged.get("crop_size")
        if merged.get("do_center_crop") is False:
            crop = None
        return cls(
            size=(int(size["height"]), int(size["width"])) if "height" in size else None,
            shortest_edge=int(size["shortest_edge"]) if "shortest_edge" in size else None,
            crop=(int(crop["height"]), int(crop["width"])) if crop else None,
            resample=int(merged["resample"]),
            rescale_factor=float(merged["rescale_factor"]),
            image_mean=tuple(float(x) for x in merged["image_mean"]),
            image_std=tuple(float(x) for x in merged["image_std"]),
        )

    @classmethod
    def from_folder(cls, model_dir: str | Path, architecture: str) -> VideoPreprocessing:
        """Read ``model_dir/video_preprocessor_config.json`` (the class defaults where it is absent).

        Raises:
            ValueError: the file is not JSON, or its size has neither height and width nor shortest_edge.
        """
        path = Path(model_dir) / VIDEO_CONFIG_NAME
        settings = json.loads(path.read_text()) if path.is_file() else {}
        try:
            return cls.from_settings(settings, architecture)
        except (KeyError, TypeError) as exc:
            raise ValueError(f"{path}: not a video processor's settings ({exc})") from None


@dataclass(frozen=True)
class EncodedVideo:
    """A sampled video whose feature rows are already computed (its frames through the vision tower a
    few per step, then the newline row): the model takes ``features`` as they are.

    Attributes:
        video: the sampled video (``frames`` ``[T, H, W, 3]`` uint8).
        features: ``[video_token_count(T), text_hidden]``, model dtype, on the device.
    """

    video: Any
    features: torch.Tensor

    @property
    def num_frames(self) -> int:
        """Frames sampled (T)."""
        return int(self.video.num_frames)

    @property
    def height(self) -> int:
        """Frame height, pixels."""
        return int(self.video.height)

    @property
    def width(self) -> int:
        """Frame width, pixels."""
        return int(self.video.width)


def is_sampled_video(item: Any) -> bool:
    """Whether a decoded medium is a video whose frames are yet to be encoded (it has ``num_frames``
    and is not an :class:`EncodedVideo`)."""
    return getattr(item, "num_frames", None) is not None and not isinstance(item, EncodedVideo)


def video_token_count(config: Any, num_frames: int, prep: VideoPreprocessing | None = None) -> int:
    """Placeholder tokens of a video of ``num_frames`` frames (module docstring): on LLaVA-OneVision
    ``num_frames x ceil(side / 2)**2 + 1`` with ``side = image_size // patch_size``; on LLaVA-NeXT-Video
    ``num_frames x (h // patch // stride) x (w // patch // stride)`` for frames of ``prep``'s size
    (the vision tower's ``image_size`` without ``prep``)."""
    vision = config.vision_config
    stride = getattr(config, "spatial_pool_stride", None)
    if stride is None:  # OneVision: bilinear pooling to half the side, rounded up, and a newline row
        pooled = math.ceil((vision.image_size // vision.patch_size) / 2)
        return num_frames * pooled * pooled + 1
    height, width = prep.frame_size if prep is not None else (vision.image_size, vision.image_size)
    return num_frames * (height // vision.patch_size // stride) * (width // vision.patch_size // stride)


def preprocess_frames(frames: np.ndarray, prep: VideoPreprocessing) -> torch.Tensor:
    """Resize (to a fixed size, or the shorter side to ``shortest_edge``), center-crop, rescale and
    normalise sampled frames as the checkpoint's video processor does.

    Args:
        frames: ``[T, H, W, 3]`` uint8 RGB.
        prep: the checkpoint's settings.

    Returns:
        ``pixel_values_videos`` of one video: ``[1, T, 3, height, width]`` float32 (CPU), ``(height,
        width) = prep.frame_size``.
    """
    resample = Image.Resampling(prep.resample)
    out = []
    for frame in frames:
        image = Image.fromarray(frame)
        if prep.size is not None:
            image = image.resize((prep.size[1], prep.size[0]), resample=resample)
        elif prep.shortest_edge is not None:  # transformers' get_resize_output_image_size, default_to_square=False
            w, h = image.size
            short, long = (w, h) if w <= h else (h, w)
            new_short, new_long = prep.shortest_edge, int(prep.shortest_edge * long / short)
            image = image.resize((new_short, new_long) if w <= h else (new_long, new_short), resample=resample)
        if prep.crop is not None:
            ch, cw = prep.crop
            w, h = image.size
            top, left = (h - ch) // 2, (w - cw) // 2
            image = image.crop((left, top, left + cw, top + ch))
        out.append(np.asarray(image))
    resized = np.stack(out).astype(np.float32)
    mean = np.asarray(prep.image_mean, dtype=np.float32)
    std = np.asarray(prep.image_std, dtype=np.float32)
    pixels = (resized * np.float32(prep.rescale_factor) - mean) / std
    return torch.from_numpy(np.ascontiguousarray(pixels.transpose(0, 3, 1, 2))).unsqueeze(0)
