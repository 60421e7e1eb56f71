"""Loading a LLaVA-family checkpoint: its architecture, model, processor, device and dtype.

Architectures (:data:`ARCHITECTURES`, chosen by ``config.json``'s ``architectures``): llava-1.5
(``LlavaForConditionalGeneration``), LLaVA-NeXT (``LlavaNextForConditionalGeneration``, "anyres"
tiling), LLaVA-OneVision (``LlavaOnevisionForConditionalGeneration``, anyres_max_9; Qwen2; videos)
and LLaVA-NeXT-Video (``LlavaNextVideoForConditionalGeneration``: LLaVA-NeXT's images, and videos).
``from_pretrained`` works on local folders only (no model hub here). The vision tower keeps only the
layers its feature layer needs (:func:`trim_vision_tower`); on a CPU device the process's allocator
keeps what a forward pass frees for the next one (:func:`keep_freed_cpu_memory`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "ARCHITECTURES",
    "checkpoint_architecture",
    "image_only_processor_class",
    "keep_freed_cpu_memory",
    "load_model",
    "load_processor",
    "resolve_device",
    "reserve_cpu_memory",
    "resolve_dtype",
    "trim_vision_tower",
]

log = logging.getLogger(__name__)

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}

#: The checkpoint architectures served (``config.json`` ``architectures[0]``, transformers class names).
ARCHITECTURES: tuple[str, ...] = (
    "LlavaForConditionalGeneration",
    "LlavaNextForConditionalGeneration",
    "LlavaOnevisionForConditionalGeneration",
    "LlavaNextVideoForConditionalGeneration",
)


def checkpoint_architecture(model_dir: str | Path) -> str:
    """The architecture named by ``model_dir/config.json`` (one of :data:`ARCHITECTURES`).

    Raises:
        FileNotFoundError: no config.json.
        ValueError: an architecture this server does not serve.
    """
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path.parent} is not a checkpoint folder (no config.json)")
    names = json.loads(path.read_text()).get("architectures") or []
    for name in names:
        if name in ARCHITECTURES:
            return str(name)
    raise ValueError(f"{path.parent}: architecture {names or '(none)'} is not one of {', '.join(ARCHITECTURES)}")


def image_only_processor_class(processor_class: type) -> Any:
    """``processor_class`` without its video processor: LLaVA-OneVision's and LLaVA-NeXT-Video's
    processors require one, and transformers' video processors need torchvision, which does not
    install beside the CPU torch wheel (a video's frames are preprocessed by :mod:`.video`).

    The processors pass their attributes to ``ProcessorMixin`` positionally, in their own order
    (LLaVA-NeXT-Video's puts the video processor first, OneVision's last), and ``from_pretrained``
    builds them positionally in ``get_attributes`` order: here ``from_pretrained`` passes them in the
    order of the class's own ``__init__`` (None for the video processor), whose place is dropped
    before ``ProcessorMixin`` sees them.
    """
    from transformers import ProcessorMixin

    everything = list(processor_class.get_attributes())  # type: ignore[attr-defined]
    kept = [a for a in everything if a != "video_processor"]

    def get_attributes(cls: type) -> list[str]:
        return list(kept)

    def from_args_and_dict(cls: type, args: Any, processor_dict: dict[str, Any], **kwargs: Any) -> Any:
        named = dict(zip(kept, args, strict=True))  # in the order of the class's own __init__
        code = processor_class.__init__.__code__  # type: ignore[misc]
        order = [n for n in code.co_varnames[1 : code.co_argcount] if n in everything]
        ordered = tuple(named.get(name) for name in order)
        return processor_class.from_args_and_dict.__func__(cls, ordered, processor_dict, **kwargs)  # type: ignore[attr-defined]

    class _WithoutVideoProcessor(ProcessorMixin):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            if "video_processor" in everything and len(args) == len(everything):
                args = tuple(a for a, name in zip(args, everything, strict=True) if name != "video_processor")
            ProcessorMixin.__init__(self, *args, **kwargs)

    namespace = {"get_attributes": classmethod(get_attributes), "from_args_and_dict": classmethod(from_args_and_dict)}
    return type(processor_class.__name__, (processor_class, _WithoutVideoProcessor), namespace)


def load_processor(model_dir: str | Path) -> Any:
    """The checkpoint's own processor (``AutoProcessor``); a processor whose video processor cannot
    load here (no torchvision) is loaded without it (:func:`image_only_processor_class`).

    Raises:
        OSError / ValueError: the folder has no loadable processor.
    """
    import transformers
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(model_dir)
    except (OSError, ValueError, ImportError, AttributeError):
        config = Path(model_dir) / "processor_config.json"
        name = json.loads(config.read_text()).get("processor_class", "") if config.is_file() else ""
        cls = getattr(transformers, name, None)
        if cls is None or "video_processor" not in cls.get_attributes():
            raise
        log.info("loading the processor without its video processor", extra={"processor": name})
        return image_only_processor_class(cls).from_pretrained(model_dir)


def resolve_device(device: str = "auto", gpu_id: int | None = None) -> torch.device:
    """Return ``cuda:<gpu_id>`` when CUDA is available (or asked for), else ``cpu``.

    Raises:
        ValueError: ``device="cuda"`` without CUDA, or an unknown device string.
    """
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda, not {device!r}")
    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("device=cuda but CUDA is not available")
    return torch.device("cuda", gpu_id or 0)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """Return the torch dtype: ``auto`` is :func:`auto_dtype` of the device (bfloat16 on a GPU that
    computes in it, else float16; float32 on the CPU).

    Raises:
        ValueError: an unknown dtype name.
    """
    if dtype == "auto":
        capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
        return auto_dtype(device.type, capability)
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be auto, float16, bfloat16 or float32, not {dtype!r}")
    return _DTYPES[dtype]


#: The first CUDA compute capability with bfloat16 arithmetic in its tensor cores (Ampere, 8.0: NVIDIA,
#: "CUDA C++ Programming Guide", compute capabilities); the A10G, L4, L40S, A100, H100 and H200 have it,
#: the T4 (7.5) and V100 (7.0) do not.
BF16_CAPABILITY = (8, 0)


def auto_dtype(device_type: str, capability: tuple[int, int] | None = None) -> torch.dtype:
    """The ``dtype: auto`` of a device: float32 on the CPU; on a GPU bfloat16 from compute capability
    :data:`BF16_CAPABILITY` on, else float16 (docs/decisions/69-the-gpu-default-is-bf16.md: bfloat16 is
    what every GPU figure and GPU test was measured in, and it keeps fp32's exponent range).

    Args:
        device_type: ``"cuda"`` or ``"cpu"``.
        capability: the GPU's ``(major, minor)`` compute capability (``torch.cuda.get_device_capability``).
    """
    if device_type != "cuda":
        return torch.float32
    return torch.bfloat16 if capability is not None and tuple(capability) >= BF16_CAPABILITY else torch.float16


def load_model(
    model_dir: str | Path,
    *,
    device: str = "auto",
    gpu_id: int | None = None,
    dtype: str = "auto",
    tensor_parallel: bool = False,
) -> tuple[Any, Any]:
    """Load the model (eval mode, on its device) and its processor from a local llava-hf checkpoint folder.

    Args:
        model_dir: folder with config.json, weights, tokenizer and processor files.
        device: ``auto`` (``cuda:<gpu_id>`` when available, else CPU), ``cpu`` or ``cuda``.
        gpu_id: CUDA device index (TorchServe passes one per worker).
        dtype: ``auto`` (:func:`auto_dtype`: bfloat16 on a GPU that has it, else float16; float32 on the
            CPU), ``float16``, ``bfloat16`` or ``float32``.
        tensor_parallel: this process is one rank of a joined process group (:mod:`.parallel`): the
            language model is loaded as this rank's shard (transformers' ``tp_plan="auto"``, placed by
            transformers on the rank's device).

    Returns:
        ``(model, processor)``.

    Raises:
        FileNotFoundError: ``model_dir`` is not a folder with a config.json.
        ValueError: bad device or dtype, or an architecture not in :data:`ARCHITECTURES`.
    """
    import transformers
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    path = Path(model_dir)
    architecture = checkpoint_architecture(path)
    dev = resolve_device(device, gpu_id)
    if dev.type == "cuda":  # its GPU is the process's current device: graphs, streams and events go there
        torch.cuda.set_device(dev)
    torch_dtype = resolve_dtype(dtype, dev)
    if dev.type == "cpu":
        keep_freed_cpu_memory()
    sharding: dict[str, Any] = {}
    if tensor_parallel:  # the model's own plan over the process group this rank joined
        from transformers.distributed import DistributedConfig

        sharding["distributed_config"] = DistributedConfig(tp_plan="auto")
    loaded: Any = getattr(transformers, architecture).from_pretrained(path, dtype=torch_dtype, **sharding)
    trim_vision_tower(loaded)
    model = loaded if tensor_parallel else loaded.to(dev)
    processor = load_processor(path)
    log.info(
        "loaded checkpoint",
        extra={"model_dir": str(path), "architecture": architecture, "device": str(dev), "dtype": str(torch_dtype)},
    )
    return model.eval(), processor


def trim_vision_tower(model: Any) -> int:
    """Drop the vision encoder's layers above the one its image features are read from, as vLLM builds
    LLaVA's vision tower only up to ``vision_feature_layer`` (``vllm/model_executor/models/llava.py``,
    ``_get_num_hidden_layers``). llava-1.5 and LLaVA-NeXT read layer -2 (``hidden_states[-2]``): the
    last CLIP layer and the post-layernorm run for nothing (1 of 24 layers of CLIP ViT-L/14).

    ``config.vision_feature_layer`` becomes the same layer counted from the proxy (``hidden_states``
    has ``num_hidden_layers + 1`` entries, the embeddings first), so the model's own
    ``get_image_features`` and ``generate`` select it as before: the features are bit-identical.
    A tower without an ``encoder.layers`` list, or one whose last layer is read (OneVision's -1), is
    left as is.

    Returns:
        The number of layers dropped.
    """
    config = model.config
    tower = getattr(model, "vision_tower", None) or getattr(getattr(model, "model", None), "vision_tower", None)
    encoder = getattr(tower, "encoder", None) or getattr(getattr(tower, "vision_model", None), "encoder", None)
    layers = getattr(encoder, "layers", None)
    wanted = config.vision_feature_layer
    if encoder is None or not isinstance(layers, torch.nn.ModuleList) or wanted is None:
        return 0
    n = len(layers)
    front = [i if i >= 0 else n + 1 + i for i in ([wanted] if isinstance(wanted, int) else wanted)]
    keep = max(front)
    if not 0 < keep < n:
        return 0
    encoder.layers = layers[:keep]
    config.vision_feature_layer = front[0] if isinstance(wanted, int) else front
    config.vision_config.num_hidden_layers = keep
    return n - keep


#: glibc's ``mallopt(3)`` parameter numbers (``<malloc.h>``).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
#: Blocks above this size are mapped on their own and returned to the kernel when freed (a session's
#: KV tensors of a large model): glibc's own ceiling for its dynamic threshold on 64-bit
#: (``DEFAULT_MMAP_THRESHOLD_MAX``), fixed from the start instead of learnt. Bytes.
CPU_MMAP_THRESHOLD_BYTES = 32 * 2**20
#: Free memory at the top of the heap kept for reuse before the rest goes back to the kernel. Bytes.
CPU_TRIM_THRESHOLD_BYTES = 512 * 2**20
#: glibc's environment variables for the same two parameters: when either is set, the operator chose.
_MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def keep_freed_cpu_memory(env: Mapping[str, str] = os.environ) -> bool:
    """Let this process's allocator keep the memory a forward pass frees for the next one, on a CPU
    device (tensors there come from ``malloc``).

    With glibc's defaults a prefill's activations (blocks of megabytes) are mapped and unmapped, or
    trimmed off the heap (when no small allocation lies above them), every pass, so each pass faults
    its pages in again: about three times the minor faults and system time of a cold image turn with
    :data:`CPU_MMAP_THRESHOLD_BYTES` / :data:`CPU_TRIM_THRESHOLD_BYTES` set through ``mallopt(3)``
    (docs/decisions/04-the-cpu-allocator.md has the figures). PyTorch's performance tuning guide recommends a caching
    allocator on CPU (jemalloc, tcmalloc) for the same reason; this is glibc's own setting.

    Args:
        env: the process environment; when it sets ``MALLOC_MMAP_THRESHOLD_`` or
            ``MALLOC_TRIM_THRESHOLD_`` (glibc's variables for the same settings), nothing is changed.

    Returns:
        Whether the thresholds were set (False: the environment chose, or the C library is not glibc).
    """
    libc = None if any(name in env for name in _MALLOC_ENV) else _glibc()
    if libc is None:
        return False
    return bool(
        libc.mallopt(_M_MMAP_THRESHOLD, CPU_MMAP_THRESHOLD_BYTES)
        and libc.mallopt(_M_TRIM_THRESHOLD, CPU_TRIM_THRESHOLD_BYTES)
    )


@functools.cache
def _glibc() -> Any:
    """This process's C library with ``mallopt``, ``malloc`` and ``free`` typed, or None when it is
    not glibc (no ``mallopt``)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    except (OSError, AttributeError):
        return None
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    return libc


#: Size of the blocks a reserve is made of: under :data:`CPU_MMAP_THRESHOLD_BYTES`, so from the heap. Bytes.
_RESERVE_BLOCK_BYTES = 16 * 2**20


def reserve_cpu_memory(num_bytes: int, env: Mapping[str, str] = os.environ) -> int:
    """Grow this process's heap by ``num_bytes`` (in 16 MiB blocks), write every page once, and free
    the blocks back into the heap, where glibc keeps them (trimming turned off): the
    sessions' KV and the passes' activations of a CPU worker then reuse pages the process holds,
    instead of faulting fresh ones in whenever its footprint grows (as sessions and conversation-cache
    entries accumulate). vLLM's CPU backend likewise allocates its KV cache space at start
    (``VLLM_CPU_KVCACHE_SPACE``). On the 2-core development VM, whose host takes back the guest's free
    pages, a page faulted in fresh cost ~10x a recycled one: 0.9-1.8 s of kernel time per 8-stream
    burst once the worker's footprint grew, 0.03-0.14 s with 2-3 GiB reserved (docs/decisions/05-a-cpu-worker-s-memory-reserved-at-start.md).
    The heap's top is then never given back: the worker keeps its
    high-water mark, as a GPU's caching allocator keeps its blocks.

    Args:
        num_bytes: bytes to reserve (rounded down to whole blocks; 0: none).
        env: the process environment; when it sets glibc's ``MALLOC_*_THRESHOLD_`` variables, nothing
            is changed (:func:`keep_freed_cpu_memory`).

    Returns:
        The bytes reserved (0: none asked, the environment chose the allocator's thresholds, or the C
        library is not glibc).
    """
    if num_bytes < _RESERVE_BLOCK_BYTES or not keep_freed_cpu_memory(env):
        return 0
    libc = _glibc()
    if not libc.mallopt(_M_TRIM_THRESHOLD, -1):  # mallopt(3): -1 turns trimming off (its value is a C int)
        return 0
    blocks: list[int] = []
    try:
        for _ in range(num_bytes // _RESERVE_BLOCK_BYTES):
            block = libc.malloc(_RESERVE_BLOCK_BYTES)
            if not block:
                break
            ctypes.memset(block, 0, _RESERVE_BLOCK_BYTES)
            blocks.append(block)
    finally:
        for block in blocks:
            libc.free(block)
    return len(blocks) * _RESERVE_BLOCK_BYTES
