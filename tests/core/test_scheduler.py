"""The scheduler's rules, without a model: plain data in, a plain-data StepPlan out (milliseconds);
the cost model it is sized by, on numbers."""

from __future__ import annotations

import pytest

from llava_sessions.engine.costs import CostModel, StepCost
from llava_sessions.engine.scheduler import (
    MIN_PREFILL_TOKENS,
    BatchLayout,
    PrefillChunk,
    RequestView,
    Room,
    StepPlan,
    TimeBudget,
    needs_rebuild,
    schedule,
)

ROWS = BatchLayout(num_rows=4, num_live=4)


def decoding(has_row: bool = True) -> RequestView:
    return RequestView("question", decoding=True, has_row=has_row)


def question(tokens: int, *, vision: bool = False) -> RequestView:
    return RequestView("question", needs_vision=vision, num_prefill_tokens=tokens)


def image(tokens: int, *, vision: bool = True) -> RequestView:
    return RequestView("image", needs_vision=vision, num_prefill_tokens=tokens)


def test_every_decoding_answer_is_a_row_and_costs_one_token_of_the_budget() -> None:
    plan = schedule([decoding(), question(100), decoding(), decoding()], 40, ROWS)
    assert plan.decode == (0, 2, 3)
    assert plan.prefill == (PrefillChunk(1, False, 37),)  # 40 - 3 decode rows


def test_the_prefill_share_is_at_least_the_minimum_chunk() -> None:
    plan = schedule([decoding() for _ in range(30)] + [question(100)], 32, BatchLayout(30, 30))
    assert plan.prefill == (PrefillChunk(30, False, MIN_PREFILL_TOKENS),)


def test_questions_go_before_images_each_in_arrival_order() -> None:
    work = [image(50, vision=False), question(3), image(40, vision=False), question(4)]
    plan = schedule(work, 1000)
    assert [p.index for p in plan.prefill] == [1, 3, 0, 2]
    assert [p.num_tokens for p in plan.prefill] == [3, 4, 50, 40]


def test_a_vision_tower_takes_the_whole_prefill_share_of_its_step() -> None:
    plan = schedule([image(600), image(600), question(5, vision=False)], 64)
    assert plan.prefill == (PrefillChunk(2, False, 5), PrefillChunk(0, True, 0))  # nothing after the tower
    restore = schedule([question(600, vision=True), question(5), image(600)], 64)
    assert restore.prefill == (PrefillChunk(0, True, 0),)  # a restore from the image tier runs the tower too


def test_chunks_are_what_is_left_of_the_share_and_stop_when_it_is_spent() -> None:
    plan = schedule([question(5), question(100), question(7)], 64)
    assert plan.prefill == (PrefillChunk(0, False, 5), PrefillChunk(1, False, 59))
    assert schedule([question(100), question(7)], 64).prefill == (PrefillChunk(0, False, 64),)


def test_work_with_nothing_left_to_prefill_is_planned_so_it_can_finish() -> None:
    plan = schedule([image(0, vision=False), question(10)], 64)
    assert plan.prefill == (PrefillChunk(1, False, 10), PrefillChunk(0, False, 0))


def test_without_a_budget_everything_runs_whole() -> None:
    plan = schedule([image(600), question(700, vision=True), question(9), decoding()], None, ROWS)
    assert plan.decode == (3,)
    assert plan.prefill == (PrefillChunk(1, True, None), PrefillChunk(2, False, 9), PrefillChunk(0, True, None))


@pytest.mark.parametrize(
    ("batch", "joining", "rebuild"),
    [
        (BatchLayout(), False, True),  # no batch yet
        (ROWS, True, True),  # an answer joins
        (BatchLayout(8, 3), False, True),  # fewer than half the rows live: compact
        (BatchLayout(8, 4), False, False),  # half live: keep
        (ROWS, False, False),  # every row live, nobody joins
    ],
)
def test_when_the_decode_batch_is_rebuilt(batch: BatchLayout, joining: bool, rebuild: bool) -> None:
    assert needs_rebuild(batch, joining) is rebuild
    plan = schedule([decoding(has_row=not joining)], 64, batch)
    assert plan.rebuild is rebuild


