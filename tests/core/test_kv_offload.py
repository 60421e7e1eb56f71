"""Demotion moves a session's KV pages to the host (issue 43 item 1), and its next question moves them back.

fp32 on CPU, the ``tiny`` checkpoint. A worker offloads only on a GPU (on a CPU its host is its
device); these tests give the store an offload budget to run the same code here. Every step checks
the pool's reference counts and the ledger (``check_invariants``).
"""

from __future__ import annotations

import torch

from engine_fixtures import make_engine
from llava_sessions.metrics import WorkerMetrics
from llava_sessions.sampling.sampler import SamplingParams
from llava_sessions.sessions import offload as offload_module
from llava_sessions.sessions.offload import KVOffload
from llava_sessions.sessions.store import Tier

GREEDY = SamplingParams(max_new_tokens=10)
FIRST, NEXT = "What is in this image?", "And what colours do you see there?"
MB = 10**6


def offloading(llava, offload_bytes: int = 100 * MB, **kw):
    return make_engine(llava, store_kw={"kv_offload_bytes": offload_bytes}, **kw)


def ids(answer) -> list[int]:
    return [t.id for t in answer.tokens]


def test_a_demoted_sessions_kv_goes_to_the_host_and_back_without_a_prefill_and_answers_exactly(llava, photos):
    """From the ``features`` tier and from the ``image`` tier (features encoded again): the device
    KV is freed at demotion, the next question writes the host copy into fresh pages and prefills only
    its own tokens, and every answer equals the never-demoted session's."""
    ref = make_engine(llava)
    ref.open("s", photos["coffee"])
    want = [ids(ref.generate("s", FIRST, GREEDY))]
    ref_next = ref.generate("s", NEXT, GREEDY)  # the reuse a session never demoted has
    want.append(ids(ref_next))
    eng = offloading(llava)
    for tier in (Tier.FEATURES, Tier.IMAGE):
        sid = f"s-{tier.value}"
        eng.open(sid, photos["coffee"])
        first = eng.generate(sid, FIRST, GREEDY)
        held = len(eng.store.get(sid).cached_ids)
        pool_used = eng.runner.pool.num_used_bytes()
        eng.store.demote(sid, Tier.FEATURES)
        if tier is Tier.IMAGE:
            eng.store.demote(sid, Tier.IMAGE)
        assert eng.store.get(sid).tier is tier and eng.store.ledger.entry(sid).num_kv_tokens == 0
        assert eng.runner.pool.num_used_bytes() < pool_used  # its pages went back to the pool
        assert sid in eng.store.offload and eng.store.offload.num_bytes == held * llava.kv_bytes_per_token
        gauges = WorkerMetrics(None).snapshot(eng)["gauges"]
        assert gauges[("KVOffloadBytes", ())] == held * llava.kv_bytes_per_token
        prefilled = eng.runner.num_prefilled_tokens
        second = eng.generate(sid, NEXT, GREEDY)
        assert second.restored_from == tier.value and second.cached_tokens == ref_next.cached_tokens > held - 20
        assert eng.runner.num_prefilled_tokens - prefilled < 40  # the question's tokens, not the ~600 held
        assert [ids(first), ids(second)] == want
        assert sid not in eng.store.offload and eng.store.offload.num_bytes == 0
    assert eng.store.stats.num_kv_offloads == 2 and eng.store.offload.num_loads == 2
    assert WorkerMetrics(None).snapshot(eng)["counters"][("KVOffloads", ())] == 2


def test_without_an_offload_budget_a_demoted_session_prefills_again_exactly(llava, photos):
    eng = make_engine(llava)
    eng.open("s", photos["coffee"])
    first = eng.generate("s", FIRST, GREEDY)
    eng.store.demote("s", Tier.FEATURES)
    assert "s" not in eng.store.offload and eng.store.stats.num_kv_offloads == 0
    prefilled = eng.runner.num_prefilled_tokens
    second = eng.generate("s", NEXT, GREEDY)
    assert second.restored_from == "features" and second.cached_tokens == 0
    assert eng.runner.num_prefilled_tokens - prefilled > 500
    ref = make_engine(llava)
    ref.open("s", photos["coffee"])
    assert [ids(ref.generate("s", FIRST, GREEDY)), ids(ref.generate("s", NEXT, GREEDY))] == [ids(first), ids(second)]


