"""Loading a LLaVA-family checkpoint: its architecture, model, processor, device and dtype.

Architectures (:data:`ARCHITECTURES`, chosen by ``config.json``'s ``architectures``): llava-1.5
(``LlavaForConditionalGeneration``), LLaVA-NeXT (``LlavaNextForConditionalGeneration``, "anyres"
tiling) and LLaVA-OneVision (``LlavaOnevisionForConditionalGeneration``, anyres_max_9; Qwen2).
``from_pretrained`` works on local folders only (no model hub here).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "ARCHITECTURES",
    "checkpoint_architecture",
    "image_only_processor_class",
    "load_model",
    "load_processor",
    "resolve_device",
    "resolve_dtype",
]

log = logging.getLogger(__name__)

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}

#: The checkpoint architectures served (``config.json`` ``architectures[0]``, transformers class names).
ARCHITECTURES: tuple[str, ...] = (
    "LlavaForConditionalGeneration",
    "LlavaNextForConditionalGeneration",
    "LlavaOnevisionForConditionalGeneration",
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
    """``processor_class`` without its video processor: LLaVA-OneVision's processor requires one, and
    transformers' video processors need torchvision, which a server of images does not need."""

    def get_attributes(cls: type) -> list[str]:
        return [a for a in processor_class.get_attributes() if a != "video_processor"]  # type: ignore[attr-defined]

    return type(processor_class.__name__, (processor_class,), {"get_attributes": classmethod(get_attributes)})


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
    """Return the torch dtype: ``auto`` is float16 on GPU and float32 on CPU.

    Raises:
        ValueError: an unknown dtype name.
    """
    if dtype == "auto":
        return torch.float16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be auto, float16, bfloat16 or float32, not {dtype!r}")
    return _DTYPES[dtype]


def load_model(
    model_dir: str | Path, *, device: str = "auto", gpu_id: int | None = None, dtype: str = "auto"
) -> tuple[Any, Any]:
    """Load the model (eval mode, on its device) and its processor from a local llava-hf checkpoint folder.

    Args:
        model_dir: folder with config.json, weights, tokenizer and processor files.
        device: ``auto`` (``cuda:<gpu_id>`` when available, else CPU), ``cpu`` or ``cuda``.
        gpu_id: CUDA device index (TorchServe passes one per worker).
        dtype: ``auto`` (float16 on GPU, float32 on CPU), ``float16``, ``bfloat16`` or ``float32``.

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
    torch_dtype = resolve_dtype(dtype, dev)
    loaded: Any = getattr(transformers, architecture).from_pretrained(path, dtype=torch_dtype)
    model = loaded.to(dev)
    processor = load_processor(path)
    log.info(
        "loaded checkpoint",
        extra={"model_dir": str(path), "architecture": architecture, "device": str(dev), "dtype": str(torch_dtype)},
    )
    return model.eval(), processor
