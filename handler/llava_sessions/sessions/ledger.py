"""The session ledger: the sessions' memory as plain integers, apart from the tensors.

Shaped like vLLM v1's KV cache manager and block pool (``vllm/v1/core/kv_cache_manager.py``,
``block_pool.py``): bookkeeping apart from memory, admission in phases, eviction at allocation time,
least recently used first. For each session it holds the number of KV-cache tokens it keeps on the
device, the bytes of its image features, its host bytes (encoded image + conversation) and whether
it is pinned (answering: never demoted or evicted). Totals are running sums, so every question the
scheduler and the metrics ask costs O(1), not a walk over tensors.

The ledger decides; the store and the engine act: :meth:`SessionLedger.allocate` returns which
sessions to demote (and books them as demoted), the caller frees their tensors. An expected
shortage returns None; a caller error (an unknown id, a negative size) raises; invariants assert.
No torch here.
"""

from __future__ import annotations

import dataclasses
import enum
from collections import OrderedDict
from dataclasses import dataclass

__all__ = ["Demotion", "LedgerEntry", "SessionLedger", "Tier", "tier_of"]


class Tier(str, enum.Enum):
    """What a session holds on the device: ``kv`` (KV cache + features), ``features`` (image features
    only), ``image`` (nothing on the device: its images' encoded bytes and the conversation on the
    host, as every tier keeps)."""

    KV = "kv"
    FEATURES = "features"
    IMAGE = "image"


def tier_of(num_kv_tokens: int, num_feature_bytes: int) -> Tier:
    """The tier of a session holding ``num_kv_tokens`` KV-cache tokens and ``num_feature_bytes`` of
    image features on the device (the one definition: the ledger's entries and the sessions use it)."""
    if num_kv_tokens:
        return Tier.KV
    if num_feature_bytes:
        return Tier.FEATURES
    return Tier.IMAGE


@dataclass
class LedgerEntry:
    """One session's memory: ``num_kv_tokens`` on the device, ``num_feature_bytes`` of image
    features on the device, ``num_host_bytes`` on the host; ``pinned`` while it answers; ``cached``
    for a conversation-cache entry (no client holds it: it goes first, whole, when room is needed)."""

    session_id: str
    num_kv_tokens: int = 0
    num_feature_bytes: int = 0
    num_host_bytes: int = 0
    pinned: bool = False
    cached: bool = False

    @property
    def tier(self) -> Tier:
        """The tier these numbers describe (:func:`tier_of`)."""
        return tier_of(self.num_kv_tokens, self.num_feature_bytes)


@dataclass(frozen=True)
class Demotion:
    """Demote ``session_id`` to ``to`` (``features``: free its KV cache; ``image``: free its KV cache
    and its features), freeing ``num_bytes`` device bytes."""

    session_id: str
    to: Tier
    num_bytes: int


