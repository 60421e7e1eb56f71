"""The one place that wires a worker: settings → loaded model → session store → engine → service.

``handler/llava_handler.py`` calls :func:`build_service` once per TorchServe worker process, in
``initialize``; tests and tools call it the same way.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from .config import Settings, job_groups
from .conversation import VideoBytes
from .engine import EngineLimits, SessionEngine, available_host_bytes, default_device_budget
from .engine.model_runner import KV_PAGE_SIZE
from .images.decode import decode_image
from .metrics import WorkerMetrics
from .model import LlavaModel
from .model.gpu.compile_cache import cache_counts, compile_cache_file, load_compile_cache
from .model.gpu.pixels import DevicePixels
from .model.gpu.regions import compile_layers, compiles, uncompile_layers
from .model.loading import reserve_cpu_memory
from .replicas import ReplicaRouter, replica_settings, resolve_devices
from .service import SessionService
from .sessions.budget import GraphShapes, graph_reserve_bytes, ladder_pages
from .sessions.store import SessionStore
from .video import VideoLimits, decode_video
from .wire.contract import IMAGE_RELAY_ENV, SEQUENCE_END_HEADER

__all__ = [
    "WorkerOrigin",
    "build_engine",
    "build_local_service",
    "build_service",
    "quiet_worker_logs",
    "session_budget",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerOrigin:
    """What TorchServe tells a worker about where it runs (picklable: replicas get it too).

    Attributes:
        env: environment overrides (``LLAVA_*``); None reads the process's environment.
        archive_dir: TorchServe's model directory (``context.system_properties["model_dir"]``); used as
            the checkpoint folder when ``model_dir`` is empty and it holds a config.json.
        gpu_id: TorchServe's GPU for this worker (``settings.gpu_id`` wins; ignored by replicas).
        end_header: TorchServe's sequence-end header name (``ctx.header_key_sequence_end``).
    """

    env: Mapping[str, str] | None = None
    archive_dir: str | None = None
    gpu_id: int | None = None
    end_header: str = SEQUENCE_END_HEADER


def build_service(
    handler_section: Mapping[str, Any],
    origin: WorkerOrigin = WorkerOrigin(),
    *,
    metrics: Any = None,
    batch_size: int | None = None,
) -> SessionService | ReplicaRouter:
    """Build this worker's handler core: one :class:`SessionService` in this process, or a
    :class:`~llava_sessions.replicas.ReplicaRouter` over one process per device when ``devices``
    names several (``resolve_devices``).

    Args:
        handler_section: the ``handler:`` section of model-config.yaml.
        origin: where the worker runs, as TorchServe says (environment, model directory, GPU, header).
        metrics: TorchServe's metrics cache (``context.metrics``) or None.
        batch_size: model-config.yaml's ``batchSize``, when known: a WARNING names the fix when the
            replicas' sessions (``max_sessions`` each) are more than it (TorchServe would serialise
            them; llava-serve, the container and llava-deploy size it, a hand-made config may not).

    Raises:
        ValueError: invalid settings. FileNotFoundError: no checkpoint folder. RuntimeError: a
        replica did not start.
    """
    settings = Settings.from_sources(dict(handler_section), origin.env)
    logging.getLogger("llava_sessions").setLevel(settings.log_level)
    devices = resolve_devices(settings)
    if batch_size is not None and settings.max_sessions * len(devices) > int(batch_size):
        log.warning(
            "model-config.yaml batchSize %s is below max_sessions %d x %d replica(s): sessions past it wait on "
            "each other; set batchSize and maxNumSequence to %d",
            batch_size,
            settings.max_sessions,
            len(devices),
            job_groups(settings.max_sessions, len(devices)),
        )
    if len(devices) == 1:
        return build_local_service(handler_section, origin, device=devices[0], metrics=metrics)
    section = dict(handler_section)
    if all(d == "cpu" for d in devices) and not settings.device_budget_bytes:
        # CPU replicas share one host memory: split one budget, measured once, so they are equal
        share = max(1, int(available_host_bytes() * settings.device_budget_fraction) // len(devices))
        section["device_budget_bytes"] = share
    # a replica process reads the environment it was given, not its own
    build = {"handler_section": section, "origin": replace(origin, env=dict(origin.env or {}))}
    return ReplicaRouter(
        settings, devices, build, metrics=metrics, builder=build_local_service, end_header=origin.end_header
    )


def quiet_worker_logs(log_level: str) -> None:
    """Drop TorchServe's per-request INFO line in a worker process, keep its metric lines.

    TorchServe 0.12's Python worker logs ``Backend received inference at: <time>`` on the root logger
    for every batch (``ts/protocol/otf_message_handler.py``); the frontend copies each line into
    model_log and stdout. The root logger goes to WARNING unless ``log_level`` is DEBUG or INFO;
    the ``ts`` loggers stay at INFO, as the ``[METRICS]`` lines the frontend parses are INFO records
    of ``ts.metrics`` and ``ts.service``.
    """
    if log_level in ("DEBUG", "INFO"):
        return
    logging.getLogger().setLevel(logging.WARNING)
    logging.getLogger("ts").setLevel(logging.INFO)


def build_local_service(
    handler_section: Mapping[str, Any],
    origin: WorkerOrigin = WorkerOrigin(),
    *,
    metrics: Any = None,
    device: str = "",
    replica: int = 0,
    num_replicas: int = 1,
) -> SessionService:
    """Build settings, model, store, engine and service in this process (one replica).

    Args:
        handler_section, origin, metrics: as :func:`build_service`.
        device: this replica's device (``"cpu"``, ``"cuda:1"``), or ``""`` for ``device`` / ``gpu_id``.
        replica: this replica's index (log lines).
        num_replicas: replicas of the worker (each gets 1/N of the host budget; ``max_sessions`` is each one's).

    Raises:
        ValueError: invalid settings. FileNotFoundError: no checkpoint folder.
    """
    settings = replica_settings(Settings.from_sources(dict(handler_section), origin.env), device, num_replicas)
    logging.getLogger("llava_sessions").setLevel(settings.log_level)
    if settings.torch_threads:
        import torch

        torch.set_num_threads(settings.torch_threads)
    model_dir = _model_dir(settings, origin.archive_dir)
    start_s = time.perf_counter()
    model = LlavaModel.from_pretrained(
        model_dir,
        device=settings.device,
        gpu_id=settings.gpu_id if settings.gpu_id is not None else origin.gpu_id,
        dtype=settings.dtype,
        tensor_parallel_size=settings.tensor_parallel_size,
        threads=settings.torch_threads,
    )
    loaded_s = time.perf_counter()
    engine = build_engine(settings, model, compile_cache_file(model_dir, model.device, model.dtype))
    weights_s, engine_s = round(loaded_s - start_s, 2), round(time.perf_counter() - loaded_s, 2)
    reserved = 0
    if model.device.type == "cpu":  # never past the sessions' budget, nor a quarter of the free memory
        cap = min(engine.store.device_budget_bytes, available_host_bytes() // 4)
        reserved = reserve_cpu_memory(min(settings.cpu_memory_reserve_bytes, cap))
    log.warning(
        "llava-sessions ready: weights loaded in %.2f s, engine built in %.2f s",
        weights_s,
        engine_s,  # the engine: its layers compiled (compile) and its graphs captured (a GPU)
        extra={
            "model_dir": model_dir,
            "device": str(model.device),
            "device_budget_bytes": engine.store.device_budget_bytes,
            "cpu_memory_reserved_bytes": reserved,
            "replica": replica,
            "weights_s": weights_s,
            "engine_s": engine_s,
        },
    )
    return SessionService(
        settings,
        engine,
        end_header=origin.end_header,
        metrics=WorkerMetrics(metrics, interval_s=settings.metrics_interval_ms / 1000.0),
        model_names=settings.served_model_name or (Path(model_dir).resolve().name,),
        image_relay=(origin.env or {}).get(IMAGE_RELAY_ENV) or None,
    )


def _model_dir(settings: Settings, archive_dir: str | None) -> str:
    """The checkpoint folder: ``model_dir``, else TorchServe's model directory when it holds a config.json.

    Raises:
        FileNotFoundError: neither names a checkpoint folder.
    """
    model_dir = settings.model_dir
    if not model_dir and archive_dir and (Path(archive_dir) / "config.json").is_file():
        model_dir = archive_dir
    if not model_dir:
        raise FileNotFoundError("no model folder: set handler.model_dir or LLAVA_MODEL_DIR")
    return model_dir


def decode_media(data: bytes, *, max_pixels: int, video_limits: VideoLimits) -> Any:
    """Decode a session's stored medium again (the engine's decode, when a medium kept as bytes must
    be encoded): a :class:`~llava_sessions.conversation.VideoBytes` is sampled as it was first
    (:func:`~llava_sessions.video.decode_video`), anything else is an image
    (:func:`~llava_sessions.images.decode_image`).

    Returns:
        An RGB PIL image, or a :class:`~llava_sessions.video.SampledVideo`.

    Raises:
        ServiceError: as the two decoders (image_invalid / image_too_large, video_invalid / video_too_large).
    """
    if isinstance(data, VideoBytes):
        return decode_video(data, num_frames=data.num_frames, fps=data.fps, limits=video_limits)
    return decode_image(data, max_pixels=max_pixels)


def build_engine(settings: Settings, model: LlavaModel, compile_cache: Path | None = None) -> SessionEngine:
    """The session store (its device budget: :func:`session_budget`) and the engine over ``model``, with
    the settings' limits. A tensor-parallel replica (``model.ranks``) runs its sessions' KV in the pool, decoded in
    place, eagerly, each prefill chunk a pass of its own and no host offload: the passes its other
    ranks mirror (:mod:`~llava_sessions.model.parallel`). Under the ``compile`` setting the text model's
    layers are fused and compiled first (:func:`~llava_sessions.model.gpu.regions.compile_layers`; ``auto``:
    on a GPU), so the engine's graphs capture the compiled kernels; what ``compile_cache`` holds (a model
    folder's, :mod:`~llava_sessions.model.gpu.compile_cache`) is loaded first, so it is not compiled again.
    ``image_preprocessing: device`` moves llava-1.5's preprocessing to the model's device
    (:mod:`~llava_sessions.model.gpu.pixels`)."""
    ranks = model.ranks.size if getattr(model, "ranks", None) is not None else 1
    on_gpu = model.device.type == "cuda"
    if compiles(settings.compile, model.device, ranks):
        compile_text_layers(model, compile_cache)
    store = SessionStore(
        device_budget_bytes=session_budget(settings, model, ranks),
        host_budget_bytes=settings.host_budget_bytes,
        kv_bytes_per_token=model.kv_bytes_per_token,
        max_sessions=settings.max_sessions,
        ttl_s=settings.session_ttl_s,
        idle_timeout_s=settings.idle_timeout_s,
        kv_offload_bytes=settings.kv_offload_bytes if on_gpu and ranks == 1 else 0,  # a CPU's host is its device
    )
    engine = SessionEngine(
        model,
        store,
        functools.partial(
            decode_media, max_pixels=settings.max_image_pixels, video_limits=VideoLimits.from_settings(settings)
        ),
        EngineLimits(
            max_new_tokens_cap=settings.max_new_tokens_cap,
            max_prompt_tokens=settings.max_prompt_tokens,
            planned_new_tokens=settings.default_max_new_tokens,
            max_images=settings.max_images_per_session,
            max_image_tokens=settings.max_image_tokens_per_session,
            cache_share=settings.conversation_cache_share,
            cache_entries=settings.conversation_cache_entries,
            truncation_headroom=settings.truncation_headroom,
        ),
        share_images=settings.share_images,
        unsalted=settings.unsalted_cache,
        fuse_prefill=settings.fuse_prefill and ranks == 1,
        cuda_graphs=False if settings.enforce_eager or ranks > 1 else None,
        async_scheduling=None if settings.async_scheduling else False,
    )
    if settings.image_preprocessing == "device":  # llava-1.5's; other processors stay on the host
        processor = model.processor.image_processor
        engine.runner.device_pixels = DevicePixels.for_processor(processor, model.device, model.dtype)
    return engine


def session_budget(settings: Settings, model: LlavaModel, ranks: int = 1) -> int:
    """The sessions' device budget, bytes: ``device_budget_bytes``, or ``device_budget_fraction`` of what
    is free now (on each GPU of a tensor-parallel replica of ``ranks``); on one GPU, of what is free less
    the CUDA graphs' estimated memory (:func:`gpu_graph_reserve`), the KV pool's page count then rounded
    down to one of a few sizes (:func:`~llava_sessions.sessions.budget.ladder_pages`, so FlexAttention's
    compiled kernels, and a model folder's compile cache, serve every start)."""
    if settings.device_budget_bytes:
        return settings.device_budget_bytes
    on_gpu = model.device.type == "cuda"
    reserve = gpu_graph_reserve(settings, model, ranks)
    budget = default_device_budget(model, settings.device_budget_fraction, reserve) * (ranks if on_gpu else 1)
    if on_gpu and ranks == 1:  # the fixed pool at one of a few sizes
        page = KV_PAGE_SIZE * model.kv_bytes_per_token
        budget = max(page, ladder_pages(budget // page) * page)
    return budget


def gpu_graph_reserve(settings: Settings, model: LlavaModel, ranks: int = 1) -> int:
    """Bytes of a GPU's free memory kept out of the sessions' budget for the CUDA graphs the engine
    captures (:func:`~llava_sessions.sessions.budget.graph_reserve_bytes`, an estimate from the model's
    shapes); 0 on a CPU, for a tensor-parallel replica and under ``enforce_eager`` (no graphs)."""
    if model.device.type != "cuda" or ranks > 1 or settings.enforce_eager:
        return 0
    reserve = graph_reserve_bytes(GraphShapes.from_config(model.config.to_dict()), model.dtype.itemsize)
    log.info("%.2f GiB of GPU memory kept for CUDA graphs (estimated)", reserve / 2**30)
    return reserve


def compile_text_layers(model: LlavaModel, compile_cache: Path | None = None) -> bool:
    """Fuse and compile ``model``'s text layers (:func:`~llava_sessions.model.gpu.regions.compile_layers`) and
    run one short prefill, so Inductor compiles now, after loading the compile cache at ``compile_cache``
    when there is one (:func:`~llava_sessions.model.gpu.compile_cache.load_compile_cache`: what it holds is
    found, not compiled). When compiling fails (Triton builds its kernel launcher with a C compiler at
    run time, which a container may lack), the layers run as loaded again and a warning says why.
    Returns whether they run compiled."""
    text = model.model.model.language_model
    loaded = compile_cache is not None and load_compile_cache(compile_cache)
    start_s = time.perf_counter()
    changed = compile_layers(text)
    try:
        model.prefill(model.new_cache(), model.tokenizer("Hello")["input_ids"], None)
    except Exception:  # noqa: BLE001 - any compiler failure: the model as loaded still serves
        log.warning("compiling the text layers failed; they run as loaded (compile: off)", exc_info=True)
        uncompile_layers(text)
        return False
    counts, took_s = cache_counts(), round(time.perf_counter() - start_s, 2)
    log.info(
        "text layers compiled in %.2f s: %d graph(s) found in a cache (compile cache %s), %d compiled",
        took_s, counts["cache_hits"], "loaded" if loaded else "none", counts["cache_misses"],
        extra={**changed, **counts, "cache_loaded": loaded, "compile_s": took_s},
    )  # fmt: skip
    return True