def test_no_decode_rows_no_rebuild_and_an_empty_plan() -> None:
    assert schedule([question(5)], 64, BatchLayout()).rebuild is False
    assert schedule([], 64).empty and schedule([], None) == StepPlan()


# ---------------------------------------------------------------- the time budget (rules 7-8)
#: A prefill pass of n tokens: 20 + n ms; a decode step 30 ms (alone too); the vision tower 50 ms.
COST = StepCost(prefill_fixed_ms=20.0, prefill_token_ms=1.0, decode_ms=30.0, vision_ms=50.0, decode_alone_ms=30.0)
#: Rules 7-9 with image work held to ``step_ms`` alone (the hold on image work has its own tests below).
TIMED = TimeBudget(step_ms=150.0, max_pass_tokens=4096, image_step_ratio=None)


def test_nothing_decoding_a_cold_turn_runs_its_vision_tower_and_whole_prompt_in_one_step() -> None:
    plan = schedule([image(589)], TIMED, BatchLayout(), COST)
    assert plan.prefill == (PrefillChunk(0, True, 589),)
    question_plan = schedule([question(700, vision=True)], TIMED, BatchLayout(), COST)
    assert question_plan.prefill == (PrefillChunk(0, True, 700),)  # a restore from the image tier alike


def test_nothing_decoding_one_pass_is_capped_by_max_pass_tokens() -> None:
    plan = schedule([question(10_000)], TimeBudget(150.0, 4096), BatchLayout(), COST)
    assert plan.prefill == (PrefillChunk(0, False, 4096),)


def test_nothing_decoding_later_pieces_run_only_in_the_time_left() -> None:
    # the first question is whole and costs 20 + 10 ms; the second gets what fits in the 120 ms left
    plan = schedule([question(10), question(500), image(600)], TIMED, BatchLayout(), COST)
    assert plan.prefill == (PrefillChunk(0, False, 10), PrefillChunk(1, False, 100))
    # after a whole long prompt no time is left: the next waits for the next step (and decodes beside it)
    assert schedule([image(600), image(600)], TIMED, BatchLayout(), COST).prefill == (PrefillChunk(0, True, 600),)


def test_while_decoding_the_prefill_chunk_fits_the_step_time_left_by_the_decode_step() -> None:
    # rule 8 alone (every chunk a pass of its own; rule 9 below)
    plan = schedule([decoding(), decoding(), question(500)], TIMED, ROWS, COST, fuse=False)
    assert plan.decode == (0, 1) and not plan.fuse
    assert plan.prefill == (PrefillChunk(2, False, 100),)  # 150 - 30 (decode) - 20 (fixed) = 100 tokens
    slower = StepCost(prefill_fixed_ms=20.0, prefill_token_ms=2.0, decode_ms=30.0, vision_ms=50.0)
    assert schedule([decoding(), question(500)], TIMED, ROWS, slower, fuse=False).prefill == (
        PrefillChunk(1, False, 50),
    )


def test_while_decoding_a_vision_tower_takes_its_cost_and_the_rest_prefills_in_the_same_pass() -> None:
    plan = schedule([decoding(), image(600)], TIMED, ROWS, COST, fuse=False)
    assert plan.prefill == (PrefillChunk(1, True, 50),)  # 150 - 30 - 50 (tower) - 20 (fixed) = 50 tokens
    tight = schedule([decoding(), image(600)], TimeBudget(90.0, 4096), ROWS, COST, fuse=False)
    assert tight.prefill == (PrefillChunk(1, True, 0),)  # the tower alone: it still moves


