"""Fused projections (``model/gpu/projections.py``, issue 59 item 1): q/k/v and gate/up in one GEMM each, the
memory unchanged, the engine's greedy answers equal to the same model's apart, and undone exactly.

fp32 on the CPU, the ``tiny`` checkpoint, loaded afresh (the shared ``llava`` fixture stays apart)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine_fixtures import make_engine
from llava_sessions.engine import SessionEngine
from llava_sessions.model import LlavaModel
from llava_sessions.model.gpu.projections import FusedLinear, FusedPart, fuse_projections, unfuse_projections
from llava_sessions.model.packed_linears import unpack_linears
from llava_sessions.sampling.sampler import SamplingParams

QUESTIONS = {"a": ("astronaut", "What is in this image?"), "b": ("coffee", "Describe the saucer."),
             "c": ("rocket", "What is it?")}  # fmt: skip


def _text(llava: LlavaModel) -> nn.Module:
    return llava.model.model.language_model


def answers(llava: LlavaModel, photos, **engine_kw: Any) -> tuple[dict[str, list[int]], SessionEngine]:
    """Three sessions' greedy answers decoded together (the batched step) in an engine of ``engine_kw``:
    token ids, and the engine."""
    eng = make_engine(llava, **engine_kw)
    gens = {}
    for sid, (photo, question) in QUESTIONS.items():
        eng.open(sid, photos[photo])
        gens[sid] = eng.start(sid, question, SamplingParams(max_new_tokens=12), remember=False)
    while not all(g.done for g in gens.values()):
        eng.step([g for g in gens.values() if not g.done])
    return {sid: [t.id for t in g.answer.tokens] for sid, g in gens.items()}, eng


def test_fused_projections_keep_the_memory_and_the_greedy_answers_and_undo_exactly(tiny_model_dir, photos):
    """Every layer's two groups fused: as many parameters as before (the parts hold none of their own), the
    same prefill logits within fp32 rounding, the same batched greedy answers; undone, the projections are
    plain ``nn.Linear`` views again and the logits the original's bit for bit. (The loaded model's linears
    are packed; fusing turns them plain first, so the original here is the plain one.)"""
    llava = LlavaModel.from_pretrained(tiny_model_dir, device="cpu", dtype="float32")
    assert unpack_linears(llava.model) == llava.packed_linears > 0
    layers = len(_text(llava).layers)
    ids = llava.tokenizer("USER: describe the picture in detail, please. ASSISTANT:")["input_ids"]
    params = sum(p.numel() for p in llava.model.parameters())
    with torch.inference_mode():
        before = llava.prefill(llava.new_cache(), ids, None)
    expected, _ = answers(llava, photos)

    assert fuse_projections(_text(llava)) == 2 * layers
    assert fuse_projections(_text(llava)) == 0  # already fused: left as it is
    attn, mlp = _text(llava).layers[0].self_attn, _text(llava).layers[0].mlp
    assert isinstance(attn.q_proj, FusedLinear) and isinstance(attn.v_proj, FusedPart)
    assert isinstance(mlp.gate_proj, FusedLinear) and isinstance(mlp.up_proj, FusedPart)
    assert sum(p.numel() for p in llava.model.parameters()) == params
    with torch.inference_mode():
        fused = llava.prefill(llava.new_cache(), ids, None)
    assert (fused - before).abs().max().item() < 1e-4
    assert answers(llava, photos)[0] == expected

    assert unfuse_projections(_text(llava)) == 2 * layers
    assert type(attn.k_proj) is nn.Linear and type(mlp.up_proj) is nn.Linear
    assert attn.k_proj.weight.data_ptr() > attn.q_proj.weight.data_ptr()  # views into one tensor
    with torch.inference_mode():
        again = llava.prefill(llava.new_cache(), ids, None)
    assert torch.equal(again, before)


def test_a_later_projection_called_on_another_tensor_computes_its_own():
    """A part answers from the group's GEMM only for the tensor the group's first projection ran on; on any
    other it runs its own slice of the fused weight (and a kept output is handed out once)."""
    torch.manual_seed(0)
    q, k, v = (nn.Linear(8, n, bias=True) for n in (8, 4, 4))
    head = FusedLinear([q, k, v])
    k_part, v_part = FusedPart(head, 1), FusedPart(head, 2)
    x, y = torch.randn(2, 3, 8), torch.randn(2, 3, 8)
    with torch.no_grad():
        assert torch.allclose(head(x), q(x), atol=1e-6)
        assert torch.allclose(k_part(y), k(y), atol=1e-6)  # another input: computed, not the kept one
        assert torch.allclose(k_part(x), k(x), atol=1e-6) and torch.allclose(v_part(x), v(x), atol=1e-6)
        assert head._input is None  # both kept outputs taken: nothing held
        assert torch.allclose(v_part(x), v(x), atol=1e-6)  # taken already: computed again
