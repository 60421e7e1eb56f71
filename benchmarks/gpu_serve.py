"""The TorchServe table on the GPU (issue 59 item 5; ``make bench-gpu-serve``, the last part of ``make gpu-check``).

What users deploy, measured over HTTP: ``llava-serve``'s :class:`~llava_tools.serve.LocalServer` (the real
TorchServe, our handler, loopback) on a checkpoint written to the machine's local disk (``--model 7b``:
the 7b-shaped random llava-1.5, written on the GPU in fp16 and served in ``--dtype``), driven by
``llava_client``. Side by side in one run:

1. **TorchServe's floor**: :mod:`floor_handler` (it answers at once, runs no model) under the same
   TorchServe config, the 1-token request's shape: the median client round trip, ms. What any handler's
   request costs here.
2. **Follow-up TTFT**: a stored session of about ``--context`` tokens asks ``FOLLOW_UP`` (not remembered)
   for one token, client time (the reply comes with its first token), median of ``--repeats``; beside
   it the server's own ``total_ms`` of the same answers.
3. **Batch-1 decode**: one stream of ``--new-tokens`` tokens on that session; ms per token = the time
   from its first token's line (a stream's first token goes out at once) to its last, over the tokens
   after the first.
4. **Streams**: ``N`` (``--streams``) sessions stream an answer at once; the aggregate decode rate is
   their tokens after each one's first over the span from the earliest first token's line to the latest
   last one (the other streams' prefills fall inside it, so it errs low beside the in-process aggregate,
   which prefills before its clock); beside it tokens / wall time, prefills included. One short round at
   each count goes first, untimed, as the in-process aggregate's warm-up does.
5. **A cold image turn**: open a session on a never-seen image and ask for one token, client time.

With ``--compile-cache`` (the default on a GPU) ``llava-compile-cache`` runs first, in a process of its
own with an empty Inductor cache: the cold start (weights, compile, capture; its graphs compiled), and the
model folder's compile cache written. The server then starts with another empty Inductor cache, so its
``server_start_s`` is a warm start from the shipped file alone, beside the floor server's start (Java and
TorchServe without a model); ``worker_start`` splits the worker's part as its ready line says: the
weights' load and the engine's build (the layers compiled, the graphs captured).

``--in-process gpu.json`` (the in-process table, ``benchmarks/gpu.py``, of the same device call) adds the
ratios of the issue's goals: follow-up TTFT against in-process + the floor + 1 ms, and 32 streams against
the in-process aggregate at 32. Each section is written to ``--json`` as it ends (:class:`gpu.Sections`).

On a CPU the same code runs as a smoke test: ``python benchmarks/gpu_serve.py --device cpu --model tiny``.
On the device machine TorchServe needs Java: ``make gpu-wheels`` packs a runtime and TorchServe's frontend
(``benchmarks/gpu_bundle.py``) and ``benchmarks/gpu_check.sh`` unpacks them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import requests

from concurrency import FLOOR_HANDLER, at_once
from gpu import FOLLOW_UP, PHOTOS, QUESTION, Sections, _fresh, stop_on_sigterm
from llava_client import SessionClient
from llava_tools.demo.samples import sample_photo
from llava_tools.serve import LocalServer

#: The request whose round trip is the floor: the shape of our 1-token answer's request.
FLOOR_REQUEST = {"type": "generate", "prompt": "Hi?", "remember": False, "parameters": {"max_new_tokens": 1}}


def write_model(model: str, folder: Path) -> dict[str, Any]:
    """Write the random checkpoint ``model`` (``tiny``, ``bench``, ``7b``: built on the GPU) to ``folder``;
    returns its size (bytes) and the seconds it took."""
    from llava_tools.tiny_model import write_checkpoint

    t0 = time.perf_counter()
    write_checkpoint(model, folder)
    size = sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
    return {"bytes": size, "write_s": round(time.perf_counter() - t0, 1)}


def fresh_caches(folder: Path) -> dict[str, str]:
    """The environment of a process whose Inductor and Triton caches start empty in ``folder`` (the
    in-process table of the same call compiled the same kernels into the default ones)."""
    return {"TORCHINDUCTOR_CACHE_DIR": str(folder), "TRITON_CACHE_DIR": str(folder / "triton")}


def compile_cache(model_dir: Path, overrides: dict[str, Any], inductor_dir: Path) -> dict[str, Any]:
    """Run ``llava-compile-cache`` on ``model_dir`` with the server's settings and an empty Inductor cache
    (``inductor_dir``); returns what it printed (the file, its bytes, graphs compiled, the worker's build
    seconds) and its wall seconds."""
    settings = [arg for key, value in overrides.items() for arg in ("--set", f"{key}={value}")]
    command = [sys.executable, "-m", "llava_tools.compile_cache", "--model-dir", str(model_dir), "--json", *settings]
    t0 = time.perf_counter()
    done = subprocess.run(command, env={**os.environ, **fresh_caches(inductor_dir)},
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    if done.returncode:
        raise RuntimeError(f"llava-compile-cache exited {done.returncode}: {done.stderr[-2000:]}")
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "wall_s": round(time.perf_counter() - t0, 1)}


def worker_start(server: LocalServer) -> dict[str, float]:
    """The worker's start as its ready line in TorchServe's ``model_log.log`` says: the weights' load and
    the engine's build, seconds ({} when the line is not there)."""
    log = (server.log_dir / "model_log.log").read_text(errors="replace")
    found = re.search(r"llava-sessions ready: weights loaded in ([\d.]+) s, engine built in ([\d.]+) s", log)
    return {"weights_s": float(found[1]), "engine_s": float(found[2])} if found else {}


