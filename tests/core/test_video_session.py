"""Video sessions (issue 44) on tiny random-weight LLaVA-OneVision and LLaVA-NeXT-Video checkpoints: a
conversation about a video whose frames are decoded and encoded once.

Exactness as for images: greedy answers token-identical to a from-scratch ``model.generate`` with the
model's own video path (``pixel_values_videos``: ``get_video_features`` and the placeholder merge),
on the conversation rendered by the checkpoint's chat template (``<video>`` expanded to the
processor's count), fp32 on CPU. The clips are real photographs (``skimage.data``) panned across
frames, encoded to H.264 MP4 by PyAV.
"""

from __future__ import annotations

import base64
import functools
import json
import uuid

import pytest
import torch

from conftest import model_device
from llava_sessions.conversation import VideoBytes, image_key
from llava_sessions.engine import EngineLimits, SessionEngine
from llava_sessions.errors import ErrorCode, ServiceError
from llava_sessions.images.fetch import decode_image
from llava_sessions.model import LlavaModel
from llava_sessions.model.video import preprocess_frames, video_token_count
from llava_sessions.sampling.sampler import SamplingParams
from llava_sessions.service import BatchRequest
from llava_sessions.sessions.store import SessionStore, Tier
from llava_sessions.video import VideoLimits
from llava_sessions.worker import build_service, decode_media
from llava_tools.demo.samples import sample_clip

N = 8
GREEDY = SamplingParams(max_new_tokens=N)
decode = functools.partial(decode_media, max_pixels=40_000_000, video_limits=VideoLimits())
#: The tiny OneVision's context: 2,048 positions, so a 16-frame video (3,137 tokens) does not fit.
CONTEXT = 2048


@pytest.fixture(scope="module")
def ov_dir(tmp_path_factory):
    from llava_tools.tiny_model import write_checkpoint

    return write_checkpoint(
        "tiny", tmp_path_factory.mktemp("ov"), seed=0, arch="llava-onevision", max_positions=CONTEXT
    )


@pytest.fixture(scope="module")
def ov(ov_dir) -> LlavaModel:
    """The tiny OneVision on the CPU, or on ``LLAVA_TEST_DEVICE`` (``make test-gpu``: a video on the GPU)."""
    torch.manual_seed(0)
    return LlavaModel.from_pretrained(ov_dir, device=model_device(), dtype="float32")


@pytest.fixture(scope="module")
def next_video(tmp_path_factory) -> LlavaModel:
    """The tiny LLaVA-NeXT-Video, written by ``llava-tiny-model --arch llava-next-video``."""
    from llava_tools.tiny_model import write_checkpoint

    folder = write_checkpoint(
        "tiny", tmp_path_factory.mktemp("nv"), seed=0, arch="llava-next-video", max_positions=CONTEXT
    )
    torch.manual_seed(0)
    return LlavaModel.from_pretrained(folder, device=model_device(), dtype="float32")


@pytest.fixture(params=["llava-onevision", "llava-next-video"])
def video_model(request) -> LlavaModel:
    """Each architecture with a video path."""
    return request.getfixturevalue("ov" if request.param == "llava-onevision" else "next_video")


def processor_video_tokens(llava, video) -> int:
    """The checkpoint processor's own count of ``video``'s placeholders (``replace_video_token`` on
    the video's pixels)."""
    pixels = preprocess_frames(video.frames, llava.video_preprocessing)
    text = llava.processor.replace_video_token({"pixel_values_videos": pixels}, 0)
    return text.count(llava.processor.video_token)


@pytest.fixture(scope="module")
def clips() -> dict[str, bytes]:
    return {"astronaut": sample_clip("astronaut"), "coffee": sample_clip("coffee")}


def engine(llava) -> SessionEngine:
    store = SessionStore(
        device_budget_bytes=10**10,
        host_budget_bytes=10**9,
        kv_bytes_per_token=llava.kv_bytes_per_token,
        max_sessions=8,
        ttl_s=1200,
    )
    return SessionEngine(llava, store, decode, EngineLimits(max_new_tokens_cap=4096), check_invariants=True)


