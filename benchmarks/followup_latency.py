"""Follow-up question latency: the public AWS sample's way vs our session engine, side by side.

(a) AWS sample: at open, decode + preprocess the image and keep the pixel tensor; for EVERY
    question run the vision tower + projector and a full prefill of system + image + question,
    then decode (batch 1, no history).
(b) ours: at open, encode the image once and prefill the prefix; a question reuses the KV cache
    (KV hit), or is served after demotion from the ``features`` or ``image`` tier.

Both paths run the same model code (the model's vision, prefill and decode passes), in one run,
interleaved question by question, so the ratio compares the work each design does. Greedy,
``--new-tokens`` per answer; medians over ``--repeats``. ``--arch llava-next --image-size 672``
is LLaVA-NeXT's shape: a 672x672 photo is 2,928 image tokens (anyres: 5 tiles of 336 px).

Usage: python benchmarks/followup_latency.py --model bench [--arch llava] [--image-size N]
       [--model-dir DIR] [--device auto]
"""

from __future__ import annotations

import argparse
import functools
import io
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from PIL import Image

from llava_sessions.conversation import Chat
from llava_sessions.engine import EngineLimits, SessionEngine
from llava_sessions.images.fetch import decode_image
from llava_sessions.model import LlavaModel
from llava_sessions.sampling.sampler import SamplingParams
from llava_sessions.sessions.store import SessionStore, Tier
from llava_tools.demo.samples import sample_photo

