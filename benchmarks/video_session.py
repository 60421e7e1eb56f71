"""A question about a video: a video session's follow-up vs the same question sent with the video again.

(a) per request (what a server without sessions does: vLLM or SGLang with ``video_url`` parts and a
    cold cache, the AWS sample's way for images): every question decodes the clip, samples its frames,
    runs the vision tower on each and prefills the whole conversation, video tokens included.
(b) ours: the session holds the video's features and the conversation's KV; a question prefills only
    itself (KV hit), or is served after demotion to the ``features`` tier (the prefix prefilled again
    from kept features) or to the ``image`` tier (the clip's bytes decoded and encoded again).

Both run the same model code (the runner's video encode, prefill and decode), in one run, interleaved
question by question; the ratio compares the work each design does. Greedy, ``--new-tokens`` per
answer, medians over ``--repeats``. The clip: a real photograph (``skimage.data.astronaut``) panned
across ``--clip-frames`` frames (48, 2 s) of 320x240 H.264, sampled to ``--num-frames`` (8: 1,569 tokens).

Usage: python benchmarks/video_session.py [--model bench] [--num-frames 8] [--model-dir DIR]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import tempfile
import time

import torch

from llava_sessions.conversation import Chat, VideoBytes
from llava_sessions.engine import EngineLimits, SessionEngine
from llava_sessions.model import LlavaRunner
from llava_sessions.sampling.sampler import SamplingParams
from llava_sessions.sessions.store import SessionStore, Tier
from llava_sessions.video import VideoLimits
from llava_sessions.worker import decode_media
from llava_tools.demo.samples import sample_clip

QUESTIONS = ["What happens in this video?", "What is the person wearing?", "Is there a flag?", "Where is this?"]


def per_request(runner: LlavaRunner, decode, data: VideoBytes, prompt: str, new_tokens: int) -> tuple[float, float]:
    """(a): decode, sample, encode and prefill everything for one question; (ttft ms, total ms)."""
    t0 = time.perf_counter()
    with torch.inference_mode():
        video = decode(data)
        feats = runner.encode_video(video)
        chat = Chat(None, image_tokens=(int(feats.shape[0]),), videos=frozenset({0}))
        ids = runner.template.conversation_ids(chat, prompt)
        cache = runner.new_cache()
        token = int(runner.prefill(cache, ids, feats).argmax())
        ttft = (time.perf_counter() - t0) * 1000
        for _ in range(new_tokens - 1):
            if token in runner.eos_token_ids:
                break
            token = int(runner.decode(cache, token).argmax())
    return ttft, (time.perf_counter() - t0) * 1000


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="bench", choices=["tiny", "bench"], help="OneVision checkpoint size to build")
    ap.add_argument("--model-dir", help="use this LLaVA-OneVision checkpoint folder instead of building one")
    ap.add_argument("--num-frames", type=int, default=8)
    ap.add_argument("--clip-frames", type=int, default=48, help="frames of the clip (at most 49 fit the photo)")
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)

    torch.manual_seed(0)
    folder = args.model_dir
    if folder is None:
        from llava_tools.tiny_model import write_checkpoint

        folder = write_checkpoint(args.model, tempfile.mkdtemp(prefix="llava-ov-"), arch="llava-onevision")
    runner = LlavaRunner.from_pretrained(folder, device="auto")
    decode = functools.partial(decode_media, max_pixels=40_000_000, video_limits=VideoLimits())
    raw = sample_clip(num_frames=args.clip_frames, fps=24, size=(320, 240), step=(4, 3))
    data = VideoBytes(raw, num_frames=args.num_frames)
    params = SamplingParams(max_new_tokens=args.new_tokens)
    store = SessionStore(
        device_budget_bytes=1 << 40, host_budget_bytes=1 << 34, kv_bytes_per_token=runner.kv_bytes_per_token
    )
    engine = SessionEngine(runner, store, decode, EngineLimits(max_new_tokens_cap=4096))

    def ours(sid: str, prompt: str, demote: Tier | None) -> tuple[float, float]:
        if demote is not None:
            engine.store.demote(sid, demote)
        gen = engine.start(sid, prompt, params, remember=False)
        t0 = time.perf_counter()
        next(gen)
        ttft = (time.perf_counter() - t0) * 1000
        for _ in gen:
            pass
        return ttft, (time.perf_counter() - t0) * 1000

    per_request(runner, decode, data, QUESTIONS[0], 2)  # warm-up
    engine.open("warm", data)
    engine.close("warm")
    rows: dict[str, list[tuple[float, float]]] = {"per_request": [], "kv": [], "features": [], "image": []}
    opens, first = [], []
    for rep in range(args.repeats):
        sid = f"s{rep}"
        t0 = time.perf_counter()
        opened = engine.open(sid, data)
        opens.append((time.perf_counter() - t0) * 1000)
        first.append(engine.generate(sid, QUESTIONS[0], params).timings.get("ttft", 0.0))
        for q in QUESTIONS[1:]:
            rows["per_request"].append(per_request(runner, decode, data, q, args.new_tokens))
            rows["kv"].append(ours(sid, q, None))
            rows["features"].append(ours(sid, q, Tier.FEATURES))
            rows["image"].append(ours(sid, q, Tier.IMAGE))

    med = statistics.median
    table = {k: {"ttft_ms": med(v[0] for v in vals), "total_ms": med(v[1] for v in vals)} for k, vals in rows.items()}
    result = {
        "model": args.model_dir or args.model,
        "device": str(runner.device),
        "torch_threads": torch.get_num_threads(),
        "num_frames": args.num_frames,
        "video_tokens": opened.image_tokens,
        "clip_bytes": len(raw),
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "open_ms": med(opens),
        "open_timings_ms": opened.timings,
        "followup": table,
        "followup_ttft_ratio_per_request_over_kv": table["per_request"]["ttft_ms"] / table["kv"]["ttft_ms"],
    }
    print(f"video: {args.num_frames} frames sampled, {opened.image_tokens} tokens; open {med(opens):.0f} ms")
    print(f"{'follow-up question':<24}{'TTFT ms':>10}{'total ms':>10}")
    for name, row in table.items():
        print(f"{name:<24}{row['ttft_ms']:>10.1f}{row['total_ms']:>10.1f}")
    print(f"per request / session (KV hit), TTFT: {result['followup_ttft_ratio_per_request_over_kv']:.1f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
