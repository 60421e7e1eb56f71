"""Model replicas in one worker (``devices``): aggregate decode of 2 replicas vs 1, side by side, over HTTP.

Two local ``llava-serve`` servers run at the same time (loopback, real TorchServe): (a) one replica
(``devices=cpu``), (b) two replicas (``devices=cpu,cpu``, one process each); every replica is limited
to ``--threads`` torch threads. In each, ``--per-replica`` sessions per replica ask for
``--new-tokens`` greedy tokens at the same moment; aggregate tokens/s = tokens / wall time. The
servers take turns round by round (a, b, a, b, ...) so drift hits both alike; while one is measured
the other is paused (SIGSTOP to its process group, SIGCONT after), as an idle TorchServe is not idle:
its job-group dispatcher wakes every ``maxBatchDelay`` (1 ms), about 5% of a core here, which would
tax (b), the one that needs both cores. The median round is reported, with the ratio (b) / (a) and
the median of the rounds' own ratios, how the sessions were spread over (b)'s replicas, and whether
the greedy answers of (a) and (b) are identical.

Usage: python benchmarks/replicas.py --model bench [--rounds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import requests

from concurrency import burst, others_paused  # benchmarks/concurrency.py (this script's folder is on sys.path)
from llava_client import SessionClient
from llava_tools.cli import add_setting_arguments
from llava_tools.demo.samples import sample_photo
from llava_tools.serve import LocalServer

QUESTION = "Describe this image in great detail, please."


def open_sessions_by_replica(server: LocalServer, num_sessions: int, timeout_s: float = 10.0) -> dict[str, float]:
    """Open sessions by replica, from the ``llava_OpenSessions`` gauges, once they add up to
    ``num_sessions`` (the worker writes its metric lines at most once per ``metrics_interval_ms``)
    or at ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = requests.get(server.metrics_url + "/metrics", timeout=10).text
        spread = {
            m.group(1): float(m.group(2))
            for m in re.finditer(r'^llava_OpenSessions\{[^}]*Replica="(\d+)"[^}]*\} (\S+)$', text, re.M)
        }
        if sum(spread.values()) >= num_sessions or time.monotonic() > deadline:
            return spread
        time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="bench", choices=["tiny", "bench"])
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--per-replica", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    add_setting_arguments(ap, handler_help="a handler setting for both servers, e.g. --set step_max_tokens=16")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    model_dir = args.model_dir
    if not model_dir:
        from llava_tools.tiny_model import write_checkpoint

        model_dir = str(write_checkpoint(args.model, tempfile.mkdtemp(prefix=f"llava-{args.model}-")))
    image = sample_photo("astronaut")
    configs = {"a": "cpu", "b": "cpu,cpu"}
    servers: dict[str, LocalServer] = {}
    try:
        for key, devices in configs.items():
            servers[key] = LocalServer(
                model_dir,
                overrides={**dict(args.overrides), "devices": devices, "torch_threads": args.threads},
                startup_timeout_s=600,
            ).start()
        sessions = {}
        for key, devices in configs.items():
            client = SessionClient.from_url(servers[key].url, max_retries=2)
            n = args.per_replica * len(devices.split(","))
            sessions[key] = [client.open_session(image) for _ in range(n)]
            for s in sessions[key]:  # warm-up: the first follow-up of each, then one burst
                s.ask(QUESTION, remember=False, max_new_tokens=2)
            burst(sessions[key], QUESTION, 4)
        rates: dict[str, list[float]] = {k: [] for k in configs}
        answers: dict[str, set[str]] = {k: set() for k in configs}
        for _ in range(args.rounds):
            for key in configs:
                with others_paused(servers, key):
                    rate, texts = burst(sessions[key], QUESTION, args.new_tokens)
                rates[key].append(rate)
                answers[key].update(texts)
        spread = open_sessions_by_replica(servers["b"], len(sessions["b"]))
    finally:
        for server in servers.values():
            server.stop()
    med = {k: statistics.median(v) for k, v in rates.items()}
    report = {
        "model": args.model_dir or args.model,
        "threads_per_replica": args.threads,
        "sessions_per_replica": args.per_replica,
        "new_tokens": args.new_tokens,
        "rounds": args.rounds,
        "settings": dict(args.overrides),
        "tokens_per_s": {"one_replica": round(med["a"], 1), "two_replicas": round(med["b"], 1)},
        "ratio_two_over_one": round(med["b"] / med["a"], 2),
        "rounds_tokens_per_s": {k: [round(r, 1) for r in v] for k, v in rates.items()},
        # each round's (a) and (b) ran back to back: their ratio is the least touched by drift
        "median_round_ratio": round(statistics.median(b / a for a, b in zip(rates["a"], rates["b"], strict=True)), 2),
        "sessions_by_replica_in_two": spread,
        "greedy_answers_identical": len(answers["a"]) == 1 and answers["a"] == answers["b"],
    }
    print(json.dumps(report, indent=1))
    print(
        f"\n1 replica: {med['a']:.1f} tok/s; 2 replicas: {med['b']:.1f} tok/s; "
        f"ratio {report['ratio_two_over_one']:.2f}x, median of the rounds' ratios "
        f"{report['median_round_ratio']:.2f}x (target >= 1.7)"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
