"""The decode step over the KV pool's pages, read two ways, side by side in one run.

One model, ``--rows`` sessions on one photo, each asked its own question (prompt ~600 tokens on
``bench``), then decoding together. Measured, interleaved round by round, medians of ``--rounds``:

1. **the decode step**: ms per step of all rows in one forward pass over the pool through
   :class:`~llava_sessions.model.kv.paged.SlotsCache`, attention reading (a) each row's positions
   gathered from its pages and padded (a GPU's eager read), (b) each row's runs of consecutive pages
   as views of the pool (a CPU's, ``model/kv/runs.py``);
2. **the sessions' KV bytes**: what each session's own contiguous cache would hold (the image prefix
   copied into each) against the pool's pages held (the prefix's full pages once, by reference count).

Greedy tokens of both reads are compared for every row and step (fp32 must match).

Usage: python benchmarks/kv_pages.py [--model bench] [--rows 8] [--steps 16] [--rounds 3] [--json FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time

import torch

from llava_sessions.images.fetch import decode_image
from llava_sessions.model import LlavaModel
from llava_sessions.model.fused import attention_on
from llava_sessions.model.kv.paged import KVPages, SlotsCache
from llava_sessions.model.kv.pages import PagePool, PageTable, fork, release, reserve
from llava_sessions.model.kv.runs import PAGED_RUNS_ATTENTION, reading_runs
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="bench", choices=["tiny", "bench"])
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
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
            g_tokens, g_ms, held = paged_rows(llava, ids, feats, args.steps)
            r_tokens, r_ms, _ = paged_rows(llava, ids, feats, args.steps, runs=True)
        row = {"gathered_step_ms": g_ms, "runs_step_ms": r_ms, "identical": g_tokens == r_tokens}
        rounds.append(row)
        print(f"round {r}", json.dumps(row), flush=True)
    gathered = statistics.median(x["gathered_step_ms"] for x in rounds)
    runs_ms = statistics.median(x["runs_step_ms"] for x in rounds)
    own_bytes = sum(len(i) for i in ids) * llava.kv_bytes_per_token  # each session's prompt in a cache of its own
    report = {
        "model": args.model, "rows": args.rows, "prompt_tokens": [len(i) for i in ids], "page_size": PAGE,
        "decode_step_ms": {"gathered": round(gathered, 2), "runs": round(runs_ms, 2),
                           "runs_ratio": round(runs_ms / gathered, 2)},
        "kv_bytes": {"own_caches": own_bytes, "pages": held, "ratio": round(held / own_bytes, 3)},
        "identical_every_round": all(x["identical"] for x in rounds),
    }  # fmt: skip
    print(json.dumps(report, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f)
    return 0 if report["identical_every_round"] else 1


if __name__ == "__main__":
    sys.exit(main())
