"""llava-1.5's vision tower and projector as one CUDA graph at their fixed input (issue 59 item 4).

A cold image turn on an H200 took 66-116 ms: 1,686 kernel launches (the vision tower's 24 layers and a
600-token prefill), about 28 ms on the device and 39 ms of host time ("The GPU table"). llava-1.5
(``LlavaForConditionalGeneration``) feeds its tower one fixed shape, ``[1, 3, S, S]`` (``vision_config.image_size``, 336), so the whole of ``get_image_features`` can be
captured once and replayed: :meth:`VisionGraph.capture` records it over a persistent input buffer (after one
eager warm-up pass), and :meth:`VisionGraph.run` copies each image's pixels in, replays and copies the
features out (vLLM runs LLaVA's vision tower as a CUDA graph too). LLaVA-NeXT's and OneVision's tiles are
captured per tile count (:mod:`.tile_graphs`); videos keep the eager path.

References: PyTorch, "CUDA Graphs" (``torch.cuda.graph``, ``CUDAGraph.replay``, static inputs overwritten
with ``copy_``).
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import Any, TypeVar

import torch

__all__ = ["VisionGraph", "capture_each", "image_features", "no_collection"]

log = logging.getLogger(__name__)

K = TypeVar("K", bound=Hashable)


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


@contextlib.contextmanager
def no_collection() -> Iterator[None]:
    """Python's cyclic garbage collector off for the block, after one collection. An object freed while
    a stream captures (an earlier engine's CUDA graph, whose destructor resets it) invalidates the
    capture ("operation not permitted when stream is capturing", seen on an H200 in the GPU suite);
    ``torch.cuda.graph`` collects first only under ``torch.compiler.config.force_cudagraph_gc``."""
    gc.collect()
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


def capture_each(
    keys: Iterable[K], run: Callable[[K], torch.Tensor], pool: Any = None
) -> tuple[dict[K, Any], dict[K, torch.Tensor], Any]:
    """Capture ``run(key)`` as a CUDA graph for each of ``keys``, in their order, all in one memory pool
    (``pool``, a ``torch.cuda.graph`` pool handle to share, or None for a new one); each pass run once
    eagerly first (lazy initialisation and autotuning outside the capture), the garbage collector paused
    (:func:`no_collection`). Graphs in one pool must never run at once.

    Returns:
        ``(graphs, outputs, pool)``: each key's ``torch.cuda.CUDAGraph`` and the output tensor its replay
        overwrites, and the pool's handle.

    Raises:
        Exception: whatever a pass or a capture raised (the caller runs eagerly).
    """
    graphs: dict[K, Any] = {}
    outputs: dict[K, torch.Tensor] = {}
    with no_collection():
        for key in keys:
            run(key)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                outputs[key] = run(key)
            pool = graph.pool()
            graphs[key] = graph
    torch.cuda.synchronize()
    return graphs, outputs, pool


class VisionGraph:
    """``get_image_features`` of one image, captured as a CUDA graph over a persistent input buffer.

    Args:
        model: the transformers LLaVA model; device, dtype: the model's.

    Attributes:
        num_replays: images encoded by replay.

    Use :meth:`capture` (None where it does not apply or fails); :meth:`matches` says whether a call's
    pixels take the graph.
    """

    def __init__(self, model: Any, device: torch.device, dtype: torch.dtype) -> None:
        size = int(model.config.vision_config.image_size)
        self.model = model
        self.pixels = torch.zeros(1, 3, size, size, device=device, dtype=dtype)
        self.graph: Any = None
        self.features: torch.Tensor | None = None
        self.num_replays = 0

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
                graphs, outputs, _ = capture_each([0], lambda _: graph._features())
        except Exception:
            log.warning("capturing the vision tower failed; images are encoded eagerly", exc_info=True)
            return None
        graph.graph, graph.features = graphs[0], outputs[0]
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
        assert self.features is not None  # captured
        out = []
        for image in pixel_values.split(1):
            self.pixels.copy_(image)
            self.graph.replay()
            self.num_replays += 1
            out.append(self.features.clone())
        return out