def test_the_budget_keeps_the_newest_copies_and_a_closed_session_frees_its_own(llava, photos):
    """An offload budget of about one session's KV: the second demotion drops the first copy (that
    session prefills again, still exactly); a copy larger than the budget is not made; closing a
    session frees its copy."""
    probe = make_engine(llava)
    probe.open("p", photos["coffee"])
    one = len(probe.store.get("p").cached_ids) * llava.kv_bytes_per_token
    eng = offloading(llava, int(one * 1.5))
    for sid in ("a", "b"):
        eng.open(sid, photos["coffee"])
    eng.store.demote("a", Tier.FEATURES)
    eng.store.demote("b", Tier.FEATURES)
    assert "a" not in eng.store.offload and "b" in eng.store.offload and eng.store.offload.num_dropped == 1
    again = eng.generate("a", FIRST, GREEDY)
    assert again.cached_tokens == 0 and ids(again) == ids(probe.generate("p", FIRST, GREEDY, remember=False))
    eng.close("b")
    assert eng.store.offload.num_bytes == 0 and "b" not in eng.store.offload
    small = offloading(llava, one // 2)
    small.open("c", photos["coffee"])
    small.store.demote("c", Tier.FEATURES)
    assert "c" not in small.store.offload and small.store.stats.num_kv_offloads == 0


def test_the_budgets_own_demotions_move_pages_and_the_sessions_answer_exactly(llava, photos):
    """A device budget of about two sessions: opening the third demotes the least recently used one
    (the ledger's choice), whose KV moves to the host; its next question reuses it, exactly."""
    probe = make_engine(llava)
    probe.open("p", photos["rocket"])
    per_session = probe.store.device_bytes()
    want = ids(probe.generate("p", NEXT, GREEDY))
    eng = offloading(llava, budget=int(per_session * 2.5), share_images=False)
    for sid, photo in (("a", "rocket"), ("b", "coffee"), ("c", "astronaut")):
        eng.open(sid, photos[photo])
    assert eng.store.get("a").tier is not Tier.KV and eng.store.stats.num_kv_offloads >= 1
    answer = eng.generate("a", NEXT, GREEDY)
    assert answer.restored_from is not None and answer.cached_tokens > 500 and ids(answer) == want


def test_a_copy_is_reused_only_under_the_images_it_was_computed_over(llava, photos):
    """Placeholder ids are alike for every image: a copy whose images are no longer the session's
    loads nothing, whatever the ids say."""
    eng = offloading(llava)
    eng.open("s", photos["coffee"])
    session = eng.store.get("s")
    offload = KVOffload(100 * MB)
    assert offload.offload(session)
    held = offload.take("s")
    assert held is not None and held.image_keys == session.image_keys
    cache = eng.runner.new_cache()
    assert offload.load(held, cache, [*held.ids, 1], ["another image"]) == 0 and len(cache.table.pages) == 0
    n = offload.load(held, cache, [*held.ids, 1], list(session.image_keys))
    assert n == len(held.ids) and cache.table.num_tokens == n
    keys, _ = cache.layer_states(0)
    assert torch.equal(keys, held.keys[0])
    cache.release()


def test_a_copy_that_fails_drops_the_kv_as_without_offload(llava, photos, monkeypatch):
    """No page-locked host memory (faked): the demotion still happens, the KV is dropped, the next
    question prefills again and answers exactly."""

    def no_host_memory(cache):
        raise RuntimeError("CUDA error: out of memory (cudaHostAlloc)")

    eng = offloading(llava)
    eng.open("s", photos["coffee"])
    first = eng.generate("s", FIRST, GREEDY)
    monkeypatch.setattr(offload_module, "_host_copy", no_host_memory)
    eng.store.demote("s", Tier.FEATURES)
    assert "s" not in eng.store.offload and eng.store.get("s").tier is Tier.FEATURES
    second = eng.generate("s", NEXT, GREEDY)
    assert second.cached_tokens == 0
    ref = make_engine(llava)
    ref.open("s", photos["coffee"])
    assert [ids(ref.generate("s", FIRST, GREEDY)), ids(ref.generate("s", NEXT, GREEDY))] == [ids(first), ids(second)]
