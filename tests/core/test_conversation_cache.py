"""The conversation cache: chat requests without a session, resent turn after turn, at a session's cost.

In the engine (fp32 on CPU, the ``tiny`` checkpoint, real photographs), as the chat dialect drives it
for a request without a session: a fresh session per request (:meth:`SessionEngine.open_empty`), the
resent conversation (:meth:`SessionEngine.start_chat`), then :meth:`SessionEngine.retain`. Every answer
is compared with ``model.generate`` from scratch on the same chat-templated conversation.
"""

from __future__ import annotations

import itertools

import pytest

import engine_fixtures
from llava_sessions.conversation import image_key
from llava_sessions.engine import EngineLimits
from llava_sessions.sessions.ledger import Tier
from test_chat_engine import EncodeCounter, chat, reference
from test_engine import ids

_ids = itertools.count()


def make_engine(llava, *, budget: int = 10**10, share: float = 0.5, entries: int = 64, unsalted="shared"):
    limits = EngineLimits(max_new_tokens_cap=4096, cache_share=share, cache_entries=entries)
    return engine_fixtures.make_engine(llava, budget, limits=limits, unsalted=unsalted)


def stateless(eng, system, turns, question, q_images, *, salt=None):
    """One chat request without a session, as the chat dialect runs it; returns its answer."""
    sid = f"sessionless-{next(_ids)}"
    eng.open_empty(sid, salt=salt)
    from test_chat_engine import target

    gen = eng.start_chat(sid, target(system, turns, question, q_images), _greedy(), salt=salt)
    for _ in gen:
        pass
    eng.retain(sid)
    eng.store.check_invariants()
    return gen.answer


def _greedy():
    from test_engine import GREEDY

    return GREEDY


def entries(eng):
    return [s for s in eng.store.sessions() if s.anonymous]


def test_resent_turns_without_a_session_are_exact_and_prefill_only_what_is_new(llava, photos, monkeypatch):
    eng = make_engine(llava)
    cat = photos["chelsea"]
    a1 = stateless(eng, None, [], "What is in the picture?", [cat])
    assert ids(a1) == reference(llava, None, [], "What is in the picture?", [cat])
    assert a1.cached_tokens == 0
    assert len(entries(eng)) == 1 and len(eng.store) == 0  # an entry, not a session
    counter = EncodeCounter(llava, monkeypatch)
    turns = [("What is in the picture?", a1.text, [cat])]
    a2 = stateless(eng, None, turns, "What colour is it?", [])
    assert ids(a2) == reference(llava, None, turns, "What colour is it?", [])
    assert counter.calls == 0  # the image's features came with the entry
    assert a2.cached_tokens >= a1.prompt_tokens  # everything up to the first answer was served
    assert len(entries(eng)) == 1  # the first turn's entry went: the second serves all it served
    turns.append(("What colour is it?", a2.text, []))
    a3 = stateless(eng, None, turns, "And the background?", [])
    assert ids(a3) == reference(llava, None, turns, "And the background?", [])
    assert a3.cached_tokens >= a2.prompt_tokens
    assert a3.cached_tokens / a3.prompt_tokens >= 0.9


def test_conversations_sharing_a_first_turn_share_its_prefix(llava, photos, monkeypatch):
    eng = make_engine(llava)
    cat = photos["chelsea"]
    a = stateless(eng, "Be brief.", [], "What animal is it?", [cat])
    assert ids(a) == reference(llava, "Be brief.", [], "What animal is it?", [cat])
    counter = EncodeCounter(llava, monkeypatch)
    b = stateless(eng, "Be brief.", [], "Where is it sitting?", [cat])
    assert ids(b) == reference(llava, "Be brief.", [], "Where is it sitting?", [cat])
    assert counter.calls == 0 and b.cached_tokens >= llava.num_image_tokens
    assert len(entries(eng)) == 2  # two branches: neither serves all the other does


