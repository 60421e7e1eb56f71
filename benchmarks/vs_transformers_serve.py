"""llava-serve beside ``transformers serve``, side by side in one run, on the same checkpoint and wheels.

The peer is transformers' own OpenAI-compatible server (``transformers serve``: ``POST
/v1/chat/completions``, server-sent events without ``[DONE]``, model id = the checkpoint's folder),
the thing a user might pick instead. It runs from its own venv (``--peer-venv``; ``make bench-peer``
builds it: ``pip install torch==<ours>`` then ``"transformers[serving]==<our pinned version>"`` from
``config/constraints.txt``), on the CPU, fp32, with the same thread count as ours. Ours is
``llava-serve`` (TorchServe and the handler, default settings) on its ``/v1/chat/completions`` route,
started as a user starts it, in its own process as the peer is (until 27 Nov it ran in this script's
process, whose client threads then shared its proxy's interpreter).
Both get the same request bodies, greedy, one measurement at a time, interleaved round by round (ours
then the peer's, then the peer's then ours), every image turn on a photo neither has seen (one pixel
changed per request). Both are warmed alike first: a short stream, then one burst of ``--concurrent``
8-token streams (a fresh llava-serve's first 8-stream bursts ran 6-12% slower than its later ones, at
101.5, 107.8, 111.9 and 114.3 tokens/s one after another on 27 Nov, while TorchServe's JIT compiled
the path and the worker's pass costs settled).

Measured, every figure the median of ``--rounds``:

1. a cold image turn, streamed: the first event (the role chunk) and TTFT (first content);
2. a cold image turn with ``max_tokens=1``: wall time;
3. a 3-turn chat resent whole without a session: turn 2's TTFT (ours: from its conversation cache);
   and ours inside a session (``requestType`` NEW_SESSION, then the same bodies with the header);
4. one stream of ``--new-tokens`` tokens: end-to-end tokens/s (tokens counted with the checkpoint's
   tokenizer on the streamed text, the same way for both);
5. 8 image streams sent at once: total tokens/s and median TTFT;
6. a running stream's longest pause between two events while a new image request arrives and
   is answered, and its longest pause with nothing else happening (the peer, which has no batching
   for LLaVA, finishes the running stream before it starts the new one: its pause is its plain gap).

Usage: python benchmarks/vs_transformers_serve.py [--model bench] [--rounds 3] [--peer-venv .venv-peer]
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import requests
from PIL import Image

from llava_tools.demo.samples import sample_photo
from llava_tools.processes import stop_process_group

QUESTIONS = ["Describe this image.", "What colour is the suit?", "Is there a flag in the picture?"]
SID = "X-Amzn-SageMaker-Session-Id"
_seed = [1000]


def fresh_photo(name: str = "astronaut") -> bytes:
    """A photo no server has seen: the sample with one pixel changed (a new image by content)."""
    _seed[0] += 1
    s = _seed[0]
    img = Image.open(io.BytesIO(sample_photo(name))).convert("RGB")
    img.putpixel((s % img.width, (s // img.width) % img.height), (s % 256, (s * 7) % 256, 99))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def user(text: str, image: bytes | None = None) -> dict[str, Any]:
    """A user message: the image (as a data URL) then the text."""
    parts: list[dict[str, Any]] = []
    if image is not None:
        parts.append(
            {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(image).decode()}}
        )
    return {"role": "user", "content": [*parts, {"type": "text", "text": text}]}


class Target:
    """One server's chat route: ``url`` (``.../v1/chat/completions``), ``model`` (its model id)."""

    def __init__(self, name: str, url: str, model: str, tokenizer: Any) -> None:
        self.name, self.url, self.model, self.tokenizer = name, url, model, tokenizer

    def stream(
        self,
        messages: list[dict[str, Any]],
        max_tokens: int,
        *,
        headers: dict[str, str] | None = None,
        url: str | None = None,
        on_event: Callable[[float], None] | None = None,
    ) -> dict[str, Any]:
        """One streamed greedy request. Returns ``first_ms`` (first event), ``ttft_ms`` (first content),
        ``total_ms``, ``text``, ``tokens`` (the text's tokens), ``gaps_ms`` (between events with content),
        ``times`` (perf_counter of each content event)."""
        body = {"model": self.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
        t0 = time.perf_counter()
        first = ttft = None
        text, times = "", []
        with requests.post(url or self.url, json=body, headers=headers or {}, stream=True, timeout=900) as r:
            if r.status_code != 200:
                raise RuntimeError(f"{self.name}: {r.status_code} {r.text[:300]}")
            for line in r.iter_lines():
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                now = time.perf_counter()
                first = first if first is not None else now
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(f"{self.name}: {chunk['error']}")
                piece = "".join((c.get("delta") or {}).get("content") or "" for c in chunk.get("choices") or ())
                if piece:
                    ttft = ttft if ttft is not None else now
                    text += piece
                    times.append(now)
                    if on_event is not None:
                        on_event(now)
        end = time.perf_counter()
        return {
            "first_ms": ((first or end) - t0) * 1000.0,
            "ttft_ms": ((ttft or end) - t0) * 1000.0,
            "total_ms": (end - t0) * 1000.0,
            "text": text,
            "tokens": len(self.tokenizer(text, add_special_tokens=False).input_ids),
            "gaps_ms": [(b - a) * 1000.0 for a, b in zip(times, times[1:], strict=False)],
            "times": times,
        }


def cold_turn(t: Target) -> dict[str, float]:
    """A never-seen photo's turn, streamed (first event and TTFT, ms), then another's with
    ``max_tokens=1`` (wall ms)."""
    r = t.stream([user(QUESTIONS[0], fresh_photo())], 16)
    one = t.stream([user(QUESTIONS[0], fresh_photo())], 1)
    return {"first_event_ms": r["first_ms"], "cold_ttft_ms": r["ttft_ms"], "cold_max_tokens_1_ms": one["total_ms"]}


def resent_chat(t: Target, session_url: str | None = None) -> float:
    """Turn 2's TTFT of a 3-turn chat resent whole (inside a session when ``session_url``)."""
    headers = new_session(session_url) if session_url is not None else {}
    url = session_url
    messages = [user(QUESTIONS[0], fresh_photo())]
    ttfts = []
    for q in QUESTIONS[1:] + [None]:
        reply = t.stream(messages, 8, headers=headers, url=url)
        ttfts.append(reply["ttft_ms"])
        if q is None:
            break
        messages += [{"role": "assistant", "content": reply["text"]}, user(q)]
    if session_url is not None:
        close_session(session_url, headers)
    return ttfts[1]


def new_session(session_url: str) -> dict[str, str]:
    """Open a session on our ``/invocations`` (SageMaker's ``NEW_SESSION``); returns its header."""
    r = requests.post(session_url, json={"requestType": "NEW_SESSION"}, headers={SID: "NEW_SESSION"}, timeout=60)
    return {SID: r.headers["X-Amzn-SageMaker-New-Session-Id"].split(";")[0]}


def close_session(session_url: str, headers: dict[str, str]) -> None:
    """Close the session ``headers`` name (``CLOSE`` on ``/invocations``)."""
    requests.post(session_url, json={"requestType": "CLOSE"}, headers=headers, timeout=60)


def one_stream(t: Target, new_tokens: int) -> float:
    """End-to-end tokens/s of one streamed image turn of ``new_tokens`` tokens."""
    r = t.stream([user(QUESTIONS[0], fresh_photo())], new_tokens)
    return r["tokens"] / (r["total_ms"] / 1000.0)


def concurrent(t: Target, n: int, new_tokens: int) -> dict[str, float]:
    """``n`` image streams sent at once: total tokens/s over the wall time, and their median TTFT (ms)."""
    photos = [fresh_photo() for _ in range(n)]
    with ThreadPoolExecutor(max_workers=n) as pool:  # all n sent at once
        t0 = time.perf_counter()
        results = list(pool.map(lambda p: t.stream([user(QUESTIONS[0], p)], new_tokens), photos))
    wall = time.perf_counter() - t0
    return {
        "concurrent_tokens_per_s": sum(r["tokens"] for r in results) / wall,
        "concurrent_median_ttft_ms": statistics.median(r["ttft_ms"] for r in results),
    }


def pause(t: Target, new_tokens: int) -> dict[str, float]:
    """A running stream's longest gap while a new image request arrives and is answered, and its
    longest gap in a stream with nothing else happening."""
    quiet = t.stream([user(QUESTIONS[0], fresh_photo())], new_tokens)
    started = threading.Event()
    count = [0]

    def on_event(now: float) -> None:
        count[0] += 1
        if count[0] == 3:
            started.set()

    result: dict[str, Any] = {}

    def running() -> None:
        result.update(t.stream([user(QUESTIONS[0], fresh_photo())], new_tokens, on_event=on_event))

    th = threading.Thread(target=running)
    th.start()
    started.wait(timeout=600)
    t0 = time.perf_counter()
    t.stream([user(QUESTIONS[0], fresh_photo())], 1)
    t1 = time.perf_counter()
    th.join()
    times = result["times"]
    gaps = [(b - a) * 1000.0 for a, b in zip(times, times[1:], strict=False) if b >= t0 and a <= t1]
    return {"pause_new_image_ms": max(gaps, default=0.0), "pause_quiet_ms": max(quiet["gaps_ms"], default=0.0)}


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_peer(venv: Path, model_dir: str, threads: int) -> tuple[subprocess.Popen, str]:
    """Start ``transformers serve`` from ``venv`` on ``model_dir`` (CPU, fp32, ``threads`` OpenMP
    threads, its own process group, its log in the temp folder); returns it and its URL once
    ``/v1/models`` answers. Exits the script when it dies or does not answer in 600 s."""
    port = free_port()
    exe = venv / "bin" / "transformers"
    if not exe.exists():
        sys.exit(f"no {exe}: build the peer's venv first (make bench-peer)")
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TRANSFORMERS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [
        str(exe),
        "serve",
        model_dir,
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    log = open(Path(tempfile.gettempdir()) / f"transformers-serve-{port}.log", "wb")  # noqa: SIM115 - lives with the process
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"transformers serve exited {proc.returncode}: see {log.name}")
        try:
            requests.get(url + "/v1/models", timeout=2)
            return proc, url
        except requests.RequestException:
            time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)
    sys.exit("transformers serve did not start in 600 s")


