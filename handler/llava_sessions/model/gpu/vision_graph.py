"""llava-1.5's vision tower and projector as one CUDA graph at their fixed input.

A cold image turn eagerly is 1,686 kernel launches (the vision tower's 24 layers and a 600-token
prefill), with more host time than device time (benchmarks/results/the-gpu-table.md). llava-1.5
(``LlavaForConditionalGeneration``) feeds its tower one fixed shape, ``[1, 3, S, S]`` (``vision_config.image_size``, 336), so the whole of ``get_image_features`` can be
captured once and replayed: :meth:`VisionGraph.capture` records it over a persistent input buffer (after one
eager warm-up pass), and :meth:`VisionGraph.run` copies each image's pixels in, replays and copies the
features out (vLLM runs LLaVA's vision tower as a CUDA graph too). LLaVA-NeXT's and OneVision's tiles are
captured per tile count (:mod:`.tile_graphs`); videos keep the eager path.

References: PyTorch, "CUDA Graphs" (``torch.cuda.graph``, ``CUDAGraph.replay``, static inputs overwritten
with ``copy_``).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from .graph_table import GraphTable, capture_failed

__all__ = ["VisionGraph", "image_features"]

log = logging.getLogger(__name__)


def image_features(model: Any, pixel_values: torch.Tensor, **kwargs: Any) -> list[torch.Tensor]:
    """The transformers LLaVA ``model``'s own ``get_image_features`` on ``pixel_values`` (``[N, 3, H, W]``,
    or ``[N, tiles, 3, H, W]`` with ``image_sizes`` in ``kwargs``), at its configured feature layer and
    strategy: one ``[image_tokens_i, text_hidden]`` tensor per image."""
    out = model.get_image_features(
        pixel_values=pixel_values,
        vision_feature_layer=model.config.vision_feature_layer,
        vision_feature_select_strategy=model.config.vision_feature_select_strategy,
        **kwargs,
    )
    feats = out.pooler_output if hasattr(out, "pooler_output") else out
    per_image = list(feats) if isinstance(feats, (list, tuple)) else list(feats.unbind(0))
    return [f.reshape(-1, f.shape[-1]).contiguous() for f in per_image]


class VisionGraph:
    """``get_image_features`` of one image, captured as a CUDA graph over a persistent input buffer.

    Args:
        model: the transformers LLaVA model; device, dtype: the model's.

    Attributes:
        pixels: the input buffer ``[1, 3, S, S]``; tower: the pass's :class:`~.graph_table.GraphTable`
            (one key, 0); num_replays: images encoded by replay.

    Use :meth:`capture` (None where it does not apply or fails); :meth:`matches` says whether a call's
    pixels take the graph.
    """

    def __init__(self, model: Any, device: torch.device, dtype: torch.dtype) -> None:
        size = int(model.config.vision_config.image_size)
        self.model = model
        self.pixels = torch.zeros(1, 3, size, size, device=device, dtype=dtype)
        self.tower: GraphTable[int] = GraphTable(lambda _: self._features())

    @property
    def num_replays(self) -> int:
        """Images encoded by replay."""
        return self.tower.num_replays

    @classmethod
    def capture(cls, model: Any, architecture: str, device: torch.device, dtype: torch.dtype) -> VisionGraph | None:
        """Capture llava-1.5's ``get_image_features`` at ``[1, 3, S, S]`` on a CUDA device.

        Returns:
            The graph; None for another architecture, on another device, or when the capture failed
            (logged: the images are then encoded eagerly, as before).
        """
        if device.type != "cuda" or architecture != "LlavaForConditionalGeneration":
            return None
        graph = cls(model, device, dtype)
        try:
            with torch.inference_mode():
                graph.tower.capture([0], device=device)
        except Exception as exc:  # noqa: BLE001 - any failure: the tower runs eagerly, as before
            capture_failed("the vision tower", "images are encoded eagerly", exc)
            return None
        return graph

    def _features(self) -> torch.Tensor:
        """The model's own image path over :attr:`pixels`: ``[image_tokens, text_hidden]``."""
        return image_features(self.model, self.pixels)[0]

    def matches(self, pixel_values: torch.Tensor, kwargs: dict[str, Any]) -> bool:
        """Whether ``pixel_values`` (``[N, 3, S, S]``, no other arguments) take the graph."""
        return not kwargs and pixel_values.dim() == 4 and tuple(pixel_values.shape[1:]) == tuple(self.pixels.shape[1:])

    def run(self, pixel_values: torch.Tensor, **kwargs: Any) -> list[torch.Tensor]:
        """Each of the ``N`` images of ``pixel_values`` (``[N, 3, S, S]``, on the device, the model's dtype;
        no ``kwargs``: :meth:`matches`) through the graph: one ``[image_tokens, text_hidden]`` tensor each,
        the caller's own."""
        out = []
        for image in pixel_values.split(1):
            self.pixels.copy_(image)
            out.append(self.tower(0))
        return out
