"""``n`` parallel samples against one answer and against ``n`` answers asked one by one, side by side.

A worker (``--model``, CPU fp32, in process through ``SessionService``) opens a session on the
sample photo; then, for each ``n``, it asks the same question (not remembered, ``--max-new-tokens``
greedy tokens, so every answer has the same length and the times compare like for like) ``--repeat``
times as one request of ``n`` answers, and as ``n`` requests of one answer each. It prints the
median ms per request, that time over one answer's, and the ``n`` requests' time over the one
request's (what prefilling the prompt once and decoding the answers as one batch saves).

With ``--shared-prefix-ab`` it instead measures, for each ``n``, the request of ``n`` answers with the
decode rows reading their shared prompt once (``model/kv/runs.py``'s shared groups, the default) and
with every row reading it alone, in alternating repeats, and prints both and their ratio.

Usage: python benchmarks/samples.py [--model tiny|bench] [--n 1 2 4 8] [--shared-prefix-ab]
"""

from __future__ import annotations

import argparse
import base64
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from llava_sessions.wire.in_flight import BatchRequest
from llava_sessions.worker import build_service
from llava_tools.demo.samples import sample_photo
from llava_tools.tiny_model import write_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["tiny", "bench"], default="tiny")
    parser.add_argument("--n", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--shared-prefix-ab", action="store_true", help="shared prompt read once against alone")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_checkpoint(args.model, Path(tmp) / args.model, seed=0)
        settings = {"model_dir": str(model_dir), "device": "cpu", "dtype": "float32", "cpu_memory_reserve_bytes": 0}
        service = build_service({**settings, "device_budget_bytes": 4 * 10**9, "max_concurrent_generations": 16})
        count = 0

        def call(body: dict) -> tuple[dict, float]:
            nonlocal count
            count += 1
            rid, t0 = f"r{count}", time.perf_counter()
            row = BatchRequest(rid, "bench-1", False, body)
            while True:
                out = service.handle([row])[0]
                if out.stop is not False:
                    return json.loads(out.body), (time.perf_counter() - t0) * 1000.0
                row = BatchRequest(rid, "bench-1", False, None)

        call({"type": "open_session", "image": {"base64": base64.b64encode(sample_photo()).decode()}})
        ask = {"type": "generate", "prompt": "Describe this image in detail.", "remember": False}
        params = {"max_new_tokens": args.max_new_tokens}
        call({**ask, "parameters": params})  # warm-up
        print(f"{args.model}, CPU fp32, {args.max_new_tokens} greedy tokens per answer, median of {args.repeat}")
        if args.shared_prefix_ab:
            shared_prefix_ab(call, ask, params, args.n, args.repeat)
            return
        print("| n | one request of n answers, ms | × one answer | n requests one by one, ms | one by one / together |")
        print("|---:|---:|---:|---:|---:|")
        one = None
        for n in args.n:
            together = statistics.median(call({**ask, "parameters": {**params, "n": n}})[1] for _ in range(args.repeat))
            apart = statistics.median(
                sum(call({**ask, "parameters": params})[1] for _ in range(n)) for _ in range(args.repeat)
            )
            one = one or together
            print(f"| {n} | {together:.0f} | {together / one:.2f} | {apart:.0f} | {apart / together:.2f} |", flush=True)


def shared_prefix_ab(
    call: Callable[[dict], tuple[dict, float]], ask: dict, params: dict, ns: list[int], repeat: int
) -> None:
    """For each of ``ns``: one request of ``n`` answers, its rows reading the shared prompt once and
    alone (``MIN_SHARED_POSITIONS`` past any prompt), in alternating repeats; medians and their ratio."""
    from llava_sessions.model.kv import runs

    default = runs.MIN_SHARED_POSITIONS
    print("| n | shared prompt read once, ms | each row alone, ms | once / alone |\n|---:|---:|---:|---:|")
    for n in ns:
        times: dict[bool, list[float]] = {True: [], False: []}
        for k in range(repeat):
            for once in (True, False) if k % 2 == 0 else (False, True):
                runs.MIN_SHARED_POSITIONS = default if once else 1 << 30
                times[once].append(call({**ask, "parameters": {**params, "n": n}})[1])
        runs.MIN_SHARED_POSITIONS = default
        on, off = statistics.median(times[True]), statistics.median(times[False])
        print(f"| {n} | {on:.0f} | {off:.0f} | {on / off:.2f} |", flush=True)


if __name__ == "__main__":
    main()
