"""The TorchServe table of the GPU check (issue 59 item 5): ``benchmarks/gpu_serve.py`` runs over real
TorchServe on the CPU as a smoke test, and ``benchmarks/gpu_bundle.py`` splits TorchServe's wheel and
puts a Java runtime and the frontend jar back as the device machine needs them."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from test_load_smoke import BENCHMARKS, _benchmark

pytestmark = pytest.mark.integration


def test_the_torchserve_table_runs_on_the_cpu_and_reads_the_goals_against_the_in_process_table(
    tiny_model_dir, tmp_path
):
    """``gpu_serve.py --device cpu``: TorchServe's floor, then llava-serve's follow-up TTFT, batch-1 decode,
    streams and a cold turn over HTTP, each section in the JSON; the goals computed against an in-process
    table (its numbers given here): follow-up TTFT within in-process + floor + 1 ms, streams at 0.9x."""
    inside = tmp_path / "gpu.json"
    inside.write_text(json.dumps({
        "turns": {"follow_up": {"ttft_ms": 1.0}, "cold_image_turn_ms": 50.0},
        "aggregate": {"2": {"tokens_per_s": 1e9}},
        "batch_one": {"ms_per_token": 2.0},
    }))  # fmt: skip
    out = tmp_path / "serve.json"
    args = ["--device", "cpu", "--model-dir", str(tiny_model_dir), "--dtype", "auto", "--streams", "1,2"]
    args += ["--new-tokens", "8", "--repeats", "1", "--floor-requests", "10", "--context", "300"]
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "gpu_serve.py"), *args, "--in-process", str(inside), "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert "errors" not in report and "checkpoint" not in report  # the given checkpoint, none written
    assert "compile_cache" not in report  # a CPU's default: no compile, no cache
    assert report["worker_start"]["weights_s"] > 0 and report["worker_start"]["engine_s"] >= 0  # its ready line
    floor = report["floor"]["round_trip_ms"]
    assert 0 < floor < report["follow_up"]["ttft_ms"] and report["follow_up"]["new_tokens"] > 10
    assert report["context_tokens"] >= 260 and report["follow_up"]["server_total_ms"] > 0
    assert report["batch_one"]["ms_per_token"] > 0 and report["batch_one"]["tokens"] == [8]
    assert set(report["streams"]) == {"1", "2"} and all(
        r["decode_tokens_per_s"] > 0 for r in report["streams"].values()
    )
    for row in report["streams"].values():  # the client's first token after the server made it, at most the last
        assert 0 < row["server_first_token_ms_p50"] < row["first_token_ms_p50"] <= row["first_token_ms_max"]
    assert report["cold"]["cold_image_turn_ms"] > 0
    goals = report["goals"]
    assert goals["follow_up_ttft"]["budget_ms"] == pytest.approx(1.0 + floor + 1.0, abs=1e-3)
    assert goals["follow_up_ttft"]["met"] is (report["follow_up"]["ttft_ms"] <= 2.0 + floor)
    assert goals["streams_2_vs_in_process"]["met"] is False  # 1e9 tokens/s in process: never reached
    assert "streams_1_vs_in_process" not in goals  # the in-process table has no level 1 here
    assert goals["batch_one_vs_in_process"] == pytest.approx(report["batch_one"]["ms_per_token"] / 2.0, abs=1e-3)


def _jar() -> bytes:
    """A small jar: a manifest, folder entries and two files, one of them binary."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as jar:
        jar.writestr("META-INF/", b"")
        jar.writestr("META-INF/MANIFEST.MF", b"Manifest-Version: 1.0\r\n\r\n")
        jar.writestr("org/pytorch/", b"")
        jar.writestr("org/pytorch/ModelServer.class", bytes(range(256)) * 4)
        jar.writestr("log4j2.xml", b"<Configuration/>")
    return buffer.getvalue()


