"""Parallel samples (``n``): one prompt prefilled once, each answer equal to the same request alone.

fp32 on CPU, the ``tiny`` checkpoint, in every decode layout. Answer ``i`` of a request seeded ``s``
is the answer of the request alone with seed ``s + i``; greedy answers are all the same; only the
``session_choice`` answer joins the session's history; the other answers' sessions go with them.
"""

from __future__ import annotations

import dataclasses

import pytest

from engine_fixtures import LAYOUTS, make_engine
from llava_sessions.conversation import Turn
from llava_sessions.engine import Sequence, SessionEngine
from llava_sessions.errors import ErrorCode, ServiceError
from llava_sessions.sampling.sampler import SamplingParams

Q = "What is in this image?"
#: Low enough that the logits decide the draws (a fork's wrong logits change its tokens and their
#: logprobs), high enough that differently seeded answers differ on the random checkpoint.
TEMPERATURE = 2.0
EXTRA_CONTIGUOUS = 2500


def run(eng: SessionEngine, gen: Sequence) -> list[list[int]]:
    """Step ``gen``'s request to its end; each answer's token ids, by index."""
    while not gen.all_done:
        eng.step([gen])
    assert gen.error is None, gen.error
    return [[t.id for t in s.answer.tokens] for s in gen.samples]


def only_sessions(eng: SessionEngine) -> list[str]:
    return sorted(s.session_id for s in eng.store.sessions())


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_seeded_samples_each_equal_the_request_alone_and_the_chosen_one_is_remembered(llava, photos, layout):
    eng, alone = make_engine(llava, **LAYOUTS[layout]), make_engine(llava)
    for e in (eng, alone):
        e.open("s", photos["astronaut"], history=[Turn("Hi", "Hello.")])
    params = SamplingParams(max_new_tokens=12, temperature=TEMPERATURE, seed=7, n=4, session_choice=2, logprobs=True)
    gen = eng.start("s", Q, params)
    assert [g.index for g in gen.samples] == [0, 1, 2, 3] and gen.samples[2] is gen
    tokens = run(eng, gen)
    alone_params = [dataclasses.replace(params, seed=7 + i, n=1, session_choice=0) for i in range(4)]
    answers = [alone.generate("s", Q, p, remember=False) for p in alone_params]
    assert tokens == [[t.id for t in a.tokens] for a in answers]
    # each fork's first token is drawn from the head's logits: its logprob is that of the answer alone
    for sample, answer in zip(gen.samples, answers, strict=True):
        assert [t.logprob for t in sample.answer.tokens] == pytest.approx([t.logprob for t in answer.tokens], abs=1e-3)
    assert len({tuple(t) for t in tokens}) > 1, "differently seeded samples differ"
    assert [s.answer.seed for s in gen.samples] == [7, 8, 9, 10]
    assert eng.history("s")[-1].answer == gen.samples[2].answer.text
    assert only_sessions(eng) == ["s"]
    # the next question reuses the chosen answer's KV and answers as it would alone
    follow = eng.generate("s", "And then?", SamplingParams(max_new_tokens=6))
    alone.generate("s", Q, alone_params[2])
    assert [t.id for t in follow.tokens] == [
        t.id for t in alone.generate("s", "And then?", SamplingParams(max_new_tokens=6)).tokens
    ]
    assert follow.cached_tokens > 0


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_greedy_samples_are_the_same_answer(llava, photos, layout):
    eng = make_engine(llava, **LAYOUTS[layout])
    eng.open("s", photos["coffee"])
    tokens = run(eng, eng.start("s", Q, SamplingParams(max_new_tokens=10, n=3), remember=False))
    assert (
        tokens[0]
        == tokens[1]
        == tokens[2]
        == [t.id for t in eng.generate("s", Q, SamplingParams(max_new_tokens=10)).tokens]
    )


@pytest.mark.parametrize(("steps", "layout"), [(0, "eager"), (1, "eager"), (3, "eager"), (4, "ahead")])
def test_an_abandoned_request_of_several_answers_leaves_the_session_as_before(llava, photos, steps, layout):
    """Closed before its prefill, at its fork, or while its answers decode (``ahead``: with a step in
    flight): the other answers' sessions go, the session is idle with its history and KV as before, and
    the next question answers exactly."""
    eng = make_engine(llava, **LAYOUTS[layout])
    eng.open("s", photos["rocket"])
    before = list(eng.store.get("s").cached_ids)
    gen = eng.start("s", Q, SamplingParams(max_new_tokens=20, temperature=50.0, seed=3, n=3))
    for _ in range(steps):
        eng.step([gen])
    assert only_sessions(eng) == ["s", "s/sample-1", "s/sample-2"]
    in_flight = eng._execute.ahead is not None and eng._execute.ahead.flight is not None
    assert in_flight == (layout == "ahead")
    gen.close()
    assert gen.all_done and only_sessions(eng) == ["s"] and not eng.store.get("s").busy
    assert eng.store.get("s").cached_ids == before and eng.history("s") == []
    assert eng.generate("s", Q, SamplingParams(max_new_tokens=5)).generated_tokens == 5


