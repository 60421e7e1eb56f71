"""Running streams while another request's image host is slow: their longest inter-token gap, side by side.

Against a local ``llava-serve`` (loopback, real TorchServe; the bench model by default), ``--streams``
sessions stream an answer (native ``generate``, ``step_max_tokens=1`` so each token is its own chunk)
and the gaps between consecutive chunks are taken at the client

- (a) quiet, and
- (b) while another client opens a session on an image URL whose host, a local HTTP server on
  127.0.0.1, answers after ``--delay`` seconds (4 s),

the slow open sent three ways, on two servers started in turn in one run:

- through the public port's proxy (``llava-serve``'s, the container's): the proxy fetches the image
  before the request reaches TorchServe (``llava_tools.serve.image_relay``), so the worker never waits;
- straight to TorchServe, default settings: the worker fetches beside its loop, and the request's
  first call waits at most ``image_fetch_wait_ms`` = 250 ms while answers run;
- straight to TorchServe with ``image_fetch_wait_ms=60000``: its first call waits for the whole
  fetch, how every fetch ran before.

Reported per way: the longest gap and p99 of (a) and (b), and the slow open's status and time.
Goal (issue "Liveness and an honest contract"): (b)'s longest gap at most 0.5 s.

Usage::

    python benchmarks/slow_image_host.py [--model bench | --model-dir DIR] [--delay 4] [--streams 4]
"""

from __future__ import annotations

import argparse
import base64
import http.server
import json
import statistics
import tempfile
import threading
import time
from urllib.parse import parse_qs, urlsplit

import requests

from llava_tools.demo.samples import sample_photo
from llava_tools.serve import LocalServer

PHOTOS = ("astronaut", "chelsea", "coffee", "rocket")
SID = "X-Amzn-SageMaker-Session-Id"


class _SlowHost(http.server.BaseHTTPRequestHandler):
    payload = b""

    def do_GET(self) -> None:  # noqa: N802
        time.sleep(float(parse_qs(urlsplit(self.path).query).get("delay", ["0"])[0]))
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(self.payload)))
        self.end_headers()
        self.wfile.write(self.payload)

    def log_message(self, *args: object) -> None:
        pass


def _stream(url: str, sid: str, new_tokens: int, arrivals: list[float]) -> None:
    body = {"type": "generate", "prompt": "Describe the image in detail.", "stream": True, "remember": False}
    body["parameters"] = {"max_new_tokens": new_tokens, "temperature": 0}
    with requests.post(url + "/invocations", json=body, headers={SID: sid}, stream=True, timeout=300) as reply:
        reply.raise_for_status()
        for chunk in reply.iter_content(chunk_size=None):
            if chunk:
                arrivals.append(time.perf_counter())


def measure(
    url: str, sids: list[str], new_tokens: int, slow_url: str | None, open_url: str = "", delay_s: float = 0.0
) -> dict:
    """Stream from every session at once (at ``url``); with ``slow_url`` (a host taking ``delay_s``),
    open a session on it 0.5 s in, sent to ``open_url`` (default ``url``). Returns the gaps' max and
    p99 (ms) and, with ``slow_url``, the open's status and seconds and the longest gap overlapping
    its wait on the host (the one that spans the wait's end also holds the open's first step)."""
    arrivals: list[list[float]] = [[] for _ in sids]
    threads = [
        threading.Thread(target=_stream, args=(url, s, new_tokens, a)) for s, a in zip(sids, arrivals, strict=True)
    ]
    for t in threads:
        t.start()
    opened: dict = {}
    t0 = time.perf_counter()
    if slow_url is not None:
        time.sleep(0.5)
        t0 = time.perf_counter()
        reply = requests.post(
            (open_url or url) + "/invocations", json={"type": "open_session", "image": {"url": slow_url}}, timeout=120
        )
        opened = {"status": reply.status_code, "seconds": round(time.perf_counter() - t0, 2)}
        if reply.status_code == 200:
            sid = reply.json()["session_id"]
            requests.post(url + "/invocations", json={"type": "close_session"}, headers={SID: sid}, timeout=60)
    for t in threads:
        t.join()
    gaps = [1000 * (b - a) for times in arrivals for a, b in zip(times, times[1:], strict=False)]
    p99 = statistics.quantiles(gaps, n=100)[98] if len(gaps) > 1 else max(gaps, default=0.0)
    if slow_url is not None:  # the gaps during which the slow request was waiting on its host
        waiting = [
            1000 * (b - a)
            for times in arrivals
            for a, b in zip(times, times[1:], strict=False)
            if b > t0 and a < t0 + delay_s
        ]
        opened["max_gap_waiting_ms"] = round(max(waiting, default=0.0))
    return {"max_gap_ms": round(max(gaps, default=0.0)), "p99_gap_ms": round(p99), "chunks": len(gaps), **opened}