#: Seconds a server gets to stop on SIGTERM before what is left of its process group is killed.
STOP_GRACE_S = 60
#: What ``llava-serve`` prints once its worker is ready (its URL).
READY = re.compile(r"llava-serve: ready at (http://\S+) ")


def start_ours(model_dir: str, settings: list[str], threads: int) -> tuple[subprocess.Popen, str]:
    """Start ``llava-serve`` on ``model_dir`` as a user runs it: its own process (as the peer is: the
    client shares no interpreter with either server), a free port, ``--set torch_threads=<threads>``
    and each of ``settings`` (``KEY=VALUE``), its output in the temp folder; returns it and its URL
    once it prints that it is ready. Exits the script when it dies or is not ready in 900 s."""
    script = Path(sys.executable).parent / "llava-serve"
    cmd = [str(script) if script.exists() else "llava-serve", "--model-dir", model_dir, "--port", "0"]
    for item in [f"torch_threads={threads}", *settings]:
        cmd += ["--set", item]
    log_path = Path(tempfile.gettempdir()) / f"llava-serve-bench-{os.getpid()}.log"
    log = open(log_path, "wb")  # noqa: SIM115 - lives with the process
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        found = READY.search(log_path.read_text(errors="replace"))
        if found:
            return proc, found.group(1)
        if proc.poll() is not None:
            sys.exit(f"llava-serve exited {proc.returncode}: see {log_path}")
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)
    sys.exit("llava-serve was not ready in 900 s")