def test_while_decoding_a_vision_piece_is_allotted_the_ms_left_and_with_nothing_decoding_none() -> None:
    """A video's frames go through the tower a few per step: the chunk says how many ms they may take
    (what the step has left after the decode step); with nothing decoding there is no bound."""
    plan = schedule([decoding(), image(600)], TIMED, ROWS, COST, fuse=False)
    assert plan.prefill[0].vision_ms == 120.0  # 150 - 30 (decode)
    held = schedule([decoding(), image(600)], TimeBudget(150.0, 4096, image_step_ratio=2.0), ROWS, COST, fuse=False)
    assert held.prefill[0].vision_ms == 30.0  # 2 x 30 (the decode step alone) - 30
    assert schedule([image(600)], TIMED, BatchLayout(), COST).prefill[0].vision_ms is None
    assert schedule([decoding(), question(50)], TIMED, ROWS, COST, fuse=False).prefill[0].vision_ms is None


# ---------------------------------------------------------------- the first chunk rides the decode step (rule 9)
def test_while_decoding_the_first_chunk_rides_the_decode_pass_and_costs_its_tokens_only() -> None:
    plan = schedule([decoding(), decoding(), question(500)], TIMED, ROWS, COST)
    assert plan.fuse and plan.decode == (0, 1)
    assert plan.prefill == (PrefillChunk(2, False, 120),)  # 150 - 30 (decode) = 120 tokens, no fixed cost
    # after its vision tower alike: 150 - 30 - 50 (tower) = 70 tokens
    assert schedule([decoding(), image(600)], TIMED, ROWS, COST).prefill == (PrefillChunk(1, True, 70),)
    # a second chunk is a pass of its own: its fixed cost counts (150 - 30 - 40 = 80 ms: 16 + 20 fit)
    two = schedule([decoding(), question(40), question(500)], TIMED, ROWS, COST)
    assert two.fuse and two.prefill == (PrefillChunk(1, False, 40), PrefillChunk(2, False, 60))


def test_nothing_rides_without_decode_rows_or_without_a_chunk() -> None:
    assert not schedule([image(589)], TIMED, BatchLayout(), COST).fuse  # nothing decoding: a pass of its own
    tight = schedule([decoding(), image(600)], TimeBudget(80.0, 4096), ROWS, COST)
    assert tight.prefill == (PrefillChunk(1, True, 0),) and not tight.fuse  # the tower alone: no chunk
    assert not schedule([decoding()], TIMED, ROWS, COST).fuse
    # a token budget fuses alike (its chunk sizes do not change), unless fusing is off
    counted = schedule([decoding(), question(100)], 64, ROWS)
    assert counted.fuse and counted.prefill == (PrefillChunk(1, False, 63),)
    assert not schedule([decoding(), question(100)], 64, ROWS, fuse=False).fuse
    assert not schedule([decoding(), image(600)], 64, ROWS).fuse  # a vision chunk spends a token budget's share


def test_the_cost_model_counts_a_fused_pass_as_the_decode_step_plus_the_chunks_tokens() -> None:
    model = CostModel(StepCost(prefill_fixed_ms=20.0, prefill_token_ms=1.0, decode_ms=30.0), decay=0.0)
    model.fused(100, 140.0)  # 100 tokens at 1 ms: the other 40 ms are the decode step's
    assert model.estimate().decode_ms == pytest.approx(40.0)
    assert model.estimate().prefill_token_ms == 1.0 and model.estimate().prefill_fixed_ms == 20.0
    assert model.estimate().decode_alone_ms == StepCost().decode_alone_ms  # only a decode step alone sets it
    model.decode(25.0)
    assert model.estimate().decode_ms == pytest.approx(25.0) and model.estimate().decode_alone_ms == pytest.approx(25.0)


