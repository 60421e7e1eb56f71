"""A decode step's greedy and sampled rows: picked together against one per row, side by side (issue 59 item 2).

After each decode step every answer picks its next token from its row of the logits ``[B, vocab]``
(float32). Each row sampling alone (:meth:`Sampler.next_token
<llava_sessions.sampling.sampler.Sampler.next_token>`) runs an argmax and reads its token to the host: on a
GPU, one kernel and one device sync per row. Rows with nothing but greedy to compute (:attr:`Sampler.plain_greedy
<llava_sessions.sampling.sampler.Sampler.plain_greedy>`) take theirs from one argmax over the batch, read at
once (:meth:`StepOutputs.accept_rows <llava_sessions.engine.outputs.StepOutputs.accept_rows>`). Measured here:
ms per step of each way, at each row count, the same logits, after a warm-up; the tokens must agree.

Sampled rows the same way (:func:`measure_sampled`): seeded rows with temperature 0.8, top-k 50 and top-p
0.9, each drawn alone (transformers' warpers, a softmax and the exponential race per row, one read each)
against all warped and drawn together (:func:`~llava_sessions.sampling.rows.sample_rows`, one read). The
same seeds on both sides: the tokens must agree.

Greedy rows that ask for their tokens' logprobs (the native dialect's default) the same way
(:func:`measure_logprobs`): each row's ``next_token`` (a ``log_softmax`` and a read per row) against one
argmax and one ``log_softmax`` over the rows, read as one tensor; tokens and logprobs must agree.

Usage: python benchmarks/greedy_rows.py [--device cuda] [--rows 1,8,32,64] [--vocab 32064] [--repeats 200]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable

import torch

from llava_sessions.sampling.rows import sample_rows
from llava_sessions.sampling.sampler import Sampler, SamplingParams


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(device: torch.device, rows: int, vocab: int, repeats: int) -> dict[str, float]:
    """ms per step of ``rows`` greedy rows picked one by one and from one argmax (medians of ``repeats``
    steps), and their ratio.

    Raises:
        AssertionError: the two ways picked different tokens.
    """
    logits = torch.randn(rows, vocab, device=device, dtype=torch.float32)
    samplers = [Sampler(SamplingParams(max_new_tokens=repeats + 10), device, [1, 2, 3]) for _ in range(rows)]
    assert all(s.plain_greedy for s in samplers)

    def one_by_one() -> list[int]:
        return [s.next_token(logits[i])[0] for i, s in enumerate(samplers)]

    def batched() -> list[int]:
        tokens = logits.argmax(-1).tolist()
        for s, token in zip(samplers, tokens, strict=True):
            s.took(token)
        return tokens

    assert one_by_one() == batched()
    return _timed(device, {"one_by_one": one_by_one, "batched": batched}, repeats)


def _timed(device: torch.device, ways: dict[str, Callable[[], list[int]]], repeats: int) -> dict[str, float]:
    """Median ms of each of two ways (``one_by_one``, ``batched``) over ``repeats`` alternating runs, and
    their ratio."""
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(repeats):
        for name, pick in ways.items():
            _sync(device)
            t0 = time.perf_counter()
            pick()
            _sync(device)
            times[name].append((time.perf_counter() - t0) * 1000)
    apart, together = statistics.median(times["one_by_one"]), statistics.median(times["batched"])
    return {"one_by_one_ms": round(apart, 4), "batched_ms": round(together, 4), "ratio": round(apart / together, 2)}


def measure_sampled(device: torch.device, rows: int, vocab: int, repeats: int) -> dict[str, float]:
    """ms per step of ``rows`` seeded sampled rows (temperature 0.8, top-k 50, top-p 0.9) drawn one by
    one and together, and their ratio.

    Raises:
        AssertionError: the two ways drew different tokens (each side's samplers seeded alike).
    """
    logits = torch.randn(rows, vocab, device=device, dtype=torch.float32)

    def samplers() -> list[Sampler]:
        params = [SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=i) for i in range(rows)]
        return [Sampler(p, device, [1, 2, 3]) for p in params]

    alone, together = samplers(), samplers()
    assert all(s.plain_sampled for s in together)
    t, k, p, m = zip(*(s.warping for s in together), strict=True)

    def one_by_one() -> list[int]:
        return [s.next_token(logits[i])[0] for i, s in enumerate(alone)]

    def batched() -> list[int]:
        noise = torch.stack([s.noise(vocab) for s in together])
        tokens = sample_rows(logits, t, k, p, m, noise)[0].tolist()
        for s, token in zip(together, tokens, strict=True):
            s.took(token)
        return tokens

    assert one_by_one() == batched()
    return _timed(device, {"one_by_one": one_by_one, "batched": batched}, repeats)


def measure_logprobs(device: torch.device, rows: int, vocab: int, repeats: int) -> dict[str, float]:
    """ms per step of ``rows`` greedy rows that ask for their tokens' logprobs (the native dialect's
    default) picked one by one (each row's ``next_token``: a ``log_softmax`` and a read each) and together
    (:func:`~llava_sessions.engine.outputs.plain_choices`: one argmax, one ``log_softmax``, one read),
    and their ratio.

    Raises:
        AssertionError: the two ways picked different tokens, or logprobs more than 1e-5 apart.
    """
    from types import SimpleNamespace

    from llava_sessions.engine.outputs import plain_choices, read_choices

    logits = torch.randn(rows, vocab, device=device, dtype=torch.float32)
    params = SamplingParams(max_new_tokens=repeats + 10, logprobs=True)
    alone = [Sampler(params, device, [1, 2, 3]) for _ in range(rows)]
    together = [SimpleNamespace(sampler=Sampler(params, device, [1, 2, 3]), params=params) for _ in range(rows)]
    assert all(g.sampler.plain_greedy for g in together)
    picked: list[tuple[list[int], list[float]]] = []

    def one_by_one() -> list[int]:
        chosen = [s.next_token(logits[i])[:2] for i, s in enumerate(alone)]
        picked.append(([t for t, _ in chosen], [lp for _, lp in chosen]))
        return picked[-1][0]

    def batched() -> list[int]:
        chosen = read_choices(plain_choices(together, logits), together)  # type: ignore[arg-type]
        for g, (token, _) in zip(together, chosen, strict=True):
            g.sampler.took(token)
        picked.append(([t for t, _ in chosen], [lp for _, lp in chosen]))
        return picked[-1][0]

    assert one_by_one() == batched()
    assert all(abs(a - b) < 1e-5 for a, b in zip(picked[0][1], picked[1][1], strict=True))
    return _timed(device, {"one_by_one": one_by_one, "batched": batched}, repeats)


def table(device: torch.device, row_counts: list[int], vocab: int, repeats: int) -> dict[str, dict[str, float]]:
    """:func:`measure` at each row count."""
    return {str(n): measure(device, n, vocab, repeats) for n in row_counts}


def sampled_table(device: torch.device, row_counts: list[int], vocab: int, repeats: int) -> dict[str, dict[str, float]]:
    """:func:`measure_sampled` at each row count."""
    return {str(n): measure_sampled(device, n, vocab, repeats) for n in row_counts}


def logprob_table(device: torch.device, row_counts: list[int], vocab: int, repeats: int) -> dict[str, dict[str, float]]:
    """:func:`measure_logprobs` at each row count."""
    return {str(n): measure_logprobs(device, n, vocab, repeats) for n in row_counts}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rows", default="1,8,32,64")
    ap.add_argument("--vocab", type=int, default=32064, help="llava-1.5's vocabulary")
    ap.add_argument("--repeats", type=int, default=200)
    args = ap.parse_args(argv)
    rows = [int(x) for x in args.rows.split(",")]
    report = {
        "device": args.device,
        "vocab": args.vocab,
        "rows": table(torch.device(args.device), rows, args.vocab, args.repeats),
        "sampled_rows": sampled_table(torch.device(args.device), rows, args.vocab, args.repeats),
        "logprob_rows": logprob_table(torch.device(args.device), rows, args.vocab, args.repeats),
    }
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