def reference(llava, turns: list[tuple[list, str, str | None]]) -> list[int]:
    """Greedy tokens of ``generate`` from scratch on ``[(media opening the user message, question,
    answer or None for the last)]``; a medium is image bytes or a :class:`VideoBytes`. The images go
    through the checkpoint's own processor; each ``<video>`` id is expanded to the processor's count
    (``_get_num_multimodal_tokens``, ``replace_video_token``) and the model runs its own video path
    on the clip's pixels."""
    chat, images, videos = [], [], []
    for media, question, answer in turns:
        stills = [m for m in media if not isinstance(m, VideoBytes)]
        clips = [m for m in media if isinstance(m, VideoBytes)]
        images += stills
        videos += clips
        content = [{"type": "image"}] * len(stills) + [{"type": "video"}] * len(clips)
        chat.append({"role": "user", "content": [*content, {"type": "text", "text": question}]})
        if answer is not None:
            chat.append({"role": "assistant", "content": [{"type": "text", "text": answer}]})
    text = llava.processor.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    # the processor refuses <video> without its video processor (torchvision): the ids come from the
    # tokenizer, each placeholder expanded to the processor's own count of its medium
    pil = [decode_image(b, max_pixels=10**8) for b in images]
    sampled = [decode(v) for v in videos]
    counts = llava.processor._get_num_multimodal_tokens(image_sizes=[(p.height, p.width) for p in pil] or None)
    assert len(images) <= 1, "several images take OneVision's several-image layout: not counted here"
    per_image = iter(getattr(counts, "num_image_tokens", None) or [])
    per_video = iter(processor_video_tokens(llava, v) for v in sampled)
    image_id, video_id = llava.config.image_token_id, llava.config.video_token_id
    ids = []
    for token in llava.tokenizer(text)["input_ids"]:
        if token == image_id:
            ids += [image_id] * next(per_image)
        elif token == video_id:
            ids += [video_id] * next(per_video)
        else:
            ids.append(token)
    kwargs = {}
    if images:
        pixels = llava.processor.image_processor(images=pil, return_tensors="pt")
        kwargs = {"pixel_values": pixels["pixel_values"], "image_sizes": pixels["image_sizes"]}
    if sampled:
        kwargs["pixel_values_videos"] = torch.cat(
            [preprocess_frames(v.frames, llava.video_preprocessing) for v in sampled]
        )
    input_ids = torch.tensor([ids], device=llava.device)
    kwargs = {k: v.to(llava.device) for k, v in kwargs.items()}
    with torch.inference_mode():
        out = llava.model.generate(
            input_ids=input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=N, do_sample=False, **kwargs
        )
    return out[0, input_ids.shape[1] :].tolist()


def ids(answer) -> list[int]:
    return [t.id for t in answer.tokens]


def test_a_video_session_answers_as_generate_does_from_every_tier(video_model, clips) -> None:
    """Open on a 4-frame sample of a clip (the processor's count: 4 x 196 + 1 tokens on OneVision,
    4 x 144 on LLaVA-NeXT-Video); the first question, a follow-up
    (only its own tokens prefilled) and the same after demotion to the features tier and to the bytes
    tier (the clip decoded and sampled again) each equal ``generate`` from scratch."""
    video = VideoBytes(clips["astronaut"], num_frames=4)
    m = video_model
    eng = engine(m)
    opened = eng.open("s", video, image=decode(video))
    per_frame = 196 if m.architecture.startswith("LlavaOnevision") else 144
    expected = 4 * per_frame + int(per_frame == 196)
    assert opened.image_tokens == expected == processor_video_tokens(m, decode(video))
    assert video_token_count(m.config, 4, m.video_preprocessing) == expected
    q1, q2, q3, q4 = "What happens in this video?", "What color is it?", "Why?", "Where?"
    a1 = eng.generate("s", q1, GREEDY)
    assert ids(a1) == reference(m, [([video], q1, None)])
    assert a1.cached_tokens == opened.prefix_tokens
    a2 = eng.generate("s", q2, GREEDY)
    history = [([video], q1, a1.text)]
    assert ids(a2) == reference(m, [*history, ([], q2, None)])
    assert a2.cached_tokens >= a1.prompt_tokens - 2  # the video and the first turn came from the cache
    history.append(([], q2, a2.text))
    eng.store.demote("s", Tier.FEATURES)
    a3 = eng.generate("s", q3, GREEDY)
    assert a3.restored_from == "features" and ids(a3) == reference(m, [*history, ([], q3, None)])
    history.append(([], q3, a3.text))
    eng.store.demote("s", Tier.IMAGE)
    a4 = eng.generate("s", q4, GREEDY)
    assert a4.restored_from == "image" and ids(a4) == reference(m, [*history, ([], q4, None)])


