"""Clients that give up under a load the server cannot keep up with, then one more request.

An open-loop load on a local ``llava-serve``: ``--requests`` chat requests spread evenly over
``--duration-s`` seconds on ``/v1/chat/completions`` (streamed unless ``--plain``, no ``max_tokens``:
the server's default answer length), each abandoned by its client after a uniform 0..``--give-up-s``
seconds (some while held at the proxy, some mid-answer) by closing its connection, as a load tool
cancels its requests at the end of a phase. Then a short request every ``--probe-every-s`` seconds
until one is answered: the seconds from the load's end to that answer, and the worker's
``llava_RequestsInFlight`` after it, are the result. Also printed: the statuses the load's requests
got (a 503 is a refusal while the load ran).

Usage: python benchmarks/abandoned.py --model tiny --requests 240 --duration-s 30 --give-up-s 5 [--json out.json]
"""

from __future__ import annotations

import argparse
import collections
import http.client
import json
import random
import re
import tempfile
import threading
import time
from pathlib import Path

import requests

from llava_tools.serve import LocalServer
from llava_tools.tiny_model import write_checkpoint


def abandoned_request(port: int, stream: bool, give_up_s: float, statuses: collections.Counter) -> None:
    """One request, left after ``give_up_s`` seconds (or answered before)."""
    t0 = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=max(0.05, give_up_s))
    began = False
    try:
        body = {"messages": [{"role": "user", "content": "Tell me a long story about cats."}], "stream": stream}
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        reply = conn.getresponse()
        statuses[str(reply.status)] += 1
        began = True
        while (left := give_up_s - (time.monotonic() - t0)) > 0:
            assert conn.sock is not None
            conn.sock.settimeout(max(0.01, left))
            if not reply.fp.readline():
                return
        statuses["left mid-answer"] += 1
    except OSError:  # a timeout
        statuses["left mid-answer" if began else "left before a reply"] += 1
    finally:
        conn.close()


def in_flight(server: LocalServer) -> float:
    text = requests.get(server.metrics_url + "/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(r"^llava_RequestsInFlight\{[^}]*\} (\S+)$", text, re.M))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["tiny", "bench"], default="tiny")
    parser.add_argument("--requests", type=int, default=240)
    parser.add_argument("--duration-s", type=float, default=30.0)
    parser.add_argument("--give-up-s", type=float, default=5.0)
    parser.add_argument("--plain", action="store_true", help="non-streamed requests")
    parser.add_argument("--probe-every-s", type=float, default=1.0)
    parser.add_argument("--limit-s", type=float, default=180.0, help="give up probing after this long")
    parser.add_argument("--json", type=Path, help="write the result here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_checkpoint(args.model, Path(tmp) / args.model, seed=0)
        with LocalServer(model_dir, startup_timeout_s=300) as server:
            port = int(server.url.rsplit(":", 1)[1])
            statuses: collections.Counter = collections.Counter()
            threads = []
            t0 = time.monotonic()
            for i in range(args.requests):
                give_up_s = random.uniform(0, args.give_up_s)
                th = threading.Thread(target=abandoned_request, args=(port, not args.plain, give_up_s, statuses))
                th.start()
                threads.append(th)
                time.sleep(max(0.0, t0 + (i + 1) * args.duration_s / args.requests - time.monotonic()))
            for th in threads:
                th.join()
            end = time.monotonic()
            probe = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            recovered_s = None
            while time.monotonic() - end < args.limit_s:
                reply = requests.post(server.url + "/v1/chat/completions", json=probe, timeout=120)
                if reply.status_code == 200:
                    recovered_s = time.monotonic() - end
                    break
                time.sleep(args.probe_every_s)
            time.sleep(2.0)  # the worker's metrics are written after its reply
            result = {
                "model": args.model,
                "requests": args.requests,
                "duration_s": args.duration_s,
                "give_up_s": args.give_up_s,
                "streamed": not args.plain,
                "load_statuses": dict(statuses),
                "answered_s_after_load": None if recovered_s is None else round(recovered_s, 2),
                "requests_in_flight_after": in_flight(server),
            }
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
