"""Async scheduling (engine/ahead.py): the next decode step launched before the host records this one's.

fp32 on the CPU, the ``tiny`` checkpoint, the paged layout's static step (what a GPU replays as CUDA
graphs; eager here). On a CPU the device runs each pass before the call returns, so nothing overlaps;
what these tests show is that the engine's state and answers are those of the engine in step with the
host, token for token and position for position, through ends, joins, abandons and failures, and
the greedy answers (with a follow-up on the sessions they leave) those of ``model.generate``.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

from engine_fixtures import LAYOUTS, make_engine, reference
from llava_sessions.config import Settings
from llava_sessions.engine import Sequence, SessionEngine
from llava_sessions.model import cache_len
from llava_sessions.sampling.sampler import SamplingParams
from llava_sessions.service import BatchRequest, SessionService

AHEAD = {**LAYOUTS["static"], "async_scheduling": True}

# (session, image, question, sampling parameters)
CASES = [
    ("a", "astronaut", "What is in this image?", SamplingParams(max_new_tokens=14)),
    ("b", "coffee", "Describe the saucer.", SamplingParams(max_new_tokens=9, logprobs=True)),
    ("c", "rocket", "What is it?", SamplingParams(max_new_tokens=20, temperature=0.8, seed=11)),
    ("d", "chelsea", "Tell me a story about it.", SamplingParams(max_new_tokens=6, top_k=20, top_p=0.9, seed=5)),
    ("e", "coffee", "And in the background?", SamplingParams(max_new_tokens=11, min_tokens=4, seed=3)),
    ("f", "astronaut", "What colour is the suit?", SamplingParams(max_new_tokens=12, logprobs=True, top_logprobs=2)),
]


def opened(llava, photos, cases=CASES, **engine_kw) -> SessionEngine:
    eng = make_engine(llava, **engine_kw)
    for sid, photo, _q, _p in cases:
        eng.open(sid, photos[photo])
    return eng


def run(
    eng: SessionEngine, cases, *, join_at: dict[str, int] | None = None, started: dict[str, Sequence] | None = None
) -> dict[str, Sequence]:
    """Start ``cases`` (those in ``join_at`` at that step; none already in ``started``, which the answers
    are added to) and step them together to the end."""
    join_at = join_at or {}
    gens: dict[str, Sequence] = {} if started is None else started
    first = max((join_at.get(sid, 0) for sid in gens), default=0) if gens else 0
    for step in range(first, 200):
        for sid, _ph, q, p in cases:
            if sid not in gens and join_at.get(sid, 0) == step:
                gens[sid] = eng.start(sid, q, p, remember=True)
        running = [g for g in gens.values() if not g.done]
        if not running and len(gens) == len(cases):
            break
        eng.step(running)
    return gens


def state(eng: SessionEngine, cases=CASES) -> dict[str, tuple[list[int], int, int]]:
    """Each session's cached ids, its cache's length and its remembered turns."""
    out = {}
    for sid, *_ in cases:
        s = eng.store.get(sid)
        assert not s.busy and cache_len(s.kv_cache) == len(s.cached_ids)
        out[sid] = (list(s.cached_ids), cache_len(s.kv_cache), len(s.history))
    return out


def same_answers(got: dict[str, Sequence], want: dict[str, Sequence]) -> None:
    assert got.keys() == want.keys()
    for sid, g in got.items():
        w = want[sid]
        assert g.error is None and g.answer is not None and w.answer is not None, sid
        assert [t.id for t in g.answer.tokens] == [t.id for t in w.answer.tokens], sid
        assert g.answer.text == w.answer.text and g.answer.finish_reason == w.answer.finish_reason, sid
        for x, y in zip(g.answer.tokens, w.answer.tokens, strict=True):  # batches of other shapes: other roundings
            assert (x.logprob is None) == (y.logprob is None) and abs((x.logprob or 0) - (y.logprob or 0)) < 1e-4, sid


@pytest.fixture(scope="module")
def cases(llava, photos):
    """:data:`CASES` and one that ends on a stop token (its own 5th greedy token) while the step after
    it may already be launched: its session must give that step's position back."""
    probe = opened(llava, photos, CASES[:1], **LAYOUTS["static"])
    sid, photo, q, _ = CASES[0]
    tokens = probe.generate(sid, q, SamplingParams(max_new_tokens=14), remember=False).tokens
    return [*CASES, ("g", photo, q, SamplingParams(max_new_tokens=14, stop_token_ids=[tokens[4].id]))]


