"""The chat dialect's costs, side by side in one run (bench model, in process through SessionService).

Each row times whole requests through the service (the body's JSON and base64 decoded, the image
hashed, the conversation templated, the model run), medians over ``--repeats``, interleaved:

1. **Follow-up TTFT of a resent 3-turn conversation**: in a session that answered the three turns
   (its cache holds them) vs the same body as a sessionless request on a worker holding nothing of it
   (``share_images: false``: every image encoded, every token prefilled; target >= 10x) vs our native
   ``generate`` of the same question in a session with the same history (target <= 1.15x: the cost
   of parsing, hashing and templating the resent history). ``max_tokens`` 1: the reply is the first
   token.
2. **Open on an image another session holds vs a new image** (native ``open_session``, the image
   inline): the stored image's features and prefix KV are copied instead of computed (target >= 3x).

Usage: python benchmarks/chat_protocol.py [--model bench] [--repeats 7] [--model-dir DIR]
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
import uuid
from pathlib import Path
from typing import Any

from PIL import Image

from llava_sessions.wire.in_flight import BatchRequest
from llava_sessions.worker import WorkerOrigin, build_local_service
from llava_tools.demo.samples import sample_photo

TURNS = ["What is in this image?", "What colour is the suit?", "Is there a flag in the picture?"]
QUESTION = "Describe the background in one sentence."


def call(service: Any, body: dict, session_id: str | None = None) -> tuple[float, dict]:
    """Send one request through ``service.handle`` (and its continuations); returns (ms, reply JSON)."""
    rid = uuid.uuid4().hex
    t0 = time.perf_counter()
    result = service.handle([BatchRequest(rid, session_id, False, json.dumps(body).encode())])[0]
    while result.stop is False:
        result = service.handle([BatchRequest(rid, session_id, False, None)])[0]
    ms = (time.perf_counter() - t0) * 1000.0
    reply = json.loads(result.body)
    if result.status != 200 or "error" in reply:
        raise RuntimeError(f"request failed: {result.status} {reply}")
    return ms, reply


def new_session(service: Any) -> str:
    return call(service, {"requestType": "NEW_SESSION"})[1]["session_id"]


def varied_photo(seed: int) -> bytes:
    """The sample photo with one pixel changed per ``seed``: a new image by content."""
    img = Image.open(io.BytesIO(sample_photo())).convert("RGB")
    img.putpixel((seed % img.width, 0), (seed % 256, 7, 11))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def conversation(image: bytes, answers: list[str], question: str) -> list[dict]:
    uri = "data:image/png;base64," + base64.b64encode(image).decode()
    messages: list[dict] = []
    for i, (prompt, answer) in enumerate(zip(TURNS, answers, strict=False)):
        parts: list[dict] = [{"type": "image_url", "image_url": {"url": uri}}] if i == 0 else []
        messages.append({"role": "user", "content": [*parts, {"type": "text", "text": prompt}]})
        messages.append({"role": "assistant", "content": answer})
    if not answers:
        messages.append(
            {
                "role": "user",
                "content": [{"type": "image_url", "image_url": {"url": uri}}, {"type": "text", "text": question}],
            }
        )
    else:
        messages.append({"role": "user", "content": question})
    return messages


def median(values: list[float]) -> float:
    return round(statistics.median(values), 2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--model", default="bench", help="tiny-model size to build (default bench)")
    parser.add_argument("--model-dir", default="", help="an existing checkpoint folder instead")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--new-tokens", type=int, default=8, help="tokens per answer of the three turns")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model_dir
        if not model_dir:
            from llava_tools.tiny_model import write_checkpoint

            model_dir = str(write_checkpoint(args.model, Path(tmp) / args.model, seed=0))
        base = {"model_dir": model_dir, "device": "cpu", "dtype": "float32", "max_sessions": 64}
        service = build_local_service(base, WorkerOrigin(env={}))
        cold = build_local_service({**base, "share_images": False}, WorkerOrigin(env={}))
        return run(service, cold, args)


def run(service: Any, cold: Any, args: argparse.Namespace) -> int:
    greedy = {"temperature": 0}
    resent, sessionless, native, held, fresh = [], [], [], [], []
    for r in range(args.repeats + 1):  # the first round warms up
        image = varied_photo(1000 + r)
        # a chat session that answered the three turns, then the follow-up resent in full
        sid = new_session(service)
        answers: list[str] = []
        for k, prompt in enumerate(TURNS):
            msgs = conversation(image, answers, prompt) if k else conversation(image, [], prompt)
            reply = call(service, {"messages": msgs, "max_tokens": args.new_tokens, **greedy}, sid)[1]
            answers.append(reply["choices"][0]["message"]["content"])
        body = {"messages": conversation(image, answers, QUESTION), "max_tokens": 1, **greedy}
        t_resent, reply = call(service, body, sid)
        cached = reply["usage"]["prompt_tokens_details"]["cached_tokens"]
        t_sessionless, _ = call(cold, body)  # nothing of it held on that worker
        # the native protocol: the same image and the same history, the same question
        opened = call(
            service,
            {
                "type": "open_session",
                "image": {"base64": base64.b64encode(image).decode()},
                "history": [{"prompt": p, "answer": a} for p, a in zip(TURNS, answers, strict=True)],
            },
        )[1]
        t_native, _ = call(
            service, {"type": "generate", "prompt": QUESTION, "parameters": {"max_new_tokens": 1}}, opened["session_id"]
        )
        # opens: an image a session holds vs an image nobody holds
        t_held, _ = call(service, {"type": "open_session", "image": {"base64": base64.b64encode(image).decode()}})
        new_image = varied_photo(5000 + r)
        t_fresh, _ = call(service, {"type": "open_session", "image": {"base64": base64.b64encode(new_image).decode()}})
        if r:
            resent.append(t_resent)
            sessionless.append(t_sessionless)
            native.append(t_native)
            held.append(t_held)
            fresh.append(t_fresh)
        print(
            f"round {r}{' (warm-up)' if not r else ''}: resent {t_resent:.1f} ms (cached {cached} of "
            f"{reply['usage']['prompt_tokens']}), sessionless {t_sessionless:.1f}, native {t_native:.1f}; "
            f"open held {t_held:.1f}, new {t_fresh:.1f}",
            flush=True,
        )
    result = {
        "follow_up_ttft_ms": {
            "resent_in_session": median(resent),
            "sessionless": median(sessionless),
            "native_generate": median(native),
        },
        "sessionless_over_resent": round(statistics.median(sessionless) / statistics.median(resent), 2),
        "resent_over_native": round(statistics.median(resent) / statistics.median(native), 3),
        "open_ms": {"image_held": median(held), "new_image": median(fresh)},
        "new_over_held_open": round(statistics.median(fresh) / statistics.median(held), 2),
        "repeats": args.repeats,
    }
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
