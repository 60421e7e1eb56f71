"""Concurrency benchmark over HTTP: batched decode across sessions, and streams while sessions open.

Three measurements, each side by side in one run against a local ``llava-serve`` (loopback, real
TorchServe, ``llava_client``):

1. **Aggregate decode rate.** ``N`` open sessions (N = 1, 2, 4, 8, 16) each ask one question for
   ``--new-tokens`` greedy tokens at the same moment; aggregate tokens/s = tokens generated / wall
   time, and its ratio to one session alone. The levels run in rounds (1, 2, 4, ..., 1, 2, 4, ...)
   so drift hits every level alike; the median round is reported.
2. **Inter-token latency while sessions open.** ``--streams`` sessions stream an answer; the gaps
   between consecutive token arrivals at the client are collected (a) with nothing else happening
   and (b) while another client opens (and closes) sessions on a photograph back to back. The
   server runs with ``step_max_tokens=1`` for this part, so each token is its own chunk and a gap is
   a real inter-token latency. Reported: p50 / p99 of each and the ratio p99(b) / p99(a).
3. **Per-request serving overhead** (tiny model): client-observed total minus the server's own
   ``total_ms`` of a 1-token answer, cold and warm, with the shipped log configuration and with
   TorchServe's own side by side; the ``/ping`` round trip; where the time goes (TorchServe's
   frontend counters, and our handler's per-call work measured in process).
4. **TorchServe's floor** (tiny model): the same 1-token answer against a handler that runs no
   model under the same TorchServe config (:func:`floor_comparison`), both warm, side by side.

Prints a JSON report (``--json`` writes it too). Bounded: loopback only, at most 16 sessions.

Usage: python benchmarks/concurrency.py --model bench [--rounds 3] [--new-tokens 48] [--json out.json]
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import re
import signal
import statistics
import sys
import tempfile
import threading
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llava_client import SessionClient
from llava_tools.cli import add_setting_arguments
from llava_tools.demo.samples import sample_photo
from llava_tools.serve import LocalServer

LEVELS = (1, 2, 4, 8, 16)
PHOTOS = ("astronaut", "chelsea", "coffee", "rocket")


def pct(values: list[float], q: int) -> float | None:
    """The ``q``-th percentile (1..99, interpolated), ms rounded to 0.01; None without values."""
    if len(values) < 2:
        return round(values[0], 2) if values else None
    return round(statistics.quantiles(values, n=100)[q - 1], 2)


def at_once(count: int, work: Callable[[int], Any]) -> tuple[list[Any], float]:
    """``work(k)`` for each ``k`` below ``count``, each in a thread of its own, all released at the same
    moment; returns their results in order and the wall seconds from that moment until the last ended.

    Raises:
        Exception: the first one a ``work`` call raised, once every thread has ended.
    """
    results: list[Any] = [None] * count
    errors: list[BaseException] = []
    barrier = threading.Barrier(count + 1)

    def one(k: int) -> None:
        barrier.wait()
        try:
            results[k] = work(k)
        except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(k,)) for k in range(count)]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return results, wall


def burst(sessions: list, question: str, new_tokens: int) -> tuple[float, list[str]]:
    """Every session asks ``question`` at the same moment (greedy, not remembered); returns the
    aggregate decode rate (generated tokens / wall seconds) and the answers' texts."""
    ask = {"remember": False, "max_new_tokens": new_tokens, "temperature": 0}
    answers, wall = at_once(len(sessions), lambda k: sessions[k].ask(question, **ask))
    return sum(a.usage.generated_tokens for a in answers) / wall, [a.text for a in answers]


def aggregate(url: str, images: list[bytes], rounds: int, new_tokens: int) -> dict:
    """Aggregate decode tokens/s at each concurrency level, median over rounds."""
    client = SessionClient.from_url(url, max_retries=2)
    sessions = [client.open_session(images[i % len(images)]) for i in range(max(LEVELS))]
    question = "Describe this image in great detail, please."
    for s in sessions:  # warm-up: every session's first follow-up, and the batch path
        s.ask(question, remember=False, max_new_tokens=2)
    rates: dict[int, list[float]] = {n: [] for n in LEVELS}
    for _ in range(rounds):
        for n in LEVELS:
            rate, _ = burst(sessions[:n], question, new_tokens)
            rates[n].append(rate)
    for s in sessions:
        s.close()
    client.close()
    base = statistics.median(rates[1])
    return {
        str(n): {
            "tokens_per_s": round(statistics.median(r), 1),
            "vs_one_session": round(statistics.median(r) / base, 2),
            "rounds": [round(x, 1) for x in r],
        }
        for n, r in rates.items()
    }


