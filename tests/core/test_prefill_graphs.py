"""A prefill chunk at static shapes (issue 59 item 4): what a GPU captures as CUDA graphs for an image turn.

Nothing is captured on this CPU. What runs here is the pass a graph records, eagerly, over the same
persistent buffers a replay reads: the chunk padded to a chunk-size bucket with pad rows on the scratch
page, the attended length padded to a length bucket, every input overwritten before the pass. fp32 greedy
tokens through it equal ``model.generate``'s, it writes nothing but the chunk's own slots and the scratch
page, and a failed pass leaves the table as it was. ``tests/gpu/test_on_gpu.py`` checks replay on a GPU.
"""

from __future__ import annotations

import pytest
import torch

import engine_fixtures
from engine_fixtures import decode
from llava_sessions.engine import EngineLimits
from llava_sessions.model.gpu.graphs import DecodeGraphs
from llava_sessions.model.gpu.prefill_graphs import PREFILL_CHUNK_SIZES, PrefillGraphs
from llava_sessions.model.kv.paged import KVPool, SessionKV
from llava_sessions.model.kv.pages import reserve
from llava_sessions.sampling.sampler import SamplingParams

N = 12
PAGE = 16


def new_pool(llava, num_pages: int) -> KVPool:
    text = llava.config.text_config
    shape = (text.num_hidden_layers, llava.num_kv_heads, llava.head_dim, llava.dtype, llava.device)
    return KVPool(*shape, page_size=PAGE, num_pages=num_pages, fixed=True)


def templated(llava, image: bytes, question: str) -> tuple[list[int], dict]:
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    text = llava.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = llava.processor(text=text, images=decode(image), return_tensors="pt").to(llava.device)
    return inputs["input_ids"][0].tolist(), inputs


