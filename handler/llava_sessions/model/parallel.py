"""Tensor parallel: one replica's model over N ranks, one process each, driven by rank 0.

transformers shards the language model of each LLaVA family itself (``tp_plan="auto"``: the q/k/v,
gate and up projections split by heads and columns, o and down by rows, the LM head gathered;
transformers' ``base_model_tp_plan`` of Llama and Qwen2), and PyTorch's ``torch.distributed`` carries
its all-reduces (``gloo`` on a CPU, NCCL on GPUs). The vision tower and the projector are whole on
every rank, and only rank 0 runs them; the token embeddings are sharded by vocabulary, so every rank
looks up the ids rank 0 sends (``embed``), and rank 0 alone places the image features among them.

Rank 0 is the replica: the process that runs the session engine, its scheduler and every decision.
The other ranks (:func:`follow`) hold their heads' share of the KV pool and nothing else: before each
forward pass rank 0 sends them exactly what that pass needs (:meth:`RankGroup.forward`: the input
embeddings, positions, attention mask, and the pool slots it writes and reads), and before each change
of the pool's pages what it is (:meth:`RankGroup.send`, by :class:`~.kv.paged.KVPages` itself: created, grown, pages copied on write). A
follower decides nothing, so no time budget or memory check can differ between ranks.

Faults: a rank that dies or fails ends the replica as one. Rank 0 watches the others' processes and
exits at once when one ends (:data:`RANK_DIED_EXIT`); a message that cannot be sent, or a token lookup
or pass that fails after it was sent (:meth:`RankGroup.sharded`; a collective with a dead rank fails
before the watcher may see it), leaves the ranks out of step, so rank 0 exits then too, never answering
a request with the error (:meth:`RankGroup.fail`); a follower exits when rank 0
does (its parent is gone, or its channel from rank 0 closes). Whoever started rank 0 (TorchServe, a
replica router) starts it again, and it starts its followers anew; sessions come back as after any
worker restart. A collective that waits longer than :data:`RANK_TIMEOUT_S` fails its pass.

Only passes over the KV pool run sharded (:class:`~.kv.paged.SlotsCache`): a tensor-parallel
replica runs its steps eagerly, without fused chunks or host offload (``worker.build_engine``).

A prefill's input embeddings (an image turn's are ~100 MB at OneVision-72b's shapes,
``benchmarks/results/tensor-parallel-engine.md``) go by a collective broadcast on GPUs (NCCL, GPU to
GPU) instead of the pipe (:attr:`RankGroup.broadcast_embeds`); on a CPU the pipe was the faster.
"""

from __future__ import annotations

import contextlib
import datetime
import inspect
import logging
import multiprocessing
import os
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

import torch

from .kv.paged import KVPages, SlotsCache

__all__ = [
    "Broadcast",
    "RANK_DIED_EXIT",
    "RANK_TIMEOUT_S",
    "RankGroup",
    "cache_keyword",
    "check_tensor_parallel",
    "follow",
    "load_replica",
    "start_ranks",
]

log = logging.getLogger(__name__)

#: Exit status of rank 0 when another rank died or a sharded pass failed (the replica restarts).
RANK_DIED_EXIT = 70
#: Seconds a collective may wait for the other ranks before its pass fails (a stalled rank).
RANK_TIMEOUT_S = 300


def check_tensor_parallel(size: int, text_config: Any, num_gpus: int | None) -> None:
    """Refuse a ``tensor_parallel_size`` the model or the machine cannot take.

    Args:
        size: ranks asked for (``tensor_parallel_size``).
        text_config: the checkpoint's text model config (``num_attention_heads``, ``num_key_value_heads``).
        num_gpus: GPUs the replica may use, or None on a CPU (ranks are processes there).

    Raises:
        ValueError: ``size`` does not divide the attention heads or the key-value heads (each rank holds
            whole heads), or exceeds ``num_gpus``; the message names both numbers.
    """
    heads = int(text_config.num_attention_heads)
    kv_heads = int(getattr(text_config, "num_key_value_heads", None) or heads)
    for what, count in (("attention heads", heads), ("key-value heads", kv_heads)):
        if count % size:
            raise ValueError(
                f"tensor_parallel_size {size} does not divide the model's {count} {what}: give a divisor of {count}"
            )
    if num_gpus is not None and size > num_gpus:
        raise ValueError(f"tensor_parallel_size {size} exceeds the {num_gpus} GPU(s) this replica can use")


