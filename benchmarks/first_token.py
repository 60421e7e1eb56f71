"""A stream's first token against a one-token answer, side by side, over HTTP through ``llava-serve``.

On a local ``llava-serve`` (``/v1/chat/completions``, no session: after the first request, the
conversation cache serves the image and the prompt's prefix), the same question on the sample photo
is asked, interleaved, ``--repeats`` times each way:

1. **one-token answer**: ``max_tokens`` 1, not streamed; the time to the whole reply.
2. **a stream's first token**: ``max_tokens`` ``--max-tokens``, streamed; the time to the first chunk
   with content, read with ``requests`` as it arrives; and by how much the stream's first chunk of any
   kind came before its first token's (a role chunk sent ahead of any token flatters a tool that takes
   the first chunk for the first token; since issue 75 item 6 the role goes with the first token).

Both pay the same prefill of the question; the ratio (2) / (1) is the cost of streaming the first
token (target: about 1). Medians in ms. Also printed: how many tokens that first content chunk held.

Usage: python benchmarks/first_token.py [--model tiny] [--repeats 15] [--max-tokens 64] [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import base64
import json
import statistics
import tempfile
import time
from pathlib import Path

import requests

from llava_tools.cli import add_setting_arguments
from llava_tools.demo.samples import sample_photo
from llava_tools.serve import LocalServer
from llava_tools.tiny_model import write_checkpoint

QUESTION = "What is in this image?"


def one_token_ms(url: str, messages: list[dict]) -> float:
    """Milliseconds to a whole ``max_tokens`` 1 answer."""
    body = {"messages": messages, "max_tokens": 1, "temperature": 0}
    t0 = time.perf_counter()
    r = requests.post(url, json=body, timeout=120)
    r.raise_for_status()
    return (time.perf_counter() - t0) * 1000.0


def first_token_ms(url: str, messages: list[dict], max_tokens: int) -> tuple[float, int, float]:
    """Milliseconds to a stream's first chunk with content, the tokens that chunk held (logprobs), and
    the milliseconds by which the stream's first chunk of any kind (a role chunk, say) came before its
    first token's (vLLM's usage so far, ``continuous_usage_stats``, says when a chunk holds a token)."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True, "logprobs": True}
    body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    t0 = time.perf_counter()
    first_any = first_token = None
    with requests.post(url, json=body, timeout=120, stream=True) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data: {"):
                continue
            now = (time.perf_counter() - t0) * 1000.0
            first_any = now if first_any is None else first_any
            chunk = json.loads(line[6:])
            if first_token is None and (chunk.get("usage") or {}).get("completion_tokens"):
                first_token = now
            choices = chunk["choices"]
            if choices and choices[0]["delta"].get("content"):
                held = len((choices[0].get("logprobs") or {}).get("content") or [])
                return now, held, (first_token if first_token is not None else now) - first_any
    raise RuntimeError("the stream ended without content")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["tiny", "bench"], default="tiny")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--max-tokens", type=int, default=64)
    add_setting_arguments(parser, handler_help="a handler setting, e.g. --set step_max_tokens=1")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_checkpoint(args.model, Path(tmp) / args.model, seed=0)
        with LocalServer(model_dir, startup_timeout_s=300, overrides=dict(args.overrides)) as server:
            url = server.url + "/v1/chat/completions"
            image = "data:image/jpeg;base64," + base64.b64encode(sample_photo()).decode()
            content = [{"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": QUESTION}]
            messages = [{"role": "user", "content": content}]
            one, streamed, held, early = [], [], [], []
            for i in range(args.repeats + 1):  # the first round warms up (and fills the conversation cache)
                a = one_token_ms(url, messages)
                b, n, before = first_token_ms(url, messages, args.max_tokens)
                if i:
                    one.append(a)
                    streamed.append(b)
                    held.append(n)
                    early.append(before)
            a, b = statistics.median(one), statistics.median(streamed)
            print(f"one-token answer:        {a:7.1f} ms (median of {args.repeats})")
            print(f"a stream's first token:  {b:7.1f} ms, its chunk held {statistics.median(held):.0f} token(s)")
            print(f"ratio first token / one-token answer: {b / a:.2f}")
            print(f"the stream's first chunk came before its first token by {statistics.median(early):.1f} ms "
                  f"(median; max {max(early):.1f})")  # fmt: skip


if __name__ == "__main__":
    main()
