"""The session service's scheduler and per-row isolation, driven directly (no TorchServe)."""

from __future__ import annotations

import base64
import dataclasses
import json
import time

import pytest

from llava_sessions.config import Settings
from llava_sessions.engine import CostModel, StepCost
from llava_sessions.service import BatchRequest, SessionService
from llava_sessions.sessions.ledger import Tier
from llava_sessions.wire.contract import SEQUENCE_END_HEADER, SLOT_WAIT_HEADER
from llava_sessions.worker import WorkerOrigin, build_service
from server_fixtures import ImageHost


def tiny_service(model_dir, **settings) -> SessionService:
    """A service on the tiny model, CPU, a 1 GB device budget, and ``settings`` over that."""
    return build_service({"model_dir": str(model_dir), "device": "cpu", "device_budget_bytes": 10**9, **settings})


@pytest.fixture(scope="module")
def service(tiny_model_dir) -> SessionService:
    """Two tokens per call (``step_max_tokens``), the call's time budget (``step_max_ms``) out of
    reach: its tests count frames of token slices, which a slow step under CPU load cut short."""
    return tiny_service(tiny_model_dir, step_max_tokens=2, max_concurrent_generations=2, step_max_ms=600_000)


def open_row(rid, sid, image):
    return BatchRequest(rid, sid, True, {"type": "open_session", "image": {"base64": base64.b64encode(image).decode()}})


def finish(service, rows, out):
    """Drive the rows that asked to continue (stop False) to their last frame; returns the last frames."""
    last = dict(zip([r.request_id for r in rows], out, strict=True))
    pending = [
        BatchRequest(r.request_id, r.session_id, False, None) for r, o in zip(rows, out, strict=True) if o.stop is False
    ]
    while pending:
        more = service.handle(pending)
        for r, o in zip(pending, more, strict=True):
            last[r.request_id] = o
        pending = [r for r, o in zip(pending, more, strict=True) if o.stop is False]
    return last


def open_sessions(service, *rows):
    """Open sessions (an open spans scheduler steps: the vision tower, then the prefix in chunks)."""
    out = service.handle(list(rows))
    assert all(o.status == 200 for o in out), [o.body for o in out]
    return [finish(service, list(rows), out)[r.request_id] for r in rows]


