"""Processing a step's output: sample, append, finish, roll back.

After a forward pass each answer samples its next token from its row of the logits and records it
(:meth:`StepOutputs.accept`); a finished answer updates its session (the remembered turn, or the cache
cropped back to the history's stable prefix) and releases it; an image prefill whose prefix is cached
releases its session. On failure or abandonment the session is put back as it was before the request
(:meth:`StepOutputs.put_back`: an answer's cache cropped to what it reused, an added image rolled
back, an open's session removed); the answers of a request of several fail together.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from ..conversation import Turn, common_prefix_len
from ..errors import ServiceError
from ..results import FinishReason
from ..sampling.rows import sample_rows
from .sequence import EngineRequest, ImagePrefill, Sequence

if TYPE_CHECKING:
    from ..sessions.store import SessionStore
    from .model_runner import ModelRunner

__all__ = ["StepOutputs"]

log = logging.getLogger(__name__)


class StepOutputs:
    """What a step's forward passes produce, applied to the work and its session (module docstring).

    Args:
        store: the sessions and their memory; runner: the model runner (its decode batch; its model's
        end-of-sequence ids and template).

    Attributes:
        num_generated_tokens: tokens sampled, finished answers or not (a metrics counter).
    """

    def __init__(self, store: SessionStore, runner: ModelRunner) -> None:
        self.store = store
        self.runner = runner
        self.model = runner.model
        self.num_generated_tokens = 0

    def accept_rows(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        """Sample each of ``seqs``' next token from its row of ``logits [B, vocab]`` (float32, the
        decode step's); one that fails to sample fails alone.

        The rows whose sampler is :attr:`~..sampling.sampler.Sampler.plain_greedy` take their tokens
        from one argmax over the batch, and those whose sampler is ``plain_sampled`` from one warp and
        draw of their rows together (:func:`~..sampling.rows.sample_rows`), all read to the host at
        once: one device sync a step, where each row's own choice is one sync a row (the other rows
        sample one by one, as before)."""
        live = [g for g in seqs if not g.done]
        greedy = [g for g in live if g.sampler.plain_greedy]
        sampled = [g for g in live if g.sampler.plain_sampled]
        tokens = self._plain_tokens(greedy, sampled, logits)
        for g in live:
            if g.done:  # another answer of its request failed and took it along
                continue
            assert g.row is not None
            try:
                if id(g) in tokens:
                    g.sampler.took(tokens[id(g)])
                    self._record(g, tokens[id(g)], None, ())
                else:
                    self.accept(g, logits[g.row])
            except Exception as exc:  # noqa: BLE001
                self.fail(g, exc)

    @staticmethod
    def _plain_tokens(greedy: list[Sequence], sampled: list[Sequence], logits: torch.Tensor) -> dict[int, int]:
        """The next token of each plain ``greedy`` and plain ``sampled`` answer, by ``id``, from one host
        read: the batch's argmax and the sampled rows' draws, computed on the logits' device (the rows'
        values copied there without waiting)."""
        parts = [logits.argmax(-1)] if greedy else []
        if sampled:
            device = logits.device
            rows = torch.tensor([g.row for g in sampled]).to(device, non_blocking=True)
            warps = [g.sampler.warping for g in sampled]  # (temperature, top_k, top_p, min_p) per row
            noise = torch.stack([g.sampler.noise(logits.shape[-1]) for g in sampled])
            temperature, top_k = [w[0] for w in warps], [w[1] for w in warps]
            top_p, min_p = [w[2] for w in warps], [w[3] for w in warps]
            parts.append(sample_rows(logits.index_select(0, rows), temperature, top_k, top_p, min_p, noise))
        chosen = torch.cat(parts).tolist() if parts else []
        drawn = len(chosen) - len(sampled)  # the sampled rows' tokens follow the batch's argmax, if any
        tokens = {id(g): chosen[drawn + i] for i, g in enumerate(sampled)}
        tokens.update((id(g), chosen[g.row]) for g in greedy if g.row is not None)
        return tokens

    def accept(self, seq: Sequence, logits: torch.Tensor) -> None:
        """Sample ``seq``'s next token from ``logits [vocab]`` (float32) and record it; finish the
        answer when it ends there."""
        token, logprob, top = seq.sampler.next_token(logits)
        self._record(seq, token, logprob, top)

    def _record(self, seq: Sequence, token: int, logprob: float | None, top: tuple[tuple[int, float], ...]) -> None:
        self.num_generated_tokens += 1
        finish = seq.append(token, logprob, self.model.eos_token_ids, top)
        if finish:
            self._finish_sequence(seq, finish)

    def _finish_sequence(self, seq: Sequence, finish_reason: FinishReason) -> None:
        """The answer ended: its KV comes back from the batch, the session keeps the turn (or its
        cache is cropped back to the history's stable prefix) and is idle again."""
        session = seq.session
        generated = [e.id for e in seq.events]
        kv = self.runner.batch.release(seq)
        if kv is not None:  # the last token is not fed yet
            session.take_back_kv(kv, seq.prompt_ids + generated[:-1])
        if seq.head is not seq:  # another answer of a request of several: only the head's is remembered
            self.store.discard(session)
            seq.finish(finish_reason)
            return
        if seq.truncated_turns:  # what the model saw: the oldest turns left the context (not their images)
            session.drop_oldest_turns(seq.truncated_turns)
        if seq.remember:
            session.remember(Turn(seq.prompt, seq.detokenizer.text, session.pending_images))
        else:  # keep what the next question can reuse: the history's stable prefix
            stable = self.model.template.prefix_ids(session.chat())
            session.crop_kv(max(seq.num_reused_tokens, common_prefix_len(seq.prompt_ids, stable)))
        session.check_invariants()
        self.store.release(session)
        seq.finish(finish_reason)

    def finish_image_prefill(self, prefill: ImagePrefill) -> None:
        """The prefix is cached: the session is idle again (within the budget) and the prefill has its result."""
        self.store.release(prefill.session)
        prefill.finish()

    def fail(self, work: EngineRequest, exc: Exception) -> None:
        """Record ``exc`` as ``work``'s error and put its session back (no-op once done). The answers
        of a request of several fail together: every one not done is put back, and the head carries
        the error even when its own answer had finished."""
        if isinstance(work, Sequence) and len(work.samples) > 1:
            for seq in work.samples:
                if not seq.done:
                    seq.fail(exc)
                    self.put_back(seq)
            if work.head.error is None:
                work.head.fail(exc)
            return
        if work.done:
            return
        work.fail(exc)
        self.put_back(work)

    def put_back(self, work: EngineRequest) -> None:
        """End ``work`` without a result and leave its session as before the request: an answer's
        cache cropped to what it reused (or dropped if a forward pass failed midway), an added
        image rolled back, an open's session removed."""
        work.end()
        session = work.session
        self.store.unpin(session)
        if isinstance(work, Sequence):
            self._put_back_answer(work)
            if work.head is not work:  # a sample session goes with its answer
                self.store.discard(session)
        elif work.action == "open":
            if session.session_id in self.store:
                try:
                    self.store.remove(session.session_id)
                except ServiceError:
                    pass
            return
        elif work.snapshot is not None:
            session.rollback(work.snapshot, self.model.template.prefix_ids)

    def _put_back_answer(self, seq: Sequence) -> None:
        session = seq.session
        if seq.features_pending:  # a resent conversation's features were never assembled: rebuild from images
            session.drop_features()
            return
        try:
            kv = self.runner.batch.release(seq)
            if kv is not None:
                session.take_back_kv(kv, seq.prompt_ids + [e.id for e in seq.events][:-1])
        except Exception:  # noqa: BLE001 - the row cannot be read back: rebuild the session from features
            log.exception("could not read a session back from the decode batch")
            session.drop_kv()
        session.keep_kv(len(session.cached_ids) if not seq.prefilled else seq.num_reused_tokens)
