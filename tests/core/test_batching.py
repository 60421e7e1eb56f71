"""Batched decode across sessions: identical answers to the same questions asked one at a time.

fp32 on CPU, the ``tiny`` checkpoint. Sessions of different context lengths join and leave the
decode batch between steps (continuous batching); each row keeps its own sampling, stop strings,
log-probs and finish reason.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.nn.attention.bias import CausalBias
from transformers import AttentionInterface

from engine_fixtures import LAYOUTS, make_engine
from llava_sessions.conversation import Turn
from llava_sessions.engine import Sequence, SessionEngine
from llava_sessions.errors import ErrorCode, overloaded
from llava_sessions.model import cache_len
from llava_sessions.model.fused import (
    FUSED_ATTENTION,
    LOWER_RIGHT_ATTENTION,
    attention_window,
    context_limit,
    fused_attention,
    lower_right_attention,
    prefer_sdpa_backends,
)
from llava_sessions.sampling.sampler import SamplingParams
from llava_sessions.sessions.store import Tier

#: Largest |logit| difference allowed between a batched decode step and the same step alone (fp32,
#: tiny model, logits of magnitude ~10): batching changes the matmul shapes and so the order of
#: floating-point sums, never the math. Measured here: ~2e-4.
LOGIT_TOLERANCE = 2e-3


# (session, image, remembered history, question, sampling parameters)
CASES = [
    ("a", "astronaut", [], "What is in this image?", SamplingParams(max_new_tokens=14)),
    (
        "b",
        "coffee",
        [("What is this?", "A cup of coffee on a saucer."), ("What colour?", "Brown and white.")],
        "Describe the saucer.",
        SamplingParams(max_new_tokens=9, logprobs=True),
    ),
    ("c", "rocket", [("Hi", "Hello.")], "What is it?", SamplingParams(max_new_tokens=20, temperature=0.8, seed=11)),
    ("d", "chelsea", [], "Tell me a story about it.", SamplingParams(max_new_tokens=6, top_k=20, top_p=0.9, seed=5)),
    ("e", "coffee", [], "And in the background?", SamplingParams(max_new_tokens=11, repetition_penalty=1.3)),
]


def open_all(eng: SessionEngine, photos) -> None:
    for sid, photo, history, _q, _p in CASES:
        eng.open(sid, photos[photo], history=[Turn(q, a) for q, a in history])


def alone(llava, photos) -> dict[str, list]:
    eng = make_engine(llava)
    open_all(eng, photos)
    return {sid: eng.generate(sid, q, p, remember=False).tokens for sid, _ph, _h, q, p in CASES}


@pytest.mark.parametrize("layout", ["eager", "static", "ahead"])
def test_batched_answers_equal_answers_alone_with_joins_and_leaves(llava, photos, layout):
    """Rows of different lengths join and leave, each decoding in its session's pages. ``eager``: each
    step at its own shape (a CPU reads each row's runs of pages); ``static``: through the static decode
    step a GPU replays as CUDA graphs (rows padded to a bucket with pad rows on the scratch page, the
    attended length to one; run eagerly here), a question prefilled alone going in as the rows of one
    such step; ``ahead``: the static step launched before the host reads its tokens. Against answers
    alone."""
    expected = alone(llava, photos)
    eng = make_engine(llava, **LAYOUTS[layout])
    open_all(eng, photos)
    gens: dict[str, Sequence] = {}
    widths = set()
    for step in range(40):
        for sid, _ph, _h, q, p in CASES:  # sessions join at different steps
            if sid not in gens and step == "abcde".index(sid) * 2:
                gens[sid] = eng.start(sid, q, p, remember=False)
        running = [g for g in gens.values() if not g.done]
        if not running and len(gens) == len(CASES):
            break
        eng.step(running)
        widths.add(eng.batch.num_live)
    assert max(widths) >= 3  # several answers really decoded together
    if layout == "static":  # every decode-only step went through the static step; the pool never grew
        graphs = eng.runner.graphs  # eager on a CPU, replayed on a GPU (make test-gpu)
        assert graphs is not None and graphs.steps.num_eager + graphs.steps.num_replays >= 10
        assert eng.runner.graphs.num_prefills >= 1  # a question no answer's step carried: one step's rows
        assert eng.runner.pool is not None and eng.runner.pool.fixed and eng.runner.pool.num_grows == 0
    for sid, gen in gens.items():
        assert gen.error is None and gen.answer is not None
        got, want = gen.answer.tokens, expected[sid]
        assert [t.id for t in got] == [t.id for t in want], sid
        assert [t.text for t in got] == [t.text for t in want]
        if got[0].logprob is not None:
            assert all(abs(x.logprob - y.logprob) < 1e-3 for x, y in zip(got, want, strict=True))
    assert eng.batch.rows == []  # the last row left: the batch is empty
    for sid, *_ in CASES:  # every session is back in its own cache, as long as before the question
        s = eng.store.get(sid)
        assert not s.busy and cache_len(s.kv_cache) == len(s.cached_ids)


def test_a_row_that_sits_out_steps_still_answers_exactly(llava, photos):
    """A job TorchServe does not bring back in a call skips steps; its masked holes change nothing."""
    expected = alone(llava, photos)
    eng = make_engine(llava)
    open_all(eng, photos)
    (sa, _, _, qa, pa), (sb, _, _, qb, pb) = CASES[0], CASES[1]
    ga, gb = eng.start(sa, qa, pa, remember=False), eng.start(sb, qb, pb, remember=False)
    for step in range(60):
        todo = [g for g in (ga, gb) if not g.done and (g is ga or step % 3 == 0)]
        if not ga.done or not gb.done:
            eng.step(todo)
    assert [t.id for t in ga.answer.tokens] == [t.id for t in expected[sa]]
    assert [t.id for t in gb.answer.tokens] == [t.id for t in expected[sb]]
    assert eng.batch.num_builds >= 1


def test_plain_greedy_rows_take_their_tokens_from_one_argmax_a_step_and_answer_as_alone(llava, photos):
    """Rows with nothing but greedy to compute (no logprobs, penalty, bias, grammar, active ``min_tokens``
    mask) take their tokens from one argmax over the step's logits, read to the host once (the profiler
    counts one ``aten::argmax`` in a decode step of three such rows); a ``min_tokens`` row joins them once
    its mask is over, a logprobs row samples alone; every answer equals the same question alone."""
    from torch.profiler import ProfilerActivity, profile

    asks = {
        "a": ("What is in this image?", SamplingParams(max_new_tokens=12)),
        "b": ("Describe the saucer.", SamplingParams(max_new_tokens=12)),
        "c": ("What is it?", SamplingParams(max_new_tokens=12, min_tokens=4, ignore_eos=True)),
        "d": ("And in the background?", SamplingParams(max_new_tokens=12, logprobs=True)),
    }
    images = {"a": "astronaut", "b": "coffee", "c": "rocket", "d": "chelsea"}
    eng = make_engine(llava)
    for sid, photo in images.items():
        eng.open(sid, photos[photo])
    expected = {sid: eng.generate(sid, q, p, remember=False).tokens for sid, (q, p) in asks.items()}
    gens = {sid: eng.start(sid, q, p, remember=False) for sid, (q, p) in asks.items() if sid != "d"}
    while not all(g.prefilled for g in gens.values()):
        eng.step([g for g in gens.values() if not g.prefilled])
    assert not gens["c"].sampler.plain_greedy  # its first tokens may not end it: masked, one by one
    while not all(g.sampler.plain_greedy for g in gens.values()):
        eng.step([g for g in gens.values() if not g.done])
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        eng.step(list(gens.values()))
    argmaxes = sum(e.count for e in prof.key_averages() if e.key == "aten::argmax")
    assert argmaxes == 1, argmaxes  # one for the three rows, not one each
    gens["d"] = eng.start("d", *asks["d"], remember=False)
    while not all(g.done for g in gens.values()):
        eng.step([g for g in gens.values() if not g.done])
    for sid, g in gens.items():
        assert [t.id for t in g.answer.tokens] == [t.id for t in expected[sid]], sid
    assert all(t.logprob is not None for t in gens["d"].answer.tokens)


def test_sampled_rows_draw_together_in_one_warp_a_step_and_answer_as_alone(llava, photos):
    """Seeded rows with temperature, top-k, top-p or min-p and nothing else are warped and drawn together
    (``sampling/rows.py``: in a decode step of three such rows and a greedy one, two of them with top-p
    and two with top-k, the profiler counts one sort and one top-k for all, not one per row that asks,
    and one exponential draw per sampled row); every answer equals the same question alone, with the
    same seed."""
    from torch.profiler import ProfilerActivity, profile

    asks = {
        "a": ("What is in this image?", SamplingParams(max_new_tokens=12, temperature=0.8, top_p=0.9, seed=3)),
        "b": ("Describe the saucer.", SamplingParams(max_new_tokens=12, top_k=40, top_p=0.95, seed=4)),
        "c": ("What is it?", SamplingParams(max_new_tokens=12, top_k=20, min_p=0.05, seed=5)),
        "d": ("And in the background?", SamplingParams(max_new_tokens=12)),
    }
    images = {"a": "astronaut", "b": "coffee", "c": "rocket", "d": "chelsea"}
    eng = make_engine(llava)
    for sid, photo in images.items():
        eng.open(sid, photos[photo])
    expected = {sid: eng.generate(sid, q, p, remember=False).tokens for sid, (q, p) in asks.items()}
    gens = {sid: eng.start(sid, q, p, remember=False) for sid, (q, p) in asks.items()}
    while not all(g.prefilled for g in gens.values()):
        eng.step([g for g in gens.values() if not g.prefilled])
    assert [g.sampler.plain_sampled for g in gens.values()] == [True, True, True, False]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        eng.step([g for g in gens.values() if not g.done])
    counts = {e.key: e.count for e in prof.key_averages()}
    assert counts.get("aten::sort") == 1 and counts.get("aten::topk") == 1, (
        counts.get("aten::sort"),
        counts.get("aten::topk"),
    )
    assert counts.get("aten::exponential_") == 3
    while not all(g.done for g in gens.values()):
        eng.step([g for g in gens.values() if not g.done])
    for sid, g in gens.items():
        assert [t.id for t in g.answer.tokens] == [t.id for t in expected[sid]], sid


def test_stop_strings_and_finish_reasons_are_per_row(llava, photos):
    eng = make_engine(llava)
    open_all(eng, photos)
    full = eng.generate("a", "What is in this image?", SamplingParams(max_new_tokens=16), remember=False)
    stop = full.text[4:6]
    assert stop.strip()
    ga = eng.start("a", "What is in this image?", SamplingParams(max_new_tokens=16, stop=(stop,)), remember=False)
    gb = eng.start("b", "Describe the saucer.", SamplingParams(max_new_tokens=16), remember=False)
    while not (ga.done and gb.done):
        eng.step([g for g in (ga, gb) if not g.done])
    assert ga.answer.finish_reason == "stop" and stop in ga.answer.text and ga.answer.text in full.text
    assert gb.answer.finish_reason == "length" and gb.answer.generated_tokens == 16


def test_remembered_turns_from_a_batch_continue_exactly(llava, photos):
    """Answers remembered out of the batch leave each session's cache holding its conversation."""
    eng = make_engine(llava)
    open_all(eng, photos)
    twin = make_engine(llava)
    open_all(twin, photos)
    gens = [eng.start(sid, q, SamplingParams(max_new_tokens=8)) for sid, _ph, _h, q, _p in CASES[:3]]
    while any(not g.done for g in gens):
        eng.step([g for g in gens if not g.done])
    for sid, _ph, _h, q, _p in CASES[:3]:
        twin.generate(sid, q, SamplingParams(max_new_tokens=8))
        a = eng.generate(sid, "Anything else?", SamplingParams(max_new_tokens=8))
        b = twin.generate(sid, "Anything else?", SamplingParams(max_new_tokens=8))
        assert [t.id for t in a.tokens] == [t.id for t in b.tokens]
        assert a.cached_tokens == b.cached_tokens > 0  # the follow-up reused the cache built in the batch