def test_salts_share_nothing_but_with_an_equal_salt(llava, photos, monkeypatch):
    eng = make_engine(llava)
    cat = photos["chelsea"]
    key = image_key(cat)
    stateless(eng, None, [], "What is in the picture?", [cat], salt="tenant-a")
    assert eng.image_held(None, key, "tenant-a") is not None
    assert eng.image_held(None, key, "tenant-b") is None  # a stored image is not offered across salts
    assert eng.image_held(None, key, None) is None  # nor to unsalted requests
    counter = EncodeCounter(llava, monkeypatch)
    b = stateless(eng, None, [], "What is in the picture?", [cat], salt="tenant-b")
    assert b.cached_tokens == 0 and counter.calls == 1  # neither KV nor features crossed
    unsalted = stateless(eng, None, [], "What is in the picture?", [cat])
    assert unsalted.cached_tokens == 0 and counter.calls == 2
    again = stateless(eng, None, [], "What is in the picture?", [cat], salt="tenant-a")
    assert again.cached_tokens >= again.prompt_tokens - 1 and counter.calls == 2  # an equal salt shares
    assert ids(again) == ids(b) == ids(unsalted)


def test_isolated_unsalted_requests_share_nothing_and_keep_nothing(llava, photos, monkeypatch):
    eng = make_engine(llava, unsalted="isolated")
    cat = photos["chelsea"]
    stateless(eng, None, [], "What is in the picture?", [cat])
    assert entries(eng) == []  # nothing to share it with: not kept
    eng.open_empty("s")
    chat(eng, "s", None, [], "What is in the picture?", [cat])
    counter = EncodeCounter(llava, monkeypatch)
    b = stateless(eng, None, [], "What is in the picture?", [cat])
    assert b.cached_tokens == 0 and counter.calls == 1  # the session's image is not offered
    c = stateless(eng, None, [], "What is in the picture?", [cat], salt="t")
    assert c.cached_tokens == 0  # a salt shares only with its equal
    assert len(entries(eng)) == 1


def test_a_uuid_resolves_within_its_salt_only(llava, photos):
    eng = make_engine(llava)
    cat = photos["chelsea"]
    sid = "sessionless-uuid"
    eng.open_empty(sid, salt="a")
    eng.remember_urls(sid, {}, {"cat-1": image_key(cat)})
    from test_chat_engine import target

    for _ in eng.start_chat(sid, target(None, [], "What is it?", [cat]), _greedy(), salt="a"):
        pass
    eng.retain(sid)
    assert eng.uuid_key(None, "cat-1", "a") == image_key(cat)
    assert eng.uuid_key(None, "cat-1", "b") is None
    assert eng.uuid_key(None, "cat-1", None) is None
    assert eng.uuid_key(None, "dog-1", "a") is None


def test_entries_go_first_oldest_first_and_sessions_are_never_demoted_for_them(llava, photos):
    cat, rocket, coffee = photos["chelsea"], photos["rocket"], photos["coffee"]
    probe = make_engine(llava)
    stateless(probe, None, [], "What is it?", [cat])
    one = probe.store.num_cache_bytes
    eng = make_engine(llava, budget=int(one * 3.6), share=1.0)  # a session, two entries, a request
    eng.open_empty("s")
    chat(eng, "s", None, [], "What is it?", [photos["astronaut"]])
    stateless(eng, None, [], "What is it?", [cat])
    stateless(eng, None, [], "What is it?", [rocket])
    first = [s.image_keys[0] for s in entries(eng)]
    assert first == [image_key(cat), image_key(rocket)]
    answer = stateless(eng, None, [], "What is it?", [coffee])
    assert ids(answer) == reference(llava, None, [], "What is it?", [coffee])
    kept = [s.image_keys[0] for s in entries(eng)]
    assert image_key(cat) not in kept and image_key(coffee) in kept  # the oldest went
    assert eng.store.peek("s").tier is Tier.KV  # the session kept its KV cache
    assert eng.store.stats.num_cache_evictions >= 1 and eng.store.stats.num_demotions_kv == 0


def test_the_share_bounds_what_entries_hold(llava, photos):
    probe = make_engine(llava)
    stateless(probe, None, [], "What is it?", [photos["chelsea"]])
    one = probe.store.num_cache_bytes
    eng = make_engine(llava, budget=one * 10, share=0.25)  # about two entries' worth
    for name in ("chelsea", "rocket", "coffee", "astronaut"):
        stateless(eng, None, [], "What is it?", [photos[name]])
    assert eng.store.num_cache_bytes <= one * 10 * 0.25
    assert 1 <= len(entries(eng)) <= 2
    off = make_engine(llava, share=0.0)
    stateless(off, None, [], "What is it?", [photos["chelsea"]])
    assert entries(off) == [] and len(off.store.sessions()) == 0


