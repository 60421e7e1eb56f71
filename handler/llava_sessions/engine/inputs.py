"""Preparing a step's inputs: what runs before a prefill chunk, on the work and its session.

An answer's start (:meth:`StepInputs.start_sequence`): a resent conversation's features assembled
(the rows other sessions hold, the vision tower on the rest), a demoted session restored (its features
encoded again from the ``image`` tier, its KV loaded from the host copy its demotion made), a prefix
another session holds adopted, and the cache cropped to the tokens the answer reuses. An image prefill's
vision tower (:meth:`StepInputs.encode_image_prefill`): an open's session takes the features and an empty
cache; an added image joins the session (which can be rolled back) and the cache is kept up to what the
new prefix shares; a video's frames go through the tower a few per step (:meth:`StepInputs.encode_frames`).
Device memory for all of it was made room for by the step's plan (scheduler rule 10); forward passes are
the model runner's.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ..conversation import common_prefix_len
from ..model import EncodedVideo, is_sampled_video
from ..results import RestoredFrom, elapsed_ms
from ..sessions.ledger import Tier
from .sequence import ImagePrefill, Sequence

if TYPE_CHECKING:
    from ..sessions.session import Session
    from ..sessions.store import SessionStore
    from .model_runner import ModelRunner
    from .sharing import ImageSharing

__all__ = ["StepInputs"]


class StepInputs:
    """What a step's chunks need before their tokens run (module docstring).

    Args:
        store: the sessions and their memory; runner: the model runner (the vision tower, new caches; its
        model's sizes and template); sharing: what other sessions hold; decode_image: encoded bytes -> image.

    Attributes:
        num_reused_tokens: prompt tokens served from a KV cache (a metrics counter).
    """

    def __init__(
        self, store: SessionStore, runner: ModelRunner, sharing: ImageSharing, decode_image: Callable[[bytes], Any]
    ) -> None:
        self.store = store
        self.runner = runner
        self.model = runner.model
        self.sharing = sharing
        self.decode_image = decode_image
        self.num_reused_tokens = 0

    def start_sequence(self, seq: Sequence) -> None:
        """Make the session prefillable for ``seq`` in the device memory the step's plan made room for
        (:attr:`~.scheduler.PrefillChunk.grant_bytes`): assemble a resent conversation's features or
        restore a demoted session, crop the cache to the tokens it reuses.

        Raises:
            ServiceError: the restore's image errors.
        """
        session = seq.session
        t0 = time.perf_counter()
        if seq.features_pending:
            self._assemble_features(seq)
        restored = self._restore(session, seq.prefill_ids)
        if seq.resent:  # a resent conversation: a prefix another session holds may serve more
            self.sharing.adopt_prefix(session, seq.prefill_ids, session.image_keys, session.image_tokens)
        reuse = seq.num_reusable_tokens()
        session.crop_kv(reuse)
        self.num_reused_tokens += reuse
        seq.started(restored, reuse, elapsed_ms(t0))

    def _assemble_features(self, seq: Sequence) -> None:
        """Give the session of a resent conversation every image's features in order: the rows found
        held, and the vision tower's on the images no session held."""
        session = seq.session
        images = [img if img is not None else self.decode_image(session.images[i]) for i, img in seq.images_to_encode]
        indexes = [i for i, _ in seq.images_to_encode]
        rows = list(seq.feature_rows)
        if indexes:
            for i, f in zip(indexes, self.runner.encode_at(session, indexes, images), strict=True):
                rows[i] = f
        session.set_features(torch.cat(rows) if rows else None)
        seq.images_to_encode, seq.features_pending = [], False

    def _restore(self, session: Session, ids: list[int]) -> RestoredFrom | None:
        """Bring a demoted session back to a prefillable state for the prompt ``ids``: its features
        (encoded again from the ``image`` tier), and its KV from the host copy its demotion made, as
        far as ``ids`` starts with it (:mod:`~llava_sessions.sessions.offload`; otherwise prefilled
        again). Returns the tier it came from (None: nothing was demoted)."""
        held = self.store.offload.take(session.session_id)  # used now or never: the session moves on
        if not session.images:  # a conversation without images: nothing to restore
            if session.kv_cache is None:
                session.start_kv(self.runner.new_cache())
            return None
        tier = session.tier
        if tier is Tier.KV:
            return None
        if tier is Tier.IMAGE:
            images = [self.decode_image(data) for data in session.images]
            session.set_features(self.runner.encode(session, images))
        session.start_kv(self.runner.new_cache())
        if held is not None and session.kv_cache is not None:
            # no room in the pool for the pages (nothing written): prefilled again, as without a copy
            with contextlib.suppress(torch.OutOfMemoryError):
                n = self.store.offload.load(held, session.kv_cache, ids, session.image_keys)
                session.record_prefill(held.ids[:n])
        session.count_restore()
        self.store.stats.num_restores += 1
        return "features" if tier is Tier.FEATURES else "image"

    def encode_image_prefill(self, prefill: ImagePrefill) -> None:
        """Run the prefill's vision tower and leave the session ready to prefill its prefix: an open's
        session takes the features and an empty cache; an added image joins the session (which can
        be rolled back), its features are appended (or every image re-encoded when the layout of the
        earlier ones changed) and the cache is kept up to what the new prefix shares with it."""
        t = time.perf_counter()
        session = prefill.session
        if prefill.new_image is None:
            rows = prefill.shared_rows
            session.set_features(torch.cat(rows) if rows else self.runner.encode(session, prefill.images))
            session.start_kv(self.runner.new_cache())
            prefill.num_reused_tokens = self.sharing.adopt_prefix(
                session, prefill.prefix, session.image_keys, session.image_tokens
            )
            self.num_reused_tokens += prefill.num_reused_tokens
        else:
            self._join_added_image(prefill)
        prefill.images = []
        prefill.encoded = True
        prefill.timings["encode"] = elapsed_ms(t)

    def encode_frames(self, prefill: ImagePrefill, allotted_ms: float) -> bool:
        """Run the next frames of the prefill's first video not yet encoded through the vision tower, as
        many as the measured per-frame cost fits in ``allotted_ms`` (at least one); a video whose
        frames are all done becomes an :class:`~llava_sessions.model.EncodedVideo` (its rows and the
        newline row). Returns whether frames are left (the prefill's other vision work waits for them)."""
        left = [i for i, item in enumerate(prefill.images) if is_sampled_video(item)]
        if not left:
            return False
        i = left[0]
        video = prefill.images[i]
        rows = prefill.video_rows.setdefault(i, [])
        done = sum(int(r.shape[0]) for r in rows) // max(1, self.model.video_rows_per_frame())
        per_frame = self.runner.costs.estimate().vision_ms
        count = max(1, int(allotted_ms // per_frame)) if per_frame > 0 else 1
        stop = min(done + count, video.num_frames)
        rows.append(self.runner.encode_frames(prefill.session, video, done, stop))
        if stop == video.num_frames:
            newline = self.model.video_newline()
            ends = [] if newline is None else [newline.to(rows[0].dtype)]
            prefill.images[i] = EncodedVideo(video, torch.cat([*rows, *ends]))
            del prefill.video_rows[i]
        return any(is_sampled_video(item) for item in prefill.images)

    def _join_added_image(self, prefill: ImagePrefill) -> None:
        session, model = prefill.session, self.model
        assert prefill.new_image is not None
        data, sizes, tokens = prefill.new_image
        prefill.snapshot = session.snapshot()
        relayout = tokens[:-1] != session.image_tokens
        had_features = session.image_features
        session.add_image(data, sizes, tokens)
        if relayout or had_features is None:  # every image (re-)encoded as laid out now
            images = [self.decode_image(d) for d in session.images[:-1]] + prefill.images
            session.set_features(self.runner.encode(session, images))
        else:
            session.set_features(torch.cat([had_features, self.runner.encode(session, prefill.images)], dim=0))
        keep = common_prefix_len(session.cached_ids, prefill.prefix)
        if relayout and model.image_token_id in session.cached_ids:  # nothing from the first image on
            keep = min(keep, session.cached_ids.index(model.image_token_id))
        if session.kv_cache is None:
            session.start_kv(self.runner.new_cache())
        else:
            session.crop_kv(keep)
        prefill.num_reused_tokens = len(session.cached_ids)
        self.num_reused_tokens += prefill.num_reused_tokens