def test_batched_logits_match_single_decode_within_tolerance(llava, photos):
    eng = make_engine(llava)
    open_all(eng, photos)
    gens = [eng.start(sid, q, SamplingParams(max_new_tokens=30), remember=False) for sid, _ph, _h, q, _p in CASES]
    eng.step(gens)  # prefill each; every row has a first token
    singles = []
    for g in gens:
        cache = copy.deepcopy(g.session.kv_cache)
        singles.append(llava.decode(cache, g.events[-1].id))
    batch = eng.batch
    logits = batch.forward(gens, rebuild=True)
    worst = max(float((logits[g.row] - single).abs().max()) for g, single in zip(gens, singles, strict=True))
    assert worst <= LOGIT_TOLERANCE
    lengths = {len(g.prompt_ids) for g in gens}
    assert len(lengths) >= 3  # really different context lengths, so really padded
    for g in gens:
        g.close()
    assert batch.rows == []


@pytest.mark.parametrize("kept", [0, 1])
def test_an_abandoned_row_leaves_its_session_as_before(llava, photos, kept):
    eng = make_engine(llava)
    open_all(eng, photos)
    before = {sid: list(eng.store.get(sid).cached_ids) for sid, *_ in CASES[:2]}
    gens = [eng.start(sid, q, SamplingParams(max_new_tokens=30)) for sid, _ph, _h, q, _p in CASES[:2]]
    for _ in range(4):
        eng.step([g for g in gens if not g.done])
    gens[kept].close()  # its client went away mid-answer
    other = gens[1 - kept]
    while not other.done:
        eng.step([other])
    gone = CASES[kept][0]
    s = eng.store.get(gone)
    assert not s.busy and s.cached_ids == before[gone] and cache_len(s.kv_cache) == len(before[gone])
    assert torch.equal(torch.tensor(s.cached_ids), torch.tensor(before[gone]))


