"""transformers' own tensor parallelism (``tp_plan="auto"``) on the LLaVA families, beside one process.

The first question of tensor parallel serving (issue 62): does the sharding PyTorch and transformers
ship give the same greedy tokens as one process for each family we serve, on this machine's CPU?
For each ``--arch`` a random-weight checkpoint is built (``--model``), then the same text-only prompt
is answered greedily by ``model.generate``:

- in this process, unsharded;
- by ``--ranks`` processes over the ``gloo`` backend (``torch.multiprocessing``, one thread each),
  the model loaded with ``tp_plan="auto"`` (transformers shards the language model's attention heads
  and MLP across the ranks with DTensor; PyTorch's ``torch.distributed`` carries the all-reduces).

It prints both token lists, whether they are equal, and the ms per answer of each (median of
``--repeat``; on a CPU the ranks' gloo all-reduces cost more than they save: the time is not the
point). transformers needs ``accelerate`` for ``tp_plan``; it is not one of this project's
dependencies, so the script says so and exits 2 without it. A model whose key-value heads do not
divide by ``--ranks`` fails in the sharded forward pass, with transformers' shape error.

``--vision-messages`` measures what decided where the vision tower runs (decision 57): the message
rank 0 sends another rank for an image turn when only rank 0 runs the vision tower (the pass's input
embeddings, bf16) against what it would send with the tower on every rank (the pixel values, bf16,
and the ids), and a decode step's (its rows' embeddings against their ids), at the real models'
shapes, through the ``multiprocessing`` pipe a rank reads (pickled, sent, received and acknowledged;
median of ``--repeat``).

``--engine`` runs the session engine instead (an open, a first answer, a follow-up; ``worker.build_engine``
as a replica wires it: one process with the CPU's defaults, then rank 0 of ``--ranks``) and prints the
ms of each, the follow-up's ms per token and the messages rank 0 sent per token.

Usage: python benchmarks/tensor_parallel.py [--arch llava llava-next llava-onevision] [--ranks 2] [--engine]
       python benchmarks/tensor_parallel.py --vision-messages --repeat 20
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

#: A prompt of ids inside every tiny vocabulary (the tiny models' text vocabularies are small).
PROMPT = [1, 13, 21, 34, 55, 8, 9, 42, 17, 5]

#: An image turn's shapes in the checkpoints' configs: hidden size, the turn's tokens (image and
#: text), its pixel values. llava-1.5-7b: 576 image tokens of one 336 px crop; OneVision-72b: anyres
#: up to 3 x 3 crops of 384 px and the whole image (10 crops), 729 tokens each before unpadding.
VISION_SHAPES: dict[str, dict[str, Any]] = {
    "llava-1.5-7b": {"hidden": 4096, "tokens": 600, "pixels": (1, 3, 336, 336)},
    "llava-onevision-qwen2-72b": {"hidden": 8192, "tokens": 7320, "pixels": (1, 10, 3, 384, 384)},
}


def _acknowledge(channel: Any) -> None:
    """The other rank's side: receive each message (unpickled) and say so, until ``None``."""
    while channel.recv() is not None:
        channel.send(True)


def vision_messages(repeat: int, rows: int = 8) -> list[dict[str, Any]]:
    """Median ms to pickle, send, receive and acknowledge each message of :data:`VISION_SHAPES`
    through a ``multiprocessing`` pipe to another process: an image turn's embeddings against its
    pixel values and ids, and a decode step's ``rows`` embeddings against their ids (all bf16). A
    tensor crosses as torch's reduction sends it: its storage moved into shared memory (a copy) and
    a file descriptor passed, so each send is of fresh tensors, as each pass's are."""
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    other = ctx.Process(target=_acknowledge, args=(theirs,), daemon=True)
    other.start()

    def ms(*parts: torch.Tensor) -> float:
        times = []
        for _ in range(repeat):
            message = ("forward", *(p.clone() for p in parts))  # a pass's own tensors: none in shared memory yet
            t0 = time.perf_counter()
            mine.send(message)
            mine.recv()
            times.append((time.perf_counter() - t0) * 1000)
        return round(statistics.median(times), 3)

    out = []
    for name, shape in VISION_SHAPES.items():
        hidden, n = shape["hidden"], shape["tokens"]
        embeds = torch.randn(1, n, hidden).to(torch.bfloat16)
        pixels = torch.randn(*shape["pixels"]).to(torch.bfloat16)
        ids = torch.randint(0, 32000, (1, n))
        row = {
            "model": name,
            "embeds_mb": round(embeds.nbytes / 2**20, 2),
            "pixels_mb": round(pixels.nbytes / 2**20, 2),
        }
        row["image_turn_embeds_ms"] = ms(embeds)
        row["image_turn_pixels_ms"] = ms(pixels, ids)
        row["decode_embeds_ms"] = ms(torch.randn(rows, 1, hidden).to(torch.bfloat16))
        row["decode_ids_ms"] = ms(torch.randint(0, 32000, (rows, 1)))
        out.append(row)
        print(json.dumps(row))
    mine.send(None)
    other.join(10)
    return out


def answer(model: Any, new_tokens: int, repeat: int) -> tuple[list[int], float]:
    """Greedy ``new_tokens`` after :data:`PROMPT`: ``(token ids, median ms per answer)``."""
    ids = torch.tensor([PROMPT])
    times, out = [], None
    with torch.no_grad():
        for _ in range(repeat + 1):  # the first is a warm-up
            t = time.perf_counter()
            out = model.generate(input_ids=ids, max_new_tokens=new_tokens, do_sample=False)
            times.append((time.perf_counter() - t) * 1000)
    assert out is not None
    return out[0, len(PROMPT) :].tolist(), statistics.median(times[1:])