def test_a_cpu_worker_reserves_its_memory_at_start_within_its_budget(tiny_model_dir, caplog) -> None:
    """``cpu_memory_reserve_bytes`` reaches the worker: a CPU replica reserves it, capped by its device
    budget, and says so in its ready line, beside the seconds its weights and its engine took; 0
    reserves nothing. (The suite's environment sets 0 for the
    TorchServe workers it starts; explicit settings win over it here.)"""
    import logging

    def reserved(**settings) -> int:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="llava_sessions"):
            build_service({"model_dir": str(tiny_model_dir), "device": "cpu", **settings}, WorkerOrigin(env={}))
        (ready,) = [r for r in caplog.records if r.getMessage().startswith("llava-sessions ready: weights loaded in")]
        assert ready.weights_s > 0 and ready.engine_s >= 0  # the start's two parts, in seconds (a CPU engine: ms)
        return ready.cpu_memory_reserved_bytes

    from llava_sessions.engine import available_host_bytes

    got = reserved(device_budget_bytes=256 << 20, cpu_memory_reserve_bytes=2 << 30)
    assert got == 256 << 20 or (got <= available_host_bytes() // 4 and available_host_bytes() < 1 << 30)
    assert reserved(device_budget_bytes=10**9, cpu_memory_reserve_bytes=0) == 0


def test_batch_rows_are_answered_independently(service, photos):
    rows = [
        open_row("r1", "ts-seq-a", photos["astronaut"]),
        BatchRequest("r2", "ts-seq-b", True, b"{not json"),
        BatchRequest("r3", "ghost", False, {"type": "generate", "prompt": "hi"}),
        BatchRequest("r4", "ts-seq-c", True, {"type": "generate", "prompt": "hi"}),
        BatchRequest("r5", "ts-seq-d", True, {"type": "open_session", "image": {"base64": "AAAA"}}),
    ]
    out = service.handle(rows)
    assert [r.status for r in out] == [200, 400, 404, 400, 400]
    assert out[0].headers["X-Amzn-SageMaker-New-Session-Id"].startswith("ts-seq-a; Expires=")
    assert [json.loads(r.body)["error"]["code"] for r in out[1:]] == [
        "invalid_request",
        "session_not_found",
        "missing_session_id",
        "image_invalid",
    ]
    # rows that leave no session behind end their TorchServe job group; the open one does not.
    # Only the client's own id that is gone reads as a closed session: the minted groups were none.
    assert "X-Amzn-SageMaker-Closed-Session-Id" not in out[0].headers and SEQUENCE_END_HEADER not in out[0].headers
    assert [r.headers.get(SEQUENCE_END_HEADER) for r in out[1:]] == ["ts-seq-b", "ghost", "ts-seq-c", "ts-seq-d"]
    assert [r.headers.get("X-Amzn-SageMaker-Closed-Session-Id") for r in out[1:]] == [None, "ghost", None, None]
    assert all(r.stop is None for r in out[1:])  # whole responses
    # nothing else decodes: the open's vision tower and whole prefix ran in this call, in one pass
    assert out[0].stop is None and json.loads(out[0].body)["session_id"] == "ts-seq-a"
    service.handle([BatchRequest("r6", "ts-seq-a", False, {"type": "close_session"})])


def test_stream_and_plain_answers_advance_in_slices(service, photos):
    open_sessions(service, open_row("o1", "s1", photos["chelsea"]), open_row("o2", "s2", photos["coffee"]))
    q = {"type": "generate", "prompt": "What is in this image?", "remember": False, "parameters": {"max_new_tokens": 7}}
    rows = [BatchRequest("g1", "s1", False, {**q, "stream": True}), BatchRequest("g2", "s2", False, q)]
    frames: dict[str, list] = {"g1": [], "g2": []}
    for _ in range(20):
        out = service.handle(rows)
        for row, res in zip(rows, out, strict=True):
            frames[row.request_id].append(res)
        rows = [
            BatchRequest(r.request_id, r.session_id, False, None)
            for r, res in zip(rows, out, strict=True)
            if res.stop is False
        ]
        if not rows:
            break
    s, p = frames["g1"], frames["g2"]
    assert [f.stop for f in s] == [False, False, False, True]  # 7 tokens, 2 per call
    assert all(f.content_type == "application/jsonlines" for f in s)
    lines = [json.loads(line) for f in s for line in f.body.splitlines()]
    assert "".join(x["token"]["text"] for x in lines) == lines[-1]["generated_text"]  # every line has a token
    assert len(lines) == 7 and all(x["generated_text"] is None for x in lines[:-1])
    assert [f.body for f in p[:-1]] == [b"", b"", b""] and p[-1].stop is True  # empty frames never reach the client
    assert json.loads(p[-1].body)["details"]["generated_tokens"] == 7
    one = service.handle([BatchRequest("g0", "s1", False, {**q, "stream": True, "parameters": {"max_new_tokens": 1}})])[
        0
    ]
    assert one.stop is None and one.body.count(b"\n") == 1  # ends in its first frame: one whole response
    assert json.loads(one.body)["token"]["text"] == json.loads(one.body)["generated_text"]
    over = service.handle(
        [BatchRequest("g3", "s1", False, q), BatchRequest("g4", "s2", False, q), BatchRequest("g5", "s1", False, q)]
    )
    assert over[2].status == 409  # s1 is busy with g3 (in the same batch)
    # a NEW request for s2 while g4 is absent from the batch: TorchServe dropped g4 (client gone)
    again = service.handle([BatchRequest("g7", "s2", False, q)])[0]
    assert again.status == 200 and "g4" not in service.requests.in_flight
    over = service.handle([BatchRequest("g6", "missing", False, q)])
    assert over[0].status == 404
    for sid in ("s1", "s2"):
        while service.engine.store.get(sid).busy:  # let g3/g4 finish
            service.handle([BatchRequest("g3", "s1", False, None), BatchRequest("g7", "s2", False, None)])
        service.handle([BatchRequest(f"c-{sid}", sid, False, {"type": "close_session"})])


def test_a_stream_s_first_token_leaves_in_the_call_that_sampled_it(tiny_model_dir, photos):
    """Issue 60 item 0: with ``step_max_tokens`` 8, the call that samples a stream's first token ends
    there, so time to first token is not time to 8 tokens; later calls group up to 8. An answer that
    does not stream is not cut short."""
    svc = tiny_service(tiny_model_dir, step_max_tokens=8, step_max_ms=600_000)
    open_sessions(svc, open_row("o1", "s1", photos["chelsea"]))
    q = {"type": "generate", "prompt": "What is in this image?", "remember": False}
    q["parameters"] = {"max_new_tokens": 20}
    rows = [BatchRequest("g1", "s1", False, {**q, "stream": True})]
    out = svc.handle(rows)
    last = finish(svc, rows, out)
    first = [json.loads(line) for line in out[0].body.splitlines()]
    assert len(first) == 1 and first[0]["token"] is not None and out[0].stop is False
    assert len(last["g1"].body.splitlines()) in range(2, 9)  # the last call's slice: grouped again
    whole = svc.handle([BatchRequest("g2", "s1", False, q)])[0]  # not streamed: 8 tokens in the first call
    assert whole.body == b"" and len(svc.requests.in_flight["g2"].work.events) == 8
    finish(svc, [BatchRequest("g2", "s1", False, None)], [whole])
    chat = BatchRequest("c1", "ts-seq-c1", True, chat_image_body(photos["coffee"], stream=True, max_tokens=20))
    token = svc.handle([chat])[0]  # the role with the first token, in the call that admitted it
    assert token.stop is False and len(svc.requests.in_flight["c1"].work.events) == 1
    assert json.loads(token.body.decode().removeprefix("data: "))["choices"][0]["delta"]["role"] == "assistant"
    finish(svc, [BatchRequest("c1", "ts-seq-c1", True, None)], [token])


def test_every_session_s_kv_is_in_the_pool_and_a_cpu_captures_no_graphs(tiny_model_dir):
    """One engine: on a CPU, as on a GPU, the sessions' KV is in the pool's pages and the answers
    decode there; the pool grows with the sessions (a GPU's is fixed at start), and no step is held
    to static shapes (``enforce_eager`` or not)."""
    for settings in ({}, {"enforce_eager": True}):
        engine = tiny_service(tiny_model_dir, **settings).engine
        assert engine.batch.layout().page_size == 16 and not engine.runner.pool.fixed, settings
        assert engine.runner.graphs is None and engine.runner.prefill_graphs is None


def _stream_texts(svc: SessionService, bodies: list[dict]) -> list[tuple[str, str | None]]:
    """Run chat stream ``bodies`` together to their ends: each one's ``(text, finish_reason)``, or
    ``(error code, None)``."""
    rows = [BatchRequest(f"st{i}", None, True, body) for i, body in enumerate(bodies)]
    raw = {row.request_id: b"" for row in rows}
    out = svc.handle(rows)
    while True:
        for row, frame in zip(rows, out, strict=True):
            raw[row.request_id] += frame.body
        rows = [BatchRequest(r.request_id, None, True, None) for r, f in zip(rows, out, strict=True) if f.stop is False]
        if not rows:
            break
        out = svc.handle(rows)
    results = []
    for body in raw.values():
        events = [json.loads(line[6:]) for line in body.decode().splitlines() if line.startswith("data: {")]
        if "error" in events[-1]:
            results.append((events[-1]["error"]["code"], None))
            continue
        text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
        results.append((text, [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1]))
    return results


def test_streams_that_outgrow_a_tight_budget_all_finish(tmp_path, one_torch_thread):
    """Four chat streams without ``max_tokens`` on a budget of ~2.7 contexts of KV (the tiny model's
    weights with a 512-token context, so each answer is half as long as at 1,024), their KV in the
    pool's pages. The steps that cannot get the pages they open preempt the newest answers, which
    resume exactly, a sampled image placeholder id embedded as text. All four finish, each equal to its
    answer alone (before issue 60: two ended ``overloaded`` or ``internal_error``)."""
    bodies = [
        {"messages": [{"role": "user", "content": f"Tell me a long story, number {i}."}], "stream": True}
        | {"ignore_eos": True, "temperature": 0}
        for i in range(4)
    ]
    from llava_tools.tiny_model import write_checkpoint

    model_dir = write_checkpoint("tiny", tmp_path / "tiny-512", seed=0, max_positions=512)
    alone_svc = tiny_service(model_dir, share_images=False)
    alone = [_stream_texts(alone_svc, [body])[0] for body in bodies]
    budget = int(2.7 * 512 * alone_svc.engine.model.kv_bytes_per_token)
    svc = tiny_service(model_dir, device_budget_bytes=budget, share_images=False, step_max_ms=600_000)
    assert _stream_texts(svc, bodies) == alone and all(reason == "length" for _, reason in alone)
    assert svc.engine.num_preemptions >= 1


def chat_image_body(image: bytes, *, stream: bool, max_tokens: int = 4) -> dict:
    url = "data:image/png;base64," + base64.b64encode(image).decode()
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is in this image?"}]
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "stream": stream}
    return {**body, "temperature": 0}


