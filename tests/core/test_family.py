"""The LLaVA family (llava-1.5, LLaVA-NeXT, LLaVA-OneVision, LLaVA-NeXT-Video) and sessions with
several images.

Exactness as for llava-1.5: greedy answers token-identical to a from-scratch ``model.generate`` on the
chat-templated conversation, built by the checkpoint's own processor (``apply_chat_template`` with the
images in the messages, as transformers documents), fp32 on CPU, tiny random-weight checkpoints.
"""

from __future__ import annotations

import functools
import io

import pytest
import torch
from PIL import Image

from llava_sessions.engine import EngineLimits, SessionEngine
from llava_sessions.errors import ErrorCode, ServiceError
from llava_sessions.images.fetch import decode_image
from llava_sessions.model import ARCHITECTURES, checkpoint_architecture
from llava_sessions.model.kv.paged import KVPages, SlotsCache
from llava_sessions.model.kv.pages import PagePool, PageTable, reserve
from llava_sessions.model.packed_linears import pack_linears
from llava_sessions.sampling.sampler import SamplingParams
from llava_sessions.sessions.store import SessionStore, Tier

N = 10
GREEDY = SamplingParams(max_new_tokens=N)
decode = functools.partial(decode_image, max_pixels=40_000_000)
ARCHS = ("llava", "llava-next", "llava-onevision", "llava-next-video")


#: Engine settings the exactness tests also run under: the decode step at static shapes over a
#: fixed pool (what a GPU replays as CUDA graphs, eager here), and demotion moving KV pages to the host.
STATIC = {"cuda_graphs": True}
OFFLOAD = 100 * 10**6


def engine(llava, *, budget: int = 10**10, offload: int = 0, engine_kw: dict | None = None, **limits) -> SessionEngine:
    store = SessionStore(
        device_budget_bytes=budget,
        host_budget_bytes=10**9,
        kv_bytes_per_token=llava.kv_bytes_per_token,
        max_sessions=8,
        ttl_s=1200,
        kv_offload_bytes=offload,
    )
    limits_ = EngineLimits(max_new_tokens_cap=4096, **limits)
    return SessionEngine(llava, store, decode, limits_, check_invariants=True, **(engine_kw or {}))


def reference(llava, messages: list[tuple[list[bytes], str, str | None]]) -> tuple[list[int], int]:
    """Greedy tokens of ``generate`` from scratch on ``[(images opening the user message, question,
    answer or None for the last)]``, and the number of image placeholders the processor put in."""
    chat = []
    for images, question, answer in messages:
        content = [{"type": "image", "image": decode(b)} for b in images] + [{"type": "text", "text": question}]
        chat.append({"role": "user", "content": content})
        if answer is not None:
            chat.append({"role": "assistant", "content": [{"type": "text", "text": answer}]})
    inputs = llava.processor.apply_chat_template(
        chat, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
    )
    with torch.inference_mode():
        out = llava.model.generate(**inputs, max_new_tokens=N, do_sample=False)
    placeholders = int((inputs["input_ids"] == llava.image_token_id).sum())
    return out[0, inputs["input_ids"].shape[1] :].tolist(), placeholders


def ids(answer) -> list[int]:
    return [t.id for t in answer.tokens]


def test_the_tool_writes_each_architecture_and_the_runner_loads_it_by_config(family, tmp_path) -> None:
    assert [r.architecture for r in family.values()] == list(ARCHITECTURES)
    with pytest.raises(ValueError, match="is not one of"):
        (tmp_path / "config.json").write_text('{"architectures": ["Qwen2VLForConditionalGeneration"]}')
        checkpoint_architecture(tmp_path)
    ov = family["llava-onevision"]
    assert ov.tokenizer.bos_token is None and ov.eos_token_ids == {ov.tokenizer.convert_tokens_to_ids("<|im_end|>")}


