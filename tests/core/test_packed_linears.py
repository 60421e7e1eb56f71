"""A CPU model's linears over oneDNN-prepacked weights (``model/packed_linears.py``): the same outputs as
``F.linear`` within rounding, tied weights left plain, the plain weight recovered exactly, and a loaded
model packed (its greedy answers equal ``model.generate``'s: every exactness test runs packed)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from llava_sessions.model import LlavaModel
from llava_sessions.model.packed_linears import PackedLinear, pack_linears, packing_supported, unpack_linears

DTYPES = [d for d in (torch.float32, torch.bfloat16) if packing_supported(d)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_packed_linear_answers_as_f_linear_and_unpacks_to_the_weight_it_packed(dtype):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(96, 160), nn.ReLU(), nn.Linear(160, 40, bias=False)).to(dtype)
    weights = [net[0].weight.detach().clone(), net[2].weight.detach().clone()]
    x = torch.randn(3, 5, 96, dtype=dtype)  # a prefill's [batch, tokens, hidden] and a decode row below
    with torch.no_grad():
        expected, expected_row = net(x), net(x[:1, :1])
        assert pack_linears(net) == 2 and all(isinstance(net[k], PackedLinear) for k in (0, 2))
        got, got_row = net(x), net(x[:1, :1])
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert got.shape == expected.shape == (3, 5, 40) and got_row.shape == (1, 1, 40)
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol)
    torch.testing.assert_close(got_row, expected_row, rtol=tol, atol=tol)
    assert [name for name, _ in net.named_parameters()] == ["0.bias"]  # the plain weights dropped
    assert unpack_linears(net) == 2 and pack_linears(nn.Sequential()) == 0
    assert (
        type(net[0]) is nn.Linear and torch.equal(net[0].weight, weights[0]) and torch.equal(net[2].weight, weights[1])
    )
    assert net[2].bias is None


def test_a_weight_two_modules_share_and_a_dtype_oneDNN_does_not_pack_stay_plain():
    emb, head, f16 = nn.Embedding(50, 32), nn.Linear(32, 50, bias=False), nn.Linear(32, 8).half()
    head.weight = emb.weight  # tied, as a tie_word_embeddings model's LM head
    model = nn.ModuleDict({"emb": emb, "head": head, "f16": f16, "plain": nn.Linear(32, 8)})
    assert packing_supported(torch.float16) is False
    assert pack_linears(model) == 1 and isinstance(model["plain"], PackedLinear)
    assert type(model["head"]) is nn.Linear and model["head"].weight is emb.weight and type(model["f16"]) is nn.Linear


def test_a_cpu_model_loads_with_its_linears_packed(tiny_model_dir):
    llava = LlavaModel.from_pretrained(tiny_model_dir, device="cpu", dtype="float32")
    packed = [name for name, m in llava.model.named_modules() if isinstance(m, PackedLinear)]
    assert llava.packed_linears == len(packed) > 0
    assert any(name.endswith("lm_head") for name in packed) and any("vision_tower" in name for name in packed)
    assert not any(type(m) is nn.Linear for m in llava.model.modules())
    x = torch.randn(2, llava.model.lm_head.in_features)
    ref = F.linear(x, llava.model.lm_head.packed.to_dense())
    torch.testing.assert_close(llava.model.lm_head(x), ref, rtol=1e-5, atol=1e-5)
