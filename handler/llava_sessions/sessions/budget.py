"""The device budget's arithmetic on a GPU, in plain integers (no torch): what the CUDA graphs keep
beside the sessions, and the KV pool's page count rounded to a few sizes.

**Graph memory.** A GPU's engine captures its passes as CUDA graphs at start (decode steps, prefill
chunks, the vision tower); each graph kind's memory pool keeps its largest pass's activations and
every graph's output for as long as the graphs live. That memory is not the sessions': the budget is
``device_budget_fraction`` of what is free at start *less* :func:`graph_reserve_bytes`, so the fixed KV
pool leaves room for the captures. Until the captures' memory is measured per graph kind on a GPU
(``benchmarks/gpu.py`` records ``peak_gpu_bytes``), :func:`graph_reserve_bytes` is an estimate from the
model's shapes; ``llava-deploy``'s plan counts the same figure.

**The pool's size.** FlexAttention over the pool is compiled at static shapes that include the pool's
page count, and a model folder ships its compile cache (docs/decisions/63-a-model-folder-ships-its-compile-cache.md):
a pool sized to the byte to each start's free memory never meets the cached kernels again.
:func:`ladder_pages` rounds the page count down to one of 16 sizes per power of two (at most 1/17 of the
pages lost), so the starts of one model on one GPU type land on the same count, and the same kernels.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["GraphShapes", "graph_reserve_bytes", "ladder_pages"]

#: Sizes per power of two that :func:`ladder_pages` keeps (16 to 31 times a power of two).
LADDER_STEPS = 16

#: What the engine captures, as ``engine/model_runner.py`` and ``model/gpu/graphs.py`` /
#: ``model/gpu/prefill_graphs.py`` set them (kept equal by a test): the largest decode batch captured, the
#: largest batch bucket read gathered on a GPU (below ``FLEX_MIN_ROWS``), the largest prefill chunk and
#: the longest attended length a prefill graph holds, tokens.
MAX_GRAPH_ROWS = 64
MAX_GATHERED_ROWS = 4
MAX_PREFILL_CHUNK = 1024
MAX_PREFILL_LENGTH = 2048

#: Bytes of a logit (the graphs' outputs are float32).
LOGIT_BYTES = 4


def ladder_pages(num_pages: int) -> int:
    """The largest page count at or below ``num_pages`` of the form ``m x 2**e`` with ``m`` in 16..31
    (below 16 pages, ``num_pages`` itself): at most 1/17 fewer pages, and one count for every start
    whose free memory differs by less than a step (a step is 1/16 to 1/32 of the count)."""
    if num_pages < LADDER_STEPS:
        return max(0, num_pages)
    shift = num_pages.bit_length() - LADDER_STEPS.bit_length()
    return (num_pages >> shift) << shift


@dataclass(frozen=True)
class GraphShapes:
    """The shapes of a checkpoint that size its CUDA graphs' memory (:func:`graph_reserve_bytes`).

    Attributes:
        hidden, intermediate, layers, heads, kv_heads, vocab, max_positions: the language model's
            (``text_config``).
        vision_tokens: positions of one tile through the vision tower (its patches, and CLS).
        vision_hidden, vision_layers: the vision tower's width and depth.
        tile_counts: the tile counts an image may have (LLaVA-NeXT, OneVision; ``(1,)`` for llava-1.5).
        tile_rows: feature rows one tile gives the language model (after the projector).
    """

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    max_positions: int
    vision_tokens: int
    vision_hidden: int
    vision_layers: int
    tile_counts: tuple[int, ...]
    tile_rows: int

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> GraphShapes:
        """From a checkpoint's ``config.json`` (a dict; transformers' defaults for llava-1.5-7b where a
        field is missing)."""
        text = config.get("text_config") or {}
        vision = config.get("vision_config") or {}
        hidden = int(text.get("hidden_size", 4096))
        heads = int(text.get("num_attention_heads", 32))
        size, patch = int(vision.get("image_size", 336)), int(vision.get("patch_size", 14))
        patches = (size // patch) ** 2
        grids = config.get("image_grid_pinpoints") or []
        counts = sorted({1, *((int(h) // size) * (int(w) // size) + 1 for h, w in grids)})
        return cls(
            hidden=hidden,
            intermediate=int(text.get("intermediate_size", 11008)),
            layers=int(text.get("num_hidden_layers", 32)),
            heads=heads,
            kv_heads=int(text.get("num_key_value_heads", heads)),
            vocab=int(text.get("vocab_size", 32064)),
            max_positions=int(text.get("max_position_embeddings", 4096)),
            vision_tokens=patches + 1,
            vision_hidden=int(vision.get("hidden_size", 1024)),
            vision_layers=int(vision.get("num_hidden_layers", 24)),
            tile_counts=tuple(counts),
            tile_rows=patches,
        )


def graph_reserve_bytes(shapes: GraphShapes, dtype_bytes: int, *, max_rows: int = MAX_GRAPH_ROWS) -> int:
    """An estimate of the device memory a GPU's CUDA graphs keep, bytes (module docstring).

    The decode and prefill graphs share one memory pool: it keeps the larger of their largest passes'
    activations and every graph's output. The vision tower's graphs keep a pool of their own. Each term:

    - a gathered decode step (``MAX_GATHERED_ROWS`` rows at ``max_positions``): one layer's keys and
      values gathered, ``2 x rows x kv_heads x head_dim x max_positions``, plus its rows' MLP;
    - a prefill chunk (``MAX_PREFILL_CHUNK`` tokens attending to ``MAX_PREFILL_LENGTH``): its hidden
      states and MLP (``chunk x (4 x hidden + 3 x intermediate)``), one layer's gathered keys and
      values, and the attention scores should SDPA materialise them (``heads x chunk x length``);
    - the outputs: each decode bucket's float32 logits (``rows x vocab``; four lengths per doubling from
      512 positions per gathered batch size, one per FlexAttention batch size) and each prefill bucket's last row;
    - the vision tower: the largest tile count's every hidden state (``output_hidden_states``:
      ``tiles x vision_tokens x vision_hidden x (vision_layers + 1)``), plus every tile count's features.

    Args:
        shapes: the checkpoint's (:class:`GraphShapes`).
        dtype_bytes: bytes of one value of the model's dtype (2 for bf16 / fp16).
        max_rows: the largest decode batch captured.

    Returns:
        Bytes; an estimate within the budget's other headroom (``1 - device_budget_fraction`` of what
        is free), not a measurement.
    """
    head_dim = shapes.hidden // shapes.heads
    gathered = min(MAX_GATHERED_ROWS, max_rows)
    decode_peak = (
        2 * gathered * shapes.kv_heads * head_dim * shapes.max_positions
        + max_rows * (4 * shapes.hidden + 3 * shapes.intermediate)
    ) * dtype_bytes
    chunk, length = MAX_PREFILL_CHUNK, min(MAX_PREFILL_LENGTH, shapes.max_positions)
    prefill_peak = (
        chunk * (4 * shapes.hidden + 3 * shapes.intermediate)
        + 2 * shapes.kv_heads * head_dim * length
        + shapes.heads * chunk * length
    ) * dtype_bytes
    num_lengths = 4 * max(0, (shapes.max_positions // 512).bit_length() - 1) + 1  # 4 per doubling from 512
    small = [b for b in (1, 2, 4) if b <= gathered]
    large = [b for b in (8, *range(16, max_rows + 1, 16)) if b <= max_rows]
    decode_outputs = (sum(small) * num_lengths + sum(large)) * shapes.vocab * LOGIT_BYTES
    prefill_outputs = 64 * shapes.vocab * LOGIT_BYTES  # about 47 buckets of one row each
    top = max(shapes.tile_counts)
    vision_peak = top * shapes.vision_tokens * shapes.vision_hidden * (shapes.vision_layers + 1) * dtype_bytes
    vision_outputs = sum(shapes.tile_counts) * shapes.tile_rows * shapes.hidden * dtype_bytes
    return max(decode_peak, prefill_peak) + decode_outputs + prefill_outputs + vision_peak + vision_outputs