def floor_round_trip(model_dir: Path, n: int, warmup: int) -> dict[str, Any]:
    """Median and p90 client round trip (ms) of :data:`FLOOR_REQUEST` against the floor handler."""
    t0 = time.perf_counter()
    with LocalServer(model_dir, handler=FLOOR_HANDLER, startup_timeout_s=300) as server:
        start_s = time.perf_counter() - t0
        headers = {"Content-Type": "application/json", "X-Amzn-SageMaker-Session-Id": "floor-1"}
        body = json.dumps(FLOOR_REQUEST)
        times = []
        with requests.Session() as http:
            for i in range(warmup + n):
                s0 = time.perf_counter()
                http.post(server.url + "/invocations", data=body, headers=headers, timeout=60).raise_for_status()
                if i >= warmup:
                    times.append((time.perf_counter() - s0) * 1000)
    return {
        "round_trip_ms": round(statistics.median(times), 3),
        "p90_ms": round(statistics.quantiles(times, n=10)[-1], 3),
        "n": n,
        "server_start_s": round(start_s, 1),
    }


def hold(client: SessionClient, image: bytes, context: int) -> tuple[Any, int]:
    """Open a session on ``image`` and remember turns until it holds about ``context`` tokens (as the
    in-process table's ``open_with_context``); returns the session and the tokens it holds."""
    session = client.open_session(image)
    held = session.ask("Hi?", remember=False, max_new_tokens=1).usage.prompt_tokens
    turn = 0
    while held + 40 < context and turn < 64:
        answer = session.ask(f"Question {turn}: what else do you see?", max_new_tokens=24, temperature=0)
        held = answer.usage.prompt_tokens + answer.usage.generated_tokens
        turn += 1
    return session, held


def follow_up(session: Any, repeats: int) -> dict[str, Any]:
    """Client time of a 1-token answer to :data:`FOLLOW_UP` (not remembered), and the server's own
    ``total_ms`` of the same answers: medians of ``repeats`` after one warm-up."""
    answers = [session.ask(FOLLOW_UP, remember=False, max_new_tokens=1, temperature=0) for _ in range(repeats + 1)]
    answers = answers[1:]
    return {
        "new_tokens": answers[0].usage.prompt_tokens - answers[0].usage.cached_tokens,
        "ttft_ms": round(statistics.median(a.client_total_ms for a in answers), 3),
        "server_total_ms": round(statistics.median(a.timings.get("total_ms", 0.0) for a in answers), 3),
    }


def timed_stream(session: Any, new_tokens: int) -> dict[str, float]:
    """One greedy stream of up to ``new_tokens`` tokens (not remembered): its tokens, the first token's
    arrival from the call (ms; the client's ``client_ttft_ms``: its line, whether or not its text is
    empty), the server's own time to that token (``ttft_ms``: from the engine's admission), the span from
    the first token's line to the last's (ms), and both arrivals' ``perf_counter`` (s).

    Lines, not text pieces: a random model's tokens can decode to no text, and a stream yields only
    non-empty pieces (runs 8-9 on the GPU timed pieces, and read one piece for a whole answer)."""
    t0 = time.perf_counter()
    with session.stream(QUESTION, remember=False, max_new_tokens=new_tokens, temperature=0) as stream:
        answer = stream.until_done()
    first, last = (answer.client_ttft_ms or 0.0), (answer.client_total_ms or 0.0)
    return {
        "tokens": answer.usage.generated_tokens,
        "first_ms": first,
        "server_first_ms": float(answer.timings.get("ttft_ms", 0.0)),
        "span_ms": max(last - first, 0.0),
        "first_at": t0 + first / 1000,
        "last_at": t0 + last / 1000,
    }


