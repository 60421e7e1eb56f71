"""Load test on loopback: N simulated users against a local llava-serve, optionally with a fault.

Each user loops until the deadline: open a session on a real photograph, ask ``--questions``
questions with think time between them (the first streamed, to measure time to first token as
the client sees it; the others plain), close. The client is ``llava_client`` with auto-recovery, as
a real user would run it; a user who sees an error asks the same question again (after 1, 2,
4 s), and a session counts as lost when that keeps failing or the session is gone for good.

Reports p50/p95/p99 time to first token and total time per question, questions per second, errors
by code, sessions lost (a session whose user saw an error that ended it), client recoveries, and
peak host memory (RSS of the TorchServe process tree, sampled every 0.5 s, and its per-minute
maximum). Faults: ``--kill-worker-at S`` kills the TorchServe worker S seconds in,
``--kill-worker-every S`` every S seconds; ``--droppers N`` adds N users who drop their connection
mid-stream (they read two pieces of a long streamed answer, close the response, and ask again until
the session answers: the time that takes is reported). At the end, a full ``max_sessions`` of new
sessions must open (no job group or session left behind).

Bounded: loopback only, at most 64 users and 3,600 s.

Usage: python benchmarks/load.py --model bench --users 16 --duration-s 300 [--kill-worker-at 120] [--json out.json]
       python benchmarks/load.py --model bench --users 8 --duration-s 1800 --kill-worker-every 300 --droppers 2
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

from llava_client import LlavaError, SessionClient, SessionGone
from llava_tools.demo.samples import sample_photo
from llava_tools.serve import LocalServer

PHOTOS = ("astronaut", "chelsea", "coffee", "rocket", "cat")
QUESTIONS = (
    "What is in this image?",
    "What colors do you see?",
    "Describe the background.",
    "Is there a person in the picture?",
    "What is written on it?",
)
MAX_USERS, MAX_DURATION_S = 64, 3600
#: A user who sees an error asks the same question again after 1, 2, 4 s before giving up.
USER_ATTEMPTS = 4


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return round(values[min(len(values) - 1, int(q / 100 * len(values)))], 1)


class Stats:
    """Thread-safe counters of the run."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ttft_ms: list[float] = []
        self.total_ms: list[float] = []
        self.errors: collections.Counter[str] = collections.Counter()
        self.sessions_opened = 0
        self.sessions_completed = 0
        self.sessions_lost = 0
        self.recoveries = 0
        self.questions = 0
        self.streams_dropped = 0
        self.busy_after_drop_ms: list[float] = []


def user(i: int, url: str, deadline: float, args: argparse.Namespace, images: dict[str, bytes], stats: Stats) -> None:
    rng = random.Random(i)
    # retries with backoff (0.5 s doubling, capped): a supervisor restart takes seconds
    client = SessionClient.from_url(url, max_retries=5)
    while time.monotonic() < deadline:
        name = rng.choice(PHOTOS)
        try:
            session = client.open_session(images[name])
        except LlavaError as err:
            with stats.lock:
                stats.errors[getattr(err, "code", None) or type(err).__name__] += 1
            time.sleep(args.think_s)
            continue
        with stats.lock:
            stats.sessions_opened += 1
        lost = False
        try:
            for k in range(args.questions):
                if time.monotonic() >= deadline:
                    break
                q = rng.choice(QUESTIONS)
                for attempt in range(USER_ATTEMPTS):  # a user asks again, more patiently each time
                    try:
                        ask(session, q, k == 0, rng, args, stats)
                        break
                    except LlavaError as err:
                        with stats.lock:
                            stats.errors[getattr(err, "code", None) or type(err).__name__] += 1
                        if attempt == USER_ATTEMPTS - 1 or isinstance(err, SessionGone):
                            raise
                        time.sleep(2.0**attempt)
                time.sleep(rng.uniform(0.5, 1.5) * args.think_s)
        except LlavaError:
            lost = True
            with stats.lock:
                stats.sessions_lost += 1
        finally:
            with stats.lock:
                stats.recoveries += session.recoveries
                stats.sessions_completed += 0 if lost else 1
            try:
                session.close()
            except LlavaError:
                pass
    client.close()


