"""Video sessions (issue 44's goals), each measured side by side in one run on a LLaVA-OneVision checkpoint.

1. **Follow-up TTFT**, in process: a video session's question vs the same question sent with the
   video again to a server without sessions:

(a) per request (what a server without sessions does: vLLM or SGLang with ``video_url`` parts and a
    cold cache, the AWS sample's way for images): every question decodes the clip, samples its frames,
    runs the vision tower on each and prefills the whole conversation, video tokens included.
(b) ours: the session holds the video's features and the conversation's KV; a question prefills only
    itself (KV hit), or is served after demotion to the ``features`` tier (the prefix prefilled again
    from kept features) or to the ``image`` tier (the clip's bytes decoded and encoded again).

   Both run the same model code (the model's video encode, prefill and decode), interleaved question
   by question; the ratio compares the work each design does.
2. **A video conversation resent without a session**, over HTTP (``llava-serve``, ``llava_client``):
   turn 2 of a stateless ``Conversation`` (the clip named by its uuid, the conversation cache serving
   the rest) vs the same turn in a session: cached share of the prompt, and client TTFT of each.
3. **Streams while a video opens**, over HTTP: 4 sessions stream answers (the server at
   ``step_max_tokens=1``, a token per chunk); the gaps between their tokens at the client, quiet vs
   while another client opens sessions on the video back to back: p99 ratio.

Greedy, ``--new-tokens`` per answer, medians over ``--repeats``. The clip: a real photograph
(``skimage.data.astronaut``) panned across ``--clip-frames`` frames (48, 2 s) of 320x240 H.264, sampled
to ``--num-frames`` (8: 1,569 tokens).

Usage: python benchmarks/video.py [--model bench] [--num-frames 8] [--model-dir DIR] [--skip-http]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from concurrency import pct, stream_gaps  # benchmarks/concurrency.py (this script's folder is on sys.path)
from llava_client import SessionClient, video_part
from llava_sessions.conversation import Chat, VideoBytes
from llava_sessions.engine import EngineLimits, SessionEngine
from llava_sessions.model import LlavaModel
from llava_sessions.sampling.sampler import SamplingParams
from llava_sessions.sessions.store import SessionStore, Tier
from llava_sessions.video import VideoLimits
from llava_sessions.worker import decode_media
from llava_tools.demo.samples import sample_clip, sample_photo
from llava_tools.serve import LocalServer

QUESTIONS = ["What happens in this video?", "What is the person wearing?", "Is there a flag?", "Where is this?"]


def per_request(llava: LlavaModel, decode, data: VideoBytes, prompt: str, new_tokens: int) -> tuple[float, float]:
    """(a): decode, sample, encode and prefill everything for one question; (ttft ms, total ms)."""
    t0 = time.perf_counter()
    with torch.inference_mode():
        video = decode(data)
        feats = llava.encode_video(video)
        chat = Chat(None, image_tokens=(int(feats.shape[0]),), videos=frozenset({0}))
        ids = llava.template.conversation_ids(chat, prompt)
        cache = llava.new_cache()
        token = int(llava.prefill(cache, ids, feats).argmax())
        ttft = (time.perf_counter() - t0) * 1000
        for _ in range(new_tokens - 1):
            if token in llava.eos_token_ids:
                break
            token = int(llava.decode(cache, token).argmax())
    return ttft, (time.perf_counter() - t0) * 1000


def in_process(llava: LlavaModel, raw: bytes, args: argparse.Namespace) -> dict:
    """Measurement 1: follow-up TTFT in a session (from each tier) vs per request."""
    decode = functools.partial(decode_media, max_pixels=40_000_000, video_limits=VideoLimits())
    data = VideoBytes(raw, num_frames=args.num_frames)
    params = SamplingParams(max_new_tokens=args.new_tokens)
    store = SessionStore(
        device_budget_bytes=1 << 40, host_budget_bytes=1 << 34, kv_bytes_per_token=llava.kv_bytes_per_token
    )
    engine = SessionEngine(llava, store, decode, EngineLimits(max_new_tokens_cap=4096))

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

    per_request(llava, decode, data, QUESTIONS[0], 2)  # warm-up
    engine.open("warm", data)
    engine.close("warm")
    rows: dict[str, list[tuple[float, float]]] = {"per_request": [], "kv": [], "features": [], "image": []}
    opens = []
    for rep in range(args.repeats):
        sid = f"s{rep}"
        t0 = time.perf_counter()
        opened = engine.open(sid, data)
        opens.append((time.perf_counter() - t0) * 1000)
        engine.generate(sid, QUESTIONS[0], params)
        for q in QUESTIONS[1:]:
            rows["per_request"].append(per_request(llava, decode, data, q, args.new_tokens))
            rows["kv"].append(ours(sid, q, None))
            rows["features"].append(ours(sid, q, Tier.FEATURES))
            rows["image"].append(ours(sid, q, Tier.IMAGE))
        engine.close(sid)  # the next open is cold (no session holds the clip's features to share)
    med = statistics.median
    table = {k: {"ttft_ms": med(v[0] for v in vals), "total_ms": med(v[1] for v in vals)} for k, vals in rows.items()}
    return {
        "video_tokens": opened.image_tokens,
        "open_ms": med(opens),
        "open_timings_ms": opened.timings,
        "followup": table,
        "followup_ttft_ratio_per_request_over_kv": table["per_request"]["ttft_ms"] / table["kv"]["ttft_ms"],
    }


def stream_ttft(stream_factory) -> float:
    """Client ms from the request to the first text piece of the stream ``stream_factory()`` opens."""
    t0 = time.perf_counter()
    with stream_factory() as stream:
        for _piece in stream:
            ttft = (time.perf_counter() - t0) * 1000
            break
        for _piece in stream:
            pass
    return ttft


def resent(url: str, clip: Path, args: argparse.Namespace) -> dict:
    """Measurement 2: turn 2 of a stateless conversation vs the same turn in a session, over HTTP."""
    client = SessionClient.from_url(url, timeout=(10.0, 600.0))
    n = args.new_tokens
    session_ttft, stateless_ttft, cached, prompt = [], [], [], []
    for rep in range(args.repeats):
        with client.open_session(video=clip, num_frames=args.num_frames) as session:
            session.ask(QUESTIONS[0], max_new_tokens=n, temperature=0)
            session_ttft.append(
                stream_ttft(lambda session=session: session.stream(QUESTIONS[1], max_new_tokens=n, temperature=0))
            )
        chat = client.conversation(cache_salt=f"bench-{rep}")
        part = video_part(clip, num_frames=args.num_frames)
        chat.ask(QUESTIONS[0], videos=[part], max_tokens=n, temperature=0)  # turn 1: the clip sent once
        stateless_ttft.append(stream_ttft(lambda chat=chat: _StreamOf(chat, QUESTIONS[1], n)))  # turn 2
        usage = chat.last_usage
        cached.append(usage.cached_tokens)
        prompt.append(usage.prompt_tokens)
    client.close()
    med = statistics.median
    return {
        "session_turn2_ttft_ms": med(session_ttft),
        "stateless_turn2_ttft_ms": med(stateless_ttft),
        "stateless_over_session_ttft": med(stateless_ttft) / med(session_ttft),
        "stateless_turn2_cached_share": med(c / p for c, p in zip(cached, prompt, strict=True)),
        "stateless_turn2_prompt_tokens": med(prompt),
    }


class _StreamOf:
    """``Conversation.ask_stream`` as a context manager of its pieces (for :func:`stream_ttft`)."""

    def __init__(self, chat, question: str, max_tokens: int) -> None:
        self._pieces = chat.ask_stream(question, max_tokens=max_tokens, temperature=0)

    def __enter__(self):
        return self._pieces

    def __exit__(self, *exc) -> None:
        for _piece in self._pieces:
            pass


def gaps_while_opening(url: str, clip: Path, args: argparse.Namespace) -> dict:
    """Measurement 3: p99 token gap of 4 streams, quiet vs while videos open back to back."""
    client = SessionClient.from_url(url, timeout=(10.0, 600.0))
    photo = sample_photo("chelsea")
    sessions = [client.open_session(photo) for _ in range(4)]
    question = "Describe this image in great detail, please."
    for s in sessions:
        s.ask(question, remember=False, max_new_tokens=2)

    def run_streams() -> list[float]:
        return stream_gaps(sessions, question, args.stream_tokens)

    quiet, busy, opens = [], [], [0]
    for _ in range(args.repeats):
        quiet += run_streams()
        stop = threading.Event()

        def opener(stop: threading.Event = stop) -> None:
            other = SessionClient.from_url(url, timeout=(10.0, 600.0))
            while not stop.is_set():
                other.open_session(video=clip, num_frames=args.num_frames).close()
                opens[0] += 1
            other.close()

        thread = threading.Thread(target=opener)
        thread.start()
        busy += run_streams()
        stop.set()
        thread.join()
    for s in sessions:
        s.close()
    client.close()
    q99, b99 = pct(quiet, 99), pct(busy, 99)
    return {
        "quiet_ms": {"p50": pct(quiet, 50), "p99": q99, "n": len(quiet)},
        "while_opening_ms": {"p50": pct(busy, 50), "p99": b99, "n": len(busy)},
        "videos_opened_meanwhile": opens[0],
        "p99_ratio": round(b99 / q99, 2) if q99 and b99 else None,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="bench", choices=["tiny", "bench"], help="OneVision checkpoint size to build")
    ap.add_argument("--model-dir", help="use this LLaVA-OneVision checkpoint folder instead of building one")
    ap.add_argument("--num-frames", type=int, default=8)
    ap.add_argument("--clip-frames", type=int, default=48, help="frames of the clip (at most 49 fit the photo)")
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--stream-tokens", type=int, default=48, help="tokens each stream of measurement 3 answers")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-http", action="store_true", help="measurement 1 only (no server)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)

    torch.manual_seed(0)
    folder = args.model_dir
    if folder is None:
        from llava_tools.tiny_model import write_checkpoint

        folder = write_checkpoint(args.model, tempfile.mkdtemp(prefix="llava-ov-"), arch="llava-onevision")
    raw = sample_clip(num_frames=args.clip_frames, fps=24, size=(320, 240), step=(4, 3))
    llava = LlavaModel.from_pretrained(folder, device="auto")
    result: dict = {"model": args.model_dir or args.model, "device": str(llava.device)}
    result.update(num_frames=args.num_frames, clip_bytes=len(raw), new_tokens=args.new_tokens, repeats=args.repeats)
    result["torch_threads"] = torch.get_num_threads()
    result["in_process"] = one = in_process(llava, raw, args)
    print(f"video: {args.num_frames} frames sampled, {one['video_tokens']} tokens; open {one['open_ms']:.0f} ms")
    print(f"{'follow-up question':<24}{'TTFT ms':>10}{'total ms':>10}")
    for name, row in one["followup"].items():
        print(f"{name:<24}{row['ttft_ms']:>10.1f}{row['total_ms']:>10.1f}")
    print(f"per request / session (KV hit), TTFT: {one['followup_ttft_ratio_per_request_over_kv']:.1f}x")
    del llava
    if not args.skip_http:
        with tempfile.TemporaryDirectory() as tmp:
            clip = Path(tmp) / "clip.mp4"
            clip.write_bytes(raw)
            overrides = {"step_max_tokens": 1, "video_num_frames": args.num_frames, "max_sessions": 16}
            with LocalServer(folder, overrides=overrides, startup_timeout_s=600) as server:
                result["resent"] = two = resent(server.url, clip, args)
                print(
                    f"turn 2 resent without a session: {two['stateless_turn2_cached_share']:.1%} of "
                    f"{two['stateless_turn2_prompt_tokens']} prompt tokens cached; TTFT "
                    f"{two['stateless_turn2_ttft_ms']:.0f} ms vs the session's {two['session_turn2_ttft_ms']:.0f} ms "
                    f"({two['stateless_over_session_ttft']:.2f}x)"
                )
                result["streams_while_opening"] = three = gaps_while_opening(server.url, clip, args)
                print(
                    f"4 streams' p99 token gap: quiet {three['quiet_ms']['p99']} ms, while videos open "
                    f"{three['while_opening_ms']['p99']} ms ({three['p99_ratio']}x; "
                    f"{three['videos_opened_meanwhile']} opened)"
                )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
