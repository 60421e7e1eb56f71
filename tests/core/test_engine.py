"""Session engine: exactness against ``model.generate`` from scratch, tiers, budget, TTL, limits.

fp32 on CPU, the ``tiny`` checkpoint, real photographs from ``skimage.data``.
"""

from __future__ import annotations

import pytest

import engine_fixtures
from engine_fixtures import decode, reference
from llava_sessions.conversation import Chat
from llava_sessions.engine import EngineLimits, SessionEngine
from llava_sessions.errors import ErrorCode, ServiceError
from llava_sessions.sampling.sampler import SamplingParams
from llava_sessions.sessions.store import SessionStore, Tier

N = 12  # max_new_tokens in exactness tests
GREEDY = SamplingParams(max_new_tokens=N)


class Clock:
    """A settable clock (epoch seconds) for TTL tests."""

    def __init__(self, t: float = 1_700_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def make_engine(llava, **store_kw) -> SessionEngine:
    return engine_fixtures.make_engine(llava, limits=EngineLimits(max_new_tokens_cap=4096), store_kw=store_kw)


def ids(answer) -> list[int]:
    return [t.id for t in answer.tokens]


def tensor_bytes(session) -> int:
    """Device bytes of a session counted straight from its tensors: its features, and its KV cache's
    pages in the pool (each page's keys and values in every layer)."""
    total = (
        0 if session.image_features is None else session.image_features.numel() * session.image_features.element_size()
    )
    cache = session.kv_cache
    if cache is not None:
        pages = cache.pool.pages
        for keys, values in zip(pages.keys, pages.values, strict=True):
            for page in cache.table.pages:
                total += keys[page].numel() * keys.element_size() + values[page].numel() * values.element_size()
    return total


def test_first_question_history_and_independent_question_match_generate(llava, photos):
    eng = make_engine(llava)
    img = photos["astronaut"]
    opened = eng.open("s1", img)
    assert opened.image_tokens == 576
    q1, q2, q3, q4 = "What is in this image?", "What color is it?", "Is there a dog?", "Describe the image in detail."

    a1 = eng.generate("s1", q1, GREEDY)
    assert ids(a1) == reference(llava, img, [], q1)
    assert a1.cached_tokens == opened.prefix_tokens and a1.prompt_tokens > a1.cached_tokens

    a2 = eng.generate("s1", q2, GREEDY)
    assert ids(a2) == reference(llava, img, [(q1, a1.text)], q2)
    assert a2.cached_tokens >= a1.prompt_tokens  # the first turn came from the cache

    a3 = eng.generate("s1", q3, GREEDY, remember=False)
    assert ids(a3) == reference(llava, img, [(q1, a1.text), (q2, a2.text)], q3)
    session = eng.store.get("s1")
    assert [t.prompt for t in session.history] == [q1, q2]
    kept = len(session.cached_ids)  # cropped back to the (re-tokenized) history, the question dropped
    assert session.cached_ids == llava.template.prefix_ids(session.chat())[:kept] and kept >= a3.cached_tokens
    session.check_invariants()

    a4 = eng.generate("s1", q4, GREEDY)  # the independent question left no trace
    assert ids(a4) == reference(llava, img, [(q1, a1.text), (q2, a2.text)], q4)
    assert a4.cached_tokens == kept


def test_system_prompt_is_templated_first(llava, photos):
    eng = make_engine(llava)
    system = "A chat between a curious human and an artificial intelligence assistant."
    eng.open("s", photos["coffee"], system_prompt=system)
    q = "What is in this image?"
    a = eng.generate("s", q, GREEDY)
    assert ids(a) == reference(llava, photos["coffee"], [], q, system_prompt=system)


@pytest.mark.parametrize("tier", [Tier.FEATURES, Tier.IMAGE])
def test_demoted_session_answers_as_if_never_demoted(llava, photos, tier):
    eng = make_engine(llava)
    img = photos["chelsea"]
    eng.open("s", img)
    q1, q2 = "What is in this image?", "What color is the cat?"
    a1 = eng.generate("s", q1, GREEDY)
    session = eng.store.get("s")
    eng.store.demote("s", tier)
    assert session.tier is tier
    a2 = eng.generate("s", q2, GREEDY)
    assert a2.restored_from == tier.value and a2.cached_tokens == 0
    assert ids(a2) == reference(llava, img, [(q1, a1.text)], q2)
    assert session.tier is Tier.KV and session.num_restores == 1


def test_interleaved_sessions_get_their_own_images_answers(llava, photos):
    eng = make_engine(llava)
    eng.open("a", photos["astronaut"])
    eng.open("b", photos["rocket"])
    q = "What is in this image?"
    ga, gb = eng.start("a", q, GREEDY), eng.start("b", q, GREEDY)
    while not (ga.done and gb.done):
        for g in (ga, gb):
            next(g, None)
    assert ids(ga.answer) == reference(llava, photos["astronaut"], [], q)
    assert ids(gb.answer) == reference(llava, photos["rocket"], [], q)
    assert ids(ga.answer) != ids(gb.answer)  # the images matter, so a leak would show


def test_budget_demotes_oldest_loses_none_and_accounts_real_bytes(llava, photos):
    probe = make_engine(llava)
    probe.open("p", photos["astronaut"])
    one_session = probe.store.device_bytes()
    # room for about two sessions with a short answer each
    eng = make_engine(llava, device_budget_bytes=int(2.3 * one_session))
    names = ["astronaut", "chelsea", "coffee", "rocket"]
    q = "What is in this image?"
    answers = {}
    for n in names:
        eng.open(n, photos[n])
        answers[n] = eng.generate(n, q, SamplingParams(max_new_tokens=4))
        sessions = eng.store.sessions()
        assert eng.store.device_bytes() == sum(tensor_bytes(s) for s in sessions)
        assert eng.store.device_bytes() <= eng.store.device_budget_bytes
    tiers = {s.session_id: s.tier for s in eng.store.sessions()}
    assert tiers["astronaut"] is not Tier.KV and tiers["rocket"] is Tier.KV  # LRU demoted first
    assert eng.store.stats.num_demotions_kv >= 2 and len(eng.store) == 4  # none lost
    by_tier = eng.store.bytes_by_tier()
    assert by_tier["kv"] + by_tier["features"] == eng.store.device_bytes()
    assert by_tier["image"] == sum(len(photos[n]) + len((q + answers[n].text).encode()) for n in names)
    for n in names:  # every session still answers exactly
        a = eng.generate(n, "What color is it?", GREEDY)
        assert ids(a) == reference(llava, photos[n], [(q, answers[n].text)], "What color is it?")


def test_ttl_and_idle_expiry(llava, photos):
    clock = Clock()
    eng = make_engine(llava, ttl_s=100, idle_timeout_s=30, clock=clock)
    opened = eng.open("s", photos["coffee"])
    assert opened.expires_at == int(clock.t) + 100
    clock.t += 29
    eng.generate("s", "Hello?", SamplingParams(max_new_tokens=2))  # activity keeps it alive
    clock.t += 29
    eng.generate("s", "Hello?", SamplingParams(max_new_tokens=2))
    clock.t += 30  # idle for the idle timeout
    with pytest.raises(ServiceError) as e:
        eng.generate("s", "Hello?", GREEDY)
    assert e.value.code is ErrorCode.SESSION_EXPIRED and e.value.status == 404
    assert len(eng.store) == 0 and eng.store.device_bytes() == 0

    t_open = eng.open("t", photos["coffee"])
    for _ in range(10):  # active every 20 s, never idle, but the absolute TTL still ends it
        clock.t += 20
        try:
            eng.generate("t", "Hi", SamplingParams(max_new_tokens=1))
        except ServiceError as err:
            assert err.code is ErrorCode.SESSION_EXPIRED
            assert clock.t >= t_open.expires_at > clock.t - 20
            break
    else:
        pytest.fail("absolute TTL did not expire the session")
    with pytest.raises(ServiceError) as e:
        eng.close("t")
    assert e.value.code is ErrorCode.SESSION_EXPIRED


def test_context_overflow_fails_and_leaves_session_intact(llava, photos):
    eng = make_engine(llava)
    img = photos["rocket"]
    eng.open("s", img)
    q1 = "What is in this image?"
    a1 = eng.generate("s", q1, GREEDY)
    snapshot = (list(eng.store.get("s").cached_ids), list(eng.store.get("s").history))
    with pytest.raises(ServiceError) as e:
        eng.generate("s", "Tell me more.", SamplingParams(max_new_tokens=llava.max_positions))
    assert e.value.code is ErrorCode.CONTEXT_LENGTH_EXCEEDED and e.value.status == 422
    assert str(llava.max_positions) in e.value.message and "prompt tokens" in e.value.message
    assert (eng.store.get("s").cached_ids, eng.store.get("s").history) == snapshot
    a2 = eng.generate("s", "Tell me more.", GREEDY)
    assert ids(a2) == reference(llava, img, [(q1, a1.text)], "Tell me more.")


def test_host_cap_evicts_lru_and_says_so(llava, photos):
    img = photos["chelsea"]
    cap = 2 * len(img) + 1000  # two sessions fit, three do not
    eng = make_engine(llava, host_budget_bytes=cap)
    eng.open("old", img)
    eng.open("mid", img)
    eng.generate("mid", "Hi", SamplingParams(max_new_tokens=2))
    eng.open("new", img)  # past the host cap: the LRU session goes, with a tombstone
    with pytest.raises(ServiceError) as e:
        eng.generate("old", "Hi", GREEDY)
    assert e.value.code is ErrorCode.SESSION_EVICTED and e.value.status == 404
    assert eng.store.host_bytes() <= cap and eng.store.stats.num_evicted == 1
    eng.generate("mid", "Hi", SamplingParams(max_new_tokens=2))  # the others are untouched


def test_streamed_text_joins_to_answer_and_details(llava, photos):
    eng = make_engine(llava)
    eng.open("s", photos["astronaut"])
    gen = eng.start("s", "Describe the image in detail.", SamplingParams(max_new_tokens=40, logprobs=True))
    pieces = [ev.text for ev in gen]
    a = gen.answer
    assert "".join(pieces) == a.text == llava.tokenizer.decode(ids(a), skip_special_tokens=True)
    assert a.generated_tokens == len(pieces) and a.finish_reason in ("stop", "length")
    assert all(t.logprob is not None and t.logprob <= 0 for t in a.tokens)
    assert a.timings["ttft"] <= a.timings["total"] and a.timings["prefill"] > 0


def test_finish_reasons_stop_sequences_and_seeded_sampling(llava, photos):
    eng = make_engine(llava)
    eng.open("s", photos["coffee"])
    q = "What is in this image?"
    a = eng.generate("s", q, SamplingParams(max_new_tokens=5), remember=False)
    assert a.finish_reason == "length" and a.generated_tokens == 5
    full = eng.generate("s", q, SamplingParams(max_new_tokens=30), remember=False)
    # a stop sequence taken from the greedy answer's own text ends it right there
    stop = full.text[len(full.text) // 2 :][:2] if len(full.text) > 4 else None
    if stop and stop.strip():
        s = eng.generate("s", q, SamplingParams(max_new_tokens=30, stop=(stop,)), remember=False)
        assert s.finish_reason == "stop" and stop in s.text and len(s.text) <= len(full.text)
        assert s.text.index(stop) + len(stop) > len(s.text) - max(len(t.text) for t in s.tokens) - len(stop)
    p = SamplingParams(max_new_tokens=10, temperature=0.8, top_p=0.9, top_k=50, seed=7)
    s1 = eng.generate("s", q, p, remember=False)
    s2 = eng.generate("s", q, p, remember=False)
    assert ids(s1) == ids(s2) and s1.seed == 7
    pen = eng.generate("s", q, SamplingParams(max_new_tokens=10, repetition_penalty=1.3), remember=False)
    assert pen.generated_tokens >= 1
    with pytest.raises(ServiceError) as e:
        SamplingParams(top_p=0)
    assert e.value.code is ErrorCode.INVALID_PARAMETER


def test_reset_close_busy_and_bad_prompts(llava, photos):
    eng = make_engine(llava)
    img = photos["chelsea"]
    eng.open("s", img)
    q = "What is in this image?"
    eng.generate("s", q, GREEDY)
    eng.reset("s")
    assert eng.history("s") == []
    a = eng.generate("s", q, GREEDY)
    assert ids(a) == reference(llava, img, [], q)

    gen = eng.start("s", "And now?", GREEDY)
    next(gen)
    with pytest.raises(ServiceError) as e:
        eng.start("s", "Another", GREEDY)
    assert e.value.code is ErrorCode.SESSION_BUSY
    cached = list(eng.store.get("s").cached_ids)
    gen.close()  # abandoned: the session is as before the question
    s = eng.store.get("s")
    assert s.cached_ids == cached[: len(s.cached_ids)] and len(s.history) == 1 and not s.busy
    assert ids(eng.generate("s", "And now?", GREEDY)) == reference(llava, img, [(q, a.text)], "And now?")

    for bad in ("", "   ", "look at <image> this"):
        with pytest.raises(ServiceError) as e:
            eng.start("s", bad, GREEDY)
        assert e.value.code is ErrorCode.INVALID_PARAMETER
    eng.close("s")
    with pytest.raises(ServiceError) as e:
        eng.generate("s", q, GREEDY)
    assert e.value.code is ErrorCode.SESSION_NOT_FOUND
    with pytest.raises(ServiceError) as e:
        eng.open("x", b"not an image")
    assert e.value.code is ErrorCode.IMAGE_INVALID and len(eng.store) == 0


def test_a_prompt_over_max_prompt_tokens_is_refused_and_short_ones_skip_the_count(llava, photos):
    """The limit counts the prompt's own tokens; a prompt of fewer UTF-8 bytes than the cap cannot be
    over it (a token covers at least one byte, plus at most one leading-space piece)."""
    eng = SessionEngine(
        llava,
        SessionStore(device_budget_bytes=10**10, host_budget_bytes=10**9, kv_bytes_per_token=llava.kv_bytes_per_token),
        decode,
        EngineLimits(max_prompt_tokens=12),
        check_invariants=True,
    )
    eng.open("s", photos["coffee"])
    eng.generate("s", "é" * 5, SamplingParams(max_new_tokens=1))  # 10 bytes + 1 <= 12: not counted
    long = "word " * 12
    assert llava.template.count_text_tokens(long) > 12
    with pytest.raises(ServiceError) as e:
        eng.start("s", long, GREEDY)
    assert e.value.code is ErrorCode.INVALID_PARAMETER and "at most 12" in e.value.message
    for text in ("Hi?", "é" * 7, "日本語のテキスト", "🙂 ok", " x", "\n\n", "a  b"):
        assert llava.template.count_text_tokens(text) <= len(text.encode("utf-8")) + 1, text


def test_open_refused_when_full_or_no_room(llava, photos):
    eng = make_engine(llava, max_sessions=1)
    eng.open("a", photos["coffee"])
    with pytest.raises(ServiceError) as e:
        eng.open("b", photos["coffee"])
    assert e.value.code is ErrorCode.OVERLOADED and e.value.retry_after_s
    tiny = make_engine(llava, device_budget_bytes=1000)
    with pytest.raises(ServiceError) as e:
        tiny.open("a", photos["coffee"])
    assert e.value.code is ErrorCode.OVERLOADED and len(tiny.store) == 0


def test_open_with_history_restores_the_conversation_exactly(llava, photos):
    from llava_sessions.conversation import Turn

    eng = make_engine(llava)
    img = photos["chelsea"]
    eng.open("orig", img)
    q1, q2, q3 = "What is in this image?", "What color is it?", "Where is it?"
    a1 = eng.generate("orig", q1, SamplingParams(max_new_tokens=8, temperature=0.9, seed=3))  # sampled
    a2 = eng.generate("orig", q2, GREEDY)
    history = [Turn(q1, a1.text), Turn(q2, a2.text)]
    restored = eng.open("copy", img, history=history)
    assert restored.prefix_tokens == len(llava.template.prefix_ids(eng.store.get("copy").chat()))
    assert [(t.prompt, t.answer) for t in eng.history("copy")] == [(t.prompt, t.answer) for t in history]
    a3 = eng.generate("copy", q3, GREEDY)
    assert ids(a3) == reference(llava, img, [(q1, a1.text), (q2, a2.text)], q3)
    assert a3.cached_tokens == restored.prefix_tokens  # only the new question was prefilled
    assert ids(a3) == ids(eng.generate("orig", q3, GREEDY))  # same as the never-lost session
    with pytest.raises(ServiceError) as e:
        eng.open("bad", img, history=[Turn("look <image>", "x")])
    assert e.value.code is ErrorCode.INVALID_PARAMETER and "bad" not in eng.store
    with pytest.raises(ServiceError) as e:
        eng.open("long", img, history=[Turn("word " * 300, "answer " * 300)])
    assert e.value.code is ErrorCode.CONTEXT_LENGTH_EXCEEDED and "long" not in eng.store


# --- context policy ---------------------------------------------------------------------------


def test_truncate_drops_the_oldest_turns_and_answers_exactly(llava, photos):
    """A turn that does not fit: the oldest remembered turns leave the context; the answer equals
    a from-scratch greedy generate on the truncated conversation, and the history follows it. (With
    no headroom: each truncation drops just the turns it needs.)"""
    limits = EngineLimits(max_new_tokens_cap=4096, truncation_headroom=0.0)
    eng = engine_fixtures.make_engine(llava, limits=limits)
    eng.open("s", photos["coffee"])
    questions = ["What is in this image?", "Describe the colours.", "What is on the left?", "And on the right?"]
    for q in questions:
        eng.generate("s", q, SamplingParams(max_new_tokens=40))
    history = [(t.prompt, t.answer) for t in eng.history("s")]
    q = "Summarise what we said."
    full = len(llava.template.conversation_ids(eng.store.get("s").chat(), q))
    room = llava.max_positions - full  # a max_new_tokens one token over the room left forces a drop
    params = SamplingParams(max_new_tokens=room + 1)
    with pytest.raises(ServiceError) as e:
        eng.start("s", q, params, context_policy="error")
    assert e.value.code is ErrorCode.CONTEXT_LENGTH_EXCEEDED and len(eng.history("s")) == 4  # nothing changed
    before = eng.store.get("s").cached_ids[:]
    answer = eng.generate("s", q, params, context_policy="truncate")
    assert answer.truncated_turns == 1 and answer.max_new_tokens == room + 1
    kept = history[1:]
    assert ids(answer) == reference(llava, photos["coffee"], kept, q, max_new_tokens=room + 1)
    assert [(t.prompt, t.answer) for t in eng.history("s")] == kept + [(q, answer.text)]
    # the KV cache was reused up to the first dropped turn: the image prefix, not more
    prefix = llava.template.prefix_ids(Chat(None, image_tokens=(576,)))
    assert answer.cached_tokens == len(prefix) and before[: len(prefix)] == prefix
    # the next question (the context is full again: one more turn leaves) continues exactly
    nxt = eng.generate("s", "Anything else?", GREEDY)
    after = (kept + [(q, answer.text)])[nxt.truncated_turns :]
    assert nxt.truncated_turns == 1 and ids(nxt) == reference(llava, photos["coffee"], after, "Anything else?")
    # with room left, a question reuses the whole cached conversation
    short = eng.generate("s", "Why?", SamplingParams(max_new_tokens=2), remember=False)
    assert short.truncated_turns == 0 and short.cached_tokens > len(prefix)


def test_a_truncation_leaves_headroom_so_the_next_turns_reuse_the_kv_cache(llava, photos):
    """Issue 60 item 4: a truncation drops enough oldest turns to leave ``truncation_headroom`` (a
    quarter) of the context free, so the turns after it append to the cached conversation instead of
    each dropping one turn and prefilling all that follows the image again. Over 10 turns at the limit
    at least 80% of the prompt tokens come from the cache (62% with no headroom), and every answer
    equals a from-scratch generate on what the model saw."""
    eng = make_engine(llava)  # the default limits: a headroom of 0.25
    eng.open("s", photos["coffee"])
    questions = ["What is in this image?", "Describe the colours.", "What is on the left?", "And on the right?"]
    limit, shares = llava.max_positions, []
    for i in range(40):
        q, before = questions[i % 4], [(t.prompt, t.answer) for t in eng.history("s")]
        answer = eng.generate("s", q, SamplingParams(max_new_tokens=40))
        if answer.truncated_turns or shares:
            shares.append(answer.cached_tokens / answer.prompt_tokens)
        if answer.truncated_turns:
            assert answer.prompt_tokens + 40 <= limit - limit // 4 < answer.prompt_tokens + 40 + 250
            kept = before[answer.truncated_turns :]
            assert ids(answer) == reference(llava, photos["coffee"], kept, q, max_new_tokens=40)
        elif len(shares) == 2:  # a turn after a truncation: the whole conversation was cached
            assert ids(answer) == reference(llava, photos["coffee"], before, q, max_new_tokens=40)
        if len(shares) == 10:
            break
    assert len(shares) == 10 and sum(shares) / 10 >= 0.8, shares


def test_truncate_clips_an_unset_max_new_tokens_only_when_no_turn_is_left(llava, photos):
    eng = make_engine(llava)
    eng.open("s", photos["rocket"])
    eng.generate("s", "What is in this image?", SamplingParams(max_new_tokens=20))
    q = "Tell me more."
    alone = len(llava.template.conversation_ids(Chat(None, image_tokens=(576,)), q))
    too_many = llava.max_positions - alone + 50  # does not fit even with every turn dropped
    # under context_policy error an unset max_new_tokens is not clipped: the turn is refused, whole
    with pytest.raises(ServiceError) as e:
        eng.start("s", q, SamplingParams(max_new_tokens=too_many), context_policy="error", clip_max_new_tokens=True)
    assert e.value.code is ErrorCode.CONTEXT_LENGTH_EXCEEDED and len(eng.history("s")) == 1
    clipped = eng.generate("s", q, SamplingParams(max_new_tokens=too_many), clip_max_new_tokens=True)
    assert clipped.truncated_turns == 1 and clipped.max_new_tokens == llava.max_positions - alone
    assert eng.history("s")[0].prompt == q
    with pytest.raises(ServiceError) as e:  # the same limit set by the request: the image and question cannot fit
        eng.start("s", q, SamplingParams(max_new_tokens=too_many))
    assert e.value.code is ErrorCode.CONTEXT_LENGTH_EXCEEDED and "shorten the question" in e.value.message


def test_an_abandoned_truncating_answer_changes_no_history(llava, photos):
    eng = make_engine(llava)
    eng.open("s", photos["chelsea"])
    for q in ("What is in this image?", "What colour is it?"):
        eng.generate("s", q, SamplingParams(max_new_tokens=30))
    q = "Once more?"
    room = llava.max_positions - len(llava.template.conversation_ids(eng.store.get("s").chat(), q))
    gen = eng.start("s", q, SamplingParams(max_new_tokens=room + 1))
    assert gen.truncated_turns == 1
    next(gen)
    gen.close()  # the client went away
    assert [t.prompt for t in eng.history("s")] == ["What is in this image?", "What colour is it?"]
    again = eng.generate("s", "What colour is it?", GREEDY, remember=False)
    assert again.truncated_turns == 0


def test_a_prompt_over_max_prompt_tokens_names_the_setting(llava, photos):
    """Issue 45 item 5: a message over the limit is refused naming the setting that limits it, so an
    operator knows what to raise (it said only "at most 2048 are allowed")."""
    eng = SessionEngine(
        llava,
        SessionStore(kv_bytes_per_token=llava.kv_bytes_per_token, device_budget_bytes=10**10, host_budget_bytes=10**9),
        decode,
        EngineLimits(max_new_tokens_cap=4096, max_prompt_tokens=16),
    )
    eng.open("s", photos["coffee"])
    with pytest.raises(ServiceError) as e:
        eng.start("s", "Describe every object in this image, one by one, with its colour and its place.")
    assert e.value.code is ErrorCode.INVALID_PARAMETER and e.value.message.startswith("prompt is ")
    assert "at most 16 are allowed (the server's max_prompt_tokens setting)" in e.value.message