@pytest.mark.parametrize("arch", ARCHS)
def test_the_vision_tower_runs_only_the_layers_its_features_are_read_from(family, small_photos, arch) -> None:
    """llava-1.5 and LLaVA-NeXT read layer -2: the loaded model's tower drops the last layer; OneVision reads
    -1 and keeps them all. ``generate`` on the trimmed model scores every step bit-identically to the
    untrimmed checkpoint's, as loaded by transformers (its linears packed as the loaded model's are, so
    both run the same kernels)."""
    import transformers

    llava = family[arch]
    folder = llava.model.name_or_path
    full = getattr(transformers, checkpoint_architecture(folder)).from_pretrained(folder, dtype=torch.float32).eval()
    assert pack_linears(full) >= llava.packed_linears > 0
    layers = full.config.vision_config.num_hidden_layers
    dropped = 0 if arch == "llava-onevision" else 1
    assert llava.config.vision_config.num_hidden_layers == layers - dropped
    tower = llava.model.model.vision_tower
    encoder = getattr(tower, "encoder", None) or tower.vision_model.encoder
    assert len(encoder.layers) == layers - dropped
    chat = [{"role": "user", "content": [{"type": "image", "image": decode(small_photos["astronaut"])}]}]
    chat[0]["content"].append({"type": "text", "text": "What is it?"})
    inputs = llava.processor.apply_chat_template(
        chat, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
    )
    scores = []
    for model in (llava.model, full):
        with torch.inference_mode():
            out = model.generate(
                **inputs, max_new_tokens=3, do_sample=False, output_scores=True, return_dict_in_generate=True
            )
        scores.append(torch.stack(out.scores))
    assert torch.equal(scores[0], scores[1])


@pytest.mark.parametrize("arch", ARCHS)
def test_image_tokens_follow_the_processor_for_every_size(family, arch) -> None:
    """The engine's count of an image's placeholders is the processor's (anyres: by image size)."""
    llava = family[arch]
    for height, width in [(672, 672), (300, 451), (427, 640), (1000, 200), (64, 64)]:
        image = Image.new("RGB", (width, height), (90, 120, 200))
        feats = llava.encode_images([image])[0]
        expected = llava.processor._get_num_multimodal_tokens(image_sizes=[[height, width]]).num_image_tokens[0]
        assert feats.shape[0] == llava.image_token_count((height, width)) == expected
    if arch == "llava":
        assert llava.image_token_count((672, 672)) == 576
    if arch == "llava-next":
        assert llava.image_token_count((672, 672)) == 2928  # llava-v1.6 at 672x672: 576 + 48 x 48 + 48


@pytest.mark.parametrize("arch", ARCHS)
def test_placeholders_expand_after_tokenizing_exactly_as_the_processor_expands_the_text(family, arch) -> None:
    """The model tokenizes one placeholder per image and expands the ids; that equals tokenizing
    the text with every image's placeholders written out (what the processors do), whitespace
    and special tokens around the images included."""
    llava = family[arch]
    for text, counts in (
        (f"{llava.image_token}\nWhat is this?", (5,)),
        (f"A  {llava.image_token}{llava.image_token} b\n{llava.image_token} c ", (5, 3, 7)),
        (f"{llava.image_token} {llava.image_token}\t\n{llava.image_token}é😀", (1, 2, 4)),
    ):
        # each placeholder is one token here, so the model takes its ids path (not the fallback)
        assert llava.tokenizer(text)["input_ids"].count(llava.image_token_id) == len(counts)
        parts = text.split(llava.image_token)
        expanded = parts[0] + "".join(llava.image_token * n + p for n, p in zip(counts, parts[1:], strict=True))
        assert llava.template.tokenize(text, counts) == llava.tokenizer(expanded, add_special_tokens=True)["input_ids"]
        assert llava.template.tokenize(text, counts).count(llava.image_token_id) == sum(counts)
    with pytest.raises(ValueError, match=r"placeholders \(2 images, 0 videos\) are not the conversation.s \(3 images"):
        llava.template.tokenize(f"{llava.image_token}{llava.image_token}", (5, 3, 7))


