"""A resent conversation (OpenAI ``messages``) in the engine: exact answers, what it reuses, images by content.

fp32 on CPU, the ``tiny`` checkpoint, real photographs. Every answer is compared with
``model.generate`` from scratch on the same chat-templated conversation.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

import engine_fixtures
from llava_sessions.conversation import ChatTarget, ImageInput, Turn, image_key
from llava_sessions.errors import ErrorCode, ServiceError
from llava_sessions.sampling.sampler import SamplingParams
from test_engine import GREEDY, N, decode, ids, make_engine


def reference(
    llava, system: str | None, turns: list[tuple[str, str, list[bytes]]], question: str, q_images: list[bytes]
) -> list[int]:
    """Greedy tokens of ``model.generate`` from scratch; each user message opens with its images."""
    messages: list[dict] = []
    if system:
        messages.append({"role": "system", "content": [{"type": "text", "text": system}]})
    images: list[bytes] = []
    for prompt, answer, imgs in [*turns, (question, None, q_images)]:
        images += imgs
        content = [{"type": "image"}] * len(imgs) + [{"type": "text", "text": prompt}]
        messages.append({"role": "user", "content": content})
        if answer is not None:
            messages.append({"role": "assistant", "content": [{"type": "text", "text": answer}]})
    text = llava.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    kw = {"images": [decode(b) for b in images]} if images else {}
    inputs = llava.processor(text=text, return_tensors="pt", **kw)
    with torch.inference_mode():
        out = llava.model.generate(**inputs, max_new_tokens=N, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def target(system, turns, question, q_images) -> ChatTarget:
    """A ChatTarget as the service builds it (every image decoded)."""
    images = [b for _, _, imgs in turns for b in imgs] + list(q_images)
    inputs = []
    for b in images:
        img = decode(b)
        inputs.append(ImageInput(image_key(b), b, (img.height, img.width), img))
    return ChatTarget(
        system, tuple(Turn(p, a, len(imgs)) for p, a, imgs in turns), question, len(q_images), tuple(inputs)
    )


def chat(eng, sid, system, turns, question, q_images, params=GREEDY):
    gen = eng.start_chat(sid, target(system, turns, question, q_images), params)
    for _ in gen:
        pass
    return gen.answer


class EncodeCounter:
    """Counts vision-tower calls on the model (the real ones run)."""

    def __init__(self, llava, monkeypatch) -> None:
        self.calls = 0
        real = llava.encode_images

        def counted(*args, **kwargs):
            self.calls += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(llava, "encode_images", counted)


def test_resent_conversation_is_exact_and_costs_its_new_tokens(llava, photos):
    eng = make_engine(llava)
    eng.open_empty("s")
    cat = photos["chelsea"]
    a1 = chat(eng, "s", None, [], "What is in the picture?", [cat])
    assert ids(a1) == reference(llava, None, [], "What is in the picture?", [cat])
    assert a1.cached_tokens == 0
    turns = [("What is in the picture?", a1.text, [cat])]
    a2 = chat(eng, "s", None, turns, "What colour is it?", [])
    assert ids(a2) == reference(llava, None, turns, "What colour is it?", [])
    # everything up to the new question was served from the cache
    assert a2.cached_tokens >= a1.prompt_tokens
    assert a2.prompt_tokens - a2.cached_tokens <= a1.generated_tokens + 30  # the answer (retokenized), the question
    turns.append(("What colour is it?", a2.text, []))
    a3 = chat(eng, "s", "Answer briefly.", turns, "And the background?", [])  # a system prompt joins: from the start
    assert ids(a3) == reference(llava, "Answer briefly.", turns, "And the background?", [])
    assert a3.cached_tokens < 5


def test_an_edited_earlier_turn_re_prefills_from_the_edit(llava, photos):
    eng = make_engine(llava)
    eng.open_empty("s")
    cat = photos["chelsea"]
    a1 = chat(eng, "s", None, [], "Describe it.", [cat])
    a2 = chat(eng, "s", None, [("Describe it.", a1.text, [cat])], "More?", [])
    edited = [("Describe it in detail.", a1.text, [cat])]
    a3 = chat(eng, "s", None, edited, "More?", [])
    assert ids(a3) == reference(llava, None, edited, "More?", [])
    # the image (before the edited text) stays cached; the edit and after are prefilled again
    assert llava.num_image_tokens < a3.cached_tokens < a2.prompt_tokens - 5
    regenerated = chat(eng, "s", None, edited, "More?", [])  # the same request again: same answer
    assert ids(regenerated) == ids(a3)


def test_a_second_image_in_a_later_turn_and_a_replaced_image(llava, photos, monkeypatch):
    monkeypatch.setattr(llava, "max_positions", 4096)  # two llava-1.5 images: over the tiny's 1,024 (rotary: no limit)
    eng = make_engine(llava)
    eng.open_empty("s")
    cat, rocket, coffee = photos["chelsea"], photos["rocket"], photos["coffee"]
    a1 = chat(eng, "s", None, [], "What is this?", [cat])
    turns = [("What is this?", a1.text, [cat])]
    counter = EncodeCounter(llava, monkeypatch)
    a2 = chat(eng, "s", None, turns, "And this one?", [rocket])
    assert ids(a2) == reference(llava, None, turns, "And this one?", [rocket])
    assert counter.calls == 1  # only the new image went through the vision tower
    assert a2.cached_tokens >= a1.prompt_tokens
    swapped = [("What is this?", a1.text, [coffee])]  # the first image replaced: cache cut before it
    a3 = chat(eng, "s", None, swapped, "And this one?", [rocket])
    assert ids(a3) == reference(llava, None, swapped, "And this one?", [rocket])
    assert a3.cached_tokens < 10
    assert counter.calls == 2  # the rocket's features were kept, the coffee's encoded


def test_a_conversation_without_images(llava):
    eng = make_engine(llava)
    eng.open_empty("s")
    a1 = chat(eng, "s", "Be kind.", [], "Hello there", [])
    assert ids(a1) == reference(llava, "Be kind.", [], "Hello there", [])
    a2 = chat(eng, "s", "Be kind.", [("Hello there", a1.text, [])], "How are you?", [])
    assert ids(a2) == reference(llava, "Be kind.", [("Hello there", a1.text, [])], "How are you?", [])
    assert a2.cached_tokens >= a1.prompt_tokens


def _one_pixel_changed(png: bytes) -> bytes:
    arr = np.array(Image.open(io.BytesIO(png)).convert("RGB"))
    arr[0, 0, 0] ^= 1
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def test_images_are_shared_across_sessions_by_exact_content(llava, photos, monkeypatch):
    eng = make_engine(llava)
    cat = photos["chelsea"]
    near = _one_pixel_changed(cat)
    assert image_key(near) != image_key(cat)
    eng.open_empty("a")
    chat(eng, "a", None, [], "What is in the picture?", [cat])
    counter = EncodeCounter(llava, monkeypatch)
    eng.open_empty("b")
    b = chat(eng, "b", None, [], "What animal is it?", [cat])
    assert counter.calls == 0  # the features of the image session a holds
    assert b.cached_tokens > llava.num_image_tokens  # and the KV of the prefix it shares, copied
    assert ids(b) == reference(llava, None, [], "What animal is it?", [cat])
    eng.open_empty("c")
    c = chat(eng, "c", None, [], "What animal is it?", [near])  # one pixel differs: nothing shared
    assert counter.calls == 1
    assert c.cached_tokens < llava.num_image_tokens
    assert ids(c) == reference(llava, None, [], "What animal is it?", [near])
    eng.store.check_invariants()


def test_share_images_off_keeps_sessions_apart(llava, photos, monkeypatch):
    from llava_sessions.engine import EngineLimits

    eng = engine_fixtures.make_engine(llava, limits=EngineLimits(), share_images=False)
    cat = photos["chelsea"]
    eng.open_empty("a")
    chat(eng, "a", None, [], "What is in the picture?", [cat])
    counter = EncodeCounter(llava, monkeypatch)
    eng.open_empty("b")
    b = chat(eng, "b", None, [], "What is in the picture?", [cat])
    assert counter.calls == 1 and b.cached_tokens == 0
    assert eng.image_held("b", image_key(cat)) is not None
    eng.close("b")
    assert eng.image_held("b", image_key(cat)) is None  # a's image is not offered to others


def test_refusals_leave_the_session_usable(llava, photos):
    eng = make_engine(llava)
    eng.open_empty("s")
    with pytest.raises(ServiceError) as err:
        chat(eng, "s", None, [], "x " * 3000, [], SamplingParams(max_new_tokens=4))
    assert err.value.code in (ErrorCode.CONTEXT_LENGTH_EXCEEDED, ErrorCode.INVALID_PARAMETER)
    with pytest.raises(ServiceError) as err:
        chat(eng, "s", None, [], "look <image> here", [])
    assert err.value.code is ErrorCode.INVALID_PARAMETER
    a = chat(eng, "s", None, [], "What is this?", [photos["coffee"]])
    assert ids(a) == reference(llava, None, [], "What is this?", [photos["coffee"]])


def test_an_abandoned_resent_turn_leaves_a_consistent_session(llava, photos, monkeypatch):
    monkeypatch.setattr(llava, "max_positions", 4096)
    eng = make_engine(llava)
    eng.open_empty("s")
    cat, rocket = photos["chelsea"], photos["rocket"]
    a1 = chat(eng, "s", None, [], "What is this?", [cat])
    turns = [("What is this?", a1.text, [cat])]
    gen = eng.start_chat("s", target(None, turns, "And this?", [rocket]), GREEDY)
    gen.close()  # abandoned before the vision tower ran
    eng.store.check_invariants()
    a = eng.generate("s", "Anything else?", GREEDY)  # the native protocol on the same session
    assert a.generated_tokens > 0
    eng.store.check_invariants()


def test_a_native_open_on_a_held_image_copies_its_features_and_prefix(llava, photos, monkeypatch):
    from test_engine import reference as native_reference

    eng = make_engine(llava)
    cat = photos["chelsea"]
    eng.open("a", cat)
    counter = EncodeCounter(llava, monkeypatch)
    eng.open("b", cat)
    assert counter.calls == 0
    b = eng.store.get("b")
    assert b.cached_ids == eng.store.get("a").cached_ids and b.kv_cache is not eng.store.get("a").kv_cache
    answer = eng.generate("b", "What is it?", GREEDY)
    assert ids(answer) == native_reference(llava, cat, [], "What is it?")
    eng.open("c", _one_pixel_changed(cat))
    assert counter.calls == 1


def test_a_chat_turn_on_a_new_image_waiting_behind_a_question_encodes_it_in_the_time_left(llava, photos, monkeypatch):
    """Scheduler rule 8 for a resent conversation's image (question work, as the 8-stream burst sends
    them): when the step's time left holds its vision tower but not a prefill pass after it, the tower
    runs alone and the turn's first chunk is fused into the next decode pass; every answer equals
    ``model.generate``'s. The passes' costs are fixed here so the plan's shape is known."""
    from llava_sessions.engine.costs import StepCost
    from llava_sessions.engine.scheduler import TimeBudget

    eng = make_engine(llava)
    for sid in ("a", "a2", "b"):
        eng.open_empty(sid)
    running = eng.start_chat("a", target(None, [], "What is in this image?", [photos["astronaut"]]), GREEDY)
    eng.step([running])  # prefilled alone: it decodes from the next step on
    follow = eng.start_chat("a2", target(None, [], "Describe it.", [photos["astronaut"]]), GREEDY)  # a stored image
    fresh = eng.start_chat("b", target(None, [], "What is in this image?", [photos["coffee"]]), GREEDY)
    cost = StepCost(prefill_fixed_ms=20.0, prefill_token_ms=1.0, decode_ms=30.0, vision_ms=50.0, decode_alone_ms=30.0)
    monkeypatch.setattr(eng.runner.costs, "estimate", lambda: cost)
    budget = TimeBudget(step_ms=30.0 + follow.view().num_prefill_tokens + 60.0, max_pass_tokens=4096)
    counter = EncodeCounter(llava, monkeypatch)
    eng.step([running, follow, fresh], prefill_budget=budget)  # 60 ms left: the coffee's tower, no pass
    assert counter.calls == 1 and follow.prefilled and not fresh.view().needs_vision
    assert len(fresh.session.cached_ids) == 0
    fused = eng.runner.num_fused_passes
    eng.step([running, follow, fresh], prefill_budget=budget)  # its first chunk rides the decode pass
    assert eng.runner.num_fused_passes == fused + 1 and len(fresh.session.cached_ids) > 0
    while not all(g.done for g in (running, follow, fresh)):
        eng.step([g for g in (running, follow, fresh) if not g.done], prefill_budget=budget)
    assert counter.calls == 1
    assert ids(running.answer) == reference(llava, None, [], "What is in this image?", [photos["astronaut"]])
    assert ids(follow.answer) == reference(llava, None, [], "Describe it.", [photos["astronaut"]])
    assert ids(fresh.answer) == reference(llava, None, [], "What is in this image?", [photos["coffee"]])