def test_a_streamed_chat_s_first_event_is_its_first_token_with_the_role(tiny_model_dir, photos):
    """Issue 75 item 6, as vLLM streams: nothing goes out before the first token (a tool that takes the
    first chunk for the first token reads the true time), and the call that admitted the stream runs its
    steps up to that token: the first frame carries the role and the first token, with status 200 and
    the charset; a stream arriving while another runs steps at once too; a bad image still gets its 4xx."""
    svc = tiny_service(tiny_model_dir)
    prefilled = svc.engine.num_prefilled_tokens
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = {**chat_image_body(photos["coffee"], stream=True), "stream_options": options}
    first = svc.handle([BatchRequest("s1", "ts-seq-s1", True, body)])[0]
    assert first.status == 200 and first.stop is False and first.content_type == "text/event-stream; charset=utf-8"
    event = json.loads(first.body.decode().removeprefix("data: "))
    assert event["choices"][0]["delta"]["role"] == "assistant" and event["usage"]["completion_tokens"] == 1
    assert svc.engine.num_prefilled_tokens > prefilled  # the admitting call ran the prefill and the first step
    # a stream arriving while another decodes: its image may prefill over several calls (sized in time
    # beside the running answer), each sending nothing, until the call of its first token: role and token
    second = BatchRequest("s3", "ts-seq-s3", True, {**chat_image_body(photos["chelsea"], stream=True)})
    out = svc.handle([BatchRequest("s1", "ts-seq-s1", True, None), second])
    while out[1].body == b"" and out[1].stop is False:
        s1 = [BatchRequest("s1", "ts-seq-s1", True, None)] if out[0].stop is False else []
        more = svc.handle([*s1, BatchRequest("s3", "ts-seq-s3", True, None)])
        out = [more[0] if s1 else out[0], more[-1]]
    event = json.loads(out[1].body.decode().removeprefix("data: "))
    assert out[1].status == 200 and event["choices"][0]["delta"]["role"] == "assistant"
    rows = [BatchRequest("s1", "ts-seq-s1", True, None), BatchRequest("s3", "ts-seq-s3", True, None)]
    last = finish(svc, rows, out)
    assert all(frame.body.endswith(b"data: [DONE]\n\n") for frame in last.values())
    bad = svc.handle([BatchRequest("s2", "ts-seq-s2", True, chat_image_body(b"not an image", stream=True))])[0]
    assert bad.status == 400 and json.loads(bad.body)["error"]["code"] == "image_invalid"