@pytest.mark.parametrize("layout", ["eager", "static"])
def test_token_budget_chunks_prefills_while_running_answers_decode_every_step(llava, photos, layout):
    """An open (vision tower, then the prefix in chunks) and a restored session's re-prefill share
    steps with running answers, their first chunk fused into the decode step's pass (over the rows'
    pages, or beside the static step): every step still decodes each running answer, and every answer
    equals the one computed without a budget."""
    expected = alone(llava, photos)
    eng = make_engine(llava, **LAYOUTS[layout])
    open_all(eng, photos)
    eng.store.demote("b", Tier.FEATURES)  # restores from the features tier: a ~600-token re-prefill
    ga = eng.start("a", CASES[0][3], CASES[0][4], remember=False)
    eng.step([ga])  # prefilled: it decodes from now on
    opening = eng.begin_open("new", photos["rocket"])
    gb = eng.start("b", CASES[1][3], CASES[1][4], remember=False)
    steps_with_both = 0
    while not (opening.done and gb.done and ga.done):
        before = len(ga.events)
        eng.step([ga, opening, gb], prefill_budget=40)
        if not ga.done and not (opening.done and gb.prefilled):
            assert len(ga.events) == before + 1  # the running answer moved this step
            steps_with_both += 1
    assert steps_with_both >= 10  # the open and the re-prefill took many budget-limited steps
    assert eng.runner.num_fused_passes >= 10  # their chunks rode the decode steps
    assert opening.error is None and opening.result.prefix_tokens == len(opening.prefix)
    assert [t.id for t in ga.answer.tokens] == [t.id for t in expected["a"]]
    assert [t.id for t in gb.answer.tokens] == [t.id for t in expected["b"]]
    assert gb.answer.restored_from == "features" and gb.answer.timings["prefill"] > 0
    # the session opened in chunks answers exactly like one opened whole
    whole = make_engine(llava)
    whole.open("new", photos["rocket"])
    q, p = "What is it?", SamplingParams(max_new_tokens=10)
    assert [t.id for t in eng.generate("new", q, p).tokens] == [t.id for t in whole.generate("new", q, p).tokens]