def measure(
    targets: list[Target], session_url: str, rounds: int, new_tokens: int, n: int
) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, list[float]]]]:
    """Every measurement ``rounds`` times, the two servers' turns alternating; returns the medians
    and every value."""
    rows: dict[str, dict[str, list[float]]] = {t.name: {} for t in targets}

    def add(name: str, values: dict[str, float]) -> None:
        for k, v in values.items():
            rows[name].setdefault(k, []).append(v)

    for r in range(rounds):
        for t in targets if r % 2 == 0 else targets[::-1]:
            add(t.name, cold_turn(t))
            add(t.name, {"resent_turn2_ttft_ms": resent_chat(t)})
            if t.name == "ours":
                add(t.name, {"session_turn2_ttft_ms": resent_chat(t, session_url)})
            add(t.name, {"one_stream_tokens_per_s": one_stream(t, new_tokens)})
            add(t.name, concurrent(t, n, new_tokens))
            add(t.name, pause(t, new_tokens))
            print(f"  round {r + 1}: {t.name} done", file=sys.stderr, flush=True)
    return {name: {k: statistics.median(v) for k, v in cols.items()} for name, cols in rows.items()}, rows


def report(med: dict[str, dict[str, float]], n: int) -> None:
    """Print each measure's medians, ours and the peer's, and their ratio."""
    ours, peer = med["ours"], med["peer"]
    lines = [
        ("cold image turn, first event (role chunk) ms", "first_event_ms", "lower"),
        ("cold image turn, streamed TTFT ms", "cold_ttft_ms", "lower"),
        ("cold image turn, max_tokens=1 wall ms", "cold_max_tokens_1_ms", "lower"),
        ("3-turn chat resent without a session, turn 2 TTFT ms", "resent_turn2_ttft_ms", "lower"),
        ("1 stream, end-to-end tokens/s", "one_stream_tokens_per_s", "higher"),
        (f"{n} concurrent image streams, total tokens/s", "concurrent_tokens_per_s", "higher"),
        (f"{n} concurrent image streams, median TTFT ms", "concurrent_median_ttft_ms", "lower"),
        ("running stream's longest pause, new image arriving ms", "pause_new_image_ms", "lower"),
        ("running stream's longest pause, quiet ms", "pause_quiet_ms", "lower"),
    ]
    print(f"{'measure':<58} {'ours':>9} {'peer':>9} {'ours/peer':>10}")
    for label, key, _ in lines:
        ratio = ours[key] / peer[key] if peer.get(key) else float("nan")
        print(f"{label:<58} {ours[key]:9.1f} {peer[key]:9.1f} {ratio:9.2f}x")
    sess = ours["session_turn2_ttft_ms"]
    print(
        f"{'same chat inside one of our sessions, turn 2 TTFT ms':<58} {sess:9.1f} {'':>9} {sess / peer['resent_turn2_ttft_ms']:9.2f}x"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bench", help="tiny_model preset to build (default bench)")
    parser.add_argument("--model-dir", default=None, help="an existing checkpoint folder instead")
    parser.add_argument("--peer-venv", default=".venv-peer", help="the venv with transformers[serving]")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--concurrent", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2, help="torch threads of each server")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a handler setting for ours")
    parser.add_argument("--json", default=None, help="also write the medians here")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model_dir
        if model_dir is None:
            from llava_tools.tiny_model import write_checkpoint

            model_dir = str(write_checkpoint(args.model, Path(tmp) / args.model, seed=0))
        model_dir = str(Path(model_dir).resolve())
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        overrides: dict[str, Any] = {"torch_threads": args.threads}
        for item in args.set:
            key, _, value = item.partition("=")
            overrides[key] = json.loads(value) if value[:1].isdigit() or value in ("true", "false") else value
        peer, peer_url = start_peer(Path(args.peer_venv), model_dir, args.threads)
        ours = None
        try:
            ours, url = start_ours(model_dir, args.set, args.threads)
            models = requests.get(url + "/v1/models", timeout=30).json()
            served = models["data"][0]["id"]  # the checkpoint folder's name, which requests must name
            targets = [
                Target("ours", url + "/v1/chat/completions", served, tokenizer),
                Target("peer", peer_url + "/v1/chat/completions", model_dir, tokenizer),
            ]
            for t in targets:  # warm both alike (first passes allocate, JIT, load the processor)
                t.stream([user(QUESTIONS[0], fresh_photo())], 4)
                concurrent(t, args.concurrent, 8)  # a fresh server's first bursts ran 6-12% slower
            print(f"ours: llava-serve {overrides}; peer: transformers serve {model_dir}", flush=True)
            med, raw = measure(targets, url + "/invocations", args.rounds, args.new_tokens, args.concurrent)
        finally:
            if ours is not None:
                stop_process_group(ours, STOP_GRACE_S)
            stop_process_group(peer, STOP_GRACE_S)
    report(med, args.concurrent)
    if args.json:
        Path(args.json).write_text(json.dumps({"medians": med, "values": raw, "settings": overrides}, indent=2))


if __name__ == "__main__":
    main()
