"""The decode step at static shapes (issue 43 item 3): what a GPU captures as CUDA graphs and replays.

Nothing is captured on this CPU (CUDA graphs need a CUDA device; ``benchmarks/gpu.py`` checks replay
against eager on a GPU). What runs here is the pass a graph records, eagerly, over the same
persistent buffers a replay reads: the rows padded to a batch bucket with pad rows on the scratch
page, the attended length padded to a length bucket, every input overwritten before the step. fp32
greedy tokens through it equal ``model.generate``'s, and it writes nothing but each row's new slot
and the scratch page.
"""

from __future__ import annotations

import pytest
import torch

from llava_sessions.model.gpu.graphs import DecodeGraphs, batch_buckets, length_buckets
from llava_sessions.model.kv.paged import KVPool, SessionKV
from llava_sessions.model.kv.pages import PageTable, reserve

N = 12
PAGE = 16


def test_buckets_are_nano_vllms_batch_sizes_and_lengths_at_most_a_quarter_apart() -> None:
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20] and batch_buckets(3) == [1, 2, 3] and batch_buckets(0) == []
    lengths = length_buckets(4096, 16)
    assert lengths == [512, 640, 768, 896, 1024, 1280, 1536, 1792, 2048, 2560, 3072, 3584, 4096]
    assert all(b <= 1.25 * a for a, b in zip(lengths, lengths[1:], strict=False))
    assert length_buckets(1000, 16) == [512, 640, 768, 896, 1008] and length_buckets(300, 16) == [304]
    assert all(n % 48 == 0 for n in length_buckets(4096, 48)) and length_buckets(4096, 48)[-1] == 4128


def new_pool(llava, num_pages: int, fixed: bool = True) -> KVPool:
    text = llava.config.text_config
    shape = (text.num_hidden_layers, llava.num_kv_heads, llava.head_dim, llava.dtype, llava.device)
    return KVPool(*shape, page_size=PAGE, num_pages=num_pages, fixed=fixed)


def test_a_fixed_pool_never_grows_and_a_holder_it_cannot_hold_gets_out_of_memory(llava) -> None:
    """A GPU's pool is sized once: a reservation past its free pages raises the allocator's error
    (on which the engine demotes idle sessions and retries), with the table and the tensors as before."""
    pool = new_pool(llava, 4)
    storage = [t.data_ptr() for t in pool.pages.keys + pool.pages.values]
    table = PageTable()
    pool.make_room(table, 4 * PAGE)
    with pytest.raises(torch.OutOfMemoryError):
        pool.make_room(table, 1)
    assert table.num_tokens == 4 * PAGE and len(table.pages) == 4 and pool.pool.num_free_pages == 0
    assert pool.num_grows == 0 and [t.data_ptr() for t in pool.pages.keys + pool.pages.values] == storage


