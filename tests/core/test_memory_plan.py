"""Scheduler rule 10 on the real engine: device memory comes with a step's plan only.

Admission checks that room can be made (its 503 comes before any forward pass) and demotes nothing;
the step that starts a request makes room for the bytes its plan grants, and a rebuilt decode
batch gets exactly the bytes the plan computed. fp32 on CPU, the ``tiny`` checkpoint.
"""

from __future__ import annotations

import pytest

from engine_fixtures import LAYOUTS, make_engine
from llava_sessions.engine import SessionEngine
from llava_sessions.engine.scheduler import schedule
from llava_sessions.engine.sequence import Phase
from llava_sessions.errors import ErrorCode
from llava_sessions.sampling.sampler import SamplingParams
from llava_sessions.sessions.store import Tier

Q = "What is in this image?"


def tiers(eng: SessionEngine) -> dict[str, Tier]:
    return {s.session_id: s.tier for s in eng.store.sessions()}


def test_admission_demotes_nothing_the_open_s_first_step_makes_its_room(llava, photos):
    probe = make_engine(llava)
    probe.open("p", photos["astronaut"])
    one = probe.store.device_bytes()
    eng = make_engine(llava, int(2.3 * one))  # room for two sessions
    eng.open("a", photos["astronaut"])
    eng.open("b", photos["coffee"])
    held = eng.store.device_bytes()
    task = eng.begin_open("c", photos["rocket"])
    assert task.view().start_bytes == eng.new_session_bytes(len(task.prefix), sum(task.session.image_tokens))
    # admitted (room can be made), but nothing demoted nor allocated before the step runs
    assert tiers(eng) == {"a": Tier.KV, "b": Tier.KV, "c": Tier.IMAGE} and eng.store.device_bytes() == held
    assert eng.store.stats.num_demotions_kv == 0
    eng.step([task])  # the vision tower's chunk carries the grant: room made, least recent first
    assert eng.store.stats.num_demotions_kv == 1 and tiers(eng)["a"] is not Tier.KV
    while not task.done:
        eng.step([task])
    assert task.error is None and tiers(eng)["c"] is Tier.KV
    assert eng.store.device_bytes() <= eng.store.device_budget_bytes


