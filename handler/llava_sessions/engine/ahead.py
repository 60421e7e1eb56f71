"""Async scheduling: the next decode step runs on the GPU while the host records this one's tokens.

In step with the host, a decode step is: the GPU runs the pass; the host waits for the tokens, then
records them (detokenizes, checks stops, streams); only then is the next pass launched, so the GPU
idles while the host works (a tenth of a 7b-shaped model's step, benchmarks/results/the-gpu-table.md). Here,
once the tokens are chosen on the device (:func:`~.outputs.plain_choices`: argmax, or warps and draw),
the next pass is launched fed those tokens where they are (:meth:`PagedDecodeBatch.forward_ahead
<.paged_batch.PagedDecodeBatch.forward_ahead>`), and its own tokens are chosen and queued for the host
behind it; then the host reads and records the first step's tokens while the GPU runs the second.
The next engine step over the same answers launches the third before it records the second, and so on
(vLLM v1's async scheduling; SGLang's overlap scheduler).

What a step launched ahead costs when an answer ends: its row computed a position the answer never
needs. That position is taken back before the answer finishes (:meth:`StepOutputs.accept_chosen
<.outputs.StepOutputs.accept_chosen>`), so every session holds exactly what the engine in step with the
host leaves, and the answers are the same tokens. An answer certain to end by ``max_new_tokens`` is
not launched ahead.

Only what the device can choose goes ahead: every answer of the step ``plain_greedy`` or
``plain_sampled`` (no top logprobs, grammar, penalties, logit bias, ``min_tokens`` mask; a token's own
logprob is chosen with it), over the static step. Anything else in the next engine step (an answer joining, a prefill chunk, an
answer gone) first records the tokens in flight (:meth:`StepAhead.settle`), then steps as usual. Between
engine steps every session's cache and the ledger agree; only the tokens in flight are not yet the
answers' events (a stream shows them one step later).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence as GenericSequence
from typing import TYPE_CHECKING, Any

import torch

from ..model.kv.cache import undo_pass
from .outputs import by_rows, plain_choices, read_choices

if TYPE_CHECKING:
    from .outputs import StepOutputs
    from .paged_batch import PagedDecodeBatch
    from .sequence import EngineRequest, Sequence

__all__ = ["InFlight", "StepAhead"]

log = logging.getLogger(__name__)


@dataclasses.dataclass
class InFlight:
    """A step's tokens, chosen on the device and on their way to the host.

    Attributes:
        seqs: the step's answers, in the order of ``tokens`` (an answer that ended since is skipped).
        tokens: ``[len(seqs)]`` long on the device: each one's token.
        host: :func:`~.outputs.plain_choices`' tensor (the tokens, and their logprobs when any answer
            asks for them) on the host (pinned on a GPU), valid once ``copied`` is done.
        copied: the CUDA event recorded after the copy (None on a CPU: ``host`` is the device's tensor).
    """

    seqs: list[Sequence]
    tokens: torch.Tensor
    host: torch.Tensor
    copied: Any = None

    @classmethod
    def send(cls, seqs: list[Sequence], chosen: torch.Tensor) -> InFlight:
        """Queue ``chosen``'s copy (:func:`~.outputs.plain_choices`' result) to the host behind the work
        that computes it (without waiting)."""
        tokens = chosen if chosen.dim() == 1 else chosen[0].to(torch.long)
        if chosen.device.type != "cuda":
            return cls(seqs, tokens, chosen)
        host = torch.empty(chosen.shape, dtype=chosen.dtype, pin_memory=True)
        host.copy_(chosen, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record(torch.cuda.current_stream(chosen.device))
        return cls(seqs, tokens, host, copied)

    def read(self) -> list[tuple[int, float | None]]:
        """Each answer's ``(token, logprob)`` on the host (waits for their copy only, not for work
        queued after it; :func:`~.outputs.read_choices`)."""
        if self.copied is not None:
            self.copied.synchronize()
        return read_choices(self.host, self.seqs)

    def live(self) -> list[Sequence]:
        """Its answers that have not ended."""
        return [g for g in self.seqs if not g.done]


class StepAhead:
    """The decode step in flight and how the engine goes on from it (module docstring).

    Args:
        batch: the paged decode batch (its static step runs the steps launched ahead).
        outputs: records the tokens (:class:`~.outputs.StepOutputs`).
        room: device bytes -> whether room is made for them (the executor's grant for the pages a
            step launched ahead opens).

    Attributes:
        flight: the step whose tokens the host has not recorded (None: the engine is in step with the host).
        num_steps: decode steps launched before the host read the tokens they are fed (a counter).
    """

    def __init__(self, batch: PagedDecodeBatch, outputs: StepOutputs, room: Callable[[int], bool]) -> None:
        self.batch = batch
        self.outputs = outputs
        self.room = room
        self.flight: InFlight | None = None
        self.num_steps = 0

    @staticmethod
    def eligible(seqs: GenericSequence[Sequence]) -> bool:
        """Whether the device can choose every one of ``seqs``' next tokens (each sampler plain)."""
        return bool(seqs) and all(g.sampler.plain for g in seqs)

    def continues(self, live: GenericSequence[EngineRequest]) -> bool:
        """Whether the engine's next step over ``live`` (the runnable work) is the decode step of the
        answers in flight, all of them and nothing else."""
        flight = self.flight
        if flight is None:
            return False
        going = flight.live()
        return len(live) == len(going) and {id(w) for w in live} == {id(g) for g in going}

    def accept(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        """After a decode step in step with the host (``logits [B, vocab]`` by each one's ``row``, every
        one of ``seqs`` :meth:`eligible`): choose the tokens on the device, launch the next step fed them,
        then record them."""
        self._go(InFlight.send(seqs, plain_choices(seqs, by_rows(logits, seqs))))

    def step(self) -> None:
        """The engine's next step when it :meth:`continues`: launch the step after the one in flight,
        fed its tokens, then record them."""
        flight, self.flight = self.flight, None
        assert flight is not None
        self._go(flight)

    def settle(self) -> None:
        """Record the tokens in flight, if any: the engine is in step with the host again (each answer
        as after a step in step with the host)."""
        flight, self.flight = self.flight, None
        if flight is not None:
            self._record(flight, {})

    def _go(self, flight: InFlight) -> None:
        """Launch the step after ``flight`` for its answers that may go on, fed its tokens; then record
        them (the host waits here for ``flight``'s copy only). The launched step is in flight after.

        An answer goes on unless it ended, its token in flight is its last by ``max_new_tokens``, or the
        device cannot choose its next token: its sampler, before that token is recorded, is not plain
        (a ``min_tokens`` mask lifts one token later than in step: the answer steps in step once more)."""
        index = [i for i, g in enumerate(flight.seqs) if self._goes_on(g)]
        seqs = [flight.seqs[i] for i in index]
        ahead, fed = self._launch(flight, index, seqs) if seqs else (None, {})
        self._record(flight, fed)
        if ahead is not None and ahead.live():
            self.flight = ahead

    def _record(self, flight: InFlight, fed: dict[int, int]) -> None:
        """Record ``flight``'s tokens (the host waits for their copy only) in its answers that have not
        ended; ``fed``: the position of each (by id) that the step launched after it already fed."""
        for g, (token, logprob) in zip(flight.seqs, flight.read(), strict=True):
            if not g.done:
                self.outputs.accept_chosen(g, token, logprob, fed.get(id(g)))

    def _launch(
        self, flight: InFlight, index: list[int], seqs: list[Sequence]
    ) -> tuple[InFlight | None, dict[int, int]]:
        """The step after ``flight`` for ``seqs`` (its answers at ``index``), launched and its tokens
        chosen: ``(its InFlight, each answer's fed position by id)``, or ``(None, {})`` with every cache
        as before when it could not launch or choose (the answers step in step with the host). On an
        interrupt, ``flight`` stays in flight (the next step records it) and the interrupt goes on."""
        starts: list[int] | None = None
        try:
            tokens = flight.tokens
            if len(index) < len(flight.seqs):
                tokens = tokens.index_select(0, torch.tensor(index).to(tokens.device, non_blocking=True))
            launched = self.batch.forward_ahead(seqs, tokens, self.room)
            if launched is None:
                return None, {}
            logits, starts = launched
            ahead = InFlight.send(seqs, plain_choices(seqs, logits))
        except BaseException as exc:
            for g, start in zip(seqs, starts or (), strict=False):
                undo_pass(g.session.kv_cache, start)
            if not isinstance(exc, Exception):
                self.flight = flight
                raise
            log.debug("choosing a step launched ahead failed; its answers step in step", exc_info=True)
            return None, {}
        self.num_steps += 1
        return ahead, {id(g): start for g, start in zip(seqs, starts, strict=True)}

    def _goes_on(self, seq: Sequence) -> bool:
        """Whether ``seq``'s step after its token in flight is launched ahead (:meth:`_go`)."""
        if seq.done or len(seq.events) + 1 >= seq.params.max_new_tokens:
            return False
        return seq.sampler.plain