def test_a_video_joins_an_image_session_and_an_image_a_video_session_exactly(
    video_model, clips, photos, small_png
) -> None:
    """An image laid out alone (anyres: a video is not one of OneVision's several images), then a video
    added: its frames encoded, the image's features and the first turn's KV kept; and a video session
    that adds an image: every image counted as in the processor's several-image mode only when two
    images are held."""
    image = small_png(photos["chelsea"], 160)
    video = VideoBytes(clips["coffee"], num_frames=2)
    m = video_model
    eng = engine(m)
    opened = eng.open("s", image)
    q1, q2, q3 = "What is in this image?", "And in the video?", "Compare them."
    a1 = eng.generate("s", q1, GREEDY)
    added = eng.add_image("s", video, image=decode(video))
    assert added.images == 2 and added.image_tokens == processor_video_tokens(m, decode(video))
    assert added.cached_tokens >= a1.prompt_tokens - 2  # no relayout: the image and the first turn stay cached
    a2 = eng.generate("s", q2, GREEDY)
    assert eng.store.get("s").image_tokens[0] == opened.image_tokens  # still laid out as a lone image
    assert ids(a2) == reference(m, [([image], q1, a1.text), ([video], q2, None)])

    eng.open("v", video, image=decode(video))
    b1 = eng.generate("v", q2, GREEDY)
    eng.add_image("v", image)
    b2 = eng.generate("v", q3, GREEDY)
    assert ids(b2) == reference(m, [([video], q2, b1.text), ([image], q3, None)])


def test_one_clip_sampled_two_ways_is_two_media_and_a_video_is_never_an_image(ov, clips, photos) -> None:
    raw = clips["astronaut"]
    keys = {image_key(raw), image_key(VideoBytes(raw)), image_key(VideoBytes(raw, num_frames=2))}
    assert len(keys | {image_key(VideoBytes(raw, fps=1.0))}) == 4
    assert image_key(VideoBytes(raw, num_frames=2)) == image_key(VideoBytes(bytes(raw), num_frames=2))
    eng = engine(ov)
    two, three = VideoBytes(raw, num_frames=2), VideoBytes(raw, num_frames=3)
    eng.open("a", two, image=decode(two))
    eng.open("b", three, image=decode(three))
    assert eng.store.get("b").image_tokens == [3 * 196 + 1]
    with pytest.raises(ServiceError) as raised:
        decode(VideoBytes(photos["astronaut"]))
    assert raised.value.code is ErrorCode.VIDEO_INVALID
    with pytest.raises(ServiceError) as raised:
        decode(raw)  # plain bytes are an image's
    assert raised.value.code is ErrorCode.IMAGE_INVALID


# ------------------------------------------------------------------ both dialects, through the service
def tiny_service(model_dir, **settings):
    return build_service({"model_dir": str(model_dir), "device": "cpu", "device_budget_bytes": 10**9, **settings})


def run(service, *rows: BatchRequest) -> dict[str, tuple[int, dict]]:
    """Each row's status and decoded body, driven to its last frame."""
    out = service.handle(list(rows))
    last = {r.request_id: o for r, o in zip(rows, out, strict=True)}
    pending = [
        BatchRequest(r.request_id, r.session_id, False, None) for r, o in zip(rows, out, strict=True) if o.stop is False
    ]
    while pending:
        more = service.handle(pending)
        last.update({r.request_id: o for r, o in zip(pending, more, strict=True)})
        pending = [r for r, o in zip(pending, more, strict=True) if o.stop is False]
    return {rid: (o.status, json.loads(o.body)) for rid, o in last.items()}


@pytest.fixture(scope="module")
def ov_service(ov_dir):
    return tiny_service(ov_dir, max_video_frames=16, video_num_frames=2)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def test_native_open_session_on_a_video_and_add_video(ov_service, ov, clips) -> None:
    raw = clips["astronaut"]
    out = run(ov_service, BatchRequest("o", "ts-seq-v1", True, {"type": "open_session", "video": {"base64": b64(raw)}}))
    status, body = out["o"]
    assert status == 200 and body["image_tokens"] == 2 * 196 + 1  # the server's video_num_frames
    ask = {"type": "generate", "prompt": "What happens?", "parameters": {"max_new_tokens": N}}
    status, answer = run(ov_service, BatchRequest("g", "ts-seq-v1", False, ask))["g"]
    assert status == 200
    assert answer["generated_text"] == ov.tokenizer.decode(
        reference(ov, [([VideoBytes(raw, num_frames=2)], "What happens?", None)])
    )
    add = {"type": "add_video", "video": {"base64": "data:video/mp4;base64," + b64(clips["coffee"]), "num_frames": 3}}
    status, added = run(ov_service, BatchRequest("a", "ts-seq-v1", False, add))["a"]
    assert status == 200 and added["image_tokens"] == 3 * 196 + 1