def test_an_entry_is_no_clients_session(llava, photos):
    from llava_sessions.errors import ErrorCode, ServiceError

    eng = make_engine(llava)
    stateless(eng, None, [], "What is it?", [photos["chelsea"]])
    (entry,) = entries(eng)
    with pytest.raises(ServiceError) as err:
        eng.start(entry.session_id, "Hello?")
    assert err.value.code is ErrorCode.SESSION_NOT_FOUND


# ---------------------------------------------------------------------------------------------- the chat dialect


@pytest.fixture(scope="module")
def service(tiny_model_dir):
    from llava_sessions.worker import build_service

    return build_service({"model_dir": str(tiny_model_dir), "device": "cpu", "device_budget_bytes": 10**9})


def _complete(service, body: dict, *, attributes: str | None = None) -> tuple[int, dict]:
    """A chat request without a session through the service (TorchServe minted its id), to its end."""
    import json

    from llava_sessions.wire.framing import BatchRequest

    rid = f"r{next(_ids)}"
    sid = f"ts-seq-{next(_ids)}"
    out = service.handle([BatchRequest(rid, sid, True, body, custom_attributes=attributes)])[0]
    while out.stop is False:
        out = service.handle([BatchRequest(rid, sid, False, None)])[0]
    return out.status, json.loads(out.body)


def _image_part(png: bytes | None, uuid: str | None = None) -> dict:
    import base64

    url = None if png is None else {"url": "data:image/png;base64," + base64.b64encode(png).decode()}
    return {"type": "image_url", "image_url": url, **({"uuid": uuid} if uuid else {})}


def _body(parts_and_text: list[tuple[list[dict], str, str | None]], **extra) -> dict:
    messages: list[dict] = []
    for parts, text, answer in parts_and_text:
        messages.append({"role": "user", "content": [*parts, {"type": "text", "text": text}]})
        if answer is not None:
            messages.append({"role": "assistant", "content": answer})
    return {"messages": messages, "temperature": 0, "max_tokens": 8, **extra}


def test_images_by_uuid_resolve_within_their_salt_and_a_miss_names_the_uuid(service, llava, photos):
    cat = photos["chelsea"]
    status, first = _complete(service, _body([([_image_part(cat, "cat-1")], "What is it?", None)], cache_salt="t1"))
    assert status == 200
    answer = first["choices"][0]["message"]["content"]
    follow = [([_image_part(None, "cat-1")], "What is it?", answer), ([], "And its colour?", None)]
    status, second = _complete(service, _body(follow, cache_salt="t1"))
    assert status == 200
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= first["usage"]["prompt_tokens"]
    with_bytes = [([_image_part(cat)], "What is it?", answer), ([], "And its colour?", None)]
    status, resent = _complete(service, _body(with_bytes, cache_salt="t1"))
    assert resent["choices"][0]["message"]["content"] == second["choices"][0]["message"]["content"]
    for salt in ("t2", None):  # another salt, or none, cannot name t1's image
        extra = {"cache_salt": salt} if salt else {}
        status, missed = _complete(service, _body(follow, **extra))
        assert status == 400 and missed["error"]["code"] == "image_uuid_not_found"
        assert "'cat-1'" in missed["error"]["message"] and missed["error"]["param"] == "messages[0].content[0].uuid"
    # the salt may come in SageMaker's CustomAttributes header instead
    status, by_header = _complete(service, _body(follow), attributes="app=x; cache_salt=t1")
    assert status == 200 and by_header["choices"] == second["choices"]


@pytest.mark.parametrize(
    ("extra", "attributes"),
    [
        ({"cache_salt": ""}, None),
        ({"cache_salt": "tab\there"}, None),
        ({"cache_salt": "x" * 257}, None),
        ({"cache_salt": 7}, None),
        ({}, "cache_salt=caf\u00e9"),
        ({"cache_salt": "a"}, "cache_salt=b"),
    ],
)
def test_a_bad_salt_is_a_typed_400(service, photos, extra, attributes):
    status, err = _complete(service, _body([([], "Hello?", None)], **extra), attributes=attributes)
    assert status == 400 and err["error"]["code"] in ("invalid_parameter", "invalid_request")
    assert err["error"]["param"] == "cache_salt"