def dropper(
    i: int, url: str, deadline: float, args: argparse.Namespace, images: dict[str, bytes], stats: Stats
) -> None:
    """A user who drops the connection mid-stream, then asks again until the session answers."""
    client = SessionClient.from_url(url, max_retries=5)
    while time.monotonic() < deadline:
        try:
            with client.open_session(images[PHOTOS[i % len(PHOTOS)]]) as session:
                with session.stream("Describe this image in great detail.", max_new_tokens=128) as stream:
                    for k, _piece in enumerate(stream):
                        if k == 1:
                            break  # leaving the with-block closes the response: the connection drops
                t0 = time.perf_counter()
                with stats.lock:
                    stats.streams_dropped += 1
                while time.monotonic() < deadline + 60:
                    try:
                        session.ask("What is in this image?", max_new_tokens=4)
                        break
                    except LlavaError as err:
                        if getattr(err, "code", None) != "session_busy":
                            raise
                        time.sleep(0.1)
                with stats.lock:
                    stats.busy_after_drop_ms.append((time.perf_counter() - t0) * 1000)
        except LlavaError as err:
            with stats.lock:
                stats.errors[f"dropper:{getattr(err, 'code', None) or type(err).__name__}"] += 1
        time.sleep(args.think_s)
    client.close()


def ask(session, q: str, streamed: bool, rng: random.Random, args: argparse.Namespace, stats: Stats) -> None:
    """One question: streamed (client-side time to first token recorded) or plain."""
    t0 = time.perf_counter()
    if streamed:
        ttft = None
        with session.stream(q, max_new_tokens=args.max_new_tokens) as stream:
            for _piece in stream:
                if ttft is None:
                    ttft = (time.perf_counter() - t0) * 1000
    else:
        session.ask(q, max_new_tokens=args.max_new_tokens, remember=rng.random() < 0.7)
    total = (time.perf_counter() - t0) * 1000
    with stats.lock:
        if streamed:
            stats.ttft_ms.append(ttft if ttft is not None else total)
        stats.total_ms.append(total)
        stats.questions += 1


