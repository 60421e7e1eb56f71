"""Batched decode inside one worker, in process (no TorchServe): the GPU rows of the concurrency table.

``benchmarks/concurrency.py`` measures the same things over HTTP through a real TorchServe. This
script drives the :class:`~llava_sessions.engine.SessionEngine` and its scheduler step directly, so
it runs where TorchServe (Java) is not installed, e.g. a bare GPU machine, and it can build the
``7b``-shaped random checkpoint (llava-1.5-7b's exact architecture) in memory on a GPU.

Measured side by side in one run:

1. **Exactness**: ``--check-sessions`` sessions with different context lengths (each has a
   different number of remembered turns) answer one question together (one batched decode) and
   each alone; greedy tokens compared row by row (fp32 must match exactly; bf16 is reported).
2. **Aggregate decode tokens/s** at each level of ``--levels`` concurrent sessions: every session
   asks at once for ``--new-tokens`` greedy tokens; tokens generated / wall time from the first
   step to the last; ratio to one session alone. Levels run in rounds; the median round counts.
3. **Inter-token latency while sessions open**: ``--streams`` answers decode (a) alone and (b)
   while an open (vision tower + prefix prefill, chunked by the step's time budget) is always in
   flight; each scheduler step is one inter-token gap of every stream. p50 / p99 and the ratio.
4. **Sessions held hot at once**: the device budget the worker would use
   (``device_budget_fraction`` of free memory) divided by what one session holds in the KV tier
   (its prefix KV + image features), next to ``max_sessions``.

Usage:
    python benchmarks/engine_decode.py --model bench
    python benchmarks/engine_decode.py --model 7b --device cuda --dtype bfloat16 --json out.json
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from llava_sessions.config import Settings
from llava_sessions.conversation import Chat
from llava_sessions.engine import (
    EngineLimits,
    ImagePrefill,
    Sequence,
    SessionEngine,
    TimeBudget,
    default_device_budget,
)
from llava_sessions.images.fetch import decode_image
from llava_sessions.model import LlavaModel
from llava_sessions.sampling.sampler import SamplingParams
from llava_sessions.sessions.store import SessionStore
from llava_tools.demo.samples import sample_photo

PHOTOS = ("astronaut", "chelsea", "coffee", "rocket")
QUESTION = "Describe this image in great detail, please."


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA is asynchronous)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def pct(values: list[float], q: int) -> float | None:
    """The ``q``-th percentile (interpolated), rounded to 0.01; None without values."""
    if len(values) < 2:
        return round(values[0], 2) if values else None
    return round(statistics.quantiles(values, n=100)[q - 1], 2)


def build_runner(args: argparse.Namespace) -> LlavaModel:
    """Load ``--model-dir``, build the ``7b`` shape in memory, or write and load a random checkpoint."""
    torch.manual_seed(0)
    if args.model_dir:
        return LlavaModel.from_pretrained(args.model_dir, device=args.device, dtype=args.dtype)
    if args.model == "7b":
        from llava_tools.tiny_model import build_model

        dtype = torch.float16 if args.dtype == "float16" else torch.bfloat16
        model, processor = build_model("7b", device="cuda" if args.device == "auto" else args.device, dtype=dtype)
        return LlavaModel(model, processor)
    from llava_tools.tiny_model import write_checkpoint

    folder = tempfile.mkdtemp(prefix=f"llava-{args.model}-")
    write_checkpoint(args.model, folder)
    return LlavaModel.from_pretrained(folder, device=args.device, dtype=args.dtype)


def run_together(engine: SessionEngine, work: list, budget: int | TimeBudget | None) -> tuple[float, list[float]]:
    """Step ``work`` until all of it is done; returns (wall s, durations in ms of steps that decoded)."""
    device = engine.model.device
    steps: list[float] = []
    t0 = time.perf_counter()
    while not all(w.done for w in work):
        decoding = any(isinstance(w, Sequence) and not w.done and w.prefilled for w in work)
        s0 = time.perf_counter()
        engine.step(work, prefill_budget=budget)
        sync(device)
        if decoding:
            steps.append((time.perf_counter() - s0) * 1000)
    return time.perf_counter() - t0, steps


def check_exact(engine: SessionEngine, images: list[bytes], n: int, new_tokens: int) -> dict:
    """Greedy tokens of ``n`` sessions (different context lengths) batched vs each alone."""
    params = SamplingParams(max_new_tokens=new_tokens)
    sids = []
    for i in range(n):
        sid = f"check{i}"
        engine.open(sid, images[i % len(images)])
        for turn in range(i):  # session i remembers i turns: context lengths differ
            engine.generate(sid, f"Question {turn}: what do you see?", SamplingParams(max_new_tokens=6 + 3 * turn))
        sids.append(sid)
    alone = [[t.id for t in engine.generate(sid, QUESTION, params, remember=False).tokens] for sid in sids]
    gens = [engine.start(sid, QUESTION, params, remember=False) for sid in sids]
    run_together(engine, gens, None)
    together = []
    for g in gens:
        assert g.answer is not None, g.error
        together.append([t.id for t in g.answer.tokens])
    contexts = [engine.store.ledger.entry(sid).num_kv_tokens for sid in sids]
    for sid in sids:
        engine.close(sid)
    same = sum(a == b for a, b in zip(alone, together, strict=True))
    return {
        "sessions": n,
        "context_tokens": contexts,
        "identical": same,
        "first_difference_at": first_differences(alone, together),
    }


def first_differences(a: list[list[int]], b: list[list[int]]) -> list[int | None]:
    """Per row, the index of the first token where ``a`` and ``b`` differ (None where equal)."""
    return [
        next((k for k, (x, y) in enumerate(zip(r, q, strict=False)) if x != y), None) for r, q in zip(a, b, strict=True)
    ]


def aggregate(engine: SessionEngine, images: list[bytes], levels: list[int], rounds: int, new_tokens: int) -> dict:
    """Aggregate decode tokens/s per level (median round) and the ratio to one session."""
    sids = [f"agg{i}" for i in range(max(levels))]
    for i, sid in enumerate(sids):
        engine.open(sid, images[i % len(images)])
    params = SamplingParams(max_new_tokens=new_tokens)
    for sid in sids:  # warm-up: every session's first follow-up
        engine.generate(sid, QUESTION, SamplingParams(max_new_tokens=2), remember=False)
    warm = [engine.start(sid, QUESTION, params, remember=False) for sid in sids]
    run_together(engine, warm, None)  # warm-up: the largest batch shape
    rates: dict[int, list[float]] = {n: [] for n in levels}
    step_ms: dict[int, list[float]] = {n: [] for n in levels}
    for _ in range(rounds):
        for n in levels:
            gens = [engine.start(sid, QUESTION, params, remember=False) for sid in sids[:n]]
            for g in gens:  # prefill (the first token) before the clock: this part measures decode
                engine.step([g])
            sync(engine.model.device)
            wall, steps = run_together(engine, gens, None)
            tokens = sum(len(g.answer.tokens) - 1 for g in gens if g.answer is not None)
            rates[n].append(tokens / wall)
            step_ms[n].append(statistics.median(steps) if steps else 0.0)
    for sid in sids:
        engine.close(sid)
    med = {n: statistics.median(v) for n, v in rates.items()}
    base = med[levels[0]] if levels[0] == 1 else None
    return {
        str(n): {
            "tokens_per_s": round(med[n], 1),
            "ratio_to_one": round(med[n] / base, 2) if base else None,
            "step_ms_median": round(statistics.median(step_ms[n]), 2),
        }
        for n in levels
    }


def itl_while_opening(
    engine: SessionEngine, images: list[bytes], streams: int, new_tokens: int, budget: TimeBudget, rounds: int
) -> dict:
    """Step durations (= inter-token gaps) of ``streams`` answers, quiet vs with opens in flight."""
    sids = [f"itl{i}" for i in range(streams)]
    for i, sid in enumerate(sids):
        engine.open(sid, images[i % len(images)])
        engine.generate(sid, QUESTION, SamplingParams(max_new_tokens=2), remember=False)
    params = SamplingParams(max_new_tokens=new_tokens)
    quiet: list[float] = []
    busy: list[float] = []
    opened = 0
    for _ in range(rounds):
        gens = [engine.start(sid, QUESTION, params, remember=False) for sid in sids]
        _, steps = run_together(engine, gens, budget)
        quiet += steps[1:]
        gens = [engine.start(sid, QUESTION, params, remember=False) for sid in sids]
        opening: ImagePrefill | None = None
        while not all(g.done for g in gens):
            if opening is None or opening.done:
                if opening is not None:
                    engine.close(opening.session_id)
                    opened += 1
                opening = engine.begin_open(f"new{opened}", images[opened % len(images)])
            decoding = any(not g.done and g.prefilled for g in gens)
            s0 = time.perf_counter()
            engine.step([*gens, opening], prefill_budget=budget)
            sync(engine.model.device)
            if decoding:
                busy.append((time.perf_counter() - s0) * 1000)
        if opening is not None:
            while not opening.done:
                engine.step([opening])
            engine.close(opening.session_id)
            opened += 1
    for sid in sids:
        engine.close(sid)
    q99, b99 = pct(quiet, 99), pct(busy, 99)
    return {
        "streams": streams,
        "step_budget": {
            "max_step_ms_while_decoding": budget.step_ms,
            "max_prefill_tokens_per_pass": budget.max_pass_tokens,
        },
        "opens_completed": opened,
        "quiet_ms": {"p50": pct(quiet, 50), "p99": q99},
        "opening_ms": {"p50": pct(busy, 50), "p99": b99},
        "p99_ratio": round(b99 / q99, 2) if q99 and b99 else None,
    }


def hot_sessions(engine: SessionEngine, images: list[bytes], settings: Settings) -> dict:
    """How many sessions the default device budget holds in the KV tier (prefix KV + features)."""
    engine.open("hot", images[0])
    entry = engine.store.ledger.entry("hot")
    per_session = entry.num_kv_tokens * engine.model.kv_bytes_per_token + entry.num_feature_bytes
    engine.close("hot")
    budget = default_device_budget(engine.model, settings.device_budget_fraction)
    return {
        "device_budget_bytes": budget,
        "device_budget_fraction": settings.device_budget_fraction,
        "bytes_per_session_kv_tier": per_session,
        "sessions_hot_by_budget": budget // per_session,
        "max_sessions_setting": settings.max_sessions,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="bench", choices=["tiny", "bench", "7b"])
    ap.add_argument("--model-dir", default=None, help="a checkpoint folder instead of a random-weight one")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    ap.add_argument("--levels", default="1,2,4,8,16", help="concurrent sessions, comma-separated (start with 1)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--check-sessions", type=int, default=4)
    ap.add_argument("--skip-itl", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    llava = build_runner(args)
    settings = Settings.from_sources({}, {})
    store = SessionStore(
        device_budget_bytes=1 << 45,
        host_budget_bytes=1 << 40,
        kv_bytes_per_token=llava.kv_bytes_per_token,
        max_sessions=4096,
    )
    engine = SessionEngine(
        llava,
        store,
        functools.partial(decode_image, max_pixels=settings.max_image_pixels),
        EngineLimits(max_new_tokens_cap=4096),
    )
    images = [sample_photo(p) for p in PHOTOS]
    levels = [int(x) for x in args.levels.split(",")]
    budget = TimeBudget(settings.max_step_ms_while_decoding, settings.max_prefill_tokens_per_pass)  # the default
    device = llava.device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    report: dict = {
        "model": args.model_dir or args.model,
        "device": f"{device} ({name})",
        "dtype": str(llava.dtype),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "new_tokens": args.new_tokens,
        "rounds": args.rounds,
        "prefix_tokens": len(llava.template.prefix_ids(Chat(None, image_tokens=(llava.num_image_tokens,)))),
    }
    print(json.dumps(report), flush=True)
    report["exactness"] = check_exact(engine, images, args.check_sessions, 24)
    print("exactness", json.dumps(report["exactness"]), flush=True)
    report["aggregate"] = aggregate(engine, images, levels, args.rounds, args.new_tokens)
    print("aggregate", json.dumps(report["aggregate"]), flush=True)
    if not args.skip_itl:
        report["itl"] = itl_while_opening(engine, images, args.streams, args.new_tokens, budget, args.rounds)
        print("itl", json.dumps(report["itl"]), flush=True)
    report["hot"] = hot_sessions(engine, images, settings)
    print("hot", json.dumps(report["hot"]), flush=True)
    if device.type == "cuda":
        report["peak_gpu_bytes"] = torch.cuda.max_memory_allocated(device)
    print(f"\n{report['model']} on {report['device']}, {report['dtype']}, {args.new_tokens} greedy tokens per answer")
    print(f"{'sessions':>9}{'tok/s':>10}{'vs one':>8}{'step ms':>9}")
    for n, row in report["aggregate"].items():
        print(f"{n:>9}{row['tokens_per_s']:>10.1f}{row['ratio_to_one'] or 0:>7.2f}x{row['step_ms_median']:>9.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
