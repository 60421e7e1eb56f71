"""A long session at the context's limit: how much of each turn's prompt the KV cache serves, by
``truncation_headroom``, side by side in one run.

For each headroom, a fresh worker (``--model``, built with a ``--context``-token context, CPU fp32,
in process through ``SessionService``) opens a session on the sample photo and asks ``--turns``
questions in it, each answer ``--max-new-tokens`` long and remembered. Once the conversation first
reaches the context's limit (a turn reports ``truncated_turns`` > 0), every turn from then on is "at
the limit"; over the first ``--at-limit`` of them it prints the mean share of prompt tokens served
from the cache (``cached_tokens / prompt_tokens``), the mean turn time (ms) and the mean number of
remembered turns the model saw (what the headroom costs in memory of the conversation).

Usage: python benchmarks/long_session.py [--model tiny] [--headroom 0 0.125 0.25 0.375 0.5]
"""

from __future__ import annotations

import argparse
import base64
import json
import statistics
import tempfile
import time
from pathlib import Path

from llava_sessions.wire.in_flight import BatchRequest
from llava_sessions.worker import build_service
from llava_tools.demo.samples import sample_photo
from llava_tools.tiny_model import write_checkpoint

QUESTIONS = [
    "What is in this image?",
    "Describe the colours you see.",
    "What might have happened just before?",
    "Is there anything unusual here?",
    "Tell me more about the background.",
]


def run(model_dir: Path, headroom: float, args: argparse.Namespace) -> dict[str, float]:
    """One session of ``args.turns`` turns under ``headroom``; the means over the turns at the limit."""
    settings = {"model_dir": str(model_dir), "device": "cpu", "dtype": "float32", "truncation_headroom": headroom}
    service = build_service({**settings, "device_budget_bytes": 2 * 10**9, "cpu_memory_reserve_bytes": 0})

    def call(rid: str, body: dict) -> dict:
        row = BatchRequest(rid, "long-1", False, body)
        while True:
            out = service.handle([row])[0]
            if out.stop is not False:
                return json.loads(out.body)
            row = BatchRequest(rid, "long-1", False, None)

    image = base64.b64encode(sample_photo()).decode()
    call("open", {"type": "open_session", "image": {"base64": image}})
    shares, times, seen, at_limit = [], [], [], False
    for i in range(args.turns):
        body = {"type": "generate", "prompt": QUESTIONS[i % len(QUESTIONS)]}
        body["parameters"] = {"max_new_tokens": args.max_new_tokens, "details": False}
        t0 = time.perf_counter()
        details = call(f"q{i}", body)["details"]
        ms = (time.perf_counter() - t0) * 1000.0
        at_limit = at_limit or details["truncated_turns"] > 0
        if at_limit and len(shares) < args.at_limit:
            shares.append(details["cached_tokens"] / details["prompt_tokens"])
            times.append(ms)
            seen.append(len(service.engine.history("long-1")))
    if len(shares) < args.at_limit:
        raise SystemExit(f"only {len(shares)} turns reached the limit: raise --turns")
    return {"cached": statistics.mean(shares), "ms": statistics.mean(times), "turns_seen": statistics.mean(seen)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["tiny", "bench"], default="tiny")
    parser.add_argument("--context", type=int, default=1024, help="the checkpoint's context, tokens")
    parser.add_argument("--turns", type=int, default=40)
    parser.add_argument("--at-limit", type=int, default=10, help="turns at the limit averaged")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--headroom", type=float, nargs="+", default=[0.0, 0.125, 0.25, 0.375, 0.5])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_checkpoint(args.model, Path(tmp) / args.model, seed=0, max_positions=args.context)
        print(f"{args.model}, context {args.context}, answers of {args.max_new_tokens} tokens, {args.at_limit} turns")
        print("| truncation_headroom | prompt tokens cached | ms per turn | turns the model saw |")
        print("|---:|---:|---:|---:|")
        for headroom in args.headroom:
            r = run(model_dir, headroom, args)
            print(f"| {headroom:g} | {r['cached']:.1%} | {r['ms']:.0f} | {r['turns_seen']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