class CountedCosts(CostModel):
    """The model runner's cost model, recording each prefill pass's length; ``pinned``: it learns nothing
    (the scheduler then sizes every step by ``prior``)."""

    def __init__(self, prior: StepCost, *, pinned: bool) -> None:
        super().__init__(prior)
        self.pinned = pinned
        self.passes: list[int] = []

    def prefill(self, num_tokens: int, ms: float) -> None:
        self.passes.append(num_tokens)
        if not self.pinned:
            super().prefill(num_tokens, ms)

    def decode(self, ms: float) -> None:
        if not self.pinned:
            super().decode(ms)

    def fused(self, num_tokens: int, ms: float) -> None:  # a chunk that rode the decode step's pass
        self.passes.append(num_tokens)
        if not self.pinned:
            super().fused(num_tokens, ms)


@pytest.mark.parametrize(("fuse", "first", "chunk"), [(True, 15, 35), (False, 10, 30)])
def test_a_lone_cold_turn_is_prefilled_in_one_pass_and_one_beside_a_stream_in_timed_chunks(
    tiny_model_dir, photos, fuse, first, chunk
):
    """Issue 33 item 1 through the service's default (adaptive) budget: with nothing decoding, the
    vision tower and the whole prompt run in the first step; while an answer decodes, a new image's
    prompt is prefilled in chunks sized by the pass costs (riding the decode step's pass, or with
    ``fuse_prefill`` off passes of their own), and its answer is the same token for token (the
    tokens and log-probabilities its ``logprobs`` list, beside the text) as the same turn prefilled
    in one pass."""
    svc = tiny_service(tiny_model_dir, step_max_tokens=1, fuse_prefill=fuse)
    learning = svc.engine.runner.costs = CountedCosts(StepCost(), pinned=False)
    body = {**chat_image_body(photos["chelsea"], stream=False, max_tokens=6), "logprobs": True}
    alone = [BatchRequest("a1", "ts-seq-a1", True, body)]
    answer_alone = json.loads(finish(svc, alone, svc.handle(alone))["a1"].body)
    prompt_tokens = answer_alone["usage"]["prompt_tokens"]
    assert learning.passes == [prompt_tokens]
    llava = [BatchRequest("b1", "ts-seq-b1", True, chat_image_body(photos["coffee"], stream=False, max_tokens=60))]
    svc.handle(llava)  # its prompt in one pass: nothing else decodes
    svc.handle([BatchRequest("b1", "ts-seq-b1", False, None)])  # it decodes now
    # 40 ms a step, 5 of them the decode step, 1 ms a token: 35 tokens a chunk riding the decode step's
    # pass, whose fixed cost is paid, or 30 in a pass of its own (5 ms fixed); the first chunk also pays
    # the vision tower's 20 ms: 15 or 10 tokens
    pinned = svc.engine.runner.costs = CountedCosts(StepCost(5.0, 1.0, 5.0, 20.0), pinned=True)
    svc.step_budget = dataclasses.replace(svc.step_budget, step_ms=40.0)
    other_salt = {**alone[0].body, "cache_salt": "elsewhere"}  # shares nothing with a1: a full prefill
    rows = [BatchRequest("b1", "ts-seq-b1", False, None), BatchRequest("a2", "ts-seq-a2", True, other_salt)]
    last = finish(svc, rows, svc.handle(rows))
    assert json.loads(last["b1"].body)["usage"]["completion_tokens"] == 60  # it decoded throughout
    assert pinned.passes[0] == first and set(pinned.passes[1:-1]) == {chunk} and sum(pinned.passes) == prompt_tokens
    assert (svc.engine.runner.num_fused_passes > 0) is fuse
    chunked = json.loads(last["a2"].body)["choices"][0]
    assert chunked["message"] == answer_alone["choices"][0]["message"]
    tokens = [(t["token"], t["bytes"]) for t in chunked["logprobs"]["content"]]
    assert tokens and tokens == [(t["token"], t["bytes"]) for t in answer_alone["choices"][0]["logprobs"]["content"]]
    assert [t["logprob"] for t in chunked["logprobs"]["content"]] == pytest.approx(
        [t["logprob"] for t in answer_alone["choices"][0]["logprobs"]["content"]], abs=1e-4
    )


