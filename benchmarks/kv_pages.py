"""The KV pool in pages beside the contiguous decode batch, side by side in one run (issue 43).

One model, ``--rows`` sessions on one photo, each asked its own question (prompt ~600 tokens on
``bench``), then decoding together. Measured, interleaved round by round, medians of ``--rounds``:

1. **the decode step**: ms per step of all rows in one forward pass, (a) over the contiguous,
   left-padded :class:`~llava_sessions.model.kv.cache.BatchKVCache` the engine uses, (b) over the
   pool through :class:`~llava_sessions.model.kv.paged.SlotsCache` (attention reads each row's
   pages gathered);
2. **a row joining**: what laying the batch out anew costs the contiguous layout (every member's KV
   copied: bytes and ms) against the pool's (a row joins by its table: 0 bytes);
3. **the sessions' KV bytes**: each session's own contiguous cache (the image prefix copied into
   each) against the pool's pages held (the prefix's full pages once, by reference count).

Greedy tokens of both layouts are compared for every row and step (fp32 must match).

4. **the engine**, its sessions' KV in the pool against a ``DynamicCache`` each (``kv_page_size=0``),
   alternating round by round (``--engine-rounds``): follow-up TTFT at ``--context`` tokens, a cold
   image turn and batch-1 decode ms per token, as ``benchmarks/gpu.py`` measures them.

Usage: python benchmarks/kv_pages.py [--model bench] [--rows 8] [--steps 16] [--rounds 3]
       [--engine-rounds 2] [--context 600] [--json FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import statistics
import sys
import tempfile
import time

import torch

from llava_sessions.engine import EngineLimits, SessionEngine
from llava_sessions.images.fetch import decode_image
from llava_sessions.model import LlavaModel
from llava_sessions.model.fused import attention_on
from llava_sessions.model.kv.paged import KVPages, SlotsCache
from llava_sessions.model.kv.pages import PagePool, PageTable, fork, release, reserve
from llava_sessions.model.kv.runs import PAGED_RUNS_ATTENTION, reading_runs
from llava_sessions.sessions.store import SessionStore
from llava_tools.demo.samples import sample_photo
from llava_tools.tiny_model import write_checkpoint

PAGE = 16


def prompts(llava: LlavaModel, rows: int) -> tuple[list[list[int]], torch.Tensor]:
    """``rows`` chat-templated questions on one photo, and the photo's feature rows."""
    image = decode_image(sample_photo("astronaut"), max_pixels=40_000_000)
    out = []
    for i in range(rows):
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": f"Question {i}?"}]}]
        text = llava.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        out.append(llava.processor(text=text, images=image, return_tensors="pt")["input_ids"][0].tolist())
    return out, llava.encode_images([image])[0]


def contiguous_rows(llava: LlavaModel, ids: list[list[int]], feats: torch.Tensor, steps: int):
    """Each row prefilled into its own ``DynamicCache``; the batch built from them (timed: a join's
    rebuild); then ``steps`` decode steps. Returns (tokens per row, step ms, build ms, build bytes)."""
    caches, tokens = [], []
    for row in ids:
        cache = llava.new_cache()
        tokens.append([int(llava.prefill(cache, row, feats).argmax())])
        caches.append(cache)
    width = max(len(r) for r in ids)
    t0 = time.perf_counter()
    batch = llava.new_batch_cache(len(ids), width + steps + 1)
    mask = torch.zeros(len(ids), batch.capacity, dtype=torch.long)
    for r, cache in enumerate(caches):
        batch.load_row(r, cache, width)
        batch.zero_leading(r, width - len(ids[r]))
        mask[r, width - len(ids[r]) : width] = 1
    batch.set_length(width)
    build_ms = (time.perf_counter() - t0) * 1000
    build_bytes = sum(len(r) for r in ids) * llava.kv_bytes_per_token
    times = []
    for s in range(steps):
        col = batch.length
        mask[:, col] = 1
        t0 = time.perf_counter()
        logits = llava.decode_batch(batch, [t[-1] for t in tokens], [len(r) + s for r in ids], mask[:, : col + 1])
        times.append((time.perf_counter() - t0) * 1000)
        for r, t in enumerate(tokens):
            t.append(int(logits[r].argmax()))
    own_bytes = sum(len(r) for r in ids) * llava.kv_bytes_per_token
    return tokens, statistics.median(times), build_ms, build_bytes, own_bytes


