"""A step's inputs copied to the GPU without blocking the host.

A copy from ordinary (pageable) host memory to a CUDA device returns only once the copy is done; a copy
from pinned (page-locked) memory with ``non_blocking=True`` is queued on the stream and returns at once
(PyTorch's "CUDA semantics" notes, "Use pinned memory buffers"). :class:`HostStaging` stages each of a
step's host tensors in a pinned buffer of its own, by name, and queues its copy. A pinned buffer may be
written again only once its last copy is done: :meth:`HostStaging.begin` waits for the event
:meth:`HostStaging.end` recorded after the last step's copies. On a CPU every copy is a plain one.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch

__all__ = ["HostStaging", "upload"]


def upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` (a CPU tensor) on ``device``: to a GPU from pinned memory, queued without blocking the host
    (PyTorch's caching host allocator keeps the pinned block until the copy is done); elsewhere a plain copy."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


class HostStaging:
    """Host → ``device`` copies of a step's inputs through pinned buffers (module docstring).

    Use: :meth:`begin`, then :meth:`upload` for each input, then :meth:`end`, once per step.
    """

    def __init__(self, device: torch.device) -> None:
        self._pinned: dict[Hashable, torch.Tensor] | None = {} if device.type == "cuda" else None
        self._device = device
        self._copied: Any = None

    @property
    def pinned(self) -> bool:
        """Whether copies go through pinned buffers (a CUDA device)."""
        return self._pinned is not None

    def begin(self) -> None:
        """Wait until the last step's copies are done (their pinned buffers are then free to write)."""
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None

    def upload(self, name: Hashable, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src)``, ``src`` a host tensor of ``dst``'s shape: on a GPU through the pinned
        buffer ``name`` (grown to the largest ``src`` of its dtype seen; ``src`` is copied into it), the
        device copy queued without blocking the host; elsewhere a plain copy."""
        if self._pinned is None:
            dst.copy_(src)
            return
        host = self._pinned.get(name)
        if host is None or host.dtype != src.dtype or host.numel() < src.numel():
            size = max(src.numel(), 2 * host.numel() if host is not None and host.dtype == src.dtype else 0)
            host = self._pinned[name] = torch.empty(size, dtype=src.dtype, pin_memory=True)
        staged = host[: src.numel()].view(src.shape)
        staged.copy_(src)
        dst.copy_(staged, non_blocking=True)

    def end(self) -> None:
        """Mark the step's copies on the device's current stream (the next :meth:`begin` waits for them)."""
        if self._pinned is not None:
            self._copied = torch.cuda.Event()
            self._copied.record(torch.cuda.current_stream(self._device))