def batch_one(session: Any, new_tokens: int, repeats: int) -> dict[str, Any]:
    """ms per token of one stream after its first token: median of ``repeats`` streams."""
    timed_stream(session, 4)  # warm
    runs = [timed_stream(session, new_tokens) for _ in range(repeats)]
    rates = [r["span_ms"] / (r["tokens"] - 1) for r in runs if r["tokens"] > 1 and r["span_ms"] > 0]
    return {
        "ms_per_token": round(statistics.median(rates), 3) if rates else None,
        "tokens": [int(r["tokens"]) for r in runs],
    }


def together(sessions: list[Any], new_tokens: int) -> tuple[list[dict[str, float]], float]:
    """Every one of ``sessions`` streams an answer at the same moment (:func:`timed_stream`); returns
    their results and the wall seconds until the last ended."""
    return at_once(len(sessions), lambda k: timed_stream(sessions[k], new_tokens))


def streams(client: SessionClient, images: list[bytes], counts: list[int], new_tokens: int) -> dict[str, Any]:
    """At each count ``N``, ``N`` sessions stream an answer at once: their tokens after each one's first
    over the span from the earliest first token to the latest last one (tokens/s), and tokens / wall
    seconds, prefills included."""
    sessions = [client.open_session(images[i % len(images)]) for i in range(max(counts))]
    for s in sessions:
        s.ask("Hi?", remember=False, max_new_tokens=2)
    rows = {}
    for n in counts:
        together(sessions[:n], 4)  # warm: the step's shapes at this count compiled and captured before the clock
        results, wall = together(sessions[:n], new_tokens)
        span = max(r["last_at"] for r in results) - min(r["first_at"] for r in results)
        decode = sum(r["tokens"] - 1 for r in results) / span if span > 0 else 0.0
        rows[str(n)] = {
            "decode_tokens_per_s": round(decode, 1),
            "tokens_per_s_with_prefill": round(sum(r["tokens"] for r in results) / wall, 1),
            "first_token_ms_p50": round(statistics.median(r["first_ms"] for r in results), 3),
            "server_first_token_ms_p50": round(statistics.median(r["server_first_ms"] for r in results), 3),
            "first_token_ms_max": round(max(r["first_ms"] for r in results), 3),
        }
    for s in sessions:
        s.close()
    return rows


def cold_turns(client: SessionClient, images: list[bytes], repeats: int) -> dict[str, Any]:
    """Client time of an open on a never-seen image plus its first question's one token: median of
    ``repeats`` after one warm-up."""
    times = []
    for i in range(repeats + 1):
        image = _fresh(images[i % len(images)], 1000 + i)
        t0 = time.perf_counter()
        session = client.open_session(image)
        session.ask(QUESTION, remember=False, max_new_tokens=1)
        times.append((time.perf_counter() - t0) * 1000)
        session.close()
    return {"cold_image_turn_ms": round(statistics.median(times[1:]), 3)}