def paged_rows(llava: LlavaModel, ids: list[list[int]], feats: torch.Tensor, steps: int, runs: bool = False):
    """The rows' shared image prefix prefilled once into the pool, each row a fork of it that
    prefills its question; then ``steps`` decode steps over the pages, attention reading each row's
    positions gathered, or with ``runs`` its runs of pages as views (``model/kv/runs.py``). Returns
    (tokens per row, step ms, bytes the pool's pages hold after the prefills)."""
    text = llava.config.text_config
    num_pages = sum(-(-(len(r) + steps) // PAGE) for r in ids) + 8
    kv = KVPages(text.num_hidden_layers, num_pages, PAGE, llava.num_kv_heads, llava.head_dim, llava.dtype, "cpu")
    pool = PagePool(num_pages, PAGE)
    common = min(next((i for i, (x, y) in enumerate(zip(ids[0], r, strict=False)) if x != y), len(r)) for r in ids[1:])
    prefix = PageTable()
    reserve(pool, prefix, common)
    llava.prefill(SlotsCache.of_sequence(kv, prefix, common), ids[0][:common], feats)
    tables, tokens = [], []
    for row in ids:
        table = fork(pool, prefix)
        kv.copy(reserve(pool, table, len(row) - common) or [])
        tokens.append([int(llava.prefill(SlotsCache.of_sequence(kv, table, len(row) - common), row, feats).argmax())])
        tables.append(table)
    release(pool, prefix)
    held = (pool.num_pages - pool.num_free_pages) * kv.bytes_per_page
    times = []
    for _ in range(steps):
        for table in tables:
            reserve(pool, table, 1)
        t0 = time.perf_counter()
        cache = SlotsCache.of_rows(kv, tables, runs=runs)
        reading = reading_runs(cache.runs) if cache.runs is not None else contextlib.nullcontext()
        on = attention_on(text, PAGED_RUNS_ATTENTION) if runs else contextlib.nullcontext()
        with torch.inference_mode(), reading, on:
            out = llava.model(
                input_ids=torch.tensor([[t[-1]] for t in tokens]),
                attention_mask=cache.attention_mask,
                position_ids=torch.tensor(cache.positions)[:, None],
                use_cache=True,
                **{llava._cache_kw: cache},
                logits_to_keep=1,
            )
        times.append((time.perf_counter() - t0) * 1000)
        for r, t in enumerate(tokens):
            t.append(int(out.logits[r, -1].argmax()))
    return tokens, statistics.median(times), held


def engine_side_by_side(llava: LlavaModel, rounds: int, context: int, new_tokens: int) -> dict:
    """The engine with its sessions' KV in the pool against ``DynamicCache``s (``kv_page_size=0``),
    alternating round by round on one model: :mod:`gpu`'s follow-up TTFT, cold image turn and batch-1
    decode (ms per token); medians, and pages / contiguous."""
    from gpu import ForwardClock, batch_one_decode, turns

    images = [sample_photo(p) for p in ("astronaut", "coffee", "chelsea")]
    runs: dict[int, list[dict]] = {PAGE: [], 0: []}
    for _ in range(rounds):
        for page_size in runs:
            store = SessionStore(device_budget_bytes=1 << 40, host_budget_bytes=1 << 40,
                                 kv_bytes_per_token=llava.kv_bytes_per_token)  # fmt: skip
            decode = functools.partial(decode_image, max_pixels=40_000_000)
            engine = SessionEngine(llava, store, decode, EngineLimits(max_new_tokens_cap=4096), kv_page_size=page_size)
            clock = ForwardClock(llava)
            one = batch_one_decode(engine, clock, images[1], context, new_tokens)
            clock.close()
            t = turns(engine, images, context, 3)
            runs[page_size].append({"follow_up_ttft_ms": t["follow_up"]["ttft_ms"],
                                    "cold_image_turn_ms": t["cold_image_turn_ms"],
                                    "decode_ms_per_token": one["ms_per_token"]})  # fmt: skip
            print(f"engine kv_page_size={page_size}", json.dumps(runs[page_size][-1]), flush=True)
    out: dict[str, dict] = {}
    for key in runs[PAGE][0]:
        paged = statistics.median(r[key] for r in runs[PAGE])
        contiguous = statistics.median(r[key] for r in runs[0])
        out[key] = {
            "pages": round(paged, 2),
            "dynamic_cache": round(contiguous, 2),
            "ratio": round(paged / contiguous, 2),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="bench", choices=["tiny", "bench"])
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--engine-rounds", type=int, default=2, help="rounds of the engine side by side (0: none)")
    ap.add_argument("--context", type=int, default=600, help="the engine's held session, tokens")
    ap.add_argument("--new-tokens", type=int, default=32, help="the engine's batch-1 answer, tokens")
    ap.add_argument("--json", default=None, help="also write the report here")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    folder = tempfile.mkdtemp(prefix=f"llava-{args.model}-")
    write_checkpoint(args.model, folder)
    llava = LlavaModel.from_pretrained(folder, device="cpu", dtype="float32")
    ids, feats = prompts(llava, args.rows)
    rounds = []
    for r in range(args.rounds):
        with torch.inference_mode():
            c_tokens, c_ms, build_ms, build_bytes, own_bytes = contiguous_rows(llava, ids, feats, args.steps)
            p_tokens, p_ms, held = paged_rows(llava, ids, feats, args.steps)
            r_tokens, r_ms, _ = paged_rows(llava, ids, feats, args.steps, runs=True)
        row = {"contiguous_step_ms": c_ms, "paged_step_ms": p_ms, "runs_step_ms": r_ms, "rebuild_ms": build_ms,
               "identical": c_tokens == p_tokens == r_tokens}  # fmt: skip
        rounds.append(row)
        print(f"round {r}", json.dumps(row), flush=True)
    c = statistics.median(x["contiguous_step_ms"] for x in rounds)
    p = statistics.median(x["paged_step_ms"] for x in rounds)
    runs_ms = statistics.median(x["runs_step_ms"] for x in rounds)
    report = {
        "model": args.model, "rows": args.rows, "prompt_tokens": [len(i) for i in ids], "page_size": PAGE,
        "decode_step_ms": {"contiguous": round(c, 2), "paged": round(p, 2), "ratio": round(p / c, 2),
                           "paged_runs": round(runs_ms, 2), "runs_ratio": round(runs_ms / c, 2)},
        "join": {"contiguous_rebuild_ms": round(statistics.median(x["rebuild_ms"] for x in rounds), 2),
                 "contiguous_rebuild_bytes": build_bytes, "paged_bytes": 0},
        "kv_bytes": {"contiguous": own_bytes, "paged": held, "ratio": round(held / own_bytes, 3)},
        "identical_every_round": all(x["identical"] for x in rounds),
    }  # fmt: skip
    if args.engine_rounds:
        report["engine"] = engine_side_by_side(llava, args.engine_rounds, args.context, args.new_tokens)
    print(json.dumps(report, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f)
    return 0 if report["identical_every_round"] else 1


if __name__ == "__main__":
    sys.exit(main())
