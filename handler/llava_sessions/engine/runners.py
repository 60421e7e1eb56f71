"""The ways a step's forward pass can run, and the one place that chooses among them.

A step (:class:`Step`) is the decode batch's rows, each reserved for its new position in its page table
and fed a token, and the prefill chunks that go with it (none: a decode step; no rows: a prefill).
Each runner answers :meth:`~StepRunner.can_run` and :meth:`~StepRunner.execute`:

- :class:`StaticRowsRunner`: the static decode step (:class:`~llava_sessions.model.gpu.graphs.DecodeGraphs`:
  a CUDA graph replayed on a GPU, the same pass eagerly elsewhere), the chunks' text tokens as more rows
  of it (several sessions' questions in one pass). The only runner that takes a step whose tokens are
  still on the device (async scheduling, :mod:`.ahead`).
- :class:`StaticPrefillRunner`: one chunk with image placeholders, or too long for the step's rows, at
  static shapes (:class:`~llava_sessions.model.gpu.prefill_graphs.PrefillGraphs`), after the rows'
  static step (two replays).
- :class:`EagerRunner`: any step of at most one chunk at its own shape (a chunk beside decode rows in
  one fused pass, :mod:`llava_sessions.model.fused`); on a CPU the rows read their runs of pages as
  views (:mod:`llava_sessions.model.kv.runs`). The last resort.

:class:`StepRunners` tries them in that order; the :class:`~.model_runner.ModelRunner` builds it from
the graphs it holds (none on a CPU by default: the eager runner alone) and is the only caller. SGLang's
``ModelRunner._forward_raw`` (its decode graph runner, prefill graph runner and eager pass behind one
interface) and nano-vllm's ``run_model`` (one ``if`` between graph and eager) are the anchors, read, not
copied.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from ..model import SlotsCache, cache_len
from ..model.fused import attention_on
from ..model.kv.runs import PAGED_RUNS_ATTENTION, reading_runs

if TYPE_CHECKING:
    from ..model import KVPool, LlavaModel, SessionKV
    from ..model.gpu.graphs import DecodeGraphs
    from ..model.gpu.prefill_graphs import PrefillGraphs
    from ..model.kv.pages import PageTable
    from ..sessions.session import Session

__all__ = [
    "Chunk",
    "EagerRunner",
    "StaticPrefillRunner",
    "StaticRowsRunner",
    "Step",
    "StepOut",
    "StepRunner",
    "StepRunners",
]

#: What a step's pass gives: the rows' logits ``[len(rows), vocab]`` float32 in the rows' order (None
#: without rows), and each chunk's last position's logits ``[vocab]`` float32.
StepOut = tuple["torch.Tensor | None", list[torch.Tensor]]


@dataclasses.dataclass(frozen=True)
class Chunk:
    """A prefill chunk: ``ids`` (the sequence's full ids up to the chunk's end) beyond ``start``
    positions its ``cache`` holds; ``image_features``: the session's image rows ``[rows, hidden]`` in
    conversation order (None: no images)."""

    cache: SessionKV
    ids: list[int]
    start: int
    image_features: torch.Tensor | None = None

    @classmethod
    def of(cls, session: Session, ids: list[int]) -> Chunk:
        """``session``'s chunk of ``ids`` (its full ids up to the chunk's end) beyond what its cache holds.

        Raises:
            TypeError: the session holds no KV in the pool (a prefill starts its cache first: ``inputs.py``).
        """
        if session.kv_cache is None:
            raise TypeError("a prefill chunk needs its session's KV in the pool, and it holds none")
        return cls(session.kv_cache, ids, cache_len(session.kv_cache), session.image_features)

    @property
    def new(self) -> list[int]:
        """The chunk's own token ids."""
        return self.ids[self.start :]

    def first_row(self, image_token_id: int) -> int:
        """The image feature row its first placeholder takes (placeholders before the chunk)."""
        return self.ids[: self.start].count(image_token_id)


@dataclasses.dataclass(frozen=True)
class Step:
    """One forward pass's work (module docstring).

    Attributes:
        rows: the decode rows' page tables, each reserved for its new position by the time the step
            executes; tokens: their fed tokens (a list, or a ``[len(rows)]`` long tensor on the device:
            chosen by the last step, not read by the host yet); chunks: the prefill chunks;
        longest: the positions the longest row attends, its new one included (0 without rows).
    """

    rows: Sequence[PageTable] = ()
    tokens: Sequence[int] | torch.Tensor = ()
    chunks: Sequence[Chunk] = ()
    longest: int = 0

    @classmethod
    def of(cls, rows: Sequence[PageTable], tokens: Sequence[int] | torch.Tensor, chunks: Sequence[Chunk] = ()) -> Step:
        """A step over reserved ``rows`` (their lengths are the attended ones)."""
        return cls(rows, tokens, chunks, max((t.num_tokens for t in rows), default=0))

    @property
    def on_device(self) -> bool:
        """Whether the rows' tokens are on the device (async scheduling)."""
        return isinstance(self.tokens, torch.Tensor)


class StepRunner(Protocol):
    """A way to run a step's pass."""

    #: True for the runner of passes at their own shape (the cost model times only those).
    eager: bool

    def can_run(self, step: Step) -> bool:
        """Whether :meth:`execute` runs ``step`` (decided before anything is written)."""
        ...

    def execute(self, step: Step) -> StepOut:
        """Run ``step``'s pass: each chunk's table extended by its tokens, each row's new position written.

        Raises:
            Exception: the pass failed (the chunks' tables as before; the rows' positions are the caller's).
        """
        ...


