"""LLaVA-NeXT's and OneVision's vision tower and projector as CUDA graphs, one per tile count.

llava-1.5 feeds its tower one fixed shape, captured once (:mod:`.vision_graph`). LLaVA-NeXT
(``LlavaNextForConditionalGeneration``) and OneVision (``LlavaOnevisionForConditionalGeneration``) cut an
image into tiles of the tower's input size, ``[k, 3, S, S]``: a base tile and the grid of the
resolution in ``image_grid_pinpoints`` that fits the image best, so ``k`` is one of a few counts
(:func:`tile_counts`: 3, 4 or 5 for llava-v1.6's five pinpoints; up to 37 for OneVision's 6 x 6 grid,
and 1 for OneVision's several-image mode). The tower's and projector's work depends only on ``k``; what
follows (unpadding each image's grid to its aspect ratio, the newline rows, OneVision's pooling of large
grids) depends on the image's size and stays the model's own ``pack_image_features``, run eagerly.

:class:`TileGraphs` captures the tower up to the configured feature layer, the feature selection and the
projector at every tile count, over one persistent input buffer (the largest first, in one memory pool).
:meth:`TileGraphs.run` feeds each image's tiles through the graph of its count, then packs them as
``get_image_features`` does. The projector's features of an image are the same whether its tiles run
alone or stacked with another image's (every op of a ViT is per tile); the tests compare the two paths.

References: transformers' ``LlavaNextModel.get_image_features`` and ``LlavaOnevisionModel.get_image_features``
(tiles per image from ``image_size_to_num_patches``, the tower's hidden state at ``vision_feature_layer``,
``default`` drops the CLS position, then ``multi_modal_projector`` and ``pack_image_features``); PyTorch,
"CUDA Graphs".
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

from .graph_table import GraphTable, capture_failed

__all__ = ["TILED_ARCHITECTURES", "TileGraphs", "tile_counts"]

log = logging.getLogger(__name__)

#: The architectures whose images are tiles of the tower's input size.
TILED_ARCHITECTURES = ("LlavaNextForConditionalGeneration", "LlavaOnevisionForConditionalGeneration")


def tile_counts(config: Any) -> list[int]:
    """Every tile count an image of a model of ``config`` may have, ascending: 1 (OneVision's several-image
    mode, a base tile alone) and, per ``image_grid_pinpoints`` resolution ``(h, w)``, the grid's
    ``(h // S) x (w // S)`` tiles plus the base tile (``S``: ``vision_config.image_size``)."""
    size = int(config.vision_config.image_size)
    return sorted({1} | {(int(h) // size) * (int(w) // size) + 1 for h, w in config.image_grid_pinpoints})


class TileGraphs:
    """The tower and projector of a tiled model at each tile count (module docstring).

    Args:
        model: the transformers model (``...ForConditionalGeneration``); architecture: its class name;
        device, dtype: the model's.

    Attributes:
        counts: the tile counts (:func:`tile_counts`); tower: the tower and projector's
            :class:`~.graph_table.GraphTable`, keyed by tile count (a count not captured, as on a CPU,
            runs eagerly at its own shape).
    """

    def __init__(self, model: Any, architecture: str, device: torch.device, dtype: torch.dtype) -> None:
        self.inner = getattr(model, "model", model)
        self.config = model.config
        self.onevision = architecture == "LlavaOnevisionForConditionalGeneration"
        self.counts = tile_counts(self.config)
        size = int(self.config.vision_config.image_size)
        self.pixels = torch.zeros(self.counts[-1], 3, size, size, device=device, dtype=dtype)
        self.tower: GraphTable[int] = GraphTable(lambda k: self._projected(self.pixels[:k]))

    @property
    def num_replays(self) -> int:
        """Images whose tiles ran through a graph."""
        return self.tower.num_replays

    @classmethod
    def capture(cls, model: Any, architecture: str, device: torch.device, dtype: torch.dtype) -> TileGraphs | None:
        """Capture the tower and projector at every tile count on a CUDA device, the largest first.

        Returns:
            The graphs; None for another architecture, on another device, or when a capture failed
            (logged: the images are then encoded eagerly, as before).
        """
        if device.type != "cuda" or architecture not in TILED_ARCHITECTURES:
            return None
        graphs = cls(model, architecture, device, dtype)
        try:
            with torch.inference_mode():
                graphs.tower.capture(reversed(graphs.counts), device=device)
        except Exception as exc:  # noqa: BLE001 - any failure: the tower runs eagerly, as before
            capture_failed("the vision tower per tile count", "images are encoded eagerly", exc)
            return None
        log.info("captured the vision tower at %d tile counts (%s)", graphs.tower.num_graphs, graphs.counts)
        return graphs

    def matches(self, pixel_values: torch.Tensor, kwargs: dict[str, Any]) -> bool:
        """Whether a call's ``pixel_values`` (``[N, tiles, 3, S, S]`` with ``image_sizes``) take the graphs."""
        return (
            pixel_values.dim() == 5 and "image_sizes" in kwargs and set(kwargs) <= {"image_sizes", "batch_num_images"}
        )

    def run(
        self, pixel_values: torch.Tensor, image_sizes: Any = None, batch_num_images: Any = None
    ) -> list[torch.Tensor]:
        """``get_image_features`` of the ``N`` images of ``pixel_values`` (``[N, tiles, 3, S, S]`` on the
        device, the model's dtype; ``image_sizes`` ``[N, 2]``, height and width; OneVision's
        ``batch_num_images``), each image's tiles through the graph of its count (eagerly where none
        was captured, as on a CPU), packed by the model's own ``pack_image_features``.

        Returns:
            One ``[image_tokens_i, text_hidden]`` tensor per image, the caller's own.
        """
        if batch_num_images is None:
            patching = [True] * len(image_sizes)
        else:  # OneVision's several-image mode: each image its base tile alone
            patching = [int(n) == 1 for n in batch_num_images for _ in range(int(n))]
        size = int(self.config.vision_config.image_size)
        per_image = []
        for pixels, image_size, patch in zip(pixel_values, image_sizes, patching, strict=False):
            count = image_size_to_num_patches(image_size, self.config.image_grid_pinpoints, size) if patch else 1
            per_image.append(self._tiles(pixels[:count]))
        if self.onevision:
            kwargs = {"vision_aspect_ratio": self.config.vision_aspect_ratio}
        else:
            kwargs = {"vision_feature_select_strategy": self.config.vision_feature_select_strategy}
        packed, _ = self.inner.pack_image_features(
            per_image, image_sizes, image_newline=self.inner.image_newline, **kwargs
        )
        return [f.reshape(-1, f.shape[-1]).contiguous() for f in packed]

    def _tiles(self, pixels: torch.Tensor) -> torch.Tensor:
        """The projector's features of one image's ``k`` tiles (``[k, 3, S, S]``): ``[k, patches, text_hidden]``."""
        count = pixels.shape[0]
        if not self.tower.captured(count):
            return self._projected(pixels)
        self.pixels[:count].copy_(pixels)
        return self.tower(count)

    def _projected(self, pixels: torch.Tensor) -> torch.Tensor:
        """The tower's hidden state at the configured layer(s), selected and projected: ``[k, patches, text_hidden]``."""
        hidden = self.inner.vision_tower(pixels, output_hidden_states=True).hidden_states
        layer = self.config.vision_feature_layer
        selected = hidden[layer] if isinstance(layer, int) else torch.cat([hidden[i] for i in layer], dim=-1)
        if self.config.vision_feature_select_strategy == "default":
            selected = selected[:, 1:]
        return self.inner.multi_modal_projector(selected)