def run_server(model_dir: str, wait_ms: int, args: argparse.Namespace, slow_url: str, ways: tuple[str, ...]) -> list:
    """One server with ``image_fetch_wait_ms=wait_ms``; per way (``front``, ``torchserve``) the quiet
    and the slow-host measures."""
    overrides = {
        "allow_http": True,
        "allow_private_networks": True,
        "step_max_tokens": 1,
        "max_sessions": 8,
        "image_fetch_wait_ms": wait_ms,
    }
    with LocalServer(model_dir, overrides=overrides, startup_timeout_s=900) as server:
        sids = []
        for k in range(args.streams):
            image = base64.b64encode(sample_photo(PHOTOS[k % len(PHOTOS)])).decode()
            reply = requests.post(
                server.url + "/invocations", json={"type": "open_session", "image": {"base64": image}}, timeout=300
            )
            reply.raise_for_status()
            sids.append(reply.json()["session_id"])
        measure(server.url, sids, args.new_tokens, None)  # warm-up: a whole run, discarded
        rows = []
        for way in ways:
            open_url = server.url if way == "front" else server.torchserve_url
            quiet = measure(server.url, sids, args.new_tokens, None)
            # a fresh URL each time: the proxy keeps what it fetched
            slow_way = f"{slow_url}&way={way}{wait_ms}-{len(rows)}"
            slow = measure(server.url, sids, args.new_tokens, slow_way, open_url, args.delay)
            rows.append({"way": way, "image_fetch_wait_ms": wait_ms, "quiet": quiet, "slow_host": slow})
        return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bench", help="llava-tiny-model size to build (default bench)")
    parser.add_argument("--model-dir", default=None, help="an existing checkpoint instead")
    parser.add_argument("--delay", type=float, default=4.0, help="seconds the image host takes to answer")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=2, help="times each way is measured on the default server")
    args = parser.parse_args()
    model_dir = args.model_dir
    if model_dir is None:
        from llava_tools.tiny_model import write_checkpoint

        model_dir = str(write_checkpoint(args.model, tempfile.mkdtemp(prefix=f"llava-{args.model}-"), seed=0))
    _SlowHost.payload = sample_photo("rocket")
    host = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _SlowHost)
    threading.Thread(target=host.serve_forever, daemon=True).start()
    slow_url = f"http://127.0.0.1:{host.server_address[1]}/photo.png?delay={args.delay}"
    try:
        report = run_server(model_dir, 250, args, slow_url, ("front", "torchserve") * args.rounds)
        report += run_server(model_dir, 60_000, args, slow_url, ("torchserve",))
    finally:
        host.shutdown()
    print(json.dumps(report, indent=2))
    for row in report:
        q, s = row["quiet"], row["slow_host"]
        print(
            f"{row['way']:>10}, image_fetch_wait_ms={row['image_fetch_wait_ms']:>6}: longest gap quiet {q['max_gap_ms']} ms, "
            f"with a {args.delay:g} s image host {s['max_gap_ms']} ms (p99 {q['p99_gap_ms']} -> {s['p99_gap_ms']} ms; "
            f"while it waits {s['max_gap_waiting_ms']} ms); "
            f"the slow open: {s.get('status')} in {s.get('seconds')} s"
        )


if __name__ == "__main__":
    main()