def test_one_answer_that_fails_fails_the_request_and_the_session_is_as_before(llava, photos):
    eng = make_engine(llava)
    eng.open("s", photos["chelsea"])
    gen = eng.start("s", Q, SamplingParams(max_new_tokens=20, ignore_eos=True, n=3))
    eng.step([gen])
    assert all(len(s.events) == 1 for s in gen.samples)

    def broken(logits):
        raise RuntimeError("a sampler failed")

    gen.samples[1].sampler.next_token = broken  # a row sampled alone
    gen.samples[1].sampler.took = broken  # a plain greedy row, its token from the batch's argmax
    eng.step([gen])
    assert gen.all_done and isinstance(gen.error, RuntimeError)
    assert only_sessions(eng) == ["s"] and not eng.store.get("s").busy and eng.history("s") == []


def test_admission_books_every_answer_and_refuses_a_request_whose_answers_cannot_all_start(llava, photos):
    probe = make_engine(llava)
    probe.open("s", photos["astronaut"])
    held = probe.store.device_bytes()
    one = probe.start("s", Q, SamplingParams(max_new_tokens=40), remember=False)
    four = SamplingParams(max_new_tokens=40, n=4)
    one.close()
    gen = probe.start("s", Q, four, remember=False)
    gen.close()
    assert gen.start_bytes >= 4 * one.start_bytes  # each other answer books its KV and features whole
    eng = make_engine(llava, held + 3 * one.start_bytes)
    eng.open("s", photos["astronaut"])
    gen = eng.start("s", Q, four, remember=False)
    eng.step([gen])
    assert gen.all_done and isinstance(gen.error, ServiceError) and gen.error.code is ErrorCode.OVERLOADED
    assert only_sessions(eng) == ["s"] and eng.generate("s", Q, SamplingParams(max_new_tokens=40)).generated_tokens


def test_answers_of_a_request_that_outgrow_memory_are_preempted_and_resume_exactly(llava, photos):
    """An older answer and a newer request of three whose starts fit but whose growth together does
    not: the newest answers (the request's, forked from its prompt) are preempted, recompute their KV
    from their own sessions' features when they resume, and every answer ends as it does alone."""
    params = SamplingParams(max_new_tokens=60, ignore_eos=True, temperature=50.0, seed=3)
    probe = make_engine(llava)
    probe.open("a", photos["astronaut"])
    probe.open("b", photos["coffee"])
    held = probe.store.device_bytes()
    older = probe.generate("a", Q, SamplingParams(max_new_tokens=60, ignore_eos=True), remember=False)
    alone = [[t.id for t in probe.generate("b", Q, params.for_sample(i), remember=False).tokens] for i in range(3)]
    grant = probe.start("b", Q, dataclasses.replace(params, n=3), remember=False)
    grant.close()
    eng = make_engine(llava, held + grant.start_bytes + 40 * llava.kv_bytes_per_token)  # 40 tokens to spare
    eng.open("a", photos["astronaut"])
    eng.open("b", photos["coffee"])
    first = eng.start("a", Q, SamplingParams(max_new_tokens=60, ignore_eos=True), remember=False)
    eng.step([first])
    gen = eng.start("b", Q, dataclasses.replace(params, n=3), remember=False)
    while not (first.done and gen.all_done):
        eng.step([first, gen])
    assert first.error is None and gen.error is None, (first.error, gen.error)
    assert [t.id for t in first.answer.tokens] == [t.id for t in older.tokens]
    assert [[t.id for t in s.answer.tokens] for s in gen.samples] == alone
    assert sum(s.num_preemptions for s in gen.samples) >= 1 and first.num_preemptions == 0
    assert only_sessions(eng) == ["a", "b"]


def head_ends_first(eng: SessionEngine, seed: int) -> Sequence | None:
    """Start a request of three answers that end on any of the first quarter of the vocabulary (so
    at random, seeded) and step it until its head's answer ends; the request if the others still
    run then, else None (its answers closed)."""
    stops = tuple(range(eng.model.tokenizer.vocab_size // 4))
    params = SamplingParams(max_new_tokens=20, temperature=50.0, seed=seed, n=3, stop_token_ids=stops)
    gen = eng.start("s", Q, params)
    while not gen.done:
        eng.step([gen])
    if gen.all_done:
        return None
    return gen


@pytest.mark.parametrize("abandon", [False, True])
def test_a_head_that_ends_first_keeps_its_turn_only_when_every_answer_has_ended(llava, photos, abandon):
    """The answers of a request succeed or fail together: the head's answer ending first leaves its
    session busy, its turn not yet kept; the turn joins the history when the last answer ends, and a
    request closed before that leaves the session as before (a CI run once lost that to a seed)."""
    eng = make_engine(llava)
    eng.open("s", photos["rocket"])
    before = list(eng.store.get("s").cached_ids)
    for seed in range(40):
        gen = head_ends_first(eng, seed)
        if gen is not None:
            break
        eng.close("s")
        eng.open("s", photos["rocket"])
    else:
        pytest.fail("no seed of 40 ended the head first")
    assert eng.store.get("s").busy and eng.history("s") == [] and gen.answer is not None
    if abandon:
        gen.close()
        assert gen.all_done and only_sessions(eng) == ["s"] and not eng.store.get("s").busy
        assert eng.store.get("s").cached_ids == before and eng.history("s") == []
    else:
        run(eng, gen)
        assert only_sessions(eng) == ["s"] and not eng.store.get("s").busy
        assert eng.history("s") == [Turn(Q, gen.answer.text, eng.history("s")[0].images)]
    assert eng.generate("s", "And then?", SamplingParams(max_new_tokens=4)).generated_tokens == 4