def _rank(rank: int, ranks: int, port: int, model_dir: str, new_tokens: int, repeat: int, result: Any) -> None:
    from transformers import AutoModelForImageTextToText

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(ranks))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=ranks)
    try:
        model = AutoModelForImageTextToText.from_pretrained(model_dir, tp_plan="auto", dtype=torch.float32).eval()
        tokens, ms = answer(model, new_tokens, repeat)
        if rank == 0:
            result.put((tokens, ms))
    except Exception as exc:  # noqa: BLE001 - the probe reports what failed, on rank 0
        if rank == 0:
            result.put((None, f"{type(exc).__name__}: {str(exc)[:200]}"))
    finally:
        dist.destroy_process_group()


def sharded(model_dir: Path, ranks: int, new_tokens: int, repeat: int) -> tuple[list[int] | None, Any]:
    """The same answer from ``ranks`` gloo processes with ``tp_plan="auto"``: ``(tokens or None, ms or
    the error's text)``."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    result = ctx.SimpleQueue()
    mp.start_processes(
        _rank, args=(ranks, port, str(model_dir), new_tokens, repeat, result), nprocs=ranks, start_method="spawn"
    )
    return result.get()


def engine_answers(model_dir: Path, ranks: int, new_tokens: int) -> dict[str, Any]:
    """The session engine over ``ranks`` ranks (1: one process, the CPU's default settings), wired by
    ``worker.build_engine``: an open, a first answer and a follow-up of ``new_tokens`` greedy tokens on
    a photo. Returns the tokens, the ms of each and, with ranks, the messages sent per token."""
    from llava_sessions.config import Settings
    from llava_sessions.model import LlavaModel
    from llava_sessions.sampling.sampler import SamplingParams
    from llava_sessions.worker import build_engine
    from llava_tools.demo.samples import sample_photo

    threads = 1 if ranks > 1 else 2
    model = LlavaModel.from_pretrained(
        model_dir, device="cpu", dtype="float32", tensor_parallel_size=ranks, threads=threads
    )
    if ranks == 1:
        torch.set_num_threads(threads)
    settings = Settings(device="cpu", device_budget_bytes=2 * 2**30, tensor_parallel_size=ranks)
    engine = build_engine(settings, model)
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    out: dict[str, Any] = {"ranks": ranks}
    t = time.perf_counter()
    engine.open("s", sample_photo("astronaut"))
    first = engine.generate("s", "What is in this image?", params)
    out["open_and_first_ms"] = round((time.perf_counter() - t) * 1000, 1)
    sent = model.ranks.num_messages if model.ranks else 0
    t = time.perf_counter()
    follow = engine.generate("s", "And the colours?", params)
    out["follow_up_ms"] = round((time.perf_counter() - t) * 1000, 1)
    out["ms_per_token"] = round(out["follow_up_ms"] / new_tokens, 1)
    if model.ranks:
        out["messages_per_token"] = round((model.ranks.num_messages - sent) / new_tokens, 2)
        model.ranks.close()
    out["tokens"] = [[t.id for t in a.tokens] for a in (first, follow)]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", nargs="+", default=["llava", "llava-next", "llava-onevision"])
    parser.add_argument("--model", choices=["tiny", "bench"], default="tiny")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=12)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument(
        "--engine", action="store_true", help="the session engine over the ranks, beside one process (not generate)"
    )
    parser.add_argument("--vision-messages", action="store_true", help="an image turn's message each way (no model)")
    args = parser.parse_args()
    if args.vision_messages:
        rows = vision_messages(args.repeat)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=2))
        return 0
    if importlib.util.find_spec("accelerate") is None:
        print("transformers needs accelerate for tp_plan: pip install accelerate", file=sys.stderr)
        return 2
    from transformers import AutoConfig, AutoModelForImageTextToText

    from llava_tools.tiny_model import write_checkpoint

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for arch in args.arch:
            kv_heads = 2 if arch == "llava-onevision" and args.model == "tiny" else None  # 1 does not divide
            model_dir = write_checkpoint(args.model, Path(tmp) / arch, seed=0, arch=arch, kv_heads=kv_heads)
            if args.engine:
                one, sharded_run = (
                    engine_answers(model_dir, 1, args.new_tokens),
                    engine_answers(model_dir, args.ranks, args.new_tokens),
                )
                rows.append({"arch": arch, "one_process": one, "sharded": sharded_run})
                rows[-1]["equal"] = one.pop("tokens") == sharded_run.pop("tokens")
                print(json.dumps(rows[-1]))
                continue
            text = AutoConfig.from_pretrained(model_dir).text_config
            torch.set_num_threads(args.ranks)
            one = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
            tokens, ms = answer(one, args.new_tokens, args.repeat)
            del one
            shard_tokens, shard = sharded(model_dir, args.ranks, args.new_tokens, args.repeat)
            rows.append(
                {
                    "arch": arch,
                    "heads": text.num_attention_heads,
                    "kv_heads": text.num_key_value_heads,
                    "one_process": {"tokens": tokens, "ms": round(ms, 1)},
                    "ranks": args.ranks,
                    "sharded": {"tokens": shard_tokens, "ms": round(shard, 1)}
                    if shard_tokens is not None
                    else {"error": shard},
                    "equal": shard_tokens == tokens,
                }
            )
            r = rows[-1]
            print(f"{arch} (heads {r['heads']}, kv heads {r['kv_heads']}): one process {tokens} {ms:.1f} ms")
            if shard_tokens is None:
                print(f"  {args.ranks} ranks: failed: {shard}")
            else:
                print(f"  {args.ranks} ranks: {shard_tokens} {shard:.1f} ms; equal: {r['equal']}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