@pytest.fixture(scope="module")
def in_step(llava, photos, cases):
    """The answers and the sessions after them, on the static step in step with the host."""
    eng = opened(llava, photos, cases, **LAYOUTS["static"])
    gens = run(eng, cases, join_at={"c": 3, "f": 5})
    assert eng._execute.ahead is None and gens["g"].answer.finish_reason == "stop"
    return gens, state(eng, cases)


def test_answers_launched_ahead_are_the_answers_in_step_and_leave_the_same_sessions(llava, photos, cases, in_step):
    """Greedy rows (one with its tokens' logprobs, chosen with them on the device) and seeded rows
    (top-k, top-p, a ``min_tokens`` mask), a row with top logprobs (chosen on the host: it keeps the
    whole batch in step while it runs), rows ending by ``max_new_tokens`` at
    different steps and two joining mid-way: every answer and every session's cache (ids, length,
    remembered turn) equals the engine's in step; most steps went ahead; nothing is left in flight."""
    want, want_state = in_step
    eng = opened(llava, photos, cases, **AHEAD)
    ahead = eng._execute.ahead
    assert ahead is not None
    got = run(eng, cases, join_at={"c": 3, "f": 5})
    same_answers(got, want)
    assert state(eng, cases) == want_state
    assert ahead.flight is None and ahead.num_steps >= 5
    eng.runner.check_pool(s.kv_cache for s in eng.store.sessions())
    # and against code neither engine shares: model.generate from scratch, the greedy answers and a
    # follow-up on the sessions they leave (a position left in a session's KV shows here)
    for sid, photo, q, p in cases:
        if p.temperature is None and p.top_k is None and not p.min_tokens and not p.stop_token_ids:
            tokens = [t.id for t in got[sid].answer.tokens]
            assert tokens == reference(llava, photos[photo], [], q, max_new_tokens=p.max_new_tokens), sid
            follow = eng.generate(sid, "And then?", SamplingParams(max_new_tokens=5), remember=False)
            turns = [(q, got[sid].answer.text)]
            assert [t.id for t in follow.tokens] == reference(
                llava, photos[photo], turns, "And then?", max_new_tokens=5
            )


def test_an_answer_that_stops_early_takes_its_launched_position_back(llava, photos):
    """An answer whose token in flight is a stop token (here, its own 4th greedy token, given as a
    ``stop_token_ids``) ends there while the step after it is already computed: that step's position
    leaves its session, which then holds what the engine in step leaves, and the others answer on."""
    probe = opened(llava, photos, **LAYOUTS["static"])
    tokens = probe.generate("a", "What is in this image?", SamplingParams(max_new_tokens=14), remember=False).tokens
    stop = tokens[3].id
    cases = [("a", "astronaut", "What is in this image?", SamplingParams(max_new_tokens=14, stop_token_ids=[stop]))]
    cases += [c for c in CASES if c[0] in "bd"]
    runs = {}
    for name, kw in (("in_step", LAYOUTS["static"]), ("ahead", AHEAD)):
        eng = opened(llava, photos, **kw)
        runs[name] = (run(eng, cases), eng)
    (want, in_step), (got, ahead) = runs["in_step"], runs["ahead"]
    same_answers(got, want)
    assert got["a"].answer.finish_reason == "stop" and len(got["a"].answer.tokens) <= 4
    assert state(ahead) == state(in_step) and ahead._execute.ahead.num_steps >= 3


