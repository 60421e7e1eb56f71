"""The GPU table in one device call (``make bench-gpu``): our engine on the GPU against its own floor.

In process, without TorchServe (the device machine has no Java): the ``7b``-shaped random llava-1.5
(its exact architecture, built on the device in bf16: no 13 GB file to carry) driven through the
:class:`~llava_sessions.engine.SessionEngine` and its scheduler step, measured side by side in one run:

1. **Weight-read floor**: the model's weight bytes divided by the device's copy bandwidth measured
   here (a 1 GiB device-to-device copy reads and writes it: bandwidth = 2 x bytes / time). A decode
   step or a short follow-up must read every weight once, so no engine beats it at batch 1.
2. **Batch-1 decode**, ms per token, on a session whose context is about ``--context`` tokens (the
   image prefix and a question; the answer's own tokens on top), with the **host ms per step**: the
   step's wall time less its forward passes' span on the device (scheduling, sampling, bookkeeping,
   what a launch-bound step adds).
3. **Aggregate tokens/s** at ``--levels`` concurrent sessions (each asks for ``--new-tokens`` greedy
   tokens at once; decode only, their prefills before the clock), and the ratio to one session.
4. **Follow-up TTFT**: a ~30-token question on a stored session of ``--context`` tokens.
5. **A cold image turn**: open on a new image and the first token of its first question (decode,
   preprocess, vision tower, projector, prefill).
6. **The peer**: transformers' own fastest batch-1 path on the same GPU, ``generate`` with a static
   cache compiled (``cache_implementation="static"``; transformers compiles the decode step itself on
   a GPU with a static cache, as its docs describe), ms per token: the median gap between its generated
   tokens, read by a streamer inside the call, after a warm-up generate.

7. **CUDA graphs against eager** (when the engine's decode step has static shapes: on a GPU, or
   ``--cuda-graphs on``): the graphs captured and
   the seconds the capture took at start; one session's and three sessions' greedy answers (three
   rows run in the four-row bucket, one pad row) replayed, then the same static pass run eagerly
   (tokens identical: issue 43's replay equals eager on the same device), then eagerly at the rows'
   own shapes (in bf16 another attended length rounds otherwise: the first differing token is
   reported); ms per step each. llava-1.5's vision tower is captured with them: one image's encoding
   replayed against eager, ms each (``vision_graph``). So are the prefill graphs (``model/gpu/prefill_graphs.py``):
   a cold image turn with the open's prefill replayed, the same static pass eager, and at its own shape,
   ms each, and their capture's seconds (``prefill_graph``).
9. **Fused projections** (``model/gpu/projections.py``): batch-1 decode and the aggregate again in an engine
   over the same model with each layer's q/k/v and gate/up fused into one GEMM each, then apart again.
10. **Compiled regions** (``model/gpu/regions.py``): the same in an engine over the model with each layer's
    norms and MLP compiled by Inductor (attention eager), its start (compile + capture) in seconds.
11. **A step's greedy and sampled rows** (``benchmarks/greedy_rows.py``): picking 1, 8, 32 and 64 rows'
   tokens one by one against one argmax over the batch, drawing as many seeded sampled rows one by
   one against one warp and draw for all, and greedy rows with their tokens' logprobs one by one against
   one argmax and one ``log_softmax`` read together, ms per step each.
11b. **Preprocessing on the device** (``model/gpu/pixels.py``, llava-1.5 only): one image's pixel values by
    transformers' Pillow processor on the host against the same steps on the device, alone and within
    the whole ``encode_images``, ms each, and how far apart their values are (``pixels``).
12. **Async scheduling** (``benchmarks/async_steps.py``, when the engine has it: its static step on a
    GPU): whole answers of 1 and 32 sessions decoded with the engine's async scheduling off and on,
    alternating, the device synchronized only around each answer; tokens/s each and the ratio (every
    other section runs it on, synchronized after each step).
13. **Attention kernels over pages** (``benchmarks/paged_attention.py``, for the model's attention
   shape at ``--context`` positions and ``--kernel-rows`` rows): contiguous SDPA, the engine's gather
   then SDPA, FlexAttention over the pool (compiled on a GPU), ``varlen_attn`` with a block table
   where torch has it; ms per layer, the difference from SDPA, and the fastest exact paged kernel.

``--paged-attention gather|flex|auto`` sets how the engine's static decode step reads the pages
(default the engine's own: ``auto`` on a GPU, gathered below ``FLEX_MIN_ROWS`` rows and with
FlexAttention, ``model/flex_pages.py``, from there); on a GPU each other read is measured too, in an
engine of its own. Every ratio is to the floor measured in the same run. Each section is written to ``--json`` as it
ends; one that raises is recorded under ``errors`` and the rest still run; ``--deadline-s`` skips the
sections due after it (one device call returns all it measured). ``python benchmarks/gpu.py --device cpu --model
tiny`` runs the same code as a smoke test (the peer then runs eager: transformers compiles only on a
GPU). ``--json`` writes the table.

Usage:
    python benchmarks/gpu.py                                   # the 7b shape on cuda, bf16
    python benchmarks/gpu.py --device cpu --model tiny --levels 1,2 --new-tokens 8
"""

from __future__ import annotations

import argparse
import functools
import gc
import itertools
import json
import signal
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers.generation.streamers import BaseStreamer

import async_steps
import greedy_rows
from engine_decode import build_runner, first_differences, run_together, sync
from llava_sessions.config import Settings
from llava_sessions.conversation import Chat
from llava_sessions.engine import EngineLimits, SessionEngine
from llava_sessions.engine.model_runner import KV_PAGE_SIZE, new_prefill_graphs
from llava_sessions.images.fetch import decode_image
from llava_sessions.model import LlavaModel
from llava_sessions.model.gpu.graphs import PagedRead
from llava_sessions.model.gpu.regions import compile_layers, compiles, uncompile_layers
from llava_sessions.sampling.sampler import SamplingParams
from llava_sessions.sessions.budget import GraphShapes, graph_reserve_bytes
from llava_sessions.sessions.store import SessionStore
from llava_sessions.worker import compile_text_layers, session_budget
from llava_tools.demo.samples import sample_photo
from paged_attention import AttentionShape, describe, measure

PHOTOS = ("astronaut", "chelsea", "coffee", "rocket")
#: A follow-up question of about 30 tokens (llava-1.5's tokenizer).
FOLLOW_UP = "Looking again at the whole picture, which colours stand out most, and where in the frame are they placed?"
QUESTION = "Describe this image in great detail, please."
#: The ways of reading the pages compared beside the engine's own (``--compare-paged-read``).
OTHER_READS: dict[str, tuple[PagedRead, ...]] = {
    "auto": ("gather", "flex"),
    "gather": ("flex", "auto"),
    "flex": ("gather", "auto"),
    "none": (),
}