def test_while_decoding_the_first_piece_always_moves_and_later_ones_need_room() -> None:
    slow_decode = StepCost(prefill_fixed_ms=20.0, prefill_token_ms=1.0, decode_ms=200.0, vision_ms=50.0)
    plan = schedule([decoding(), question(500), question(40)], TIMED, ROWS, slow_decode)
    assert plan.prefill == (PrefillChunk(1, False, MIN_PREFILL_TOKENS),)
    # a second chunk runs when 16 tokens of it fit: 150 - 30 - (20 + 30) = 70 ms left for question(40)
    fits = schedule([decoding(), question(30), question(40)], TIMED, ROWS, COST)
    assert fits.prefill == (PrefillChunk(1, False, 30), PrefillChunk(2, False, 40))
    # an image after it prefills only when its tower fits too: 150 - 30 - 60 = 60 ms hold the tower
    # (50) but not 16 tokens more in a pass of their own (50 + 20 + 16): the tower runs alone in the
    # time left, and its first chunk rides the next step's decode pass; 30 ms left hold nothing
    tower_alone = schedule([decoding(), question(60), image(600)], TIMED, ROWS, COST)
    assert tower_alone.prefill == (PrefillChunk(1, False, 60), PrefillChunk(2, True, 0))
    assert tower_alone.prefill[1].vision_ms == pytest.approx(60.0)
    no_tower = schedule([decoding(), question(90), image(600)], TIMED, ROWS, COST)
    assert no_tower.prefill == (PrefillChunk(1, False, 90),)
    # a chat image turn is question work: the same
    turn = schedule([decoding(), question(60), question(600, vision=True)], TIMED, ROWS, COST)
    assert turn.prefill == (PrefillChunk(1, False, 60), PrefillChunk(2, True, 0))


# ---------------------------------------------------------------- image work held to the decode step alone (rule 8)
HELD = TimeBudget(step_ms=150.0, max_pass_tokens=4096)  # the default: image work within 2 decode steps alone


def test_while_decoding_image_work_is_held_to_twice_the_decode_step_alone() -> None:
    # 2 x 30 ms: 30 ms beside the decode step, its chunk fused into the decode pass (30 tokens), not 120
    assert schedule([decoding(), image(600, vision=False)], HELD, ROWS, COST).prefill == (PrefillChunk(1, False, 30),)
    assert schedule([decoding(), question(500)], HELD, ROWS, COST).prefill == (PrefillChunk(1, False, 120),)
    # the vision tower (50 ms) does not fit beside the decode step: it runs alone, and still moves
    tower = schedule([decoding(), image(600)], HELD, ROWS, COST)
    assert tower.prefill == (PrefillChunk(1, True, 0),) and not tower.fuse
    # the first chunk always moves: at least 16 tokens however little is left
    tight = StepCost(prefill_fixed_ms=20.0, prefill_token_ms=1.0, decode_ms=30.0, vision_ms=50.0, decode_alone_ms=20.0)
    assert schedule([decoding(), image(600, vision=False)], HELD, ROWS, tight).prefill == (
        PrefillChunk(1, False, MIN_PREFILL_TOKENS),
    )


def test_the_hold_is_measured_against_the_decode_step_alone_and_what_the_step_planned_first() -> None:
    # chunks fused into the decode pass raised its share to 40 ms; the hold is still 2 x 30: 20 tokens
    fused = StepCost(prefill_fixed_ms=20.0, prefill_token_ms=1.0, decode_ms=40.0, vision_ms=50.0, decode_alone_ms=30.0)
    assert schedule([decoding(), image(600, vision=False)], HELD, ROWS, fused).prefill == (PrefillChunk(1, False, 20),)
    # a question first takes the step's budget; an image after it only within the hold (60 - 30 - 20 = 10 ms: no)
    plan = schedule([decoding(), question(20), image(600, vision=False)], HELD, ROWS, COST)
    assert plan.prefill == (PrefillChunk(1, False, 20),)
    # a step budget below the hold wins; a ratio of None holds image work to the step budget alone
    assert schedule([decoding(), image(600, vision=False)], TimeBudget(40.0, 4096), ROWS, COST).prefill == (
        PrefillChunk(1, False, MIN_PREFILL_TOKENS),
    )
    five = TimeBudget(150.0, 4096, image_step_ratio=5.0)
    assert schedule([decoding(), image(600, vision=False)], five, ROWS, COST).prefill == (PrefillChunk(1, False, 120),)


def test_nothing_decoding_image_work_is_not_held() -> None:
    assert schedule([image(589)], HELD, BatchLayout(), COST).prefill == (PrefillChunk(0, True, 589),)
    # after a whole question, an image gets what the step's budget has left (150 - 30 - 20 (fixed) = 100 tokens)
    plan = schedule([question(10), image(600, vision=False)], HELD, BatchLayout(), COST)
    assert plan.prefill == (PrefillChunk(0, False, 10), PrefillChunk(1, False, 100))


