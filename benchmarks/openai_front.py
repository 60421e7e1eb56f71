"""What ``llava-serve``'s OpenAI proxy costs per request, side by side with TorchServe reached directly.

One TorchServe serving the floor handler (``benchmarks/floor_handler.py``: it answers at once, no
model), fronted by :class:`~llava_tools.serve.front.OpenAIFront` as ``llava-serve`` runs it. The same
small JSON body goes, interleaved request by request over keep-alive connections, to

- TorchServe's own ``/invocations`` (the floor: no proxy),
- ``/invocations`` through the proxy (relayed as it came),
- ``/v1/chat/completions`` through the proxy (OpenAI's route, sent to ``/invocations``),

and the script prints each path's median and p90 latency and the proxy's added median, in ms.
Goal (issue "Stateless conversations"): at most 0.3 ms per request.

Usage::

    python benchmarks/openai_front.py [--requests 400]
"""

from __future__ import annotations

import argparse
import contextlib
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def _serve(model_dir: str) -> Iterator[tuple[str, str]]:
    """``llava-serve`` with the floor handler, in its own process as users run it; yields its URL and
    TorchServe's own (from its ready line)."""
    command = [sys.executable, "-m", "llava_tools.serve", "--model-dir", model_dir, "--port", "0"]
    command += ["--handler", str(ROOT / "benchmarks" / "floor_handler.py")]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            match = re.search(r"ready at (\S+) .*TorchServe itself at (\S+?)\)", line)
            if match:
                break
        else:
            raise SystemExit("llava-serve did not start")
        yield match.group(1), match.group(2)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400, help="requests per path")
    args = parser.parse_args()
    body = b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}'
    headers = {"Content-Type": "application/json"}
    with tempfile.TemporaryDirectory() as model_dir, _serve(model_dir) as (url, torchserve_url):
        paths = {
            "TorchServe /invocations (floor)": torchserve_url + "/invocations",
            "front /invocations": url + "/invocations",
            "front /v1/chat/completions": url + "/v1/chat/completions",
        }
        sessions = {name: requests.Session() for name in paths}
        times: dict[str, list[float]] = {name: [] for name in paths}
        for i in range(args.requests + 20):
            for k, (name, url) in enumerate(paths.items()):
                # one sequence (job group) per path: the floor handler never ends one
                sequence = {"X-Amzn-SageMaker-Session-Id": f"bench-{k}"}
                t0 = time.perf_counter()
                reply = sessions[name].post(url, data=body, headers={**headers, **sequence}, timeout=30)
                elapsed = (time.perf_counter() - t0) * 1000.0
                assert reply.status_code == 200, (name, reply.status_code, reply.text[:200])
                if i >= 20:  # warm-up
                    times[name].append(elapsed)
    floor = statistics.median(times["TorchServe /invocations (floor)"])
    print(f"{'path':<34} {'median ms':>10} {'p90 ms':>8} {'added ms':>9}")
    for name, values in times.items():
        values.sort()
        median = statistics.median(values)
        p90 = values[int(len(values) * 0.9)]
        print(f"{name:<34} {median:>10.3f} {p90:>8.3f} {median - floor:>+9.3f}")


if __name__ == "__main__":
    main()