class RankGroup:
    """Rank 0's side of a tensor-parallel replica: the other ranks' processes and their channels.

    Args:
        size: ranks in all (rank 0 included).
        processes: the other ranks' processes (``size - 1``), started by :func:`start_ranks`.
        channels: a pipe to each (``multiprocessing``: a message pickled, its tensors on the host). Not
            a collective: a rank waits for its next message as long as rank 0 is idle, while the passes'
            own collectives time out (:data:`RANK_TIMEOUT_S`).

    Attributes:
        num_messages: messages sent since start (passes and page changes).
        num_broadcasts: input embeddings sent by a broadcast since start.
        broadcast_embeds: a pass of more than one position sends its input embeddings by a collective
            broadcast inside the pass (:class:`Broadcast` in the message), not in the message: on by
            default on GPUs (NCCL), where the pipe would carry them through the host.
    """

    def __init__(self, size: int, processes: list[Any], channels: list[Any], *, broadcast_embeds: bool = False) -> None:
        self.size = size
        self.processes = processes
        self.channels = channels
        self.num_messages = 0
        self.num_broadcasts = 0
        self.broadcast_embeds = broadcast_embeds
        self._closing = False
        self._watcher = threading.Thread(target=self._watch, name="rank-watch", daemon=True)
        self._watcher.start()

    def send(self, message: tuple[Any, ...]) -> None:
        """Send ``message`` (``(kind, *args)``, tensors on the host) to every other rank. A channel that
        fails (its rank is gone, possibly before the watcher saw it) ends the replica (:meth:`fail`)."""
        try:
            for channel in self.channels:
                channel.send(message)
        except OSError as exc:
            self.fail(f"a rank's channel failed: {type(exc).__name__}: {exc}")
        self.num_messages += 1

    @contextlib.contextmanager
    def sharded(self, what: str) -> Iterator[None]:
        """A step every rank runs (its message sent inside, then rank 0's share, whose collectives meet the
        others'). Any failure in it ends the replica (:meth:`fail`), never a request's error: the ranks are
        out of step, and a collective with a dead rank fails before the watcher may see it die."""
        try:
            yield
        except BaseException as exc:
            self.fail(f"{what} failed: {type(exc).__name__}: {exc}")
            raise

    @staticmethod
    def check(cache: Any) -> None:
        """Refuse a pass the other ranks cannot run: only passes over the KV pool's slots
        (:class:`~.kv.paged.SlotsCache`) are sharded.

        Raises:
            RuntimeError: ``cache`` is another kind of cache (a bug: the replica's settings exclude it).
        """
        if not isinstance(cache, SlotsCache):
            raise RuntimeError(f"a tensor-parallel pass runs over the KV pool's slots, not a {type(cache).__name__}")

    def forward(self, cache: Any, kwargs: dict[str, Any]) -> None:
        """Send the other ranks the pass rank 0 is about to run: ``kwargs`` as given to the model
        (``inputs_embeds`` ``[B, n, hidden]``, ``attention_mask``, ``position_ids``, ``logits_to_keep``)
        over ``cache``, a :class:`~.kv.paged.SlotsCache` (its write and read slots); inside :meth:`sharded`.
        """
        import torch.distributed as dist

        layer = cache.layers[0]
        slots = (_host(layer.write_slots), _host(layer.read_slots), layer.num_new, layer.whole_pool)
        embeds = kwargs.get("inputs_embeds")
        if not (self.broadcast_embeds and isinstance(embeds, torch.Tensor) and embeds.shape[1] > 1):
            self.send(("forward", slots, {k: _host(v) for k, v in kwargs.items()}))
            return
        sent = {k: _host(v) for k, v in kwargs.items() if k != "inputs_embeds"}
        sent["inputs_embeds"] = Broadcast(tuple(embeds.shape), embeds.dtype)
        self.send(("forward", slots, sent))
        dist.broadcast(embeds.contiguous(), src=0)
        self.num_broadcasts += 1

    def fail(self, why: str) -> None:
        """End rank 0 at once (the other ranks follow): a rank is gone, or a sharded step failed after the
        others were told of it, so they are out of step. The replica is restarted by whoever started it."""
        log.error("tensor-parallel replica ends: %s", why)
        os._exit(RANK_DIED_EXIT)

    def close(self) -> None:
        """Stop the other ranks and leave the process group (rank 0 goes on without them)."""
        import torch.distributed as dist

        self._closing = True
        try:
            for channel in self.channels:
                with contextlib.suppress(OSError):  # a rank already gone
                    channel.send(("stop",))
        finally:
            for p in self.processes:
                p.join(30)
                if p.is_alive():
                    p.kill()
            dist.destroy_process_group()

    def _watch(self) -> None:
        sentinels = [p.sentinel for p in self.processes]
        wait(sentinels)
        if not self._closing:
            dead = [p.pid for p in self.processes if not p.is_alive()]
            self.fail(f"rank process {dead} exited")


