"""Fused projections: each text layer's q/k/v in one GEMM, and its gate/up in one.

A decoder layer of the LLaVA family's text models (Llama, Mistral, Qwen2 in transformers) projects its
input three times for attention (``q_proj``, ``k_proj``, ``v_proj``, each an ``nn.Linear``) and twice for
its MLP (``gate_proj``, ``up_proj``), always in that order and on the same tensor. :func:`fuse_projections`
concatenates each group's weights (and biases: Qwen2's q/k/v have them) into one tensor, freeing the
originals, so the memory is the same. The first module of a group (:class:`FusedLinear`) runs one
``F.linear`` over the fused weight, returns its own slice and keeps the others for the group's next modules
(:class:`FusedPart`). Those answer from it when called on the same input tensor, and otherwise from
their own slice of the weight. Every engine path, and transformers' own ``generate`` on the same model,
runs through them unchanged. vLLM (``QKVParallelLinear``, ``MergedColumnParallelLinear``), SGLang and
gpt-fast fuse the same groups, for the same reason: one GEMM reads the group's weights in one pass, and a
decode step launches three kernels fewer per layer.

A tensor-parallel replica keeps its projections apart: transformers shards each of them by its own plan.

Off by default: on a CPU a decode step was no faster fused (the split outputs are strided views, and
the CPU's GEMMs gain nothing from one call; decision 60), and on a
GPU CUDA graphs already remove the launches; ``benchmarks/gpu.py`` measures it on the GPU (its
``fused_projections`` section) before an engine turns it on (decision 60).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..packed_linears import unpack_linears

__all__ = ["FusedLinear", "FusedPart", "fuse_projections", "unfuse_projections"]

#: The groups fused in each decoder layer: (the submodule, its projections in the order the layer calls them).
GROUPS = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj")))


class FusedLinear(nn.Module):
    """The first projection of a fused group: one ``F.linear`` over the group's weights.

    Args:
        linears: the group's ``nn.Linear`` modules in call order (same input size, dtype and device; all
            with a bias or none). Their weights are copied into :attr:`weight` ``[sum(out), in]``; the
            caller drops the originals.

    Attributes:
        weight: ``[sum of out_features, in_features]``; bias: ``[sum of out_features]`` or None.
        sizes: each projection's ``out_features``.
    """

    def __init__(self, linears: list[nn.Linear]) -> None:
        super().__init__()
        self.sizes = [lin.out_features for lin in linears]
        self.in_features = linears[0].in_features
        self.weight = nn.Parameter(torch.cat([lin.weight.detach() for lin in linears]), requires_grad=False)
        biases = [lin.bias for lin in linears]
        fused_bias = None if biases[0] is None else torch.cat([b.detach() for b in biases if b is not None])
        self.bias = None if fused_bias is None else nn.Parameter(fused_bias, requires_grad=False)
        self._input: torch.Tensor | None = None
        self._rest: list[torch.Tensor | None] = []

    def part(self, index: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Projection ``index``'s weight ``[out, in]`` and bias ``[out]`` (or None): views of the fused ones."""
        start = sum(self.sizes[:index])
        stop = start + self.sizes[index]
        return self.weight[start:stop], None if self.bias is None else self.bias[start:stop]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., in]`` through every projection of the group at once; returns the first's ``[..., out0]``
        and keeps the others for :class:`FusedPart` (released as they are taken)."""
        first, *rest = F.linear(x, self.weight, self.bias).split(self.sizes, dim=-1)
        self._input, self._rest = x, list(rest)
        return first

    def take(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Projection ``index`` (1 or more) of ``x``: the kept output when the group's first projection ran on
        this very tensor, else computed from the projection's own slice of the weight."""
        kept = self._rest[index - 1] if x is self._input else None
        if kept is not None:
            self._rest[index - 1] = None  # each kept output is taken once
            if all(r is None for r in self._rest):
                self._input, self._rest = None, []
            return kept
        weight, bias = self.part(index)
        return F.linear(x, weight, bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, sizes={self.sizes}, bias={self.bias is not None}"


class FusedPart(nn.Module):
    """A later projection of a fused group (``k_proj``, ``v_proj``, ``up_proj``): answers from its
    :class:`FusedLinear`. Holds no parameters of its own (the group's first module holds them).

    Args:
        head: the group's :class:`FusedLinear`; index: this projection's place in the group (1 or more).
    """

    def __init__(self, head: FusedLinear, index: int) -> None:
        super().__init__()
        self._head = [head]  # a list: not registered as a submodule (the parameters stay counted once)
        self.index = index
        self.out_features = head.sizes[index]
        self.in_features = head.in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., in]`` -> ``[..., out]``: :meth:`FusedLinear.take`."""
        return self._head[0].take(self.index, x)


def _fusable(linears: list[Any]) -> bool:
    if not all(type(lin) is nn.Linear for lin in linears):
        return False
    first = linears[0]
    return all(
        lin.in_features == first.in_features
        and lin.weight.dtype == first.weight.dtype
        and lin.weight.device == first.weight.device
        and (lin.bias is None) == (first.bias is None)
        for lin in linears
    )


def fuse_projections(text_model: nn.Module) -> int:
    """Fuse q/k/v and gate/up in every decoder layer of ``text_model`` (its ``layers``) in place; a group
    whose modules are not plain ``nn.Linear`` alike (another family's, an already fused one) is left as it is.
    A CPU model's packed linears are turned plain first (:func:`~..packed_linears.unpack_linears`).

    Returns:
        The groups fused.
    """
    unpack_linears(text_model)
    fused = 0
    for layer in getattr(text_model, "layers", ()):
        for owner_name, names in GROUPS:
            owner = getattr(layer, owner_name, None)
            linears = [getattr(owner, name, None) for name in names]
            if owner is None or not _fusable(linears):
                continue
            with torch.no_grad():
                head = FusedLinear([lin for lin in linears if isinstance(lin, nn.Linear)])
            setattr(owner, names[0], head)
            for index, name in enumerate(names[1:], start=1):
                setattr(owner, name, FusedPart(head, index))
            fused += 1
    return fused


def unfuse_projections(text_model: nn.Module) -> int:
    """Undo :func:`fuse_projections`: each fused group's projections become ``nn.Linear`` modules again,
    their weights and biases views of the fused tensors (no copy). Returns the groups undone."""
    undone = 0
    for layer in getattr(text_model, "layers", ()):
        for owner_name, names in GROUPS:
            owner = getattr(layer, owner_name, None)
            head = getattr(owner, names[0], None)
            if not isinstance(head, FusedLinear):
                continue
            for index, name in enumerate(names):
                weight, bias = head.part(index)
                linear = nn.Linear(head.in_features, head.sizes[index], bias=bias is not None, device="meta")
                linear.weight = nn.Parameter(weight, requires_grad=False)
                if bias is not None:
                    linear.bias = nn.Parameter(bias, requires_grad=False)
                setattr(owner, name, linear)
            undone += 1
    return undone
