"""Image features and conversation-prefix KV shared between sessions, found by image content.

vLLM's encoder-cache idea (vllm/v1/core/encoder_cache_manager.py) on our sessions: the vision tower
runs once per distinct image while any session holds its features, and a new conversation that starts
like one a session holds copies that prefix's KV cache instead of prefilling it. Nothing is held here:
the rows and caches stay in the sessions that own them (and count in the memory budget there); this
module only finds them. An image is matched by its exact content key (SHA-256 of its bytes) and its
layout (placeholder count and the model's several-image mode), never by token ids alone (the
placeholder ids of two images are the same: docs/platform.md, vLLM issue 20261).

Sharing is scoped by ``cache_salt`` (vLLM's field; CVE-2025-46570): state is found only in
sessions whose salt equals the asker's, and this covers everything found by content (prefix KV,
image features, the images themselves, and image ``uuid`` references), where vLLM salts only the KV
(vllm#55439). Unsalted requests share with each other under ``unsalted="shared"`` (vLLM's default)
and with nothing but their own session under ``"isolated"``. With ``enabled`` False
(``share_images: false``) a session finds only its own rows and KV, whatever the salts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

import torch

from ..conversation import common_prefix_len, image_starts, still_images

if TYPE_CHECKING:
    from ..model import LlavaModel
    from ..sessions.session import Session
    from ..sessions.store import SessionStore

__all__ = ["MIN_SHARED_TOKENS", "ImageSharing", "Unsalted", "reusable_len"]

#: The shortest prefix worth copying from another session, tokens (vLLM's default block size: its
#: prefix cache hits whole blocks of 16); shorter ones (a chat template's first tokens) are prefilled.
MIN_SHARED_TOKENS = 16

#: What requests without a ``cache_salt`` share: ``shared`` (with every other unsalted request, as
#: vLLM) or ``isolated`` (nothing beyond their own session).
Unsalted = Literal["shared", "isolated"]


def reusable_len(
    holder: Session, ids: list[int], keys: Sequence[str], tokens: Sequence[int], image_token_id: int
) -> int:
    """How many of ``ids`` the KV cache of ``holder`` serves exactly: the common token prefix, cut at
    the first image whose content key or placeholder count differs (the n-th image run of the prefix
    is the n-th image of both conversations).

    Args:
        holder: the session whose ``cached_ids`` are compared.
        ids: the conversation's token ids; keys / tokens: its images' content keys and placeholder counts.
        image_token_id: the placeholder token id.
    """
    keep = common_prefix_len(holder.cached_ids, ids)
    for n, start in enumerate(image_starts(ids, image_token_id, keep)):
        if n >= len(holder.image_keys) or holder.image_keys[n] != keys[n] or holder.image_tokens[n] != tokens[n]:
            return start
    return keep


class ImageSharing:
    """Find image features and prefix KV caches by content in one session, or in every session.

    Args:
        store: the sessions.
        model: the loaded model (layout rules, placeholder id, prefix copies).
        enabled: search other sessions too (``share_images``); else only the asking session's own.
        unsalted: what requests without a salt share (:data:`Unsalted`).
    """

    def __init__(
        self, store: SessionStore, model: LlavaModel, *, enabled: bool = True, unsalted: Unsalted = "shared"
    ) -> None:
        self.store = store
        self.model = model
        self.enabled = enabled
        self.unsalted = unsalted

    def scope(self, salt: str | None) -> str | None:
        """The sharing scope of a request of ``salt``: equal scopes share; None shares with nobody."""
        if not self.enabled:
            return None
        if salt is not None:
            return "salt:" + salt
        return "" if self.unsalted == "shared" else None

    def _candidates(self, session: Session | None, salt: str | None) -> list[Session]:
        """``session`` first (when there is one), then every other session of the same scope."""
        own = [] if session is None else [session]
        scope = self.scope(salt)
        if scope is None:
            return own
        return own + [s for s in self.store.sessions() if s is not session and self.scope(s.salt) == scope]

    def held(self, session: Session | None, key: str, salt: str | None) -> tuple[bytes, tuple[int, ...]] | None:
        """The encoded bytes and (height, width) of the image of content ``key`` if ``session`` (or a
        session of the scope of ``salt``) holds it; else None."""
        for holder in self._candidates(session, salt):
            if key in holder.image_keys:
                i = holder.image_keys.index(key)
                return holder.images[i], holder.image_sizes[i]
        return None

    def uuid_key(self, session: Session | None, uuid: str, salt: str | None) -> str | None:
        """The content key of the image a client named ``uuid``, remembered by ``session`` or a session
        of the scope of ``salt`` (the most recently used first), or None."""
        others = [h for h in reversed(self._candidates(None, salt)) if h is not session]
        for holder in ([] if session is None else [session]) + others:
            key = holder.image_uuids.get(uuid)
            if key is not None and key in holder.image_keys:
                return key
        return None

    def rows(self, session: Session, key: str, num_tokens: int, num_images: int) -> torch.Tensor | None:
        """The feature rows ``[num_tokens, hidden]`` (a view; copy before keeping) of the image of
        content ``key`` laid out with ``num_tokens`` placeholders in a conversation of ``num_images``
        still images, from ``session`` first, then (when enabled) any session holding them; None if none does."""
        mode = self.model.base_layout(num_images)
        for holder in self._candidates(session, session.salt):
            feats = holder.image_features
            if feats is None or self.model.base_layout(still_images(holder.image_sizes)) != mode:
                continue
            offset = 0
            for k, n in zip(holder.image_keys, holder.image_tokens, strict=True):
                if k == key and n == num_tokens:
                    return feats[offset : offset + n]
                offset += n
        return None

    def adopt_prefix(self, session: Session, ids: list[int], keys: Sequence[str], tokens: Sequence[int]) -> int:
        """When another session's KV cache (of the same scope) serves more of ``ids`` than
        ``session``'s own, give ``session`` a copy of that prefix (its own cache is replaced) and
        record the holder in ``session.source_id``. Returns the tokens ``session``'s cache now serves."""
        image_id = self.model.image_token_id
        own = reusable_len(session, ids, keys, tokens, image_id) if session.kv_cache is not None else 0
        best, best_len = None, max(own, MIN_SHARED_TOKENS - 1)
        for holder in self._candidates(session, session.salt)[1:]:
            if holder.kv_cache is None:
                continue
            n = reusable_len(holder, ids, keys, tokens, image_id)
            if n > best_len:
                best, best_len = holder, n
        if best is None or best.kv_cache is None:
            return own
        session.adopt_kv(best.kv_cache.fork(best_len), ids[:best_len])
        session.copied_from(best.session_id)
        self.store.touch(best)
        return best_len
