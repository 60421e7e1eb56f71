"""Stateless conversations against sessions, side by side in one run (bench model, over HTTP).

A real ``llava-serve`` (TorchServe, the handler, CPU fp32) and raw HTTP requests to ``/invocations``
in the chat dialect, each streamed so TTFT is the time to the first content event:

1. **Turns 2 and 3 of a 3-turn image chat**, resent whole in a session (AWS's pattern: NEW_SESSION,
   then the whole ``messages`` every turn) and resent without a session (the conversation cache),
   interleaved, a fresh photo (by content) per conversation: median TTFT per mode, their ratio (goal
   <= 1.3x) and the share of prompt tokens served from cache (goal >= 90%).
2. **8 interleaved stateless conversations on 8 photos** (turn 1 of each, then turn 2 of each, then
   turn 3): the share cached on turns 2+ under the default budget (goal >= 90%); then on a server whose
   device budget holds only a few of them: every answer the same as under the default budget, and
   which conversations still hit (the oldest entries go first).
3. **Two salts, one image and one conversation**: salt A's repeat (a hit), salt B's first turn (0
   cached tokens) and a never-seen photo's first turn: salt B's TTFT over the new photo's (goal:
   1.0 within noise, no timing signal across salts).
4. **Bytes our client sends per follow-up**, with the image's bytes resent and by ``uuid``.

Usage: python benchmarks/stateless.py [--model bench] [--repeats 3] [--model-dir DIR]
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import requests
from PIL import Image

from llava_tools.demo.samples import sample_photo
from llava_tools.serve.server import LocalServer

TURNS = ["What is in this image?", "What colour is the suit?", "Is there a flag in the picture?"]
SID = "X-Amzn-SageMaker-Session-Id"
MAX_TOKENS = 8


def photo(seed: int) -> bytes:
    """The sample photo with one pixel changed per ``seed``: a new image by content, the same size."""
    img = Image.open(io.BytesIO(sample_photo())).convert("RGB")
    img.putpixel((seed % img.width, 1), (seed % 256, (seed // 256) % 256, 11))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def messages_for(image: bytes, answers: list[str], *, uuid: str | None = None, reference: bool = False) -> list[dict]:
    """The conversation up to turn ``len(answers) + 1``: the photo opens the first user message."""
    part: dict[str, Any] = {
        "type": "image_url",
        "image_url": {"url": "data:image/png;base64," + base64.b64encode(image).decode()},
    }
    if uuid:
        part = {"type": "image_url", "image_url": None, "uuid": uuid} if reference else {**part, "uuid": uuid}
    out: list[dict] = []
    for i, prompt in enumerate(TURNS[: len(answers) + 1]):
        out.append({"role": "user", "content": [*([part] if i == 0 else []), {"type": "text", "text": prompt}]})
        if i < len(answers):
            out.append({"role": "assistant", "content": answers[i]})
    return out


def turn(url: str, messages: list[dict], session_id: str | None = None, salt: str | None = None) -> dict[str, Any]:
    """One streamed chat request: ``ttft_ms``, ``text``, ``prompt_tokens``, ``cached_tokens``."""
    body: dict[str, Any] = {
        "messages": messages,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if salt:
        body["cache_salt"] = salt
    headers = {"Content-Type": "application/json", **({SID: session_id} if session_id else {})}
    t0 = time.perf_counter()
    ttft, text, usage = None, "", {}
    with requests.post(url + "/invocations", data=json.dumps(body), headers=headers, stream=True, timeout=600) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {r.text[:300]}")
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"])
            for choice in chunk.get("choices") or ():
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    ttft = ttft if ttft is not None else (time.perf_counter() - t0) * 1000.0
                    text += piece
            usage = chunk.get("usage") or usage
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "ttft_ms": ttft or 0.0,
        "text": text,
        "prompt_tokens": usage.get("prompt_tokens", 0),
        "cached_tokens": cached,
    }


def new_session(url: str) -> str:
    r = requests.post(
        url + "/invocations", json={"requestType": "NEW_SESSION"}, headers={SID: "NEW_SESSION"}, timeout=60
    )
    return r.headers["X-Amzn-SageMaker-New-Session-Id"].split(";")[0]


def chat(url: str, image: bytes, *, session: bool, salt: str | None = None) -> list[dict[str, Any]]:
    """A 3-turn conversation on ``image``; every turn resends the whole conversation."""
    sid = new_session(url) if session else None
    answers: list[str] = []
    out = []
    for _ in TURNS:
        reply = turn(url, messages_for(image, answers), sid, salt)
        answers.append(reply["text"])
        out.append(reply)
    if sid:
        requests.post(url + "/invocations", json={"requestType": "CLOSE"}, headers={SID: sid}, timeout=60)
    return out


def part1(url: str, repeats: int) -> None:
    rows: dict[str, list[dict]] = {"session": [], "stateless": []}
    for r in range(repeats):
        for k, mode in enumerate(rows):
            rows[mode] += chat(url, photo(100 + 2 * r + k), session=mode == "session")[1:]
    print("1. turns 2 and 3 of a 3-turn image chat, resent whole every turn")
    med = {}
    for mode, replies in rows.items():
        med[mode] = statistics.median(x["ttft_ms"] for x in replies)
        share = sum(x["cached_tokens"] for x in replies) / sum(x["prompt_tokens"] for x in replies)
        print(f"   {mode:<10} TTFT median {med[mode]:8.1f} ms   cached {100 * share:5.1f}% of prompt tokens")
    print(f"   stateless / session TTFT: {med['stateless'] / med['session']:.2f}x (goal <= 1.3x)")


def interleaved(url: str, n: int = 8, *, newest_first: bool = False) -> tuple[list[list[dict[str, Any]]], float]:
    """``n`` stateless conversations, turn by turn interleaved (turn 1 of each, then turn 2 of each, ...;
    ``newest_first``: turns 2+ from the last conversation back, so a cache that keeps only some of them
    shows which it kept); returns the replies and the cached share of turns 2+."""
    images = [photo(200 + i) for i in range(n)]
    answers: list[list[str]] = [[] for _ in range(n)]
    replies: list[list[dict[str, Any]]] = [[] for _ in range(n)]
    for t in range(len(TURNS)):
        for i in reversed(range(n)) if newest_first and t else range(n):
            reply = turn(url, messages_for(images[i], answers[i]))
            answers[i].append(reply["text"])
            replies[i].append(reply)
    later = [x for conv in replies for x in conv[1:]]
    return replies, sum(x["cached_tokens"] for x in later) / sum(x["prompt_tokens"] for x in later)


def part3(url: str, repeats: int) -> None:
    hit, other, new = [], [], []
    for r in range(repeats):
        image = photo(300 + 2 * r)
        first = turn(url, messages_for(image, []), salt="tenant-a")
        hit.append(turn(url, messages_for(image, []), salt="tenant-a"))
        pair = [("b", image), ("c", photo(301 + 2 * r))]
        for name, picture in pair if r % 2 == 0 else pair[::-1]:  # alternate which goes first
            (other if name == "b" else new).append(turn(url, messages_for(picture, []), salt=f"tenant-{name}"))
        assert other[-1]["text"] == first["text"], "a salt changes what is shared, never the answer"
    med = {
        name: statistics.median(x["ttft_ms"] for x in rows)
        for name, rows in (("hit", hit), ("other", other), ("new", new))
    }
    print("3. one photo and conversation under two salts")
    print(
        f"   salt A repeated (a hit)      TTFT {med['hit']:8.1f} ms   cached {statistics.median(x['cached_tokens'] for x in hit):.0f} tokens"
    )
    print(
        f"   salt B, first turn           TTFT {med['other']:8.1f} ms   cached {max(x['cached_tokens'] for x in other)} tokens"
    )
    print(f"   a never-seen photo           TTFT {med['new']:8.1f} ms")
    print(f"   salt B / never-seen photo: {med['other'] / med['new']:.2f}x (goal 1.0 within noise)")


def part4() -> None:
    image = photo(400)
    answers = ["A man in a space suit.", "White."]
    resent = len(json.dumps({"messages": messages_for(image, answers, uuid="u1")}).encode())
    referenced = len(json.dumps({"messages": messages_for(image, answers, uuid="u1", reference=True)}).encode())
    print("4. bytes our client sends for turn 3 of a one-photo chat")
    print(f"   image bytes resent: {resent:,} B   by uuid: {referenced:,} B   ({resent / referenced:.0f}x fewer)")


def _metric(server: LocalServer, name: str) -> float:
    """A gauge's value from TorchServe's metrics port (0.0 when not there yet)."""
    deadline = time.monotonic() + 10
    while True:
        for line in requests.get(server.metrics_url + "/metrics", timeout=10).text.splitlines():
            if line.startswith(f"llava_{name}{{"):
                return float(line.rsplit(" ", 1)[1])
        if time.monotonic() > deadline:
            return 0.0
        time.sleep(0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bench", help="tiny_model preset to build (default bench)")
    parser.add_argument("--model-dir", default=None, help="an existing checkpoint folder instead")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model_dir
        if model_dir is None:
            from llava_tools.tiny_model import write_checkpoint

            model_dir = str(write_checkpoint(args.model, Path(tmp) / args.model, seed=0))
        common = {"startup_timeout_s": 900, "openai_routes": False}
        with LocalServer(model_dir, **common) as server:
            part1(server.url, args.repeats)
            replies, share = interleaved(server.url, newest_first=True)
            print("2. 8 interleaved stateless conversations, 3 turns each")
            print(f"   default budget: turns 2+ cached {100 * share:5.1f}% of prompt tokens (goal >= 90%)")
            entry = _metric(server, "ConversationCacheBytes") / max(1.0, _metric(server, "ConversationCacheEntries"))
            part3(server.url, max(args.repeats, 5))
        small = int(entry * 4.5)  # about three 3-turn entries beside the one answering
        overrides = {"device_budget_bytes": small, "conversation_cache_share": 1.0}
        with LocalServer(model_dir, overrides=overrides, **common) as server:
            tight, tight_share = interleaved(server.url, newest_first=True)
        same = all(
            a["text"] == b["text"] for x, y in zip(replies, tight, strict=True) for a, b in zip(x, y, strict=True)
        )
        hits = ["hit" if conv[1]["cached_tokens"] >= conv[0]["prompt_tokens"] else "miss" for conv in tight]
        print(f"   device budget {small:,} B (about 3 entries): turns 2+ cached {100 * tight_share:5.1f}%")
        print(f"   answers identical to the default budget's: {same}")
        print(f"   turn 2 of conversations 1..8 (turns 1 sent 1..8, turns 2 sent 8..1): {' '.join(hits)}")
    part4()


if __name__ == "__main__":
    sys.exit(main())
