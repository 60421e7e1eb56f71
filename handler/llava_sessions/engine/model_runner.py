"""The model runner: execute the forward passes a step's plan names, on the sessions' tensors.

nano-vllm's ``model_runner.py``: no policy here (what runs and how many tokens is the
:class:`~.scheduler.StepPlan`'s), no bookkeeping beyond recording what a pass put in a session's KV
cache. Every forward pass of the engine goes through this class: the vision tower, a prefill chunk,
the decode batch's step; each is retried once after a CUDA out-of-memory error with the idle sessions
demoted (:func:`~.memory.oom_attempts`). Each pass is timed into :attr:`ModelRunner.costs`, the cost
model the scheduler sizes a step by (:mod:`.costs`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable, Iterator, Sequence as GenericSequence
from typing import TYPE_CHECKING, Any

import torch

from ..conversation import still_images
from ..model import EncodedVideo, KVPool, LlavaModel, SessionKV, cache_len
from ..model.gpu.graph_table import capture_failed
from ..model.gpu.graphs import DecodeGraphs, PagedRead
from ..model.gpu.prefill_graphs import PrefillGraphs
from ..model.gpu.tile_graphs import TileGraphs
from ..model.gpu.vision_graph import VisionGraph
from .costs import CostModel
from .memory import oom_attempts
from .paged_batch import PagedDecodeBatch
from .runners import Chunk, EagerRunner, StaticPrefillRunner, StaticRowsRunner, Step, StepRunner, StepRunners

if TYPE_CHECKING:
    from ..model.gpu.pixels import DevicePixels
    from ..sessions.session import Session
    from ..sessions.store import SessionStore
    from .sequence import Sequence

__all__ = [
    "KV_PAGE_SIZE",
    "MAX_GRAPH_ROWS",
    "ModelRunner",
    "new_graphs",
    "new_pool",
    "new_prefill_graphs",
]

log = logging.getLogger(__name__)

#: Token positions per page of a replica's KV pool (vLLM's default block size).
KV_PAGE_SIZE = 16

#: The largest decode batch captured as a CUDA graph (nano-vllm's default, 512, is for text-only
#: batches). A larger step (up to ``max_sessions``, 128 by default) runs eagerly, where launches
#: weigh less: 128 rows in the 4,096-position bucket would gather 8.6 GB of a 7B model's K and V per
#: layer into the graphs' memory pool, against 4.3 GB at 64.
MAX_GRAPH_ROWS = 64


class ModelRunner:
    """Runs the forward passes of a plan's chunks.

    Args:
        model: the loaded model (:class:`~llava_sessions.model.LlavaModel`).
        store: the session store (the decode batch's bytes, demotions after an out-of-memory error).
        cuda_graphs: decode steps and prefill chunks at static shapes (:class:`~llava_sessions.model.gpu.graphs.
            DecodeGraphs`): captured as CUDA graphs on a CUDA device, run eagerly elsewhere (tests); None:
            on a CUDA device; False: never (the ``enforce_eager`` setting). A failed capture logs a
            warning and the passes run eagerly at their own shapes.

    Every session's KV is in the replica's pool of pages, on every device. With static shapes (on a
    CUDA device by default) the pool is fixed: sized once at start to the store's device budget in
    pages, never grown nor shrunk (the ledger books the pages sessions hold, not the free ones; image
    features live beside the pool, within the budget's headroom). Otherwise (a CPU) it grows as
    sessions need pages.

    Attributes:
        pool: the replica's :class:`~llava_sessions.model.KVPool` (:func:`new_pool`).
        batch: the running answers' :class:`~.paged_batch.PagedDecodeBatch` over the pool's pages.
        graphs: the decode step at static shapes (:func:`new_graphs`; None: steps at their own shapes).
        prefill_graphs: a prefill chunk at static shapes (:func:`new_prefill_graphs`; None: at its own shape).
        passes: the :class:`~.runners.StepRunners` built from them, the one place a pass is chosen
            (:meth:`set_static` rebuilds it).
        vision_graph: the vision tower as CUDA graphs (llava-1.5's :class:`~llava_sessions.model.gpu.
            vision_graph.VisionGraph`, or per tile count :class:`~llava_sessions.model.gpu.tile_graphs.
            TileGraphs`; captured on a GPU with the decode graphs), handed to the model's image path.
        device_pixels: llava-1.5's preprocessing on the device (:mod:`llava_sessions.model.gpu.pixels`,
            the ``image_preprocessing: device`` setting), handed to the model's image path; None: the processor's.
        num_prefilled_tokens: tokens prefilled since start (a counter for metrics).
        num_fused_passes: decode steps that carried a prefill chunk (:meth:`decode_with_chunk`).
        costs: the measured cost of each kind of pass (:class:`~.costs.CostModel`).
    """

    def __init__(
        self,
        model: LlavaModel,
        store: SessionStore,
        *,
        cuda_graphs: bool | None = None,
    ) -> None:
        self.model = model
        self.store = store
        on_gpu = model.device.type == "cuda"
        graphs = on_gpu if cuda_graphs is None else cuda_graphs
        self.pool = new_pool(model, KV_PAGE_SIZE, store.device_budget_bytes if graphs else 0)
        #: On a GPU, the device memory each graph kind's capture took (bytes the allocator reserved), to
        #: hold against the budget's estimate (``sessions/budget.py``; ``benchmarks/gpu.py`` reports it).
        self.graph_bytes: dict[str, int] = {}
        with reserved_growth(self.graph_bytes, "decode", on_gpu):
            self.graphs = new_graphs(model, self.pool) if graphs else None
        with reserved_growth(self.graph_bytes, "prefill", on_gpu):
            self.prefill_graphs = new_prefill_graphs(model, self.pool, self.graphs)
        self.vision_graph: VisionGraph | TileGraphs | None = None
        if self.graphs is not None and on_gpu:  # the vision tower, replayed
            args = (model.model, model.architecture, model.device, model.dtype)
            with reserved_growth(self.graph_bytes, "vision", on_gpu):
                self.vision_graph = VisionGraph.capture(*args) or TileGraphs.capture(*args)
        self.device_pixels: DevicePixels | None = None
        self.passes = StepRunners(self._runners())
        self.batch = PagedDecodeBatch(model, store, self.pool, self.passes)
        self.num_prefilled_tokens = 0
        self.num_fused_passes = 0
        self.costs = CostModel()

    def _runners(self) -> list[StepRunner]:
        """The runners of :attr:`passes`, in the order they are tried: the static step, the static prefill
        (with graphs), the eager pass (always; on a CPU the rows read their runs of pages as views)."""
        token, found = self.model.image_token_id, list[StepRunner]()
        if self.graphs is not None:
            found.append(StaticRowsRunner(self.graphs, token))
            if self.prefill_graphs is not None:
                found.append(StaticPrefillRunner(self.graphs, self.prefill_graphs, token))
        read_runs = self.pool.pages.keys[0].device.type == "cpu" and self.model.ranks is None
        return [*found, EagerRunner(self.model, self.pool, read_runs=read_runs)]

    def set_static(self, graphs: DecodeGraphs | None, prefill_graphs: PrefillGraphs | None) -> None:
        """Run the static passes through ``graphs`` and ``prefill_graphs`` from now on (None: none of that
        kind; the eager pass instead), and rebuild :attr:`passes` (the one the decode batch holds)."""
        self.graphs, self.prefill_graphs = graphs, prefill_graphs
        self.passes.runners = self._runners()

    @property
    def static_steps(self) -> bool:
        """Whether decode steps run at static shapes (so a step may launch ahead: :mod:`.ahead`)."""
        return self.graphs is not None

    @property
    def replays_steps(self) -> bool:
        """Whether the static decode steps replay captured CUDA graphs (async scheduling's default)."""
        return self.graphs is not None and self.graphs.steps.num_graphs > 0

    def read_pages(self, paged_read: PagedRead) -> None:
        """The static decode step made anew, its attention reading the pages as ``paged_read`` (how the
        GPU suite and ``benchmarks/gpu.py`` compare the reads), and the prefill graphs beside it (on
        the new step's scratch page; the old one goes back to the pool). Nothing happens without one."""
        if self.graphs is None:
            return
        self.graphs.close()
        graphs = new_graphs(self.model, self.pool, paged_read)
        self.set_static(graphs, new_prefill_graphs(self.model, self.pool, graphs))

    def _ms_since(self, t0: float) -> float:
        """Wall ms since ``t0`` (perf_counter), the device's queued work included (a CUDA device is
        synchronized first, so the time is the pass's, not its launch's)."""
        device = getattr(self.model, "device", None)
        if device is not None and device.type == "cuda":
            torch.cuda.synchronize(device)
        return (time.perf_counter() - t0) * 1000.0

    def encode(self, session: Session, images: GenericSequence[Any]) -> torch.Tensor:
        """Run the vision tower on ``images``, the session's last ``len(images)`` (decoded), laid out
        as in the session's conversation now (:attr:`Session.image_tokens`).

        Returns:
            Their feature rows ``[sum of their image tokens, hidden]``, model dtype, on the device.

        Raises:
            ServiceError: image_invalid; overloaded (out of device memory twice).
            RuntimeError: the model gave another row count than the processor's (a bug).
        """
        first = len(session.images) - len(images)
        feats = self.encode_at(session, range(first, len(session.images)), images)
        return feats[0] if len(feats) == 1 else torch.cat(feats, dim=0)

    def encode_frames(self, session: Session, video: Any, start: int, stop: int) -> torch.Tensor:
        """Run the vision tower on frames ``start:stop`` of a sampled ``video`` of ``session``'s open or
        added video (:meth:`~llava_sessions.model.LlavaModel.encode_video_frames`), timed per frame.

        Returns:
            Their feature rows ``[(stop - start) x rows per frame, hidden]``, model dtype, on the device.

        Raises:
            ServiceError: overloaded (out of device memory twice).
        """
        t0 = time.perf_counter()
        for attempt in oom_attempts(self.store, keep=session):
            with attempt:
                rows = self.model.encode_video_frames(video, start, stop)
        self.costs.vision(stop - start, self._ms_since(t0))
        return rows

    def encode_at(
        self, session: Session, indexes: GenericSequence[int], images: GenericSequence[Any]
    ) -> list[torch.Tensor]:
        """Run the vision tower on ``images``, the session's images at ``indexes`` (decoded), laid out
        as in its conversation now.

        Returns:
            One ``[image_tokens[i], hidden]`` tensor per image, model dtype, on the device.

        Raises:
            ServiceError: image_invalid; overloaded (out of device memory twice).
            RuntimeError: the model gave another row count than the processor's (a bug).
        """
        num_images = still_images(session.image_sizes)
        t0 = time.perf_counter()
        for attempt in oom_attempts(self.store, keep=session):
            with attempt:
                feats = self.model.encode_images(images, num_images, pixels=self.device_pixels, tower=self.vision_graph)
        self.costs.vision(vision_units(images), self._ms_since(t0))
        expected = [session.image_tokens[i] for i in indexes]
        got = [int(f.shape[0]) for f in feats]
        if got != expected:
            raise RuntimeError(f"image features have {got} rows; the processor counts {expected}")
        return feats

    def prefill(
        self, session: Session, ids: list[int], num_tokens: int | None, timings: dict[str, float]
    ) -> tuple[torch.Tensor, int]:
        """Prefill the next ``num_tokens`` of ``ids`` beyond the session's cache (None: all of them,
        at least one) in one forward pass; the session records the ids its cache now holds.
        ``timings["prefill"]`` accumulates the pass's ms.

        Returns:
            ``(logits [vocab] float32 of the chunk's last position, tokens prefilled)``.

        Raises:
            ServiceError: overloaded (out of device memory twice). Exception: the forward pass failed.
        """
        t0 = time.perf_counter()
        start, end = self._chunk(session, ids, num_tokens)
        step = Step(chunks=(Chunk.of(session, ids[:end]),))
        runner = self.passes.choose(step)
        assert runner is not None  # the eager runner runs any one chunk
        for attempt in oom_attempts(self.store, keep=session):
            with attempt:
                _, (logits,) = runner.execute(step)
        if runner.eager:  # the cost model plans eager chunks; a static pass's ms are not its
            self.costs.prefill(end - start, self._ms_since(t0))
        self._record(session, ids[:end], start, t0, timings)
        return logits, end - start

    def prefill_together(
        self, parts: GenericSequence[tuple[Session, list[int], int | None, dict[str, float]]]
    ) -> list[torch.Tensor | None]:
        """Prefill each part's chunk (``(session, ids, num_tokens, timings)``: as :meth:`prefill`) as rows
        of shared static steps, as many chunks to a step as its largest bucket holds (:meth:`DecodeGraphs.
        run_with_chunks <llava_sessions.model.gpu.graphs.DecodeGraphs.run_with_chunks>`: one replay on a GPU
        for several sessions' questions, where each alone is a replay of its own). A part whose cache is
        not in the pool or whose chunk holds image placeholders is not run, nor is any without graphs.

        Returns:
            Per part, the logits ``[vocab]`` float32 of its chunk's last position (its session records
            the ids its cache now holds, its ``timings["prefill"]`` the shared pass's ms), or None: not
            run, or its shared pass failed (logged at DEBUG), its session untouched (the caller prefills
            it alone, and learns its own error).
        """
        out: list[torch.Tensor | None] = [None] * len(parts)
        if self.graphs is None:
            return out
        groups: list[list[tuple[int, Chunk]]] = [[]]
        for index, (session, ids, num_tokens, _) in enumerate(parts):
            start, end = self._chunk(session, ids, num_tokens)
            if session.kv_cache is None or self.model.image_token_id in ids[start:end]:
                continue
            if sum(len(c.new) for _, c in groups[-1]) + end - start > self.graphs.rows[-1]:
                groups.append([])
            groups[-1].append((index, Chunk(session.kv_cache, ids[:end], start)))
        for group in (g for g in groups if len(g) > 1):  # a chunk alone: the caller's own path
            t0 = time.perf_counter()
            step = Step(chunks=[c for _, c in group])
            runner = self.passes.choose(step)
            if runner is None:
                continue
            try:
                _, lasts = runner.execute(step)
            except Exception:  # noqa: BLE001 - each chunk alone tells whose failure it is
                log.debug("a shared prefill pass failed; its chunks run alone", exc_info=True)
                continue
            for (i, chunk), last in zip(group, lasts, strict=True):
                self._record(parts[i][0], chunk.ids, chunk.start, t0, parts[i][3])
                out[i] = last
        return out

    def decode(self, seqs: list[Sequence], *, rebuild: bool) -> torch.Tensor:
        """One decode step of ``seqs`` in one forward pass (:meth:`PagedDecodeBatch.forward <.paged_batch.PagedDecodeBatch.forward>`).

        Returns:
            Logits ``[B, vocab]`` float32, indexed by each generation's ``row``.
        """
        t0 = time.perf_counter()
        logits = self.batch.forward(seqs, rebuild=rebuild)
        self.costs.decode(self._ms_since(t0))
        return logits

    def decode_with_chunk(
        self,
        seqs: list[Sequence],
        *,
        rebuild: bool,
        session: Session,
        ids: list[int],
        num_tokens: int | None,
        timings: dict[str, float],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step of ``seqs`` and the prefill of the next ``num_tokens`` of ``ids`` beyond
        ``session``'s cache (as :meth:`prefill`) in ONE forward pass
        (:meth:`PagedDecodeBatch.forward_with_chunk <.paged_batch.PagedDecodeBatch.forward_with_chunk>`); the
        session records the ids its cache now holds.

        Returns:
            ``(logits [B, vocab] by row, logits [vocab] of the chunk's last position)``, float32.

        Raises:
            ServiceError: overloaded. Exception: the pass failed (the batch's next column and the
            session's cache are as before it; the rows the step gave joining answers stay).
        """
        t0 = time.perf_counter()
        start, end = self._chunk(session, ids, num_tokens)
        rows, last = self.batch.forward_with_chunk(seqs, rebuild=rebuild, session=session, ids=ids[:end])
        self.num_fused_passes += 1
        self.costs.fused(end - start, self._record(session, ids[:end], start, t0, timings))
        return rows, last

    @staticmethod
    def _chunk(session: Session, ids: list[int], num_tokens: int | None) -> tuple[int, int]:
        """``(start, end)`` of the chunk that prefills the next ``num_tokens`` of ``ids`` beyond the
        session's cache (None: all of them; at least one)."""
        start = cache_len(session.kv_cache)
        return start, len(ids) if num_tokens is None else min(len(ids), start + max(1, num_tokens))

    def _record(self, session: Session, ids: list[int], start: int, t0: float, timings: dict[str, float]) -> float:
        """After a pass that prefilled ``ids[start:]``: the session records the ids its cache holds,
        the counters and ``timings["prefill"]`` the pass; returns its ms."""
        session.record_prefill(ids)
        self.num_prefilled_tokens += len(ids) - start
        ms = self._ms_since(t0)
        timings["prefill"] = round(timings.get("prefill", 0.0) + ms, 3)
        return ms

    @property
    def page_size(self) -> int:
        """Positions per page of the KV pool."""
        return self.pool.page_size

    def new_cache(self) -> SessionKV:
        """An empty cache for a session: a :class:`~llava_sessions.model.SessionKV` in the pool."""
        return self.pool.new_cache()

    def check_pool(self, caches: Iterable[Any]) -> None:
        """Assert that ``caches`` (every session's) are all the pool's holders: its reference counts
        are their page tables' (:meth:`KVPool.check <llava_sessions.model.KVPool.check>`)."""
        tables = [c.table for c in caches if c is not None]
        self.pool.check(tables + ([self.graphs.table] if self.graphs is not None else []))


@contextlib.contextmanager
def reserved_growth(into: dict[str, int], key: str, on_gpu: bool) -> Iterator[None]:
    """Record in ``into[key]`` how many bytes the CUDA allocator reserved during the block (a capture's
    memory pool and what it keeps); nothing on a CPU."""
    if not on_gpu:
        yield
        return
    before = torch.cuda.memory_reserved()
    yield
    into[key] = torch.cuda.memory_reserved() - before


def new_pool(model: LlavaModel, page_size: int, fixed_bytes: int = 0) -> KVPool:
    """The KV pool of a replica running ``model``, pages of ``page_size`` positions. ``fixed_bytes`` > 0:
    the pool is fixed at that many bytes of pages (and one more, the static decode step's scratch
    page); 0: it grows."""
    text = model.config.text_config
    shape = (text.num_hidden_layers, model.num_kv_heads, model.head_dim, model.dtype, model.device)
    mirror = getattr(model, "ranks", None)  # a tensor-parallel replica's other ranks hold their heads' pages
    if not fixed_bytes:
        return KVPool(*shape, page_size=page_size, mirror=mirror)
    num_pages = max(1, fixed_bytes // (page_size * model.kv_bytes_per_token)) + 1
    return KVPool(*shape, page_size=page_size, num_pages=num_pages, fixed=True, mirror=mirror)


def new_graphs(model: LlavaModel, pool: KVPool, paged_read: PagedRead | None = None) -> DecodeGraphs | None:
    """The static decode step over ``pool`` (:class:`~llava_sessions.model.gpu.graphs.DecodeGraphs`, up to
    :data:`MAX_GRAPH_ROWS` rows over the model's context, attention reading the pages as ``paged_read``
    says: by default ``auto`` on a CUDA device, ``gather`` elsewhere, where FlexAttention runs unfused
    over the whole pool), its buckets captured as CUDA graphs on a CUDA device. None when the capture
    fails (logged; the decode steps then run eagerly at their own shapes, the path every test runs)."""
    if paged_read is None:
        paged_read = "auto" if model.device.type == "cuda" else "gather"
    graphs = DecodeGraphs(model, pool, max_rows=MAX_GRAPH_ROWS, max_len=model.max_positions, paged_read=paged_read)
    if model.device.type != "cuda":
        return graphs
    try:
        graphs.capture()
    except Exception as exc:  # noqa: BLE001 - any failure: the steps run eagerly at their own shapes
        capture_failed("the decode steps as CUDA graphs", "decode steps run eagerly", exc)
        graphs.close()
        return None
    return graphs


def new_prefill_graphs(model: LlavaModel, pool: KVPool | None, graphs: DecodeGraphs | None) -> PrefillGraphs | None:
    """Prefill chunks at static shapes over ``pool`` (:class:`~llava_sessions.model.gpu.prefill_graphs.
    PrefillGraphs`), beside the decode ``graphs`` (their scratch page; on a CUDA device captured into
    their memory pool). None without decode graphs, for a tensor-parallel replica (its ranks run each
    pass as rank 0 tells them, at its own shape), or when the capture fails (logged: chunks then run
    eagerly at their own shapes)."""
    if graphs is None or pool is None or getattr(model, "ranks", None) is not None:
        return None
    prefills = PrefillGraphs(model, pool, graphs.table.pages[0], max_len=model.max_positions)
    if model.device.type != "cuda" or not graphs.steps.num_graphs:
        return prefills
    try:
        prefills.capture(graphs.steps.mempool)
    except Exception as exc:  # noqa: BLE001 - any failure: chunks run eagerly at their own shapes
        capture_failed("the prefill chunks as CUDA graphs", "prefill chunks run eagerly", exc)
        return None
    return prefills


def vision_units(images: GenericSequence[Any]) -> int:
    """What a vision pass over ``images`` ran, in the cost model's unit (an image, or a video frame):
    each still image 1, each video its frames; a video encoded a few frames per step before
    (:class:`~llava_sessions.model.EncodedVideo`) 0, its frames timed then."""
    return sum(0 if isinstance(item, EncodedVideo) else int(getattr(item, "num_frames", None) or 1) for item in images)
