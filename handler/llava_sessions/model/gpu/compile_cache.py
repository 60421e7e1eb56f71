"""The compile cache a model folder ships: what Inductor compiled for the text layers
(:mod:`.regions`), saved once on a GPU and loaded by every later worker start, so a new container does
not compile them again.

PyTorch's "Mega-Cache" (``torch.compiler.save_cache_artifacts`` / ``load_cache_artifacts``; PyTorch's
tutorial "Compile Time Caching in torch.compile") packs what compiling wrote to Inductor's caches (the FX
graph cache with, on a GPU, the Triton kernels bundled in, the AOTAutograd cache, autotuning results)
into one byte string. Loaded before compiling, it fills Inductor's local cache
(``TORCHINDUCTOR_CACHE_DIR``), and each graph Dynamo traces then finds its code there instead of compiling
it (Dynamo's tracing is still paid). PyTorch checks the torch and Triton versions and, on a GPU, the GPU,
so a file built elsewhere only misses and the layers compile as without it; the file's name carries the
torch version and the GPU's name, so build it on the instance type you deploy to.

The file sits at ``<model folder>/compile-cache/torch-<version>-<device>-<dtype>.bin``
(:func:`compile_cache_file`); ``llava-compile-cache`` writes it, ``worker.build_local_service`` reads it,
and ``llava-deploy`` packages it with the checkpoint. On the 2-core CPU (the ``tiny`` model, ``compile:
on``) a worker in a fresh Inductor cache found both graphs in the file and compiled none, but the start
gained little (12.3 s of compiling against 13.7 s): there Inductor still probes the CPU's vector
instructions (6 s) and builds the kernels' C++ (1.4 s) in each new cache folder, which the file does not
hold (decision 63).
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

import torch

__all__ = ["CACHE_FOLDER", "cache_counts", "compile_cache_file", "load_compile_cache", "save_compile_cache"]

log = logging.getLogger(__name__)

#: The folder of a model folder that holds its compile caches (no leading dot: ``llava-deploy`` packages it).
CACHE_FOLDER = "compile-cache"


def compile_cache_file(model_dir: str | Path, device: torch.device, dtype: torch.dtype) -> Path:
    """The compile cache's path for this torch, ``device`` and ``dtype`` in ``model_dir``:
    ``compile-cache/torch-<torch.__version__>-<cpu | the GPU's name>-<dtype>.bin``, the GPU's name as
    ``torch.cuda.get_device_name`` gives it, lower case, e.g. ``nvidia-h200``. Whether it exists is not
    checked."""
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    where = re.sub(r"[^a-z0-9.]+", "-", where.lower()).strip("-")
    return Path(model_dir) / CACHE_FOLDER / f"torch-{torch.__version__}-{where}-{str(dtype).removeprefix('torch.')}.bin"


def load_compile_cache(path: Path) -> bool:
    """Load the compile cache at ``path`` into Inductor's local cache, before anything compiles
    (``torch.compiler.load_cache_artifacts``). Returns whether it was loaded: False when there is no
    such file, or (with a warning saying why) when it cannot be read or loaded; the layers then compile
    as without one."""
    if not path.is_file():
        return False
    try:  # torch logs and returns None for bytes it cannot read
        loaded = torch.compiler.load_cache_artifacts(path.read_bytes()) is not None
    except Exception:  # noqa: BLE001 - a stale or foreign cache: compiling from scratch still serves
        log.debug("loading %s raised", path, exc_info=True)
        loaded = False
    if not loaded:
        log.warning("the compile cache %s could not be loaded; the text layers compile from scratch", path.name)
    return loaded


def save_compile_cache(path: Path) -> int:
    """Write what this process has compiled (``torch.compiler.save_cache_artifacts``) to ``path``,
    replacing it whole (written beside it, then renamed). Returns the bytes written.

    Raises:
        RuntimeError: nothing was compiled in this process.
        OSError: ``path``'s folder cannot be created or written.
    """
    saved = torch.compiler.save_cache_artifacts()
    if saved is None or not saved[0]:
        raise RuntimeError("nothing was compiled in this process: no compile cache to write")
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    partial.write_bytes(saved[0])
    partial.replace(path)
    return len(saved[0])


def cache_counts() -> dict[str, int]:
    """Graphs this process found compiled in Inductor's cache (``cache_hits``) and compiled itself
    (``cache_misses``) so far: Inductor's FX graph cache counters (``torch._dynamo.utils.counters``)."""
    inductor = torch._dynamo.utils.counters["inductor"]
    return {"cache_hits": int(inductor["fxgraph_cache_hit"]), "cache_misses": int(inductor["fxgraph_cache_miss"])}
