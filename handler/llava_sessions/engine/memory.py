"""Device memory: the default budget, what a new session takes, and one retry after a CUDA out-of-memory error.

Booking is the ledger's (``llava_sessions.sessions.ledger``) and the store's; this module measures what is
there and turns an allocator failure into demotions of idle sessions, then a typed ``overloaded``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from ..errors import overloaded

if TYPE_CHECKING:
    from ..model import LlavaModel
    from ..sessions.session import Session
    from ..sessions.store import SessionStore

__all__ = [
    "OomAttempt",
    "available_host_bytes",
    "default_device_budget",
    "device_bytes",
    "is_oom",
    "kv_grant_bytes",
    "new_session_bytes",
    "oom_attempts",
]

log = logging.getLogger(__name__)


def available_host_bytes() -> int:
    """Host memory available now (``sysconf`` available pages x page size), bytes."""
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def default_device_budget(model: LlavaModel, fraction: float, reserve_bytes: int = 0) -> int:
    """``fraction`` of the device memory free now (CUDA ``mem_get_info``), or of available host
    memory (:func:`available_host_bytes`) on CPU, less ``reserve_bytes`` first (what the CUDA graphs
    will keep); bytes, at least 1."""
    if model.device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(model.device)
    else:
        free = available_host_bytes()
    return max(1, int(max(0, free - reserve_bytes) * fraction))


def is_oom(exc: BaseException) -> bool:
    """Whether ``exc`` is the device allocator running out of memory."""
    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()


class OomAttempt:
    """One attempt of a forward pass (:func:`oom_attempts`): a context manager that, on the device
    allocator running out of memory, demotes every idle session but ``keep`` and lets the caller's
    loop try again, or, on the last attempt, raises ``overloaded``."""

    def __init__(self, store: SessionStore, keep: Session | None, *, last: bool) -> None:
        self.store, self.keep, self.last = store, keep, last
        self.failed = False

    def __enter__(self) -> OomAttempt:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> bool:
        if exc is None or not is_oom(exc):
            return False  # done, or an error that is not the allocator's: it propagates
        if self.last:
            raise overloaded("the device is out of memory; retry later", "step_memory") from exc
        log.warning("out of memory; demoting idle sessions and retrying once")
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        self.store.demote_all(keep=self.keep)
        self.failed = True
        return True  # swallowed: the loop makes the second attempt


def oom_attempts(store: SessionStore, *, keep: Session | None) -> Iterator[OomAttempt]:
    """Attempts of a forward pass, run in the caller's own frame (no callback)::

        for attempt in oom_attempts(store, keep=session):
            with attempt:
                out = runner.prefill(...)

    The first runs it; after an out-of-memory error every idle session but ``keep`` is demoted and
    a second runs it again; a second out-of-memory error raises ServiceError(overloaded). Any other
    error propagates from the attempt that raised it.
    """
    first = OomAttempt(store, keep, last=False)
    yield first
    if first.failed:
        yield OomAttempt(store, keep, last=True)


def device_bytes(model: LlavaModel, num_kv_tokens: int, num_feature_tokens: int = 0) -> int:
    """Device bytes of ``num_kv_tokens`` tokens of KV cache (``kv_bytes_per_token`` each) and
    ``num_feature_tokens`` rows of image features (hidden x dtype bytes each)."""
    return num_feature_tokens * model.feature_bytes_per_token + num_kv_tokens * model.kv_bytes_per_token


def kv_grant_bytes(model: LlavaModel, page_size: int, held_tokens: int, num_tokens: int) -> int:
    """Device bytes the ledger books more for a KV cache of ``held_tokens`` positions once it holds
    ``num_tokens``: the whole pages of ``page_size`` positions it takes beyond those it holds (a cache
    in the KV pool is booked by its pages: :attr:`SessionKV.num_held_tokens
    <llava_sessions.model.SessionKV.num_held_tokens>`; ``page_size`` 0: the positions alone); 0 when it
    does not grow."""
    if page_size:
        held_tokens = -(-held_tokens // page_size) * page_size
        num_tokens = -(-num_tokens // page_size) * page_size
    return max(0, num_tokens - held_tokens) * model.kv_bytes_per_token


def new_session_bytes(
    model: LlavaModel, num_prefix_tokens: int, num_image_tokens: int | None = None, page_size: int = 0
) -> int:
    """Device bytes a new session takes in the ``kv`` tier: its image features (``num_image_tokens``,
    default one base tile) plus the KV cache of its ``num_prefix_tokens`` (in whole pages of
    ``page_size`` positions: :func:`kv_grant_bytes`)."""
    image_tokens = model.num_image_tokens if num_image_tokens is None else num_image_tokens
    return device_bytes(model, 0, image_tokens) + kv_grant_bytes(model, page_size, 0, num_prefix_tokens)
