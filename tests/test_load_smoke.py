"""benchmarks/load.py stays runnable: a short run with a worker killed mid-way loses no session."""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


def test_load_run_with_a_killed_worker_recovers_every_session(tiny_model_dir):
    spec = importlib.util.spec_from_file_location("load", Path(__file__).parents[1] / "benchmarks" / "load.py")
    load = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(load)
    args = argparse.Namespace(
        model="tiny",
        model_dir=str(tiny_model_dir),
        users=3,
        duration_s=18,
        questions=3,
        think_s=0.3,
        max_new_tokens=6,
        kill_worker_at=7.0,
    )
    result = load.run(args)
    print(json.dumps(result))
    assert result["questions"] >= 6 and result["ttft_ms"]["p50"] is not None
    assert result["sessions_lost"] == 0, json.dumps(result)
    assert result["fault"]["server_restarts"] == 1
    assert result["peak_host_rss_bytes"] > 0