def test_a_later_piece_runs_its_vision_tower_alone_in_the_time_its_step_has_left(
    llava, photos, small_photos, monkeypatch
):
    """Scheduler rule 8: when the time a step has left holds a waiting open's vision tower but not a
    prefill pass after it, the tower runs alone in that step and the open's first chunk rides the next
    decode pass; the running answer moves every step, and the answers and the session opened so equal
    those computed without a budget. The passes' costs are fixed here so the plan's shape is known."""
    from llava_sessions.engine.costs import StepCost
    from llava_sessions.engine.scheduler import TimeBudget

    expected = alone(llava, photos)
    eng = make_engine(llava)
    open_all(eng, photos)
    ga = eng.start("a", CASES[0][3], CASES[0][4], remember=False)
    eng.step([ga])  # prefilled alone: it decodes from the next step on
    gb = eng.start("b", CASES[1][3], CASES[1][4], remember=False)
    opening = eng.begin_open("new", small_photos["rocket"])  # an image no session holds
    cost = StepCost(prefill_fixed_ms=20.0, prefill_token_ms=1.0, decode_ms=30.0, vision_ms=50.0, decode_alone_ms=30.0)
    monkeypatch.setattr(eng.runner.costs, "estimate", lambda: cost)
    question = gb.view().num_prefill_tokens  # its chunk rides the decode pass: 1 ms a token
    budget = TimeBudget(step_ms=30.0 + question + 60.0, max_pass_tokens=4096, image_step_ratio=None)
    encoded = []
    real = eng.runner.encode
    monkeypatch.setattr(eng.runner, "encode", lambda s, images: encoded.append(s.session_id) or real(s, images))
    fused = eng.runner.num_fused_passes
    eng.step([ga, gb, opening], prefill_budget=budget)  # 60 ms left: the tower (50), no 16-token pass (86)
    assert encoded == ["new"] and cache_len(eng.store.get("new").kv_cache) == 0
    assert gb.prefilled and eng.runner.num_fused_passes == fused + 1
    before = len(ga.events)
    eng.step([ga, gb, opening], prefill_budget=budget)  # the open's first chunk rides the decode pass whole
    assert len(ga.events) == before + 1 and eng.runner.num_fused_passes == fused + 2
    assert cache_len(eng.store.get("new").kv_cache) == budget.step_ms - cost.decode_ms
    while not (ga.done and gb.done and opening.done):
        eng.step([w for w in (ga, gb, opening) if not w.done], prefill_budget=budget)
    assert encoded == ["new"] and opening.error is None
    assert [t.id for t in ga.answer.tokens] == [t.id for t in expected["a"]]
    assert [t.id for t in gb.answer.tokens] == [t.id for t in expected["b"]]
    whole = make_engine(llava)
    whole.open("new", small_photos["rocket"])
    q, p = "What is it?", SamplingParams(max_new_tokens=10)
    assert [t.id for t in eng.generate("new", q, p).tokens] == [t.id for t in whole.generate("new", q, p).tokens]


