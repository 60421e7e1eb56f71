"""Processing a step's output: sample, append, finish, roll back.

After a forward pass each answer samples its next token from its row of the logits and records it
(:meth:`StepOutputs.accept`); a finished answer updates its session (the remembered turn, or the cache
cropped back to the history's stable prefix) and releases it; an image prefill whose prefix is cached
releases its session. On failure or abandonment the session is put back as it was before the request
(:meth:`StepOutputs.put_back`: an answer's cache cropped to what it reused, an added image rolled
back, an open's session removed); the answers of a request of several fail together, and the
head's turn is kept only once all of them have ended.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..conversation import Turn, common_prefix_len
from ..errors import ServiceError
from ..model.kv.cache import undo_pass
from ..results import FinishReason
from ..sampling.rows import sample_rows
from .sequence import EngineRequest, ImagePrefill, Sequence

if TYPE_CHECKING:
    from ..sessions.store import SessionStore
    from .model_runner import ModelRunner

__all__ = ["StepOutputs", "by_rows", "plain_choices", "read_choices"]


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

        The rows whose sampler is :attr:`~..sampling.sampler.Sampler.plain_greedy` or ``plain_sampled``
        take their tokens (and logprobs) from one argmax and one warp and draw of their rows together
        (:func:`plain_choices`), read to the host at once: one device sync a step, where each row's own
        choice is one sync a row (the other rows sample one by one, as before)."""
        live = [g for g in seqs if not g.done]
        plain = [g for g in live if g.sampler.plain]
        chosen: torch.Tensor | list = plain_choices(plain, by_rows(logits, plain)) if plain else []
        choices = dict(zip(map(id, plain), read_choices(chosen, plain), strict=True))
        for g in live:
            if g.done:  # another answer of its request failed and took it along
                continue
            assert g.row is not None
            if id(g) in choices:
                self.accept_chosen(g, *choices[id(g)])
                continue
            try:
                self.accept(g, logits[g.row])
            except Exception as exc:  # noqa: BLE001
                self.fail(g, exc)

    def accept_chosen(self, seq: Sequence, token: int, logprob: float | None = None, fed: int | None = None) -> None:
        """Record ``token`` (and its ``logprob``, None unless the answer asks for logprobs), chosen for
        ``seq`` outside its sampler (:func:`plain_choices`), and finish the answer when it ends there; a
        failure is the answer's alone.

        ``fed``: the next decode step, launched ahead, already fed ``token`` (:meth:`PagedDecodeBatch.
        forward_ahead <.paged_batch.PagedDecodeBatch.forward_ahead>`), at this position of the session's
        cache. The session records it when the answer goes on; when the answer ends with it (or fails)
        the position is taken back first, so the session holds what it would had that step not run: an
        answer's last token is never fed."""
        try:
            seq.sampler.took(token)
            self._record(seq, token, logprob, (), fed)
        except Exception as exc:  # noqa: BLE001
            if fed is not None:
                undo_pass(seq.session.kv_cache, fed)
            self.fail(seq, exc)

    def accept(self, seq: Sequence, logits: torch.Tensor) -> None:
        """Sample ``seq``'s next token from ``logits [vocab]`` (float32) and record it; finish the
        answer when it ends there."""
        token, logprob, top = seq.sampler.next_token(logits)
        self._record(seq, token, logprob, top)

    def _record(
        self,
        seq: Sequence,
        token: int,
        logprob: float | None,
        top: tuple[tuple[int, float], ...],
        fed: int | None = None,
    ) -> None:
        self.num_generated_tokens += 1
        finish = seq.append(token, logprob, self.model.eos_token_ids, top)
        if fed is not None:  # a step launched ahead fed it: kept while the answer goes on (accept_chosen)
            if finish:
                undo_pass(seq.session.kv_cache, fed)
            else:
                seq.session.record_decode([token])
        if finish:
            self._finish_sequence(seq, finish)

    def _finish_sequence(self, seq: Sequence, finish_reason: FinishReason) -> None:
        """The answer ended: it leaves the decode batch (its session's cache holds every token it fed:
        all but the last), the session keeps the turn (or its cache is cropped back to the history's
        stable prefix) and is idle again."""
        self.runner.batch.drop(seq)
        session = seq.session
        seq.finish(finish_reason)
        if seq.head is not seq:  # another answer of a request of several: only the head's is remembered
            self.store.discard(session)
            if seq.head.turn_waits and seq.all_done:
                self._keep_turn(seq.head)
        elif seq.all_done:
            self._keep_turn(seq)
        else:  # the answers of a request succeed or fail together: the turn waits for the others
            seq.turn_waits = True

    def _keep_turn(self, seq: Sequence) -> None:
        """Every answer of ``seq``'s request ended: its session keeps the turn (or its cache is
        cropped back to the history's stable prefix) and is idle again."""
        seq.turn_waits = False
        session = seq.session
        if seq.truncated_turns:  # what the model saw: the oldest turns left the context (not their images)
            session.drop_oldest_turns(seq.truncated_turns)
        if seq.remember:
            session.remember(Turn(seq.prompt, seq.detokenizer.text, session.pending_images))
        else:  # keep what the next question can reuse: the history's stable prefix
            stable = self.model.template.prefix_ids(session.chat())
            session.crop_kv(max(seq.num_reused_tokens, common_prefix_len(seq.prompt_ids, stable)))
        session.check_invariants()
        self.store.release(session)

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
                self.put_back(seq)  # a head whose turn waits is put back too
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
        image rolled back, an open's session removed. No-op once ``work`` is done, but for a head
        whose turn waits for the other answers of its request (:attr:`Sequence.turn_waits`)."""
        if work.done and not (isinstance(work, Sequence) and work.turn_waits):
            return
        work.end()
        session = work.session
        self.store.unpin(session)
        if isinstance(work, Sequence):
            work.turn_waits = False
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
        self.runner.batch.drop(seq)
        session.keep_kv(len(session.cached_ids) if not seq.prefilled else seq.num_reused_tokens)


def by_rows(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """``seqs``' rows of a decode step's ``logits [B, vocab]`` (by each one's ``row``), in their order:
    ``[len(seqs), vocab]``, ``logits`` itself when they are its rows in order."""
    rows = [g.row for g in seqs]
    if rows == list(range(logits.shape[0])):
        return logits
    return logits.index_select(0, torch.tensor(rows).to(logits.device, non_blocking=True))


def plain_choices(seqs: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
    """The next token of each of ``seqs`` (each sampler :attr:`~..sampling.sampler.Sampler.plain_greedy`
    or ``plain_sampled``) from its row of ``logits [len(seqs), vocab]`` float32, on the logits' device,
    without waiting for it: the argmax, or for a sampled answer its warps and draw, the sampled rows
    together (:func:`~..sampling.rows.sample_rows`).

    Returns:
        ``[len(seqs)]`` long: the tokens; or, when any of ``seqs`` asks for logprobs, ``[2, len(seqs)]``
        float32: the tokens (exact in float32: ids under 2**24), over each token's logprob under the
        distribution it was chosen from (the raw logits', or the warped ones' of a sampled answer, as
        :meth:`Sampler.next_token <..sampling.sampler.Sampler.next_token>` gives it), one tensor for one
        read (:func:`read_choices`).
    """
    tokens = logits.argmax(-1)
    sampled = [i for i, g in enumerate(seqs) if g.sampler.plain_sampled]
    drawn = warped = index = None
    if sampled:
        index = torch.tensor(sampled).to(logits.device, non_blocking=True)
        warps = [seqs[i].sampler.warping for i in sampled]  # (temperature, top_k, top_p, min_p) per row
        noise = torch.stack([seqs[i].sampler.noise(logits.shape[-1]) for i in sampled])
        temperature, top_k = [w[0] for w in warps], [w[1] for w in warps]
        top_p, min_p = [w[2] for w in warps], [w[3] for w in warps]
        drawn, warped = sample_rows(logits.index_select(0, index), temperature, top_k, top_p, min_p, noise)
        tokens = tokens.index_copy(0, index, drawn)
    if not any(g.params.logprobs for g in seqs):
        return tokens
    assert logits.shape[-1] < 1 << 24, "token ids must be exact in float32"
    logprobs = _logprob_of(logits, tokens)
    if index is not None and warped is not None and drawn is not None:
        logprobs = logprobs.index_copy(0, index, _logprob_of(warped, drawn))
    return torch.stack([tokens.to(torch.float32), logprobs])


def _logprob_of(scores: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``log_softmax(scores [R, V])`` at each row's token ``tokens [R]``: ``[R]`` float32."""
    return torch.log_softmax(scores, dim=-1).gather(1, tokens[:, None])[:, 0]


def read_choices(chosen: torch.Tensor | list, seqs: list[Sequence]) -> list[tuple[int, float | None]]:
    """:func:`plain_choices`' result for ``seqs`` read to the host (the tensor, or its ``tolist()``
    already read): each one's ``(token, logprob)``, the logprob None where the answer asks for none."""
    values = chosen.tolist() if isinstance(chosen, torch.Tensor) else chosen
    if not values or not isinstance(values[0], list):  # tokens alone
        return [(int(t), None) for t in values]
    return [(int(t), lp if g.params.logprobs else None) for g, t, lp in zip(seqs, values[0], values[1], strict=True)]
