"""A CPU model's linear layers over weights prepacked for oneDNN, the kernels PyTorch's CPU GEMMs call.

A decode step on a CPU reads every weight of the text model once (a batch-1 step of the bench model:
172 MB in fp32) and does little arithmetic with it, so how fast the GEMM streams its weight from memory
sets the step's time. ``F.linear`` hands oneDNN a plain row-major ``[out, in]`` weight, which it reorders
on the fly. :class:`PackedLinear` keeps the weight in oneDNN's own blocked layout instead, reordered once
at load (``torch.ops.mkldnn._reorder_linear_weight``), and runs ``torch.ops.mkldnn._linear_pointwise``
over it: the two operators PyTorch's own compiler uses for the same purpose (Inductor's CPU weight
prepacking under ``freezing``, ``torch/_inductor/fx_passes/mkldnn_fusion.py``). vLLM's CPU build does
the same with its own oneDNN binding. What it gained here: decision 76.

:func:`pack_linears` swaps every plain ``nn.Linear`` of a model for one, dropping the plain weight (the
memory stays the same), so transformers' own ``generate`` on the model runs the same kernels as every
engine pass. It is for a CPU model in float32 or bfloat16 (oneDNN's bf16 path needs AVX-512 BF16 or
AMX: ``torch.ops.mkldnn._is_mkldnn_bf16_supported``); a weight shared with another module (tied
embeddings) or of another dtype is left as it is. :func:`unpack_linears` turns them back into plain
``nn.Linear`` modules (the weight reordered back, equal to the one loaded), for what needs a plain weight
to work on: fused projections and compiled regions (:mod:`.gpu.projections`, :mod:`.gpu.regions`;
Inductor lowers these operators only over weights frozen as constants).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["PackedLinear", "pack_linears", "packing_supported", "unpack_linears"]


def packing_supported(dtype: torch.dtype) -> bool:
    """Whether this PyTorch build packs and runs linears of ``dtype`` on this CPU (oneDNN present;
    float32, or bfloat16 where the CPU has bf16 instructions)."""
    if not torch.backends.mkldnn.is_available():
        return False
    ops = torch.ops.mkldnn
    if not (hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")):
        return False
    if dtype == torch.bfloat16:
        return bool(ops._is_mkldnn_bf16_supported())
    return dtype == torch.float32


class PackedLinear(nn.Module):
    """``nn.Linear``'s forward over a weight prepacked for oneDNN.

    Args:
        linear: a plain ``nn.Linear`` on the CPU (weight ``[out, in]``, float32 or bfloat16).

    Attributes:
        in_features, out_features: as the linear's.
        packed: the weight in oneDNN's blocked layout (an opaque ``torch._mkldnn`` tensor of
            ``out × in`` elements; not in the state dict).
        bias: ``[out]`` or None, the linear's own parameter.
    """

    packed: torch.Tensor

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach())  # no batch-size hint
        self.register_buffer("packed", packed, persistent=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., in]`` -> ``[..., out]``, as ``F.linear(x, weight, bias)``."""
        rows = x.reshape(-1, self.in_features)
        out = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def _shared_weights(model: nn.Module) -> set[int]:
    """Storage addresses of weights more than one module holds (a tied LM head and embedding)."""
    seen: dict[int, int] = {}
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.device.type == "cpu" and not weight.is_mkldnn:
            seen[weight.data_ptr()] = seen.get(weight.data_ptr(), 0) + 1
    return {ptr for ptr, count in seen.items() if count > 1}


def pack_linears(model: Any) -> int:
    """Replace every plain ``nn.Linear`` of ``model`` (on the CPU, of a dtype :func:`packing_supported`
    accepts, its weight held by no other module) with a :class:`PackedLinear`, in place.

    Returns:
        The linears replaced (0 when this build or CPU does not pack).
    """
    shared = _shared_weights(model)
    replaced = 0
    for owner in list(model.modules()):
        for name, child in list(owner.named_children()):
            if type(child) is not nn.Linear:
                continue
            weight = child.weight
            if weight.device.type != "cpu" or weight.data_ptr() in shared or not packing_supported(weight.dtype):
                continue
            setattr(owner, name, PackedLinear(child))
            replaced += 1
    return replaced


def unpack_linears(model: nn.Module) -> int:
    """Turn every :class:`PackedLinear` of ``model`` back into a plain ``nn.Linear``, in place, its
    weight ``[out, in]`` reordered back from the packed layout (equal to the weight packed). Returns
    the linears turned back."""
    replaced = 0
    for owner in list(model.modules()):
        for name, child in list(owner.named_children()):
            if not isinstance(child, PackedLinear):
                continue
            linear = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None, device="meta")
            linear.weight = nn.Parameter(child.packed.to_dense(), requires_grad=False)
            if child.bias is not None:
                linear.bias = child.bias
            setattr(owner, name, linear)
            replaced += 1
    return replaced