QUESTIONS = [
    "What is in this image?",
    "What color is the suit?",
    "Is there a flag in the picture?",
    "Describe the background in one sentence.",
]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class AwsSampleWay:
    """The baseline: cached pixel tensor; vision tower + full prefill for every question."""

    def __init__(self, llava: LlavaModel, decode) -> None:
        self.llava = llava
        self.decode = decode
        self.pixels: torch.Tensor | None = None
        self.extra: dict[str, torch.Tensor] = {}  # image_sizes for anyres models
        self.chat = Chat(None)

    def open(self, image_bytes: bytes) -> float:
        t0 = time.perf_counter()
        image = self.decode(image_bytes)
        out = self.llava.processor.image_processor(images=[image], return_tensors="pt")
        self.pixels = out["pixel_values"].to(self.llava.device)
        self.extra = {"image_sizes": out["image_sizes"]} if "image_sizes" in out else {}
        tokens = self.llava.image_token_count((image.height, image.width))
        self.chat = Chat(None, image_tokens=(tokens,))
        sync(self.llava.device)
        return (time.perf_counter() - t0) * 1000

    @torch.inference_mode()
    def ask(self, prompt: str, new_tokens: int) -> tuple[float, float]:
        r = self.llava
        t0 = time.perf_counter()
        assert self.pixels is not None
        feats = torch.cat(r.encode_pixels(self.pixels, **self.extra))
        cache = r.new_cache()
        ids = r.template.conversation_ids(self.chat, prompt)
        logits = r.prefill(cache, ids, feats)
        token = int(logits.argmax())
        sync(r.device)
        ttft = (time.perf_counter() - t0) * 1000
        for _ in range(new_tokens - 1):
            if token in r.eos_token_ids:
                break
            token = int(r.decode(cache, token).argmax())
        sync(r.device)
        return ttft, (time.perf_counter() - t0) * 1000


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="bench", choices=["tiny", "bench", "7b"], help="checkpoint size to build")
    ap.add_argument("--arch", default="llava", choices=["llava", "llava-next", "llava-onevision"])
    ap.add_argument("--image-size", type=int, help="resize the photo to N x N pixels (default: as it is, 512 x 512)")
    ap.add_argument("--model-dir", help="use this checkpoint folder instead of building one")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)

    torch.manual_seed(0)
    if args.model_dir:
        llava = LlavaModel.from_pretrained(args.model_dir, device=args.device, dtype=args.dtype)
    elif args.model == "7b":
        from llava_tools.tiny_model import build_model

        model, processor = build_model("7b", device="cuda", dtype=torch.float16)
        llava = LlavaModel(model, processor)
    else:
        from llava_tools.tiny_model import write_checkpoint

        tmp = tempfile.mkdtemp(prefix=f"llava-{args.model}-")
        write_checkpoint(args.model, tmp, arch=args.arch)
        llava = LlavaModel.from_pretrained(tmp, device=args.device, dtype=args.dtype)
    device = llava.device
    decode = functools.partial(decode_image, max_pixels=40_000_000)
    image = sample_photo("astronaut")
    if args.image_size:
        buf = io.BytesIO()
        Image.open(io.BytesIO(image)).convert("RGB").resize((args.image_size, args.image_size)).save(buf, "PNG")
        image = buf.getvalue()
    params = SamplingParams(max_new_tokens=args.new_tokens)
    engine = SessionEngine(
        llava,
        SessionStore(
            device_budget_bytes=1 << 40, host_budget_bytes=1 << 34, kv_bytes_per_token=llava.kv_bytes_per_token
        ),
        decode,
        EngineLimits(max_new_tokens_cap=4096),
    )

    def ours(sid: str, prompt: str, demote: str | None) -> tuple[float, float]:
        if demote == "features":
            engine.store.demote(sid, Tier.FEATURES)
        elif demote == "image":
            engine.store.demote(sid, Tier.IMAGE)
        gen = engine.start(sid, prompt, params, remember=False)
        t0 = time.perf_counter()
        next(gen)
        sync(device)
        ttft = (time.perf_counter() - t0) * 1000
        for _ in gen:
            pass
        sync(device)
        return ttft, (time.perf_counter() - t0) * 1000

    # warm-up both paths once
    aws = AwsSampleWay(llava, decode)
    aws.open(image)
    aws.ask(QUESTIONS[0], 2)
    engine.open("warm", image)
    engine.generate("warm", QUESTIONS[0], SamplingParams(max_new_tokens=2))
    engine.close("warm")

    open_a, open_b, first_a, first_b = [], [], [], []
    rows: dict[str, list[tuple[float, float]]] = {"a": [], "kv": [], "features": [], "image": []}
    for rep in range(args.repeats):
        # open + first answer, each way
        aws = AwsSampleWay(llava, decode)
        open_a.append(aws.open(image))
        first_a.append(aws.ask(QUESTIONS[0], args.new_tokens)[1])
        sid = f"s{rep}"
        t0 = time.perf_counter()
        engine.open(sid, image)
        sync(device)
        open_b.append((time.perf_counter() - t0) * 1000)
        g0 = time.perf_counter()
        engine.generate(sid, QUESTIONS[0], params)
        sync(device)
        first_b.append((time.perf_counter() - g0) * 1000)
        # follow-ups, interleaved
        for q in QUESTIONS[1:]:
            rows["a"].append(aws.ask(q, args.new_tokens))
            rows["kv"].append(ours(sid, q, None))
            rows["features"].append(ours(sid, q, "features"))
            rows["image"].append(ours(sid, q, "image"))

    med = statistics.median
    table = {k: {"ttft_ms": med(v[0] for v in vals), "total_ms": med(v[1] for v in vals)} for k, vals in rows.items()}
    s = engine.store.get(f"s{args.repeats - 1}")
    entry = engine.store.ledger.entry(s.session_id)  # what the store accounts for the session
    kv_bytes = entry.num_kv_tokens * llava.kv_bytes_per_token
    feat_bytes, host_bytes = entry.num_feature_bytes, entry.num_host_bytes
    result = {
        "model": args.model if not args.model_dir else args.model_dir,
        "device": str(device),
        "dtype": str(llava.dtype),
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "torch_threads": torch.get_num_threads(),
        "followup": table,
        "followup_ttft_ratio_a_over_kv": table["a"]["ttft_ms"] / table["kv"]["ttft_ms"],
        "open_ms": {"a": med(open_a), "b": med(open_b)},
        "open_plus_first_answer_ms": {"a": med(open_a) + med(first_a), "b": med(open_b) + med(first_b)},
        "bytes_per_session": {
            "kv_tier": kv_bytes + feat_bytes + host_bytes,
            "features_tier": feat_bytes + host_bytes,
            "image_tier": host_bytes,
            "kv_cache": kv_bytes,
            "image_features": feat_bytes,
            "host_image_and_conversation": host_bytes,
        },
        "architecture": llava.architecture,
        "image_size": list(decode(image).size),
        "image_tokens": s.image_tokens[0],
        "prefix_tokens": len(llava.template.prefix_ids(Chat(None, image_tokens=tuple(s.image_tokens)))),
    }
    opa, opb = result["open_plus_first_answer_ms"]["a"], result["open_plus_first_answer_ms"]["b"]
    result["open_plus_first_answer_ratio_b_over_a"] = opb / opa

    print(
        f"model={result['model']} ({llava.architecture}) device={device} dtype={llava.dtype} "
        f"threads={torch.get_num_threads()} new_tokens={args.new_tokens} repeats={args.repeats} "
        f"image={result['image_size'][0]}x{result['image_size'][1]} ({result['image_tokens']} image tokens) "
        f"prefix={result['prefix_tokens']} tokens"
    )
    print(f"{'path':<34}{'follow-up TTFT ms':>20}{'follow-up total ms':>20}")
    names = {
        "a": "(a) AWS sample (vision+full prefill)",
        "kv": "(b) ours, KV hit",
        "features": "(b) ours, from features tier",
        "image": "(b) ours, from image-bytes tier",
    }
    for k, name in names.items():
        print(f"{name:<34}{table[k]['ttft_ms']:>20.1f}{table[k]['total_ms']:>20.1f}")
    print(f"follow-up TTFT ratio (a)/(b, KV hit): {result['followup_ttft_ratio_a_over_kv']:.1f}x  (target >= 10x)")
    print(
        f"open: (a) {med(open_a):.1f} ms, (b) {med(open_b):.1f} ms; open + first answer: (a) {opa:.1f} ms, "
        f"(b) {opb:.1f} ms, (b)/(a) = {result['open_plus_first_answer_ratio_b_over_a']:.3f}  (target <= 1.10)"
    )
    bp = result["bytes_per_session"]
    print(
        f"bytes per session: kv tier {bp['kv_tier']:,} (KV {kv_bytes:,} + features {feat_bytes:,} + host {host_bytes:,}); "
        f"features tier {bp['features_tier']:,}; image tier {bp['image_tier']:,}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