def prompts(llava) -> list[list[int]]:
    """Three chat prompts of different lengths (text only); the longest crosses 512 positions while
    it answers, so its step moves from the 512 bucket to the next."""
    tok = llava.processor.tokenizer
    lengths = [9, 60, 512 - N // 2]
    out = []
    for n in lengths:
        ids = tok("Describe the view from the window in a few words, please. " * 60)["input_ids"]
        out.append(ids[:n])
    return out


def reference(llava, ids: list[int]) -> list[int]:
    with torch.inference_mode():
        ids_t = torch.tensor([ids], device=llava.device)  # the model's device (tests/gpu runs this on a GPU)
        out = llava.model.generate(input_ids=ids_t, max_new_tokens=N, min_new_tokens=N, do_sample=False)
    return out[0, len(ids) :].tolist()


def changed_slots(pool: KVPool, before: list[torch.Tensor]) -> set[int]:
    """Slots of any layer whose keys or values differ from ``before`` (the tensors' earlier copies)."""
    now = pool.pages.keys + pool.pages.values
    slots: set[int] = set()
    for old, new in zip(before, now, strict=True):
        diff = (old != new).reshape(old.shape[0] * PAGE, -1).any(-1)
        slots |= set(diff.nonzero().flatten().tolist())
    return slots


@pytest.mark.parametrize("paged_read", ["gather", "flex", "auto"])
def test_the_static_step_answers_as_generate_and_writes_only_each_rows_new_slot(llava, paged_read) -> None:
    """Rows join and leave (3 rows run in the 4-row bucket with a pad row); each row's fed token is
    written at its new slot and nowhere else but the scratch page; the greedy tokens equal
    ``model.generate``'s for each prompt alone, whether attention gathers the rows' slots, reads the
    pool through FlexAttention's block mask (``flex``: eager on the CPU), or (``auto``, FlexAttention
    from 2 rows here) one step one way and the next the other."""
    pool = new_pool(llava, 200)
    ids = prompts(llava)
    caches = [SessionKV(pool) for _ in ids]
    tokens = [[int(llava.prefill(c, p, None).argmax())] for c, p in zip(caches, ids, strict=True)]
    graphs = DecodeGraphs(llava, pool, max_rows=8, max_len=llava.max_positions, paged_read=paged_read, flex_rows=2)
    scratch = set(range(graphs.table.pages[0] * PAGE, (graphs.table.pages[0] + 1) * PAGE))
    plan = [[0], [0, 1], [0, 1, 2], [2, 0, 1], [1, 2]] + [[0, 1, 2]] * (N + 2)
    buckets = set()
    for rows in plan:
        rows = [r for r in rows if len(tokens[r]) < N]
        if not rows:
            continue
        for r in rows:
            assert reserve(pool.pool, caches[r].table, 1) == []
        tables = [caches[r].table for r in rows]
        before = [t.clone() for t in pool.pages.keys + pool.pages.values]
        logits = graphs.run(tables, [tokens[r][-1] for r in rows])
        assert logits is not None and logits.shape[0] == len(rows)
        new = {t.pages[(t.num_tokens - 1) // PAGE] * PAGE + (t.num_tokens - 1) % PAGE for t in tables}
        assert new <= changed_slots(pool, before) <= new | scratch
        buckets.add(graphs.bucket(len(rows), max(t.num_tokens for t in tables)))
        for i, r in enumerate(rows):
            tokens[r].append(int(logits[i].argmax()))
    assert tokens == [reference(llava, p) for p in ids]
    top = graphs.lengths[-1]  # a bucket read with FlexAttention reads the whole pool: one length
    expected = {
        "gather": {(1, 512), (4, 512), (4, 640)},
        "flex": {(1, top), (4, top)},
        "auto": {(1, 512), (4, top)},
    }[paged_read]
    assert expected <= buckets and graphs.steps.num_eager > N and graphs.steps.num_replays == 0
    lengths = {L for _, L in buckets}  # a flex bucket's is the whole pool's; the gather never reaches it here
    assert all(n == top for b, n in buckets if graphs.reads_flex(b)) and (top in lengths) == (paged_read != "gather")
    fours = {b for b in graphs.buckets if b[0] == 4}  # what a GPU would capture for 4 rows
    assert fours == ({(4, top)} if paged_read != "gather" else {(4, L) for L in graphs.lengths})
    pool.check([*(c.table for c in caches), graphs.table])


@pytest.mark.parametrize("paged_read", ["gather", "flex"])
def test_a_short_chunk_prefilled_as_the_rows_of_one_step_answers_as_generate(llava, paged_read) -> None:
    """A follow-up's 40 tokens after a 300-token prefix (forked from another holder, so its partly
    written last page is shared and copied on write) go in as 40 rows of one static step (the 48-row
    bucket): each row writes its slot and attends to the positions up to its own, so the last row's
    logits and the greedy answer decoded after it equal ``model.generate``'s on the whole prompt; a
    chunk larger than every bucket is handed back with nothing reserved."""
    pool = new_pool(llava, 200)
    ids = prompts(llava)[2][:340]
    first = SessionKV(pool)
    llava.prefill(first, ids[:300], None)
    session = first.fork(300)  # the prefix's pages by reference; its last (partial) one shared
    graphs = DecodeGraphs(llava, pool, max_rows=64, max_len=llava.max_positions, paged_read=paged_read)
    assert graphs.prefill(session.table, list(range(5, 70))) is None and session.table.num_tokens == 300
    logits = graphs.prefill(session.table, ids[300:])
    assert logits is not None and session.table.num_tokens == 340 and graphs.num_prefills == 1
    assert session.table.pages[:18] == first.table.pages[:18] and session.table.pages[18] != first.table.pages[18]
    tokens = [int(logits.argmax())]
    while len(tokens) < N:
        assert reserve(pool.pool, session.table, 1) == []
        tokens.append(int(graphs.run([session.table], [tokens[-1]])[0].argmax()))
    assert tokens == reference(llava, ids)
    pool.check([first.table, session.table, graphs.table])


def test_a_step_larger_than_every_bucket_is_left_to_the_caller_and_close_frees_the_scratch_page(llava) -> None:
    pool = new_pool(llava, 64)
    free = pool.pool.num_free_pages
    graphs = DecodeGraphs(llava, pool, max_rows=2, max_len=512)
    assert pool.pool.num_free_pages == free - 1 and graphs.rows == [1, 2] and graphs.lengths == [512]
    tables = []
    for n in (3, 5, 7):
        tables.append(PageTable())
        pool.make_room(tables[-1], n)
    before = [t.clone() for t in pool.pages.keys + pool.pages.values]
    assert graphs.run(tables, [1, 2, 3]) is None  # three rows: no bucket holds them
    pool.make_room(tables[0], 512)
    assert graphs.run(tables[:1], [1]) is None  # 515 positions: longer than every bucket
    assert changed_slots(pool, before) == set()  # nothing written
    graphs.close()
    pool.check(tables)


def _flex_case(dim: int) -> tuple:
    """Two rows sharing a whole first page (a shared prefix), then each its own partial page (37 and 20
    positions: 5 and 4 of 16 in their last page), in a pool whose other slots hold random keys; the
    queries; and SDPA over each row's positions gathered (the expected output)."""
    torch.manual_seed(0)
    heads, kv_heads, pages_n = 4, 2, 6
    keys = torch.randn(pages_n * PAGE, kv_heads, dim)
    values = torch.randn(pages_n * PAGE, kv_heads, dim)
    query = torch.randn(2, heads, 1, dim)
    pool_k, pool_v = (t.view(1, -1, kv_heads, dim).transpose(1, 2) for t in (keys, values))

    def expected(tables: list[list[int]], lengths: list[int]) -> list[torch.Tensor]:
        out = []
        for r, (table, n) in enumerate(zip(tables, lengths, strict=True)):
            slots = torch.tensor([p * PAGE + i for p in table for i in range(PAGE)][:n])
            k, v = keys[slots].transpose(0, 1)[None], values[slots].transpose(0, 1)[None]
            out.append(torch.nn.functional.scaled_dot_product_attention(query[r : r + 1], k, v, enable_gqa=True))
        return out

    return query, pool_k, pool_v, pages_n, expected


def test_flex_over_pages_reads_each_rows_own_positions_of_shared_pages_and_no_free_tail() -> None:
    """:mod:`~llava_sessions.model.kv.flex` (the unfused FlexAttention a CPU runs, which applies the
    mask function everywhere): every other slot of the pool holds random keys, so a read past a row's
    length or into the other row's page would change the output. Through the block mask the output
    equals SDPA over each row's positions gathered (fp32, grouped-query heads); the mask reads the
    buffers themselves, so the next step's fill changes what the same mask object reads."""
    from llava_sessions.model.kv.flex import PageBlocks, paged_flex_attention

    query, pool_k, pool_v, pages_n, expected = _flex_case(8)
    blocks = PageBlocks(4, pages_n, PAGE, torch.device("cpu"))
    for tables, lengths in (([[3, 1, 4], [3, 5]], [37, 20]), ([[2], [3, 1, 4]], [3, 40])):
        blocks.fill(tables, lengths)
        out, _ = paged_flex_attention(None, query, pool_k, pool_v, blocks.mask(2), scaling=8**-0.5)
        for r, want in enumerate(expected(tables, lengths)):
            assert torch.allclose(out[r : r + 1].transpose(1, 2), want, atol=1e-5), (tables, r)
    assert blocks.mask(2) is blocks.mask(2)


def test_compiled_flex_reads_whole_pages_unmasked_and_bounds_the_partial_one() -> None:
    """The fused kernel a GPU runs (``torch.compile(flex_attention)``; inductor's CPU template here,
    ~20 s to compile) calls the mask function on partial blocks only: whole pages are full blocks, the
    partial last page the one bounded block. Same case and expectation as the unfused test, the
    buffers refilled between the calls under one compiled kernel."""
    from torch.nn.attention.flex_attention import flex_attention

    from llava_sessions.model.kv.flex import PageBlocks

    query, pool_k, pool_v, pages_n, expected = _flex_case(64)
    blocks = PageBlocks(4, pages_n, PAGE, torch.device("cpu"))
    attend = torch.compile(flex_attention)
    for tables, lengths in (([[3, 1, 4], [3, 5]], [37, 20]), ([[2], [3, 1, 4]], [3, 40])):
        blocks.fill(tables, lengths)
        k, v = pool_k.expand(2, -1, -1, -1), pool_v.expand(2, -1, -1, -1)
        out = attend(query, k, v, block_mask=blocks.mask(2), scale=64**-0.5, enable_gqa=True)
        for r, want in enumerate(expected(tables, lengths)):
            assert torch.allclose(out[r : r + 1], want, atol=1e-5), (tables, r)


def test_no_collection_pauses_the_garbage_collector_for_a_capture_and_restores_it() -> None:
    """Graph captures run with Python's cyclic collector off (an earlier engine's graphs freed mid-capture
    invalidate it, seen on an H200): off inside, back on after, also after an error, and left off when
    it was off."""
    import gc

    from llava_sessions.model.gpu.graph_table import no_collection

    assert gc.isenabled()
    with no_collection():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), no_collection():
        raise RuntimeError("a failed capture")
    assert gc.isenabled()
    gc.disable()
    try:
        with no_collection():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