def reference(llava, inputs: dict) -> list[int]:
    with torch.inference_mode():
        out = llava.model.generate(**inputs, max_new_tokens=N, min_new_tokens=N, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def changed_slots(pool: KVPool, before: list[torch.Tensor]) -> set[int]:
    now = pool.pages.keys + pool.pages.values
    slots: set[int] = set()
    for old, new in zip(before, now, strict=True):
        slots |= set((old != new).reshape(old.shape[0] * PAGE, -1).any(-1).nonzero().flatten().tolist())
    return slots


def answer(llava, pool: KVPool, graphs: DecodeGraphs, table, first: torch.Tensor) -> list[int]:
    """Greedy tokens from ``first`` logits on, decoded through the static step."""
    tokens = [int(first.argmax())]
    while len(tokens) < N:
        assert reserve(pool.pool, table, 1) == []
        tokens.append(int(graphs.run([table], [tokens[-1]])[0].argmax()))
    return tokens


@pytest.fixture(scope="module")
def image_prompt(llava, photos):
    ids, inputs = templated(llava, photos["coffee"], "What is in this image?")
    return ids, llava.encode_images([decode(photos["coffee"])])[0], reference(llava, inputs)


def test_buckets_hold_the_chunk_and_its_context_and_never_read_less_than_the_chunk(llava) -> None:
    pool = new_pool(llava, 8)
    prefills = PrefillGraphs(llava, pool, 0, max_len=4096)
    assert prefills.sizes == list(PREFILL_CHUNK_SIZES) and prefills.lengths[0] == 512 and prefills.lengths[-1] == 2048
    assert prefills.bucket(590, 590) == (640, 640)  # llava-1.5's open
    assert prefills.bucket(100, 300) == (128, 512)
    assert prefills.bucket(890, 900) == (1024, 1024)  # the read never shorter than the chunk's rows
    assert prefills.bucket(200, 1500) == (256, 1536)
    assert prefills.bucket(1025, 1025) is None and prefills.bucket(10, 2049) is None
    assert all(t <= L for t, L in prefills.buckets) and prefills.buckets[0] == (1024, 2048)
    assert len(prefills.buckets) == sum(1 for t in prefills.sizes for L in prefills.lengths if t <= L)
    assert PrefillGraphs(llava, pool, 0, max_len=1000).lengths[-1] == 1008  # the model's context


def test_an_image_prompt_prefilled_at_static_shapes_answers_as_generate(llava, image_prompt) -> None:
    """The whole templated prompt (the image's placeholders among its tokens) in one padded pass from
    position 0: greedy tokens equal ``model.generate``'s; the pass writes only the prompt's slots and the
    scratch page's; its last logits equal the eager pass's over the pool (fp32)."""
    ids, features, expected = image_prompt
    pool = new_pool(llava, 200)
    graphs = DecodeGraphs(llava, pool, max_rows=4, max_len=llava.max_positions)
    prefills = PrefillGraphs(llava, pool, graphs.table.pages[0], max_len=llava.max_positions)
    scratch = set(range(graphs.table.pages[0] * PAGE, (graphs.table.pages[0] + 1) * PAGE))
    cache = SessionKV(pool)
    before = [t.clone() for t in pool.pages.keys + pool.pages.values]
    logits = prefills.prefill(cache.table, ids, 0, features)
    assert logits is not None and cache.table.num_tokens == len(ids) and prefills.chunks.num_eager == 1
    own = {p * PAGE + i for p in cache.table.pages for i in range(PAGE)}
    assert changed_slots(pool, before) <= own | scratch
    eager = SessionKV(pool)
    torch.testing.assert_close(logits, llava.prefill(eager, ids, features), rtol=1e-4, atol=1e-4)
    assert answer(llava, pool, graphs, cache.table, logits) == expected
    pool.check([cache.table, eager.table, graphs.table])


def test_a_chunk_after_cached_positions_in_a_shared_page_answers_as_generate(llava, image_prompt) -> None:
    """The prompt's first 40 tokens prefilled eagerly by one holder, forked (its partly written last page
    shared, so copied on write), then the rest (the image's placeholders from their first row on) as one
    static chunk: the same greedy tokens; a chunk no bucket holds is handed back with nothing reserved."""
    ids, features, expected = image_prompt
    pool = new_pool(llava, 200)
    graphs = DecodeGraphs(llava, pool, max_rows=4, max_len=llava.max_positions)
    prefills = PrefillGraphs(llava, pool, graphs.table.pages[0], max_len=llava.max_positions)
    first = SessionKV(pool)
    llava.prefill(first, ids[:40], features)
    session = first.fork(40)
    assert prefills.prefill(session.table, [5] * 1100, 0, None) is None and session.table.num_tokens == 40
    rows = ids[:40].count(llava.image_token_id)
    logits = prefills.prefill(session.table, ids[40:], rows, features)
    assert logits is not None and session.table.pages[:2] == first.table.pages[:2]
    assert session.table.pages[2] != first.table.pages[2]
    assert answer(llava, pool, graphs, session.table, logits) == expected
    pool.check([first.table, session.table, graphs.table])


def test_a_failed_pass_leaves_the_table_as_it_was(llava, image_prompt, monkeypatch) -> None:
    ids, features, _ = image_prompt
    pool = new_pool(llava, 200)
    prefills = PrefillGraphs(llava, pool, 199, max_len=llava.max_positions)
    cache = SessionKV(pool)
    llava.prefill(cache, ids[:20], features)
    pages, free = list(cache.table.pages), pool.pool.num_free_pages

    def fails(*args, **kwargs):
        raise RuntimeError("the pass failed")

    monkeypatch.setattr(llava, "text_pass", fails)
    with pytest.raises(RuntimeError, match="the pass failed"):
        prefills.prefill(cache.table, ids[20:], ids[:20].count(llava.image_token_id), features)
    assert cache.table.num_tokens == 20 and cache.table.pages == pages and pool.pool.num_free_pages == free


def test_the_engines_static_layout_opens_an_image_through_the_static_prefill(llava, photos) -> None:
    """The engine with the static step (a GPU's, run eagerly here) opens an image with its prefix
    prefilled at static shapes, and answers two turns as the engine without it does."""
    answers, runners = [], []
    for layout in ("eager", "static"):
        engine = engine_fixtures.make_engine(
            llava, limits=EngineLimits(max_new_tokens_cap=64), **engine_fixtures.LAYOUTS[layout]
        )
        engine.open("s1", photos["astronaut"])
        turns = []
        for question in ("What is in this image?", "And the colours?"):
            done = engine.generate("s1", question, SamplingParams(max_new_tokens=N))
            turns.append([t.id for t in done.tokens])
        answers.append(turns)
        runners.append(engine.runner)
    assert answers[0] == answers[1]
    assert runners[0].prefill_graphs is None and runners[1].prefill_graphs.chunks.num_eager >= 1
