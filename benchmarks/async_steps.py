"""Async scheduling against decode steps in step with the host, side by side in one engine (issue 59 item 2).

With async scheduling (``handler/llava_sessions/engine/ahead.py``) a decode step replayed as a CUDA graph
launches the next step, fed the tokens it chose on the GPU, before the host reads and records them;
without it the GPU idles while the host records each step's tokens. Measured here, in one engine (its
static step; async scheduling turned off and on between runs, alternating, the same sessions): the wall
time of whole answers decoded by ``n`` sessions at once, the device synchronized only at the start and
the end (a sync after each step would hide what async scheduling overlaps), as ms per step and tokens/s,
and the ratio. The greedy tokens of the two ways must agree.

On a CPU the device runs each pass before the call returns, so nothing overlaps: the ratio there is what
the bookkeeping costs, not what a GPU gains.

Usage: python benchmarks/async_steps.py [--device cuda] [--model tiny|bench|7b] [--levels 1,8,32]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from engine_decode import build_runner, sync
from llava_sessions.engine import SessionEngine
from llava_sessions.sampling.sampler import SamplingParams
from llava_tools.demo.samples import sample_photo

QUESTION = "Describe this image in great detail, please."
PHOTOS = ("astronaut", "coffee", "chelsea", "rocket")


def decode_wall(engine: SessionEngine, sids: list[str], new_tokens: int) -> tuple[float, int, list[list[int]]]:
    """Greedy answers of ``sids`` at once: (wall seconds of their decode steps, tokens those steps
    made, each answer's token ids). The prompts are prefilled before the clock starts."""
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    gens = [engine.start(sid, QUESTION, params, remember=False) for sid in sids]
    while not all(g.prefilled for g in gens):
        engine.step([g for g in gens if not g.prefilled])
    before = sum(len(g.events) for g in gens)
    sync(engine.model.device)
    t0 = time.perf_counter()
    while not all(g.done for g in gens):
        engine.step([g for g in gens if not g.done])
    sync(engine.model.device)
    wall = time.perf_counter() - t0
    answers = [[t.id for t in g.answer.tokens] for g in gens if g.answer is not None]
    return wall, sum(len(a) for a in answers) - before, answers


def table(engine: SessionEngine, images: list[bytes], levels: list[int], new_tokens: int, repeats: int) -> dict:
    """Per level ``n``: ms per decode step and tokens/s, in step and ahead (medians of ``repeats``
    alternating runs), the ratio of their tokens/s, and whether their tokens agree.

    Raises:
        ValueError: ``engine`` has no async scheduling (no static decode step, or turned off).
    """
    executor = engine._execute  # the benchmark turns the engine's async scheduling off and on again
    ahead = executor.ahead
    if ahead is None:
        raise ValueError("the engine has no async scheduling: its decode step is not static, or it is off")
    sids = [f"async{i}" for i in range(max(levels))]
    for i, sid in enumerate(sids):
        engine.open(sid, images[i % len(images)])
    decode_wall(engine, sids, 4)  # warm
    rows: dict[str, dict] = {}
    try:
        for n in levels:
            runs: dict[str, list[tuple[float, int]]] = {"in_step": [], "ahead": []}
            tokens: dict[str, list[list[int]]] = {}
            for _ in range(repeats):
                for way in ("in_step", "ahead"):
                    executor.ahead = ahead if way == "ahead" else None
                    wall, made, tokens[way] = decode_wall(engine, sids[:n], new_tokens)
                    runs[way].append((wall, made))
            rows[str(n)] = _row(runs, n, tokens["in_step"] == tokens["ahead"])
    finally:
        executor.ahead = ahead
        for sid in sids:
            engine.close(sid)
    return {"rows": rows, "steps_ahead": ahead.num_steps}


def _row(runs: dict[str, list[tuple[float, int]]], n: int, same: bool) -> dict:
    out: dict = {"same_tokens": same}
    for way, measured in runs.items():
        per_s = statistics.median(made / wall for wall, made in measured)
        out[way] = {"tokens_per_s": round(per_s, 1), "ms_per_step": round(1000 * n / per_s, 3)}
    out["ahead_vs_in_step"] = round(out["ahead"]["tokens_per_s"] / out["in_step"]["tokens_per_s"], 3)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", choices=["tiny", "bench", "7b"])
    ap.add_argument("--model-dir", default=None, help="a checkpoint folder instead of a random-weight one")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", help="bfloat16, float16 or float32")
    ap.add_argument("--levels", default="1,8", help="concurrent sessions, comma-separated")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    from gpu import new_engine  # noqa: PLC0415 - the GPU table's engine: a static step on any device

    llava = build_runner(args)
    engine = new_engine(llava, True, async_scheduling=True)
    images = [sample_photo(p) for p in PHOTOS]
    report = table(engine, images, [int(x) for x in args.levels.split(",")], args.new_tokens, args.repeats)
    print(json.dumps({"device": str(llava.device), "model": args.model_dir or args.model, **report}, indent=2))
    return 0 if all(r["same_tokens"] for r in report["rows"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
