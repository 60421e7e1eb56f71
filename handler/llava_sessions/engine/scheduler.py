"""The scheduler: decide what one engine step runs. Plain data in, a plain-data :class:`StepPlan` out.

vLLM's token-budget idea (``max_num_batched_tokens``; vLLM v1 ``Scheduler.schedule`` returns a
``SchedulerOutput``), nano-vllm's cut (``engine/scheduler.py`` decides, the model runner executes).
No torch, no tensors, no sessions: the rules are unit-tested without a model (tests/core/test_scheduler.py).

The rules, in order:

1. **Decode rows first.** Every answer whose prompt is prefilled decodes one token, all of them in
   one batched forward pass; each row costs one token of the step's budget.
2. **The prefill share.** What is left of the budget, but at least :data:`MIN_PREFILL_TOKENS`, so
   new work always moves while many answers decode.
3. **Questions before images.** Prefill work runs questions (a new answer's prompt, a demoted
   session's restore) before image work (an open, an added image), each kind in arrival order:
   a follow-up is a few tokens and a user waits for its first token.
4. **The vision tower takes its step's share.** A request whose next chunk is the vision tower
   (an open or added image not yet encoded; a question on a session demoted to the ``image`` tier)
   runs it and nothing after it, and the step's prefill share is spent.
5. **Chunks.** Otherwise a chunk prefills ``min(tokens left, share left)`` tokens, at least one.
   The step stops planning prefill when its share is spent.
6. **Decode batch rebuilds.** The batch's rows are laid out anew when it has none, when an answer
   joins, or when fewer than half its rows are still live (compaction). The rows' KV is their
   sessions' pages, so a rebuild moves no KV: it only gives the joining answers rows.

With no budget (``None``) every request runs whole: vision tower, then its whole prefill.

**A time budget** (:class:`TimeBudget`, the default; Sarathi-Serve's latency-sized token budget) replaces
rules 2, 4 and 5 with these, given the measured :class:`~.costs.StepCost` of each kind of pass:

7. **Nothing decoding: a lone prefill runs whole.** The first chunk runs its vision tower and all its
   tokens (up to ``max_pass_tokens``, the memory cap of one pass) in this step: a cold turn costs one
   full forward, not one per chunk.
8. **Answers decoding: the step stays within ``step_ms``.** The decode step's measured cost comes off
   the step's time; each chunk then takes its vision tower's cost and the tokens that fit in what is
   left (``fixed + n * per_token``). The first chunk always moves (its vision tower, or at least
   :data:`MIN_PREFILL_TOKENS` tokens); a later chunk runs only when the vision tower it needs and
   :data:`MIN_PREFILL_TOKENS` tokens fit in the time left, or its vision tower alone when only that
   fits (the step's leftover time encodes the next image, whose first chunk then rides the next
   decode pass whole instead of sharing it with the tower). Rules 1, 3 and 6 hold as before.
   **Image work is held to the decode step alone.** An open or an added image (no first token waits
   on it) plans only within ``image_step_ratio`` times a decode step with no chunk riding it
   (:attr:`~.costs.StepCost.decode_alone_ms`), or ``step_ms`` if less: while sessions open, the
   running answers' inter-token gap grows at most that many times (2: it at most doubles). The
   first chunk still always moves.

Under either budget:

9. **The first chunk rides the decode step.** While answers decode, the first prefill chunk
   runs in the decode step's forward pass (Sarathi-Serve's stall-free batching: the pass's fixed
   cost is paid once), so under a time budget it costs its tokens only (``n * per_token``); the
   step's other chunks are passes of their own.

And always:

10. **Memory comes with the plan** (nano-vllm's ``BlockManager.allocate`` inside ``schedule``, vLLM v1's
    ``KVCacheManager.allocate_slots``). A chunk that starts its work carries the device bytes that
    start needs (:attr:`PrefillChunk.grant_bytes`: :attr:`RequestView.start_bytes`), and every decode
    step carries the pages its rows open (:attr:`StepPlan.batch_bytes`: ``rows whose next position
    starts a page x page_size x kv_bytes_per_token``). The engine makes room for exactly these before
    it runs them; nothing else gets device memory (admission only checks that room can be made).
11. **Preemption: the newest answers leave when the batch cannot grow** (vLLM's rule; the plan's
    :class:`Room`). Given the device bytes the ledger can still make room for (``room_bytes``: the
    budget less what busy sessions hold), a step whose pages do not fit drops its newest answers,
    one at a time, until the rest fits; the oldest always stays. A leaving answer's pages
    (:attr:`RequestView.num_held_kv_tokens`) come back to the room. When even the oldest answer alone
    does not fit, the decode rows fail ``overloaded`` (``refused``). A preempted answer waits, then
    recomputes its KV and decodes on, with the same tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from .costs import StepCost

__all__ = [
    "MIN_PREFILL_TOKENS",
    "BatchLayout",
    "PrefillChunk",
    "Room",
    "StepPlan",
    "TimeBudget",
    "RequestView",
    "make_room",
    "needs_rebuild",
    "schedule",
]

#: Prefill tokens a step runs at least, whatever the decode rows took of its budget.
MIN_PREFILL_TOKENS = 16

#: ``question``: an answer's prefill (restore + prompt); ``image``: an open or an added image.
RequestKind = Literal["question", "image"]


@dataclass(frozen=True)
class RequestView:
    """What the scheduler sees of one request in flight.

    Attributes:
        kind: ``question`` or ``image`` (rule 3).
        decoding: its prompt is prefilled: it is a decode row (rule 1).
        has_row: it already holds a row of the decode batch (a decoding answer without one joins).
        needs_vision: its next chunk runs the vision tower (rule 4).
        num_prefill_tokens: tokens it has left to prefill (after the vision chunk, if any).
        start_bytes: device bytes its first chunk needs room for (0 once started; rule 10).
        num_kv_tokens: a decoding answer's tokens in its KV cache.
        num_held_kv_tokens: token positions of device memory its session's KV holds (the ledger's
            count: its pages x page size; rule 11).
        created: when the request arrived (``time.perf_counter()``): the newest leave first (rule 11).
    """

    kind: RequestKind
    decoding: bool = False
    has_row: bool = False
    needs_vision: bool = False
    num_prefill_tokens: int = 0
    start_bytes: int = 0
    num_kv_tokens: int = 0
    num_held_kv_tokens: int = 0
    created: float = 0.0


@dataclass(frozen=True)
class BatchLayout:
    """The decode batch's shape (:class:`~.paged_batch.PagedDecodeBatch`): ``num_rows`` rows
    (``num_live`` of them running answers; 0: no batch yet), over the sessions' pages of
    ``page_size`` positions, each position ``kv_bytes_per_token`` bytes (rule 10)."""

    num_rows: int = 0
    num_live: int = 0
    kv_bytes_per_token: int = 0
    page_size: int = 16


@dataclass(frozen=True)
class TimeBudget:
    """A step budget in time (rules 7-8): ``step_ms``, the most ms a step's passes take while answers
    decode (their inter-token gap); ``max_pass_tokens``, the most tokens one prefill pass runs;
    ``image_step_ratio``, the most a step that plans image work takes while answers decode, in
    decode steps alone (None: ``step_ms`` alone)."""

    step_ms: float
    max_pass_tokens: int
    image_step_ratio: float | None = 2.0


@dataclass(frozen=True)
class PrefillChunk:
    """Run work ``index``'s vision tower when ``vision``, then prefill ``num_tokens`` of its tokens
    (0: none this step; None: all that are left), once room is made for ``grant_bytes`` device bytes
    (its work's start; rule 10). ``vision_ms``: the ms its vision tower may take this step, while
    answers decode under a time budget (a video's frames then go through it a few per step; None:
    no bound); left out of a chunk's equality (a plan's shape is its work, tokens and bytes)."""

    index: int
    vision: bool
    num_tokens: int | None
    grant_bytes: int = 0
    vision_ms: float | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Room:
    """How the decode step gets its bytes (rule 11): ``preempt``, the indexes of the answers that
    leave it first (newest first; their KV is dropped, they resume later); ``refused``, no room can be
    made: the decode rows fail ``overloaded``."""

    preempt: tuple[int, ...] = ()
    refused: bool = False


@dataclass(frozen=True)
class StepPlan:
    """One step: ``decode`` (indexes of the answers that decode one token together, the preempted
    ones included), ``rebuild`` (lay the decode batch out anew first), ``prefill`` (chunks, in the
    order they run), ``fuse`` (rule 9: the first chunk runs in the decode step's forward
    pass), ``batch_bytes`` (the device bytes of the pages its rows open, once ``room``'s preemptions
    are made; room made for them first: rules 10 and 11)."""

    decode: tuple[int, ...] = ()
    rebuild: bool = False
    prefill: tuple[PrefillChunk, ...] = ()
    fuse: bool = False
    batch_bytes: int = 0
    room: Room = Room()

    @property
    def empty(self) -> bool:
        """True when the step runs nothing."""
        return not self.decode and not self.prefill


def needs_rebuild(batch: BatchLayout, joining: bool) -> bool:
    """Rule 6: whether the decode batch's rows are laid out anew before the step (``joining``: an
    answer without a row decodes this step)."""
    return batch.num_rows == 0 or joining or batch.num_live * 2 < batch.num_rows


def schedule(
    work: Sequence[RequestView],
    token_budget: int | TimeBudget | None,
    batch: BatchLayout = BatchLayout(),
    cost: StepCost | None = None,
    *,
    fuse: bool = True,
    room_bytes: int | Callable[[], int] | None = None,
) -> StepPlan:
    """Plan one step over ``work`` (in arrival order) within ``token_budget``: a number of tokens
    (rules 1-6), a :class:`TimeBudget` with the passes' measured ``cost`` (rules 1, 3, 6, 7, 8; None:
    :class:`~.costs.StepCost`'s defaults), or None (no limit); ``fuse``: rule 9 holds (False: every
    prefill chunk is a pass of its own); ``room_bytes``: the device bytes room can be made for, or
    what reads them (called only when the decode step opens pages: the engine's ledger reads every
    session), for rule 11's preemptions (None: as many as the step needs).

    Returns:
        The :class:`StepPlan`.
    """
    decode = tuple(i for i, w in enumerate(work) if w.decoding)
    rebuild = bool(decode) and needs_rebuild(batch, any(not work[i].has_row for i in decode))
    order = [i for kind in ("question", "image") for i, w in enumerate(work) if w.kind == kind and not w.decoding]
    if isinstance(token_budget, TimeBudget):
        chunks = _timed(work, order, token_budget, cost or StepCost(), bool(decode), fuse and bool(decode))
    else:
        chunks = _counted(work, order, token_budget, len(decode))
    fused = fuse and bool(decode) and bool(chunks) and chunks[0].num_tokens != 0
    chunks = tuple(
        PrefillChunk(p.index, p.vision, p.num_tokens, work[p.index].start_bytes, p.vision_ms) for p in chunks
    )
    room, batch_bytes = make_room(work, decode, batch, room_bytes)
    return StepPlan(decode, rebuild, chunks, fused, batch_bytes, room)


def make_room(
    work: Sequence[RequestView],
    decode: Sequence[int],
    batch: BatchLayout,
    room_bytes: int | Callable[[], int] | None,
) -> tuple[Room, int]:
    """Rules 10 and 11: how the decode step of ``decode`` (indexes into ``work``) gets its device bytes
    when room can be made for ``room_bytes``, or what reads them (called only when the step opens
    pages); None: any number.

    Returns:
        The :class:`Room` (the preemptions, or refused) and the step's bytes once it is made (0 when
        refused).
    """
    need = _batch_bytes(work, decode, batch, ())
    if callable(room_bytes):
        room_bytes = room_bytes() if need > 0 else None
    if room_bytes is None or need <= max(room_bytes, 0):
        return Room(), need
    newest_first = sorted(decode, key=lambda i: (work[i].created, i), reverse=True)
    for k in range(len(newest_first)):  # the newest k leave; the oldest always stays
        leaving = newest_first[:k]
        need = _batch_bytes(work, decode, batch, leaving)
        freed = sum(work[i].num_held_kv_tokens for i in leaving) * batch.kv_bytes_per_token
        if need - freed <= max(room_bytes, 0):
            return Room(tuple(sorted(leaving))), need
    return Room(refused=True), 0


def _batch_bytes(work: Sequence[RequestView], decode: Sequence[int], batch: BatchLayout, leaving: Sequence[int]) -> int:
    """Rule 10: the device bytes of the pages the decode step of ``decode`` but ``leaving`` opens (a
    row whose next position is a page's first)."""
    opened = sum(1 for i in decode if i not in leaving and work[i].num_kv_tokens % batch.page_size == 0)
    return opened * batch.page_size * batch.kv_bytes_per_token


def _counted(
    work: Sequence[RequestView], order: list[int], token_budget: int | None, num_decode: int
) -> tuple[PrefillChunk, ...]:
    """Rules 2, 4 and 5: the prefill chunks of a step under a token budget (None: every chunk whole)."""
    share = None if token_budget is None else max(token_budget - num_decode, MIN_PREFILL_TOKENS)
    chunks: list[PrefillChunk] = []
    for i in order:
        if share is not None and share <= 0:
            break
        w = work[i]
        if w.needs_vision:
            chunks.append(PrefillChunk(i, True, None if share is None else 0))
            share = None if share is None else 0
            continue
        num = w.num_prefill_tokens if share is None else min(w.num_prefill_tokens, max(1, share))
        chunks.append(PrefillChunk(i, False, num))
        if share is not None:
            share -= num
    return tuple(chunks)


def _timed(
    work: Sequence[RequestView], order: list[int], budget: TimeBudget, cost: StepCost, decoding: bool, fused: bool
) -> tuple[PrefillChunk, ...]:
    """Rules 7-9: the prefill chunks of a step under a time budget (``fused``: the first chunk
    rides the decode step's pass and costs its tokens only)."""
    spent = cost.decode_ms if decoding else 0.0  # ms planned so far
    ratio = budget.image_step_ratio
    image_ms = budget.step_ms if not decoding or ratio is None else min(budget.step_ms, ratio * cost.decode_alone_ms)
    chunks: list[PrefillChunk] = []
    for i in order:
        w = work[i]
        ms_left = (image_ms if w.kind == "image" else budget.step_ms) - spent
        rides = fused and not chunks  # the first chunk, in the decode step's pass
        vision_ms = cost.vision_ms if w.needs_vision else 0.0
        least = min(w.num_prefill_tokens, MIN_PREFILL_TOKENS)
        if chunks and ms_left < vision_ms + cost.prefill_ms(least):
            if w.needs_vision and decoding and ms_left >= vision_ms:  # its vision tower alone fits
                chunks.append(PrefillChunk(i, True, 0, vision_ms=ms_left))
            break
        ms_left -= vision_ms
        if not chunks and not decoding:
            num = min(w.num_prefill_tokens, budget.max_pass_tokens)
        else:
            num = min(w.num_prefill_tokens, budget.max_pass_tokens, cost.tokens_within(ms_left, fused=rides))
            if not chunks and not w.needs_vision:
                num = max(num, least)
        allotted = max(ms_left + vision_ms, 0.0) if decoding and w.needs_vision else None
        chunks.append(PrefillChunk(i, w.needs_vision, num, vision_ms=allotted))
        spent += vision_ms + (cost.prefill_ms(num, fused=rides) if num else 0.0)
    return tuple(chunks)