def stream_gaps(sessions: list, question: str, new_tokens: int) -> list[float]:
    """Every session streams an answer to ``question`` at once (greedy, not remembered); returns the
    gaps between consecutive token arrivals at this client, ms, all streams together."""
    gaps: list[float] = []
    lock = threading.Lock()

    def one(s) -> None:
        last = None
        mine = []
        with s.stream(question, remember=False, max_new_tokens=new_tokens, temperature=0) as stream:
            for _piece in stream:
                now = time.perf_counter()
                if last is not None:
                    mine.append((now - last) * 1000.0)
                last = now
        with lock:
            gaps.extend(mine)

    threads = [threading.Thread(target=one, args=(s,)) for s in sessions]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return gaps


def inter_token(url: str, images: list[bytes], streams: int, new_tokens: int, rounds: int) -> dict:
    """Client-side token arrival gaps (ms) of running streams, quiet vs while sessions open."""
    client = SessionClient.from_url(url, max_retries=2)
    sessions = [client.open_session(images[i % len(images)]) for i in range(streams)]
    question = "Describe this image in great detail, please."
    for s in sessions:
        s.ask(question, remember=False, max_new_tokens=2)

    def run_streams() -> list[float]:
        return stream_gaps(sessions, question, new_tokens)

    quiet: list[float] = []
    busy: list[float] = []
    opens = [0]
    for _ in range(rounds):
        quiet += run_streams()
        stop = threading.Event()

        def opener(stop: threading.Event = stop) -> None:
            other = SessionClient.from_url(url, max_retries=2)
            i = 0
            while not stop.is_set():
                s = other.open_session(images[i % len(images)])
                opens[0] += 1
                s.close()
                i += 1
            other.close()

        t = threading.Thread(target=opener)
        t.start()
        busy += run_streams()
        stop.set()
        t.join()
    for s in sessions:
        s.close()
    client.close()
    q99, b99 = pct(quiet, 99), pct(busy, 99)
    return {
        "streams": streams,
        "quiet_ms": {"p50": pct(quiet, 50), "p99": pct(quiet, 99), "n": len(quiet)},
        "while_opening_ms": {"p50": pct(busy, 50), "p99": pct(busy, 99), "n": len(busy)},
        "sessions_opened_meanwhile": opens[0],
        "p99_ratio": round(b99 / q99, 2) if q99 and b99 else None,
    }


@contextlib.contextmanager
def others_paused(servers: dict[str, LocalServer], measured: str):
    """Pause every server but ``measured`` (its whole process group: frontend, worker, replicas)."""
    groups = [os.getpgid(s.frontend_pid()) for k, s in servers.items() if k != measured]  # type: ignore[arg-type]
    for group in groups:
        os.killpg(group, signal.SIGSTOP)
    try:
        yield
    finally:
        for group in groups:
            os.killpg(group, signal.SIGCONT)


def torchserve_default_log_config(folder: str) -> Path:
    """TorchServe's own log4j2.xml (the one inside its frontend jar), written into ``folder``."""
    import ts

    jar = Path(ts.__file__).parent / "frontend" / "model-server.jar"
    with zipfile.ZipFile(jar) as archive:
        data = archive.read("log4j2.xml")
    path = Path(folder) / "torchserve-default-log4j2.xml"
    path.write_bytes(data)
    return path


def _frontend_counters(metrics_url: str) -> dict[str, float]:
    """TorchServe's frontend counters (Prometheus): requests, and summed latency / queue time in us."""
    import requests

    text = requests.get(metrics_url + "/metrics", timeout=10).text
    out = {}
    for name in ("ts_inference_requests_total", "ts_inference_latency_microseconds", "ts_queue_latency_microseconds"):
        found = re.search(rf"^{name}{{[^}}]*}} (\S+)$", text, re.M)  # Java's doubles: 1.2E7
        out[name] = float(found.group(1)) if found else 0.0
    return out


