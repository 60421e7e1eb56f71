"""Our server under two sets of settings, side by side: the rows of ``vs_vllm.py``, ours against ours.

``vs_vllm.py`` measures ``llava-serve`` beside vLLM's CPU build; this script runs the same rounds
(``vs_vllm.measure``: cold turn, resent conversation, session turns, a single stream's ms per token and
chunks, a burst of image streams, ``n`` = 4) against two ``llava-serve`` processes started one at a
time in alternating rounds, the first with the settings of ``--a`` and the second with those of
``--b`` (``KEY=VALUE``, comma-separated; empty: the defaults), and prints each row's B / A ratio. What
a setting's default costs or gains is measured this way before it changes.

Usage:
    python benchmarks/ours_settings.py --b step_max_tokens=1 --rounds 3 --dtype float32
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from llava_tools.tiny_model import write_checkpoint
from vs_vllm import ROWS, alternate, start_llava


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--a", default="", help="settings of A, KEY=VALUE comma-separated (empty: the defaults)")
    ap.add_argument("--b", default="", help="settings of B, as --a")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--concurrent", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    sets = {"A": [s for s in args.a.split(",") if s], "B": [s for s in args.b.split(",") if s]}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(write_checkpoint("bench", Path(tmp) / "bench", seed=0))
        med = alternate(
            {name: lambda name=name: start_llava(model_dir, args.dtype, args.threads, sets[name]) for name in sets},
            args.rounds,
            args.concurrent,
            args.dtype,
        )
    print(f"A: {sets['A'] or 'defaults'}; B: {sets['B'] or 'defaults'}; {args.dtype}, {args.rounds} rounds, medians")
    print("| measure | A | B | B / A |\n|---|---:|---:|---:|")
    for key, label, fmt in [*ROWS, ("session_ttft_ms", "the same 5 turns in a session: turns 2-5, ms", "{:.0f}")]:
        a, b = med["A"][key], med["B"][key]
        print(f"| {label.format(n=args.concurrent)} | {fmt.format(a)} | {fmt.format(b)} | {b / a:.2f}x |")


if __name__ == "__main__":
    main()