def test_an_open_beside_a_stream_is_held_to_its_decode_steps_and_opens_the_same_session(tiny_model_dir, photos):
    """Issue 33's p99 goal through the service: while an answer decodes, a session opening on an image
    (no first token waits on it) prefills in chunks that keep each step within
    ``max_step_ratio_while_opening`` (5 here) decode steps alone, not ``max_step_ms_while_decoding``;
    the session it opens answers the same as one opened alone."""
    svc = tiny_service(tiny_model_dir, step_max_tokens=1, max_step_ratio_while_opening=5, share_images=False)
    learning = svc.engine.runner.costs = CountedCosts(StepCost(), pinned=False)
    open_sessions(svc, open_row("o1", "ts-seq-o1", photos["chelsea"]))
    prefix_tokens = learning.passes[0]
    assert learning.passes == [prefix_tokens]  # alone: its whole prefix in one pass
    llava = [BatchRequest("b1", "ts-seq-b1", True, chat_image_body(photos["coffee"], stream=False, max_tokens=200))]
    svc.handle(llava)
    svc.handle([BatchRequest("b1", "ts-seq-b1", False, None)])  # it decodes now
    # the step's 40 ms would give a chunk 35 tokens; an open is held to 5 x 5 ms (the decode step
    # alone): 20 tokens a chunk riding the decode step's pass, after a first step of the tower alone
    pinned = svc.engine.runner.costs = CountedCosts(StepCost(5.0, 1.0, 5.0, 20.0, decode_alone_ms=5.0), pinned=True)
    svc.step_budget = dataclasses.replace(svc.step_budget, step_ms=40.0)
    rows = [BatchRequest("b1", "ts-seq-b1", False, None), open_row("o2", "ts-seq-o2", photos["chelsea"])]
    last = finish(svc, rows, svc.handle(rows))
    assert json.loads(last["b1"].body)["usage"]["completion_tokens"] == 200  # it decoded throughout
    assert set(pinned.passes[:-1]) == {20} and sum(pinned.passes) == prefix_tokens, pinned.passes
    assert svc.engine.runner.num_fused_passes >= len(pinned.passes)
    q = {"type": "generate", "prompt": "What is in this image?", "parameters": {"max_new_tokens": 8}}
    a1, a2 = (answer_of(svc, f"q{i}", f"ts-seq-o{i}", q) for i in (1, 2))
    assert a2["generated_text"] == a1["generated_text"]


def test_jobs_run_ahead_between_calls_by_at_most_a_slice_and_answer_the_same(tiny_model_dir, photos):
    """What a replica process does while no call waits: the requests in flight go on by one step per
    run_ahead(), at most step_max_tokens (2) past the last call each; the next call emits what they
    made. Greedy answers are the same as without running ahead, streamed or not. (The calls' time
    budget, step_max_ms, is set out of reach: the frames counted are the token slices', which a
    loaded machine's slow step would otherwise cut short.)"""
    service = tiny_service(tiny_model_dir, step_max_tokens=2, max_concurrent_generations=2, step_max_ms=600_000)
    open_sessions(service, open_row("o1", "ra1", photos["chelsea"]), open_row("o2", "ra2", photos["coffee"]))
    q = {"type": "generate", "prompt": "What is in this image?", "remember": False, "parameters": {"max_new_tokens": 9}}

    def answer(ahead: bool) -> tuple[str, list[int], str]:
        rows = [
            BatchRequest(f"s{ahead}", "ra1", False, {**q, "stream": True}),
            BatchRequest(f"p{ahead}", "ra2", False, q),
        ]
        streamed, tokens_per_frame, plain, calls = [], [], "", 0
        while rows:
            out = service.handle(rows)
            calls += 1
            for row, res in zip(rows, out, strict=True):
                if row.request_id.startswith("s"):
                    lines = [json.loads(line) for line in res.body.splitlines()]
                    streamed += [x["token"]["text"] for x in lines]
                    tokens_per_frame.append(len(lines))
                elif res.stop is not False:
                    plain = json.loads(res.body)["generated_text"]
            rows = [
                BatchRequest(r.request_id, r.session_id, False, None)
                for r, res in zip(rows, out, strict=True)
                if res.stop is False
            ]
            if ahead:
                steps = 0
                while service.run_ahead():
                    steps += 1
                assert steps <= 2  # at most a slice past the call
        return "".join(streamed), tokens_per_frame, plain

    text, frames, plain = answer(ahead=False)
    assert frames == [1, 2, 2, 2, 2]  # the first token alone (test_a_stream_s_first_token_...)
    ahead_text, ahead_frames, ahead_plain = answer(ahead=True)
    assert (ahead_text, ahead_plain) == (text, plain)
    assert ahead_frames == [1, 4, 4]  # each later call emits the slice it ran plus what ran ahead
    assert not service.run_ahead() and not service.requests.in_flight  # nothing in flight: nothing to run
    for sid in ("ra1", "ra2"):
        service.handle([BatchRequest(f"c-{sid}", sid, False, {"type": "close_session"})])


def test_generation_slots_are_capped_with_retry_after(service, photos):
    for sid in ("a1", "a2", "a3"):
        open_sessions(service, open_row(f"o-{sid}", sid, photos["rocket"]))
    q = {"type": "generate", "prompt": "Describe it.", "parameters": {"max_new_tokens": 20}}
    out = service.handle(
        [BatchRequest("x1", "a1", False, q), BatchRequest("x2", "a2", False, q), BatchRequest("x3", "a3", False, q)]
    )
    assert [r.status for r in out] == [200, 200, 503]
    assert json.loads(out[2].body)["error"]["code"] == "overloaded" and out[2].headers["Retry-After"] == "1"
    assert "X-Amzn-SageMaker-Closed-Session-Id" not in out[2].headers  # the session is intact
    assert out[2].headers[SLOT_WAIT_HEADER] == "1"  # refused before anything was done: the proxy holds it
    rows = [BatchRequest("x1", "a1", False, None), BatchRequest("x2", "a2", False, None)]
    while rows:
        out = service.handle(rows)
        rows = [r for r, res in zip(rows, out, strict=True) if res.stop is False]
    for sid in ("a1", "a2", "a3"):
        service.handle([BatchRequest(f"c-{sid}", sid, False, {"type": "close_session"})])
    assert isinstance(service.settings, Settings)


