"""``llava-tiny-model``'s command line: write a random-weight checkpoint (:func:`.builder.write_checkpoint`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .builder import ARCHS, SIZES, write_checkpoint

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """CLI entry ``llava-tiny-model``."""
    parser = argparse.ArgumentParser(
        prog="llava-tiny-model", description="Write a random-weight llava-hf checkpoint of one family and size."
    )
    parser.add_argument("--arch", choices=list(ARCHS), default="llava", help="model family (default: llava)")
    parser.add_argument(
        "--size",
        choices=sorted(SIZES),
        default="tiny",
        help="tiny: seconds to build, for tests and the demo; bench: llava-1.5's shape scaled for a CPU, for "
        "benchmarks; 7b: llava-1.5-7b's exact shape, built on a GPU only (default: tiny)",
    )
    parser.add_argument("--out", required=True, help="output folder (new or empty)")
    parser.add_argument("--seed", type=int, default=0, help="the random weights' seed (default: 0)")
    parser.add_argument("--max-positions", type=int, help="the text model's context in tokens (default: the size's)")
    parser.add_argument("--kv-heads", type=int, help="the text model's key-value heads (default: the size's)")
    args = parser.parse_args(argv)
    try:
        if Path(args.out).exists() and (not Path(args.out).is_dir() or any(Path(args.out).iterdir())):
            raise ValueError(f"{args.out} is not empty: random weights would replace its own; give a new folder")
        path = write_checkpoint(
            args.size,
            args.out,
            seed=args.seed,
            arch=args.arch,
            max_positions=args.max_positions,
            kv_heads=args.kv_heads,
        )
    except (RuntimeError, ValueError) as exc:
        print(f"llava-tiny-model: {exc}", file=sys.stderr)
        return 2
    print(f"llava-tiny-model: wrote {args.arch} {args.size} checkpoint (random weights) to {path}")
    return 0
