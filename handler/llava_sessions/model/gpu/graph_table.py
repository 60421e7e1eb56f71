"""One pass's CUDA graphs by bucket key (:class:`GraphTable`), and the capture loop every graph kind shares.

Each graph kind (the decode step, a prefill chunk, the vision tower, the tower per tile count) keeps only
how it fills its persistent inputs and what its pass runs; the table maps a bucket key to its captured
graph and the output tensor its replay overwrites, and owns the capture, the replay, the eager fallback
(a key with no graph, on a CPU every key, runs the same pass eagerly), the counters, the graphs' memory
pool and ``close``.

References: PyTorch, "CUDA Graphs" (``torch.cuda.graph``, ``CUDAGraph.replay``, the ``pool`` argument;
static inputs overwritten with ``copy_``); nano-vllm ``engine/model_runner.py`` (capture the largest
bucket first, every graph in one pool), read, not copied.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import warnings
from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import Any, Generic, TypeVar

import torch

__all__ = [
    "EMPTY_GRAPH_WARNING",
    "GraphTable",
    "capture_each",
    "capture_failed",
    "check_replay",
    "no_collection",
    "refuse_empty",
]

log = logging.getLogger(__name__)

K = TypeVar("K", bound=Hashable)


class GraphTable(Generic[K]):
    """The CUDA graphs of one pass, ``run(key)``, by bucket key (module docstring).

    Args:
        run: the pass of a bucket over the kind's persistent buffers: key -> output tensor (the logits
            or features of the bucket's padded shape).

    Attributes:
        num_replays: calls served by a replay; num_eager: calls that ran the pass eagerly (no graph for
            the key: on a CPU, or a bucket not captured).
        replay: False runs every call eagerly, captured or not (the check that a replay gives what the
            same pass gives eagerly: ``benchmarks/gpu.py``, the GPU suite).
        mempool: the graphs' memory pool handle once captured (another table may capture into it).
    """

    def __init__(self, run: Callable[[K], torch.Tensor]) -> None:
        self._run = run
        self._graphs: dict[K, Any] = {}
        self._out: dict[K, torch.Tensor] = {}
        self.num_replays = 0
        self.num_eager = 0
        self.replay = True
        self.mempool: Any = None

    @property
    def num_graphs(self) -> int:
        """Keys captured."""
        return len(self._graphs)

    def captured(self, key: K) -> bool:
        """Whether ``key``'s pass replays as a graph."""
        return key in self._graphs

    def capture(self, keys: Iterable[K], *, device: torch.device, pool: Any = None) -> None:
        """Capture every key's pass, in ``keys``' order (the largest first), in ``pool`` (a handle to
        share, or None for a new one): :func:`capture_each`.

        Raises:
            RuntimeError: not on a CUDA device; a capture recorded nothing or replays away from its
                eager pass. Exception: whatever a pass raised. Nothing is kept on a failure.
        """
        if device.type != "cuda":
            raise RuntimeError("CUDA graphs are captured on a CUDA device only")
        self._graphs, self._out, self.mempool = capture_each(keys, self._run, pool, device=device)

    def __call__(self, key: K) -> torch.Tensor:
        """``key``'s pass over the buffers as filled: replayed when captured (and :attr:`replay`), else
        run eagerly. Returns the output, the caller's own (a replay's is cloned out of the graph's)."""
        graph = self._graphs.get(key) if self.replay else None
        if graph is None:
            self.num_eager += 1
            return self._run(key)
        graph.replay()
        self.num_replays += 1
        return self._out[key].clone()

    def close(self) -> None:
        """Drop the graphs and their outputs (their memory pool goes once nothing holds it)."""
        self._graphs.clear()
        self._out.clear()
        self.mempool = None


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
