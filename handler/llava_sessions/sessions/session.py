"""One session's state: its conversation, its images, and what of it is cached on the device.

A session changes only through its own methods, which keep ``cached_ids``, the KV cache's length,
the images and their feature rows in step (:meth:`Session.check_invariants`); the store
(``llava_sessions.sessions.store``) keeps the ledger in step with it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..conversation import Chat, Turn, common_prefix_len, image_key, video_indexes
from ..model.kv.cache import cache_len
from .ledger import Tier, tier_of

if TYPE_CHECKING:
    from ..model.kv.paged import SessionKV

__all__ = ["Session", "SessionSnapshot"]


@dataclass(frozen=True)
class SessionSnapshot:
    """What :meth:`Session.rollback` puts back: the images, their layout, the pending count and the
    features (the KV cache is kept only up to what the restored conversation shares with it)."""

    images: tuple[bytes, ...]
    image_keys: tuple[str, ...]
    image_sizes: tuple[tuple[int, ...], ...]
    image_tokens: tuple[int, ...]
    pending_images: int
    image_features: torch.Tensor | None


@dataclass
class Session:
    """One client's conversation about one image or more, and what of it is cached on the device.

    The fields are read freely; they change only through the methods below (and the store's
    :meth:`SessionStore.pin` / :meth:`SessionStore.unpin`), which keep the invariant
    :meth:`check_invariants` asserts: ``cached_ids`` are exactly the tokens in ``kv_cache``. Every method that changes what the session
    holds marks it ``changed``; the store brings its ledger up to date from the changed sessions before
    each decision it takes, so no caller books memory by hand and nothing here calls the store.

    Attributes:
        session_id: the id (``ts-seq-<uuid>`` minted by TorchServe, or any uuid4-based id).
        images: the encoded images as received (host), in conversation order (the opening one first).
        image_keys: each image's content key (:func:`~llava_sessions.conversation.image_key`).
        image_urls: URL or S3 URI → content key of the images fetched for this session (a URL is
            fetched once per session).
        image_uuids: a client's image ``uuid`` (vLLM's per-part field) → content key: a later
            request may name the image by it instead of sending the bytes.
        salt: the ``cache_salt`` of the requests that made this state (None: unsalted); what it
            holds is shared only with requests of an equal salt (:class:`~llava_sessions.engine.sharing.ImageSharing`).
        anonymous: a conversation-cache entry: the state a chat request without a session left
            behind (no client names it; dropped first when memory is short, never a session's loss).
        source_id: the entry whose prefix this session copied last (its earlier turn, when a
            stateless conversation is resent), or None.
        image_sizes: each image's decoded (height, width), pixels.
        image_tokens: each image's placeholder tokens in the conversation as it is now.
        pending_images: images added since the last remembered turn (they open the next question).
        system_prompt: optional system message.
        history: remembered turns, oldest first.
        image_features: ``[sum(image_tokens), hidden]`` on the device (every image's rows in order),
            or None (tier ``image``).
        kv_cache: the cache holding ``cached_ids`` (a :class:`~llava_sessions.model.SessionKV`: its pages
            in the replica's KV pool, where a running answer's decode step writes too), or None.
        cached_ids: token ids whose keys/values are in ``kv_cache``.
        opened_at: open time (epoch s); expires_at: absolute expiry (epoch s, whole seconds).
        last_used: last request time (epoch s) for LRU and the idle timeout.
        busy: a generation or image prefill is in flight; a busy session is never demoted or evicted.
        num_restores: how many times a demoted session was rebuilt.
        changed: what the session holds (KV tokens, features, host bytes) changed since the store's
            ledger last recorded it.
    """

    session_id: str
    images: list[bytes]
    system_prompt: str | None
    opened_at: float
    expires_at: int
    last_used: float
    image_sizes: list[tuple[int, ...]] = field(default_factory=list)
    image_tokens: list[int] = field(default_factory=list)
    pending_images: int = 1
    image_keys: list[str] = field(default_factory=list)
    image_urls: dict[str, str] = field(default_factory=dict)
    image_uuids: dict[str, str] = field(default_factory=dict)
    salt: str | None = None
    anonymous: bool = False
    source_id: str | None = None
    history: list[Turn] = field(default_factory=list)
    image_features: torch.Tensor | None = None
    kv_cache: SessionKV | None = None
    cached_ids: list[int] = field(default_factory=list)
    busy: bool = False
    num_restores: int = 0
    changed: bool = field(default=True, repr=False, compare=False)

    # ------------------------------------------------------------------ reading
    def chat(self) -> Chat:
        """The conversation as the chat template sees it (system, turns, images)."""
        return Chat(
            self.system_prompt,
            tuple(self.history),
            self.pending_images,
            tuple(self.image_tokens),
            video_indexes(self.image_sizes),
        )

    @property
    def tier(self) -> Tier:
        """The tier the session is in now (:func:`~llava_sessions.sessions.ledger.tier_of`)."""
        return tier_of(cache_len(self.kv_cache), self.feature_bytes)

    @property
    def feature_bytes(self) -> int:
        """Device bytes of the image features."""
        f = self.image_features
        return 0 if f is None else f.untyped_storage().nbytes()

    @property
    def num_held_kv_tokens(self) -> int:
        """Token positions of device memory the KV cache holds, what the ledger books: its pages x
        page size (:attr:`SessionKV.num_held_tokens <llava_sessions.model.SessionKV.num_held_tokens>`)."""
        return 0 if self.kv_cache is None else self.kv_cache.num_held_tokens

    @property
    def host_bytes(self) -> int:
        """Encoded images + UTF-8 conversation text (system prompt and turns), bytes."""
        text = (self.system_prompt or "") + "".join(t.prompt + t.answer for t in self.history)
        return sum(len(b) for b in self.images) + len(text.encode("utf-8"))

    def check_invariants(self) -> None:
        """Assert ``len(cached_ids) == cache_len(kv_cache)`` and one feature row per image placeholder."""
        assert len(self.cached_ids) == cache_len(self.kv_cache), (len(self.cached_ids), cache_len(self.kv_cache))
        if self.image_features is not None:
            assert self.image_features.shape[0] == sum(self.image_tokens), "one feature row per image placeholder"
        assert self.pending_images + sum(t.images for t in self.history) == len(self.images) == len(self.image_tokens)
        assert len(self.image_keys) == len(self.images), "one content key per image"
        if not self.busy and self.images and self.image_features is None:
            assert cache_len(self.kv_cache) == 0, "an idle session holds no KV cache without its images' features"

    def _changed(self) -> None:
        """Mark a change of what the session holds (KV tokens, features, host bytes) for the ledger."""
        self.changed = True

    # ------------------------------------------------------------------ the KV cache
    def _hold_kv(self, cache: SessionKV | None) -> None:
        """Hold ``cache`` from now on; the one held before gives its pages back to the pool."""
        if self.kv_cache is not None and self.kv_cache is not cache:
            self.kv_cache.release()
        self.kv_cache = cache

    def start_kv(self, cache: SessionKV) -> None:
        """Start caching from nothing in the empty ``cache`` (an open, a restore)."""
        self._hold_kv(cache)
        self.cached_ids = []
        self._changed()

    def record_prefill(self, ids: list[int]) -> None:
        """The KV cache was extended in place to hold ``ids`` (a prefill chunk ran): record them.

        Raises:
            ValueError: the cache does not hold ``len(ids)`` positions.
        """
        if cache_len(self.kv_cache) != len(ids):
            raise ValueError(f"the cache holds {cache_len(self.kv_cache)} positions, not {len(ids)}")
        self.cached_ids = list(ids)
        self._changed()

    def crop_kv(self, length: int) -> None:
        """Keep the first ``length`` cached positions (the pages past them freed, ``cached_ids`` sliced).

        Raises:
            ValueError: fewer than ``length`` positions are cached.
        """
        if self.kv_cache is None:
            return
        self.kv_cache.truncate(length)
        self.cached_ids = self.cached_ids[:length]
        self._changed()

    def keep_kv(self, length: int) -> None:
        """Keep the first ``length`` cached positions after a failed or abandoned step; drop the KV
        cache instead when it cannot be trusted (it holds fewer than ``length`` positions)."""
        if self.kv_cache is None:
            return
        try:
            if cache_len(self.kv_cache) < length:
                self.drop_kv()
            else:
                self.crop_kv(length)
        except Exception:  # noqa: BLE001 - an unreadable cache is rebuilt from the features
            self.drop_kv()

    def record_decode(self, ids: list[int]) -> None:
        """A decode step wrote ``ids``' positions into the KV cache in place (a decode row is the
        session's own cache): record them, so the ledger books the pages they took.

        Raises:
            ValueError: the cache does not hold ``len(cached_ids) + len(ids)`` positions.
        """
        self.record_prefill(self.cached_ids + ids)

    def adopt_kv(self, cache: SessionKV, ids: list[int]) -> None:
        """Hold ``cache`` (a copy of another session's prefix, or a fresh one) holding ``ids``.

        Raises:
            ValueError: the cache does not hold ``len(ids)`` positions.
        """
        if cache_len(cache) != len(ids):
            raise ValueError(f"the cache holds {cache_len(cache)} positions, not {len(ids)}")
        self._hold_kv(cache)
        self.cached_ids = list(ids)
        self._changed()

    def drop_kv(self) -> None:
        """Demote ``kv`` → ``features``: free the KV cache (a paged cache's pages go back to the pool)."""
        self._hold_kv(None)
        self.cached_ids = []
        self._changed()

    def drop_features(self) -> None:
        """Demote to ``image``: free the KV cache and the image features."""
        self.drop_kv()
        self.image_features = None
        self._changed()

    # ------------------------------------------------------------------ images and conversation
    def set_features(self, features: torch.Tensor | None) -> None:
        """Hold ``features`` ``[sum(image_tokens), hidden]``: every image's rows, in order (None: none
        held, the images are encoded again when needed)."""
        self.image_features = features
        self._changed()

    def add_image(self, data: bytes, image_sizes: list[tuple[int, ...]], image_tokens: list[int]) -> None:
        """Append an encoded image (it opens the next question); ``image_sizes`` / ``image_tokens``
        are every image's, as laid out with it (the features follow with :meth:`set_features`)."""
        self.images = [*self.images, data]
        self.image_keys = [*self.image_keys, image_key(data)]
        self.image_sizes, self.image_tokens = list(image_sizes), list(image_tokens)
        self.pending_images += 1
        self._changed()

    def set_conversation(
        self,
        system_prompt: str | None,
        turns: list[Turn],
        pending_images: int,
        images: list[tuple[str, bytes, tuple[int, ...], int]],
    ) -> None:
        """Hold a resent conversation (OpenAI ``messages``): the system prompt, the remembered turns,
        the images opening the next question, and every image as ``(key, data, (height, width),
        placeholder tokens)`` in conversation order. The features and the KV cache are the caller's
        to make match (:meth:`set_features`, :meth:`crop_kv`)."""
        self.system_prompt, self.history, self.pending_images = system_prompt, list(turns), pending_images
        self.image_keys = [key for key, _, _, _ in images]
        self.images = [data for _, data, _, _ in images]
        self.image_sizes = [size for _, _, size, _ in images]
        self.image_tokens = [tokens for _, _, _, tokens in images]
        self._changed()

    def remember_url(self, url: str, key: str) -> None:
        """Remember that ``url`` gave the image of content ``key`` (it is not fetched again)."""
        self.image_urls[url] = key

    def set_salt(self, salt: str | None) -> None:
        """Hold what comes next under ``salt`` (the ``cache_salt`` of the request that sends it)."""
        self.salt = salt

    def copied_from(self, source_id: str) -> None:
        """Record that the KV prefix now held was copied from ``source_id``'s cache."""
        self.source_id = source_id

    def remember_uuid(self, uuid: str, key: str) -> None:
        """Remember that the client's image ``uuid`` names the image of content ``key``."""
        self.image_uuids[uuid] = key

    def snapshot(self) -> SessionSnapshot:
        """What :meth:`rollback` puts back (before an added image)."""
        return SessionSnapshot(
            tuple(self.images),
            tuple(self.image_keys),
            tuple(self.image_sizes),
            tuple(self.image_tokens),
            self.pending_images,
            self.image_features,
        )

    def rollback(self, snap: SessionSnapshot, keep_ids: Callable[[Chat], list[int]]) -> None:
        """Put the images, their layout and features back as in ``snap``; keep the KV cache up to what
        the restored conversation's prefix (``keep_ids(chat)``) shares with it, or drop it when the
        cached image rows changed layout or no features are left."""
        relayout = list(snap.image_tokens) != self.image_tokens[: len(snap.image_tokens)]
        self.images, self.image_sizes = list(snap.images), list(snap.image_sizes)
        self.image_keys = list(snap.image_keys)
        self.image_tokens, self.pending_images = list(snap.image_tokens), snap.pending_images
        self.image_features = snap.image_features
        if snap.image_features is None or relayout:
            self.drop_kv()
        else:
            self.keep_kv(common_prefix_len(self.cached_ids, keep_ids(self.chat())))
        self._changed()

    def remember(self, turn: Turn) -> None:
        """Append ``turn`` to the history (the pending images open it)."""
        self.history.append(turn)
        self.pending_images = 0
        self._changed()

    def drop_oldest_turns(self, n: int) -> None:
        """Drop the ``n`` oldest turns; their images open the first turn kept (or the next question)."""
        kept = self.chat().without_oldest(n)
        self.history, self.pending_images = list(kept.turns), kept.pending_images
        self._changed()

    def forget_history(self) -> None:
        """Forget every turn, keep the images: every image opens the next question."""
        self.history = []
        self.pending_images = len(self.images)
        self._changed()

    def count_restore(self) -> None:
        """Count one rebuild of a demoted session."""
        self.num_restores += 1
