"""Eight image chats sent at once, ours alone: in process (the engine stepped directly) or over HTTP.

``vs_transformers_serve.py`` measures the same burst beside a peer, whose rounds share the machine's
drift with ours; this script measures only ours, so two commits can be compared run against run
(one checkout's code on ``PYTHONPATH``, the other's next). Each round sends ``--concurrent`` chat
requests without a session, each on a photo no round has seen (one pixel changed), asking
``--new-tokens`` greedy tokens with ``ignore_eos``, and reports the total tokens/s over the burst's
wall time and each request's TTFT (s, sorted: the staircase of first tokens).

- ``--mode engine`` (default): :meth:`SessionEngine.start_chat` for each request, then
  :meth:`SessionEngine.step` over all of them with the default time budget until every answer ends:
  no TorchServe, no HTTP; also the number of steps and the median step ms.
- ``--mode http``: a ``llava-serve`` started as a user starts it (default settings, 2 torch threads),
  its ``/v1/chat/completions`` streamed by ``vs_transformers_serve.Target``.

Prints one JSON line per round, then the median tokens/s.

Usage: python benchmarks/image_burst.py [--mode engine|http] [--rounds 3] [--concurrent 8] [--new-tokens 64]
       [--set max_step_ratio_while_opening=6 ...]
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

from llava_tools.tiny_model import write_checkpoint
from vs_transformers_serve import fresh_photo


def engine_rounds(model_dir: str, rounds: int, n: int, new_tokens: int, overrides: dict[str, str]) -> list[dict]:
    """``rounds`` bursts of ``n`` chats through the engine in process (module docstring), its step
    budget the worker's under the settings ``overrides`` (field name: value)."""
    from llava_sessions.config import Settings
    from llava_sessions.conversation import ChatTarget, ImageInput, image_key
    from llava_sessions.engine import EngineLimits, SessionEngine
    from llava_sessions.images.fetch import decode_image
    from llava_sessions.model import LlavaModel
    from llava_sessions.sampling.sampler import SamplingParams
    from llava_sessions.service import step_budget
    from llava_sessions.sessions.store import SessionStore

    torch.set_num_threads(2)
    llava = LlavaModel.from_pretrained(model_dir, device="cpu", dtype="auto")
    settings = Settings.from_sources({}, {f"LLAVA_{k.upper()}": v for k, v in overrides.items()})
    store = SessionStore(
        device_budget_bytes=1 << 36, host_budget_bytes=1 << 34, kv_bytes_per_token=llava.kv_bytes_per_token
    )
    decode = functools.partial(decode_image, max_pixels=settings.max_image_pixels)
    engine = SessionEngine(llava, store, decode, EngineLimits(max_new_tokens_cap=4096))
    budget = step_budget(settings)
    count = [0]

    def burst(tokens: int) -> dict:
        params = SamplingParams(max_new_tokens=tokens, ignore_eos=True)
        seqs, steps = [], []
        t0 = time.perf_counter()
        for _ in range(n):
            sid, data = f"burst{count[0]}", fresh_photo()
            count[0] += 1
            image = decode(data)
            target = ChatTarget(
                None, (), "Describe this image.", 1, (ImageInput(image_key(data), data, image.size[::-1], image),)
            )
            engine.open_empty(sid)
            seqs.append(engine.start_chat(sid, target, params))
        while not all(s.done for s in seqs):
            s0 = time.perf_counter()
            engine.step([s for s in seqs if not s.done], prefill_budget=budget)
            steps.append((time.perf_counter() - s0) * 1000)
        wall = time.perf_counter() - t0
        tokens_out = sum(len(s.answer.tokens) for s in seqs if s.answer is not None)
        ttfts = sorted(round(s.timings["ttft"] / 1000, 2) for s in seqs if "ttft" in s.timings)
        for s in seqs:
            engine.close(s.session_id)
        return {
            "tokens_per_s": round(tokens_out / wall, 1),
            "ttft_s": ttfts,
            "steps": len(steps),
            "step_ms_median": round(statistics.median(steps), 1),
        }

    burst(8)  # warm-up: the first passes allocate and settle the cost model
    return [burst(new_tokens) for _ in range(rounds)]


def http_rounds(model_dir: str, rounds: int, n: int, new_tokens: int, overrides: dict[str, str]) -> list[dict]:
    """``rounds`` bursts of ``n`` streamed chats against a ``llava-serve`` on ``model_dir``, started with
    the settings ``overrides`` as its ``LLAVA_*`` environment."""
    import os

    import requests
    from transformers import AutoTokenizer

    from llava_tools.processes import stop_process_group
    from vs_transformers_serve import STOP_GRACE_S, Target, concurrent, start_ours, user

    os.environ.update({f"LLAVA_{k.upper()}": v for k, v in overrides.items()})
    proc, url = start_ours(model_dir, [], 2)
    try:
        served = requests.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        target = Target("ours", url + "/v1/chat/completions", served, AutoTokenizer.from_pretrained(model_dir))
        target.stream([user("Describe this image.", fresh_photo())], 4)
        concurrent(target, n, 8)  # warm-up, as vs_transformers_serve.py does
        return [{k: round(v, 1) for k, v in concurrent(target, n, new_tokens).items()} for _ in range(rounds)]
    finally:
        stop_process_group(proc, STOP_GRACE_S)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=["engine", "http"], default="engine")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrent", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="a setting, as LLAVA_<FIELD>")
    args = ap.parse_args()
    overrides = dict(item.split("=", 1) for item in args.set)
    import llava_sessions

    print(f"code: {Path(llava_sessions.__file__).parent}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(write_checkpoint("bench", Path(tmp) / "bench", seed=0))
        run = engine_rounds if args.mode == "engine" else http_rounds
        results = run(model_dir, args.rounds, args.concurrent, args.new_tokens, overrides)
    key = "tokens_per_s" if args.mode == "engine" else "concurrent_tokens_per_s"
    for r in results:
        print(json.dumps(r))
    print(f"median tokens/s: {statistics.median(r[key] for r in results):.1f}")


if __name__ == "__main__":
    sys.exit(main())
