"""Compiled regions: each text layer's norms and MLP through Inductor, attention left eager (issue 59 item 1).

A decode step of a 7b-shaped llava-1.5 on an H200 spends about 2.7 ms in some 1,500 small kernels and
the gaps between them: RMSNorm alone is seven (a cast, a square, a mean, an add, an rsqrt, two multiplies)
twice a layer, and the MLP's SiLU and product two more. :func:`compile_regions` compiles each layer's
``input_layernorm``, ``post_attention_layernorm`` and ``mlp``, and the final ``norm``, with
``torch.compile`` (``nn.Module.compile``: Inductor, mode ``default``, shapes dynamic, so one compiled
graph serves every row count and the same code serves every layer). Inductor fuses each norm into one
kernel and the MLP's SiLU and product into one; the GEMMs stay cuBLAS calls. Attention (the pool write,
the page read, SDPA or FlexAttention) stays outside every compiled region, as in vLLM's piecewise
compilation, so nothing compiled depends on an attended length. The engine's CUDA graphs capture the
compiled kernels as they capture eager ones (SGLang's pattern: compile, then capture); ``reduce-overhead``
is never used, since it would capture graphs of its own.

Off by default: on the 2-core CPU a decode step of the bench model took 18.1 ms compiled against 15.4 ms
eager (each compiled call's guards cost more than the fused kernels save there), and the card's gain is
measured by ``benchmarks/gpu.py``'s ``compiled_regions`` section before an engine turns it on (decision 60).
:func:`uncompile_regions` takes the compiled calls off again.
"""

from __future__ import annotations

from torch import nn

__all__ = ["REGIONS", "compile_regions", "uncompile_regions"]

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
    (``nn.Module.compile(dynamic=True)``); each compiles on its first call. Returns the modules compiled."""
    regions = _regions(text_model)
    for module in regions:
        module.compile(dynamic=True)
    return len(regions)


def uncompile_regions(text_model: nn.Module) -> int:
    """Take the compiled calls of :func:`compile_regions` off ``text_model`` (eager again). Returns the
    modules changed."""
    regions = [m for m in _regions(text_model) if getattr(m, "_compiled_call_impl", None) is not None]
    for module in regions:
        module._compiled_call_impl = None
    return len(regions)