def test_the_time_budget_keeps_rules_1_3_and_6() -> None:
    plan = schedule([image(50, vision=False), decoding(has_row=False), question(3)], TIMED, ROWS, COST)
    assert plan.decode == (1,) and plan.rebuild
    assert [p.index for p in plan.prefill] == [2, 0]


def test_the_cost_model_fits_fixed_and_per_token_cost_from_timed_passes() -> None:
    model = CostModel(StepCost(prefill_fixed_ms=5.0, prefill_token_ms=0.1), decay=0.9)
    for _ in range(40):
        for n in (16, 64, 300, 589):
            model.prefill(n, 30.0 + 0.8 * n)  # the device: 30 ms fixed, 0.8 ms a token
    cost = model.estimate()
    assert cost.prefill_fixed_ms == pytest.approx(30.0, rel=0.02)
    assert cost.prefill_token_ms == pytest.approx(0.8, rel=0.02)
    assert cost.tokens_within(30.0 + 0.8 * 100) in (99, 100) and cost.tokens_within(10.0) == 0


def test_the_cost_model_with_passes_of_one_length_keeps_the_fixed_cost_and_follows_the_total() -> None:
    model = CostModel(StepCost(prefill_fixed_ms=20.0, prefill_token_ms=1.0), decay=0.5)
    for _ in range(60):
        model.prefill(64, 20.0 + 64 * 3.0)  # a slower device than the prior
    cost = model.estimate()
    assert cost.prefill_ms(64) == pytest.approx(212.0, rel=0.01)
    assert cost.prefill_fixed_ms == pytest.approx(20.0, abs=1.0)


def test_the_cost_model_follows_the_decode_step_and_the_vision_tower_and_ignores_nonsense() -> None:
    model = CostModel(decay=0.5)
    for _ in range(30):
        model.decode(12.0)
        model.vision(2, 90.0)  # two images: 45 ms each
    model.prefill(0, 5.0)
    model.decode(float("nan"))
    cost = model.estimate()
    assert cost.decode_ms == pytest.approx(12.0) and cost.vision_ms == pytest.approx(45.0)


def test_rule_10_a_piece_that_starts_its_work_carries_its_start_bytes_later_pieces_none() -> None:
    work = [
        RequestView("question", num_prefill_tokens=30, start_bytes=4000),  # waiting: its start comes with it
        RequestView("question", num_prefill_tokens=30),  # started in an earlier step: nothing more to grant
        RequestView("image", needs_vision=True, num_prefill_tokens=600, start_bytes=90_000),
    ]
    plan = schedule(work, 64)  # the image's vision tower takes what is left of the share: its start too
    assert plan.prefill == (
        PrefillChunk(0, False, 30, 4000),
        PrefillChunk(1, False, 30, 0),
        PrefillChunk(2, True, 0, 90_000),
    )
    assert schedule(work, None).prefill[2] == PrefillChunk(2, True, None, 90_000)
    assert plan.batch_bytes == 0  # nothing decodes: no batch


def test_rules_6_and_10_over_pages_a_step_carries_the_pages_its_rows_open_and_a_join_moves_nothing() -> None:
    per_token, page = 10, 16
    paged = BatchLayout(3, 3, kv_bytes_per_token=per_token, page_size=page)
    opens = RequestView("question", decoding=True, has_row=True, num_kv_tokens=32)  # position 32 starts a page
    inside = RequestView("question", decoding=True, has_row=True, num_kv_tokens=33)
    joining = RequestView("question", decoding=True, has_row=False, num_kv_tokens=48)
    plan = schedule([opens, inside, inside], None, paged)
    assert not plan.rebuild and plan.batch_bytes == page * per_token  # every step, not only a rebuild
    assert schedule([inside] * 3, None, paged).batch_bytes == 0
    plan = schedule([opens, joining, inside], None, paged)
    assert plan.rebuild and plan.batch_bytes == 2 * page * per_token  # the joining row's next page, no copy
    assert not needs_rebuild(BatchLayout(4, 4, page_size=page), False)  # however long its rows: no columns to run out
    assert needs_rebuild(BatchLayout(8, 3, page_size=page), False)  # compaction still gives rows anew


