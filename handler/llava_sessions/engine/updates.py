"""What a step's pieces need and produce, applied to the work in flight and its session.

Each prefill piece of a step's plan runs here (:meth:`StateUpdates.run_piece`; the first rides the
decode step's pass when the plan says so: :meth:`StateUpdates.decode_with_chunk`). Device memory
comes with the plan only (scheduler rules 10-11): room is made here, for a piece's ``grant_bytes``
and the batch's ``batch_bytes`` once the answers the plan preempts have left, and nowhere else. Before a prefill: a demoted session is restored
(its features re-encoded from the ``image`` tier) and its cache cropped to the tokens the answer
reuses; an image task's images join the session and are encoded. After a forward pass: the next
token is sampled and recorded, and a finished answer or task updates its session (the remembered
turn, the cache kept for the next question) and releases it. A preempted answer (the plan's choice)
leaves the batch and resumes later with its KV recomputed. On failure or
abandonment: the session is put back as it was before the request (an open's session is removed).
Forward passes themselves are the model runner's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ..conversation import Turn, common_prefix_len
from ..errors import ServiceError, overloaded
from ..model import EncodedVideo, SessionKV, is_sampled_video
from ..results import FinishReason, RestoredFrom, elapsed_ms
from ..sessions.ledger import Tier
from .memory import kv_grant_bytes
from .samples import fork_samples
from .scheduler import PrefillPiece, Room, make_room
from .sequence import Generation, ImageTask, Phase, Work

if TYPE_CHECKING:
    from ..sessions.session import Session
    from ..sessions.store import SessionStore
    from .model_runner import ModelRunner
    from .sharing import ImageSharing

__all__ = ["BatchRoom", "StateUpdates"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class BatchRoom:
    """A step's plan for its decode batch, as the engine carries it out: ``rebuild`` (lay it out anew
    first), ``batch_bytes`` (room made for them once ``leaving`` left), ``leaving`` (the answers
    ``decision`` preempts), ``decision`` (the scheduler's :class:`~.scheduler.Room`)."""

    rebuild: bool
    batch_bytes: int = 0
    leaving: tuple[Generation, ...] = ()
    decision: Room = Room()


class StateUpdates:
    """The engine's changes to work and sessions around the forward passes (module docstring).

    Args:
        store: the sessions and their memory; runner: the model runner (its model's sizes and
        template); sharing: what other sessions hold; decode_image: encoded bytes -> image.

    Attributes:
        num_reused_tokens / num_generated_tokens: counters for metrics (prompt tokens served from a
            KV cache; tokens sampled, finished answers or not).
        num_preemptions: answers preempted so that older ones could grow (the plan's
            :class:`~.scheduler.Room`, carried out by :meth:`_batch_room`).
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
        self.num_generated_tokens = 0
        self.num_preemptions = 0

    # ------------------------------------------------------------------ answers
    def start_generation(self, gen: Generation) -> None:
        """Make the session prefillable for ``gen`` in the device memory the step's plan made room for
        (:attr:`~.scheduler.PrefillPiece.grant_bytes`): assemble a resent conversation's features or
        restore a demoted session, crop the cache to the tokens it reuses.

        Raises:
            ServiceError: the restore's image errors.
        """
        session = gen.session
        t0 = time.perf_counter()
        if gen.features_pending:
            self._assemble_features(gen)
        restored = self._restore(session, gen.prefill_ids)
        if gen.resent:  # a resent conversation: a prefix another session holds may serve more
            self.sharing.adopt_prefix(session, gen.prefill_ids, session.image_keys, session.image_tokens)
        reuse = gen.num_reusable_tokens()
        session.crop_kv(reuse)
        self.num_reused_tokens += reuse
        gen.started(restored, reuse, elapsed_ms(t0))

    def _assemble_features(self, gen: Generation) -> None:
        """Give the session of a resent conversation every image's features in order: the rows found
        held, and the vision tower's on the images no session held."""
        session = gen.session
        images = [img if img is not None else self.decode_image(session.images[i]) for i, img in gen.images_to_encode]
        indexes = [i for i, _ in gen.images_to_encode]
        rows = list(gen.feature_rows)
        if indexes:
            for i, f in zip(indexes, self.runner.encode_at(session, indexes, images), strict=True):
                rows[i] = f
        session.set_features(torch.cat(rows) if rows else None)
        gen.images_to_encode, gen.features_pending = [], False

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
        if held is not None and isinstance(session.kv_cache, SessionKV):
            # no room in the pool for the pages (nothing written): prefilled again, as without a copy
            with contextlib.suppress(torch.OutOfMemoryError):
                n = self.store.offload.load(held, session.kv_cache, ids, session.image_keys)
                session.record_prefill(held.ids[:n])
        session.count_restore()
        self.store.stats.num_restores += 1
        return "features" if tier is Tier.FEATURES else "image"

    def decode(self, gens: list[Generation], room: BatchRoom) -> None:
        """Run the decode step of ``gens`` together and sample each one's next token, once ``room``'s
        plan is carried out (preemptions, then room made for the batch's bytes); a failed forward
        pass fails every one of them (their sessions put back)."""
        gens = self._batch_room(gens, room)
        if not gens:
            return
        try:
            logits = self.runner.decode(gens, rebuild=room.rebuild)
        except Exception as exc:  # noqa: BLE001 - the batched step failed: each of its answers fails
            for g in gens:
                self.fail(g, exc)
            return
        except BaseException:
            for g in gens:
                self.put_back(g)
            raise
        self.accept_rows(gens, logits)

    def _batch_room(self, gens: list[Generation], room: BatchRoom) -> list[Generation]:
        """Carry out the plan's :class:`~.scheduler.Room` for the decode batch (scheduler rules 10-11):
        free the rows' sessions' copies of their KV when it says ``unlend``, preempt the answers it
        names (:meth:`_preempt`), then make room for the batch's bytes. When the step's earlier work
        changed what the ledger holds since the plan (a fused piece's restore), the scheduler decides
        again on the ledger's integers now (:func:`~.scheduler.make_room`). ``refused``: every answer
        fails ``overloaded``. Returns the answers that decode this step."""
        for attempt in (room, None):
            if attempt is None:  # the plan's room was not there: decide again on what is held now
                views = [g.view() for g in gens]
                decision, batch_bytes = make_room(
                    views, range(len(gens)), self.runner.batch.layout(), self.store.room_bytes()
                )
                attempt = BatchRoom(room.rebuild, batch_bytes, tuple(gens[i] for i in decision.preempt), decision)
            if attempt.decision.refused:
                break
            if attempt.decision.unlend:
                self.runner.batch.unlend()
            for gone in attempt.leaving:
                self._preempt(gone)
            gens = [g for g in gens if g not in attempt.leaving]
            if attempt.batch_bytes <= 0 or self.store.allocate(attempt.batch_bytes, keep=None):
                return gens
        for g in gens:
            self.fail(g, overloaded("not enough device memory to decode now; retry later", "step_memory"))
        return []

    def _preempt(self, gen: Generation) -> None:
        """Preempt ``gen``: its row leaves the batch unread and its session's KV is dropped (no copy;
        the session keeps its image features), so it waits, then recomputes the KV of its prompt and
        tokens so far (:attr:`~.sequence.Generation.prefill_ids`) and decodes on: the same tokens, as
        greedy decoding and a seeded sampler give them. Its stream pauses meanwhile."""
        batch = self.runner.batch
        batch.drop(gen)
        gen.session.drop_kv()
        left = max(1, gen.room_tokens - len(gen.events))
        # it resumes once room is made for its KV and for the batch it will join (the rebuild lays every
        # row out anew beside the old batch): resuming sooner would only be preempted again
        joined = batch.bytes_without([gen], [])
        gen.preempt(kv_grant_bytes(self.model, self.runner.page_size, 0, len(gen.prefill_ids) + left) + joined)
        self.num_preemptions += 1

    def accept_rows(self, gens: list[Generation], logits: torch.Tensor) -> None:
        """Sample each of ``gens``' next token from its row of ``logits [B, vocab]`` (float32, the
        decode step's); one that fails to sample fails alone."""
        for g in gens:
            if g.done:  # another answer of its request failed and took it along
                continue
            assert g.row is not None
            try:
                self.accept(g, logits[g.row])
            except Exception as exc:  # noqa: BLE001
                self.fail(g, exc)

    def accept(self, gen: Generation, logits: torch.Tensor) -> None:
        """Sample ``gen``'s next token from ``logits [vocab]`` (float32) and record it; finish the
        answer when it ends there."""
        token, logprob, top = gen.sampler.next_token(logits)
        self.num_generated_tokens += 1
        finish = gen.append(token, logprob, self.model.eos_token_ids, top)
        if finish:
            self._finish_generation(gen, finish)

    def _finish_generation(self, gen: Generation, finish_reason: FinishReason) -> None:
        """The answer ended: its KV comes back from the batch, the session keeps the turn (or its
        cache is cropped back to the history's stable prefix) and is idle again."""
        session = gen.session
        generated = [e.id for e in gen.events]
        kv = self.runner.batch.release(gen)
        if kv is not None:  # the last token is not fed yet
            session.take_back_kv(kv, gen.prompt_ids + generated[:-1])
        if gen.head is not gen:  # another answer of a request of several: only the head's is remembered
            self.store.discard(session)
            gen.finish(finish_reason)
            return
        if gen.truncated_turns:  # what the model saw: the oldest turns left the context (not their images)
            session.drop_oldest_turns(gen.truncated_turns)
        if gen.remember:
            session.remember(Turn(gen.prompt, gen.detokenizer.text, session.pending_images))
        else:  # keep what the next question can reuse: the history's stable prefix
            stable = self.model.template.prefix_ids(session.chat())
            session.crop_kv(max(gen.num_reused_tokens, common_prefix_len(gen.prompt_ids, stable)))
        session.check_invariants()
        self.store.release(session)
        gen.finish(finish_reason)

    # ------------------------------------------------------------------ image tasks
    def encode_image_task(self, task: ImageTask) -> None:
        """Run the task's vision tower and leave the session ready to prefill its prefix: an open's
        session takes the features and an empty cache; an added image joins the session (which can
        be rolled back), its features are appended (or every image re-encoded when the layout of the
        earlier ones changed) and the cache is kept up to what the new prefix shares with it."""
        t = time.perf_counter()
        session = task.session
        if task.new_image is None:
            rows = task.shared_rows
            session.set_features(torch.cat(rows) if rows else self.runner.encode(session, task.images))
            session.start_kv(self.runner.new_cache())
            task.num_reused_tokens = self.sharing.adopt_prefix(
                session, task.prefix, session.image_keys, session.image_tokens
            )
            self.num_reused_tokens += task.num_reused_tokens
        else:
            self._join_added_image(task)
        task.images = []
        task.encoded = True
        task.timings["encode"] = elapsed_ms(t)

    def _encode_frames(self, task: ImageTask, allotted_ms: float) -> bool:
        """Run the next frames of the task's first video not yet encoded through the vision tower, as
        many as the measured per-frame cost fits in ``allotted_ms`` (at least one); a video whose
        frames are all done becomes an :class:`~llava_sessions.model.EncodedVideo` (its rows and the
        newline row). Returns whether frames are left (the task's other vision work waits for them)."""
        left = [i for i, item in enumerate(task.images) if is_sampled_video(item)]
        if not left:
            return False
        i = left[0]
        video = task.images[i]
        rows = task.video_rows.setdefault(i, [])
        done = sum(int(r.shape[0]) for r in rows) // max(1, self.model.video_rows_per_frame())
        per_frame = self.runner.costs.estimate().vision_ms
        count = max(1, int(allotted_ms // per_frame)) if per_frame > 0 else 1
        stop = min(done + count, video.num_frames)
        rows.append(self.runner.encode_frames(task.session, video, done, stop))
        if stop == video.num_frames:
            newline = self.model.video_newline()
            ends = [] if newline is None else [newline.to(rows[0].dtype)]
            task.images[i] = EncodedVideo(video, torch.cat([*rows, *ends]))
            del task.video_rows[i]
        return any(is_sampled_video(item) for item in task.images)

    def _join_added_image(self, task: ImageTask) -> None:
        session, model = task.session, self.model
        assert task.new_image is not None
        data, sizes, tokens = task.new_image
        task.snapshot = session.snapshot()
        relayout = tokens[:-1] != session.image_tokens
        had_features = session.image_features
        session.add_image(data, sizes, tokens)
        if relayout or had_features is None:  # every image (re-)encoded as laid out now
            images = [self.decode_image(d) for d in session.images[:-1]] + task.images
            session.set_features(self.runner.encode(session, images))
        else:
            session.set_features(torch.cat([had_features, self.runner.encode(session, task.images)], dim=0))
        keep = common_prefix_len(session.cached_ids, task.prefix)
        if relayout and model.image_token_id in session.cached_ids:  # nothing from the first image on
            keep = min(keep, session.cached_ids.index(model.image_token_id))
        if session.kv_cache is None:
            session.start_kv(self.runner.new_cache())
        else:
            session.crop_kv(keep)
        task.num_reused_tokens = len(session.cached_ids)
        self.num_reused_tokens += task.num_reused_tokens

    def finish_image_task(self, task: ImageTask) -> None:
        """The prefix is cached: the session is idle again (within the budget) and the task has its result."""
        self.store.release(task.session)
        task.finish()

    # ------------------------------------------------------------------ failures
    def fail(self, work: Work, exc: Exception) -> None:
        """Record ``exc`` as ``work``'s error and put its session back (no-op once done). The answers
        of a request of several fail together: every one not done is put back, and the head carries
        the error even when its own answer had finished."""
        if isinstance(work, Generation) and len(work.samples) > 1:
            for gen in work.samples:
                if not gen.done:
                    gen.fail(exc)
                    self.put_back(gen)
            if work.head.error is None:
                work.head.fail(exc)
            return
        if work.done:
            return
        work.fail(exc)
        self.put_back(work)

    def put_back(self, work: Work) -> None:
        """End ``work`` without a result and leave its session as before the request: an answer's
        cache cropped to what it reused (or dropped if a forward pass failed midway), an added
        image rolled back, an open's session removed."""
        work.end()
        session = work.session
        self.store.unpin(session)
        if isinstance(work, Generation):
            self._put_back_answer(work)
            if work.head is not work:  # a sample session goes with its answer
                self.store.discard(session)
        elif work.kind_of_task == "open":
            if session.session_id in self.store:
                try:
                    self.store.remove(session.session_id)
                except ServiceError:
                    pass
            return
        elif work.snapshot is not None:
            session.rollback(work.snapshot, self.model.template.prefix_ids)

    def _put_back_answer(self, gen: Generation) -> None:
        session = gen.session
        if gen.features_pending:  # a resent conversation's features were never assembled: rebuild from images
            session.drop_features()
            return
        try:
            kv = self.runner.batch.release(gen)
            if kv is not None:
                session.take_back_kv(kv, gen.prompt_ids + [e.id for e in gen.events][:-1])
        except Exception:  # noqa: BLE001 - the row cannot be read back: rebuild the session from features
            log.exception("could not read a session back from the decode batch")
            session.drop_kv()
        session.keep_kv(len(session.cached_ids) if not gen.prefilled else gen.num_reused_tokens)

    def run_piece(self, w: Work, piece: PrefillPiece) -> None:
        """Execute one prefill piece of a step's plan: what comes before its chunk (a waiting answer's
        start, an image's vision tower), then the chunk in a pass of its own. A failure is ``w``'s
        alone (its ``error`` set, its session put back)."""
        self._piece(w, piece, stop_before_chunk=False)

    def _piece(self, w: Work, piece: PrefillPiece, *, stop_before_chunk: bool) -> bool:
        """Run ``piece`` of ``w``: its work before the chunk and, unless ``stop_before_chunk`` (the
        caller runs the chunk), its chunk. A failure is ``w``'s alone (its ``error`` set, its session
        put back).

        Returns:
            Whether a chunk is left for the caller to run (``stop_before_chunk`` only).
        """
        try:
            if not self._before_chunk(w, piece):
                return False
            if stop_before_chunk:
                return True
            self._after_chunk(w, self.runner.prefill(w.session, self._ids(w), piece.num_tokens, w.timings)[0])
        except Exception as exc:  # noqa: BLE001 - one request's failure is that request's
            self.fail(w, exc)
        except BaseException:
            self.fail(w, RuntimeError("interrupted"))
            raise
        return False

    def decode_with_chunk(self, gens: list[Generation], room: BatchRoom, w: Work, piece: PrefillPiece) -> None:
        """Rule 9 (:mod:`.scheduler`): the decode step of ``gens`` and ``piece``'s chunk in one forward
        pass (``room``: as :meth:`decode`). When the piece runs no chunk after all, the decode step
        runs alone; when the batch gets no room or the pass fails, each part runs on its own, so each
        failure stays its own request's."""
        if not self._piece(w, piece, stop_before_chunk=True):
            self.decode(gens, room)
            return
        alone = dataclasses.replace(piece, vision=False, grant_bytes=0)  # its start ran: the chunk is left
        gens = self._batch_room(gens, room)
        if not gens:
            self._piece(w, alone, stop_before_chunk=False)
            return
        try:
            rows, last = self.runner.decode_with_chunk(
                gens,
                rebuild=room.rebuild,
                session=w.session,
                ids=self._ids(w),
                num_tokens=piece.num_tokens,
                timings=w.timings,
            )
        except Exception:  # noqa: BLE001 - whose failure it is, the parts alone tell
            log.debug("the fused decode and prefill pass failed; running them apart", exc_info=True)
            self.decode(gens, BatchRoom(room.rebuild))  # its room is made
            self._piece(w, alone, stop_before_chunk=False)
            return
        except BaseException:
            for g in gens:
                self.put_back(g)
            self.fail(w, RuntimeError("interrupted"))
            raise
        self.accept_rows(gens, rows)
        try:
            self._after_chunk(w, last)
        except Exception as exc:  # noqa: BLE001
            self.fail(w, exc)

    def _before_chunk(self, w: Work, piece: PrefillPiece) -> bool:
        """What runs before a piece's prefill chunk: room made for its ``grant_bytes`` (scheduler rule
        10: the work's start; ``overloaded`` when none can be made), a waiting answer's start
        (restore, crop), an image's vision tower. Returns False when the piece runs no chunk this step
        (the vision tower took its share, or the image's prefix is all cached: then its task is finished)."""
        if piece.grant_bytes and not self.store.allocate(piece.grant_bytes, keep=w.session):
            if isinstance(w, Generation) and w.resuming:
                return False  # a preempted answer waits for room (older answers end and free it)
            raise w.no_room()
        if isinstance(w, Generation):
            if w.phase is Phase.WAITING:
                self.start_generation(w)
            return piece.num_tokens != 0
        if piece.vision and piece.vision_ms is not None and self._encode_frames(w, piece.vision_ms):
            return False  # a video's frames are left: the vision tower took this step's share
        if piece.vision or not w.encoded:  # not a vision piece: features another session holds
            self.encode_image_task(w)
            if piece.vision and piece.num_tokens == 0:
                return False  # the vision tower took this step's share
        if len(w.session.cached_ids) < len(w.prefix):
            return True
        self.finish_image_task(w)
        return False

    def _after_chunk(self, w: Work, logits: Any) -> None:
        """What follows a prefill chunk: an answer whose prompt is all prefilled samples its first
        token; an image whose prefix is all cached is done."""
        if isinstance(w, Generation):
            if len(w.session.cached_ids) == len(w.prefill_ids):
                resumed = w.resuming  # its next token is known: the decode step feeds it
                first = not w.prefilled
                w.prefilled_all()
                if first and len(w.samples) > 1:  # the request's other answers start from this prompt
                    fork_samples(w, self.model, self.accept, logits)
                if not resumed:
                    self.accept(w, logits)
        elif len(w.session.cached_ids) == len(w.prefix):
            self.finish_image_task(w)

    @staticmethod
    def _ids(w: Work) -> list[int]:
        """The full token ids ``w`` prefills (an answer's prompt, and a resumed one's tokens so far;
        an image's prefix)."""
        return w.prefill_ids if isinstance(w, Generation) else w.prefix
