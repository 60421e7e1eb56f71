"""oneDNN-prepacked linears against plain ``F.linear`` on a CPU, side by side in one process.

The same random-weight checkpoint is loaded twice: once as the worker loads it (its linears packed,
:mod:`llava_sessions.model.packed_linears`) and once with packing turned off. In alternating rounds
each engine runs the same work, and the script prints each measure's packed / plain ratio:

- ``decode_1``: ms per decode step of one answer (64 tokens);
- ``decode_8``: ms per decode step of eight answers decoding together;
- ``open``: opening a session on a new photo and its first answer token, ms;
- ``greedy_equal``: of the rounds' greedy answers (32 tokens, three photos), how many the two engines
  give alike.

Usage:
    python benchmarks/packed_linears.py --model bench --dtype float32 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from unittest import mock

import torch

from gpu import PHOTOS, QUESTION, _fresh, answers, new_engine
from llava_sessions.model import LlavaModel
from llava_sessions.sampling.sampler import SamplingParams
from llava_tools.demo.samples import sample_photo
from llava_tools.tiny_model import write_checkpoint


def load(folder: str, dtype: str, packed: bool) -> LlavaModel:
    """The checkpoint as the worker loads it, or with packing turned off (its linears plain)."""
    if packed:
        return LlavaModel.from_pretrained(folder, device="cpu", dtype=dtype)
    with mock.patch("llava_sessions.model.llava.pack_linears", return_value=0):
        return LlavaModel.from_pretrained(folder, device="cpu", dtype=dtype)


def one_round(engine, images: list[bytes], salt: int) -> dict:
    """One round's measures on ``engine`` (sessions opened and closed inside)."""
    sids = [f"s{k}" for k in range(8)]
    for k, sid in enumerate(sids):
        engine.open(sid, images[k % len(images)])
    _, decode_1 = answers(engine, sids[:1], 64)
    _, decode_8 = answers(engine, sids, 32)
    greedy = [answers(engine, [sid], 32)[0][0] for sid in sids[:3]]
    for sid in sids:
        engine.close(sid)
    t0 = time.perf_counter()
    engine.open("cold", _fresh(images[0], salt))
    engine.generate("cold", QUESTION, SamplingParams(max_new_tokens=1), remember=False)
    open_ms = (time.perf_counter() - t0) * 1000
    engine.close("cold")
    return {"decode_1": decode_1, "decode_8": decode_8, "open": round(open_ms, 1), "greedy": greedy}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="bench", choices=["tiny", "bench"])
    ap.add_argument("--dtype", default="float32", help="float32 or bfloat16")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    folder = tempfile.mkdtemp(prefix=f"llava-{args.model}-")
    write_checkpoint(args.model, folder)
    models = {"packed": load(folder, args.dtype, True), "plain": load(folder, args.dtype, False)}
    print(json.dumps({"packed_linears": models["packed"].packed_linears, "dtype": args.dtype}), flush=True)
    engines = {name: new_engine(llava, graphs=None) for name, llava in models.items()}
    images = [sample_photo(p) for p in PHOTOS]
    for engine in engines.values():
        one_round(engine, images, 0)  # warm-up
    rows: dict[str, list[dict]] = {name: [] for name in engines}
    for r in range(args.rounds):
        order = list(engines) if r % 2 == 0 else list(reversed(engines))
        for name in order:
            rows[name].append(one_round(engines[name], images, r + 1))
        print(json.dumps({n: {k: v for k, v in rows[n][-1].items() if k != "greedy"} for n in order}), flush=True)
    report: dict = {}
    for measure in ("decode_1", "decode_8", "open"):
        packed = statistics.median(row[measure] for row in rows["packed"])
        plain = statistics.median(row[measure] for row in rows["plain"])
        report[measure] = {"packed": packed, "plain": plain, "ratio": round(packed / plain, 3)}
    pairs = [
        (a, b)
        for p, q in zip(rows["packed"], rows["plain"], strict=True)
        for a, b in zip(p["greedy"], q["greedy"], strict=True)
    ]
    report["greedy_equal"] = f"{sum(a == b for a, b in pairs)} of {len(pairs)}"
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