def answer(created: float, kv_tokens: int, *, has_row: bool = True, held: int = 0) -> RequestView:
    """A decoding answer that arrived at ``created``, ``kv_tokens`` long, its session holding ``held``
    positions of its own KV on the device."""
    return RequestView(
        "question", decoding=True, has_row=has_row, num_kv_tokens=kv_tokens, num_held_kv_tokens=held, created=created
    )


def test_rule_11_a_step_that_cannot_grow_drops_its_newest_answers_and_keeps_the_oldest() -> None:
    per_token, page = 10, 16
    batch = BatchLayout(2, 2, kv_bytes_per_token=per_token, page_size=page)
    # in arrival order 0, 2, 1: the third in the list is the newest; every next position opens a page
    work = [answer(1.0, 48), answer(3.0, 32, has_row=False), answer(2.0, 64)]
    whole = 3 * page * per_token
    assert schedule(work, None, batch).room == Room() and schedule(work, None, batch).batch_bytes == whole
    assert schedule(work, None, batch, room_bytes=whole).room == Room()  # room enough: nobody leaves
    plan = schedule(work, None, batch, room_bytes=whole - 1)
    assert plan.room == Room(preempt=(1,)) and plan.batch_bytes == 2 * page * per_token
    assert plan.decode == (0, 1, 2)  # the engine drops the preempted one before the pass
    plan = schedule(work, None, batch, room_bytes=page * per_token)  # only one fits: the oldest
    assert plan.room == Room(preempt=(1, 2)) and plan.batch_bytes == page * per_token
    plan = schedule(work, None, batch, room_bytes=page * per_token - 1)  # not even the oldest
    assert plan.room == Room(refused=True) and plan.batch_bytes == 0


def test_rule_11_over_pages_a_leaving_answers_pages_come_back_to_the_room() -> None:
    per_token, page = 10, 16
    paged = BatchLayout(3, 3, kv_bytes_per_token=per_token, page_size=page)
    # every answer's next position opens a page; the newest holds 4 pages of its own
    work = [answer(1.0, 32, held=32), answer(2.0, 48, held=48), answer(3.0, 64, held=64)]
    assert schedule(work, None, paged, room_bytes=3 * page * per_token).room == Room()
    plan = schedule(work, None, paged, room_bytes=0)  # the newest's 4 pages pay for the 2 the others open
    assert plan.room == Room(preempt=(2,)) and plan.batch_bytes == 2 * page * per_token
    # nothing to grant: fits even over budget (the ledger's room negative)
    inside = [answer(1.0, 33, held=48), answer(2.0, 50, held=64)]
    assert schedule(inside, None, paged, room_bytes=-5).room == Room()
    assert schedule([answer(1.0, 32, held=32)], None, paged, room_bytes=page * per_token - 1).room == Room(refused=True)


def test_rule_11_the_plan_reads_the_room_only_when_its_step_opens_pages_and_carries_the_preemptions() -> None:
    """``schedule`` decides preemption itself: given what reads the room (the engine's ledger, which
    reads every session), it reads it only for a step whose rows open pages, and the plan carries
    the answers that leave."""
    per_token, page = 10, 16
    batch = BatchLayout(2, 2, kv_bytes_per_token=per_token, page_size=page)
    reads: list[int] = []

    def room() -> int:
        reads.append(1)
        return page * per_token  # one page: the oldest's

    inside = [answer(1.0, 33), answer(2.0, 40)]
    assert schedule(inside, None, batch, room_bytes=room).room == Room() and reads == []
    opening = [answer(1.0, 32), answer(2.0, 48)]
    plan = schedule(opening, None, batch, room_bytes=room)
    assert reads == [1] and plan.room == Room(preempt=(1,)) and plan.batch_bytes == page * per_token
