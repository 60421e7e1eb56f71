"""Compiled regions (``model/regions.py``, issue 59 item 1): each text layer's norms and MLP through
Inductor (C++ kernels on the CPU), attention eager: the engine's greedy answers through the static decode
step (what a card captures as CUDA graphs, eager here) equal the same model's eager ones, and the compiled
calls come off again.

fp32 on the CPU, the ``tiny`` checkpoint, loaded afresh (the shared ``llava`` fixture stays eager)."""

from __future__ import annotations

import torch

from engine_fixtures import LAYOUTS
from llava_sessions.model import LlavaModel
from llava_sessions.model.regions import compile_regions, uncompile_regions
from test_projections import answers


def test_compiled_norms_and_mlps_answer_as_eager_and_come_off_again(tiny_model_dir, photos):
    llava = LlavaModel.from_pretrained(tiny_model_dir, device="cpu", dtype="float32")
    text = llava.model.model.language_model
    expected, _ = answers(llava, photos, **LAYOUTS["static"])
    assert compile_regions(text) == 3 * len(text.layers) + 1
    torch._dynamo.utils.counters.clear()
    got, eng = answers(llava, photos, **LAYOUTS["static"])
    assert got == expected and eng.runner.graphs is not None and eng.runner.graphs.num_eager > 0
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # really compiled
    assert uncompile_regions(text) == 3 * len(text.layers) + 1
    assert all(layer.mlp._compiled_call_impl is None for layer in text.layers)
    assert uncompile_regions(text) == 0