def handler_per_call(model_dir: str, image: bytes, n: int) -> dict:
    """Our per-call work outside ``total_ms``, in process (no TorchServe): ``SessionService.handle()``
    wall time minus ``total_ms`` of the same 1-token follow-up (parsing, chat template, tokenizing,
    encoding the reply, queueing the metrics), medians of ``n`` in ms."""
    from llava_sessions.service import BatchRequest
    from llava_sessions.worker import build_local_service

    service = build_local_service({"model_dir": model_dir, "max_sessions": 8})
    body = {"type": "open_session", "image": {"base64": base64.b64encode(image).decode()}}
    out = service.handle([BatchRequest("open", "bench-1", False, json.dumps(body).encode())])
    while out[0].stop is False:
        out = service.handle([BatchRequest("open", "bench-1", False, None)])
    ask = json.dumps({"type": "generate", "prompt": "Hi?", "remember": False, "parameters": {"max_new_tokens": 1}})
    walls, totals = [], []
    for i in range(n + 20):
        t0 = time.perf_counter()
        out = service.handle([BatchRequest(f"q{i}", "bench-1", False, ask.encode())])
        service.emit_metrics()
        wall = (time.perf_counter() - t0) * 1000.0
        if i >= 20:
            walls.append(wall)
            totals.append(json.loads(out[0].body)["details"]["timings"]["total_ms"])
    return {
        "handle_ms": round(statistics.median(walls), 3),
        "server_total_ms": round(statistics.median(totals), 3),
        "outside_total_ms": round(statistics.median([w - t for w, t in zip(walls, totals, strict=True)]), 3),
    }


def serving_overhead(model_dir: str, image: bytes, n: int, warmup: int) -> dict:
    """Client-observed total minus the server's own ``total_ms`` for 1-token answers (ms).

    Two servers run side by side, requests alternating between them in blocks of 20: ``ours`` (the
    shipped configuration, quiet log4j2.xml) and ``torchserve_default_logging`` (the same with
    TorchServe's own log configuration). Reported: the median over the first ``n`` answers of a
    fresh server (``cold``: the JVM has not compiled the request path yet) and over ``n`` answers
    after ``warmup`` more (``warm``), the ``/ping`` round trip, and where the warm time goes (means,
    so the parts add up): the client and HTTP outside the frontend, the frontend's queue (job group
    dispatch and the batch aggregator's ``maxBatchDelay``), the worker round trip (socket, TorchServe's
    Python, our handler outside ``total_ms``) and, in process, our handler's share of it.
    """
    import requests

    folder = tempfile.mkdtemp(prefix="llava-overhead-")
    variants = {"ours": None, "torchserve_default_logging": torchserve_default_log_config(folder)}
    servers = {
        name: LocalServer(model_dir, overrides={"max_sessions": 8}, log_config=log_config, startup_timeout_s=600)
        for name, log_config in variants.items()
    }
    try:
        for server in servers.values():
            server.start()
        sessions = {
            name: SessionClient.from_url(s.url, max_retries=0).open_session(image) for name, s in servers.items()
        }

        def answers(count: int) -> dict[str, list[tuple[float, float]]]:
            got: dict[str, list[tuple[float, float]]] = {name: [] for name in servers}
            for _ in range(0, count, 20):
                for name, session in sessions.items():
                    for _ in range(min(20, count - len(got[name]))):
                        a = session.ask("Hi?", remember=False, max_new_tokens=1)
                        got[name].append((a.client_total_ms, a.timings["total_ms"]))
            return got

        def over(pairs: list[tuple[float, float]]) -> float:
            return round(statistics.median(c - t for c, t in pairs), 2)

        cold = answers(n)
        answers(warmup)
        before = _frontend_counters(servers["ours"].metrics_url)
        warm = answers(n)
        after = _frontend_counters(servers["ours"].metrics_url)
        http = requests.Session()
        ping = []
        for _ in range(n):
            t0 = time.perf_counter()
            http.get(servers["ours"].url + "/ping", timeout=10)
            ping.append((time.perf_counter() - t0) * 1000.0)
    finally:
        for server in servers.values():
            server.stop()
    count = max(1.0, after["ts_inference_requests_total"] - before["ts_inference_requests_total"])
    frontend = (after["ts_inference_latency_microseconds"] - before["ts_inference_latency_microseconds"]) / count / 1e3
    queue = (after["ts_queue_latency_microseconds"] - before["ts_queue_latency_microseconds"]) / count / 1e3
    client_mean = statistics.fmean(c for c, _ in warm["ours"])
    server_mean = statistics.fmean(t for _, t in warm["ours"])
    return {
        "client_minus_server_total_ms": {
            name: {"cold": over(cold[name]), "warm": over(warm[name])} for name in servers
        },
        "server_total_ms": round(statistics.median(t for _, t in warm["ours"]), 2),
        "ping_round_trip_ms": round(statistics.median(ping), 2),
        "warm_breakdown_mean_ms": {
            "client_and_http": round(client_mean - frontend, 2),
            "frontend_queue": round(queue, 2),
            "worker_round_trip": round(frontend - queue - server_mean, 2),
            "server_total_ms": round(server_mean, 2),
        },
        "n": n,
        "warmup": warmup,
    }