def test_native_n_answers_whole_and_streamed_and_the_session_keeps_the_chosen_one(tiny_model_dir, photos):
    """``parameters.n`` in the native dialect: a whole reply's ``generated_text`` and ``details`` are
    the ``session_choice`` answer's and ``choices`` holds every answer by index (each its seed's
    answer alone); a stream's lines carry their answer's ``index`` and each answer ends with its own
    ``generated_text`` line; only the chosen answer joins the history; each answer takes a slot."""
    svc = tiny_service(tiny_model_dir, max_concurrent_generations=3)
    open_sessions(svc, open_row("o", "s", photos["rocket"]))
    params = {"max_new_tokens": 6, "temperature": 2.0, "seed": 3, "details": True}
    ask = {"type": "generate", "prompt": "What is it?", "remember": False}

    def whole(rid, **extra):
        row = BatchRequest(rid, "s", False, {**ask, **extra, "parameters": {**params, **extra.pop("parameters", {})}})
        return json.loads(finish(svc, [row], svc.handle([row]))[rid].body)

    alone = [whole(f"a{i}", parameters={"seed": 3 + i})["generated_text"] for i in range(3)]
    assert len(set(alone)) > 1
    many = whole("m", parameters={"n": 3, "session_choice": 1})
    assert [c["index"] for c in many["choices"]] == [0, 1, 2] and [
        c["generated_text"] for c in many["choices"]
    ] == alone
    assert many["generated_text"] == alone[1] and many["details"]["seed"] == 4
    assert "choices" not in whole("one")
    refused = svc.handle([BatchRequest("r", "s", False, {**ask, "parameters": {"n": 4}})])[0]
    assert refused.status == 400 and "max_concurrent_generations" in json.loads(refused.body)["error"]["message"]
    row = BatchRequest(
        "st",
        "s",
        False,
        {
            "type": "generate",
            "prompt": "What is it?",
            "stream": True,
            "parameters": {**params, "n": 3, "session_choice": 2},
        },
    )
    frames = [svc.handle([row])[0]]
    while frames[-1].stop is False:
        frames += svc.handle([BatchRequest("st", "s", False, None)])
    lines = [json.loads(line) for f in frames for line in f.body.splitlines()]
    for i in range(3):
        mine = [x for x in lines if x["index"] == i]
        assert "".join(x["token"]["text"] for x in mine) == mine[-1]["generated_text"] == alone[i]
        assert all(x["generated_text"] is None for x in mine[:-1]) and mine[-1]["details"]["seed"] == 3 + i
    assert len(lines) == 18 and {x["index"] for x in lines[:3]} == {0, 1, 2}  # interleaved from the first token
    assert [t.answer for t in svc.engine.history("s")] == [alone[2]]
    assert svc.engine.store.sessions() == [svc.engine.store.get("s")]  # the other answers' sessions are gone


def test_a_job_a_batch_lacks_is_freed_at_once_and_its_minted_group_ended(service, photos):
    """TorchServe sends every request that asked to continue in every later batch until its last frame, and
    drops one whose client left without a word: the first batch without it frees its generation slot
    and its session (a sessionless request's is removed, a session's question undone), and the job group minted
    for the sessionless is ended on the next continuation frame, not left to TorchServe's idle timeout."""
    open_sessions(service, open_row("o-k1", "k1", photos["rocket"]))
    chat = {"messages": [{"role": "user", "content": "A story."}], "stream": True, "max_tokens": 60, "ignore_eos": True}
    ask = {"type": "generate", "prompt": "Describe it.", "parameters": {"max_new_tokens": 40}}
    first = service.handle([BatchRequest("gone", "ts-seq-gone", True, chat), BatchRequest("q1", "k1", False, ask)])
    assert [o.stop for o in first] == [False, False] and "ts-seq-gone" in service.engine.store
    assert service.metrics.num_in_flight == 2
    # the sessionless request's client left: the next batch lacks it; both slots are free for new answers at once
    out = service.handle([BatchRequest("q1", "k1", False, None), BatchRequest("q2", "k1", False, ask)])
    assert "gone" not in service.requests.in_flight and "ts-seq-gone" not in service.engine.store
    assert out[0].headers[SEQUENCE_END_HEADER] == "ts-seq-gone"  # carried by a continuation frame
    assert out[1].status == 409  # k1 is still busy with q1: the session's own rule, not a slot
    # the session's question is left too: the session is idle again, as before that question
    out = service.handle([BatchRequest("o-k2", "k2", True, open_row("", "", photos["chelsea"]).body)])
    assert "q1" not in service.requests.in_flight
    service.engine.check_idle("k1")
    finish(service, [BatchRequest("o-k2", "k2", True, None)], out)
    assert service.metrics.num_in_flight == 0
    replies = [answer_of(service, f"a-{sid}", sid, ask) for sid in ("k1", "k2")]  # each a 200
    assert all(r["generated_text"] is not None for r in replies)
    for sid in ("k1", "k2"):
        service.handle([BatchRequest(f"c-{sid}", sid, False, {"type": "close_session"})])


