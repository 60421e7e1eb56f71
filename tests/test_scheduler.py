"""The scheduler's rules, without a model: plain data in, a plain-data StepPlan out (milliseconds)."""

from __future__ import annotations

import pytest

from llava_sessions.engine.scheduler import (
    MIN_PREFILL_TOKENS,
    BatchLayout,
    PrefillPiece,
    StepPlan,
    WorkView,
    needs_rebuild,
    schedule,
)

ROWS = BatchLayout(num_rows=4, num_live=4, length=100, capacity=164)


def decoding(has_row: bool = True) -> WorkView:
    return WorkView("question", decoding=True, has_row=has_row)


def question(tokens: int, *, vision: bool = False) -> WorkView:
    return WorkView("question", needs_vision=vision, num_prefill_tokens=tokens)


def image(tokens: int, *, vision: bool = True) -> WorkView:
    return WorkView("image", needs_vision=vision, num_prefill_tokens=tokens)


def test_every_decoding_answer_is_a_row_and_costs_one_token_of_the_budget() -> None:
    plan = schedule([decoding(), question(100), decoding(), decoding()], 40, ROWS)
    assert plan.decode == (0, 2, 3)
    assert plan.prefill == (PrefillPiece(1, False, 37),)  # 40 - 3 decode rows


def test_the_prefill_share_is_at_least_the_minimum_chunk() -> None:
    plan = schedule([decoding() for _ in range(30)] + [question(100)], 32, BatchLayout(30, 30, 10, 74))
    assert plan.prefill == (PrefillPiece(30, False, MIN_PREFILL_TOKENS),)


def test_questions_go_before_images_each_in_arrival_order() -> None:
    work = [image(50, vision=False), question(3), image(40, vision=False), question(4)]
    plan = schedule(work, 1000)
    assert [p.index for p in plan.prefill] == [1, 3, 0, 2]
    assert [p.num_tokens for p in plan.prefill] == [3, 4, 50, 40]


def test_a_vision_tower_takes_the_whole_prefill_share_of_its_step() -> None:
    plan = schedule([image(600), image(600), question(5, vision=False)], 64)
    assert plan.prefill == (PrefillPiece(2, False, 5), PrefillPiece(0, True, 0))  # nothing after the tower
    restore = schedule([question(600, vision=True), question(5), image(600)], 64)
    assert restore.prefill == (PrefillPiece(0, True, 0),)  # a restore from the image tier runs the tower too


def test_chunks_are_what_is_left_of_the_share_and_stop_when_it_is_spent() -> None:
    plan = schedule([question(5), question(100), question(7)], 64)
    assert plan.prefill == (PrefillPiece(0, False, 5), PrefillPiece(1, False, 59))
    assert schedule([question(100), question(7)], 64).prefill == (PrefillPiece(0, False, 64),)


def test_work_with_nothing_left_to_prefill_is_planned_so_it_can_finish() -> None:
    plan = schedule([image(0, vision=False), question(10)], 64)
    assert plan.prefill == (PrefillPiece(1, False, 10), PrefillPiece(0, False, 0))


def test_without_a_budget_everything_runs_whole() -> None:
    plan = schedule([image(600), question(700, vision=True), question(9), decoding()], None, ROWS)
    assert plan.decode == (3,)
    assert plan.prefill == (PrefillPiece(1, True, None), PrefillPiece(2, False, 9), PrefillPiece(0, True, None))


@pytest.mark.parametrize(
    ("batch", "joining", "rebuild"),
    [
        (BatchLayout(), False, True),  # no batch yet
        (ROWS, True, True),  # an answer joins
        (BatchLayout(4, 4, 164, 164), False, True),  # the columns ran out
        (BatchLayout(8, 3, 100, 164), False, True),  # fewer than half the rows live: compact
        (BatchLayout(8, 4, 100, 164), False, False),  # half live: keep
        (BatchLayout(4, 4, 163, 164), False, False),  # one column left
    ],
)
def test_when_the_decode_batch_is_rebuilt(batch: BatchLayout, joining: bool, rebuild: bool) -> None:
    assert needs_rebuild(batch, joining) is rebuild
    plan = schedule([decoding(has_row=not joining)], 64, batch)
    assert plan.rebuild is rebuild


def test_no_decode_rows_no_rebuild_and_an_empty_plan() -> None:
    assert schedule([question(5)], 64, BatchLayout()).rebuild is False
    assert schedule([], 64).empty and schedule([], None) == StepPlan()