def test_a_decode_step_takes_exactly_the_pages_its_plan_granted(llava, photos):
    """Rule 10 over pages: a decode step's plan carries the bytes of the pages its rows open (a row
    whose next position starts a page), and the sessions hold exactly that much more after it; joins
    give rows and move no KV."""
    eng = make_engine(llava)
    for sid, photo in (("a", "astronaut"), ("b", "coffee"), ("c", "rocket")):
        eng.open(sid, photos[photo])
    gens = [eng.start("a", Q, SamplingParams(max_new_tokens=40))]
    opened, rebuilds = 0, 0
    for step in range(60):
        if step in (3, 6):  # answers join a running batch
            gens.append(eng.start("bc"[step // 3 - 1], Q + " Be brief." * step, SamplingParams(max_new_tokens=40)))
        live = [g for g in gens if not g.done]
        if not live:
            break
        plan = schedule([g.view() for g in live], None, eng.batch.layout(), fuse=eng.fuse)
        before = eng.store.device_bytes()
        eng.step(live)
        rebuilds += plan.rebuild
        if plan.decode and not plan.prefill and not any(g.done for g in live):
            assert eng.store.device_bytes() - before == plan.batch_bytes
            opened += plan.batch_bytes > 0
    assert rebuilds >= 3 and opened >= 2 and all(g.error is None for g in gens)


def test_a_start_refused_memory_fails_alone_and_the_session_stays(llava, photos):
    """Two questions start in one step; the budget has room for the first's start only. The second
    fails with a 503 ``overloaded`` (its grant refused: the other session is answering, it cannot be
    demoted) and its session is as it was; the first answers exactly as alone (the pages its decode steps
    open made room for by demoting the refused session, idle again), and the refused one answers after.

    The budget is cut to half a token past the first start's grant, which counts the whole pages
    the start takes in the KV pool (as the ledger books them)."""
    params, params_b = SamplingParams(max_new_tokens=3), SamplingParams(max_new_tokens=48, min_tokens=48)
    probe = make_engine(llava)
    probe.open("a", photos["astronaut"])
    probe.open("b", photos["coffee"])
    held = probe.store.device_bytes()
    expected = probe.generate("a", Q, params, remember=False)
    expected_b = probe.generate("b", Q, params_b, remember=False)
    need_a = probe.start("a", Q, params, remember=False).start_bytes
    eng = make_engine(llava, held + need_a + llava.kv_bytes_per_token // 2)
    eng.open("a", photos["astronaut"])
    eng.open("b", photos["coffee"])
    assert eng.store.device_bytes() == held
    ga = eng.start("a", Q, params, remember=False)
    gb = eng.start("b", Q, params_b, remember=False)
    assert gb.start_bytes > 2 * 16 * llava.kv_bytes_per_token  # more than the first can leave (under a page)
    eng.step([ga, gb])
    assert gb.done and gb.error is not None and gb.error.code is ErrorCode.OVERLOADED
    assert gb.error.retry_after_s and "device memory" in gb.error.message
    assert not ga.done and not eng.store.get("b").busy and tiers(eng) == {"a": Tier.KV, "b": Tier.KV}
    eng.step([ga])  # the first decode step: room made for the page it opens, if any
    assert eng.store.device_bytes() <= eng.store.device_budget_bytes
    while not ga.done:
        eng.step([ga])
    assert ga.error is None and [t.id for t in ga.answer.tokens] == [t.id for t in expected.tokens]
    again = eng.generate("b", Q, params_b, remember=False)  # as it answers alone (restored from its demotion)
    assert [t.id for t in again.tokens] == [t.id for t in expected_b.tokens] and again.tokens
    assert eng.store.device_bytes() <= eng.store.device_budget_bytes


def test_work_listed_twice_in_a_step_runs_once(llava, photos):
    """``SessionEngine.step`` is public: an answer passed twice (a caller's slip) decodes one token
    per step and stays exact, instead of joining the decode batch twice."""
    params = SamplingParams(max_new_tokens=6)
    expected = make_engine(llava)
    expected.open("a", photos["astronaut"])
    want = [t.id for t in expected.generate("a", Q, params, remember=False).tokens]
    eng = make_engine(llava)
    eng.open("a", photos["astronaut"])
    gen = eng.start("a", Q, params, remember=False)
    steps = 0
    while not gen.done:
        eng.step([gen, gen])
        steps += 1
    assert gen.error is None and [t.id for t in gen.answer.tokens] == want and steps == len(want)


@pytest.mark.parametrize("layout", ["eager", "static", "ahead"])
def test_answers_that_outgrow_memory_are_preempted_newest_first_and_resume_exactly(llava, photos, layout):
    """vLLM's rule, however a step runs (``static``: through the static decode step, over a pool fixed
    at the budget; ``ahead``: that with async scheduling, whose launched steps get room for their pages
    or step in step): three answers whose starts fit but whose growth together does not. Where the
    step cannot get the pages it opens, the newest answer is preempted (its row leaves the batch unread,
    its KV is dropped) instead of every answer failing ``overloaded`` mid-stream; it waits,
    recomputes its prompt's and its tokens' KV, and goes on: every answer ends with the tokens it
    gives alone (greedy, and a seeded sampled one), none fails, the preempted one's stream pauses
    meanwhile, and the preemptions are counted."""
    sessions = {"a": "astronaut", "b": "coffee", "c": "rocket"}
    params = {
        "a": SamplingParams(max_new_tokens=120, ignore_eos=True),
        "b": SamplingParams(max_new_tokens=120, ignore_eos=True, temperature=0.9, seed=7),
        "c": SamplingParams(max_new_tokens=120, ignore_eos=True),
    }
    probe = make_engine(llava)
    for sid, photo in sessions.items():
        probe.open(sid, photos[photo])
    held = probe.store.device_bytes()
    alone = {sid: [t.id for t in probe.generate(sid, Q, params[sid], remember=False).tokens] for sid in sessions}
    # the questions' pages and about one and a half answers' (every answer's pages are its session's)
    budget = held + (3 * 32 + 180) * llava.kv_bytes_per_token
    eng = make_engine(llava, budget, **LAYOUTS[layout])
    for sid, photo in sessions.items():
        eng.open(sid, photos[photo])
    gens = [eng.start(sid, Q, params[sid], remember=False) for sid in sessions]
    paused_steps = 0
    while not all(g.done for g in gens):
        waiting = {id(g): len(g.events) for g in gens if g.num_preemptions and g.phase is Phase.WAITING}
        eng.step([g for g in gens if not g.done])
        for g in gens:  # its stream pauses: no token while it waits and recomputes its KV
            if id(g) in waiting:
                assert len(g.events) == waiting[id(g)] and not g.done
                paused_steps += 1
    assert all(g.error is None for g in gens), [repr(g.error) for g in gens]
    assert paused_steps >= 1
    assert {g.session_id: [t.id for t in g.answer.tokens] for g in gens} == alone
    assert eng.num_preemptions == sum(g.num_preemptions for g in gens) >= 1
    assert max(g.num_preemptions for g in gens[1:]) >= 1 and gens[0].num_preemptions == 0  # the oldest never
    assert eng.store.device_bytes() <= eng.store.device_budget_bytes
    assert sorted(g.answer.cached_tokens > 500 for g in gens) == [True, True, True]  # reported as first started
    ahead = eng._execute.ahead
    assert (ahead is not None and ahead.num_steps > 0 and ahead.flight is None) == (layout == "ahead")
