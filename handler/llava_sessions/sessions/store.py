"""Sessions, their memory tiers, and the store that keeps them under a byte budget.

A session holds, from most to least costly to rebuild:

=========== ================================================ ===============================
tier        what is held                                      restored on the next request by
=========== ================================================ ===============================
``kv``      KV cache of the conversation prefix + features   nothing (prefill the new tokens)
``features`` projected image features on the device           re-prefill the conversation
``image``   encoded image bytes + conversation (host only)    re-encode the image, re-prefill
=========== ================================================ ===============================

Every tier also keeps the encoded image bytes and the conversation on the host, so a demoted
session answers exactly as if it had never been demoted. The store keeps the sessions (their
tensors, TTL, tombstones); every byte decision is its :class:`~.ledger.SessionLedger`'s, a ledger of
plain integers (KV tokens x bytes per token, feature bytes, host bytes: the image bytes plus the
UTF-8 conversation text) apart from the tensors, like vLLM v1's KV-cache manager. The store tells the
ledger what the sessions hold (each session marks its own changes, :attr:`Session.changed`, and the
store records the changed ones before every decision and every read of its numbers) and applies the
demotions it decides. Its memory API is vLLM's and nano-vllm's: :meth:`SessionStore.can_allocate`,
:meth:`SessionStore.allocate` (room made by demoting idle sessions), :meth:`SessionStore.pin` /
:meth:`SessionStore.unpin` (an answering session is never demoted), :meth:`SessionStore.release`,
:meth:`SessionStore.remove`.

Over the device budget the least-recently-used idle sessions are demoted one tier at a time:
first KV caches are dropped (LRU first), then image features. Past the host cap, and only
then, LRU idle sessions are dropped whole; their ids are remembered (a bounded tombstone map)
so their next request gets ``session_evicted`` rather than a wrong answer. TTL: an absolute
expiry fixed at open (whole seconds: the instant the SageMaker ``Expires`` header carries) plus
an optional idle timeout; expired sessions are freed lazily, on access or :meth:`sweep`.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from ..conversation import Turn, image_key
from ..errors import ErrorCode, ServiceError, counted, overloaded
from .ledger import Demotion, SessionLedger, Tier
from .offload import KVOffload
from .session import Session, SessionSnapshot

__all__ = ["Session", "SessionSnapshot", "SessionStore", "StoreStats", "Tier"]

log = logging.getLogger(__name__)


@dataclass
class StoreStats:
    """Counters since start (monotonic); read with :meth:`SessionStore.stats`."""

    num_expired: int = 0
    num_evicted: int = 0
    num_demotions_kv: int = 0
    num_demotions_features: int = 0
    num_restores: int = 0
    num_cache_evictions: int = 0
    num_kv_offloads: int = 0


class SessionStore:
    """All sessions of one worker, under a device byte budget and a host byte cap.

    Admission in phases, like vLLM's managers: :meth:`add` a session (host cap enforced),
    :meth:`allocate` device bytes before growing one (LRU demotion of the others) with it
    :meth:`pin` ned, :meth:`release` it after (unpinned, then :meth:`enforce`), :meth:`remove` on close. The numbers behind each decision are the ledger's
    (:attr:`ledger`); before each decision or read it records what the changed sessions hold
    (:attr:`Session.changed`).

    Args:
        device_budget_bytes: most bytes of KV caches + image features at once.
        host_budget_bytes: most bytes of encoded images + conversations held at once.
        kv_bytes_per_token: KV-cache bytes of one token (the model's ``kv_bytes_per_token``).
        max_sessions: most sessions held at once.
        ttl_s: absolute lifetime of a session from open, s.
        idle_timeout_s: a session idle this long expires, s (0 = off).
        clock: time source in epoch seconds (injectable for tests).
        max_tombstones: how many expired/evicted/closed ids are remembered for precise errors.
        kv_offload_bytes: host bytes for demoted sessions' KV pages (:mod:`.offload`; 0: a demotion
            drops the KV, recomputed on the next question).

    Attributes:
        offload: the host copies of demoted sessions' KV (:class:`~.offload.KVOffload`).

    Raises:
        ValueError: a budget or ``kv_bytes_per_token`` is not > 0.
    """

    def __init__(
        self,
        *,
        device_budget_bytes: int,
        host_budget_bytes: int,
        kv_bytes_per_token: int,
        max_sessions: int = 128,
        ttl_s: int = 1200,
        idle_timeout_s: int = 0,
        clock: Callable[[], float] = time.time,
        max_tombstones: int = 10_000,
        kv_offload_bytes: int = 0,
    ) -> None:
        if device_budget_bytes <= 0 or host_budget_bytes <= 0:
            raise ValueError("budgets must be > 0 bytes")
        self._ledger = SessionLedger(
            kv_bytes_per_token=kv_bytes_per_token,
            device_budget_bytes=device_budget_bytes,
            host_budget_bytes=host_budget_bytes,
        )
        self.max_sessions = max_sessions
        self.ttl_s = ttl_s
        self.idle_timeout_s = idle_timeout_s
        self.clock = clock
        self._sessions: dict[str, Session] = {}
        self._tombstones: OrderedDict[str, ErrorCode] = OrderedDict()
        self._max_tombstones = max_tombstones
        self.stats = StoreStats()
        self.offload = KVOffload(kv_offload_bytes)

    # ------------------------------------------------------------------ queries
    def __len__(self) -> int:
        """Open sessions (conversation-cache entries not counted)."""
        return sum(not s.anonymous for s in self._sessions.values())

    @property
    def num_cache_entries(self) -> int:
        """Conversation-cache entries held (:meth:`retain`)."""
        return sum(s.anonymous for s in self._sessions.values())

    @property
    def num_cache_bytes(self) -> int:
        """Device bytes the conversation-cache entries hold."""
        return self.ledger.num_cache_bytes

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._sessions

    @property
    def device_budget_bytes(self) -> int:
        """The device byte budget."""
        return self._ledger.device_budget_bytes

    @property
    def host_budget_bytes(self) -> int:
        """The host byte cap."""
        return self._ledger.host_budget_bytes

    def sessions(self) -> list[Session]:
        """Sessions, least recently used first."""
        return [self._sessions[sid] for sid in self._ledger.lru()]

    def device_bytes(self) -> int:
        """Bytes of KV caches + image features over all sessions (O(sessions)); a running answer's KV is
        its session's."""
        self._refresh()
        return self._ledger.num_device_bytes

    def host_bytes(self) -> int:
        """Bytes of encoded images + conversations over all sessions (O(sessions))."""
        self._refresh()
        return self._ledger.num_host_bytes

    def bytes_by_tier(self) -> dict[str, int]:
        """``{"kv": KV bytes, "features": feature bytes, "image": host bytes}``."""
        self._refresh()
        led = self._ledger
        return {
            "kv": led.num_kv_bytes,
            "features": led.num_feature_bytes,
            "image": led.num_host_bytes,
        }

    @property
    def ledger(self) -> SessionLedger:
        """The ledger, up to date with what every session holds now."""
        self._refresh()
        return self._ledger

    def _refresh(self) -> None:
        """Record in the ledger what every changed session holds now (O(sessions) flag reads)."""
        for session in self._sessions.values():
            if session.changed:
                self._sync(session)

    def _sync(self, session: Session) -> None:
        """Record in the ledger what ``session`` holds now (its KV tokens, feature and host bytes,
        whether it is answering)."""
        if self._sessions.get(session.session_id) is not session:
            return
        session.changed = False
        self._ledger.set_usage(
            session.session_id,
            num_kv_tokens=session.num_held_kv_tokens,
            num_feature_bytes=session.feature_bytes,
            num_host_bytes=session.host_bytes,
        )
        self._ledger.pin(session.session_id, session.busy)

    def new_session(
        self,
        session_id: str,
        system_prompt: str | None,
        images: list[bytes],
        image_sizes: list[tuple[int, ...]],
        image_tokens: list[int],
        history: list[Turn] | None = None,
    ) -> Session:
        """Create (not add) a session with its expiry fixed now (``floor(now) + ttl_s``), holding
        ``images`` (encoded, in conversation order) with their sizes and placeholder counts and the
        remembered ``history``; the images no turn of ``history`` places open the next question."""
        now = self.clock()
        history = list(history or [])
        return Session(
            session_id=session_id,
            images=list(images),
            system_prompt=system_prompt,
            opened_at=now,
            expires_at=int(now) + self.ttl_s,
            last_used=now,
            image_sizes=list(image_sizes),
            image_tokens=list(image_tokens),
            pending_images=len(images) - sum(t.images for t in history),
            history=history,
            image_keys=[image_key(data) for data in images],
        )

    def pin(self, session: Session) -> None:
        """Mark ``session`` as answering: pinned, never demoted nor evicted (in the ledger too)."""
        session.busy = True
        self._sync(session)

    def unpin(self, session: Session) -> None:
        """Mark ``session`` idle again (in the ledger too): it may be demoted or evicted from now on."""
        session.busy = False
        self._sync(session)

    def release(self, session: Session) -> None:
        """End ``session``'s request: :meth:`unpin` it, then demote or evict other idle sessions
        while over a budget (:meth:`enforce`; ``session`` itself stays)."""
        self.unpin(session)
        self.enforce(keep=session)

    def check_invariants(self) -> None:
        """Assert every session's own invariants (:meth:`Session.check_invariants`) and that the
        ledger holds what each session holds (KV tokens, feature and host bytes, pinned iff busy)."""
        self._refresh()
        assert len(self._ledger) == len(self._sessions)
        for session in self._sessions.values():
            session.check_invariants()
            entry = self._ledger.entry(session.session_id)
            held = (session.num_held_kv_tokens, session.feature_bytes, session.host_bytes, session.busy)
            assert (entry.num_kv_tokens, entry.num_feature_bytes, entry.num_host_bytes, entry.pinned) == held, (
                session.session_id,
                entry,
                held,
            )

    def add(self, session: Session) -> None:
        """Admit ``session`` as most recently used.

        Raises:
            ServiceError(invalid_request): the id is already open.
            ServiceError(overloaded): ``max_sessions`` are open, or its host bytes alone exceed the cap.
        """
        self.sweep()
        if session.session_id in self._sessions:
            raise ServiceError(ErrorCode.INVALID_REQUEST, "a session with this id is already open")
        if len(self) >= self.max_sessions:
            raise overloaded(
                f"this worker holds its maximum of {counted(self.max_sessions, 'session')}", "session_room"
            )
        if session.host_bytes > self.host_budget_bytes:
            raise overloaded("the session does not fit in host memory", "session_room")
        self._sessions[session.session_id] = session
        self._ledger.add(session.session_id, session.host_bytes)
        self._sync(session)
        self._tombstones.pop(session.session_id, None)
        self.enforce(keep=session)

    def hold_sample(self, session: Session) -> None:
        """Hold ``session``, busy, outside ``max_sessions``: a copy of a session's conversation that no
        client names (``anonymous``), which another answer of a request of several runs on
        (:mod:`~llava_sessions.engine.samples`); :meth:`discard` frees it."""
        assert session.anonymous and session.session_id not in self._sessions
        session.busy = True
        self._sessions[session.session_id] = session
        self._ledger.add(session.session_id, session.host_bytes)
        self._sync(session)

    def discard(self, session: Session) -> None:
        """Free a session :meth:`hold_sample` held (its answer ended), at once; no-op when gone."""
        if self._sessions.get(session.session_id) is session:
            self._drop(session, ErrorCode.SESSION_NOT_FOUND)

    def get(self, session_id: str) -> Session:
        """Return the open session ``session_id`` and mark it most recently used.

        Raises:
            ServiceError(session_expired | session_evicted | session_not_found).
        """
        self.sweep()
        session = self._sessions.get(session_id)
        if session is None or session.anonymous:  # a conversation-cache entry is no client's session
            code = self._tombstones.get(session_id, ErrorCode.SESSION_NOT_FOUND)
            messages = {
                ErrorCode.SESSION_EXPIRED: "the session has expired; open a new one",
                ErrorCode.SESSION_EVICTED: "the session was evicted because the server ran out of memory; open a new one",
                ErrorCode.SESSION_NOT_FOUND: "no open session with this id on this worker",
            }
            raise ServiceError(code, messages[code])
        session.last_used = self.clock()
        self._ledger.touch(session_id)
        return session

    def touch(self, session: Session) -> None:
        """Mark ``session`` (a session or a conversation-cache entry whose state was just reused) most
        recently used, without the checks of :meth:`get`."""
        if self._sessions.get(session.session_id) is session:
            session.last_used = self.clock()
            self._ledger.touch(session.session_id)

    def peek(self, session_id: str) -> Session | None:
        """The open session ``session_id`` or None, without marking it used or sweeping."""
        return self._sessions.get(session_id)

    def remove(self, session_id: str) -> Session:
        """Close ``session_id`` and free everything it holds.

        Raises:
            ServiceError(session_*): as :meth:`get`.
        """
        session = self.get(session_id)
        self._drop(session, ErrorCode.SESSION_NOT_FOUND)
        return session

    def sweep(self) -> int:
        """Free every expired idle session (TTL or idle timeout); returns how many."""
        now = self.clock()
        expired = [s for s in self._sessions.values() if not s.busy and self._is_expired(s, now)]
        for s in expired:
            self._drop(s, ErrorCode.SESSION_EXPIRED)
            if not s.anonymous:
                self.stats.num_expired += 1
                log.info("session expired", extra={"session_id": s.session_id})
        return len(expired)

    def _drop(self, session: Session, code: ErrorCode) -> None:
        del self._sessions[session.session_id]
        self._ledger.remove(session.session_id)
        self.offload.forget(session.session_id)
        session.drop_features()
        if session.anonymous:  # no client knows its id: nothing to tell anyone
            self.stats.num_cache_evictions += code is ErrorCode.SESSION_EVICTED
        else:
            self._bury(session.session_id, code)

    # ------------------------------------------------------------------ the conversation cache
    def retain(self, session: Session, *, max_bytes: int, max_entries: int, drop: Session | None = None) -> bool:
        """Keep the state a chat request without a session leaves (its images, features and KV of
        prompt and answer) as an anonymous conversation-cache entry, instead of removing it.

        Entries are dropped, least recently used first and whole, before any session is demoted or
        evicted (:meth:`SessionLedger.allocate`); here, until they hold at most ``max_bytes`` device
        bytes and ``max_entries`` entries, and until the device budget holds without demoting a
        session (the new entry itself goes when it does not fit beside the sessions).

        Args:
            session: the request's idle session (not yet an entry).
            max_bytes: the share of the device budget entries may hold, bytes.
            max_entries: most entries held.
            drop: an entry the new one makes redundant (the same conversation's earlier turn), dropped first.

        Returns:
            Whether the entry is held.
        """
        if self._sessions.get(session.session_id) is not session or session.busy:
            return False
        session.anonymous = True
        self._ledger.mark_cached(session.session_id)
        self._sync(session)
        if drop is not None and drop.anonymous and not drop.busy and drop.session_id in self._sessions:
            self._drop(drop, ErrorCode.SESSION_NOT_FOUND)
        self._refresh()
        for sid in self._ledger.cache_over(max_bytes):
            self._drop(self._sessions[sid], ErrorCode.SESSION_EVICTED)
        entries = [s for s in self.sessions() if s.anonymous and not s.busy]
        for old in entries[: max(0, len(entries) - max_entries)]:
            self._drop(old, ErrorCode.SESSION_EVICTED)
        self.enforce()
        return session.session_id in self._sessions

    def _is_expired(self, s: Session, now: float) -> bool:
        return now >= s.expires_at or (self.idle_timeout_s > 0 and now - s.last_used >= self.idle_timeout_s)

    def _bury(self, session_id: str, code: ErrorCode) -> None:
        self._tombstones[session_id] = code
        self._tombstones.move_to_end(session_id)
        while len(self._tombstones) > self._max_tombstones:
            self._tombstones.popitem(last=False)

    # ------------------------------------------------------------------ budget
    def room_bytes(self) -> int:
        """The most device bytes :meth:`allocate` can make room for now (demoting every idle session;
        negative: over budget even then), the scheduler's ``room_bytes`` (rule 11)."""
        self._refresh()
        return self._ledger.room_bytes()

    def can_allocate(self, num_bytes: int, keep: Session | None = None) -> bool:
        """Whether :meth:`allocate` would find room for ``num_bytes`` (nothing changes)."""
        self._refresh()
        return self._ledger.can_allocate(num_bytes, keep=None if keep is None else keep.session_id)

    def allocate(self, num_bytes: int, keep: Session | None) -> bool:
        """Make room for ``num_bytes`` more device bytes for ``keep`` by demoting other idle sessions.

        Returns:
            True when ``device_bytes() + num_bytes <= device_budget_bytes`` afterwards; False when
            even demoting every other idle session to the ``image`` tier would not be enough (then
            nothing is demoted, nothing is lost).
        """
        self._refresh()
        demotions = self._ledger.allocate(num_bytes, keep=None if keep is None else keep.session_id)
        if demotions is None:
            return False
        self._apply(demotions)
        return True

    def demote(self, session_id: str, to: Tier) -> None:
        """Demote the idle session ``session_id`` to tier ``to`` now (``features``: free its KV cache,
        its pages copied to the host first when the offload budget has room; ``image``: its features
        too, any KV likewise copied first), as the budget would (tests and benchmarks use it).

        Raises:
            ServiceError(session_*): as :meth:`get`. ValueError: the session is busy, or ``to`` is ``kv``.
        """
        session = self._sessions.get(session_id) or self.get(session_id)
        if session.busy or to is Tier.KV:
            raise ValueError("only an idle session is demoted, to features or image")
        self.stats.num_kv_offloads += self.offload.offload(session)  # the KV it holds leaves the device
        session.drop_kv() if to is Tier.FEATURES else session.drop_features()

    def demote_all(self, keep: Session | None) -> None:
        """Demote every idle session but ``keep`` to the ``image`` tier (after an out-of-memory error)."""
        self._refresh()
        self._apply(self._ledger.demote_all(keep=None if keep is None else keep.session_id))

    def enforce(self, keep: Session | None = None) -> bool:
        """Demote LRU idle sessions (never ``keep``) until within the device budget, then evict
        LRU idle sessions while over the host cap. Returns True when within both."""
        keep_id = None if keep is None else keep.session_id
        self._refresh()
        self._apply(self._ledger.enforce(keep=keep_id))
        for sid in self._ledger.evictions(keep=keep_id):
            evicted = self._sessions[sid]
            self._drop(evicted, ErrorCode.SESSION_EVICTED)
            if not evicted.anonymous:
                self.stats.num_evicted += 1
                log.warning("session evicted: host memory cap reached", extra={"session_id": sid})
        led = self._ledger
        return led.num_device_bytes <= led.device_budget_bytes and led.num_host_bytes <= led.host_budget_bytes

    def _apply(self, demotions: list[Demotion]) -> None:
        """Free the tensors the ledger's demotions name (already booked there)."""
        for d in demotions:
            s = self._sessions[d.session_id]
            if s.anonymous:  # a conversation-cache entry goes whole
                self._drop(s, ErrorCode.SESSION_EVICTED)
            elif d.to is Tier.FEATURES:
                self.stats.num_kv_offloads += self.offload.offload(s)  # its pages copied to the host first
                s.drop_kv()
                self.stats.num_demotions_kv += 1
            else:
                self.stats.num_kv_offloads += self.offload.offload(s)  # any KV it still holds, likewise
                s.drop_features()
                self.stats.num_demotions_features += 1