def test_prefills_over_cached_positions_in_the_lower_right_causal_form_answer_exactly(llava, photos, monkeypatch):
    """On CUDA a prefill over cached positions (a follow-up, an open's later chunks, a fused pass's
    chunk) attends with ``causal_lower_right`` so SDPA's flash kernel applies. Forced here on the CPU
    (where PyTorch materializes that mask): every answer equals the default path's, and the
    lower-right form really ran, alone and inside fused passes."""
    expected = alone(llava, photos)
    assert not llava.lower_right_prefill  # off on the CPU: nothing to gain there
    biased = {"alone": 0, "fused": 0}

    def spy(module, query, key, value, attention_mask, **kwargs):
        biased["alone"] += 1 < query.shape[2] < key.shape[2]
        return lower_right_attention(module, query, key, value, attention_mask, **kwargs)

    def fused_spy(module, query, key, value, attention_mask, **kwargs):
        biased["fused"] += isinstance(
            key.cache.chunk_mask(query.shape[2] - key.cache.num_rows, query.device), CausalBias
        )
        return fused_attention(module, query, key, value, attention_mask, **kwargs)

    monkeypatch.setattr(llava, "lower_right_prefill", True)
    AttentionInterface.register(LOWER_RIGHT_ATTENTION, spy)
    AttentionInterface.register(FUSED_ATTENTION, fused_spy)
    try:
        assert [[t.id for t in a] for a in alone(llava, photos).values()] == [
            [t.id for t in a] for a in expected.values()
        ]
        eng = make_engine(llava)
        open_all(eng, photos)
        ga = eng.start("a", CASES[0][3], CASES[0][4], remember=False)
        eng.step([ga])  # prefilled: it decodes from now on, and b's question rides its steps in chunks
        gb = eng.start("b", CASES[1][3], CASES[1][4], remember=False)
        while not (ga.done and gb.done):
            eng.step([g for g in (ga, gb) if not g.done], prefill_budget=8)
    finally:
        AttentionInterface.register(LOWER_RIGHT_ATTENTION, lower_right_attention)
        AttentionInterface.register(FUSED_ATTENTION, fused_attention)
    assert [t.id for t in ga.answer.tokens] == [t.id for t in expected["a"]]
    assert [t.id for t in gb.answer.tokens] == [t.id for t in expected["b"]]
    assert biased["alone"] > 0 and biased["fused"] > 0