def test_an_image_part_needs_a_url_or_a_uuid(service):
    status, err = _complete(service, _body([([{"type": "image_url", "image_url": None}], "Hi?", None)]))
    assert status == 400 and err["error"]["code"] == "invalid_request"
    assert "uuid" in err["error"]["message"]


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_replicas_send_a_resent_conversation_where_its_prefix_is_cached(tiny_model_dir, photos):
    """Two replica processes: a sessionless conversation's next turn goes back to the replica that
    answered its first (its conversation cache is there), not to the one with most room."""
    import base64
    import json

    from llava_sessions.replicas import ReplicaRouter
    from llava_sessions.wire.affinity import prefix_key
    from llava_sessions.wire.framing import BatchRequest
    from llava_sessions.worker import build_service

    router = build_service({"model_dir": str(tiny_model_dir), "devices": "cpu,cpu", "device_budget_bytes": 10**9})
    assert isinstance(router, ReplicaRouter)
    try:

        def run(sid, body):
            rid = f"r{next(_ids)}"
            out = router.handle([BatchRequest(rid, sid, sid is None or sid.startswith("ts-"), body)])[0]
            while out.stop is False:
                out = router.handle([BatchRequest(rid, sid, False, None)])[0]
            return json.loads(out.body)

        cat = "data:image/png;base64," + base64.b64encode(photos["chelsea"]).decode()
        turn1 = _body([([{"type": "image_url", "image_url": {"url": cat}}], "What is it?", None)])
        first = run(f"ts-seq-{next(_ids)}", turn1)
        key = prefix_key(turn1)
        home = router.prefixes[key]
        # a session opened now goes where room is most, ties to the lowest index; then most room is elsewhere
        opened = run(None, {"type": "open_session", "image": {"base64": base64.b64encode(photos["rocket"]).decode()}})
        assert router.placement[opened["session_id"]] == home  # so most room is now the other replica
        answer = first["choices"][0]["message"]["content"]
        turn2 = _body(
            [([{"type": "image_url", "image_url": {"url": cat}}], "What is it?", answer), ([], "Colour?", None)]
        )
        assert prefix_key(turn2) == key
        second = run(f"ts-seq-{next(_ids)}", turn2)
        assert router.prefixes[key] == home
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= first["usage"]["prompt_tokens"]
    finally:
        router.close()


def _native_open(service, png: bytes, *, attributes: str | None = None) -> dict:
    import base64
    import json

    from llava_sessions.wire.framing import BatchRequest

    rid = f"r{next(_ids)}"
    sid = f"ts-seq-{next(_ids)}"
    body = {"type": "open_session", "image": {"base64": base64.b64encode(png).decode()}}
    out = service.handle([BatchRequest(rid, sid, True, body, custom_attributes=attributes)])[0]
    while out.stop is False:
        out = service.handle([BatchRequest(rid, sid, False, None)])[0]
    assert out.status == 200, out.body
    return json.loads(out.body)


def test_native_opens_share_a_held_image_only_within_their_salt(service, photos):
    """The native dialect's salt (SageMaker's custom attributes, or the open's ``cache_salt``): an open
    on an image another session holds copies its features and prefix only under an equal salt."""
    coffee = photos["coffee"]
    engine = service.engine

    def reused(attributes: str | None) -> int:
        """Prefix tokens the open copied from another session (the engine's counter)."""
        before = engine.num_reused_tokens
        opened = _native_open(service, coffee, attributes=attributes)
        source = engine.store.peek(opened["session_id"]).source_id
        assert (source is not None) == (engine.num_reused_tokens > before)
        return engine.num_reused_tokens - before

    assert reused("cache_salt=native-a") == 0
    assert reused("cache_salt=native-b") == 0
    assert reused(None) == 0  # unsalted: another scope too
    assert reused("tenant=x;cache_salt=native-a") >= runner_image_tokens(engine)


def runner_image_tokens(engine) -> int:
    return engine.model.num_image_tokens


def test_the_metrics_count_hits_misses_entries_and_bytes(service, photos):
    before = service.metrics.snapshot(service.engine)
    astronaut = photos["astronaut"]
    status, first = _complete(service, _body([([_image_part(astronaut)], "Who is it?", None)], cache_salt="m"))
    answer = first["choices"][0]["message"]["content"]
    follow = [([_image_part(astronaut)], "Who is it?", answer), ([], "Where?", None)]
    status, second = _complete(service, _body(follow, cache_salt="m"))
    assert status == 200
    after = service.metrics.snapshot(service.engine)
    counters = {k: after["counters"][k] - before["counters"].get(k, 0) for k in after["counters"]}
    assert counters[("ConversationCacheHits", ())] == 1 and counters[("ConversationCacheMisses", ())] == 1
    assert after["gauges"][("ConversationCacheEntries", ())] >= 1
    assert after["gauges"][("ConversationCacheBytes", ())] > 0
