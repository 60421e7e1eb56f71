"""Where an engine step's time goes: ``torch.profiler`` over the engine's passes, in process.

``benchmarks/gpu.py`` says how long a decode step, a follow-up and a cold image turn take on a GPU;
this script says why. For each region it prints the median wall ms of ``--repeats`` runs (timed
without the profiler), then, from one profiled run: how many kernels were launched, how many times
the host waited for the device (``cudaStreamSynchronize``, ``cudaDeviceSynchronize`` and the
synchronous ``cudaMemcpy`` a CPU-to-device copy of pageable memory makes), how many ``.item()``
reads there were (``aten::_local_scalar_dense``), and the operators that took the most host time
and the most device time. A launch-bound pass shows many kernels and little device time; a pass
that waits on the device each layer shows syncs in the tens.

Regions (the ``7b``-shaped llava-1.5 on a GPU by default, as ``gpu.py`` builds it):

- ``decode_eager``: one batch-1 decode step at about ``--context`` positions over the pool's pages, eager;
- ``decode_graphs``: the same step replayed as a CUDA graph (on a GPU);
- ``follow_up``: a ~40-token question on a stored session, to its first token, in the engine a GPU
  runs (graphs: the question goes in as one static step's rows; eager on a CPU);
- ``open``: opening a session on a never-seen image (decode, preprocess, vision tower, prefix prefill),
  in the same engine;
- ``hf_decode``: transformers' own eager decode step (the model called with a ``DynamicCache``), the
  yardstick for what eager costs on this device.

Usage:
    python benchmarks/profile_step.py                       # the 7b shape on cuda, bf16
    python benchmarks/profile_step.py --device cpu --model tiny --dtype auto --repeats 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from engine_decode import build_runner, sync
from gpu import FOLLOW_UP, PHOTOS, QUESTION, _fresh, new_engine, open_with_context, release_memory
from llava_sessions.model import LlavaModel
from llava_sessions.sampling.sampler import SamplingParams
from llava_tools.demo.samples import sample_photo

#: Host-side calls that wait for the device (CUDA runtime names as the profiler records them).
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpy", "cudaEventSynchronize")


def profile_region(device: torch.device, run: Callable[[], Any], repeats: int, rows: int) -> dict[str, Any]:
    """``run()`` timed ``repeats`` times (after one warm-up), then once under the profiler: wall ms
    (median), kernel launches, host waits, ``.item()`` reads, and the top ``rows`` operators by self
    host time and by self device time (each ``[name, calls, ms]``)."""
    run()
    walls = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        run()
        sync(device)
        walls.append((time.perf_counter() - t0) * 1000)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        run()
        sync(device)
    events = prof.key_averages()

    def count(*names: str) -> int:
        return sum(e.count for e in events if e.key in names)

    def top(attr: str) -> list[list[Any]]:
        ranked = sorted(events, key=lambda e: getattr(e, attr), reverse=True)[:rows]
        return [[e.key[:60], e.count, round(getattr(e, attr) / 1000, 3)] for e in ranked if getattr(e, attr) > 0]

    device_attr = "self_device_time_total" if hasattr(events[0], "self_device_time_total") else "self_cuda_time_total"
    return {
        "wall_ms": round(statistics.median(walls), 3),
        "torch_host_ms": round(sum(e.self_cpu_time_total for e in events) / 1000, 3),
        "kernel_launches": count("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx"),
        "graph_launches": count("cudaGraphLaunch"),
        "host_waits": {name: count(name) for name in SYNCS if count(name)},
        "item_reads": count("aten::_local_scalar_dense"),
        "top_host_ms": top("self_cpu_time_total"),
        "top_device_ms": top(device_attr) if device.type == "cuda" else [],
    }


def decode_step_region(engine: Any, image: bytes, context: int) -> Callable[[], None]:
    """A batch-1 answer decoding on a stored session of about ``context`` positions: each call runs one
    decode step (a new answer starts, prefilled outside the call, when the last one ends)."""
    open_with_context(engine, "p", image, context)
    state: dict[str, Any] = {"gen": None}

    def step() -> None:
        gen = state["gen"]
        if gen is None or gen.done:
            params = SamplingParams(max_new_tokens=256, ignore_eos=True)
            gen = state["gen"] = engine.start("p", QUESTION, params, remember=False)
            while not gen.prefilled:
                engine.step([gen])
            sync(engine.model.device)
        engine.step([gen])

    return step


def hf_decode_region(llava: LlavaModel, context: int) -> Callable[[], None]:
    """transformers' eager decode step: the model called on one token with a ``DynamicCache`` of
    ``context`` positions (cropped back after each call)."""
    from transformers import DynamicCache

    model, device = llava.model, llava.device
    words = llava.processor.tokenizer(QUESTION, add_special_tokens=False)["input_ids"]
    ids = torch.tensor([(words * (context // len(words) + 1))[:context]], device=device)
    cache = DynamicCache()
    with torch.inference_mode():
        model(input_ids=ids, use_cache=True, **{llava._cache_kw: cache})
    token = ids[:, -1:]

    @torch.inference_mode()
    def step() -> None:
        model(input_ids=token, use_cache=True, logits_to_keep=1, **{llava._cache_kw: cache})
        cache.crop(-1)

    return step


def turn_regions(engine: Any, images: list[bytes], args: argparse.Namespace) -> dict[str, Any]:
    """The follow-up (a ~40-token question on a stored session, to its first token) and the open of a
    never-seen image, profiled on ``engine``."""
    device = engine.model.device
    open_with_context(engine, "fu", images[0], args.context)
    params = SamplingParams(max_new_tokens=1)

    def follow_up() -> None:
        gen = engine.start("fu", FOLLOW_UP, params, remember=False)
        while not gen.done:
            engine.step([gen])

    fresh = iter(enumerate([_fresh(images[2], n) for n in range(args.repeats + 2)]))  # new bytes each open

    def open_image() -> None:
        n, image = next(fresh)
        engine.open(f"cold{n}", image)
        engine.close(f"cold{n}")

    return {
        "follow_up": profile_region(device, follow_up, args.repeats, args.rows),
        "open": profile_region(device, open_image, args.repeats, args.rows),
    }


def regions(llava: LlavaModel, args: argparse.Namespace) -> dict[str, Any]:
    """Every region's profile, one engine at a time (each takes its fixed pool on a GPU)."""
    device, images = llava.device, [sample_photo(p) for p in PHOTOS]
    out: dict[str, Any] = {}
    for name, graphs in (("decode_eager", False), ("decode_graphs", True)):
        if graphs and device.type != "cuda":
            continue
        engine = new_engine(llava, graphs)
        out[name] = profile_region(device, decode_step_region(engine, images[1], args.context), args.repeats, args.rows)
        if name == ("decode_graphs" if device.type == "cuda" else "decode_eager"):  # the engine a user runs
            out.update(turn_regions(engine, images, args))
        del engine
        release_memory(device)
        print_region(name, out[name])
    out["hf_decode"] = profile_region(device, hf_decode_region(llava, args.context), args.repeats, args.rows)
    return out


def print_region(name: str, r: dict[str, Any]) -> None:
    """One region's lines."""
    print(f"\n== {name}: {r['wall_ms']} ms ({r['torch_host_ms']} ms in torch ops); {r['kernel_launches']} kernels, {r['graph_launches']} graph launches, "
          f"host waits {r['host_waits']}, .item() x{r['item_reads']}", flush=True)  # fmt: skip
    for label, rows in (("host", r["top_host_ms"]), ("device", r["top_device_ms"])):
        for key, calls, ms in rows:
            print(f"   {label:<7}{ms:>9.3f} ms  x{calls:<6} {key}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="7b", choices=["tiny", "bench", "7b"])
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--context", type=int, default=600)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--rows", type=int, default=12, help="operators listed per region and kind of time")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    llava = build_runner(args)
    out = regions(llava, args)
    for name in ("follow_up", "open", "hf_decode"):
        print_region(name, out[name])
    if args.json:
        import json

        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