class StaticRowsRunner:
    """The static decode step, text chunks as more rows of it (module docstring)."""

    eager = False

    def __init__(self, graphs: DecodeGraphs, image_token_id: int) -> None:
        self.graphs, self.image_token_id = graphs, image_token_id

    def can_run(self, step: Step) -> bool:
        """A bucket holds every row (the chunks' tokens too), and every chunk is text, not empty."""
        news = [c.new for c in step.chunks]
        if any(not n or self.image_token_id in n for n in news) or (step.on_device and news):
            return False
        ends = [c.start + len(n) for c, n in zip(step.chunks, news, strict=True)]
        num_rows = len(step.rows) + sum(map(len, news))
        return num_rows > 0 and self.graphs.bucket(num_rows, max([step.longest, *ends])) is not None

    def execute(self, step: Step) -> StepOut:
        """Raises: as :meth:`StepRunner.execute`; torch.OutOfMemoryError: a fixed pool is full."""
        if not step.chunks:
            logits = self.graphs.run(step.rows, step.tokens)
            assert logits is not None  # can_run: a bucket holds it
            return logits, []
        assert not step.on_device  # can_run
        tokens = list(step.tokens)
        done = self.graphs.run_with_chunks(step.rows, tokens, [(c.cache.table, c.new) for c in step.chunks])
        assert done is not None  # can_run: a bucket holds it
        return (done[0] if step.rows else None), done[1]


class StaticPrefillRunner:
    """One chunk at static shapes after the rows' static step (module docstring)."""

    eager = False

    def __init__(self, graphs: DecodeGraphs, prefills: PrefillGraphs, image_token_id: int) -> None:
        self.graphs, self.prefills, self.image_token_id = graphs, prefills, image_token_id

    def can_run(self, step: Step) -> bool:
        """One chunk, which a prefill bucket holds, and no rows or rows a decode bucket holds."""
        if len(step.chunks) != 1 or step.on_device:
            return False
        chunk = step.chunks[0]
        if not chunk.new or self.prefills.bucket(len(chunk.new), len(chunk.ids)) is None:
            return False
        return not step.rows or self.graphs.bucket(len(step.rows), step.longest) is not None

    def execute(self, step: Step) -> StepOut:
        """Raises: as :meth:`StepRunner.execute`; torch.OutOfMemoryError: a fixed pool is full."""
        rows = self.graphs.run(step.rows, step.tokens) if step.rows else None
        chunk = step.chunks[0]
        first_row = chunk.first_row(self.image_token_id)
        last = self.prefills.prefill(chunk.cache.table, chunk.new, first_row, chunk.image_features)
        assert last is not None  # can_run: a bucket holds it
        return rows, [last]


class EagerRunner:
    """Every step of at most one chunk, at its own shape (module docstring).

    Args:
        model: the loaded model; pool: the replica's KV pool;
        read_runs: the rows read their runs of pages as views (a CPU's one-process replica), else
            gathered (a GPU; a tensor-parallel replica, whose other ranks run the pass as sent, with SDPA).
    """

    eager = True

    def __init__(self, model: LlavaModel, pool: KVPool, *, read_runs: bool) -> None:
        self.model, self.pool, self.read_runs = model, pool, read_runs

    def can_run(self, step: Step) -> bool:
        """At most one chunk, something to run, the tokens on the host."""
        return len(step.chunks) <= 1 and bool(step.rows or step.chunks) and not step.on_device

    def execute(self, step: Step) -> StepOut:
        """Raises: as :meth:`StepRunner.execute`."""
        tokens = list(step.tokens)
        if not step.chunks:
            rows = SlotsCache.of_rows(self.pool.pages, step.rows, runs=self.read_runs)
            if rows.runs is None:
                return self.model.decode_batch(rows, tokens, rows.positions, rows.attention_mask), []
            with reading_runs(rows.runs), attention_on(self.model.config.text_config, PAGED_RUNS_ATTENTION):
                return self.model.decode_batch(rows, tokens, rows.positions, rows.attention_mask), []
        chunk = step.chunks[0]
        if not step.rows:
            return None, [self.model.prefill(chunk.cache, chunk.ids, chunk.image_features)]
        rows = SlotsCache.of_rows(self.pool.pages, step.rows, runs=self.read_runs)
        positions = [t.num_tokens - 1 for t in step.rows]
        logits, last = self.model.fused_step(
            rows, tokens, positions, rows.attention_mask, chunk.cache, chunk.ids, chunk.image_features
        )
        return logits, [last]


class StepRunners:
    """The runners a replica has, in the order they are tried (static first, eager last)."""

    def __init__(self, runners: Sequence[StepRunner]) -> None:
        self.runners = list(runners)

    def choose(self, step: Step) -> StepRunner | None:
        """The first runner that can run ``step``; None when none can (several chunks without a static
        step, or tokens on the device without one)."""
        return next((r for r in self.runners if r.can_run(step)), None)

    def can_run(self, step: Step) -> bool:
        """Whether some runner runs ``step``."""
        return self.choose(step) is not None

    def execute(self, step: Step) -> StepOut:
        """Run ``step`` through :meth:`choose`'s runner.

        Raises:
            ValueError: no runner can run it. Exception: as :meth:`StepRunner.execute`.
        """
        runner = self.choose(step)
        if runner is None:
            raise ValueError(f"no runner runs a step of {len(step.rows)} rows and {len(step.chunks)} chunks")
        return runner.execute(step)
