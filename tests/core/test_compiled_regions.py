"""Compiled regions (``model/gpu/regions.py``, issue 59 item 1): each text layer's norms and MLP through
Inductor (C++ kernels on the CPU), attention eager: the engine's greedy answers through the static decode
step (what a GPU captures as CUDA graphs, eager here) equal the same model's eager ones, and the compiled
calls come off again.

fp32 on the CPU, the ``tiny`` checkpoint, loaded afresh (the shared ``llava`` fixture stays eager)."""

from __future__ import annotations

import pytest
import torch

from engine_fixtures import LAYOUTS
from llava_sessions.config import Settings
from llava_sessions.model import LlavaModel
from llava_sessions.model.gpu.projections import FusedLinear
from llava_sessions.model.gpu.regions import compile_regions, compiles, uncompile_layers, uncompile_regions
from llava_sessions.worker import build_engine
from test_projections import answers


def test_compiled_norms_and_mlps_answer_as_eager_and_come_off_again(tiny_model_dir, photos):
    llava = LlavaModel.from_pretrained(tiny_model_dir, device="cpu", dtype="float32")
    text = llava.model.model.language_model
    expected, _ = answers(llava, photos, **LAYOUTS["static"])
    assert compile_regions(text) == 3 * len(text.layers) + 1
    torch._dynamo.utils.counters.clear()
    got, eng = answers(llava, photos, **LAYOUTS["static"])
    assert got == expected and eng.runner.graphs is not None and eng.runner.graphs.steps.num_eager > 0
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # really compiled
    assert uncompile_regions(text) == 3 * len(text.layers) + 1
    assert all(layer.mlp._compiled_call_impl is None for layer in text.layers)
    assert uncompile_regions(text) == 0


@pytest.mark.parametrize(
    ("setting", "device", "ranks", "expected"),
    [("auto", "cuda", 1, True), ("auto", "cpu", 1, False), ("on", "cpu", 1, True), ("off", "cuda", 1, False),
     ("auto", "cuda", 2, False), ("on", "cpu", 2, False)],
)  # fmt: skip
def test_the_compile_setting_compiles_on_a_gpu_and_never_a_tensor_parallel_replica(setting, device, ranks, expected):
    assert compiles(setting, torch.device(device), ranks) is expected


def test_an_engine_built_with_compile_on_fuses_and_compiles_its_text_layers_before_its_step_and_auto_leaves_a_cpu_eager(
    tiny_model_dir,
):
    """``build_engine`` under ``compile: on`` fuses q/k/v and gate/up and compiles each layer's norms and
    MLP before the engine (and its static step) exists; ``auto`` on a CPU leaves the model as loaded."""
    budget = {"device": "cpu", "device_budget_bytes": 10**9}
    llava = LlavaModel.from_pretrained(tiny_model_dir, device="cpu", dtype="float32")
    text = llava.model.model.language_model
    build_engine(Settings(**budget), llava)
    assert (
        not isinstance(text.layers[0].self_attn.q_proj, FusedLinear) and text.layers[0].mlp._compiled_call_impl is None
    )
    torch._dynamo.utils.counters.clear()
    build_engine(Settings(compile="on", **budget), llava)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # compiled at the start, not by a request
    for layer in text.layers:
        assert isinstance(layer.self_attn.q_proj, FusedLinear) and isinstance(layer.mlp.gate_proj, FusedLinear)
        assert layer.mlp._compiled_call_impl is not None and layer.input_layernorm._compiled_call_impl is not None
    assert uncompile_layers(text) == {"fused": 2 * len(text.layers), "compiled": 3 * len(text.layers) + 1}


def test_layers_that_fail_to_compile_run_as_loaded_and_a_warning_says_why(tiny_model_dir, photos, caplog):
    """A compiler failure at the start (a container without the C compiler Triton needs, here a forced
    error in the warm-up pass) leaves the text layers as loaded, with a warning, and the engine answers as
    the model does."""
    llava = LlavaModel.from_pretrained(tiny_model_dir, device="cpu", dtype="float32")
    text = llava.model.model.language_model
    expected, _ = answers(llava, photos, **LAYOUTS["static"])
    prefill = llava.prefill

    def fails_once(*args, **kwargs):
        llava.prefill = prefill
        raise RuntimeError("Failed to find C compiler")

    llava.prefill = fails_once
    with caplog.at_level("WARNING", logger="llava_sessions.worker"):
        build_engine(Settings(compile="on", device="cpu", device_budget_bytes=10**9), llava)
    assert "compiling the text layers failed" in caplog.text
    assert (
        not isinstance(text.layers[0].self_attn.q_proj, FusedLinear) and text.layers[0].mlp._compiled_call_impl is None
    )
    assert answers(llava, photos, **LAYOUTS["static"])[0] == expected