def against_in_process(report: dict[str, Any], path: str) -> dict[str, Any]:
    """The issue's goals, from this run and the in-process table at ``path`` (benchmarks/gpu.py's JSON):
    follow-up TTFT against in-process + the floor + 1 ms; the streams' aggregate against in-process at
    the same count; batch-1 ms per token and the cold turn against in-process."""
    inside = json.loads(Path(path).read_text())
    out: dict[str, Any] = {}
    floor = report.get("floor", {}).get("round_trip_ms")
    turns, ours = inside.get("turns", {}), report.get("follow_up", {})
    if turns and ours and floor is not None:
        budget = turns["follow_up"]["ttft_ms"] + floor + 1.0
        out["follow_up_ttft"] = {"http_ms": ours["ttft_ms"], "budget_ms": round(budget, 3),
                                 "met": ours["ttft_ms"] <= budget}  # fmt: skip
    for n, row in report.get("streams", {}).items():
        if n in inside.get("aggregate", {}):
            ratio = row["decode_tokens_per_s"] / inside["aggregate"][n]["tokens_per_s"]
            out[f"streams_{n}_vs_in_process"] = {"ratio": round(ratio, 3), "met": ratio >= 0.9}
    if "batch_one" in inside and report.get("batch_one", {}).get("ms_per_token"):
        out["batch_one_vs_in_process"] = round(
            report["batch_one"]["ms_per_token"] / inside["batch_one"]["ms_per_token"], 3
        )
    if "cold" in report and "cold_image_turn_ms" in turns:
        out["cold_turn_vs_in_process"] = round(report["cold"]["cold_image_turn_ms"] / turns["cold_image_turn_ms"], 3)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="7b", choices=["tiny", "bench", "7b"])
    ap.add_argument("--model-dir", default=None, help="a checkpoint folder instead of writing a random one")
    ap.add_argument("--work-dir", default=None, help="where the checkpoint is written (default: a new temp folder)")
    ap.add_argument("--device", default="cuda", help="cuda (the handler's devices: auto) or cpu")
    ap.add_argument("--dtype", default="bfloat16", help="the handler's dtype setting")
    ap.add_argument("--context", type=int, default=600, help="the stored session's context, tokens")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--streams", default="8,32", help="concurrent streams, comma-separated")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--compile-cache", action=argparse.BooleanOptionalAction, default=None,
                    help="write the compile cache cold first, then start the server warm from it (default: on a GPU)")  # fmt: skip
    ap.add_argument("--floor-requests", type=int, default=200)
    ap.add_argument("--in-process", default=None, help="benchmarks/gpu.py's JSON of the same call: the goals' ratios")
    ap.add_argument("--json", default=None, help="the table as JSON, rewritten after every section")
    ap.add_argument("--deadline-s", type=float, default=None, help="skip the sections due after this many seconds")
    args = ap.parse_args(argv)
    stop_on_sigterm()  # timeout's SIGTERM: the servers' process groups stopped on the way out
    t_start = time.perf_counter()
    report = Sections(args.json, args.deadline_s, t_start)
    report.data.update({"model": args.model_dir or args.model, "device": args.device, "dtype": args.dtype})
    model_dir = Path(args.model_dir or Path(args.work_dir or tempfile.mkdtemp(prefix="llava-serve-")) / "model")
    if not args.model_dir:
        report.run("checkpoint", lambda: write_model(args.model, model_dir))
    report.run("floor", lambda: floor_round_trip(model_dir, args.floor_requests, warmup=50))
    counts = [int(x) for x in args.streams.split(",") if x]
    overrides = {"dtype": args.dtype, "max_sessions": max(counts, default=1) + 8,
                 "max_concurrent_generations": max(counts, default=1)}  # fmt: skip
    if args.device == "cpu":
        overrides["devices"] = "cpu"
    env: dict[str, str] = {}
    if args.compile_cache if args.compile_cache is not None else args.device != "cpu":
        overrides["compile"] = "on"
        work = Path(tempfile.mkdtemp(prefix="inductor-"))
        report.run("compile_cache", lambda: compile_cache(model_dir, overrides, work / "cold"))
        env.update(fresh_caches(work / "warm"))  # the server finds only the shipped file
    images = [sample_photo(p) for p in PHOTOS]
    t0 = time.perf_counter()
    with LocalServer(model_dir, overrides=overrides, env=env, startup_timeout_s=900) as server:
        report.data["server_start_s"] = round(time.perf_counter() - t0, 1)
        report.data["worker_start"] = worker_start(server)
        client = SessionClient.from_url(server.url, max_retries=0, timeout=300)
        session, held = hold(client, images[0], args.context)
        report.data["context_tokens"] = held
        report.run("follow_up", lambda: follow_up(session, args.repeats))
        report.run("batch_one", lambda: batch_one(session, args.new_tokens, args.repeats))
        session.close()
        report.run("streams", lambda: streams(client, images, counts, args.new_tokens))
        report.run("cold", lambda: cold_turns(client, images, args.repeats))
        client.close()
    if args.in_process and Path(args.in_process).exists():
        report.run("goals", lambda: against_in_process(report.data, args.in_process))
    report.data["seconds"] = round(time.perf_counter() - t_start, 1)
    report.save()
    print(json.dumps(report.data, indent=1))
    return 1 if report.data.get("errors") else 0


if __name__ == "__main__":
    sys.exit(main())
