"""benchmarks/load.py stays runnable: a short run with a worker killed mid-way and a stream dropped mid-way
loses no session and leaves room for a full max_sessions afterwards."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

BENCHMARKS = Path(__file__).parents[2] / "benchmarks"


def _benchmark(name: str):
    """Load ``benchmarks/<name>.py`` as a module (the folder is on sys.path, as when run as a script)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))  # replicas.py imports concurrency.burst
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # as importlib's recipe does: a dataclass in it looks its module up there
    spec.loader.exec_module(module)
    return module


def test_load_run_with_a_killed_worker_recovers_every_session(tiny_model_dir):
    load = _benchmark("load")
    args = argparse.Namespace(
        model="tiny",
        model_dir=str(tiny_model_dir),
        users=3,
        duration_s=18,
        questions=3,
        think_s=0.3,
        max_new_tokens=6,
        kill_worker_at=7.0,
        kill_worker_every=None,
        droppers=1,
    )
    result = load.run(args)
    print(json.dumps(result))
    assert result["questions"] >= 6 and result["ttft_ms"]["p50"] is not None
    assert result["sessions_lost"] == 0, json.dumps(result)
    assert result["fault"]["server_restarts"] == 1
    assert result["peak_host_rss_bytes"] > 0
    assert result["dropped_streams"]["count"] >= 1  # a user dropped a stream and the session answered again
    after = result["sessions_opened_after_the_run"]
    assert after["opened"] == after["asked"], after  # no session or job group left behind


