"""A checkpoint's video path: which models have one, a video's placeholder count, its frames' pixels.

LLaVA-OneVision encodes a video as its frames through the vision tower and projector, each frame's
patch grid pooled bilinearly to half its side (rounded up), then one ``image_newline`` row
(``LlavaOnevisionModel.get_video_features`` and ``apply_pooling``, transformers 5.x): ``frames x
ceil(side / 2)**2 + 1`` rows, 196 per frame + 1 at 384 px with 14 px patches, the count the processor
gives (``LlavaOnevisionProcessor._get_num_multimodal_tokens(video_sizes=...)``).

The video processors of transformers 5.x need torchvision, which does not install beside the CPU torch
wheel used here (its 0.28 wheel imports without its ``nms`` operator). The frames are preprocessed as
the video processor's settings say (``video_preprocessor_config.json``, else the class defaults of
``LlavaOnevisionVideoProcessor``: 384 x 384, bicubic, rescale 1/255, OpenAI CLIP mean and std), with
Pillow's resize, as the image processors' PIL backend resizes. No torch module state here.
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

#: The architectures whose video path is served (transformers class names). llava-1.5 and LLaVA-NeXT
#: have none; LLaVA-NeXT-Video is not served yet (docs/design.md, known limits).
VIDEO_ARCHITECTURES: tuple[str, ...] = ("LlavaOnevisionForConditionalGeneration",)

#: ``LlavaOnevisionVideoProcessor``'s class defaults (transformers 5.x,
#: ``models/llava_onevision/video_processing_llava_onevision.py``): OpenAI CLIP's mean and std.
_ONEVISION_DEFAULTS: dict[str, Any] = {
    "size": {"height": 384, "width": 384},
    "resample": 3,  # PIL bicubic
    "rescale_factor": 1 / 255,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
}

#: The checkpoint file transformers writes a video processor's settings to.
VIDEO_CONFIG_NAME = "video_preprocessor_config.json"


@dataclass(frozen=True)
class VideoPreprocessing:
    """How a checkpoint's video processor turns frames into pixels.

    Attributes:
        height, width: the resized frame, pixels.
        resample: Pillow's resampling filter number (3: bicubic).
        rescale_factor: multiplies the uint8 values (1/255).
        image_mean, image_std: per channel (R, G, B), applied after rescaling.
    """

    height: int
    width: int
    resample: int
    rescale_factor: float
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]

    @classmethod
    def from_settings(cls, settings: dict[str, Any]) -> VideoPreprocessing:
        """Build from a video processor's settings (the keys of ``video_preprocessor_config.json``;
        missing keys take ``LlavaOnevisionVideoProcessor``'s defaults)."""
        merged = {**_ONEVISION_DEFAULTS, **{k: v for k, v in settings.items() if v is not None}}
        size = merged["size"]
        return cls(
            height=int(size["height"]),
            width=int(size["width"]),
            resample=int(merged["resample"]),
            rescale_factor=float(merged["rescale_factor"]),
            image_mean=tuple(float(x) for x in merged["image_mean"]),  # type: ignore[arg-type]
            image_std=tuple(float(x) for x in merged["image_std"]),  # type: ignore[arg-type]
        )

    @classmethod
    def from_folder(cls, model_dir: str | Path) -> VideoPreprocessing:
        """Read ``model_dir/video_preprocessor_config.json`` (the class defaults where it is absent).

        Raises:
            ValueError: the file is not JSON or its size has no height and width.
        """
        path = Path(model_dir) / VIDEO_CONFIG_NAME
        settings = json.loads(path.read_text()) if path.is_file() else {}
        try:
            return cls.from_settings(settings)
        except (KeyError, TypeError) as exc:
            raise ValueError(f"{path}: not a video processor's settings ({exc})") from None


@dataclass(frozen=True)
class EncodedVideo:
    """A sampled video whose feature rows are already computed (its frames through the vision tower a
    few per step, then the newline row): the runner takes ``features`` as they are.

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


def video_token_count(config: Any, num_frames: int) -> int:
    """Placeholder tokens of a video of ``num_frames`` frames on a LLaVA-OneVision ``config``:
    ``num_frames x ceil(side / 2)**2 + 1``, ``side = image_size // patch_size`` (module docstring)."""
    vision = config.vision_config
    pooled = math.ceil((vision.image_size // vision.patch_size) / 2)
    return num_frames * pooled * pooled + 1


def preprocess_frames(frames: np.ndarray, prep: VideoPreprocessing) -> torch.Tensor:
    """Resize, rescale and normalise sampled frames as the checkpoint's video processor does.

    Args:
        frames: ``[T, H, W, 3]`` uint8 RGB.
        prep: the checkpoint's settings.

    Returns:
        ``pixel_values_videos`` of one video: ``[1, T, 3, prep.height, prep.width]`` float32 (CPU).
    """
    resized = np.stack(
        [
            np.asarray(
                Image.fromarray(frame).resize((prep.width, prep.height), resample=Image.Resampling(prep.resample))
            )
            for frame in frames
        ]
    ).astype(np.float32)
    mean = np.asarray(prep.image_mean, dtype=np.float32)
    std = np.asarray(prep.image_std, dtype=np.float32)
    pixels = (resized * np.float32(prep.rescale_factor) - mean) / std
    return torch.from_numpy(np.ascontiguousarray(pixels.transpose(0, 3, 1, 2))).unsqueeze(0)
