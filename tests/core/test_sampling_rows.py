"""Sampling a step's rows together (``sampling/rows.py``, issue 59 item 2): the warps equal transformers'
own warpers row by row, the exponential race draws tokens with their probabilities, and a seeded answer
draws the same tokens alone (:meth:`Sampler.next_token`) as beside other rows (:func:`sample_rows`).
fp32 on the CPU."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from llava_sessions.sampling.params import SamplingParams
from llava_sessions.sampling.rows import race, sample_rows, warp_rows
from llava_sessions.sampling.sampler import Sampler

VOCAB = 512
#: (temperature, top_k, top_p, min_p) per row; None: the warper is off for that row
ROWS = [
    (0.7, None, None, None),
    (None, 20, None, None),
    (None, None, 0.8, None),
    (None, None, None, 0.05),
    (1.3, 50, 0.9, 0.02),
    (0.5, 1, None, None),
    (2.0, None, 0.3, None),
]
#: rows where each that asks for top-p asks for top-k too: the nucleus is found among the top-k's tokens
ROWS_WITH_TOP_K = [
    (0.7, 30, 0.9, None),
    (None, 20, None, None),
    (1.3, 50, 0.8, 0.02),
    (None, None, None, 0.05),
    (0.9, 5, 0.5, None),
]


def transformers_probs(logits: torch.Tensor, temperature, top_k, top_p, min_p) -> torch.Tensor:
    procs = LogitsProcessorList()
    if temperature is not None:
        procs.append(TemperatureLogitsWarper(temperature))
    if top_k:
        procs.append(TopKLogitsWarper(top_k))
    if top_p is not None:
        procs.append(TopPLogitsWarper(top_p))
    if min_p:
        procs.append(MinPLogitsWarper(min_p))
    return procs(torch.empty(1, 0, dtype=torch.long), logits.unsqueeze(0)).softmax(-1)[0]


def neutral(temperature, top_k, top_p, min_p) -> tuple[float, int, float, float]:
    return (temperature or 1.0, top_k or 0, 1.0 if top_p is None else top_p, min_p or 0.0)


@pytest.mark.parametrize("rows", [ROWS, ROWS_WITH_TOP_K], ids=["top-p-sorts-the-vocabulary", "top-p-within-top-k"])
def test_the_rows_warps_equal_transformers_warpers_row_by_row(rows):
    torch.manual_seed(0)
    logits = torch.randn(len(rows), VOCAB) * 4
    t, k, p, m = zip(*(neutral(*r) for r in rows), strict=True)
    warped = warp_rows(logits, t, k, p, m).softmax(-1)
    for i, row in enumerate(rows):
        want = transformers_probs(logits[i], *row)
        assert torch.allclose(warped[i], want, atol=1e-6), row
        assert torch.equal(warped[i] > 0, want > 0), row  # the same tokens cut
        if row[1] == 1:
            assert int((warped[i] > 0).sum()) == 1  # top-k 1: only the most likely token is left


def test_the_race_draws_each_token_with_its_probability():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    g = torch.Generator().manual_seed(1)
    draws = 40_000
    noise = torch.empty(draws, 5).exponential_(generator=g)
    counts = torch.bincount(race(probs.expand(draws, 5), noise), minlength=5).float() / draws
    assert torch.allclose(counts, probs, atol=0.01), counts
    assert counts[-1] == 0  # a cut token is never drawn


@pytest.mark.parametrize(("seed", "rows"), [(0, ROWS), (7, ROWS_WITH_TOP_K)], ids=["sorted", "within-top-k"])
def test_a_seeded_answer_draws_the_same_tokens_alone_and_beside_other_rows(seed, rows):
    """Each row's sampler draws its tokens one by one (``next_token``) in one copy and with the others
    (``sample_rows``: the rows' warps, each row's noise from its own generator) in another, over eight
    steps of changing logits: the same tokens."""
    params = [SamplingParams(do_sample=True, temperature=t, top_k=k, top_p=p, min_p=m, seed=seed + i) for i, (t, k, p, m) in
              enumerate(rows)]  # fmt: skip
    alone = [Sampler(q, torch.device("cpu"), [1, 2, 3]) for q in params]
    together = [Sampler(q, torch.device("cpu"), [1, 2, 3]) for q in params]
    assert all(s.plain_sampled and not s.plain_greedy for s in together)
    torch.manual_seed(seed)
    for _ in range(8):
        logits = torch.randn(len(rows), VOCAB) * 3
        one_by_one = [s.next_token(logits[i])[0] for i, s in enumerate(alone)]
        t, k, p, m = zip(*(s.warping for s in together), strict=True)
        noise = torch.stack([s.noise(VOCAB) for s in together])
        drawn, _ = sample_rows(logits, t, k, p, m, noise)
        assert drawn.tolist() == one_by_one
        for s, token in zip(together, drawn.tolist(), strict=True):
            s.took(token)


def test_greedy_answers_and_answers_with_penalties_or_top_logprobs_are_not_sampled_together():
    """A token's own logprob is chosen with it (the native dialect's default); top logprobs are not."""
    cpu = torch.device("cpu")
    assert Sampler(SamplingParams(), cpu, [1]).plain_greedy
    assert Sampler(SamplingParams(logprobs=True), cpu, [1]).plain_greedy
    assert Sampler(SamplingParams(temperature=0.7, seed=1, logprobs=True), cpu, [1]).plain_sampled
    assert not Sampler(SamplingParams(), cpu, [1]).plain_sampled
    for extra in ({"logprobs": True, "top_logprobs": 2}, {"repetition_penalty": 1.2}, {"frequency_penalty": 0.5}):
        s = Sampler(SamplingParams(temperature=0.7, seed=1, **extra), cpu, [1])
        assert not s.plain_sampled and not s.plain_greedy, extra
    with pytest.raises(ValueError, match="no generator"):
        Sampler(SamplingParams(), cpu, [1]).noise(VOCAB)


@pytest.mark.parametrize(("seed", "rows"), [(0, ROWS), (7, ROWS_WITH_TOP_K)], ids=["sorted", "within-top-k"])
def test_tokens_chosen_together_carry_the_logprobs_each_sampler_gives_alone(seed, rows):
    """A step's plain rows chosen together (``plain_choices``: greedy rows and seeded sampled rows, most
    asking for their tokens' logprobs, read as one tensor) give each row the token and the logprob its
    own ``next_token`` gives, over eight steps: the raw distribution's for a greedy row, the warped one's
    for a sampled row; None for a row that asks for none."""
    from types import SimpleNamespace

    from llava_sessions.engine.outputs import plain_choices, read_choices

    params = [SamplingParams(max_new_tokens=20, logprobs=True), SamplingParams(max_new_tokens=20)]
    params += [
        SamplingParams(do_sample=True, temperature=t, top_k=k, top_p=p, min_p=m, seed=seed + i, logprobs=i % 3 != 1)
        for i, (t, k, p, m) in enumerate(rows)
    ]
    alone = [Sampler(q, torch.device("cpu"), [1, 2, 3]) for q in params]
    together = [SimpleNamespace(sampler=Sampler(q, torch.device("cpu"), [1, 2, 3]), params=q) for q in params]
    assert all(g.sampler.plain_greedy or g.sampler.plain_sampled for g in together)
    torch.manual_seed(seed)
    for _ in range(8):
        logits = torch.randn(len(params), VOCAB) * 3
        want = [s.next_token(logits[i])[:2] for i, s in enumerate(alone)]
        got = read_choices(plain_choices(together, logits), together)  # type: ignore[arg-type]
        assert [t for t, _ in got] == [t for t, _ in want]
        for (_, lp), (_, expected) in zip(got, want, strict=True):
            assert (lp is None) == (expected is None)
            assert lp is None or abs(lp - expected) < 1e-5
        for g, (token, _) in zip(together, got, strict=True):
            g.sampler.took(token)