@pytest.mark.parametrize("offload", [0, OFFLOAD], ids=["recomputed", "pages-to-host"])
@pytest.mark.parametrize("arch", ARCHS)
def test_first_question_follow_up_independent_and_every_tier_match_generate(
    family, small_photos, arch, offload
) -> None:
    """``pages-to-host``: each demotion moves the session's KV pages to the host and the restore
    moves them back (sessions/offload.py) instead of prefilling the conversation again."""
    llava, img = family[arch], small_photos["astronaut"]
    eng = engine(llava, offload=offload)
    opened = eng.open("s", img)
    q1, q2, q3, q4, q5 = "What is in this image?", "What color is it?", "Is there a dog?", "Why?", "Where?"
    a1 = eng.generate("s", q1, GREEDY)
    want, placeholders = reference(llava, [([img], q1, None)])
    assert ids(a1) == want and opened.image_tokens == placeholders
    assert a1.cached_tokens == opened.prefix_tokens
    a2 = eng.generate("s", q2, GREEDY)
    assert ids(a2) == reference(llava, [([img], q1, a1.text), ([], q2, None)])[0]
    assert a2.cached_tokens >= a1.prompt_tokens - 2  # the first turn came from the cache (re-tokenized edge)
    a3 = eng.generate("s", q3, GREEDY, remember=False)
    history = [([img], q1, a1.text), ([], q2, a2.text)]
    assert ids(a3) == reference(llava, [*history, ([], q3, None)])[0]
    eng.store.demote("s", Tier.FEATURES)  # demoted to the features tier
    a4 = eng.generate("s", q4, GREEDY)
    assert a4.restored_from == "features" and ids(a4) == reference(llava, [*history, ([], q4, None)])[0]
    eng.store.demote("s", Tier.IMAGE)  # demoted to the image tier
    a5 = eng.generate("s", q5, GREEDY)
    history.append(([], q4, a4.text))
    assert a5.restored_from == "image" and ids(a5) == reference(llava, [*history, ([], q5, None)])[0]
    assert (min(a4.cached_tokens, a5.cached_tokens) >= a2.prompt_tokens) == bool(offload)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_through_the_kv_pages_match_generate(family, small_photos, arch) -> None:
    """The paged KV pool (model/paged_kv.py) under each architecture's own attention (OneVision's
    Qwen2 groups its query heads over fewer KV heads): a prefill and decode steps through pages of
    16 positions give ``generate``'s greedy tokens."""
    llava, img = family[arch], small_photos["coffee"]
    want, _ = reference(llava, [([img], "What is in this image?", None)])
    chat = [
        {
            "role": "user",
            "content": [{"type": "image", "image": decode(img)}, {"type": "text", "text": "What is in this image?"}],
        }
    ]
    prompt = llava.processor.apply_chat_template(
        chat, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
    )["input_ids"][0].tolist()
    features = torch.cat(llava.encode_images([decode(img)]))
    text = llava.config.text_config
    kv = KVPages(text.num_hidden_layers, 128, 16, llava.num_kv_heads, llava.head_dim, llava.dtype, "cpu")
    pool, table = PagePool(128, 16), PageTable()
    reserve(pool, table, len(prompt))
    tokens = [int(llava.prefill(SlotsCache.of_sequence(kv, table, len(prompt)), prompt, features).argmax())]
    while len(tokens) < len(want):
        reserve(pool, table, 1)
        tokens.append(int(llava.decode(SlotsCache.of_sequence(kv, table, 1), tokens[-1]).argmax()))
    assert tokens == want and len(table.pages) == pool.pages_for(len(prompt) + len(want) - 1)