def test_more_frames_asked_than_a_clip_has_are_every_frame_and_the_reply_says_so(ov_service) -> None:
    """A 3-frame clip asked for 5: every frame is used (transformers' sampler does so), no error, and
    the reply's ``warnings`` say it, in the native open and in a chat completion; a request that got
    what it asked has no ``warnings``."""
    short = b64(sample_clip("rocket", num_frames=3))
    body = {"type": "open_session", "video": {"base64": short, "num_frames": 5}}
    status, opened = run(ov_service, BatchRequest("o5", "ts-seq-v5", True, body))["o5"]
    assert status == 200 and opened["image_tokens"] == 3 * 196 + 1
    assert opened["warnings"] == ["the video has 3 frames and 5 were asked: all 3 are used"]
    body["video"]["num_frames"] = 3
    assert "warnings" not in run(ov_service, BatchRequest("o3", "ts-seq-v3", True, body))["o3"][1]
    part = {"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + short}, "num_frames": 4}
    chat = {"messages": [{"role": "user", "content": [part, {"type": "text", "text": "Hi"}]}], "max_tokens": 2}
    status, reply = run(ov_service, BatchRequest("c5", None, True, chat))["c5"]
    assert status == 200 and reply["warnings"] == ["the video has 3 frames and 4 were asked: all 3 are used"]
    from openai.types.chat import ChatCompletion  # here: the GPU's check runs this module without openai

    ChatCompletion.model_validate(reply)


@pytest.mark.parametrize(
    ("medium", "code", "status", "says"),
    [
        ({"video": {"base64": "photo"}}, "video_invalid", 400, "container"),  # an image where a video goes
        ({"image": {"base64": "clip"}}, "image_invalid", 400, "image"),  # and the reverse
        ({"video": {"base64": "clip", "num_frames": 17}}, "invalid_parameter", 400, "16"),  # max_video_frames
        ({"video": {"base64": "clip", "num_frames": 2, "fps": 1.0}}, "invalid_parameter", 400, "not both"),
        ({"video": {"base64": "clip", "num_frames": 16}}, "context_length_exceeded", 422, "2048"),  # 3,137 tokens
        ({"image": {"base64": "photo"}, "video": {"base64": "clip"}}, "invalid_request", 400, "exactly one"),
    ],
)
def test_a_refused_video_is_a_typed_4xx_and_the_worker_answers_on(
    ov_service, clips, photos, medium, code, status, says
) -> None:
    data = {"photo": b64(photos["astronaut"]), "clip": b64(clips["astronaut"])}
    body = {"type": "open_session", **{k: {**v, "base64": data[v["base64"]]} for k, v in medium.items()}}
    got_status, got = run(ov_service, BatchRequest("bad", "ts-seq-bad", True, body))["bad"]
    assert (got_status, got["error"]["code"]) == (status, code), got
    assert says in got["error"]["message"]
    sid = f"ts-seq-{uuid.uuid4()}"
    ok = run(ov_service, BatchRequest("ok", sid, True, {"type": "open_session", "video": {"base64": data["clip"]}}))
    assert ok["ok"][0] == 200, ok


def test_chat_video_url_parts_with_uuid_and_the_conversation_cache(ov_service, ov, clips) -> None:
    """vLLM's ``video_url`` part (a data URI, ``num_frames`` on the part as SGLang takes it, or in
    vLLM's ``mm_processor_kwargs``, a ``uuid``): the answer equals ``generate``; the resent conversation naming the clip by its uuid alone
    is served from the conversation cache (the clip never decoded or encoded again); a uuid of a video in an
    ``image_url`` part is refused."""
    raw = clips["coffee"]
    part = {
        "type": "video_url",
        "video_url": {"url": "data:video/mp4;base64," + b64(raw)},
        "num_frames": 3,
        "uuid": "v1",
    }
    q1, q2 = "What happens in this video?", "And then?"
    body = {
        "messages": [{"role": "user", "content": [part, {"type": "text", "text": q1}]}],
        "max_tokens": N,
        "temperature": 0,
    }
    status, reply = run(ov_service, BatchRequest("c1", None, True, body))["c1"]
    assert status == 200, reply
    video = VideoBytes(raw, num_frames=3)
    first_prompt = reply["usage"]["prompt_tokens"]
    a1 = reply["choices"][0]["message"]["content"]
    assert a1 == ov.tokenizer.decode(reference(ov, [([video], q1, None)]))
    # vLLM's mm_processor_kwargs samples a part that names nothing: the same 3 frames, the same answer
    bare = {k: v for k, v in part.items() if k not in ("num_frames", "uuid")}
    kwargs = {**body, "messages": [{"role": "user", "content": [bare, {"type": "text", "text": q1}]}]}
    status, same = run(
        ov_service, BatchRequest("c0", None, True, {**kwargs, "mm_processor_kwargs": {"num_frames": 3}})
    )["c0"]
    assert status == 200 and same["usage"]["prompt_tokens"] == first_prompt
    assert same["choices"][0]["message"]["content"] == a1
    by_uuid = {"type": "video_url", "video_url": None, "uuid": "v1"}
    messages = [
        {"role": "user", "content": [by_uuid, {"type": "text", "text": q1}]},
        {"role": "assistant", "content": a1},
        {"role": "user", "content": q2},
    ]
    status, reply = run(ov_service, BatchRequest("c2", None, True, {**body, "messages": messages}))["c2"]
    assert status == 200, reply
    assert reply["choices"][0]["message"]["content"] == ov.tokenizer.decode(
        reference(ov, [([video], q1, a1), ([], q2, None)])
    )
    # the clip and the first question came from the cache (the random model's answer text may
    # tokenize otherwise when resent, so the cached run can end inside the answer)
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] >= first_prompt - 2
    wrong = {"type": "image_url", "image_url": None, "uuid": "v1"}
    messages[0] = {"role": "user", "content": [wrong, {"type": "text", "text": q1}]}
    status, reply = run(ov_service, BatchRequest("c3", None, True, {**body, "messages": messages}))["c3"]
    assert (status, reply["error"]["code"]) == (400, "image_uuid_not_found")
    assert "names a video" in reply["error"]["message"]