def test_an_answer_closed_while_its_token_is_in_flight_leaves_its_session_as_before(llava, photos):
    """A client leaves while a step is in flight: the tokens in flight are recorded first, then the
    answer is put back (its session as before the question); the other answer goes on ahead, exactly."""
    want = run(opened(llava, photos, **LAYOUTS["static"]), [CASES[1]])
    eng = opened(llava, photos, **AHEAD)
    before = list(eng.store.get("a").cached_ids)
    ga = eng.start("a", CASES[0][2], CASES[0][3], remember=True)
    gb = eng.start("b", CASES[1][2], CASES[1][3], remember=True)
    for _ in range(4):
        eng.step([ga, gb])
    ahead = eng._execute.ahead
    assert ahead.flight is not None and ahead.num_steps >= 1
    ga.close()
    assert ahead.flight is None and ga.done and ga.answer is None
    assert eng.store.get("a").cached_ids == before and not eng.store.get("a").busy
    while not gb.done:
        eng.step([gb])
    same_answers({"b": gb}, want)
    assert ahead.num_steps >= 4


@pytest.mark.parametrize(
    ("where", "fault"),
    [("launch", RuntimeError), ("choice", RuntimeError), ("launch", KeyboardInterrupt)],
    ids=["launch-fails", "choice-fails", "interrupted"],
)
def test_a_launch_that_fails_fails_no_answer(llava, photos, cases, in_step, monkeypatch, where, fault):
    """A step launched ahead whose pass raises, or whose tokens cannot be chosen (once each, here), is
    taken back whole: the answers go on in step with the host, then ahead again, and equal the
    engine's in step. An interrupt (KeyboardInterrupt) leaves the engine's step; the tokens in flight
    stay, the next step records them, and the answers are still those in step."""
    import llava_sessions.engine.ahead as ahead_module

    want, want_state = in_step
    eng = opened(llava, photos, cases, **AHEAD)
    graphs = eng.runner.graphs
    real_run, real_choices, failed = graphs.run, ahead_module.plain_choices, []

    def fail_once(calls_so_far: int) -> None:
        if not failed and calls_so_far >= 3:
            failed.append(where)
            raise fault("a fault in the step launched ahead")

    def faulty_run(tables, tokens):
        if where == "launch" and isinstance(tokens, torch.Tensor):
            fail_once(3)
        return real_run(tables, tokens)

    choices: list[int] = []

    def plain_choices(seqs, logits):
        if where == "choice" and sys._getframe(1).f_code.co_name == "_launch":  # a launched step's tokens
            choices.append(1)
            fail_once(len(choices) + 2)
        return real_choices(seqs, logits)

    graphs.run = faulty_run  # type: ignore[method-assign]
    monkeypatch.setattr(ahead_module, "plain_choices", plain_choices)
    interrupted, started = [], {}  # the answers, kept across an interrupt
    try:
        got = run(eng, cases, join_at={"c": 3, "f": 5}, started=started)
    except KeyboardInterrupt:
        interrupted.append(1)
        assert eng._execute.ahead.flight is not None  # the tokens in flight stay for the next step
        got = run(eng, cases, join_at={"c": 3, "f": 5}, started=started)
    assert failed == [where] and bool(interrupted) == (fault is KeyboardInterrupt)
    same_answers(got, want)
    assert state(eng, cases) == want_state


