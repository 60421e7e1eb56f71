"""llava-1.5's image preprocessing on the model's device.

transformers' CLIP image processor (the Pillow one here: its torchvision one needs torchvision, which does
not install beside the CPU torch wheel) resizes each image's shortest edge to 336 with Pillow's bicubic
filter, crops the centre 336 x 336, rescales to [0, 1] and normalises, on the host. On a GPU most of a replayed vision
tower's time for one image was that host work (benchmarks/results/the-gpu-table.md). :class:`DevicePixels` does the same steps on the device: the decoded image's bytes are copied
there (through pinned memory on a GPU), resized with PyTorch's antialiased bicubic filter (Pillow's
``a = -0.5`` kernel, widened when shrinking, as Pillow's is) and rounded to whole levels as Pillow's
8-bit output is, then cropped, rescaled and normalised.

Pillow resizes in two passes, across then down, each rounded and clipped to 8 bits; so does this (one
pass of both would keep the first pass's overshoot at sharp edges: up to 7 levels apart on the test
photographs). The pixel values are then Pillow's but for its fixed-point arithmetic: at most one level
apart (:data:`MAX_LEVEL_DIFFERENCE`), in 0.01-0.14% of the values of six scikit-image photographs. The
features may still differ from ``model.generate``'s on the processor's pixels, so the
``image_preprocessing`` setting keeps the host's Pillow path by default until a GPU measures both.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

__all__ = ["MAX_LEVEL_DIFFERENCE", "DevicePixels", "resized_size"]

#: Largest difference, in 8-bit levels before rescaling, between a value of :class:`DevicePixels` and the
#: processor's (Pillow's fixed-point filter weights against PyTorch's float ones).
MAX_LEVEL_DIFFERENCE = 1

#: Pillow's bicubic filter (``PIL.Image.Resampling.BICUBIC``), the only one done here.
_BICUBIC = 3


def resized_size(height: int, width: int, shortest_edge: int) -> tuple[int, int]:
    """``(height, width)`` with the shorter side ``shortest_edge`` and the longer one scaled and truncated,
    as transformers' ``get_resize_output_image_size(..., default_to_square=False)`` gives them."""
    short, long = (width, height) if width <= height else (height, width)
    new_short, new_long = shortest_edge, int(shortest_edge * long / short)
    return (new_long, new_short) if width <= height else (new_short, new_long)


class DevicePixels:
    """A CLIP image processor's steps on ``device`` (module docstring).

    Args:
        shortest_edge: the resize's target for the shorter side (336 for llava-1.5).
        crop: ``(height, width)`` of the centre crop.
        scale: the rescale factor (1/255).
        mean, std: the per-channel normalisation, RGB.
        device, dtype: where and in what the pixel values are returned.
    """

    def __init__(
        self,
        shortest_edge: int,
        crop: tuple[int, int],
        scale: float,
        mean: Sequence[float],
        std: Sequence[float],
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.shortest_edge, self.crop, self.scale = shortest_edge, crop, scale
        self.device, self.dtype = device, dtype
        self._mean = torch.tensor(list(mean), dtype=torch.float32, device=device)[:, None, None]
        self._std = torch.tensor(list(std), dtype=torch.float32, device=device)[:, None, None]

    @classmethod
    def for_processor(cls, image_processor: Any, device: torch.device, dtype: torch.dtype) -> DevicePixels | None:
        """The device steps of ``image_processor`` when it is a plain CLIP one (resize the shortest edge
        bicubic to at least the crop, centre crop, rescale, normalise, RGB; no tiling); None for any other
        (LLaVA-NeXT's and OneVision's tiles keep the processor, as does a crop the resize may not cover,
        which the processor pads)."""
        size = _as_dict(getattr(image_processor, "size", None))
        crop = _as_dict(getattr(image_processor, "crop_size", None))
        plain = (
            getattr(image_processor, "do_resize", False)
            and getattr(image_processor, "do_center_crop", False)
            and getattr(image_processor, "do_rescale", False)
            and getattr(image_processor, "do_normalize", False)
            and int(getattr(image_processor, "resample", -1)) == _BICUBIC
            and getattr(image_processor, "image_grid_pinpoints", None) is None
            and set(size) == {"shortest_edge"}
            and {"height", "width"} <= set(crop)
            and int(size["shortest_edge"]) >= max(int(crop["height"]), int(crop["width"]))  # no padding
        )
        if not plain:
            return None
        return cls(
            int(size["shortest_edge"]),
            (int(crop["height"]), int(crop["width"])),
            float(image_processor.rescale_factor),
            image_processor.image_mean,
            image_processor.image_std,
            device,
            dtype,
        )

    def __call__(self, images: Sequence[Any]) -> torch.Tensor:
        """The pixel values of RGB ``images`` (PIL images or ``[H, W, 3]`` uint8 arrays): ``[N, 3, crop
        height, crop width]`` in the model's dtype, on the device.

        Raises:
            ValueError: an image is not ``[H, W, 3]`` uint8, or is smaller than one pixel a side.
        """
        return torch.stack([self._one(image) for image in images]).to(self.dtype)

    def _one(self, image: Any) -> torch.Tensor:
        array = np.asarray(image.convert("RGB") if hasattr(image, "convert") else image)
        if array.ndim != 3 or array.shape[2] != 3 or array.dtype != np.uint8 or 0 in array.shape:
            raise ValueError(f"an image must be [H, W, 3] uint8, not {array.shape} {array.dtype}")
        host = torch.empty(array.shape, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
        np.copyto(host.numpy(), array)  # the image's one host copy (pinned on a GPU)
        levels = host.to(self.device, non_blocking=True).permute(2, 0, 1)[None].to(torch.float32)
        height, width = resized_size(array.shape[0], array.shape[1], self.shortest_edge)
        resized = levels
        for size in ((levels.shape[2], width), (height, width)):  # Pillow's passes: across, then down
            if tuple(resized.shape[2:]) != size:
                resized = F.interpolate(resized, size=size, mode="bicubic", antialias=True, align_corners=False)
                resized = resized.round_().clamp_(0, 255)  # each pass's 8-bit output, as Pillow's
        resized = resized[0]
        crop_h, crop_w = self.crop
        top, left = (height - crop_h) // 2, (width - crop_w) // 2
        cropped = resized[:, top : top + crop_h, left : left + crop_w]  # never short: the resize covers the crop
        return (cropped * self.scale - self._mean) / self._std


def _as_dict(value: Any) -> dict[str, Any]:
    """A processor's size field as a plain dict (transformers keeps some as ``SizeDict``), without Nones."""
    if value is None:
        return {}
    items = value.items() if hasattr(value, "items") else vars(value).items()
    return {k: v for k, v in items if v is not None}
