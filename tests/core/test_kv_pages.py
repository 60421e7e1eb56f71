"""The KV pool in pages: its bookkeeping (model/pages.py), the caches over it (model/paged_kv.py) and
the engine's sessions held in it.

Bookkeeping rules run without a model. Exactness runs the ``tiny`` checkpoint in fp32 on the CPU:
greedy tokens through the pool equal ``model.generate``'s on the same chat-templated prompt, for a
sequence alone, for two sessions sharing their image prefix's pages, for rows decoding in one
batch that join and leave between steps, and for an engine's sessions (whose every step checks the
pool's reference counts against the sessions' page tables), their answers decoding in their own pages
or in the contiguous batch.
"""

from __future__ import annotations

import pytest
import torch

from engine_fixtures import decode, make_engine
from llava_sessions.engine.paged_batch import PagedDecodeBatch
from llava_sessions.metrics import WorkerMetrics
from llava_sessions.model.fused import attention_on
from llava_sessions.model.kv import paged as paged_kv
from llava_sessions.model.kv.paged import KVPages, KVPool, SessionKV, SlotsCache
from llava_sessions.model.kv.pages import PageCopy, PagePool, PageTable, fork, release, reserve, truncate
from llava_sessions.model.kv.runs import PAGED_RUNS_ATTENTION, reading_runs, table_runs
from llava_sessions.sampling.sampler import SamplingParams

N = 8  # greedy tokens per answer
PAGE = 16


# ---------------------------------------------------------------------- bookkeeping, no model
def test_allocation_is_all_or_nothing_and_free_pages_come_back() -> None:
    pool = PagePool(4, PAGE)
    assert pool.allocate(5) is None and pool.num_free_pages == 4  # a shortage takes nothing
    pages = pool.allocate(3)
    assert pages is not None and len(set(pages)) == 3 and pool.usage == 0.75
    pool.free(pages[:1])
    assert pool.num_free_pages == 2
    with pytest.raises(ValueError, match="already free"):
        pool.free(pages[:1])
    with pytest.raises(ValueError, match="only a held page"):
        pool.share(pages[:1])
    with pytest.raises(ValueError, match="at least one page"):
        PagePool(0, PAGE)


def test_a_table_books_whole_pages_and_nothing_past_its_last() -> None:
    pool = PagePool(8, PAGE)
    table = PageTable()
    assert reserve(pool, table, 1) == []
    assert (table.num_tokens, len(table.pages)) == (1, 1)
    assert reserve(pool, table, 31) == []
    assert (table.num_tokens, len(table.pages)) == (32, 2)  # exactly full: no spare page
    assert reserve(pool, table, 1) == [] and len(table.pages) == 3
    assert table.slots(31, 33, PAGE) == [table.pages[1] * PAGE + 15, table.pages[2] * PAGE]
    with pytest.raises(IndexError):
        table.slots(0, 49, PAGE)
    truncate(pool, table, 17)
    assert (table.num_tokens, len(table.pages), pool.num_free_pages) == (17, 2, 6)
    with pytest.raises(ValueError):
        truncate(pool, table, 18)
    release(pool, table)
    assert (table.pages, table.num_tokens, pool.num_free_pages) == ([], 0, 8)


def test_a_fork_shares_every_page_and_a_write_copies_only_a_shared_partial_last_page() -> None:
    pool = PagePool(8, PAGE)
    a = PageTable()
    reserve(pool, a, 40)  # pages 0, 1 full; page 2 holds 8 positions
    b = fork(pool, a)
    assert b.pages == a.pages and all(pool.ref_count(p) == 2 for p in a.pages)
    assert pool.num_free_pages == 5  # the fork took no page
    copies = reserve(pool, b, 1)
    assert copies == [PageCopy(a.pages[2], b.pages[2], 8)]  # copy on write of the partial page only
    assert b.pages[:2] == a.pages[:2] and b.pages[2] != a.pages[2]
    assert pool.ref_count(a.pages[2]) == 1 and pool.ref_count(a.pages[0]) == 2
    assert reserve(pool, a, 1) == []  # a's partial page is its own again: written in place
    c = fork(pool, a, 32)  # a prefix on a page boundary
    assert c.pages == a.pages[:2] and reserve(pool, c, 5) == []  # its next write opens a new page
    d = fork(pool, a, 20)
    assert reserve(pool, d, 1) == [PageCopy(a.pages[1], d.pages[1], 4)]
    with pytest.raises(ValueError):
        fork(pool, a, 42)


