"""Compiled regions (``model/regions.py``, issue 59 item 1): each text layer's norms and MLP through
Inductor (C++ kernels on the CPU), attention eager: the engine's greedy answers through the static decode
step (what a card captures as CUDA graphs, eager here) equal the same model's eager ones, and the compiled
calls come off again.

fp32 on the CPU, the ``tiny`` checkpoint, loaded afresh (the shared ``llava`` fixture stays eager)."""

from __future__ import annotations

import torch

from engine_fixtures import LAYOUTS, make_engine
from llava_sessions.model import LlavaModel
from llava_sessions.model.regions import compile_regions, uncompile_regions
from llava_sessions.sampling.sampler import SamplingParams

QUESTIONS = {"a": ("astronaut", "What is in this image?"), "b": ("coffee", "Describe the saucer."),
             "c": ("rocket", "What is it?")}  # fmt: skip


def _answers(llava: LlavaModel, photos) -> dict[str, list[int]]:
    """Three sessions' greedy answers decoded together through the static decode step, token ids."""
    eng = make_engine(llava, **LAYOUTS["static"])
    gens = {}
    for sid, (photo, question) in QUESTIONS.items():
        eng.open(sid, photos[photo])
        gens[sid] = eng.start(sid, question, SamplingParams(max_new_tokens=10), remember=False)
    while not all(g.done for g in gens.values()):
        eng.step([g for g in gens.values() if not g.done])
    assert eng.runner.graphs is not None and eng.runner.graphs.num_eager > 0
    return {sid: [t.id for t in g.answer.tokens] for sid, g in gens.items()}


def test_compiled_norms_and_mlps_answer_as_eager_and_come_off_again(tiny_model_dir, photos):
    llava = LlavaModel.from_pretrained(tiny_model_dir, device="cpu", dtype="float32")
    text = llava.model.model.language_model
    expected = _answers(llava, photos)
    assert compile_regions(text) == 3 * len(text.layers) + 1
    torch._dynamo.utils.counters.clear()
    assert _answers(llava, photos) == expected
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # really compiled
    assert uncompile_regions(text) == 3 * len(text.layers) + 1
    assert all(layer.mlp._compiled_call_impl is None for layer in text.layers)
    assert uncompile_regions(text) == 0
