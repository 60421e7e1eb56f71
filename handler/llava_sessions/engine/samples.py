"""Parallel samples (OpenAI's and vLLM's ``n``): one prompt prefilled once, ``n`` answers sampled from it.

A request of ``n`` answers is admitted as one :class:`~.sequence.Sequence`, the *head*, on the
session, plus ``n - 1`` others, each on a *sample session* of its own: a copy of the session's
conversation (its images, their layout and its turns) that no client names and no budget of
sessions counts (``anonymous``), held busy while its answer runs and discarded when it ends. The
others wait (:attr:`Sequence.ready`) until the head's prompt is prefilled; then each forks from it
(:func:`fork_samples`): its KV cache is the head's prompt (the same pages of the KV pool, shared
by reference count, with the last partial page copied once an answer writes to it), its image
features are the head's tensor, and its first token is sampled from the same logits with its own
sampler. From then on each answer is a row of the decode batch like any other; one that is
preempted recomputes its KV from its own session's features.

Only the head's answer becomes the session's turn (``session_choice`` picks which index the head
is). Answer ``i`` samples with ``seed + i`` (:meth:`SamplingParams.for_sample`), so each answer can
be repeated alone. The answers of a request succeed or fail together (:meth:`StepOutputs.fail
<.outputs.StepOutputs.fail>`): a head whose answer ends first keeps its session busy, the turn
waiting (:attr:`Sequence.turn_waits`), until the last answer ends; a request abandoned before then
leaves the session as before. Admission books the memory of all of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence as GenericSequence
from typing import TYPE_CHECKING, Any

from ..sampling.params import SamplingParams
from ..sampling.sampler import IncrementalDetokenizer, Sampler
from .memory import device_bytes, kv_grant_bytes
from .sequence import EngineRequest, Sequence

if TYPE_CHECKING:
    import torch

    from ..sessions.session import Session
    from ..sessions.store import SessionStore

__all__ = ["add_samples", "fork_samples", "runnable", "sample_bytes"]


def sample_bytes(model: Any, page_size: int, num_tokens: int, num_image_tokens: int) -> int:
    """Device bytes one more answer of a request takes once forked: the KV of ``num_tokens``
    positions (the prompt and the answer's room; booked whole, as the ledger counts each session's
    positions, shared pages too) and a second count of the session's image features
    (``num_image_tokens`` rows), bytes."""
    return kv_grant_bytes(model, page_size, 0, num_tokens) + device_bytes(model, 0, num_image_tokens)


def add_samples(
    head: Sequence,
    request: SamplingParams,
    store: SessionStore,
    model: Any,
    grammar: Callable[[SamplingParams], Any],
) -> None:
    """Give ``head`` (built with ``request.for_sample(request.session_choice)``) the request's other
    ``request.n - 1`` answers, each on a new busy sample session (module docstring); no-op for ``n`` = 1.

    Args:
        head: the admitted answer on the session.
        request: the request's parameters (``n``, ``session_choice``, ``seed``, clipped ``max_new_tokens``).
        store: where the sample sessions are held (and counted in the memory budget).
        model: the loaded model (device, end-of-sequence ids, tokenizer).
        grammar: a request's parameters → a new structured-output matcher (or None).
    """
    if request.n == 1:
        return
    session = head.session
    samples: list[Sequence] = []
    held: list[Session] = []
    try:
        for i in range(request.n):
            if i == request.session_choice:
                samples.append(head)
                continue
            copy = _sample_session(session, i)
            store.hold_sample(copy)
            held.append(copy)
            params = request.for_sample(i)
            sampler = Sampler(params, model.device, head.prompt_ids, model.eos_token_ids, grammar(params))
            seq = Sequence(
                head._driver,
                copy,
                head.prompt,
                head.prompt_ids,
                params,
                False,
                sampler,
                IncrementalDetokenizer(model.tokenizer, skip_special_tokens=params.skip_special_tokens),
                truncated_turns=head.truncated_turns,
                room_tokens=head.room_tokens,
            )
            seq.head, seq.index = head, i
            samples.append(seq)
    except BaseException:
        for copy in held:  # a sampler or grammar that could not start: no copy stays held
            store.discard(copy)
        raise
    head.index = request.session_choice
    for seq in samples:
        seq.samples = samples


def _sample_session(session: Session, index: int) -> Session:
    """A copy of ``session``'s conversation for answer ``index`` (anonymous, holding nothing on the
    device yet; its own lists, as the session's history grows when its answer is remembered)."""
    return dataclasses.replace(
        session,
        session_id=f"{session.session_id}/sample-{index}",
        images=list(session.images),
        image_keys=list(session.image_keys),
        image_sizes=list(session.image_sizes),
        image_tokens=list(session.image_tokens),
        image_urls={},
        image_uuids={},
        anonymous=True,
        source_id=None,
        history=list(session.history),
        image_features=None,
        kv_cache=None,
        cached_ids=[],
        busy=False,
        num_restores=0,
        changed=True,
    )


def fork_samples(head: Sequence, model: Any, accept: Callable[[Sequence, torch.Tensor], None], logits: Any) -> None:
    """The head's prompt is prefilled (its session caches exactly its prompt): start every other
    answer of its request from it (module docstring), sampling each one's first token from ``logits``
    ``[vocab]`` (float32; each sampler gets a copy). Run before the head samples its own.

    Each answer's cache shares the prompt's pages (:meth:`SessionKV.fork
    <llava_sessions.model.SessionKV.fork>`: nothing copied).
    """
    session = head.session
    n = len(head.prompt_ids)
    assert session.kv_cache is not None, "the head's prompt is prefilled"
    for seq in head.samples:
        if seq is head or seq.done:
            continue
        seq.session.set_features(session.image_features)
        seq.session.adopt_kv(session.kv_cache.fork(n), session.cached_ids[:n])
        seq.started(head.restored_from, head.num_reused_tokens, 0.0)
        seq.prefilled_all()
        accept(seq, logits.clone())


def runnable(work: GenericSequence[EngineRequest]) -> list[EngineRequest]:
    """``work`` and every other answer of its requests (:attr:`Sequence.samples`), each once, in
    order, less what is done and the answers still waiting for their head's prefill."""
    every = [s for w in work for s in (w.samples if isinstance(w, Sequence) else (w,))]
    live = {id(w): w for w in every if not w.done and (not isinstance(w, Sequence) or w.ready)}
    return list(live.values())