class SessionLedger:
    """Device and host bytes of every session under two budgets, with an LRU order of sessions.

    Args:
        kv_bytes_per_token: bytes one token of KV cache costs (2 x layers x kv_heads x head_dim x
            dtype size; llava-1.5-7b fp16: 524,288).
        device_budget_bytes: most device bytes (KV caches + image features).
        host_budget_bytes: most host bytes (encoded images + conversations).

    Raises:
        ValueError: a budget or the per-token size is not > 0.
    """

    def __init__(self, *, kv_bytes_per_token: int, device_budget_bytes: int, host_budget_bytes: int) -> None:
        if kv_bytes_per_token <= 0 or device_budget_bytes <= 0 or host_budget_bytes <= 0:
            raise ValueError("kv_bytes_per_token and the budgets must be > 0 bytes")
        self.kv_bytes_per_token = kv_bytes_per_token
        self.device_budget_bytes = device_budget_bytes
        self.host_budget_bytes = host_budget_bytes
        self._entries: OrderedDict[str, LedgerEntry] = OrderedDict()  # least recently used first
        self._num_kv_tokens = 0
        self._num_feature_bytes = 0
        self._num_host_bytes = 0

    # ------------------------------------------------------------------ queries
    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._entries

    def entry(self, session_id: str) -> LedgerEntry:
        """The entry of ``session_id`` (read it, do not change it).

        Raises:
            KeyError: unknown id.
        """
        return self._entries[session_id]

    def lru(self) -> list[str]:
        """Session ids, least recently used first."""
        return list(self._entries)

    @property
    def num_kv_bytes(self) -> int:
        """Device bytes of the sessions' KV caches."""
        return self._num_kv_tokens * self.kv_bytes_per_token

    @property
    def num_feature_bytes(self) -> int:
        """Device bytes of the sessions' image features."""
        return self._num_feature_bytes

    @property
    def num_device_bytes(self) -> int:
        """Device bytes in use: KV caches + features."""
        return self.num_kv_bytes + self._num_feature_bytes

    @property
    def num_host_bytes(self) -> int:
        """Host bytes in use: encoded images + conversations."""
        return self._num_host_bytes

    @property
    def usage(self) -> float:
        """Device bytes in use over the device budget, 0.0 to 1.0 (more when over budget)."""
        return self.num_device_bytes / self.device_budget_bytes

    # ------------------------------------------------------------------ registry
    def add(self, session_id: str, num_host_bytes: int) -> None:
        """Register a session (most recently used) holding ``num_host_bytes`` on the host, nothing on the device.

        Raises:
            ValueError: the id is registered already, or a size is negative.
        """
        if session_id in self._entries:
            raise ValueError(f"session {session_id!r} is in the ledger already")
        self._entries[session_id] = LedgerEntry(session_id)
        self.set_usage(session_id, num_host_bytes=num_host_bytes)

    def remove(self, session_id: str) -> LedgerEntry:
        """Forget a session and everything it held; returns its last entry.

        Raises:
            KeyError: unknown id.
        """
        last = dataclasses.replace(self._entries[session_id])
        self.set_usage(session_id, num_kv_tokens=0, num_feature_bytes=0, num_host_bytes=0)
        del self._entries[session_id]
        return last

    def touch(self, session_id: str) -> None:
        """Mark a session most recently used.

        Raises:
            KeyError: unknown id.
        """
        self._entries.move_to_end(session_id)

    def pin(self, session_id: str, pinned: bool = True) -> None:
        """Pin (answering: never demoted nor evicted) or unpin a session.

        Raises:
            KeyError: unknown id.
        """
        self._entries[session_id].pinned = pinned

    def mark_cached(self, session_id: str) -> None:
        """Make a session's entry a conversation-cache entry (dropped before any session is demoted).

        Raises:
            KeyError: unknown id.
        """
        self._entries[session_id].cached = True

    def device_bytes_of(self, entry: LedgerEntry) -> int:
        """Device bytes ``entry`` holds (KV + features)."""
        return entry.num_kv_tokens * self.kv_bytes_per_token + entry.num_feature_bytes

    @property
    def num_cache_bytes(self) -> int:
        """Device bytes of the conversation-cache entries (O(entries))."""
        return sum(self.device_bytes_of(e) for e in self._entries.values() if e.cached)

    def cache_over(self, limit: int, keep: str | None = None) -> list[str]:
        """Unpinned conversation-cache entries but ``keep`` to drop, least recently used first, until
        their device bytes are at most ``limit`` (as far as possible). Not booked: the caller removes them."""
        over = self.num_cache_bytes - limit
        out: list[str] = []
        for e in self._entries.values():
            if over <= 0:
                break
            if e.cached and not e.pinned and e.session_id != keep:
                out.append(e.session_id)
                over -= self.device_bytes_of(e)
        return out

    def set_usage(
        self,
        session_id: str,
        *,
        num_kv_tokens: int | None = None,
        num_feature_bytes: int | None = None,
        num_host_bytes: int | None = None,
    ) -> None:
        """Record what a session holds now (None: unchanged).

        Raises:
            KeyError: unknown id. ValueError: a negative size.
        """
        e = self._entries[session_id]
        if num_kv_tokens is not None:
            if num_kv_tokens < 0:
                raise ValueError("num_kv_tokens must be >= 0")
            self._num_kv_tokens += num_kv_tokens - e.num_kv_tokens
            e.num_kv_tokens = num_kv_tokens
        if num_feature_bytes is not None:
            if num_feature_bytes < 0:
                raise ValueError("num_feature_bytes must be >= 0")
            self._num_feature_bytes += num_feature_bytes - e.num_feature_bytes
            e.num_feature_bytes = num_feature_bytes
        if num_host_bytes is not None:
            if num_host_bytes < 0:
                raise ValueError("num_host_bytes must be >= 0")
            self._num_host_bytes += num_host_bytes - e.num_host_bytes
            e.num_host_bytes = num_host_bytes
        assert self._num_kv_tokens >= 0 and self._num_feature_bytes >= 0 and self._num_host_bytes >= 0

    # ------------------------------------------------------------------ admission
    def room_bytes(self, keep: str | None = None) -> int:
        """The most device bytes :meth:`allocate` can make room for: the budget less what stays once
        every unpinned session but ``keep`` is demoted to the ``image`` tier (negative: over budget
        even then). Nothing changes."""
        freeable = sum(self.device_bytes_of(e) for e in self._entries.values() if not e.pinned and e.session_id != keep)
        return self.device_budget_bytes - (self.num_device_bytes - freeable)

    def can_allocate(self, num_bytes: int, keep: str | None = None) -> bool:
        """Whether ``num_bytes`` more device bytes fit once every unpinned session but ``keep`` is
        demoted to the ``image`` tier (nothing changes)."""
        return num_bytes <= self.room_bytes(keep)

    def allocate(self, num_bytes: int, keep: str | None = None) -> list[Demotion] | None:
        """Make room for ``num_bytes`` more device bytes by demoting unpinned sessions but ``keep``.

        Conversation-cache entries go first (least recently used first, whole), then KV caches
        (least recently used first), then features, so a session loses its
        cheapest-to-rebuild state before another loses its image features. The demotions are
        booked here; the caller frees the tensors they name. ``num_bytes`` itself is not booked:
        record it with :meth:`set_usage` once it is held.

        Returns:
            The demotions (possibly none), or None when even demoting every such session is not
            enough; then nothing changes.

        Raises:
            ValueError: ``num_bytes`` < 0.
        """
        if num_bytes < 0:
            raise ValueError("num_bytes must be >= 0")
        if not self.can_allocate(num_bytes, keep):
            return None
        return self._demote_until(self.device_budget_bytes - num_bytes, keep)

    def enforce(self, keep: str | None = None) -> list[Demotion]:
        """Demote unpinned sessions but ``keep`` until within the device budget (as far as possible)."""
        return self._demote_until(self.device_budget_bytes, keep)

    def demote_all(self, keep: str | None = None) -> list[Demotion]:
        """Demote every unpinned session but ``keep`` to the ``image`` tier (booked); returns the demotions."""
        return self._demote_until(-1, keep)

    def evictions(self, keep: str | None = None) -> list[str]:
        """Unpinned sessions but ``keep`` to drop, least recently used first, until within the host
        budget (as far as possible). Not booked: the caller :meth:`remove` s them."""
        over = self._num_host_bytes - self.host_budget_bytes
        out: list[str] = []
        entries = self._entries.values()
        for e in [*(e for e in entries if e.cached), *(e for e in entries if not e.cached)]:
            if over <= 0:
                break
            if e.pinned or e.session_id == keep:
                continue
            out.append(e.session_id)
            over -= e.num_host_bytes
        return out

    def _demote_until(self, limit: int, keep: str | None) -> list[Demotion]:
        out: list[Demotion] = []
        for e in self._entries.values():  # conversation-cache entries first, whole (the store drops them)
            if self.num_device_bytes <= limit:
                return out
            freed = self.device_bytes_of(e)
            if e.cached and not e.pinned and e.session_id != keep and freed:
                self.set_usage(e.session_id, num_kv_tokens=0, num_feature_bytes=0)
                out.append(Demotion(e.session_id, Tier.IMAGE, freed))
        for to in (Tier.FEATURES, Tier.IMAGE):  # then KV caches (big), then features (small)
            for e in self._entries.values():  # least recently used first
                if self.num_device_bytes <= limit:
                    return out
                if e.pinned or e.session_id == keep:
                    continue
                freed = e.num_kv_tokens * self.kv_bytes_per_token
                if to is Tier.IMAGE:
                    freed += e.num_feature_bytes
                if freed == 0:
                    continue
                self.set_usage(e.session_id, num_kv_tokens=0, num_feature_bytes=None if to is Tier.FEATURES else 0)
                out.append(Demotion(e.session_id, to, freed))
        return out