def test_seeded_samples_of_one_request_launched_ahead_equal_them_in_step(llava, photos):
    """``n`` = 3 seeded answers of one question decode as three rows ahead, each the answer in step."""
    params = SamplingParams(max_new_tokens=10, temperature=0.9, seed=7, n=3)
    answers = {}
    for name, kw in (("in_step", LAYOUTS["static"]), ("ahead", AHEAD)):
        eng = opened(llava, photos, **kw)
        seq = eng.start("a", "What is in this image?", params, remember=False)
        while not seq.all_done:
            eng.step([seq])
        answers[name] = [[t.id for t in s.answer.tokens] for s in seq.samples]
        if name == "ahead":
            assert eng._execute.ahead.num_steps >= 5 and eng._execute.ahead.flight is None
    assert answers["ahead"] == answers["in_step"] and len({tuple(a) for a in answers["ahead"]}) > 1


def test_a_service_streams_the_same_answers_and_frees_a_request_its_client_left(llava, photos):
    """Through the worker's service (TorchServe's batches of continuation rows, two tokens a call, and
    run-ahead between calls): a native stream, a chat stream and a plain answer equal the in-step
    service's, token for token; a stream whose client leaves while a step is in flight (the next batch
    lacks it) is freed at once, its session idle and as before the question."""
    settings = Settings(step_max_tokens=2, step_max_ms=600_000, max_concurrent_generations=4)
    ask = {"type": "generate", "prompt": "What is in this image?", "remember": False}
    chat = {"messages": [{"role": "user", "content": "Describe it."}], "stream": True, "max_tokens": 11, "seed": 5}

    def serve(engine_kw: dict) -> tuple[dict[str, list[bytes]], SessionService, list[int]]:
        svc = SessionService(settings, make_engine(llava, **engine_kw))
        for sid, photo in (("s1", "chelsea"), ("s2", "coffee"), ("s3", "rocket")):
            svc.engine.open(sid, photos[photo])
        before = list(svc.engine.store.get("s3").cached_ids)
        rows = [
            BatchRequest("n", "s1", False, {**ask, "stream": True, "parameters": {"max_new_tokens": 9}}),
            BatchRequest("p", "s2", False, {**ask, "parameters": {"max_new_tokens": 7}}),
            BatchRequest("c", "ts-seq-c", True, chat),
            BatchRequest("gone", "s3", False, {**ask, "stream": True, "parameters": {"max_new_tokens": 30}}),
        ]
        bodies: dict[str, list[bytes]] = {r.request_id: [] for r in rows}
        for call in range(40):
            out = svc.handle(rows)
            for row, reply in zip(rows, out, strict=True):
                bodies[row.request_id].append(reply.body)
            rows = [
                BatchRequest(r.request_id, r.session_id, r.minted, None)
                for r, reply in zip(rows, out, strict=True)
                if reply.stop is False and not (r.request_id == "gone" and call == 2)  # its client left
            ]
            while svc.run_ahead():
                pass
            if not rows:
                break
        return bodies, svc, before

    want, _, _ = serve(LAYOUTS["static"])
    got, svc, before = serve(AHEAD)
    ahead = svc.engine._execute.ahead
    assert ahead is not None and ahead.num_steps >= 5 and ahead.flight is None
    assert native_tokens(got["n"]) == native_tokens(want["n"]) and len(native_tokens(got["n"])) == 9
    assert json.loads(got["p"][-1])["generated_text"] == json.loads(want["p"][-1])["generated_text"]
    assert chat_text(got["c"]) == chat_text(want["c"]) and chat_text(got["c"])
    assert not svc.requests.in_flight
    svc.engine.check_idle("s3")
    assert svc.engine.store.get("s3").cached_ids == before


def native_tokens(frames: list[bytes]) -> list[int]:
    """The token ids of a native stream's JSON lines."""
    return [json.loads(line)["token"]["id"] for f in frames for line in f.splitlines()]


def chat_text(frames: list[bytes]) -> str:
    """The content of a chat stream's server-sent events."""
    out = []
    for line in b"".join(frames).splitlines():
        if line.startswith(b"data: {"):
            choices = json.loads(line[len(b"data: ") :])["choices"]
            out += [c["delta"].get("content") or "" for c in choices]
    return "".join(out)
