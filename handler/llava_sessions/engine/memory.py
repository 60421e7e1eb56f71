"""Device memory: the default budget, and one retry after a CUDA out-of-memory error.

Booking is the ledger's (``llava_sessions.sessions.ledger``) and the store's; this module measures what is
there and turns an allocator failure into demotions of idle sessions, then a typed ``overloaded``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import torch

from ..errors import overloaded

if TYPE_CHECKING:
    from ..model import LlavaRunner
    from ..sessions.session import Session
    from ..sessions.store import SessionStore

__all__ = ["available_host_bytes", "default_device_budget", "is_oom", "oom_retry"]

log = logging.getLogger(__name__)

T = TypeVar("T")


def available_host_bytes() -> int:
    """Host memory available now (``sysconf`` available pages x page size), bytes."""
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def default_device_budget(runner: LlavaRunner, fraction: float) -> int:
    """``fraction`` of the device memory free now (CUDA ``mem_get_info``), or of available host
    memory (:func:`available_host_bytes`) on CPU; bytes."""
    if runner.device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(runner.device)
    else:
        free = available_host_bytes()
    return max(1, int(free * fraction))


def is_oom(exc: BaseException) -> bool:
    """Whether ``exc`` is the device allocator running out of memory."""
    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()


def oom_retry(fn: Callable[[], T], store: SessionStore, *, keep: Session | None) -> T:
    """Run ``fn``; on a CUDA out-of-memory error demote every idle session but ``keep`` and retry once.

    Raises:
        ServiceError: overloaded, when the retry runs out of memory too.
        Exception: whatever else ``fn`` raises.
    """
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001
        if not is_oom(exc):
            raise
        log.warning("out of memory; demoting idle sessions and retrying once")
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        store.demote_all(keep=keep)
        try:
            return fn()
        except Exception as exc2:  # noqa: BLE001
            if is_oom(exc2):
                raise overloaded("the device is out of memory; retry later", "step_memory") from exc2
            raise


def new_session_bytes(runner: LlavaRunner, num_prefix_tokens: int, num_image_tokens: int | None = None) -> int:
    """Device bytes a new session takes in the ``kv`` tier: its image features (``num_image_tokens``,
    default one base tile, x hidden x dtype bytes) plus the KV cache of its ``num_prefix_tokens``."""
    image_tokens = runner.num_image_tokens if num_image_tokens is None else num_image_tokens
    return image_tokens * runner.feature_bytes_per_token + num_prefix_tokens * runner.kv_bytes_per_token