@pytest.mark.parametrize("arch", ARCHS)
def test_added_images_join_the_conversation_exactly_and_reuse_the_cache(family, small_photos, arch) -> None:
    llava = family[arch]
    a, b, c = small_photos["chelsea"], small_photos["coffee"], small_photos["rocket"]
    eng = engine(llava)
    eng.open("s", a)
    q1, q2, q3, q4 = "What is in this image?", "Compare the two images.", "Which is brighter?", "And the third?"
    a1 = eng.generate("s", q1, GREEDY)
    before = list(eng.store.get("s").cached_ids)
    added = eng.add_image("s", b)
    assert added.images == 2
    relayout = arch == "llava-onevision"  # several images: one base tile + newline each, image a re-encoded
    if relayout:
        assert added.image_tokens == llava.num_image_tokens + 1
        assert added.cached_tokens == before.index(llava.image_token_id)  # up to the first image
    else:
        assert added.image_tokens == llava.image_token_count(Image.open(io.BytesIO(b)).size[::-1])
        assert added.cached_tokens >= a1.prompt_tokens  # the whole first turn came from the cache
    a2 = eng.generate("s", q2, GREEDY)
    conv = [([a], q1, a1.text), ([b], q2, None)]
    want, placeholders = reference(llava, conv)
    assert ids(a2) == want and sum(eng.store.get("s").image_tokens) == placeholders
    assert a2.cached_tokens == added.prefix_tokens  # only the question was prefilled
    conv[-1] = ([b], q2, a2.text)
    a3 = eng.generate("s", q3, GREEDY)
    assert ids(a3) == reference(llava, [*conv, ([], q3, None)])[0]
    conv.append(([], q3, a3.text))
    third = eng.add_image("s", c)
    assert third.images == 3 and third.cached_tokens > a3.cached_tokens  # everything before, and some of the last turn
    a4 = eng.generate("s", q4, GREEDY)
    assert ids(a4) == reference(llava, [*conv, ([c], q4, None)])[0]
    conv.append(([c], q4, a4.text))
    eng.store.demote("s", Tier.IMAGE)  # every image re-encoded from its bytes
    a5 = eng.generate("s", "Once more?", GREEDY)
    assert a5.restored_from == "image" and ids(a5) == reference(llava, [*conv, ([], "Once more?", None)])[0]
    eng.reset("s")  # the conversation goes, the images stay: all of them open the next question
    a6 = eng.generate("s", q2, GREEDY)
    assert ids(a6) == reference(llava, [([a, b, c], q2, None)])[0]


def test_image_limits_are_typed_errors_and_leave_the_session_as_it_was(family, small_photos) -> None:
    llava = family["llava"]
    eng = engine(llava, max_images=2)
    eng.open("s", small_photos["chelsea"])
    a1 = eng.generate("s", "What is in this image?", GREEDY)
    eng.add_image("s", small_photos["coffee"])
    with pytest.raises(ServiceError) as e:
        eng.add_image("s", small_photos["rocket"])
    assert e.value.code is ErrorCode.IMAGE_LIMIT_EXCEEDED and e.value.status == 422
    tight = engine(llava, max_image_tokens=1000)
    tight.open("t", small_photos["chelsea"])
    with pytest.raises(ServiceError) as e:
        tight.add_image("t", small_photos["coffee"])  # 2 x 576 > 1000
    assert e.value.code is ErrorCode.IMAGE_LIMIT_EXCEEDED and "1152" in e.value.message
    with pytest.raises(ServiceError) as e:
        tight.add_image("t", b"not an image")
    assert e.value.code is ErrorCode.IMAGE_INVALID
    session = tight.store.get("t")
    assert len(session.images) == 1 and not session.busy
    # a failing vision tower: the session is as before the add, and answers as before
    chelsea, q1, q2 = small_photos["chelsea"], "What is in this image?", "What color is it?"
    other = engine(llava)
    other.open("u", chelsea)
    u1 = other.generate("u", q1, GREEDY)
    original = llava.encode_images
    llava.encode_images = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom"))  # type: ignore[method-assign]
    try:
        task = other.begin_add_image("u", small_photos["coffee"])
        other.step([task])
        assert isinstance(task.error, RuntimeError) and task.done
    finally:
        llava.encode_images = original  # type: ignore[method-assign]
    session = other.store.get("u")
    assert len(session.images) == 1 and session.pending_images == 0 and not session.busy
    again = other.generate("u", q2, GREEDY)
    assert again.cached_tokens >= u1.prompt_tokens - 2  # the cache survived the failed add
    assert ids(again) == reference(llava, [([chelsea], q1, u1.text), ([], q2, None)])[0]
    assert ids(a1) and len(eng.store.get("s").images) == 2  # the first session is untouched