def answer_of(service, rid, sid, body):
    """Drive one non-streamed question to its end; returns the reply as JSON."""
    out = service.handle([BatchRequest(rid, sid, False, body)])[0]
    while out.stop is False:
        out = service.handle([BatchRequest(rid, sid, False, None)])[0]
    assert out.status == 200, out.body
    return json.loads(out.body)


def test_open_timings_measure_each_phase(service, photos):
    opened = json.loads(open_sessions(service, open_row("t-open", "t1", photos["astronaut"]))[0].body)
    t = opened["timings"]
    assert set(t) == {"fetch_ms", "decode_ms", "encode_ms", "prefill_ms", "total_ms"}
    assert t["decode_ms"] > 0 and t["encode_ms"] > 0 and t["prefill_ms"] > 0  # a JPEG decode is real work
    assert t["total_ms"] >= t["fetch_ms"] + t["decode_ms"] + t["encode_ms"] + t["prefill_ms"] - 0.01
    service.handle([BatchRequest("t-close", "t1", False, {"type": "close_session"})])


def test_details_carry_the_drawn_seed_and_where_a_session_was_restored_from(service, photos):
    open_sessions(service, open_row("d-open", "d1", photos["coffee"]))
    q = {"type": "generate", "prompt": "Describe it.", "remember": False}
    greedy = answer_of(service, "d-g", "d1", {**q, "parameters": {"max_new_tokens": 3}})["details"]
    assert greedy["seed"] is None and greedy["restored_from"] is None
    sampled = answer_of(service, "d-s", "d1", {**q, "parameters": {"max_new_tokens": 6, "do_sample": True}})
    seed = sampled["details"]["seed"]
    assert isinstance(seed, int)
    again = answer_of(service, "d-r", "d1", {**q, "parameters": {"max_new_tokens": 6, "do_sample": True, "seed": seed}})
    assert again["generated_text"] == sampled["generated_text"] and again["details"]["seed"] == seed
    service.engine.store.demote("d1", Tier.IMAGE)  # demoted to the image tier
    restored = answer_of(service, "d-i", "d1", {**q, "parameters": {"max_new_tokens": 3}})["details"]
    assert restored["restored_from"] == "image" and restored["timings"]["restore_ms"] > 0
    service.engine.store.demote("d1", Tier.FEATURES)
    assert (
        answer_of(service, "d-f", "d1", {**q, "parameters": {"max_new_tokens": 3}})["details"]["restored_from"]
        == "features"
    )
    service.handle([BatchRequest("d-close", "d1", False, {"type": "close_session"})])


def test_a_chat_image_url_is_fetched_once_per_session(tiny_model_dir, photos):
    """OpenAI messages with an http image URL (a real local server): the session remembers which
    content the URL gave, so the resent conversation does not fetch it again; another session does."""
    host = ImageHost(photos["chelsea"])
    hits, url = host.hits, host.url("/cat.png")
    try:
        svc = tiny_service(tiny_model_dir, allow_http=True, allow_private_networks=True)

        def chat(sid, messages):
            rows = [
                BatchRequest(f"r{len(hits)}-{sid}-{len(messages)}", sid, False, {"messages": messages, "max_tokens": 3})
            ]
            out = finish(svc, rows, svc.handle(rows))
            return json.loads(next(iter(out.values())).body)

        def new_session():
            return json.loads(
                svc.handle([BatchRequest("n-" + str(len(hits)), None, False, {"requestType": "NEW_SESSION"})])[0].body
            )["session_id"]

        sid = new_session()
        messages = [
            {
                "role": "user",
                "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What?"}],
            }
        ]
        first = chat(sid, messages)
        assert first["object"] == "chat.completion" and hits == ["/cat.png"]
        messages += [first["choices"][0]["message"], {"role": "user", "content": "More?"}]
        again = chat(sid, messages)
        assert hits == ["/cat.png"]  # resent: not fetched again
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= first["usage"]["prompt_tokens"]
        chat(new_session(), messages[:1])
        assert len(hits) == 2  # another session fetches it itself
    finally:
        host.close()


# ---- image fetches beside the scheduling loop ------------------------------------------------


@pytest.fixture(scope="module")
def image_host(photos):
    """An image host on 127.0.0.1: ``?delay=S`` answers after S seconds, ``?status=N`` with status N."""
    with ImageHost(photos["rocket"]) as host:
        yield host.url()


@pytest.fixture(scope="module")
def fetching(tiny_model_dir) -> SessionService:
    """A service that may fetch from 127.0.0.1, with a 1.5 s fetch deadline and a 0.1 s wait while busy."""
    return tiny_service(
        tiny_model_dir,
        step_max_tokens=2,
        allow_http=True,
        allow_private_networks=True,
        fetch_total_timeout_s=1.5,
        image_fetch_wait_ms=100,
    )


def _url_open(rid, url):
    return BatchRequest(rid, None, False, {"type": "open_session", "image": {"url": url}})


