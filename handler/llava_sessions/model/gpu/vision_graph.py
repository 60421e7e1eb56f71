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

import contextlib
import gc
import logging
import warnings
from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import Any, TypeVar

import torch

__all__ = [
    "VisionGraph",
    "capture_each",
    "capture_failed",
    "check_replay",
    "image_features",
    "no_collection",
    "refuse_empty",
]

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
    capture ("operation not permitted when stream is capturing", seen on a GPU in the GPU suite);
    ``torch.cuda.graph`` collects first only under ``torch.compiler.config.force_cudagraph_gc``."""
    gc.collect()
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


#: What PyTorch warns when a capture recorded no work (``CUDAGraph::capture_end``): the passes ran on
#: another device's stream than the one captured, so every replay would return the capture-time output.
EMPTY_GRAPH_WARNING = "The CUDA Graph is empty"


def capture_each(
    keys: Iterable[K], run: Callable[[K], torch.Tensor], pool: Any = None, *, device: torch.device | None = None
) -> tuple[dict[K, Any], dict[K, torch.Tensor], Any]:
    """Capture ``run(key)`` as a CUDA graph for each of ``keys``, in their order, all in one memory pool
    (``pool``, a ``torch.cuda.graph`` pool handle to share, or None for a new one), on ``device`` (made
    the current device for the capture; None: the current one). Each pass runs once eagerly first (lazy
    initialisation and autotuning outside the capture), the garbage collector paused
    (:func:`no_collection`); after its capture each graph is replayed once and its output checked against
    that eager pass's (:func:`check_replay`). Graphs in one pool must never run at once.

    Returns:
        ``(graphs, outputs, pool)``: each key's ``torch.cuda.CUDAGraph`` and the output tensor its replay
        overwrites, and the pool's handle.

    Raises:
        RuntimeError: a capture recorded nothing (PyTorch's :data:`EMPTY_GRAPH_WARNING`, made an error), or
            a replay differs from its eager pass; the message names the key.
        Exception: whatever a pass or a capture raised. The caller drops that kind of graph and runs it
            eagerly.
    """
    graphs: dict[K, Any] = {}
    outputs: dict[K, torch.Tensor] = {}
    with no_collection(), torch.cuda.device(device):
        for key in keys:
            eager = run(key).clone()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with torch.cuda.graph(graph, pool=pool):
                    outputs[key] = run(key)
            refuse_empty([str(w.message) for w in caught], key)
            pool = graph.pool()
            graphs[key] = graph
            graph.replay()
            check_replay(key, eager, outputs[key])
            del eager
        torch.cuda.synchronize()
    return graphs, outputs, pool


def capture_failed(what: str, fallback: str, exc: BaseException) -> None:
    """Say once, in one WARNING line, that capturing ``what`` failed and ``fallback`` runs instead, with the
    error's type and first line (its traceback at DEBUG)."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    log.warning("capturing %s failed (%s: %s); %s", what, type(exc).__name__, first[:300], fallback)
    log.debug("capturing %s failed", what, exc_info=exc)


def refuse_empty(messages: Iterable[str], key: Hashable) -> None:
    """Raise when ``messages`` (the warnings a capture gave) hold PyTorch's :data:`EMPTY_GRAPH_WARNING`.

    Raises:
        RuntimeError: naming ``key``: the graph captured no work (its passes ran on another device's stream).
    """
    if any(EMPTY_GRAPH_WARNING in m for m in messages):
        raise RuntimeError(
            f"the CUDA graph of {key!r} captured no work: its passes ran on another device than the current one"
        )


def replay_tolerance(dtype: torch.dtype) -> float:
    """The largest difference, relative to the eager output's largest magnitude, that :func:`check_replay`
    accepts: a replay runs the eager pass's kernels on the same inputs, so only a kernel's own
    nondeterminism (split reductions, atomics) can move it; 1e-2 in a 16-bit dtype, 1e-4 in float32."""
    return 1e-4 if dtype == torch.float32 else 1e-2


def check_replay(key: Hashable, eager: torch.Tensor, replayed: torch.Tensor) -> None:
    """Check a replayed graph's output against the same pass run eagerly on the same inputs.

    Args:
        key: the graph's key (named in the error).
        eager, replayed: the two outputs, of one shape.

    Raises:
        RuntimeError: the shapes differ, the two are not NaN at the same places, or the largest
            difference is over :func:`replay_tolerance` of the eager output's largest magnitude (at least 1).
    """
    if eager.shape != replayed.shape:
        raise RuntimeError(f"the CUDA graph of {key!r} gave shape {tuple(replayed.shape)}, eager {tuple(eager.shape)}")
    if not eager.numel():
        return
    a, b = eager.float(), replayed.float()
    if not torch.equal(a.isnan(), b.isnan()):
        raise RuntimeError(f"the CUDA graph of {key!r} replays NaN where its eager pass has none (or the reverse)")
    a, b = a.nan_to_num(0.0), b.nan_to_num(0.0)
    scale, gap = float(a.abs().max()), float((a - b).abs().max())
    if not gap <= replay_tolerance(eager.dtype) * max(scale, 1.0):
        raise RuntimeError(f"the CUDA graph of {key!r} replays {gap:.3g} away from its eager pass (scale {scale:.3g})")


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
                graphs, outputs, _ = capture_each([0], lambda _: graph._features(), device=device)
        except Exception as exc:  # noqa: BLE001 - any failure: the tower runs eagerly, as before
            capture_failed("the vision tower", "images are encoded eagerly", exc)
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