class ForwardClock:
    """The span of the model's forward passes on the device, per engine step: CUDA events around each
    ``model.forward`` and each CUDA graph replay (wall time on a CPU), summed until :meth:`take`."""

    def __init__(self, llava: LlavaModel) -> None:
        self.device = llava.device
        self.spans: list[tuple[Any, Any]] = []
        self.model = model = llava.model
        forward = model.forward

        @functools.wraps(forward)  # generate() reads the forward's signature
        def timed(*args: Any, **kwargs: Any) -> Any:
            start, end = self._mark(), None
            try:
                return forward(*args, **kwargs)
            finally:
                end = self._mark()
                self.spans.append((start, end))

        model.forward = timed
        self._replay = None
        if self.device.type == "cuda":  # a replayed decode graph is a forward pass too
            self._replay = replay = torch.cuda.CUDAGraph.replay

            def timed_replay(graph: Any) -> None:
                start = self._mark()
                replay(graph)
                self.spans.append((start, self._mark()))

            torch.cuda.CUDAGraph.replay = timed_replay  # type: ignore[method-assign]

    def close(self) -> None:
        """Stop timing: the model's own forward and graph replay again."""
        del self.model.forward
        if self._replay is not None:
            torch.cuda.CUDAGraph.replay = self._replay  # type: ignore[method-assign]

    def _mark(self) -> Any:
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def take(self) -> float:
        """Milliseconds of forward passes since the last call (the device synchronized first)."""
        sync(self.device)
        if self.device.type == "cuda":
            ms = sum(start.elapsed_time(end) for start, end in self.spans)
        else:
            ms = sum((end - start) * 1000.0 for start, end in self.spans)
        self.spans.clear()
        return ms


def weight_floor(llava: LlavaModel) -> dict[str, float]:
    """The weight-read floor: weight bytes / the device's measured copy bandwidth (median of 5 copies
    of the weights' size, at least 64 MiB and at most 1 GiB)."""
    device = llava.device
    weight_bytes = sum(p.numel() * p.element_size() for p in llava.model.parameters())
    size = max(64 << 20, min(1 << 30, weight_bytes))
    src = torch.empty(size, dtype=torch.uint8, device=device)
    src.fill_(1)
    dst = torch.empty_like(src)
    times = []
    for _ in range(6):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - t0)
    bandwidth = 2 * size / statistics.median(times[1:])  # a copy reads and writes every byte
    del src, dst
    return {
        "weight_bytes": weight_bytes,
        "copy_bandwidth_gb_s": round(bandwidth / 1e9, 1),
        "floor_ms": round(weight_bytes / bandwidth * 1000, 3),
    }


def open_with_context(engine: SessionEngine, sid: str, image: bytes, context: int) -> int:
    """Open ``sid`` on ``image`` and remember turns until its context holds about ``context`` tokens;
    returns the tokens it holds."""
    engine.open(sid, image)
    turn = 0
    while engine.store.ledger.entry(sid).num_kv_tokens + 40 < context and turn < 64:
        engine.generate(sid, f"Question {turn}: what else do you see?", SamplingParams(max_new_tokens=24))
        turn += 1
    return engine.store.ledger.entry(sid).num_kv_tokens


def batch_one_decode(engine: SessionEngine, clock: ForwardClock, image: bytes, context: int, new_tokens: int) -> dict:
    """ms per token of one answer's decode steps at about ``context`` tokens, and the host ms per step."""
    held = open_with_context(engine, "b1", image, context)
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    engine.generate("b1", QUESTION, SamplingParams(max_new_tokens=4), remember=False)  # warm
    gen = engine.start("b1", QUESTION, params, remember=False)
    while not gen.prefilled:  # the prefill before the clock
        engine.step([gen])
    clock.take()
    walls, hosts = [], []
    while not gen.done:
        s0 = time.perf_counter()
        engine.step([gen])
        sync(engine.model.device)
        wall = (time.perf_counter() - s0) * 1000
        walls.append(wall)
        hosts.append(wall - clock.take())
    engine.close("b1")
    return {
        "context_tokens": held,
        "ms_per_token": round(statistics.median(walls), 3),
        "host_ms_per_step": round(statistics.median(hosts), 3),
        "steps": len(walls),
    }


def aggregate(engine: SessionEngine, images: list[bytes], levels: list[int], new_tokens: int) -> dict:
    """Decode tokens/s with ``n`` sessions answering at once, per level, and the ratio to one."""
    sids = [f"agg{i}" for i in range(max(levels))]
    for i, sid in enumerate(sids):
        engine.open(sid, images[i % len(images)])
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    warm = [engine.start(sid, QUESTION, SamplingParams(max_new_tokens=4), remember=False) for sid in sids]
    run_together(engine, warm, None)
    rows = {}
    for n in levels:
        gens = [engine.start(sid, QUESTION, params, remember=False) for sid in sids[:n]]
        while not all(g.prefilled for g in gens):  # prefills before the clock: this measures decode
            engine.step([g for g in gens if not g.prefilled])
        wall, steps = run_together(engine, gens, None)
        tokens = sum(len(g.answer.tokens) - 1 for g in gens if g.answer is not None)
        rows[n] = {"tokens_per_s": tokens / wall, "step_ms": statistics.median(steps) if steps else 0.0}
    for sid in sids:
        engine.close(sid)
    one = rows[levels[0]]["tokens_per_s"] if levels[0] == 1 else None
    return {
        str(n): {
            "tokens_per_s": round(r["tokens_per_s"], 1),
            "vs_one": round(r["tokens_per_s"] / one, 2) if one else None,
            "step_ms": round(r["step_ms"], 3),
        }
        for n, r in rows.items()
    }


def first_token_ms(engine: SessionEngine, start: Callable[[], Any]) -> float:
    """ms from ``start()`` (a request admitted) to its first token, the device synchronized."""
    device = engine.model.device
    sync(device)
    t0 = time.perf_counter()
    work = start()
    if hasattr(work, "prefilled"):
        while not work.prefilled and not work.done:
            engine.step([work])
    sync(device)
    ms = (time.perf_counter() - t0) * 1000
    while not work.done:
        engine.step([work])
    return ms


