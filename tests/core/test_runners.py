"""The one place a pass is chosen (issue 74 item 3): ``engine/runners.py``'s :class:`StepRunners`.

Each runner says whether it can run a step before anything is written, and the first that can runs it:
the static decode step (a GPU replays it as CUDA graphs; eagerly here, over a fixed pool), the static
prefill, then the eager pass. A runner's answer is the pass it runs: its logits equal the eager pass's
on the same step (fp32), and the engine's modules never read the graphs themselves.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

import engine_fixtures
from llava_sessions.engine.runners import Chunk, EagerRunner, StaticPrefillRunner, StaticRowsRunner, Step
from llava_sessions.model.kv.pages import reserve, truncate

ENGINE = Path(__file__).resolve().parents[2] / "handler" / "llava_sessions" / "engine"


def _open(engine, photos, sid: str):
    engine.open(sid, photos["coffee"])
    return engine.store.get(sid)


def test_each_step_goes_to_the_first_runner_that_can_run_it_and_gets_the_eager_pass_s_logits(llava, photos):
    static = engine_fixtures.make_engine(llava, **engine_fixtures.LAYOUTS["static"])
    passes = static.runner.passes
    kinds = [type(r) for r in passes.runners]
    assert kinds == [StaticRowsRunner, StaticPrefillRunner, EagerRunner]
    session = _open(static, photos, "s")
    cache, ids = session.kv_cache, list(session.cached_ids)
    text = llava.tokenizer(" What colour is the cup?", add_special_tokens=False)["input_ids"]
    chunk = Chunk(cache, ids + text, len(ids), session.image_features)
    assert isinstance(passes.choose(Step(chunks=[chunk])), StaticRowsRunner)  # text: rows of the static step
    image = llava.image_token_id
    with_image = Chunk(cache, ids + [image] * 4 + text, len(ids), session.image_features)
    assert isinstance(passes.choose(Step(chunks=[with_image])), StaticPrefillRunner)  # placeholders
    two = [chunk, Chunk(cache, ids + text[:3], len(ids))]
    assert isinstance(passes.choose(Step(chunks=two)), StaticRowsRunner)  # several sessions' questions
    eager = engine_fixtures.make_engine(llava).runner.passes
    assert [type(r) for r in eager.runners] == [EagerRunner]
    assert eager.choose(Step(chunks=two)) is None  # several chunks need the static step
    on_device = Step([cache.table], torch.tensor([text[0]]), (), cache.table.num_tokens + 1)
    assert passes.can_run(on_device) and not eager.can_run(on_device)  # only the static step launches ahead

    # the static step's logits are the eager pass's on the same reserved row
    start = cache.table.num_tokens
    outs = []
    for runner in (passes.runners[0], passes.runners[-1]):
        assert reserve(static.runner.pool.pool, cache.table, 1) == []
        step = Step.of([cache.table], [text[0]])
        assert runner.can_run(step)
        logits, lasts = runner.execute(step)
        outs.append(logits)
        assert lasts == []
        truncate(static.runner.pool.pool, cache.table, start)  # the step's position taken back
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)


def test_the_engine_s_modules_never_read_the_graphs():
    """``engine.py``, ``executor.py``, ``paged_batch.py`` and ``ahead.py`` ask the runner (its
    ``passes``, ``static_steps``, ``replays_steps``), never a graph kind."""
    for name in ("engine.py", "executor.py", "paged_batch.py", "ahead.py"):
        text = (ENGINE / name).read_text()
        found = re.findall(r"\.(graphs|prefill_graphs|vision_graph)\b|DecodeGraphs|PrefillGraphs", text)
        assert not found, (name, found)
