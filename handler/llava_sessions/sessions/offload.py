"""Demoted sessions' KV moved to host memory, and moved back on their next question.

When the store demotes an idle session from the ``kv`` tier (its KV dropped from the device), a
session whose KV is in the replica's pool (:class:`~llava_sessions.model.SessionKV`) first has its
pages copied to the host: every layer's keys and values over its cached positions, ``[1, kv_heads,
n, head_dim]`` each (pinned memory on a CUDA device, so the copy back is a DMA). The pages then go
back to the pool as before. On the session's next question the restore writes the copy into fresh
pages (:meth:`SessionKV.extend <llava_sessions.model.SessionKV.extend>`) instead of prefilling the
conversation again; the answer reports those positions as cached. The copies live under their own
host byte budget (``kv_offload_bytes``, apart from the host budget of images and conversations): an
offload that does not fit drops the oldest copies first; a copy larger than the budget is not made
(the session recomputes, as without offload). A copy is dropped when its session is closed,
evicted, expired or gets KV on the device again another way.

vLLM's KV offloading (``--kv-offloading-size``, its CPU offloading connector) is the anchor; its
preemption recomputes, as ours does: only demotion moves pages.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..conversation import common_prefix_len
from ..model import SessionKV

if TYPE_CHECKING:
    from .session import Session

__all__ = ["HostKV", "KVOffload"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HostKV:
    """A session's KV on the host: the token ``ids`` it covers, the content keys of the session's
    images then (``image_keys``: placeholder ids are alike for every image, so the KV is reused only
    under the same images), and every layer's ``keys`` / ``values`` ``[1, kv_heads, len(ids),
    head_dim]`` (model dtype; ``nbytes`` in all)."""

    ids: list[int]
    image_keys: list[str]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    nbytes: int


class KVOffload:
    """The host copies of demoted sessions' KV, under ``budget_bytes`` (module docstring).

    Args:
        budget_bytes: most host bytes the copies hold at once (0: no copy is ever made).

    Attributes:
        num_bytes: host bytes the copies hold now.
        num_offloads / num_loads / num_dropped: copies made, moved back, dropped unused (counters).
    """

    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes < 0:
            raise ValueError(f"kv_offload_bytes must be >= 0, not {budget_bytes}")
        self.budget_bytes = budget_bytes
        self._held: OrderedDict[str, HostKV] = OrderedDict()
        self.num_bytes = 0
        self.num_offloads = 0
        self.num_loads = 0
        self.num_dropped = 0

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._held

    def offload(self, session: Session) -> bool:
        """Copy ``session``'s KV (an idle session about to be demoted) to the host, dropping the
        oldest copies while the budget lacks room; the caller drops the device KV after.

        Returns:
            Whether a copy was made (False: no budget, a cache outside the pool, nothing cached,
            larger than the whole budget, or the copy failed, e.g. no page-locked host memory: logged).
        """
        cache, ids = session.kv_cache, list(session.cached_ids)
        if not self.budget_bytes or cache is None or not ids:
            return False
        nbytes = len(ids) * cache.pool.pages.bytes_per_page // cache.pool.page_size
        if nbytes > self.budget_bytes:
            return False
        self.forget(session.session_id)
        while self.num_bytes + nbytes > self.budget_bytes:
            self._pop(next(iter(self._held)))
            self.num_dropped += 1
        try:
            host = _host_copy(cache)
        except Exception:  # noqa: BLE001 - a copy is an optimization: dropping the KV is always correct
            log.warning("a demoted session's KV could not be copied to the host; it is dropped", exc_info=True)
            return False
        self._held[session.session_id] = HostKV(ids, list(session.image_keys), list(host[0]), list(host[1]), nbytes)
        self.num_bytes += nbytes
        self.num_offloads += 1
        return True

    def take(self, session_id: str) -> HostKV | None:
        """Hand over ``session_id``'s copy (it leaves the budget), or None."""
        return self._pop(session_id)

    def forget(self, session_id: str) -> None:
        """Drop ``session_id``'s copy, if any (its session is gone or holds KV on the device again)."""
        if self._pop(session_id) is not None:
            self.num_dropped += 1

    def load(self, held: HostKV, cache: SessionKV, ids: list[int], image_keys: list[str]) -> int:
        """Write into the empty ``cache`` the positions of ``held`` that ``ids`` (the prompt about to
        be prefilled) starts with, less its last (at least one token is always prefilled), when the
        session's images ``image_keys`` still start with the ones ``held`` was computed over.

        Returns:
            The positions written (0: nothing matched, or an image of ``held`` is no longer the session's).

        Raises:
            torch.OutOfMemoryError: no room in the pool (nothing written).
        """
        same_images = image_keys[: len(held.image_keys)] == held.image_keys
        n = min(common_prefix_len(held.ids, ids), len(ids) - 1) if same_images else 0
        if n > 0:
            device = cache.pool.pages.keys[0].device
            keys = [k[:, :, :n].to(device, non_blocking=True) for k in held.keys]
            values = [v[:, :, :n].to(device, non_blocking=True) for v in held.values]
            cache.extend(keys, values)
            self.num_loads += 1
        return n

    def _pop(self, session_id: str) -> HostKV | None:
        held = self._held.pop(session_id, None)
        if held is not None:
            self.num_bytes -= held.nbytes
        return held


def _host_copy(cache: SessionKV) -> torch.Tensor:
    """Every layer's keys and values of ``cache`` in one host tensor ``[2, layers, 1, kv_heads, n,
    head_dim]`` (pinned from a CUDA device: one page-locked allocation, and the copy back is a DMA),
    gathered and copied one layer at a time, so the device holds one layer's copy at once beside the pool."""
    k0, v0 = cache.layer_states(0)
    on_gpu = k0.device.type == "cuda"
    host = torch.empty((2, len(cache.layers), *k0.shape), dtype=k0.dtype, pin_memory=on_gpu)
    for i in range(len(cache.layers)):
        keys, values = (k0, v0) if i == 0 else cache.layer_states(i)
        host[0, i].copy_(keys)
        host[1, i].copy_(values)
    return host