def turns(engine: SessionEngine, images: list[bytes], context: int, repeats: int) -> dict:
    """Follow-up TTFT on a stored session of about ``context`` tokens, and a cold image turn (open on a
    never-seen image + its first question's first token), medians of ``repeats``."""
    held = open_with_context(engine, "fu", images[0], context)
    new = len(engine.model.template.conversation_ids(engine.store.get("fu").chat(), FOLLOW_UP)) - held
    params = SamplingParams(max_new_tokens=2)
    follow = [
        first_token_ms(engine, lambda: engine.start("fu", FOLLOW_UP, params, remember=False))
        for _ in range(repeats + 1)
    ][1:]
    engine.close("fu")
    cold = []
    for i in range(repeats + 1):
        image = _fresh(images[i % len(images)], i)  # never seen: no shared features or prefix
        sync(engine.model.device)
        t0 = time.perf_counter()
        engine.open(f"cold{i}", image)
        sync(engine.model.device)
        open_ms = (time.perf_counter() - t0) * 1000
        ttft = first_token_ms(engine, lambda i=i: engine.start(f"cold{i}", QUESTION, params, remember=False))
        cold.append(open_ms + ttft)
        engine.close(f"cold{i}")
    return {
        "follow_up": {"context_tokens": held, "new_tokens": new, "ttft_ms": round(statistics.median(follow), 3)},
        "cold_image_turn_ms": round(statistics.median(cold[1:]), 3),
    }


def vision_graph_rows(llava: LlavaModel, tower: Any, images: list[bytes], repeats: int) -> dict:
    """One image's ``encode_images`` (preprocessing, tower, projector) with llava-1.5's vision tower
    replayed as a CUDA graph (``tower``, the engine's runner's) and eagerly, ms each (medians of ``repeats`` after a warm-up), and the
    largest difference of their features."""
    import io

    from PIL import Image

    picture = Image.open(io.BytesIO(images[0])).convert("RGB")
    times, feats = {}, {}
    for name in ("replayed", "eager"):
        runs = []
        for _ in range(repeats + 1):
            sync(llava.device)
            t0 = time.perf_counter()
            feats[name] = llava.encode_images([picture], tower=tower if name == "replayed" else None)[0]
            sync(llava.device)
            runs.append((time.perf_counter() - t0) * 1000)
        times[name] = statistics.median(runs[1:])
    diff = float((feats["replayed"].float() - feats["eager"].float()).abs().max())
    return {"replayed_ms": round(times["replayed"], 3), "eager_ms": round(times["eager"], 3),
            "ratio": round(times["eager"] / times["replayed"], 2), "max_feature_difference": diff}  # fmt: skip


def prefill_graph_rows(engine: SessionEngine, images: list[bytes], repeats: int) -> dict:
    """A cold image turn (open on a never-seen image, then its question's first token) with the open's
    prefill replayed from a prefill graph, run as the same static pass eagerly, and run at its own
    shape (no prefill graphs), ms each (medians of ``repeats`` after a warm-up, the three alternating);
    and the seconds capturing the prefill graphs took (made anew here, replacing the engine's)."""
    runner = engine.runner
    sync(engine.model.device)
    t0 = time.perf_counter()
    prefills = new_prefill_graphs(engine.model, runner.pool, runner.graphs)
    capture_s = time.perf_counter() - t0
    assert prefills is not None
    runner.set_static(runner.graphs, prefills)  # an image chunk beside a decode step uses the same ones
    params = SamplingParams(max_new_tokens=1)
    modes = ("replayed", "static_eager", "own_shape")
    times: dict[str, list[float]] = {m: [] for m in modes}
    try:
        for i in range(repeats + 1):
            for k, mode in enumerate(modes):
                runner.set_static(runner.graphs, None if mode == "own_shape" else prefills)
                prefills.chunks.replay = mode == "replayed"
                sid = f"pg{i}-{k}"
                sync(engine.model.device)
                t0 = time.perf_counter()
                engine.open(sid, _fresh(images[i % len(images)], 3 * i + k + 101))  # never seen
                sync(engine.model.device)
                open_ms = (time.perf_counter() - t0) * 1000
                ttft = first_token_ms(engine, lambda sid=sid: engine.start(sid, QUESTION, params, remember=False))
                times[mode].append(open_ms + ttft)
                engine.close(sid)
    finally:
        runner.set_static(runner.graphs, prefills)
        prefills.chunks.replay = True
    out: dict[str, Any] = {f"{m}_ms": round(statistics.median(times[m][1:]), 3) for m in modes}
    graphed = {"graphs": prefills.chunks.num_graphs, "replays": prefills.chunks.num_replays}
    out.update({**graphed, "capture_s": round(capture_s, 2)})
    return out


def pixel_rows(llava: LlavaModel, images: list[bytes], repeats: int) -> dict | None:
    """llava-1.5's preprocessing on the host (transformers' Pillow processor) against on the device
    (``model/gpu/pixels.py``): one image's pixel values alone and its whole ``encode_images`` (with the
    tower as the engine runs it), ms each (medians of ``repeats`` after a warm-up, alternating), and the
    largest difference of their pixel values (8-bit levels) and features. None for a model whose
    processor tiles (nothing to move)."""
    import io

    from PIL import Image

    from llava_sessions.model.gpu.pixels import DevicePixels

    processor = llava.processor.image_processor
    pixels = DevicePixels.for_processor(processor, llava.device, llava.dtype)
    if pixels is None:
        return None
    picture = Image.open(io.BytesIO(images[0])).convert("RGB")
    ways: dict[str, Callable[[], Any]] = {
        "host_pixels": lambda: processor(images=[picture], return_tensors="pt")["pixel_values"].to(llava.device),
        "device_pixels": lambda: pixels([picture]),
        "host_encode": lambda: llava.encode_images([picture])[0],
        "device_encode": lambda: _with_pixels(llava, pixels, picture),
    }
    times: dict[str, list[float]] = {name: [] for name in ways}
    out: dict[str, Any] = {}
    for _ in range(repeats + 1):
        for name, way in ways.items():
            sync(llava.device)
            t0 = time.perf_counter()
            out[name] = way()
            sync(llava.device)
            times[name].append((time.perf_counter() - t0) * 1000)
    std = torch.tensor(processor.image_std, device=llava.device)[None, :, None, None]
    levels = (out["device_pixels"].float() - out["host_pixels"].float()).abs() * std / processor.rescale_factor
    feats = (out["device_encode"].float() - out["host_encode"].float()).abs().max() / out["host_encode"].abs().max()
    row = {name: round(statistics.median(t[1:]), 3) for name, t in times.items()}
    return {**{f"{k}_ms": v for k, v in row.items()}, "max_level_difference": float(levels.max()),
            "relative_feature_difference": float(feats)}  # fmt: skip