def test_a_reservation_the_pool_cannot_hold_changes_nothing() -> None:
    pool = PagePool(3, PAGE)
    a = PageTable()
    reserve(pool, a, 20)
    b = fork(pool, a)
    before = (list(b.pages), b.num_tokens, pool.num_free_pages)
    assert reserve(pool, b, 30) is None  # needs a copied page and two more: 3 > 1 free
    assert (b.pages, b.num_tokens, pool.num_free_pages) == before
    for table in (a, b):
        release(pool, table)
    assert pool.num_free_pages == 3


# ---------------------------------------------------------------------- exactness, tiny model
def templated(llava, image: bytes, question: str) -> tuple[list[int], dict]:
    """The chat-templated prompt ids of one question on ``image`` and the processor's inputs."""
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    text = llava.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = llava.processor(text=text, images=decode(image), return_tensors="pt")
    return inputs["input_ids"][0].tolist(), inputs


def reference(llava, inputs: dict) -> list[int]:
    with torch.inference_mode():
        out = llava.model.generate(**inputs, max_new_tokens=N, min_new_tokens=N, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def new_pool(llava, num_pages: int) -> tuple[PagePool, KVPages]:
    text = llava.config.text_config
    kv = KVPages(text.num_hidden_layers, num_pages, PAGE, llava.num_kv_heads, llava.head_dim, llava.dtype, "cpu")
    return PagePool(num_pages, PAGE), kv


def prefill(llava, pool, kv, table, ids, features) -> int:
    """Prefill ``ids`` past ``table``'s positions through the pool; the greedy next token."""
    start = table.num_tokens
    kv.copy(reserve(pool, table, len(ids) - start) or [])
    return int(llava.prefill(SlotsCache.of_sequence(kv, table, len(ids) - start), ids, features).argmax())


@pytest.fixture(scope="module")
def two_questions(llava, photos):
    """Two questions on one photo: prompt ids, references, the image's features, the common prefix."""
    qa = templated(llava, photos["coffee"], "What is in this image?")
    qb = templated(llava, photos["coffee"], "Describe the colours, please.")
    features = llava.encode_images([decode(photos["coffee"])])[0]
    common = next(i for i, (x, y) in enumerate(zip(qa[0], qb[0], strict=False)) if x != y)
    return qa[0], qb[0], reference(llava, qa[1]), reference(llava, qb[1]), features, common


def test_greedy_tokens_through_pages_equal_generate(llava, two_questions) -> None:
    ids_a, _ids_b, ref_a, _ref_b, features, _common = two_questions
    pool, kv = new_pool(llava, 64)
    table = PageTable()
    tokens = [prefill(llava, pool, kv, table, ids_a, features)]
    while len(tokens) < N:
        reserve(pool, table, 1)
        tokens.append(int(llava.decode(SlotsCache.of_sequence(kv, table, 1), tokens[-1]).argmax()))
    assert tokens == ref_a
    assert len(table.pages) == pool.pages_for(len(ids_a) + N - 1)
    assert (pool.num_pages - pool.num_free_pages) * kv.bytes_per_page == len(table.pages) * kv.bytes_per_page


def test_sessions_on_one_image_share_its_prefix_pages_and_answer_exactly(llava, two_questions) -> None:
    ids_a, ids_b, ref_a, ref_b, features, common = two_questions
    pool, kv = new_pool(llava, 128)
    prefix = PageTable()
    prefill(llava, pool, kv, prefix, ids_a[:common], features)  # the image's prefix, once
    a, b = fork(pool, prefix), fork(pool, prefix)
    release(pool, prefix)
    full = common // PAGE
    assert all(pool.ref_count(p) == 2 for p in a.pages[:full])
    answers = []
    for table, ids in ((a, ids_a), (b, ids_b)):
        tokens = [prefill(llava, pool, kv, table, ids, features)]
        while len(tokens) < N:
            reserve(pool, table, 1)
            tokens.append(int(llava.decode(SlotsCache.of_sequence(kv, table, 1), tokens[-1]).argmax()))
        answers.append(tokens)
    assert answers == [ref_a, ref_b]
    assert a.pages[:full] == b.pages[:full]  # the full prefix pages are stored once
    whole = llava.new_cache()  # a's prompt prefilled contiguously: the pages hold the same keys
    llava.prefill(whole, ids_a, features)
    slots = torch.tensor(a.slots(0, len(ids_a), PAGE))[None]
    for layer, contiguous in enumerate(whole.layers):
        keys, values = kv.gather(layer, slots)
        torch.testing.assert_close(keys, contiguous.keys, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(values, contiguous.values, rtol=1e-4, atol=1e-5)
    # the only bytes copied: the prefix's partial last page, by the first session writing into it
    # (the second then holds the old page alone and writes it in place)
    assert kv.num_copied_bytes == (common % PAGE) * kv.bytes_per_page // PAGE
    held = pool.num_pages - pool.num_free_pages
    assert held == len(set(a.pages) | set(b.pages)) < len(a.pages) + len(b.pages)


def test_rows_decode_together_exactly_and_join_or_leave_without_moving_kv(llava, two_questions) -> None:
    ids_a, ids_b, ref_a, ref_b, features, _common = two_questions
    pool, kv = new_pool(llava, 128)
    tables = {"a": PageTable(), "b": PageTable()}
    tokens = {
        "a": [prefill(llava, pool, kv, tables["a"], ids_a, features)],
        "b": [prefill(llava, pool, kv, tables["b"], ids_b, features)],
    }
    storage = [t.data_ptr() for t in kv.keys + kv.values]
    # b sits out the first two steps and a the last two: rows join and leave between steps
    plan = [["a"], ["a"], ["a", "b"], ["a", "b"], ["a", "b"], ["b", "a"], ["a", "b"], ["b"], ["b"]]
    for rows in plan:
        rows = [r for r in rows if len(tokens[r]) < N]
        for r in rows:
            assert reserve(pool, tables[r], 1) == []
        cache = SlotsCache.of_rows(kv, [tables[r] for r in rows])
        ids = torch.tensor([[tokens[r][-1]] for r in rows])
        with torch.inference_mode():
            out = llava.model(
                input_ids=ids,
                attention_mask=cache.attention_mask,
                position_ids=torch.tensor(cache.positions)[:, None],
                use_cache=True,
                **{llava._cache_kw: cache},
                logits_to_keep=1,
            )
        for i, r in enumerate(rows):
            tokens[r].append(int(out.logits[i, -1].argmax()))
    assert (tokens["a"], tokens["b"]) == (ref_a, ref_b)
    assert kv.num_copied_bytes == 0  # no row's KV moved, whoever joined or left
    assert [t.data_ptr() for t in kv.keys + kv.values] == storage


def test_a_table_s_runs_are_its_consecutive_pages_as_slot_ranges() -> None:
    assert table_runs([3, 4, 5, 9, 10, 2], 16 * 5 + 3, PAGE) == [(48, 96), (144, 176), (32, 35)]
    assert table_runs([7], 1, PAGE) == [(112, 113)]
    assert table_runs([1, 2, 3], 17, PAGE) == [(16, 33)]  # positions past num_tokens are not read
    with pytest.raises(IndexError):
        table_runs([1], 17, PAGE)


def test_holders_growing_side_by_side_keep_their_pages_in_runs() -> None:
    """Eight tables prefilled, then growing a page at a time in turn, as a decode step's rows do: each
    keeps its pages in few runs (a growing table takes the page after its last; a new run starts mid
    the longest free run), where a first-free list would interleave them page by page."""
    pool = PagePool(1024, PAGE)
    tables = [PageTable() for _ in range(8)]
    for table in tables:
        reserve(pool, table, 600)
    for _ in range(20 * PAGE):
        for table in tables:
            reserve(pool, table, 1)
    for table in tables:
        assert len(table_runs(table.pages, table.num_tokens, PAGE)) <= 2, table.pages
    assert pool.free_pages() == [p for p in range(pool.num_pages) if pool.ref_count(p) == 0]
    for table in tables:
        release(pool, table)
    assert pool.num_free_pages == 1024 and pool.allocate(1024) is not None  # every page free again, in one run


def test_a_decode_step_reading_runs_answers_as_the_gathered_one_over_scattered_pages(llava, two_questions) -> None:
    """Rows whose pages are scattered (a shared prefix, then pages taken in turn, as crowded growth
    leaves them): the step reading each row's runs of pages as views gives the gathered step's logits
    within float rounding, and the same greedy tokens as ``generate``."""
    ids_a, ids_b, ref_a, ref_b, features, common = two_questions
    pool, kv = new_pool(llava, 256)
    taken = pool.allocate(256)
    assert taken is not None
    pool.free(taken[::2])  # every other page free: no two free pages are consecutive
    prefix = PageTable()
    prefill(llava, pool, kv, prefix, ids_a[:common], features)
    tables = {"a": fork(pool, prefix), "b": fork(pool, prefix)}
    release(pool, prefix)
    tokens = {
        "a": [prefill(llava, pool, kv, tables["a"], ids_a, features)],
        "b": [prefill(llava, pool, kv, tables["b"], ids_b, features)],
    }
    text = llava.config.text_config
    for _ in range(N - 1):
        rows = ["a", "b"]
        for r in rows:
            reserve(pool, tables[r], 1)
        logits = {}
        for runs in (False, True):
            cache = SlotsCache.of_rows(kv, [tables[r] for r in rows], runs=runs)
            ids = [tokens[r][-1] for r in rows]
            if runs:
                assert all(len(spans) > 30 for spans in cache.runs)  # a run per page
                with reading_runs(cache.runs), attention_on(text, PAGED_RUNS_ATTENTION):
                    logits[runs] = llava.decode_batch(cache, ids, cache.positions, cache.attention_mask)
            else:
                logits[runs] = llava.decode_batch(cache, ids, cache.positions, cache.attention_mask)
        torch.testing.assert_close(logits[True], logits[False], rtol=1e-4, atol=1e-4)
        for i, r in enumerate(rows):
            tokens[r].append(int(logits[True][i].argmax()))
    assert (tokens["a"], tokens["b"]) == (ref_a, ref_b)


# ---------------------------------------------------------------------- the engine's sessions in the pool


GREEDY = SamplingParams(max_new_tokens=N, min_tokens=N)


def test_an_engine_holds_its_sessions_kv_in_the_pool_and_an_image_prefix_once(llava, photos, two_questions) -> None:
    """Sessions' KV lives in the replica's pool (every step checks the pool's counts against the
    sessions' tables: check_invariants); a second session on the same image holds the first one's
    full prefix pages by reference, the ledger books each session's pages, and closing frees all."""
    _ids_a, _ids_b, ref_a, ref_b, _features, common = two_questions
    eng = make_engine(llava)
    pool = eng.runner.pool
    assert pool is not None
    eng.open("a", photos["coffee"])
    a = eng.generate("a", "What is in this image?", GREEDY)
    copied = pool.pages.num_copied_bytes
    eng.open("b", photos["coffee"])
    b = eng.generate("b", "Describe the colours, please.", GREEDY)
    assert [t.id for t in a.tokens] == ref_a and [t.id for t in b.tokens] == ref_b
    assert b.cached_tokens >= common - 1  # b's prompt reused a's image prefix
    sa, sb = eng.store.get("a"), eng.store.get("b")
    assert isinstance(sa.kv_cache, SessionKV) and isinstance(sb.kv_cache, SessionKV)
    full = (b.cached_tokens // PAGE) - 1
    assert full > 30 and sa.kv_cache.table.pages[:full] == sb.kv_cache.table.pages[:full]
    assert pool.pages.num_copied_bytes - copied <= pool.pages.bytes_per_page  # one partial page at most
    booked = eng.store.ledger.entry("b").num_kv_tokens * llava.kv_bytes_per_token
    assert booked == len(sb.kv_cache.table.pages) * pool.pages.bytes_per_page  # the booked bytes: its pages
    held = len(set(sa.kv_cache.table.pages) | set(sb.kv_cache.table.pages))
    assert pool.num_used_bytes() == held * pool.pages.bytes_per_page < eng.store.ledger.num_device_bytes
    gauges = WorkerMetrics().snapshot(eng)["gauges"]
    assert gauges[("KVPoolBytes", ("used",))] == pool.num_used_bytes() < gauges[("SessionBytes", ("kv",))]
    assert gauges[("KVPoolBytes", ("allocated",))] == pool.pages.nbytes() >= pool.num_used_bytes()
    eng.close("a")
    eng.close("b")
    assert pool.pool.num_free_pages == pool.pool.num_pages  # nothing leaked


def test_a_pool_grows_as_its_session_needs_and_keeps_what_it_holds(llava, two_questions) -> None:
    ids_a, _ids_b, ref_a, _ref_b, features, _common = two_questions
    text = llava.config.text_config
    pool = KVPool(text.num_hidden_layers, llava.num_kv_heads, llava.head_dim, llava.dtype, "cpu", num_pages=1)
    cache = pool.new_cache()
    tokens = [int(llava.prefill(cache, ids_a[:100], features).argmax())]  # grows from 1 page
    tokens = [int(llava.prefill(cache, ids_a, features).argmax())]  # grows again: the rest of the prompt
    while len(tokens) < N:
        tokens.append(int(llava.decode(cache, tokens[-1]).argmax()))
    assert tokens == ref_a and pool.num_grows >= 2
    assert cache.num_held_tokens == len(cache.table.pages) * PAGE == pool.pool.pages_for(len(ids_a) + N - 1) * PAGE
    pool.check([cache.table])


def test_a_pass_that_fails_midway_leaves_the_session_cache_as_before(llava, two_questions) -> None:
    """A prefill whose forward pass fails after layer 0 wrote (an out-of-memory error in a later
    layer) takes its positions back, so the retry runs the same pass and answers exactly."""
    ids_a, _ids_b, ref_a, _ref_b, features, common = two_questions
    text = llava.config.text_config
    pool = KVPool(text.num_hidden_layers, llava.num_kv_heads, llava.head_dim, llava.dtype, "cpu")
    cache = pool.new_cache()
    llava.prefill(cache, ids_a[:common], features)
    before = (list(cache.table.pages), cache.table.num_tokens)

    def out_of_memory(module, args):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    hook = llava.model.model.language_model.layers[-1].register_forward_pre_hook(out_of_memory)
    try:
        with pytest.raises(torch.OutOfMemoryError):
            llava.prefill(cache, ids_a, features)
    finally:
        hook.remove()
    assert (cache.table.pages, cache.table.num_tokens) == before
    pool.check([cache.table])
    tokens = [int(llava.prefill(cache, ids_a, features).argmax())]
    while len(tokens) < N:
        tokens.append(int(llava.decode(cache, tokens[-1]).argmax()))
    assert tokens == ref_a


# ---------------------------------------------------------------------- answers decoding in their sessions' pages
def test_answers_decode_in_their_sessions_pages_and_join_or_leave_moving_no_kv(llava, photos, two_questions) -> None:
    """Each running answer decodes straight into its session's pages. Two
    answers on one photo, the second joining while the first decodes and going on after it left:
    each gives ``generate``'s greedy tokens; no KV byte is copied in any step a row joins, decodes
    or leaves; the store books no batch beside the sessions, and after every step each session's
    booked bytes are the pages it holds, its answer's among them."""
    _ids_a, _ids_b, ref_a, ref_b, _features, _common = two_questions
    eng = make_engine(llava)
    pool = eng.runner.pool
    assert isinstance(eng.batch, PagedDecodeBatch)
    eng.open("a", photos["coffee"])
    eng.open("b", photos["coffee"])
    sessions = {"a": eng.store.get("a"), "b": eng.store.get("b")}
    a = eng.start("a", "What is in this image?", GREEDY)
    while len(a.events) < 3:
        eng.step([a])
    b = eng.start("b", "Describe the colours, please.", GREEDY)
    eng.step([a, b])  # b's prompt rides a's decode step and samples its first token: b joins next step
    assert b.row is None and len(b.events) == 1 and eng.runner.num_fused_passes == 1
    copied, alone = pool.pages.num_copied_bytes, 0
    while not b.done:
        eng.step([g for g in (a, b) if not g.done])
        alone += a.done and not b.done  # b decodes on after a left
        for sid, g in zip("ab", (a, b), strict=True):
            cache = sessions[sid].kv_cache
            assert isinstance(cache, SessionKV)
            assert len(sessions[sid].cached_ids) == len(g.prompt_ids) + len(g.events) - 1  # fed in place
            booked = eng.store.ledger.entry(sid).num_kv_tokens * llava.kv_bytes_per_token
            assert booked == len(cache.table.pages) * pool.pages.bytes_per_page
    assert alone >= 1 and eng.batch.num_builds >= 2  # b joined a running batch; a left before b ended
    assert pool.pages.num_copied_bytes == copied  # no KV moved when b joined, as both decoded, nor when a left
    assert ([t.id for t in a.answer.tokens], [t.id for t in b.answer.tokens]) == (ref_a, ref_b)
    eng.close("a")
    eng.close("b")
    assert pool.pool.num_free_pages == pool.pool.num_pages


def test_a_paged_decode_step_that_runs_out_of_memory_is_taken_back_and_retried_exactly(
    llava, photos, two_questions
) -> None:
    """A paged decode step whose pass fails in its last layer after the others wrote (a CUDA
    out-of-memory error) takes every row's new position back, demotes the idle sessions and runs
    again: the answer is ``generate``'s and the pool holds what the sessions' tables list."""
    _ids_a, _ids_b, ref_a, _ref_b, _features, _common = two_questions
    eng = make_engine(llava)
    eng.open("idle", photos["astronaut"])
    eng.open("a", photos["coffee"])
    a = eng.start("a", "What is in this image?", GREEDY)
    eng.step([a])  # the prompt, and the first token
    failed = []

    def out_of_memory_once(module, args):
        if args[0].shape[1] == 1 and not failed:  # a decode step's one position
            failed.append(True)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    hook = llava.model.model.language_model.layers[-1].register_forward_pre_hook(out_of_memory_once)
    try:
        while not a.done:
            eng.step([a])
    finally:
        hook.remove()
    assert failed and a.error is None and [t.id for t in a.answer.tokens] == ref_a
    assert eng.store.get("idle").kv_cache is None  # demoted to make room for the retry


def test_a_grant_is_what_the_ledger_books_for_it_whole_pages_in_the_pool(llava, photos) -> None:
    """Admission's grants count what the ledger books: an open's is its features and its prefix's
    whole pages, exactly what the session is booked once open; a remembered turn's is never less
    than what it is booked once answered, and more only by the page of the answer's last token,
    which is never fed."""
    eng = make_engine(llava)
    task = eng.begin_open("a", photos["coffee"])
    while not task.done:
        eng.step([task])
    assert eng.store.device_bytes() == task.start_bytes  # nothing else held
    before = eng.store.device_bytes()
    gen = eng.start("a", "Describe it in detail, please.", SamplingParams(max_new_tokens=20, min_tokens=20))
    while not gen.done:
        eng.step([gen])
    grown = eng.store.device_bytes() - before  # the turn's prompt and answer, as booked
    assert 0 <= gen.start_bytes - grown <= PAGE * llava.kv_bytes_per_token


def test_a_growth_out_of_memory_midway_leaves_the_pool_as_its_holders_see_it(llava, two_questions, monkeypatch) -> None:
    """The pool grows one tensor at a time (the device holds one grown tensor beside the pool, never
    a second pool). An out-of-memory error midway (faked: a CPU has none) leaves the pool's pages and
    the session's positions as they were; the retry grows only the tensors left, and the cache
    answers exactly."""
    ids_a, _ids_b, ref_a, _ref_b, features, _common = two_questions
    text = llava.config.text_config
    pool = KVPool(text.num_hidden_layers, llava.num_kv_heads, llava.head_dim, llava.dtype, "cpu", num_pages=1)
    cache = pool.new_cache()
    llava.prefill(cache, ids_a[:10], features)
    grown, calls = paged_kv._grown, []

    def out_of_memory_at_the_third(t, num_pages):
        calls.append(num_pages)
        if len(calls) == 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return grown(t, num_pages)

    monkeypatch.setattr(paged_kv, "_grown", out_of_memory_at_the_third)
    with pytest.raises(torch.OutOfMemoryError):
        llava.prefill(cache, ids_a, features)
    assert pool.pool.num_pages == pool.pages.num_pages == 1 and cache.table.num_tokens == 10
    tensors = len(pool.pages.keys) + len(pool.pages.values)
    grew = [t.shape[0] > 1 for t in pool.pages.keys + pool.pages.values]
    assert grew == [True, True] + [False] * (tensors - 2)  # two grew before the error
    tokens = [int(llava.prefill(cache, ids_a, features).argmax())]
    assert len(calls) == 3 + tensors - 2  # the retry grew the others, not those two again
    while len(tokens) < N:
        tokens.append(int(llava.decode(cache, tokens[-1]).argmax()))
    assert tokens == ref_a
    assert {t.shape[0] for t in pool.pages.keys + pool.pages.values} == {pool.pool.num_pages}
    pool.check([cache.table])


def test_the_worker_holds_every_session_s_kv_in_a_pool_that_grows_on_a_cpu(llava) -> None:
    """One engine on every device: the worker's engine keeps the sessions' KV in the pool's pages on a
    CPU too, the pool growing with them (a GPU's is fixed at the budget at start)."""
    from llava_sessions.config import Settings
    from llava_sessions.worker import build_engine

    runner = build_engine(Settings(device_budget_bytes=10**9), llava).runner
    assert runner.page_size == PAGE and not runner.pool.fixed and runner.graphs is None