def test_a_slow_image_host_stalls_only_the_request_that_named_it(fetching, image_host, photos):
    """A stream runs while another request's image host takes 1 s: every handle() call still returns
    within a few hundred ms with the stream's new tokens; the open answers 200 at once (its headers
    carry the id its session then gets) and its session opens when the bytes are in."""
    (opened,) = open_sessions(fetching, open_row("f-o1", "fs-1", photos["astronaut"]))
    sid = json.loads(opened.body)["session_id"]
    body = {"type": "generate", "prompt": "Describe it.", "stream": True, "parameters": {"max_new_tokens": 200}}
    stream = BatchRequest("f-g1", sid, False, body)
    first = fetching.handle([stream])
    assert first[0].stop is False
    opening = _url_open("f-o2", f"{image_host}?delay=1.0")
    rows = [BatchRequest("f-g1", sid, False, None), opening]
    calls, tokens_while_fetching, answered = [], 0, None
    while answered is None:
        t0 = time.perf_counter()
        out = fetching.handle(rows)
        calls.append(time.perf_counter() - t0)
        by_id = dict(zip([r.request_id for r in rows], out, strict=True))
        opened = by_id["f-o2"]
        if opened.stop is False and not opened.body and "f-g1" in by_id and by_id["f-g1"].body:
            tokens_while_fetching += 1
        if len(calls) == 1:  # the open's first frame: 200 with its session's headers, no body yet
            assert (opened.status, opened.stop, opened.body) == (200, False, b"")
            first_headers = opened.headers
        if opened.stop is not False:
            answered = opened
        rows = [
            BatchRequest(r.request_id, r.session_id, False, None)
            for r, o in zip(rows, out, strict=True)
            if o.stop is False
        ]
    # the 1 s fetch never held a call: the stream's tokens came out in calls made while it was pending
    assert sum(calls) >= 0.9 and tokens_while_fetching >= 2, (calls, tokens_while_fetching)
    opened_id = json.loads(answered.body)["session_id"]
    assert answered.stop is True and first_headers["X-Amzn-SageMaker-New-Session-Id"].startswith(opened_id + ";")
    if rows:  # the stream, if it is still going
        finish(fetching, rows, fetching.handle(rows))
    for s in (sid, opened_id):
        fetching.handle([BatchRequest(f"c-{s}", s, False, {"type": "close_session"})])


def test_a_fetch_failure_with_nothing_else_running_gets_its_typed_4xx(fetching, image_host):
    """Nothing else generates: the request's first call waits for its fetch, so the refusal is its
    status: 404 at the host, a host past the deadline."""
    out = fetching.handle([_url_open("f-e1", f"{image_host}?status=404&token=s3cret")])
    error = json.loads(out[0].body)["error"]
    assert (out[0].status, error["code"]) == (400, "image_fetch_failed") and out[0].stop is None
    assert "127.0.0.1 answered HTTP 404" in error["message"] and "s3cret" not in error["message"]
    t0 = time.perf_counter()
    out = fetching.handle([_url_open("f-e2", f"{image_host}?delay=3")])
    # the host answers after 3 s: the timeout code says the deadline fired first; the call waited for it
    assert (out[0].status, json.loads(out[0].body)["error"]["code"]) == (400, "image_fetch_timeout")
    assert time.perf_counter() - t0 >= 1.4
    assert not fetching.parked and not fetching.requests.in_flight


def test_a_fetch_that_fails_after_its_reply_began_ends_it_with_the_typed_error(fetching, image_host, photos):
    """A stream runs, so a slow fetch's request answers 200 after 0.1 s; the timeout then ends it with
    the typed error as its body (native), or as a stream's error event and ``[DONE]`` (chat)."""
    (opened,) = open_sessions(fetching, open_row("f-o3", "fs-3", photos["coffee"]))
    sid = json.loads(opened.body)["session_id"]
    body = {"type": "generate", "prompt": "Describe it.", "stream": True, "parameters": {"max_new_tokens": 400}}
    running = fetching.handle([BatchRequest("f-g3", sid, False, body)])
    assert running[0].stop is False
    chat = {
        "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"{image_host}?delay=3"}}]}
        ],
        "stream": True,
    }
    rows = [
        BatchRequest("f-g3", sid, False, None),
        _url_open("f-l1", f"{image_host}?delay=3"),
        BatchRequest("f-l2", "ts-seq-l2", True, chat),
    ]
    out = fetching.handle(rows)
    assert [o.status for o in out[1:]] == [200, 200] and [o.stop for o in out[1:]] == [False, False]
    assert out[2].content_type == "text/event-stream; charset=utf-8" and out[2].headers == {}
    last = finish(fetching, rows, out)
    native = json.loads(last["f-l1"].body)["error"]
    assert last["f-l1"].stop is True and native["code"] == "image_fetch_timeout"
    events = last["f-l2"].body.decode()
    assert last["f-l2"].stop is True and events.endswith("data: [DONE]\n\n"), events
    assert json.loads(events.split("\n\n")[0].removeprefix("data: "))["error"]["code"] == "image_fetch_timeout"
    assert last["f-l2"].headers == {"X-Llava-Sequence-End": "ts-seq-l2"}  # the sessionless request's job group ends
    assert not fetching.parked
    fetching.handle([BatchRequest("c-f3", sid, False, {"type": "close_session"})])