def test_an_open_abandoned_midway_leaves_no_session(llava, photos):
    eng = make_engine(llava)
    task = eng.begin_open("half", photos["coffee"])
    eng.step([task], prefill_budget=32)
    eng.step([task], prefill_budget=32)
    assert not task.done and "half" in eng.store and eng.store.get("half").busy
    task.close()
    assert "half" not in eng.store and eng.store.device_bytes() == 0


def test_a_fused_pass_that_fails_midway_runs_its_parts_apart_and_loses_nothing(llava, photos):
    """The decode step and a prefill chunk share one forward pass (rule 9 of the scheduler). When that
    pass fails after some layers wrote their keys (here: the last layer raises, once per pass, twice),
    the batch's column and the session's cache are put back, each part runs alone, and every answer
    still equals the one computed alone."""
    expected = alone(llava, photos)
    eng = make_engine(llava)
    open_all(eng, photos)
    eng.store.demote("b", Tier.FEATURES)
    ga = eng.start("a", CASES[0][3], CASES[0][4], remember=False)
    eng.step([ga])
    gb = eng.start("b", CASES[1][3], CASES[1][4], remember=False)
    failures = {"left": 2, "seen": 0}

    def fail_fused_pass(module, args):
        if llava.config.text_config._attn_implementation == FUSED_ATTENTION:
            failures["seen"] += 1
            if failures["left"] > 0:
                failures["left"] -= 1
                raise RuntimeError("a fault in the fused pass")

    hook = llava.model.model.language_model.layers[-1].register_forward_pre_hook(fail_fused_pass)
    try:
        while not (ga.done and gb.done):
            eng.step([w for w in (ga, gb) if not w.done], prefill_budget=64)
    finally:
        hook.remove()
    assert failures == {"left": 0, "seen": failures["seen"]} and failures["seen"] >= 3
    assert ga.error is None and gb.error is None
    assert [t.id for t in ga.answer.tokens] == [t.id for t in expected["a"]]
    assert [t.id for t in gb.answer.tokens] == [t.id for t in expected["b"]]
    s = eng.store.get("b")
    assert not s.busy and cache_len(s.kv_cache) == len(s.cached_ids)