def tree_rss(root_pid: int) -> int:
    try:
        root = psutil.Process(root_pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


def run(args: argparse.Namespace) -> dict:
    if args.users > MAX_USERS or args.duration_s > MAX_DURATION_S:
        raise SystemExit(f"bounded: at most {MAX_USERS} users and {MAX_DURATION_S} s")
    model_dir = args.model_dir
    if not model_dir:
        from llava_tools.tiny_model import write_checkpoint

        model_dir = str(write_checkpoint(args.model, tempfile.mkdtemp(prefix=f"llava-{args.model}-")))
    images = {n: sample_photo(n) for n in PHOTOS}
    stats = Stats()
    overrides = {"max_sessions": max(args.users * 2, 8)}
    # 8 job groups more than sessions, as model-config.yaml: an open past max_sessions gets our 503 + Retry-After
    ts = {"batchSize": overrides["max_sessions"] + 8, "maxNumSequence": overrides["max_sessions"] + 8}
    with LocalServer(
        model_dir, host="127.0.0.1", overrides=overrides, model_config_overrides=ts, startup_timeout_s=600
    ) as server:
        peak = [0]
        per_minute: dict[int, int] = {}
        stop = threading.Event()
        t_start = time.monotonic()

        def sample() -> None:
            while not stop.wait(0.5):
                if server._proc is not None:  # the launcher's process group
                    rss = tree_rss(server._proc.pid)
                    peak[0] = max(peak[0], rss)
                    minute = int((time.monotonic() - t_start) // 60)
                    per_minute[minute] = max(per_minute.get(minute, 0), rss)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        deadline = t_start + args.duration_s
        threads = [
            threading.Thread(target=user, args=(i, server.url, deadline, args, images, stats), daemon=True)
            for i in range(args.users)
        ] + [
            threading.Thread(target=dropper, args=(i, server.url, deadline, args, images, stats), daemon=True)
            for i in range(args.droppers)
        ]
        for t in threads:
            t.start()
        killed: list[int] | None = None
        kill_times = []
        if args.kill_worker_at is not None:
            kill_times.append(args.kill_worker_at)
        if args.kill_worker_every:
            kill_times += [
                k * args.kill_worker_every for k in range(1, int(args.duration_s // args.kill_worker_every) + 1)
            ]
        for at in sorted(t for t in kill_times if t < args.duration_s):
            time.sleep(max(0.0, t_start + at - time.monotonic()))
            killed = (killed or []) + server.worker_pids()
            for pid in server.worker_pids():
                psutil.Process(pid).kill()
        for t in threads:
            t.join(timeout=args.duration_s + 300)
        elapsed = time.monotonic() - t_start
        stop.set()
        restarts = server.restarts
        after = open_all(server.url, overrides["max_sessions"], images)
    minutes = sorted(per_minute)
    growth = None
    if len(minutes) > 6:  # from minute 5 to the last whole minute
        growth = round(per_minute[minutes[-2]] / per_minute[5] - 1, 3)
    return {
        "model": args.model_dir or args.model,
        "users": args.users,
        "duration_s": round(elapsed, 1),
        "questions_per_user_session": args.questions,
        "think_s": args.think_s,
        "max_new_tokens": args.max_new_tokens,
        "questions": stats.questions,
        "questions_per_s": round(stats.questions / elapsed, 2),
        "ttft_ms": {
            "p50": pct(stats.ttft_ms, 50),
            "p95": pct(stats.ttft_ms, 95),
            "p99": pct(stats.ttft_ms, 99),
            "mean": round(statistics.mean(stats.ttft_ms), 1) if stats.ttft_ms else None,
        },
        "total_ms": {"p50": pct(stats.total_ms, 50), "p95": pct(stats.total_ms, 95), "p99": pct(stats.total_ms, 99)},
        "errors_by_code": dict(stats.errors),
        "sessions_opened": stats.sessions_opened,
        "sessions_lost": stats.sessions_lost,
        "client_recoveries": stats.recoveries,
        "peak_host_rss_bytes": peak[0],
        "host_rss_mib_by_minute": {m: round(per_minute[m] / 2**20) for m in minutes},
        "host_rss_growth_minute5_to_end": growth,
        "fault": {"killed_worker_pids": killed, "server_restarts": restarts} if killed is not None else None,
        "dropped_streams": {
            "count": stats.streams_dropped,
            "session_busy_after_drop_ms": {
                "p50": pct(stats.busy_after_drop_ms, 50),
                "max": round(max(stats.busy_after_drop_ms), 1) if stats.busy_after_drop_ms else None,
            },
        },
        "sessions_opened_after_the_run": after,
    }


def open_all(url: str, n: int, images: dict[str, bytes]) -> dict:
    """Open ``n`` (= max_sessions) new sessions at once after the run, then close them."""
    client = SessionClient.from_url(url, max_retries=5)
    opened, errors = [], collections.Counter()
    for k in range(n):
        try:
            opened.append(client.open_session(images[PHOTOS[k % len(PHOTOS)]]))
        except LlavaError as err:
            errors[getattr(err, "code", None) or type(err).__name__] += 1
    for session in opened:
        session.close()
    client.close()
    return {"asked": n, "opened": len(opened), "errors": dict(errors)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="bench", choices=["tiny", "bench"])
    ap.add_argument("--model-dir")
    ap.add_argument("--users", type=int, default=16)
    ap.add_argument("--duration-s", type=float, default=300)
    ap.add_argument("--questions", type=int, default=3)
    ap.add_argument("--think-s", type=float, default=2.0)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--kill-worker-at", type=float, default=None, help="seconds into the run")
    ap.add_argument("--kill-worker-every", type=float, default=None, help="kill the worker every S seconds")
    ap.add_argument("--droppers", type=int, default=0, help="extra users who drop their connection mid-stream")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    result = run(args)
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