def _with_pixels(llava: LlavaModel, pixels: Any, picture: Any) -> torch.Tensor:
    """One image's features with ``llava``'s preprocessing on its device (``device_pixels``) for the call."""
    return llava.encode_images([picture], pixels=pixels)[0]


def _fresh(image: bytes, salt: int) -> bytes:
    """``image`` with one pixel changed: new bytes, so nothing another session holds matches it."""
    import io

    from PIL import Image

    picture = Image.open(io.BytesIO(image)).convert("RGB")
    picture.putpixel((0, 0), (salt % 256, 7, 11))
    out = io.BytesIO()
    picture.save(out, "PNG")
    return out.getvalue()


class TokenClock(BaseStreamer):
    """A ``generate`` streamer that stamps each token as it reaches the host: transformers calls
    :meth:`put` once with the prompt, then once per generated token (after its ``.cpu()``, so the
    device has finished the step); the gaps between generated tokens are the decode steps."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def put(self, value: Any) -> None:
        self.stamps.append(time.perf_counter())

    def end(self) -> None:
        pass

    def step_ms(self) -> list[float]:
        """The decode steps' wall times (ms): the gaps between generated tokens (the prompt's stamp
        and the prefill before the first token left out)."""
        return [(b - a) * 1000 for a, b in itertools.pairwise(self.stamps[1:])]


@torch.inference_mode()
def peer_static_generate(llava: LlavaModel, image: bytes, new_tokens: int) -> dict:
    """transformers' own batch-1 path: ``generate`` with a static cache (compiled by transformers on a
    GPU, with PyTorch's default SDPA backends, cuDNN's included), greedy, ``new_tokens`` tokens; ms per token: the median gap between generated tokens, read
    by a streamer inside the call (:class:`TokenClock`), over every run but the first (it compiles)."""
    processor, model = llava.processor, llava.model
    picture = decode_image(image, max_pixels=40_000_000)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = processor(images=[picture], text=prompt, return_tensors="pt").to(llava.device, llava.dtype)
    kwargs = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "do_sample": False}
    steps: list[float] = []
    cudnn = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(True)  # the peer as its users run it: PyTorch's default SDPA backends
    try:
        for run in range(3):
            clock = TokenClock()
            model.generate(**inputs, **kwargs, cache_implementation="static", streamer=clock)
            if run > 0:
                steps.extend(clock.step_ms())
    finally:
        torch.backends.cuda.enable_cudnn_sdp(cudnn)
    return {
        "ms_per_token": round(statistics.median(steps), 3),
        "compiled": llava.device.type == "cuda",
        "prompt_tokens": int(inputs["input_ids"].shape[1]),
    }


def cuda_graphs_arg(args: argparse.Namespace) -> bool | None:
    """``--cuda-graphs`` as the engine takes it: None (auto: on a GPU), True or False."""
    return {"auto": None, "on": True, "off": False}[args.cuda_graphs]


def new_engine(
    llava: LlavaModel,
    graphs: bool | None,
    paged_read: PagedRead | None = None,
    cpu_pool_bytes: int = 1 << 27,
    async_scheduling: bool | None = None,
) -> SessionEngine:
    """An engine on ``llava`` whose store does not demote at the table's levels: on a GPU the worker's
    budget (:func:`~llava_sessions.worker.session_budget`: 0.8 of the free memory less the graphs'
    estimate; its fixed pool takes that much at start), on a CPU an unbounded budget
    (``cpu_pool_bytes``, 128 MiB, when ``graphs`` fixes the pool there too: the unfused FlexAttention a
    CPU runs reads the whole pool). Its static decode step reads the pages as ``paged_read`` says (None:
    the engine's own choice; another one captures its graphs again that way). ``async_scheduling``: as
    :class:`SessionEngine`'s (None: with captured graphs)."""
    if llava.device.type == "cuda":
        budget = session_budget(Settings.from_sources({}, {}), llava)
    else:
        budget = cpu_pool_bytes if graphs else 1 << 45
    store = SessionStore(
        device_budget_bytes=budget, host_budget_bytes=1 << 40, kv_bytes_per_token=llava.kv_bytes_per_token
    )
    decode = functools.partial(decode_image, max_pixels=40_000_000)
    limits = EngineLimits(max_new_tokens_cap=4096)
    engine = SessionEngine(llava, store, decode, limits, cuda_graphs=graphs, async_scheduling=async_scheduling)
    executor = engine.runner
    if paged_read not in (None, paged_read_of(engine)) and executor.graphs is not None:
        executor.read_pages(paged_read)  # type: ignore[arg-type]
    return engine


def paged_read_of(engine: SessionEngine) -> str:
    """How ``engine``'s static decode step reads the pages (``none`` without one)."""
    graphs = engine.runner.graphs
    return graphs.paged_read if graphs is not None else "none"


def answers(engine: SessionEngine, sids: list[str], new_tokens: int) -> tuple[list[list[int]], float]:
    """``sids`` answer :data:`QUESTION` together, ``new_tokens`` greedy tokens each: their tokens and
    the median ms of a decode step (the prefills before the clock)."""
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    gens = [engine.start(sid, QUESTION, params, remember=False) for sid in sids]
    while not all(g.prefilled for g in gens):
        engine.step([g for g in gens if not g.done])
    _, walls = run_together(engine, gens, None)  # every step from here on decodes
    return [[t.id for t in g.answer.tokens] for g in gens], round(statistics.median(walls), 3)


def graphs_against_eager(engine: SessionEngine, images: list[bytes], new_tokens: int, capture_s: float) -> dict:
    """One session's and three sessions' greedy answers through the static decode step replayed (CUDA
    graphs on a GPU), the same static pass run eagerly (identical tokens: issue 43's replay equals
    eager), and eagerly at the rows' own shapes (another attended length: in bf16 the sums round
    otherwise, so a near tie of a random model's logits can flip; the first differing token is
    reported); ms per step each."""
    runner = engine.runner
    graphs, prefills = runner.graphs, runner.prefill_graphs
    assert graphs is not None
    sids = [f"graph{i}" for i in range(3)]
    for i, sid in enumerate(sids):
        engine.open(sid, images[i % len(images)])
    report: dict[str, Any] = {"num_graphs": graphs.steps.num_graphs, "capture_s": round(capture_s, 2)}
    for rows in (1, 3):
        answers(engine, sids[:rows], 4)  # warm
        replayed, replay_ms = answers(engine, sids[:rows], new_tokens)
        graphs.steps.replay = False
        static, static_ms = answers(engine, sids[:rows], new_tokens)
        graphs.steps.replay = True
        runner.set_static(None, None)  # every pass at its own shape
        eager, eager_ms = answers(engine, sids[:rows], new_tokens)
        runner.set_static(graphs, prefills)
        report[f"rows_{rows}"] = {
            "identical": replayed == static,
            "first_difference": first_differences(replayed, static),
            "static_ms": replay_ms,
            "static_eager_ms": static_ms,
            "own_shape_identical": replayed == eager,
            "own_shape_first_difference": first_differences(replayed, eager),
            "eager_ms": eager_ms,
        }
    report["num_replays"], report["num_static_eager"] = graphs.steps.num_replays, graphs.steps.num_eager
    for sid in sids:
        engine.close(sid)
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="7b", choices=["tiny", "bench", "7b"])
    ap.add_argument("--model-dir", default=None, help="a checkpoint folder instead of a random-weight one")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", help="bfloat16, float16 or float32 (auto: the device's)")
    ap.add_argument("--levels", default="1,8,32,64", help="concurrent sessions, comma-separated (start with 1)")
    ap.add_argument("--context", type=int, default=600, help="a stored session's context, tokens")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--skip-peer", action="store_true", help="leave transformers' static-cache generate out")
    ap.add_argument("--cuda-graphs", default="auto", choices=["auto", "on", "off"],
                    help="the decode step's static shapes (graphs on a GPU); off: the enforce_eager setting")  # fmt: skip
    ap.add_argument("--compile", default="auto", choices=["auto", "on", "off"],
                    help="the compile setting: the text layers fused and compiled before the engine (auto: on a GPU)")  # fmt: skip
    ap.add_argument("--async-scheduling", default="auto", choices=["auto", "on", "off"],
                    help="the engine's async scheduling (auto: with captured graphs)")  # fmt: skip
    ap.add_argument("--paged-attention", default=None, choices=["gather", "flex", "auto"],
                    help="how the static decode step reads the pages (default: the engine's own; flex: "
                         "FlexAttention over the pool; auto: the gather below FLEX_MIN_ROWS rows, flex from there)")  # fmt: skip
    ap.add_argument("--compare-paged-read", default="auto", choices=["auto", "on", "off"],
                    help="each other way of reading the pages, in an engine of its own (auto: on a GPU)")  # fmt: skip
    ap.add_argument("--kernel-rows", default="1,32", help="rows of the attention-kernel table ('': none)")
    ap.add_argument("--kernels", default="gather_sdpa,flex_paged,varlen_paged", help="its paged kernels")
    ap.add_argument("--json", default=None, help="the table as JSON, rewritten after every section")
    ap.add_argument("--deadline-s", type=float, default=None,
                    help="skip the sections that would start this many seconds after the run began")  # fmt: skip
    ap.add_argument("--sections", default="",
                    help=f"the sections to run, comma-separated, each in its place in the default order "
                         f"(newest first after the floor; '': all): {', '.join(SECTIONS)}; 'smoke': {', '.join(SMOKE)}; "
                         f"'rest': the others")  # fmt: skip
    args = ap.parse_args(argv)
    try:
        wanted = sections_wanted(args.sections)  # a typo is refused before the model is built
    except ValueError as exc:
        ap.error(str(exc))

    stop_on_sigterm()
    t_start = time.perf_counter()
    llava = build_runner(args)
    device = llava.device
    graphs = cuda_graphs_arg(args)
    t_engine = time.perf_counter()  # the engine's start: compiling the layers (on their first pass) and capture
    compiled = compiles(args.compile, device) and compile_text_layers(llava)  # as worker.build_engine does
    ahead = {"auto": None, "on": True, "off": False}[args.async_scheduling]
    engine = new_engine(llava, graphs, args.paged_attention, async_scheduling=ahead)
    capture_s = time.perf_counter() - t_engine
    images = [sample_photo(p) for p in PHOTOS]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    report = Sections(args.json, args.deadline_s, t_start)
    report.data.update({
        "model": args.model_dir or args.model,
        "device": f"{device} ({name})",
        "dtype": str(llava.dtype),
        "torch": torch.__version__,
        "cudnn_sdpa": torch.backends.cuda.cudnn_sdp_enabled(),
        "paged_attention": paged_read_of(engine),
        "prefix_tokens": len(llava.template.prefix_ids(Chat(None, image_tokens=(llava.num_image_tokens,)))),
        "engine_start_s": round(capture_s, 2),
        "compiled_layers": compiled,
        "context": args.context,
    })  # fmt: skip
    levels = [int(x) for x in args.levels.split(",")]
    report.data["graph_counts"] = graph_counts(engine)
    report.data["graph_memory"] = graph_memory(engine)
    report.data["sections"] = [name for name in SECTIONS if name in wanted]
    vocab = int(llava.config.text_config.vocab_size)
    runner, ahead_on = engine.runner, engine._execute.ahead is not None
    in_engine: dict[str, Callable[[], Any] | None] = {  # None: not on this engine (no such graphs or steps)
        "floor": lambda: weight_floor(llava),
        "prefill_graph": (lambda: prefill_graph_rows(engine, images, args.repeats)) if runner.prefill_graphs else None,
        "pixels": lambda: pixel_rows(llava, images, args.repeats),
        "async_scheduling": (lambda: async_steps.table(engine, images, [1, 32], args.new_tokens, 3)) if ahead_on else None,
        "logprob_rows": lambda: greedy_rows.logprob_table(device, [1, 8, 32, 64], vocab, args.repeats * 5),
        "sampled_rows": lambda: greedy_rows.sampled_table(device, [1, 8, 32, 64], vocab, args.repeats * 5),
        "vision_graph": (lambda: vision_graph_rows(llava, runner.vision_graph, images, args.repeats)) if runner.vision_graph else None,
        "graphs": (lambda: graphs_against_eager(engine, images, args.new_tokens, capture_s)) if runner.graphs else None,
        "batch_one": lambda: timed_batch_one(engine, llava, images[1], args),
        "turns": lambda: turns(engine, images, args.context, args.repeats),
        "aggregate": lambda: aggregate(engine, images, levels, args.new_tokens),
        "pool": lambda: pool_report(engine, args.context),
        "greedy_rows": lambda: greedy_rows.table(device, [1, 8, 32, 64], vocab, args.repeats * 20),
    }  # fmt: skip
    for name in SECTIONS[: len(in_engine)]:
        measure_it = in_engine[name]
        if name in wanted and measure_it is not None:
            report.run(name, measure_it)
    compare = {"on": True, "off": False, "auto": device.type == "cuda"}[args.compare_paged_read]
    compare = compare and engine.runner.graphs is not None
    engine = runner = None  # type: ignore[assignment]  # its pool and batch go first: the next engine's take their room
    in_engine.clear()
    release_memory(device)
    # the layers the other way (eager if the table's were compiled, else compiled), then as loaded for the
    # sections after it (the peer compiles transformers' own forward over the model as loaded)
    if "other_layers" in wanted:
        change, undo = (uncompile_layers, None) if compiled else (compile_layers, uncompile_layers)
        report.run("other_layers", lambda: changed_model(llava, images, levels, args, change, undo))
        release_memory(device)
    if not args.skip_peer and "peer" in wanted:
        report.run("peer", lambda: peer_static_generate(llava, images[2], args.new_tokens))
    reads = OTHER_READS[report.data["paged_attention"]] if compare and "paged_read" in wanted else ()
    for read in reads:  # each in an engine of its own
        report.run(f"paged_read_{read}", lambda read=read: other_paged_read(llava, read, images, levels, args))
        release_memory(device)
    # last: compiling FlexAttention takes seconds per shape, and every row above is printed already
    if "attention_kernels" in wanted:
        report.run("attention_kernels", lambda: attention_kernels(llava, args))
    if device.type == "cuda":
        report.data["peak_gpu_bytes"] = torch.cuda.max_memory_allocated(device)
    report.data["seconds"] = round(time.perf_counter() - t_start, 1)
    report.save()
    print_table(report.data)
    return 1 if report.data.get("errors") else 0


#: The table's sections in the order they run: the floor first (every ratio's), then the engine's
#: sections newest first (the GPU code least measured gets measured before a deadline cuts the call),
#: then those that build engines or models of their own.
SECTIONS = (
    "floor",
    "prefill_graph",
    "pixels",
    "async_scheduling",
    "logprob_rows",
    "sampled_rows",
    "vision_graph",
    "graphs",
    "batch_one",
    "turns",
    "aggregate",
    "pool",
    "greedy_rows",
    "other_layers",
    "peer",
    "paged_read",
    "attention_kernels",
)
#: What ``make gpu-smoke`` measures (``--sections smoke``): the floor and batch-1 decode, the cold image turn
#: with its prefill replayed, device pixels against the host's, the vision tower and the decode steps
#: replayed against eager, follow-up TTFT, and the aggregate (32 sessions with ``--levels 1,32``).
SMOKE = ("floor", "prefill_graph", "pixels", "vision_graph", "graphs", "batch_one", "turns", "aggregate")


def sections_wanted(spec: str) -> set[str]:
    """The sections ``--sections`` names: '' all of :data:`SECTIONS`, ``smoke`` :data:`SMOKE`, ``rest`` the
    others, else a comma-separated list of names (``smoke`` and ``rest`` may stand among them).

    Raises:
        ValueError: a name that is no section (the sections listed).
    """
    names: set[str] = set()
    for part in filter(None, (p.strip() for p in spec.split(","))):
        if part == "smoke":
            names |= set(SMOKE)
        elif part == "rest":
            names |= set(SECTIONS) - set(SMOKE)
        elif part in SECTIONS:
            names.add(part)
        else:
            raise ValueError(f"--sections: no section {part!r}; choose from {', '.join(SECTIONS)}, smoke, rest")
    return names or set(SECTIONS)


def graph_counts(engine: SessionEngine) -> dict[str, int]:
    """The CUDA graphs the engine's start captured, by kind (0 each on a CPU, which captures none)."""
    runner = engine.runner
    return {
        "decode": runner.graphs.steps.num_graphs if runner.graphs is not None else 0,
        "prefill": runner.prefill_graphs.chunks.num_graphs if runner.prefill_graphs is not None else 0,
        "vision": runner.vision_graph.tower.num_graphs if runner.vision_graph is not None else 0,
    }


def graph_memory(engine: SessionEngine) -> dict[str, Any]:
    """Each graph kind's capture in bytes the allocator reserved (a GPU's; none on a CPU), their sum, and
    the budget's estimate of it (``sessions/budget.py``) beside it: what replaces the estimate."""
    model = engine.runner.model
    estimate = graph_reserve_bytes(GraphShapes.from_config(model.config.to_dict()), model.dtype.itemsize)
    measured = dict(engine.runner.graph_bytes)
    return {"measured": measured, "measured_bytes": sum(measured.values()), "estimate_bytes": estimate}


def stop_on_sigterm() -> None:
    """Make SIGTERM (what ``timeout`` sends first) raise ``SystemExit(143)``: the ``with`` blocks and
    ``finally`` clauses unwind, so every server this process started is stopped, its process group
    whole (:class:`~llava_tools.serve.LocalServer`'s ``stop``). Python's default SIGTERM ends the
    process at once, leaving TorchServe, in a session of its own, holding the GPU."""

    def _exit(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _exit)


def release_memory(device: torch.device) -> None:
    """Free what a finished engine held (its objects refer to each other, so a collection frees them),
    and on a GPU hand the cached blocks back, so the next engine's fixed pool is sized to all of it."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


class Sections:
    """The table's sections as they finish: each is printed and written to ``path`` (JSON) at once, so a
    device call cut off at its limit still returns every section before the cut; a section that raises
    is recorded under ``errors`` with its traceback's tail and the rest still run (one device call
    measures all it can); one that would start more than ``deadline_s`` seconds after ``t_start`` is
    listed under ``skipped``."""

    def __init__(self, path: str | None, deadline_s: float | None, t_start: float) -> None:
        self.path, self.deadline_s, self.t_start = path, deadline_s, t_start
        self.data: dict[str, Any] = {}

    def run(self, name: str, measure_it: Callable[[], Any]) -> None:
        """``measure_it()`` recorded as section ``name``, or its error, or skipped past the deadline."""
        elapsed = time.perf_counter() - self.t_start
        if self.deadline_s is not None and elapsed > self.deadline_s:
            self.data.setdefault("skipped", []).append(name)
            print(f"{name}: skipped, {elapsed:.0f} s past the start (--deadline-s {self.deadline_s:g})", flush=True)
            self.save()
            return
        try:
            value = measure_it()
        except Exception:  # noqa: BLE001 - recorded with its traceback; the other sections still run
            trace = traceback.format_exc()
            print(f"{name} FAILED after {time.perf_counter() - self.t_start:.0f} s:\n{trace}", flush=True)
            self.data.setdefault("errors", {})[name] = trace.splitlines()[-20:]
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        else:
            self.data[name] = value
            print(f"{name} ({time.perf_counter() - self.t_start:.0f} s)", json.dumps(value), flush=True)
        self.save()

    def save(self) -> None:
        """Write the sections so far to the JSON path (when one was given)."""
        if self.path:
            Path(self.path).write_text(json.dumps(self.data, indent=1))


def timed_batch_one(engine: SessionEngine, llava: LlavaModel, image: bytes, args: argparse.Namespace) -> dict:
    """:func:`batch_one_decode` with the forward passes timed on the device (:class:`ForwardClock`)."""
    clock = ForwardClock(llava)
    try:
        return batch_one_decode(engine, clock, image, args.context, args.new_tokens)
    finally:
        clock.close()


def pool_report(engine: SessionEngine, context: int) -> dict | None:
    """The KV pool's page size, pages, growths and bytes, and the sessions of ``context`` tokens its
    pages hold (issue 43: >= 100 at 600 on an 80 GB H100); None without a pool."""
    pool = engine.runner.pool
    if pool is None:
        return None
    return {
        "page_size": pool.page_size,
        "pages": pool.pool.num_pages,
        "grows": pool.num_grows,
        "fixed": pool.fixed,
        "bytes": pool.pages.nbytes(),
        "sessions_at_context": pool.pool.num_pages // pool.pool.pages_for(context),
    }


def other_paged_read(llava: LlavaModel, read: PagedRead, images: list[bytes], levels: list[int],
                     args: argparse.Namespace) -> dict:  # fmt: skip
    """Batch-1 decode, the aggregate and the graphs against eager again in an engine whose static
    decode step reads the pages as ``read`` (``flex``: FlexAttention over the pool;
    its start's seconds include capturing the engine's own graphs first, then ``read``'s)."""
    graphs = cuda_graphs_arg(args)
    # on a CPU, a pool of twice what the compared sessions hold (every unfused FlexAttention step reads
    # all of it) and 16 MiB for their image features
    per_session = (args.context + args.new_tokens + 2 * KV_PAGE_SIZE) * llava.kv_bytes_per_token
    pool_bytes = 2 * (max(*levels, 3) + 1) * per_session + (1 << 24)
    t0 = time.perf_counter()
    engine = new_engine(llava, graphs, read, cpu_pool_bytes=pool_bytes)
    start_s = time.perf_counter() - t0
    b1 = timed_batch_one(engine, llava, images[1], args)
    rows = {"paged_attention": read, "batch_one": b1, "aggregate": aggregate(engine, images, levels, args.new_tokens)}
    if engine.runner.graphs is not None:
        rows["graphs"] = graphs_against_eager(engine, images, args.new_tokens, start_s)
    return rows


def changed_model(
    llava: LlavaModel, images: list[bytes], levels: list[int], args: argparse.Namespace,
    change: Callable[[torch.nn.Module], dict[str, int]], undo: Callable[[torch.nn.Module], Any] | None,
) -> dict:  # fmt: skip
    """Batch-1 decode and the aggregate in an engine over the same model with its text model changed in
    place by ``change`` (:func:`compile_layers` or :func:`uncompile_layers`: what it changed, ``changed``),
    and after by ``undo`` (None: left so). Also: the largest difference of a prompt's last logits from
    before, the first changed prefill's seconds and the engine's start (a compiled change compiles in them;
    the engine's graphs are captured over it), and the graphs dynamo made."""
    text = llava.model.model.language_model
    ids = llava.tokenizer(QUESTION)["input_ids"]
    with torch.inference_mode():
        before = llava.prefill(llava.new_cache(), ids, None)
    changed = change(text)
    torch._dynamo.utils.counters.clear()
    try:
        t0 = time.perf_counter()
        with torch.inference_mode():
            after = llava.prefill(llava.new_cache(), ids, None)
        first_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        engine = new_engine(llava, cuda_graphs_arg(args), args.paged_attention)
        start_s = time.perf_counter() - t0
        b1 = timed_batch_one(engine, llava, images[1], args)
        rows = aggregate(engine, images, levels, args.new_tokens)
        graphs = int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    finally:
        if undo is not None:
            undo(text)
    return {
        "compiled": change is compile_layers,
        "changed": changed,
        "dynamo_graphs": graphs,
        "first_prefill_s": round(first_s, 2),
        "engine_start_s": round(start_s, 2),
        "max_logit_difference": float((after - before).abs().max()),
        "batch_one": b1,
        "aggregate": rows,
    }


def attention_kernels(llava: LlavaModel, args: argparse.Namespace) -> list[dict[str, Any]]:
    """``paged_attention.measure`` at the text model's attention shape, ``--context`` positions and each
    of ``--kernel-rows`` rows, in the model's dtype, printed as it goes."""
    heads = llava.model.config.text_config.num_attention_heads
    page = KV_PAGE_SIZE
    reports = []
    for rows in (int(r) for r in args.kernel_rows.split(",") if r):
        shape = AttentionShape(heads, llava.num_kv_heads, llava.head_dim, rows, args.context, page)
        report = measure(llava.device, llava.dtype, shape, kernels=tuple(args.kernels.split(",")))
        print(describe(report), flush=True)
        reports.append(report)
    return reports


def print_table(report: dict[str, Any]) -> None:
    """The table, every latency with its ratio to the floor measured in the same run (a section that
    failed or was skipped is left out, and named at the end)."""
    print(f"\n{report['model']} on {report['device']}, {report['dtype']}, torch {report['torch']}")
    floor = report["floor"]["floor_ms"] if "floor" in report else float("nan")
    if "floor" in report:
        print(f"weight-read floor: {floor:.2f} ms ({report['floor']['weight_bytes'] / 1e9:.2f} GB at "
              f"{report['floor']['copy_bandwidth_gb_s']} GB/s)")  # fmt: skip
    b1, t, peer = report.get("batch_one"), report.get("turns"), report.get("peer")
    rows = []
    if b1:
        rows.append((f"batch-1 decode, context {b1['context_tokens']}", b1["ms_per_token"], "ms/token"))
        rows.append(("  of it host work per step", b1["host_ms_per_step"], "ms"))
    if t:
        rows.append((f"follow-up TTFT ({t['follow_up']['new_tokens']} new tokens)", t["follow_up"]["ttft_ms"], "ms"))
        rows.append(("cold image turn (open + first token)", t["cold_image_turn_ms"], "ms"))
    if peer:
        how = "compiled" if peer["compiled"] else "eager"
        rows.append((f"transformers static-cache generate ({how})", peer["ms_per_token"], "ms/token"))
    for label, value, unit in rows:
        print(f"{label:<48}{value:>10.2f} {unit:<9}{value / floor:>7.2f}x floor")
    if b1 and peer:
        print(f"{'batch-1 decode vs transformers':<48}{b1['ms_per_token'] / peer['ms_per_token']:>10.2f}x")
    for n, row in report.get("aggregate", {}).items():
        ratio = f"{row['vs_one']:.1f}x one" if row["vs_one"] else ""
        print(f"{n + ' sessions at once':<48}{row['tokens_per_s']:>10.1f} tokens/s {ratio}")
    for n, row in report.get("async_scheduling", {}).get("rows", {}).items():
        label = f"{n} session(s), async scheduling against in step"
        print(f"{label:<48}{row['ahead_vs_in_step']:>10.2f}x tokens/s (same tokens: {row['same_tokens']})")
    pool = report.get("pool")
    if pool and pool["fixed"]:
        label = f"sessions its {pool['bytes'] / 1e9:.1f} GB KV pool holds at {report.get('context', '')}"
        print(f"{label:<48}{pool['sessions_at_context']:>10d}")
    _print_graphs_and_kernels(report)
    for name, trace in report.get("errors", {}).items():
        print(f"{name}: FAILED, {trace[-1]}")
    for name in report.get("skipped", []):
        print(f"{name}: skipped (deadline)")
    print(f"(run took {report['seconds']} s)")


def _print_graphs_and_kernels(report: dict[str, Any]) -> None:
    """The table's second half: graphs against eager, the attention kernels, the layers the other way."""
    g = report.get("graphs")
    if g:  # the static decode step (replayed graphs on a GPU) against eager at the step's own shape
        print(f"decode graphs: {g['num_graphs']} captured in {g['capture_s']} s")
        for rows in (1, 3):
            r = g[f"rows_{rows}"]
            same = "identical" if r["identical"] else f"DIFFERENT from {r['first_difference']}"
            label = f"  {rows} row(s): replay vs the same pass eager, tokens {same}"
            print(f"{label:<58}{r['static_ms']:>8.2f} ms/step {r['static_ms'] / r['static_eager_ms']:>6.2f}x")
            own = "identical" if r["own_shape_identical"] else f"first differ at {r['own_shape_first_difference']}"
            label = f"  {rows} row(s): vs eager at its own shape, tokens {own}"
            print(f"{label:<58}{r['eager_ms']:>8.2f} ms/step eager")
    for n, row in report.get("greedy_rows", {}).items():  # a step's greedy rows: one argmax against one each
        label = f"{n} greedy rows picked, one argmax for all"
        print(f"{label:<48}{row['batched_ms']:>10.3f} ms   {row['ratio']:.2f}x faster than one each")
    for n, row in report.get("sampled_rows", {}).items():  # a step's sampled rows: one warp and draw for all
        label = f"{n} sampled rows drawn, one warp for all"
        print(f"{label:<48}{row['batched_ms']:>10.3f} ms   {row['ratio']:.2f}x faster than one each")
    for n, row in report.get("logprob_rows", {}).items():  # greedy rows with logprobs: one log_softmax for all
        label = f"{n} rows with logprobs, one read for all"
        print(f"{label:<48}{row['batched_ms']:>10.3f} ms   {row['ratio']:.2f}x faster than one each")
    p = report.get("pixels")
    if p:  # llava-1.5's preprocessing on the host against on the device
        print(f"{'one image preprocessed on the device':<48}{p['device_pixels_ms']:>10.2f} ms   "
              f"{p['host_pixels_ms'] / p['device_pixels_ms']:.2f}x faster than the host ({p['host_pixels_ms']:.2f} ms; "
              f"{p['max_level_difference']:.0f} level(s) apart at most)")  # fmt: skip
        print(f"{'  and encoded':<48}{p['device_encode_ms']:>10.2f} ms   against {p['host_encode_ms']:.2f} ms "
              f"(features {p['relative_feature_difference']:.1e} apart, relative)")  # fmt: skip
    v = report.get("vision_graph")
    if v:  # llava-1.5's vision tower replayed against eager, one image's encoding
        print(f"{'one image encoded, tower replayed':<48}{v['replayed_ms']:>10.2f} ms   {v['ratio']:.2f}x faster "
              f"than eager ({v['eager_ms']:.2f} ms; features differ by {v['max_feature_difference']:.1e})")  # fmt: skip
    g = report.get("prefill_graph")
    if g:  # a cold image turn, the open's prefill replayed against the same pass eagerly and at its own shape
        print(f"{'cold image turn, prefill replayed':<48}{g['replayed_ms']:>10.2f} ms   against "
              f"{g['static_eager_ms']:.2f} ms eager, {g['own_shape_ms']:.2f} ms at its own shape "
              f"({g['graphs']} graphs captured in {g['capture_s']} s)")  # fmt: skip
    for kernels in report.get("attention_kernels", []):
        print(describe(kernels))
    b1 = report.get("batch_one")
    others = [report[f"paged_read_{r}"] for r in ("gather", "flex", "auto") if f"paged_read_{r}" in report]
    for other in others if b1 else ():  # the static step reading the pages another way, as ratios to this run's
        print(f"paged read {other['paged_attention']} against {report['paged_attention']}:")
        _print_rows(other, report)
        for rows in (1, 3) if other.get("graphs") else ():
            r = other["graphs"][f"rows_{rows}"]
            same = "identical" if r["identical"] else f"DIFFERENT from {r['first_difference']}"
            print(f"  {rows} row(s): replay vs the same pass eager, tokens {same}")
    layers = report.get("other_layers")
    if layers and b1:  # the layers the other way (fused and compiled, or as loaded), as ratios to this run's
        what = "compiled layers against eager" if layers["compiled"] else "eager layers against compiled"
        print(f"{what} ({layers['dynamo_graphs']} graphs, engine start {layers['engine_start_s']} s against "
              f"{report['engine_start_s']} s, logits differ by {layers['max_logit_difference']:.2e} at most):")  # fmt: skip
        _print_rows(layers, report)


def _print_rows(other: dict[str, Any], report: dict[str, Any]) -> None:
    """A second engine's batch-1 decode and aggregate, each with its ratio to the first engine's."""
    b1 = report["batch_one"]
    ratio = other["batch_one"]["ms_per_token"] / b1["ms_per_token"]
    print(f"{'  batch-1 decode':<48}{other['batch_one']['ms_per_token']:>10.2f} ms/token {ratio:>6.2f}x")
    for n, row in other["aggregate"].items():
        mine = report.get("aggregate", {}).get(n)
        ratio = row["tokens_per_s"] / mine["tokens_per_s"] if mine else float("nan")
        print(f"{'  ' + n + ' sessions at once':<48}{row['tokens_per_s']:>10.1f} tokens/s {ratio:>6.2f}x")


if __name__ == "__main__":
    sys.exit(main())