def test_a_riding_piece_that_cannot_start_fails_alone_and_the_decode_step_still_runs(llava, photos):
    """The first chunk of a step rides the decode step's pass only once it has started; when its start
    fails (here: no device memory for the answer, the store's overloaded), it fails alone and the
    running answer decodes its token in that step, exactly as without it."""
    expected = alone(llava, photos)
    eng = make_engine(llava)
    open_all(eng, photos)
    ga = eng.start("a", CASES[0][3], CASES[0][4], remember=False)
    eng.step([ga])
    gb = eng.start("b", CASES[1][3], CASES[1][4], remember=False)

    def no_room(gen: Sequence) -> None:
        raise overloaded("not enough device memory for this answer now; retry later", "step_memory")

    eng._execute.inputs.start_sequence = no_room  # type: ignore[method-assign]
    before = len(ga.events)
    eng.step([ga, gb])
    del eng._execute.inputs.start_sequence
    assert gb.done and gb.error is not None and gb.error.code is ErrorCode.OVERLOADED
    assert len(ga.events) == before + 1 and eng.runner.num_fused_passes == 0  # the decode step ran alone
    assert not eng.store.get("b").busy
    while not ga.done:
        eng.step([ga])
    assert [t.id for t in ga.answer.tokens] == [t.id for t in expected["a"]]