def test_a_model_without_a_video_path_answers_video_unsupported_in_both_dialects(tiny_model_dir, clips) -> None:
    service = tiny_service(tiny_model_dir)
    native = {"type": "open_session", "video": {"base64": b64(clips["astronaut"])}}
    part = {"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + b64(clips["astronaut"])}}
    chat = {"messages": [{"role": "user", "content": [part, {"type": "text", "text": "What happens?"}]}]}
    out = run(service, BatchRequest("n", "ts-seq-n", True, native), BatchRequest("c", None, True, chat))
    for rid in ("n", "c"):
        status, body = out[rid]
        assert (status, body["error"]["code"]) == (400, "video_unsupported")
        assert "LlavaForConditionalGeneration" in body["error"]["message"]


def test_an_image_after_a_video_in_one_question_is_refused_natively_and_reordered_in_chat(
    ov, ov_service, clips, photos, small_png
) -> None:
    """The template renders a message's images before its videos: a native add_image right after a
    video (no question between) is a 400 that says so, and the session is as before; a chat message
    with a video part before an image part is read in the template's order, as ``generate`` sees it."""
    image = small_png(photos["chelsea"], 160)
    video = VideoBytes(clips["astronaut"], num_frames=2)
    eng = engine(ov)
    eng.open("v", video, image=decode(video))
    with pytest.raises(ServiceError) as raised:
        eng.add_image("v", image)
    assert raised.value.code is ErrorCode.INVALID_REQUEST and "before its videos" in raised.value.message
    assert len(eng.store.get("v").images) == 1
    parts = [
        {"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + b64(clips["astronaut"])}},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + b64(image)}},
        {"type": "text", "text": "Compare them."},
    ]
    body = {"messages": [{"role": "user", "content": parts}], "max_tokens": N, "temperature": 0}
    status, reply = run(ov_service, BatchRequest("mixed", None, True, body))["mixed"]
    assert status == 200, reply
    want = reference(ov, [([image, video], "Compare them.", None)])  # 2 frames: the server's default
    assert reply["choices"][0]["message"]["content"] == ov.tokenizer.decode(want)


def test_a_video_opened_beside_a_running_answer_takes_its_frames_a_few_per_step(
    video_model, clips, monkeypatch
) -> None:
    """While an answer decodes under a time budget, an opening video's frames go through the vision
    tower a few per step (the measured per-frame cost within the step's allotted ms), so the answer
    keeps streaming; the session opened so, and the answer, equal ``generate``."""
    from llava_sessions.engine.scheduler import TimeBudget

    ov = video_model
    eng = engine(ov)
    first = VideoBytes(clips["coffee"], num_frames=2)
    eng.open("running", first, image=decode(first))
    q = "What happens in this video?"
    long_answer = SamplingParams(max_new_tokens=40)
    running = eng.start("running", q, long_answer, remember=False)
    eng.step([running])  # prefilled alone: it decodes from the next step on
    video = VideoBytes(clips["astronaut"], num_frames=6)
    opening = eng.begin_open("opened", video, image=decode(video))
    chunks: list[int] = []
    real = eng.runner.encode_frames
    monkeypatch.setattr(
        eng.runner, "encode_frames", lambda s, v, a, b: chunks.append(b - a) or real(s, v, a, b)
    )  # the real pass, watched: how many frames each step's chunk ran
    budget = TimeBudget(step_ms=10_000, max_pass_tokens=4096, image_step_ratio=0.001)  # held to one frame a step
    steps_with_running = 0
    while not opening.done:
        eng.step([w for w in (running, opening) if not w.done], prefill_budget=budget)
        steps_with_running += not running.done
    assert opening.error is None and chunks == [1] * 6, chunks
    assert steps_with_running >= 5  # the answer decoded beside the frames
    while not running.done:
        eng.step([running])
    assert ids(running.answer)[:N] == reference(ov, [([first], q, None)])  # reference: N tokens
    assert ids(eng.generate("opened", q, GREEDY)) == reference(ov, [([video], q, None)])


def test_a_video_over_max_video_bytes_is_413_video_too_large_before_it_is_decoded(ov_dir, clips) -> None:
    service = tiny_service(ov_dir, max_video_bytes=1000)
    body = {"type": "open_session", "video": {"base64": b64(clips["astronaut"])}}
    status, got = run(service, BatchRequest("big", "ts-seq-big", True, body))["big"]
    assert (status, got["error"]["code"]) == (413, "video_too_large") and "1000 bytes" in got["error"]["message"]
    part = {"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + b64(clips["astronaut"])}}
    chat = {"messages": [{"role": "user", "content": [part, {"type": "text", "text": "What happens?"}]}]}
    status, got = run(service, BatchRequest("big-chat", None, True, chat))["big-chat"]
    assert (status, got["error"]["code"]) == (413, "video_too_large")


def test_sessions_on_one_clip_share_its_features_within_a_salt(ov, clips) -> None:
    """A second session opened on the same clip, sampled the same way, takes the first one's feature
    rows (found by the clip's content key) instead of running the tower; another salt does not."""
    eng = engine(ov)
    video = VideoBytes(clips["coffee"], num_frames=2)
    eng.open("a", video, image=decode(video), salt="tenant-1")
    shared = eng.begin_open("b", video, image=decode(video), salt="tenant-1")
    assert shared.shared_rows is not None
    apart = eng.begin_open("c", video, image=decode(video), salt="tenant-2")
    assert apart.shared_rows is None
    for task in (shared, apart):
        while not task.done:
            eng.step([task])
    q = "What happens in this video?"
    assert ids(eng.generate("b", q, GREEDY)) == ids(eng.generate("c", q, GREEDY)) == reference(ov, [([video], q, None)])


def test_a_video_then_an_image_survive_truncation_and_refuse_a_reset_typed(ov, clips, photos, small_png) -> None:
    """A session on a video whose next turn added an image: dropping the video's turn would move the
    video into the image's message, which the template renders images first. Truncation skips that
    drop (a typed 422 when nothing else fits), and a reset, which would do the same, is a typed 400;
    the session answers on, as before."""
    image = small_png(photos["chelsea"], 64)
    video = VideoBytes(clips["coffee"], num_frames=2)
    eng = engine(ov)
    eng.open("s", video, image=decode(video))
    eng.generate("s", "What happens?", GREEDY)
    eng.add_image("s", image)
    eng.generate("s", "And here?", GREEDY)
    held = len(eng.store.get("s").cached_ids)
    with pytest.raises(ServiceError) as raised:
        eng.generate("s", "Describe it all.", SamplingParams(max_new_tokens=CONTEXT - held))
    assert raised.value.code is ErrorCode.CONTEXT_LENGTH_EXCEEDED
    with pytest.raises(ServiceError) as raised:
        eng.reset("s")
    assert raised.value.code is ErrorCode.INVALID_REQUEST and "an image after a video" in raised.value.message
    assert "the conversation is kept as it was" in raised.value.message  # what happened, and no action apps lack
    assert len(eng.store.get("s").history) == 2 and eng.generate("s", "Why?", GREEDY).tokens