@dataclass(frozen=True)
class Broadcast:
    """In a ``forward`` message, in place of the input embeddings: they follow by a collective
    broadcast from rank 0, ``shape`` ``[B, n, hidden]`` of ``dtype``."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def _host(value: Any) -> Any:
    """A tensor copied to the host (a CUDA tensor pickles with its device index, another rank's)."""
    return value.cpu() if isinstance(value, torch.Tensor) else value


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _join(rank: int, size: int, port: int, device_index: int, timeout_s: float) -> None:
    """Join the ranks' process group (NCCL on GPUs, else ``gloo``); a collective waits ``timeout_s`` at most."""
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(device_index))
    backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() > device_index else "gloo"
    if backend == "nccl":  # the rank's GPU is its current device before NCCL opens a communicator on it
        torch.cuda.set_device(device_index)
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def start_ranks(
    size: int,
    model_dir: str | Path,
    *,
    device: torch.device,
    dtype: str,
    threads: int = 0,
    timeout_s: float | None = None,
) -> RankGroup:
    """Start ranks ``1 .. size - 1`` as processes (``multiprocessing`` spawn) loading ``model_dir``
    sharded, and join their process group as rank 0. Rank 0 loads its own shard after this returns
    (:func:`load_replica`); each follower then waits for messages.

    Args:
        size: ranks in all. device: rank 0's, the CPU or GPU ``N`` (ranks on GPUs ``N .. N + size - 1``).
        dtype: as :func:`~.loading.load_model`. threads: torch threads per rank (0: the host's share).
        timeout_s: the longest a collective (a rank joining, a pass's all-reduce) waits for the others
            (default :data:`RANK_TIMEOUT_S`).

    Raises:
        RuntimeError: a rank did not join within ``timeout_s``.
    """
    port = _free_port()
    timeout_s = timeout_s or RANK_TIMEOUT_S
    first = device.index or 0  # a CPU device has none
    threads = threads or max(1, (os.cpu_count() or 1) // size)
    ctx = multiprocessing.get_context("spawn")
    me = multiprocessing.current_process()
    if me.daemon:  # a replica's process (replicas.py) may start ranks: they end with it (_exit_with_parent)
        me.daemon = False
    processes, channels = [], []
    for rank in range(1, size):
        inbox, channel = ctx.Pipe()  # rank 0 sends on it; the rank says once that it is up
        args = (rank, size, port, first + rank, str(model_dir), dtype, threads, os.getpid(), inbox, timeout_s)
        p = ctx.Process(target=follow, args=args, name=f"llava-rank-{rank}", daemon=True)
        p.start()
        inbox.close()  # the rank's end: rank 0 keeps only its own
        processes.append(p)
        channels.append(channel)
    torch.set_num_threads(threads)
    # watching them from here: a rank dying while starting ends rank 0
    group = RankGroup(size, processes, channels, broadcast_embeds=device.type == "cuda")
    for channel in channels:  # each rank's imports done (seconds): the rendezvous then takes well under the timeout
        channel.recv()
    _join(0, size, port, first, timeout_s)
    return group


def load_replica(
    model_dir: str | Path, device: str, gpu_id: int | None, dtype: str, size: int, threads: int = 0
) -> tuple[Any, Any, RankGroup | None]:
    """Load a replica's model as :func:`~.loading.load_model` does; with ``size`` > 1 ranks, the size
    checked (:func:`check_tensor_parallel`), the other ranks started (:func:`start_ranks`) and this
    process's shard loaded as rank 0.

    Returns:
        ``(model, processor, the other ranks or None)``.

    Raises:
        FileNotFoundError, ValueError: as :func:`~.loading.load_model`, or :func:`check_tensor_parallel`.
        RuntimeError: a rank did not join within :data:`RANK_TIMEOUT_S`.
    """
    from transformers import AutoConfig

    from .loading import load_model, resolve_device

    ranks = None
    if size > 1:
        dev = resolve_device(device, gpu_id)
        gpus = torch.cuda.device_count() - (dev.index or 0) if dev.type == "cuda" else None
        check_tensor_parallel(size, AutoConfig.from_pretrained(model_dir).text_config, gpus)
        ranks = start_ranks(size, model_dir, device=dev, dtype=dtype, threads=threads)
    model, processor = load_model(model_dir, device=device, gpu_id=gpu_id, dtype=dtype, tensor_parallel=size > 1)
    return model, processor, ranks


def follow(
    rank: int,
    size: int,
    port: int,
    device_index: int,
    model_dir: str,
    dtype: str,
    threads: int,
    parent: int,
    inbox: Any,
    timeout_s: float = RANK_TIMEOUT_S,
) -> None:
    """A follower rank's whole life: join, load its shard, then run what rank 0 sends until told to stop.

    Messages (``(kind, *args)``): ``pages`` (hold a pool of that shape), ``grow`` (add pages),
    ``copy`` (pages copied on write), ``embed`` (token ids rank 0 looks up: the embeddings are sharded
    by vocabulary), ``forward`` (one pass over the pool's slots), ``stop``.
    """
    import torch.distributed as dist

    from .loading import load_model

    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    torch.set_num_threads(threads)
    inbox.send("up")
    _join(rank, size, port, device_index, timeout_s)
    on_gpu = dist.get_backend() == "nccl"
    device = f"cuda:{device_index}" if on_gpu else "cpu"
    model, _ = load_model(
        model_dir,
        device="cuda" if on_gpu else "cpu",
        gpu_id=device_index if on_gpu else None,
        dtype=dtype,
        tensor_parallel=True,
    )
    keyword = cache_keyword(model)
    pages: KVPages | None = None
    dev = torch.device(device)
    while True:
        try:
            kind, *args = inbox.recv()
        except (EOFError, OSError):  # rank 0 is gone: nothing to serve
            os._exit(0)
        if kind == "stop":
            break
        if kind == "pages":
            layers, num_pages, page_size, heads, head_dim, kv_dtype = args
            pages = KVPages(layers, num_pages, page_size, heads, head_dim, kv_dtype, dev)
        elif kind == "grow":
            assert pages is not None
            pages.grow(args[0])
        elif kind == "copy":
            assert pages is not None
            pages.copy(args[0])
        elif kind == "embed":  # its share of the vocabulary's lookup; rank 0 sends the embeddings it builds
            with torch.inference_mode():
                model.get_input_embeddings()(args[0].to(dev))
        elif kind == "forward":
            assert pages is not None
            _run_pass(model, keyword, pages, dev, *args)
    dist.destroy_process_group()


@torch.inference_mode()
def _run_pass(model: Any, keyword: str, pages: KVPages, dev: torch.device, slots: tuple, kwargs: dict) -> None:
    """The pass rank 0 described, over this rank's pages (its output is rank 0's to use)."""
    import torch.distributed as dist

    write, read, num_new, whole_pool = slots
    cache = SlotsCache(pages, write.to(dev), read.to(dev), num_new, whole_pool=whole_pool)
    inputs = {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    spec = inputs.get("inputs_embeds")
    if isinstance(spec, Broadcast):  # they follow the message by a broadcast from rank 0
        inputs["inputs_embeds"] = torch.empty(spec.shape, dtype=spec.dtype, device=dev)
        dist.broadcast(inputs["inputs_embeds"], src=0)
    model(use_cache=True, **{keyword: cache}, **inputs)


def cache_keyword(model: Any) -> str:
    """The model's KV cache keyword: ``cache`` since transformers 5.24 (``past_key_values`` is deprecated
    there and removed in 5.40), ``past_key_values`` before it."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _exit_with_parent(parent: int) -> None:
    """A follower outlives no rank 0: poll the parent's pid (its death re-parents this process)."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(0)
