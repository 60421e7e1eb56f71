"""The session ledger's rules, in plain integers: no model, no tensors, milliseconds."""

from __future__ import annotations

import random

import pytest

from llava_sessions.sessions.ledger import Demotion, SessionLedger, Tier

KV = 1000  # bytes per KV token in these tests
FEAT = 50_000  # bytes of one session's image features


def ledger(device: int = 1_000_000, host: int = 10_000) -> SessionLedger:
    return SessionLedger(kv_bytes_per_token=KV, device_budget_bytes=device, host_budget_bytes=host)


def hold(led: SessionLedger, sid: str, tokens: int, host: int = 100) -> None:
    led.add(sid, host)
    led.set_usage(sid, num_kv_tokens=tokens, num_feature_bytes=FEAT)


def test_totals_are_running_sums():
    led = ledger()
    hold(led, "a", 300)
    hold(led, "b", 200, host=250)
    assert led.num_kv_bytes == 500 * KV and led.num_feature_bytes == 2 * FEAT
    assert led.num_device_bytes == 500 * KV + 2 * FEAT and led.num_host_bytes == 350
    assert led.usage == pytest.approx(led.num_device_bytes / 1_000_000)
    led.set_usage("a", num_kv_tokens=10)
    assert led.num_kv_bytes == 210 * KV
    removed = led.remove("b")
    assert removed.num_kv_tokens == 200 and led.num_kv_bytes == 10 * KV and led.num_host_bytes == 100
    assert led.entry("a").tier is Tier.KV


def test_allocate_demotes_least_recently_used_kv_first_then_features():
    led = ledger(device=1_000_000)
    for sid in "abc":
        hold(led, sid, 250)  # 3 x (250 KB + 50 KB) = 900 KB
    led.touch("a")  # LRU order now b, c, a
    demotions = led.allocate(300_000)
    assert demotions == [Demotion("b", Tier.FEATURES, 250 * KV)]  # one KV cache was enough
    assert led.entry("b").tier is Tier.FEATURES and led.num_device_bytes + 300_000 <= 1_000_000
    demotions = led.allocate(900_000)  # needs features too: every KV cache first, then features, LRU
    assert [(d.session_id, d.to) for d in demotions] == [
        ("c", Tier.FEATURES),
        ("a", Tier.FEATURES),
        ("b", Tier.IMAGE),
    ]
    assert led.num_device_bytes + 900_000 <= 1_000_000


def test_pinned_and_kept_sessions_are_never_demoted_and_a_shortage_changes_nothing():
    led = ledger(device=1_000_000)
    hold(led, "busy", 400)
    hold(led, "mine", 400)
    led.pin("busy")
    before = (led.num_device_bytes, led.entry("busy").num_kv_tokens, led.entry("mine").num_kv_tokens)
    assert not led.can_allocate(300_000, keep="mine")
    assert led.allocate(300_000, keep="mine") is None
    assert (led.num_device_bytes, led.entry("busy").num_kv_tokens, led.entry("mine").num_kv_tokens) == before
    led.pin("busy", False)
    assert led.allocate(300_000, keep="mine") == [Demotion("busy", Tier.FEATURES, 400 * KV)]


def test_enforce_and_host_evictions():
    led = ledger(device=600_000, host=1_000)
    for sid in "abcd":
        hold(led, sid, 100, host=300)  # 4 x 150 KB = 600 KB device, 1,200 B host
    led.set_usage("d", num_kv_tokens=300)  # grew past the budget
    assert [d.session_id for d in led.enforce(keep="d")] == ["a", "b"]
    assert led.num_device_bytes <= 600_000
    led.pin("a")
    assert led.evictions(keep="d") == ["b"]  # a is pinned; one eviction brings host under the cap
    for sid in led.evictions(keep="d"):
        led.remove(sid)
    assert led.num_host_bytes <= 1_000


def test_caller_errors_raise():
    led = ledger()
    hold(led, "a", 1)
    with pytest.raises(ValueError):
        led.add("a", 1)
    with pytest.raises(KeyError):
        led.set_usage("nope", num_kv_tokens=1)
    with pytest.raises(ValueError):
        led.set_usage("a", num_kv_tokens=-1)
    with pytest.raises(ValueError):
        led.allocate(-5)
    with pytest.raises(ValueError):
        SessionLedger(kv_bytes_per_token=0, device_budget_bytes=1, host_budget_bytes=1)


def test_random_operations_keep_the_sums_equal_to_the_entries():
    rng = random.Random(0)
    led = ledger(device=2_000_000, host=5_000)
    for step in range(3_000):
        sids = led.lru()
        op = rng.random()
        if op < 0.25 or not sids:
            sid = f"s{step}"
            led.add(sid, rng.randint(0, 400))
            led.set_usage(sid, num_kv_tokens=rng.randint(0, 600), num_feature_bytes=rng.choice([0, FEAT]))
        elif op < 0.45:
            led.set_usage(rng.choice(sids), num_kv_tokens=rng.randint(0, 900))
        elif op < 0.55:
            led.remove(rng.choice(sids))
        elif op < 0.65:
            led.pin(rng.choice(sids), rng.random() < 0.5)
        elif op < 0.8:
            got = led.allocate(rng.randint(0, 1_500_000), keep=rng.choice(sids))
            if got is not None:
                assert all(not led.entry(d.session_id).pinned for d in got)
        else:
            for sid in led.evictions():
                led.remove(sid)
        entries = [led.entry(s) for s in led.lru()]
        assert led.num_kv_bytes == sum(e.num_kv_tokens for e in entries) * KV
        assert led.num_feature_bytes == sum(e.num_feature_bytes for e in entries)
        assert led.num_host_bytes == sum(e.num_host_bytes for e in entries)