#: The floor's handler (benchmarks/floor_handler.py): answers at once, runs no model.
FLOOR_HANDLER = Path(__file__).with_name("floor_handler.py")


def floor_comparison(
    model_dir: str,
    image: bytes,
    *,
    warmup: int,
    n: int,
    block: int = 20,
    variants: dict[str, dict[str, str]] | None = None,
) -> dict:
    """Our 1-token answer against TorchServe's floor, both warm, side by side (ms, client-side).

    Servers with the same TorchServe config (model-config.yaml, our log4j2.xml): ``ours`` (and any
    other ``variants`` of ours: name -> extra environment); ``floor``, :data:`FLOOR_HANDLER` answering
    ``{"ok": true}``; ``floor_same_reply``, the same handler answering our 1-token answer's own bytes
    and headers (so the reply's size and encoding are apart from our work). The same client (one
    ``requests.Session`` each, the session header on every request) sends ``warmup`` requests to each,
    then ``n`` measured ones, in blocks of ``block`` taken in turns, every other server paused during a
    block (:func:`others_paused`). Reported: medians of the client time; ours also beyond its own
    ``total_ms``; ``above_floor_ms`` = ours beyond its ``total_ms`` minus the floor, split into
    ``reply_size_and_headers_ms`` and ``our_work_ms``.
    """
    import requests

    variants = variants or {"ours": {}}
    folder = Path(tempfile.mkdtemp(prefix="llava-floor-"))
    servers: dict[str, LocalServer] = {}
    ids: dict[str, str] = {}
    ask = json.dumps({"type": "generate", "prompt": "Hi?", "remember": False, "parameters": {"max_new_tokens": 1}})
    try:
        for name, env in variants.items():
            servers[name] = LocalServer(model_dir, overrides={"max_sessions": 8}, env=env, startup_timeout_s=600)
            servers[name].start()
            ids[name] = SessionClient.from_url(servers[name].url, max_retries=0).open_session(image).id
        first = next(iter(variants))
        reply = requests.post(
            servers[first].url + "/invocations",
            data=ask,
            headers={"Content-Type": "application/json", "X-Amzn-SageMaker-Session-Id": ids[first]},
            timeout=60,
        )
        (folder / "reply.json").write_bytes(reply.content)
        floors = {
            "floor": {},
            "floor_same_reply": {"LLAVA_FLOOR_BODY_FILE": str(folder / "reply.json")},
            "floor_same_forward": {"LLAVA_FLOOR_MODEL_DIR": model_dir},
        }
        for name, env in floors.items():
            servers[name] = LocalServer(
                model_dir, overrides={"max_sessions": 8}, handler=FLOOR_HANDLER, env=env, startup_timeout_s=600
            )
            servers[name].start()
            ids[name] = f"floor-{name.replace('_', '-')}"
        clients = {name: requests.Session() for name in servers}

        def one(name: str) -> tuple[float, float]:
            headers = {"Content-Type": "application/json", "X-Amzn-SageMaker-Session-Id": ids[name]}
            t0 = time.perf_counter()
            r = clients[name].post(servers[name].url + "/invocations", data=ask, headers=headers, timeout=60)
            client_ms = (time.perf_counter() - t0) * 1000.0
            r.raise_for_status()
            timed = name in variants or name == "floor_same_forward"
            total = json.loads(r.content)["details"]["timings"]["total_ms"] if timed else 0.0
            return client_ms, total

        def run(count: int) -> dict[str, list[tuple[float, float]]]:
            got: dict[str, list[tuple[float, float]]] = {name: [] for name in servers}
            while len(got["floor"]) < count:
                for name in servers:
                    with others_paused(servers, name):
                        got[name] += [one(name) for _ in range(min(block, count - len(got[name])))]
            return got

        run(warmup)
        got = run(n)
    finally:
        for server in servers.values():
            server.stop()

    def med(values) -> float:
        return round(statistics.median(values), 3)

    floor, same = med(c for c, _ in got["floor"]), med(c for c, _ in got["floor_same_reply"])
    forward_beyond = med(c - t for c, t in got["floor_same_forward"])
    report: dict = {
        "floor_client_ms": floor,
        "floor_same_reply_client_ms": same,
        "reply_size_and_headers_ms": round(same - floor, 3),
        "floor_same_forward": {
            "client_ms": med(c for c, _ in got["floor_same_forward"]),
            "total_ms": med(t for _, t in got["floor_same_forward"]),
            "beyond_total_ms": forward_beyond,
            "above_floor_ms": round(forward_beyond - floor, 3),
        },
        "reply_bytes": len((folder / "reply.json").read_bytes()),
        "warmup": warmup,
        "n": n,
    }
    for name in variants:
        beyond = med(c - t for c, t in got[name])
        report[name] = {
            "client_ms": med(c for c, _ in got[name]),
            "total_ms": med(t for _, t in got[name]),
            "beyond_total_ms": beyond,
            "above_floor_ms": round(beyond - floor, 3),
            "our_work_ms": round(beyond - same, 3),
            "above_same_forward_ms": round(beyond - forward_beyond, 3),
        }
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="bench", choices=["tiny", "bench"])
    ap.add_argument("--model-dir", default=None, help="a checkpoint folder instead of a random-weight one")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--streams", type=int, default=4)
    add_setting_arguments(ap, handler_help="an extra handler setting, e.g. --set step_max_tokens=16")
    ap.add_argument("--skip-itl", action="store_true", help="skip the inter-token latency part")
    ap.add_argument("--skip-aggregate", action="store_true", help="skip the aggregate decode part")
    ap.add_argument("--skip-overhead", action="store_true", help="skip the per-request serving overhead part")
    ap.add_argument("--skip-floor", action="store_true", help="skip the comparison with TorchServe's floor")
    ap.add_argument(
        "--overhead-warmup", type=int, default=1000, help="answers per server before the warm overhead is measured"
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    model_dir = args.model_dir
    if not model_dir:
        from llava_tools.tiny_model import write_checkpoint

        model_dir = str(write_checkpoint(args.model, tempfile.mkdtemp(prefix=f"llava-{args.model}-")))
    images = [sample_photo(n) for n in PHOTOS]
    extra = dict(args.overrides)
    overrides = {"max_sessions": 32, "max_concurrent_generations": 16, **extra}
    ts = {"batchSize": 32, "maxNumSequence": 32}
    report: dict = {"model": args.model_dir or args.model, "new_tokens": args.new_tokens, "settings": overrides}
    if not args.skip_aggregate:
        with LocalServer(model_dir, overrides=overrides, model_config_overrides=ts, startup_timeout_s=600) as server:
            report["aggregate_decode"] = aggregate(server.url, images, args.rounds, args.new_tokens)
    if not args.skip_itl:
        itl_overrides = {**overrides, "step_max_tokens": 1}
        with LocalServer(
            model_dir, overrides=itl_overrides, model_config_overrides=ts, startup_timeout_s=600
        ) as server:
            report["inter_token_latency"] = inter_token(server.url, images, args.streams, 64, max(1, args.rounds - 1))
    if not args.skip_overhead:  # on the tiny model, so the model's own time is small next to it
        from llava_tools.tiny_model import write_checkpoint

        tiny = str(write_checkpoint("tiny", tempfile.mkdtemp(prefix="llava-tiny-")))
        report["serving_overhead_tiny"] = serving_overhead(tiny, images[2], 100, args.overhead_warmup)
        report["serving_overhead_tiny"]["handler_in_process"] = handler_per_call(tiny, images[2], 200)
    if not args.skip_floor:  # on the tiny model: ours against a handler that runs no model, same TorchServe
        from llava_tools.tiny_model import write_checkpoint

        tiny = str(write_checkpoint("tiny", tempfile.mkdtemp(prefix="llava-tiny-")))
        report["floor_tiny"] = floor_comparison(tiny, images[2], warmup=600, n=400)
        report["floor_tiny"]["handler_in_process"] = handler_per_call(tiny, images[2], 200)
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