def test_a_sliding_window_is_found_in_each_config_kind_and_caps_the_context():
    """The window some layer attends within (Mistral's ``sliding_window``, Qwen2's when
    ``use_sliding_window``), or None when every layer attends to the whole context; the context served
    is capped at it (docs/decisions/74-a-sliding-window-caps-the-context.md)."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    assert attention_window(LlamaConfig()) is None and attention_window(Qwen2Config()) is None
    assert attention_window(MistralConfig(sliding_window=None)) is None
    assert attention_window(MistralConfig()) == 4096  # Mistral-7B-v0.1's window, the config's default
    windowed = Qwen2Config(use_sliding_window=True, sliding_window=256, max_window_layers=1, num_hidden_layers=4)
    assert attention_window(windowed) == 256
    assert context_limit(MistralConfig(max_position_embeddings=32768)) == 4096
    assert context_limit(MistralConfig(sliding_window=None, max_position_embeddings=32768)) == 32768
    assert context_limit(MistralConfig(max_position_embeddings=2048)) == 2048


def test_a_decode_step_out_of_memory_midway_is_undone_and_retried_exactly(llava, photos):
    """A decode step whose pass runs out of device memory after some layers wrote their column (the
    CUDA allocator's error, raised here by the last layer once) leaves no column behind: the retry
    writes the same column, and the answers equal the ones computed alone."""
    expected = alone(llava, photos)
    eng = make_engine(llava)
    open_all(eng, photos)
    gens = [eng.start(sid, q, p, remember=False) for sid, _ph, _h, q, p in CASES[:2]]
    eng.step(gens)  # both prefilled: they decode together from now on
    fired = {"left": 1}

    def out_of_memory(module, args):
        if args[0].shape[1] == 1 and fired["left"] > 0:  # a decode step's pass, once
            fired["left"] -= 1
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    hook = llava.model.model.language_model.layers[-1].register_forward_pre_hook(out_of_memory)
    try:
        while not all(g.done for g in gens):
            eng.step([g for g in gens if not g.done])
    finally:
        hook.remove()
    assert fired["left"] == 0
    for g, (sid, *_rest) in zip(gens, CASES[:2], strict=True):
        assert g.error is None, g.error
        assert [t.id for t in g.answer.tokens] == [t.id for t in expected[sid]]


def test_a_cuda_runner_takes_cudnn_out_of_sdpa_and_a_cpu_one_changes_nothing():
    """cuDNN's SDPA plans each new shape (1.8-2.1 ms of host time a layer per decode step on an H200,
    benchmarks/profile_step.py): on a CUDA device it is turned off and no other backend changes; on a
    CPU nothing changes."""
    cuda = torch.backends.cuda
    others = (cuda.flash_sdp_enabled, cuda.mem_efficient_sdp_enabled, cuda.math_sdp_enabled)
    before, cudnn = [flag() for flag in others], cuda.cudnn_sdp_enabled()
    try:
        cuda.enable_cudnn_sdp(True)
        prefer_sdpa_backends(torch.device("cpu"))
        assert cuda.cudnn_sdp_enabled()
        prefer_sdpa_backends(torch.device("cuda"))
        assert not cuda.cudnn_sdp_enabled() and [flag() for flag in others] == before
    finally:
        cuda.enable_cudnn_sdp(cudnn)


def test_questions_arriving_together_prefill_as_rows_of_shared_static_steps_and_answer_as_alone(llava, photos):
    """On the static step (a GPU's replayed graphs; eager here), questions of several sessions that
    arrive while an answer decodes prefill as rows of shared steps: the first beside the decode rows
    (instead of the eager fused pass), the others together in one more step, where each used to be a
    pass of its own. Every answer equals the one computed alone; a shared pass that fails (once, here)
    runs its chunks again each alone and loses nothing."""
    expected = alone(llava, photos)
    eng = make_engine(llava, **LAYOUTS["static"])
    open_all(eng, photos)
    graphs = eng.runner.graphs
    assert graphs is not None
    ga = eng.start("a", CASES[0][3], CASES[0][4], remember=False)
    eng.step([ga])
    eng.step([ga])  # decoding
    later = [eng.start(sid, q, p, remember=False) for sid, _ph, _h, q, p in CASES[1:4]]
    passes, prefills, eager_fused = graphs.steps.num_eager, graphs.num_prefills, []
    fused_step = llava.fused_step
    llava.fused_step = lambda *a, **k: eager_fused.append(1) or fused_step(*a, **k)
    try:
        eng.step([ga, *later])
    finally:
        del llava.fused_step
    assert all(g.prefilled for g in later) and eng.runner.num_fused_passes == 1 and not eager_fused
    assert (
        graphs.num_prefills - prefills == 3 and graphs.steps.num_eager - passes == 2
    )  # three chunks, two static steps
    run_with_chunks, failed = graphs.run_with_chunks, []

    def fail_once(tables, tokens, chunks):
        if len(chunks) > 1 and not failed:
            failed.append(len(chunks))
            raise RuntimeError("a fault in the shared pass")
        return run_with_chunks(tables, tokens, chunks)

    work = [ga, *later]
    while not all(g.done for g in work):
        eng.step([g for g in work if not g.done])
    graphs.run_with_chunks = fail_once  # type: ignore[method-assign]
    again = [eng.start(CASES[i][0], CASES[i][3], CASES[i][4], remember=False) for i in (1, 3, 4)]
    while not all(g.done for g in again):  # nothing decodes: the three chunks share one pass, which fails
        eng.step([g for g in again if not g.done])
    assert failed == [3]  # and each ran alone
    for sid, gen in zip("abcdbde", [*work, *again], strict=True):
        assert gen.error is None and [t.id for t in gen.answer.tokens] == [t.id for t in expected[sid]], sid
    for sid in "abcde":
        s = eng.store.get(sid)
        assert not s.busy and cache_len(s.kv_cache) == len(s.cached_ids)