def test_a_context_too_small_for_another_image_is_a_422(family, photos) -> None:
    llava = family["llava-next"]  # 8192 positions; the astronaut at 512 px is 2,928 tokens
    eng = engine(llava, max_images=8)
    eng.open("s", photos["astronaut"])
    eng.add_image("s", photos["astronaut"])
    with pytest.raises(ServiceError) as e:
        eng.add_image("s", photos["astronaut"])
    assert e.value.code is ErrorCode.CONTEXT_LENGTH_EXCEEDED and len(eng.store.get("s").images) == 2


def test_a_model_with_a_sliding_window_is_served_within_it_exactly_and_refuses_past_it(small_photos, tmp_path):
    """A text model attending within a sliding window (Qwen2's ``use_sliding_window``, as
    Mistral-7B-v0.1's 4,096 tokens) is served with its context capped at the window, where every
    position attends to all before it as the pool's attention computes: a two-turn conversation
    equals ``generate`` (which applies the window), and an image that would take the conversation
    past the window is a 422 ``context_length_exceeded``."""
    import json

    from llava_sessions.model import LlavaModel
    from llava_tools.tiny_model import write_checkpoint

    folder = write_checkpoint("tiny", tmp_path / "windowed", seed=0, arch="llava-onevision")
    config = json.loads((folder / "config.json").read_text())
    window = 2400
    config["text_config"].update(use_sliding_window=True, sliding_window=window, max_window_layers=0)
    config["text_config"].pop("layer_types", None)  # derived again from the three above: every layer's sliding
    (folder / "config.json").write_text(json.dumps(config))
    torch.manual_seed(0)
    llava = LlavaModel.from_pretrained(folder, device="cpu", dtype="float32")
    assert llava.max_positions == window < config["text_config"]["max_position_embeddings"]
    img, q1, q2 = small_photos["coffee"], "What is in this image?", "And the colours?"
    eng = engine(llava, max_images=16)
    opened = eng.open("s", img)
    assert 0 < opened.prefix_tokens < window - 100
    a1 = eng.generate("s", q1, GREEDY)
    assert ids(a1) == reference(llava, [([img], q1, None)])[0]
    a2 = eng.generate("s", q2, GREEDY)
    assert a2.cached_tokens > 0 and ids(a2) == reference(llava, [([img], q1, a1.text), ([], q2, None)])[0]
    with pytest.raises(ServiceError) as e:
        for _ in range(15):
            eng.add_image("s", img)
    assert e.value.code is ErrorCode.CONTEXT_LENGTH_EXCEEDED and f"{window} tokens" in e.value.message


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_chunks_riding_the_decode_step_match_generate(family, small_photos, arch, static) -> None:
    """A question's prompt and an open's prefix prefilled in chunks inside the running answers' decode
    passes (rule 9 of the scheduler): every answer, and the session opened so, as ``generate`` gives.
    ``static``: the answers decode in their pages through the static decode step (``STATIC``)."""
    llava, (img1, img2, img3) = (
        family[arch],
        (small_photos["astronaut"], small_photos["coffee"], small_photos["rocket"]),
    )
    eng = engine(llava, budget=10**8, engine_kw=STATIC) if static else engine(llava)
    eng.open("running", img1)
    eng.open("asking", img2)
    q = "What is in this image?"
    running = eng.start("running", q, GREEDY, remember=False)
    eng.step([running])  # prefilled alone: it decodes from the next step on
    asking = eng.start("asking", q, GREEDY, remember=False)
    opening = eng.begin_open("opened", img3)
    work = [running, asking, opening]
    while not all(w.done for w in work):
        eng.step([w for w in work if not w.done], prefill_budget=24)
    assert eng.runner.num_fused_passes >= 3
    assert running.error is None and asking.error is None and opening.error is None
    assert ids(running.answer) == reference(llava, [([img1], q, None)])[0]
    assert ids(asking.answer) == reference(llava, [([img2], q, None)])[0]
    assert ids(eng.generate("opened", q, GREEDY)) == reference(llava, [([img3], q, None)])[0]
    if static:  # the decode-only steps ran at static shapes, and the open's image chunks beside them
        assert eng.runner.graphs is not None and eng.runner.graphs.steps.num_eager >= 3
        assert eng.runner.prefill_graphs is not None and eng.runner.prefill_graphs.chunks.num_eager >= 1
