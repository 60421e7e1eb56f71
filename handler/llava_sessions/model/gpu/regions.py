"""Compiled regions: each text layer's norms and MLP through Inductor, attention left eager.

A decode step of a 7b-shaped llava-1.5 on a GPU spends a third of its time in some 1,500 small kernels
and the gaps between them: RMSNorm alone is seven (a cast, a square, a mean, an add, an rsqrt, two multiplies)
twice a layer, and the MLP's SiLU and product two more. :func:`compile_regions` compiles each layer's
``input_layernorm``, ``post_attention_layernorm`` and ``mlp``, and the final ``norm``, with
``torch.compile`` (``nn.Module.compile``: Inductor, mode ``default``, shapes dynamic, so one compiled
graph serves every row count and the same code serves every layer). Inductor fuses each norm into one
kernel and the MLP's SiLU and product into one; the GEMMs stay cuBLAS calls. Attention (the pool write,
the page read, SDPA or FlexAttention) stays outside every compiled region, as in vLLM's piecewise
compilation, so nothing compiled depends on an attended length. The engine's CUDA graphs capture the
compiled kernels as they capture eager ones (SGLang's pattern: compile, then capture); ``reduce-overhead``
is never used, since it would capture graphs of its own.

On a GPU the ``compile`` setting's ``auto`` turns this and the fused projections on (:func:`compile_layers`,
before the engine captures its graphs): on a GPU it made decode faster at every batch size (decision
62). On a CPU it stays off: a decode step was slower compiled than eager (each compiled call's guards
cost more than the fused kernels save there; decision 60). :func:`uncompile_regions` takes the compiled calls off again.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from ..packed_linears import unpack_linears
from .projections import fuse_projections, unfuse_projections

__all__ = [
    "REGIONS",
    "compile_layers",
    "compile_regions",
    "compiled_regions",
    "compiles",
    "uncompile_layers",
    "uncompile_regions",
]

#: The ``compile`` setting: ``auto`` compiles on a CUDA device, ``on`` everywhere, ``off`` nowhere.
CompileSetting = Literal["auto", "on", "off"]

#: The submodules of a decoder layer that are compiled (the LLaVA family's text models name them alike).
REGIONS = ("input_layernorm", "post_attention_layernorm", "mlp")


def _regions(text_model: nn.Module) -> list[nn.Module]:
    found = [
        getattr(layer, name) for layer in getattr(text_model, "layers", ()) for name in REGIONS if hasattr(layer, name)
    ]
    norm = getattr(text_model, "norm", None)
    return found + ([norm] if isinstance(norm, nn.Module) else [])


def compile_regions(text_model: nn.Module) -> int:
    """Compile each decoder layer's norms and MLP and the final norm of ``text_model`` in place
    (``nn.Module.compile(dynamic=True)``); each compiles on its first call, its linears plain again
    (:func:`~..packed_linears.unpack_linears`: Inductor does not lower a CPU's packed ones). Returns the
    modules compiled."""
    unpack_linears(text_model)
    regions = _regions(text_model)
    for module in regions:
        module.compile(dynamic=True)
    return len(regions)


def compiled_regions(text_model: nn.Module) -> list[nn.Module]:
    """The regions of ``text_model`` that run compiled now (:func:`compile_regions`, not yet taken off)."""
    return [m for m in _regions(text_model) if getattr(m, "_compiled_call_impl", None) is not None]


def uncompile_regions(text_model: nn.Module) -> int:
    """Take the compiled calls of :func:`compile_regions` off ``text_model`` (eager again). Returns the
    modules changed."""
    regions = compiled_regions(text_model)
    for module in regions:
        module._compiled_call_impl = None
    return len(regions)


def compiles(setting: CompileSetting, device: torch.device, ranks: int = 1) -> bool:
    """Whether a replica on ``device`` compiles its layers under the ``compile`` setting: ``on`` always,
    ``auto`` on a CUDA device, ``off`` never; a tensor-parallel replica (``ranks`` > 1: its ranks run the
    same passes on their shards) never."""
    if ranks > 1 or setting == "off":
        return False
    return setting == "on" or device.type == "cuda"


def compile_layers(text_model: nn.Module) -> dict[str, int]:
    """Fuse ``text_model``'s projections (:func:`~.projections.fuse_projections`), then compile its
    regions (:func:`compile_regions`), in place. Call it before the engine captures its CUDA graphs: the
    graphs then replay the compiled kernels. Returns ``{"fused": groups, "compiled": modules}``."""
    fused = fuse_projections(text_model)
    return {"fused": fused, "compiled": compile_regions(text_model)}


def uncompile_layers(text_model: nn.Module) -> dict[str, int]:
    """Undo :func:`compile_layers`: ``text_model`` runs as loaded again (graphs captured over it must be
    captured again). Returns ``{"fused": groups undone, "compiled": modules changed}``."""
    compiled = uncompile_regions(text_model)
    return {"fused": unfuse_projections(text_model), "compiled": compiled}