def test_engine_decode_benchmark_runs_and_batched_greedy_answers_match_alone(tiny_model_dir, tmp_path):
    """The in-process benchmark (the GPU rows' script) runs on the CPU; its exactness part holds."""
    bench = _benchmark("engine_decode")
    out = tmp_path / "report.json"
    argv = ["--model-dir", str(tiny_model_dir), "--levels", "1,2,4", "--rounds", "1", "--new-tokens", "8"]
    assert bench.main([*argv, "--streams", "2", "--check-sessions", "3", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["exactness"]["identical"] == 3, report["exactness"]
    assert len(set(report["exactness"]["context_tokens"])) == 3  # three different context lengths
    assert report["aggregate"]["1"]["ratio_to_one"] == 1.0 and report["aggregate"]["4"]["tokens_per_s"] > 0
    assert report["itl"]["opens_completed"] >= 1 and report["hot"]["sessions_hot_by_budget"] > 0


def test_replicas_benchmark_runs_places_evenly_and_answers_alike(tiny_model_dir, tmp_path):
    """benchmarks/replicas.py stays runnable: 2 replicas vs 1 side by side, sessions 2 + 2, same answers."""
    bench = _benchmark("replicas")
    out = tmp_path / "replicas.json"
    argv = ["--model-dir", str(tiny_model_dir), "--rounds", "1", "--new-tokens", "6", "--per-replica", "2"]
    assert bench.main([*argv, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["sessions_by_replica_in_two"] == {"0": 2.0, "1": 2.0}
    assert report["greedy_answers_identical"] is True and report["tokens_per_s"]["two_replicas"] > 0


def test_the_gpu_table_runs_on_the_cpu_as_a_smoke_test(tmp_path):
    """``benchmarks/gpu.py --device cpu --model tiny`` (issue 43 item 5) runs the same code as on a GPU
    and writes every measure of the table, each latency beside the floor measured in the run; the paged
    static decode step (what a GPU replays as CUDA graphs, run eagerly here) against eager at the
    step's own shape, greedy tokens identical; the static step reading the pages with FlexAttention, and with ``auto``, in engines of their own (their
    tokens identical too)."""
    import subprocess

    out = tmp_path / "gpu.json"
    args = ["--device", "cpu", "--model", "tiny", "--dtype", "auto", "--levels", "1,2", "--new-tokens", "4"]
    args += ["--cuda-graphs", "on", "--kernel-rows", "1,2"]
    args += ["--kernels", "gather_sdpa,varlen_paged"]  # FlexAttention's first eager call costs seconds: its own test
    args += ["--compare-paged-read", "on"]  # the static step reading pages with flex, and auto, in engines of their own
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "gpu.py"), *args, "--repeats", "1", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["floor"]["floor_ms"] > 0 and report["floor"]["weight_bytes"] > 0
    assert report["batch_one"]["ms_per_token"] > 0 and report["batch_one"]["context_tokens"] > 500
    assert 0 <= report["batch_one"]["host_ms_per_step"] <= report["batch_one"]["ms_per_token"] + 1
    assert set(report["aggregate"]) == {"1", "2"} and report["aggregate"]["1"]["vs_one"] == 1.0
    assert report["turns"]["follow_up"]["ttft_ms"] > 0 and report["turns"]["cold_image_turn_ms"] > 0
    assert report["peer"]["ms_per_token"] > 0 and report["peer"]["compiled"] is False
    assert "x floor" in done.stdout and "batch-1 decode vs transformers" in done.stdout
    graphs = report["graphs"]  # nothing captured on a CPU: every static step ran eagerly
    assert graphs["num_graphs"] == 0 and graphs["num_replays"] == 0 and graphs["num_static_eager"] > 0
    assert graphs["rows_1"]["identical"] is True and graphs["rows_3"]["identical"] is True
    assert graphs["rows_3"]["first_difference"] == [None] * 3 and graphs["rows_1"]["static_eager_ms"] > 0
    assert graphs["rows_3"]["own_shape_identical"] is True  # fp32 on a CPU: the own-shape pass agrees too
    assert report["cudnn_sdpa"] in (True, False) and "errors" not in report and "skipped" not in report
    assert report["pool"]["fixed"] is True and report["pool"]["grows"] == 0
    assert report["pool"]["sessions_at_context"] > 100 and "KV pool holds at" in done.stdout
    kernels = report["attention_kernels"]  # the model's attention shape over pages, per kernel
    assert [k["shape"]["rows"] for k in kernels] == [1, 2] and all(k["fastest"] for k in kernels)
    assert "varlen_paged" in kernels[0]["kernels"] and "fastest paged kernel" in done.stdout
    assert report["paged_attention"] == "gather"  # a CPU engine's own read; a GPU's is auto
    flex = report["paged_read_flex"]  # FlexAttention over the pages: replay (eager here) equals eager
    assert flex["paged_attention"] == "flex" and flex["batch_one"]["ms_per_token"] > 0
    assert flex["graphs"]["rows_3"]["identical"] is True and flex["graphs"]["rows_3"]["own_shape_identical"] is True
    assert "paged read flex against gather" in done.stdout and "paged read auto against gather" in done.stdout
    assert report["paged_read_auto"]["graphs"]["rows_1"]["identical"] is True
    assert report["compiled_layers"] is False and set(report["greedy_rows"]) == set(report["sampled_rows"]) == {
        "1",
        "8",
        "32",
        "64",
    }
    assert "32 greedy rows picked, one argmax for all" in done.stdout
    layers = report["other_layers"]  # fused and compiled (Inductor's C++ on a CPU) in an engine of their own
    assert layers["compiled"] is True and layers["changed"]["fused"] > 0 and layers["changed"]["compiled"] > 0
    assert layers["dynamo_graphs"] >= 1 and layers["max_logit_difference"] < 1e-3
    assert layers["batch_one"]["ms_per_token"] > 0 and "compiled layers against eager" in done.stdout


def test_attention_kernels_over_pages_agree_with_sdpa_up_to_a_partial_last_page():
    """benchmarks/paged_attention.py: 3 rows of 37 positions each (a partial last page of 5 of 16) in
    pages scattered through a pool whose other slots hold random keys, grouped-query heads; the
    engine's gather + SDPA and FlexAttention over the pool (eager on a CPU) match contiguous SDPA in
    fp32, so each bounds a row to its length; varlen_attn and xformers' kernel, CUDA only, are reported as
    not run."""
    import torch

    bench = _benchmark("paged_attention")
    shape = bench.AttentionShape(heads=4, kv_heads=2, head_dim=16, rows=3, length=37, page_size=16)
    report = bench.measure("cpu", torch.float32, shape, repeats=1)
    kernels = report["kernels"]
    assert kernels["contiguous"]["max_abs_diff"] == 0.0
    for name in ("gather_sdpa", "flex_paged"):
        assert kernels[name]["max_abs_diff"] < 1e-5, (name, kernels[name])
    assert "error" in kernels["varlen_paged"] and report["fastest"] in ("gather_sdpa", "flex_paged")
    assert "error" in kernels["xformers_paged"]  # not installed here; CUDA only where it is
    assert "not run" in bench.describe(report) and report["shape"]["flex_compiled"] is False


def test_the_kv_pages_benchmark_runs_and_both_reads_answer_alike(tmp_path):
    """benchmarks/kv_pages.py stays runnable: the pool's decode step reading each row's pages gathered
    beside reading their runs as views, greedy tokens identical, the shared prefix stored once."""
    bench = _benchmark("kv_pages")
    out = tmp_path / "pages.json"
    args = ["--model", "tiny", "--rows", "3", "--steps", "3", "--rounds", "1", "--json", str(out)]
    assert bench.main(args) == 0
    report = json.loads(out.read_text())
    assert report["identical_every_round"] is True and report["decode_step_ms"]["runs"] > 0
    assert report["kv_bytes"]["pages"] < report["kv_bytes"]["own_caches"]


def test_the_prefill_attention_benchmark_runs_and_both_forms_agree(tmp_path):
    """benchmarks/prefill_attention.py stays runnable: a follow-up's prefill with the materialized mask
    and in the lower-right form, timed side by side, the same logits in fp32 on the CPU."""
    bench = _benchmark("prefill_attention")
    out = tmp_path / "prefill.json"
    assert bench.main(["--model", "tiny", "--context", "200", "--repeats", "2", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["max_logit_difference"] < 1e-4 and report["default_on_this_device"] is False
    assert report["materialized_mask_ms"] > 0 and report["lower_right_ms"] > 0


def test_the_gpu_table_records_each_section_as_it_ends_and_a_failing_one_without_stopping(tmp_path):
    """benchmarks/gpu.py's ``Sections``: every section is written to the JSON as it ends (a device call
    cut off at its limit keeps what was measured), a section that raises is recorded with its
    traceback's last line and the next one still runs, and one due past ``--deadline-s`` is skipped."""
    import time

    gpu = _benchmark("gpu")
    path = tmp_path / "table.json"
    sections = gpu.Sections(str(path), None, time.perf_counter())
    sections.run("first", lambda: {"ms": 1.5})
    assert json.loads(path.read_text()) == {"first": {"ms": 1.5}}
    sections.run("broken", lambda: 1 / 0)
    sections.run("after", lambda: 3)
    saved = json.loads(path.read_text())
    assert saved["first"] == {"ms": 1.5} and saved["after"] == 3 and "broken" not in saved
    assert saved["errors"]["broken"][-1] == "ZeroDivisionError: division by zero"
    late = gpu.Sections(str(path), 5.0, time.perf_counter() - 6.0)
    late.run("too_late", lambda: 1)
    assert json.loads(path.read_text()) == {"skipped": ["too_late"]}


def test_the_step_profile_runs_on_the_cpu(tmp_path):
    """benchmarks/profile_step.py on the tiny model: every region's wall time, the torch operators'
    share of it and their top host-time rows; no kernels or host waits on a CPU."""
    bench = _benchmark("profile_step")
    out = tmp_path / "profile.json"
    args = ["--device", "cpu", "--model", "tiny", "--dtype", "auto", "--repeats", "2", "--rows", "3"]
    assert bench.main([*args, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report) == {"decode_eager", "follow_up", "open", "hf_decode"}
    for name, region in report.items():
        assert region["wall_ms"] > 0 and region["torch_host_ms"] > 0, name
        assert region["kernel_launches"] == 0 and region["host_waits"] == {} and len(region["top_host_ms"]) == 3
