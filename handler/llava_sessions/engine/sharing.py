"""Image features and conversation-prefix KV shared between sessions, found by image content.

vLLM's encoder-cache idea (vllm/v1/core/encoder_cache_manager.py) on our sessions: the vision tower
runs once per distinct image while any session holds its features, and a new conversation that starts
like one a session holds copies that prefix's KV cache instead of prefilling it. Nothing is held here:
the rows and caches stay in the sessions that own them (and count in the memory budget there); this
module only finds them. An image is matched by its exact content key (SHA-256 of its bytes) and its
layout (placeholder count and the model's several-image mode), never by token ids alone (the
placeholder ids of two images are the same: shared/notes/chat-protocol.md, vLLM issue 20261).

With ``enabled`` False (``share_images: false``) a session finds only its own rows and KV, so one
tenant cannot time another's images.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from ..sessions.conversation import common_prefix_len, image_starts

if TYPE_CHECKING:
    from ..model import LlavaRunner
    from ..sessions.session import Session
    from ..sessions.store import SessionStore

__all__ = ["ImageSharing", "reusable_len"]


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
        runner: the model (layout rules, placeholder id, prefix copies).
        enabled: search other sessions too (``share_images``); else only the asking session's own.
    """

    def __init__(self, store: SessionStore, runner: LlavaRunner, *, enabled: bool = True) -> None:
        self.store = store
        self.runner = runner
        self.enabled = enabled

    def _candidates(self, session: Session | None) -> list[Session]:
        """``session`` first (when there is one), then every other session when sharing is on."""
        own = [] if session is None else [session]
        if not self.enabled:
            return own
        return own + [s for s in self.store.sessions() if s is not session]

    def held(self, session: Session | None, key: str) -> tuple[bytes, tuple[int, int]] | None:
        """The encoded bytes and (height, width) of the image of content ``key`` if ``session`` (or,
        when sharing, any session) holds it; else None."""
        for holder in self._candidates(session):
            if key in holder.image_keys:
                i = holder.image_keys.index(key)
                return holder.images[i], holder.image_sizes[i]
        return None

    def rows(self, session: Session, key: str, num_tokens: int, num_images: int) -> torch.Tensor | None:
        """The feature rows ``[num_tokens, hidden]`` (a view; copy before keeping) of the image of
        content ``key`` laid out with ``num_tokens`` placeholders in a conversation of ``num_images``
        images, from ``session`` first, then (when enabled) any session holding them; None if none does."""
        mode = self.runner.base_layout(num_images)
        for holder in self._candidates(session):
            feats = holder.image_features
            if feats is None or self.runner.base_layout(len(holder.images)) != mode:
                continue
            offset = 0
            for k, n in zip(holder.image_keys, holder.image_tokens, strict=True):
                if k == key and n == num_tokens:
                    return feats[offset : offset + n]
                offset += n
        return None

    def adopt_prefix(self, session: Session, ids: list[int], keys: Sequence[str], tokens: Sequence[int]) -> int:
        """When another session's KV cache serves more of ``ids`` than ``session``'s own, give
        ``session`` a copy of that prefix (its own cache is replaced). Returns the tokens ``session``'s
        cache now serves. No-op when sharing is off."""
        image_id = self.runner.image_token_id
        own = reusable_len(session, ids, keys, tokens, image_id) if session.kv_cache is not None else 0
        if not self.enabled:
            return own
        best, best_len = None, own
        for holder in self.store.sessions():
            if holder is session or holder.kv_cache is None:
                continue
            n = reusable_len(holder, ids, keys, tokens, image_id)
            if n > best_len:
                best, best_len = holder, n
        if best is None:
            return own
        session.adopt_kv(self.runner.copy_prefix(best.kv_cache, best_len), ids[:best_len])
        return best_len
