"""A prefill over cached positions: transformers' materialized causal mask vs SDPA's lower-right form.

The choice behind ``LlavaModel.lower_right_prefill`` (on by default on CUDA, off on the CPU), measured
side by side in one run on one device: a follow-up of ``--new`` tokens over a session of ``--context``
cached tokens (the prefill pass alone, the cache cropped back after each), (a) with the model's own
mask, (b) through :func:`~llava_sessions.model.fused.lower_right_attention`; interleaved, medians of
``--repeats``; the logits of both compared.

Usage:
    python benchmarks/prefill_attention.py [--model bench] [--device auto] [--dtype auto]
    python benchmarks/prefill_attention.py --model 7b --device cuda     # the 7b shape in bf16 on a GPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time

import torch

from llava_sessions.model import LlavaModel
from llava_sessions.model.kv.cache import undo_pass
from llava_tools.tiny_model import write_checkpoint


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA is asynchronous)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_prefill(llava: LlavaModel, cache, ids: list[int], lower_right: bool) -> tuple[float, torch.Tensor]:
    """ms of one prefill of ``ids`` past ``cache`` (cropped back afterwards), and its logits."""
    start = int(cache.get_seq_length())
    llava.lower_right_prefill = lower_right
    sync(llava.device)
    t0 = time.perf_counter()
    logits = llava.prefill(cache, ids, None)
    sync(llava.device)
    ms = (time.perf_counter() - t0) * 1000
    undo_pass(cache, start)
    return ms, logits


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="bench", choices=["tiny", "bench", "7b"])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--context", type=int, default=600)
    ap.add_argument("--new", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--json", default=None, help="also write the report here")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    if args.model == "7b":
        from llava_tools.tiny_model import build_model

        dtype = torch.float16 if args.dtype == "float16" else torch.bfloat16
        model, processor = build_model("7b", device="cuda" if args.device == "auto" else args.device, dtype=dtype)
        llava = LlavaModel(model, processor)
    else:
        folder = tempfile.mkdtemp(prefix=f"llava-{args.model}-")
        write_checkpoint(args.model, folder)
        llava = LlavaModel.from_pretrained(folder, device=args.device, dtype=args.dtype)
    on_device = llava.lower_right_prefill
    vocab = llava.model.config.text_config.vocab_size
    ids = [
        int(x) for x in torch.randint(5, vocab, (args.context + args.new,), generator=torch.Generator().manual_seed(0))
    ]
    cache = llava.new_cache()
    llava.prefill(cache, ids[: args.context], None)
    times: dict[bool, list[float]] = {False: [], True: []}
    diffs = []
    for i in range(args.repeats + 1):
        pair = {}
        for lower_right in (False, True) if i % 2 else (True, False):
            ms, logits = timed_prefill(llava, cache, ids, lower_right)
            pair[lower_right] = logits
            if i:  # the first pair warms up
                times[lower_right].append(ms)
        diffs.append(float((pair[True] - pair[False]).abs().max()))
    llava.lower_right_prefill = on_device
    mask_ms, lower_ms = statistics.median(times[False]), statistics.median(times[True])
    name = torch.cuda.get_device_name(llava.device) if llava.device.type == "cuda" else "cpu"
    report = {
        "model": args.model,
        "device": f"{llava.device} ({name})",
        "dtype": str(llava.dtype),
        "context": args.context,
        "new_tokens": args.new,
        "materialized_mask_ms": round(mask_ms, 3),
        "lower_right_ms": round(lower_ms, 3),
        "ratio": round(lower_ms / mask_ms, 3),
        "max_logit_difference": max(diffs),
        "default_on_this_device": on_device,
    }
    print(json.dumps(report, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
