"""Decode attention over the pool's runs when rows share their first pages (``model/kv/runs.py``): the
``n`` samples of one prompt read the prompt's slots once, stacked, and every row's output is what SDPA
over its own gathered positions gives; a row that shares nothing, or too little, reads alone."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llava_sessions.model.kv.runs import (
    MIN_SHARED_POSITIONS,
    attend_runs,
    shared_groups,
    shared_prefix,
    skip_positions,
)


def _reference(query, key, value, runs):
    """SDPA per row over its positions gathered from the pool: ``[B, 1, heads, head_dim]``."""
    outs = []
    for r, spans in enumerate(runs):
        slots = torch.cat([torch.arange(a, b) for a, b in spans])
        k, v = key[:, :, slots], value[:, :, slots]  # [1, kv_heads, positions, head_dim]
        q = query[r : r + 1]
        out = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # [1, heads, 1, head_dim]
        outs.append(out.transpose(1, 2))
    return torch.cat(outs)


def _pool(slots=1024, kv_heads=2, head_dim=16, dtype=torch.float32):
    torch.manual_seed(0)
    layer_k = torch.randn(slots, kv_heads, head_dim, dtype=dtype)
    layer_v = torch.randn(slots, kv_heads, head_dim, dtype=dtype)
    return layer_k.permute(1, 0, 2).unsqueeze(0), layer_v.permute(1, 0, 2).unsqueeze(0)  # the pool's views


def test_rows_that_share_a_prompt_read_it_once_and_answer_as_sdpa_over_their_own_positions():
    key, value = _pool()
    prompt = [(0, 96), (160, 200)]  # 136 positions in two runs of pages
    runs = [
        [*prompt, (320, 323)],  # three forks, each with its own answer pages
        [*prompt, (336, 338)],
        [(0, 96), (160, 205)],  # a fork whose own page came right after the prompt's: one longer run
        [(500, 540)],  # another session: shares nothing
        [(0, 40), (600, 610)],  # shares 40 positions: fewer than MIN_SHARED_POSITIONS, reads alone
    ]
    groups = shared_groups(runs)
    assert ([0, 1, 2], [(0, 96), (160, 200)]) in groups and ([3], []) in groups
    assert sorted(r for members, _ in groups for r in members) == [0, 1, 2, 3, 4]
    assert MIN_SHARED_POSITIONS > 40 and ([4], []) in groups  # by first slot it is the forks' group: held apart
    query = torch.randn(len(runs), 4, 1, 16)  # 4 query heads over 2 kv heads
    torch.testing.assert_close(attend_runs(query, key, value, runs), _reference(query, key, value, runs))


def test_without_shared_pages_each_row_reads_alone_as_before():
    key, value = _pool(kv_heads=4)
    runs = [[(0, 70)], [(100, 180), (300, 301)], [(400, 401)]]
    assert shared_groups(runs) == [([0], []), ([1], []), ([2], [])]
    query = torch.randn(3, 4, 1, 16)
    torch.testing.assert_close(attend_runs(query, key, value, runs), _reference(query, key, value, runs))


def test_bf16_rows_sharing_a_prompt_stay_within_bf16_rounding():
    key, value = _pool(dtype=torch.bfloat16)
    runs = [[(0, 128), (200, 203)], [(0, 128), (220, 221)]]
    query = torch.randn(2, 4, 1, 16, dtype=torch.bfloat16)
    got = attend_runs(query, key, value, runs).float()
    torch.testing.assert_close(got, _reference(query.float(), key.float(), value.float(), runs), rtol=2e-2, atol=2e-2)


def test_the_span_helpers():
    assert shared_prefix([(0, 96), (160, 200)], [(0, 96), (160, 205)]) == 136
    assert shared_prefix([(0, 96)], [(0, 50), (70, 80)]) == 50
    assert shared_prefix([(5, 9)], [(6, 9)]) == 0
    assert skip_positions([(0, 96), (160, 205)], 136) == [(200, 205)]
    assert skip_positions([(0, 10)], 10) == [] and skip_positions([(0, 10), (20, 30)], 3) == [(3, 10), (20, 30)]
