"""``llava-compile-cache`` (issue 59 item 1): run as the user runs it, in processes of its own, each with
an Inductor cache folder of its own (``TORCHINDUCTOR_CACHE_DIR``), so nothing is found that this run did
not ship. The first run compiles the text layers and writes the model folder's compile cache; a second
start, in a fresh Inductor cache, finds every graph in that file and compiles none (it builds the worker
as a TorchServe worker does: ``build_local_service``); ``llava-deploy`` packages the file with the
checkpoint. fp32 on the CPU, ``compile: on`` (``auto`` leaves a CPU eager)."""

from __future__ import annotations

import json
import logging
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from llava_sessions.model.gpu.compile_cache import CACHE_FOLDER, compile_cache_file, load_compile_cache
from llava_tools.deploy.package import build_package
from test_docs import snippet

BUDGET = "device_budget_bytes=1000000000"


#: docs/deploy.md's command, as a user runs it.
COMMAND = "llava-compile-cache --model-dir /path/to/llava-1.5-7b-hf"


def run_tool(model_dir, inductor_dir, *args):
    """The docs' command on ``model_dir`` (the console script of this interpreter's environment)."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(inductor_dir)}
    program, *words = shlex.split(
        snippet("deploy.md", COMMAND).strip().replace("/path/to/llava-1.5-7b-hf", str(model_dir))
    )
    command = [str(Path(sys.executable).parent / program), *words, *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)


def test_the_cache_written_once_makes_a_fresh_start_find_every_graph_compiled(tiny_model_dir, tmp_path):
    model_dir = shutil.copytree(tiny_model_dir, tmp_path / "model")
    cold = run_tool(model_dir, tmp_path / "inductor-a", "--json", "--set", BUDGET)
    assert cold.returncode == 0, cold.stderr
    first = json.loads(cold.stdout)
    path = compile_cache_file(model_dir, torch.device("cpu"), torch.float32)
    assert first["path"] == str(path) and path.stat().st_size == first["size_bytes"] > 0
    assert first["cache_misses"] >= 2 and first["cache_hits"] == 0  # the norms' graph and the MLP's, compiled

    warm = run_tool(model_dir, tmp_path / "inductor-b", "--json", "--set", BUDGET)
    assert warm.returncode == 0, warm.stderr
    second = json.loads(warm.stdout)
    assert second["cache_hits"] == first["cache_misses"] and second["cache_misses"] == 0

    keys = [f.key for f in build_package(model_dir)]
    assert f"llava/{CACHE_FOLDER}/{path.name}" in keys  # the file travels with the checkpoint


def test_a_folder_that_is_no_checkpoint_exits_2_and_says_why(tmp_path):
    done = run_tool(tmp_path / "nothing", tmp_path / "inductor")
    assert done.returncode == 2 and "llava-compile-cache:" in done.stderr and not done.stdout


def test_a_cache_that_cannot_be_loaded_is_skipped_with_a_warning(tmp_path, caplog):
    """A damaged or foreign file never stops a worker: it compiles as without one, and a warning says so."""
    broken = tmp_path / CACHE_FOLDER / "torch-x-cpu-float32.bin"
    broken.parent.mkdir()
    broken.write_bytes(b"not a cache")
    with caplog.at_level(logging.WARNING, logger="llava_sessions.model.gpu.compile_cache"):
        assert load_compile_cache(broken) is False
    assert "could not be loaded" in caplog.text
    assert load_compile_cache(tmp_path / "absent.bin") is False


def test_a_config_that_is_no_model_config_exits_2_and_names_the_file(tmp_path):
    """``--config`` pointing at a YAML list, at text that is not YAML, or at a ``handler:`` that is not a
    mapping: exit 2, the file named, no traceback (model-config.yaml is read as ``llava-serve`` and
    ``llava-deploy`` read it)."""
    for name, text in (("list.yaml", "- a\n- b\n"), ("broken.yaml", "handler: [\n"), ("flat.yaml", "handler: 3\n")):
        config = tmp_path / name
        config.write_text(text)
        done = run_tool(tmp_path / "nothing", tmp_path / "inductor", "--config", str(config))
        assert done.returncode == 2 and str(config) in done.stderr and "Traceback" not in done.stderr, done.stderr