def _wheel(path: Path, jar: bytes) -> None:
    """A torchserve-shaped wheel: the ``ts`` package with its frontend jar, and a RECORD naming it."""
    record = "ts/__init__.py,,\nts/frontend/model-server.jar,sha256=x,1\ntorchserve-0.12.0.dist-info/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr("ts/__init__.py", "")
        wheel.writestr("ts/frontend/model-server.jar", jar)
        wheel.writestr(
            "torchserve-0.12.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: torchserve\nVersion: 0.12.0\n"
        )
        wheel.writestr(
            "torchserve-0.12.0.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        wheel.writestr("torchserve-0.12.0.dist-info/RECORD", record)


@pytest.mark.timeout(240)
def test_a_timed_out_torchserve_table_stops_every_server_it_started(tiny_model_dir, tmp_path):
    """``timeout`` ends a part of the GPU check with SIGTERM: gpu_serve.py then stops its servers'
    process groups on the way out (TorchServe, in a session of its own, would otherwise keep the GPU
    through the next part), and exits 143 with what it measured written."""
    import time

    import psutil

    out = tmp_path / "serve.json"
    args = ["--device", "cpu", "--model-dir", str(tiny_model_dir), "--dtype", "auto", "--streams", "1"]
    args += ["--floor-requests", "100000", "--json", str(out)]  # the floor's loop outlasts the signal
    proc = subprocess.Popen(
        [sys.executable, str(BENCHMARKS / "gpu_serve.py"), *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    started: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline and proc.poll() is None:  # until TorchServe's Java runs under it
            started = psutil.Process(proc.pid).children(recursive=True)
            if any("java" in (p.name() or "") for p in started if p.is_running()):
                break
            time.sleep(0.5)
        assert proc.poll() is None and any("java" in p.name() for p in started), "TorchServe never started"
        time.sleep(2)  # its requests under way
        started = psutil.Process(proc.pid).children(recursive=True)
        proc.terminate()  # SIGTERM, as timeout sends it
        assert proc.wait(timeout=60) == 143, proc.stderr.read().decode()[-2000:] if proc.stderr else ""
        _gone, alive = psutil.wait_procs(started, timeout=30)
        assert [p.pid for p in alive if p.status() != psutil.STATUS_ZOMBIE] == []
    finally:
        for p in [*started, psutil.Process(proc.pid)] if proc.poll() is None else started:
            try:
                p.kill()
            except psutil.Error:
                pass
        proc.wait(timeout=30)


def test_the_gpu_table_refuses_a_section_it_does_not_have():
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "gpu.py"), "--device", "cpu", "--sections", "smoke,no_such_section"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "no section 'no_such_section'" in done.stderr
    assert "prefill_graph" in done.stderr and "Traceback" not in done.stderr


def test_the_bundle_carries_the_frontend_jar_apart_and_puts_it_and_a_runnable_java_back(tmp_path):
    """split_wheel: the wheel loses its jar and the jar's RECORD line; pip installs it. unpack: the Java
    runtime's programs run again (a tar that lost their run bits, as the device's copy did) and the jar is
    rebuilt with every entry, in order, byte for byte."""
    bundle = _benchmark("gpu_bundle")
    out, site, java = tmp_path / "out", tmp_path / "site", tmp_path / "java"
    out.mkdir()
    jar = _jar()
    wheel = tmp_path / "torchserve-0.12.0-py3-none-any.whl"
    _wheel(wheel, jar)
    split, frontend = bundle.split_wheel(wheel, out)
    with zipfile.ZipFile(split) as z:
        assert bundle.JAR not in z.namelist() and "ts/__init__.py" in z.namelist()
        assert bundle.JAR not in z.read("torchserve-0.12.0.dist-info/RECORD").decode()
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(site), str(split)]
    subprocess.run(pip, check=True, timeout=120)
    runtime = tmp_path / "runtime" / "java"
    (runtime / "bin").mkdir(parents=True)
    (runtime / "lib").mkdir()
    (runtime / "bin" / "java").write_text("#!/bin/sh\necho java-ran\n")
    (runtime / "lib" / "jspawnhelper").write_text("#!/bin/sh\n")
    for path in (runtime / "bin" / "java", runtime / "lib" / "jspawnhelper"):
        path.chmod(0o644)  # as a copy without run bits
    with tarfile.open(out / bundle.JAVA_TAR, "w:xz") as tar:
        tar.add(runtime, arcname="java")
    bundle.unpack(out, site, java)
    ran = subprocess.run([str(java / "bin" / "java")], capture_output=True, text=True, check=True)
    assert ran.stdout == "java-ran\n" and os.access(java / "lib" / "jspawnhelper", os.X_OK)
    with zipfile.ZipFile(io.BytesIO(jar)) as before, zipfile.ZipFile(site / bundle.JAR) as after:
        assert after.namelist() == before.namelist()
        assert all(after.read(name) == before.read(name) for name in before.namelist())
    assert frontend.stat().st_size > 0
    with pytest.raises(FileNotFoundError, match="install the torchserve wheel"):
        bundle.unpack(out, tmp_path / "empty", java)
