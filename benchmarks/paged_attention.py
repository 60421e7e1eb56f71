"""Attention over KV pages: the kernels PyTorch ships, measured side by side on one device (issue 43
item 2, "choose the kernel per device by measurement").

One decode step's attention in one layer: ``rows`` queries ``[rows, heads, 1, head_dim]``, each over its
own ``length`` cached positions, which sit in pages of ``page_size`` positions scattered through a
pool laid out as the engine's (:class:`~llava_sessions.model.kv.paged.KVPages`: ``[pages, page_size,
kv_heads, head_dim]`` per layer). Each kernel's output is compared with the first's:

- ``contiguous``: SDPA over each row's keys and values already in one tensor ``[rows, kv_heads, length,
  head_dim]`` (what the contiguous decode batch reads; no pages, the yardstick);
- ``gather_sdpa``: the pool's slots gathered by page table, then SDPA with a bool mask bounding each
  row to its length (what the paged layout and the CUDA graphs run today; transformers' continuous
  batching reads pages the same way);
- ``flex_paged``: FlexAttention straight over the pool through the engine's own block mask
  (``model/flex_pages.py``'s ``PageBlocks``: one kv block per page, a row's whole pages full blocks,
  its partial last page bounded by the mask function; without the bound, the zero tail of a partial
  last page is attended to); compiled with
  ``torch.compile`` on a CUDA device (``compile_flex``), as its docs require for speed;
- ``varlen_paged``: ``torch.nn.attention.varlen.varlen_attn`` with ``block_table=`` and ``seqused_k=``
  (torch 2.12+, CUDA only); left out where the installed torch's signature lacks them;
- ``xformers_paged``: xformers' Triton split-K decode kernel (``fmha.triton_splitk.FwOp``) straight over
  the pool through a page table (``PagedBlockDiagonalPaddedKeysMask``; xformers 0.0.35, a 3.3 MB wheel
  that needs only torch and Triton). CUDA only, and only for pages of a multiple of its 64-position key
  blocks: run ``--page-size 64``. Its wheel does not fit the GPU check's carry beside Java (64.0 of
  67.1 MB), so it is measured in a device call of its own:
  ``pip download --no-deps xformers==0.0.35 -d .whl-kernels``, carry ``.whl-kernels``, then
  ``pip install --no-deps --target /tmp/site .whl-kernels/*.whl`` and
  ``PYTHONPATH=/tmp/site:handler python3 benchmarks/paged_attention.py --page-size 64 --rows 1,8,32,64``.

A kernel that raises is reported with its error, not measured. ``fastest`` names the fastest paged
kernel whose output is within ``tolerance`` of the yardstick. ``benchmarks/gpu.py`` prints this table
for the model's attention shape on the GPU; ``python benchmarks/paged_attention.py --device cpu`` runs
it here.
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F

from llava_sessions.model.kv.flex import PageBlocks
from llava_sessions.model.kv.paged import KVPages, page_slots
from llava_sessions.model.kv.pages import pages_for

#: The paged kernels, in the order they are tried (``contiguous`` is the yardstick, not a candidate).
PAGED_KERNELS = ("gather_sdpa", "flex_paged", "varlen_paged", "xformers_paged")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_ms(fn: Callable[[], torch.Tensor], device: torch.device, repeats: int) -> tuple[float, torch.Tensor]:
    """Median wall ms of ``fn`` over ``repeats`` calls (after two warm-up calls; the device
    synchronized around each), and its last output."""
    out = fn()
    out = fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        out = fn()
        _sync(device)
        times.append((time.perf_counter() - start) * 1000.0)
    return statistics.median(times), out


@dataclass(frozen=True)
class AttentionShape:
    """What one measurement attends: ``heads`` query heads over ``kv_heads`` key/value heads (``heads``
    a multiple of it) of ``head_dim``; ``rows`` in the decode batch, each over ``length`` cached
    positions (the step's new one included) in pages of ``page_size`` positions."""

    heads: int
    kv_heads: int
    head_dim: int
    rows: int
    length: int
    page_size: int


class PagedProblem:
    """One layer's decode-step attention over a page pool (module docstring).

    Args:
        device, dtype: where and in what the tensors live.
        shape: the heads, rows, lengths and page size.
        seed: the random contents' and the page order's seed.
    """

    def __init__(self, device: torch.device, dtype: torch.dtype, shape: AttentionShape, seed: int = 0) -> None:
        heads, kv_heads, head_dim = shape.heads, shape.kv_heads, shape.head_dim
        rows, length, page_size = shape.rows, shape.length, shape.page_size
        gen = torch.Generator().manual_seed(seed)
        self.device, self.heads, self.kv_heads, self.head_dim = device, heads, kv_heads, head_dim
        self.rows, self.length, self.page_size = rows, length, page_size
        self.row_pages = pages_for(length, page_size)
        self.num_pages = rows * self.row_pages + 1  # page 0 stays unused, as the scratch page does
        order = torch.randperm(self.num_pages - 1, generator=gen) + 1
        self.tables = order.view(rows, self.row_pages)  # [rows, row_pages] long, host
        # one layer of the engine's own pool, its pages filled with random keys and values
        self.pages = KVPages(1, self.num_pages, page_size, kv_heads, head_dim, dtype, device)
        self.keys, self.values = self.pages.keys[0], self.pages.values[0]
        with torch.inference_mode():  # the pool's tensors are inference tensors
            self.keys.copy_(torch.randn(self.keys.shape, generator=gen))
            self.values.copy_(torch.randn(self.values.shape, generator=gen))
        self.query = torch.randn(rows, heads, 1, head_dim, generator=gen).to(device, dtype)
        slots = page_slots(self.tables.tolist(), page_size)  # [rows, row_pages * page_size]
        self.slots = slots.to(device)
        positions = torch.arange(slots.shape[1], device=device)
        self.bound = (positions < length)[None, None, None, :].expand(rows, 1, 1, -1)  # [rows, 1, 1, L']

    def _gathered(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.pages.gather(0, self.slots)  # the engine's read: [rows, kv_heads, L', d] each

    def contiguous(self) -> Callable[[], torch.Tensor]:
        """SDPA over ``[rows, kv_heads, length, head_dim]`` tensors built before the clock."""
        k, v = (t[:, :, : self.length].contiguous() for t in self._gathered())
        gqa = self.heads != self.kv_heads
        return lambda: F.scaled_dot_product_attention(self.query, k, v, enable_gqa=gqa)

    def gather_sdpa(self) -> Callable[[], torch.Tensor]:
        """Gather by page table, then SDPA under the length bound (the engine's paged read)."""
        gqa = self.heads != self.kv_heads

        def run() -> torch.Tensor:
            k, v = self._gathered()
            return F.scaled_dot_product_attention(self.query, k, v, attn_mask=self.bound, enable_gqa=gqa)

        return run

    def flex_paged(self, compile_flex: bool) -> Callable[[], torch.Tensor]:
        """FlexAttention over the whole pool through the engine's block mask (``model/flex_pages.py``'s
        ``PageBlocks``: a row's whole pages full blocks, its partial last page the one bounded block)."""
        from torch.nn.attention.flex_attention import flex_attention

        blocks = PageBlocks(self.rows, self.num_pages, self.page_size, self.device)
        blocks.fill(self.tables.tolist(), [self.length] * self.rows)
        mask = blocks.mask(self.rows)
        flat = self.num_pages * self.page_size
        k = self.keys.view(1, flat, self.kv_heads, self.head_dim).transpose(1, 2)  # [1, kv_heads, slots, d]
        v = self.values.view(1, flat, self.kv_heads, self.head_dim).transpose(1, 2)
        attend = torch.compile(flex_attention, dynamic=False) if compile_flex else flex_attention
        gqa, rows = self.heads != self.kv_heads, self.rows
        return lambda: attend(
            self.query, k.expand(rows, -1, -1, -1), v.expand(rows, -1, -1, -1), block_mask=mask, enable_gqa=gqa
        )

    def varlen_paged(self) -> Callable[[], torch.Tensor]:
        """``varlen_attn`` with ``block_table`` and ``seqused_k`` (raises where torch lacks them)."""
        from torch.nn.attention import varlen

        if "block_table" not in inspect.signature(varlen.varlen_attn).parameters:
            raise NotImplementedError(f"torch {torch.__version__}'s varlen_attn takes no block_table")
        rows, device = self.rows, self.device
        query = self.query.squeeze(2)  # [rows, heads, d]: one query token per row
        cu_q = torch.arange(rows + 1, dtype=torch.int32, device=device)
        used = torch.full((rows,), self.length, dtype=torch.int32, device=device)
        table = self.tables.to(device=device, dtype=torch.int32)
        gqa = self.heads != self.kv_heads

        def run() -> torch.Tensor:
            out = varlen.varlen_attn(
                query,
                self.keys,
                self.values,
                cu_q,
                None,
                1,
                self.length,
                enable_gqa=gqa,
                seqused_k=used,
                block_table=table,
            )
            return out.unsqueeze(2)

        return run

    def xformers_paged(self) -> Callable[[], torch.Tensor]:
        """xformers' Triton split-K kernel over the pool through the page table (raises where xformers is
        not installed, off CUDA, or for a page size its kernel refuses). Its layout: the query
        ``[1, rows, kv_heads, heads per kv head, d]`` (one token per row), the pool's keys and values
        ``[1, slots, kv_heads, 1, d]`` expanded over each group's heads."""
        from xformers.ops import fmha
        from xformers.ops.fmha import triton_splitk
        from xformers.ops.fmha.attn_bias import PagedBlockDiagonalPaddedKeysMask

        rows, groups, d = self.rows, self.kv_heads, self.head_dim
        per_group, flat = self.heads // groups, self.num_pages * self.page_size
        query = self.query.reshape(rows, groups, per_group, d)[None]
        k, v = (t.view(1, flat, groups, 1, d).expand(1, flat, groups, per_group, d) for t in (self.keys, self.values))
        bias = PagedBlockDiagonalPaddedKeysMask.from_seqlens(
            [1] * rows,
            [self.length] * rows,
            self.tables.to(device=self.device, dtype=torch.int32),
            self.page_size,
            device=self.device,
        )

        def run() -> torch.Tensor:
            out = fmha.memory_efficient_attention_forward(query, k, v, attn_bias=bias, op=triton_splitk.FwOp)
            return out.reshape(rows, self.heads, d)[:, :, None]

        return run


def measure(
    device: str | torch.device,
    dtype: torch.dtype,
    shape: AttentionShape,
    *,
    repeats: int = 20,
    compile_flex: bool | None = None,
    tolerance: float | None = None,
    kernels: tuple[str, ...] = PAGED_KERNELS,
) -> dict[str, Any]:
    """Each kernel's median ms for one layer's decode-step attention, and its largest absolute
    difference from ``contiguous`` (the module docstring's list).

    Args:
        compile_flex: compile FlexAttention (default: on a CUDA device only; compiling on a CPU takes
            seconds per shape).
        tolerance: the largest difference a kernel may show and still be chosen (default 1e-4 in
            fp32, 2e-2 in 16-bit types).
        kernels: the paged kernels to run (``contiguous`` always runs first).

    Returns:
        ``{"shape": {...}, "kernels": {name: {"ms", "max_abs_diff"} or {"error"}}, "fastest": name or
        None}``: ``fastest`` is the quickest paged kernel within ``tolerance``.
    """
    device = torch.device(device)
    problem = PagedProblem(device, dtype, shape)
    compile_flex = device.type == "cuda" if compile_flex is None else compile_flex
    tolerance = (1e-4 if dtype == torch.float32 else 2e-2) if tolerance is None else tolerance
    builders: dict[str, Callable[[], Callable[[], torch.Tensor]]] = {
        "contiguous": problem.contiguous,
        "gather_sdpa": problem.gather_sdpa,
        "flex_paged": lambda: problem.flex_paged(compile_flex),
        "varlen_paged": problem.varlen_paged,
        "xformers_paged": problem.xformers_paged,
    }
    results: dict[str, dict[str, Any]] = {}
    reference: torch.Tensor | None = None
    with torch.inference_mode():
        for name, build in builders.items():
            if name != "contiguous" and name not in kernels:
                continue
            try:
                ms, out = _time_ms(build(), device, repeats)
            except Exception as exc:  # noqa: BLE001 - a kernel this device or torch lacks: reported, not run
                first_line = str(exc).splitlines()[0][:200] if str(exc) else ""
                results[name] = {"error": f"{type(exc).__name__}: {first_line}"}
                continue
            reference = out.float() if reference is None else reference
            results[name] = {"ms": round(ms, 4), "max_abs_diff": float((out.float() - reference).abs().max())}
    exact = [n for n in PAGED_KERNELS if "ms" in results.get(n, {}) and results[n]["max_abs_diff"] <= tolerance]
    described = {**asdict(shape), "dtype": str(dtype).removeprefix("torch."), "flex_compiled": compile_flex}
    return {"shape": described, "kernels": results, "fastest": min(exact, key=lambda n: results[n]["ms"], default=None)}


def describe(report: dict[str, Any]) -> str:
    """One line per kernel: ms and the difference, or the error; then the choice."""
    s = report["shape"]
    lines = [
        f"attention over pages, {s['rows']} rows x {s['length']} positions, {s['heads']}/{s['kv_heads']} heads "
        f"x {s['head_dim']}, pages of {s['page_size']}, {s['dtype']}:"
    ]
    for name, k in report["kernels"].items():
        if "error" in k:
            lines.append(f"  {name:<13} not run: {k['error']}")
        else:
            lines.append(f"  {name:<13} {k['ms']:9.3f} ms  max |diff| {k['max_abs_diff']:.2e}")
    lines.append(f"  fastest paged kernel within tolerance: {report['fastest']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rows", default="1,8,32", help="decode batch sizes, comma-separated")
    ap.add_argument("--length", type=int, default=600)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--compile-flex", choices=["auto", "on", "off"], default="auto")
    ap.add_argument("--kernels", default=",".join(PAGED_KERNELS), help="the paged kernels to run")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    compile_flex = None if args.compile_flex == "auto" else args.compile_flex == "on"
    reports = []
    for rows in (int(r) for r in args.rows.split(",")):
        shape = AttentionShape(args.heads, args.kv_heads, args.head_dim, rows, args.length, args.page_size)
        report = measure(
            args.device,
            getattr(torch, args.dtype),
            shape,
            repeats=args.repeats,
            compile_flex=compile_flex,
            kernels=tuple(args.kernels.split(",")),
        )
        print(describe(report), flush=True)
        reports.append(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(reports, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
