"""Tensor parallel (issue 62): one replica's model sharded over 2 ranks, each its own process, on the CPU
over ``gloo`` (each rank one thread), answers exactly as one process does.

Each family's tiny checkpoint (OneVision built with 2 key-value heads, so they divide by 2) is loaded
twice: as one process with the CPU's default settings (contiguous decode batch, fused prefill chunks),
and as rank 0 of 2 ranks (``tensor_parallel_size=2``), the engine wired by ``worker.build_engine`` as
a replica is. The same conversation runs on both; every greedy answer is the same token list (fp32).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch

from llava_sessions.config import Settings
from llava_sessions.conversation import VideoBytes
from llava_sessions.engine import SessionEngine
from llava_sessions.model import LlavaModel
from llava_sessions.model.parallel import check_tensor_parallel
from llava_sessions.sampling.sampler import SamplingParams
from llava_sessions.sessions.store import Tier
from llava_sessions.video import VideoLimits
from llava_sessions.worker import build_engine, decode_media
from llava_tools.demo.samples import sample_clip

FAMILIES = ("llava", "llava-next", "llava-onevision")
GREEDY = SamplingParams(max_new_tokens=10)
decode = functools.partial(decode_media, max_pixels=40_000_000, video_limits=VideoLimits())


def checkpoint(tmp_path_factory: Any, arch: str) -> Path:
    from llava_tools.tiny_model import write_checkpoint

    kv_heads = 2 if arch == "llava-onevision" else None  # the tiny OneVision's default is 1 KV head
    return write_checkpoint("tiny", tmp_path_factory.mktemp(arch), arch=arch, kv_heads=kv_heads)


def engine_of(llava: LlavaModel, tp: int, budget: int = 10**9) -> SessionEngine:
    settings = Settings(device="cpu", device_budget_bytes=budget, tensor_parallel_size=tp, max_new_tokens_cap=512)
    return build_engine(settings, llava)


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, tmp_path_factory):
    """``(one process's model, rank 0's model of 2 ranks)`` of one family; the ranks stop after its tests."""
    folder = checkpoint(tmp_path_factory, request.param)
    torch.manual_seed(0)
    one = LlavaModel.from_pretrained(folder, device="cpu", dtype="float32")
    two = LlavaModel.from_pretrained(folder, device="cpu", dtype="float32", tensor_parallel_size=2, threads=1)
    yield request.param, one, two
    two.ranks.close()


def tokens(answer: Any) -> list[int]:
    return [t.id for t in answer.tokens]


def conversation(eng: SessionEngine, photos: dict[str, bytes]) -> list[list[int]]:
    """A session's life: open, a question, a follow-up (KV reused), an added image, a question about
    both, a demotion to the image tier (every image encoded again, the history prefilled again), a
    question; then a stateless chat turn twice, the second a conversation-cache hit."""
    from test_chat_engine import target

    eng.open("s", photos["coffee"])
    out = [tokens(eng.generate("s", q, GREEDY)) for q in ("What is in this image?", "And the colours?")]
    eng.add_image("s", photos["rocket"])
    out.append(tokens(eng.generate("s", "Compare the two images.", GREEDY)))
    eng.store.demote("s", Tier.IMAGE)
    answer = eng.generate("s", "Which is brighter?", GREEDY)
    assert answer.restored_from == "image"
    out.append(tokens(answer))
    for n in range(2):
        sid = f"stateless-{n}"
        eng.open_empty(sid)
        gen = eng.start_chat(sid, target("Be brief.", [], "What is it?", [photos["chelsea"]]), GREEDY)
        for _ in gen:
            pass
        eng.retain(sid)
        assert (gen.answer.cached_tokens > 0) == (n == 1)  # the second is served from the cache entry
        out.append(tokens(gen.answer))
    eng.store.check_invariants()
    return out


def test_two_ranks_answer_a_whole_conversation_exactly_as_one_process(pair, small_photos) -> None:
    arch, one, two = pair
    want = conversation(engine_of(one, 1), small_photos)
    sent = two.ranks.num_messages
    eng = engine_of(two, 2)
    assert eng.runner.pool is not None and not eng.fuse  # the passes the other rank mirrors
    assert conversation(eng, small_photos) == want
    assert two.ranks.num_messages > sent + 6 * 10  # every pass went to the other rank
    assert two.num_kv_heads == one.num_kv_heads // 2 and two.kv_bytes_per_token == one.kv_bytes_per_token


def test_prefill_embeddings_by_broadcast_answer_as_one_process(pair, small_photos) -> None:
    """A GPU's way (``broadcast_embeds``, on by default under NCCL) run over ``gloo``: every pass of
    more than one position sends its input embeddings by a collective broadcast after its message,
    not in it; the conversation's answers are the same."""
    arch, one, two = pair
    if arch != "llava":
        pytest.skip("the message is the engine's, the same for every family: one is enough here")
    assert two.ranks.broadcast_embeds is False  # the CPU's default: the pipe is the faster there
    want = conversation(engine_of(one, 1), small_photos)
    two.ranks.broadcast_embeds, before = True, two.ranks.num_broadcasts
    try:
        assert conversation(engine_of(two, 2), small_photos) == want
        assert two.ranks.num_broadcasts >= before + 6  # every prefill's embeddings went that way
    finally:
        two.ranks.broadcast_embeds = False


def test_a_video_session_on_two_ranks_answers_as_one_process(pair) -> None:
    arch, one, two = pair
    if arch != "llava-onevision":
        pytest.skip("the video path is OneVision's among the three")
    video = VideoBytes(sample_clip("astronaut"), num_frames=4)
    answers = []
    for llava, tp in ((one, 1), (two, 2)):
        eng = engine_of(llava, tp)
        eng.open("v", video, image=decode(video))
        answers.append([tokens(eng.generate("v", q, GREEDY)) for q in ("What happens?", "And then?")])
    assert answers[0] == answers[1]


def test_preempted_answers_on_two_ranks_resume_exactly(pair, small_photos) -> None:
    """Three answers whose growth together outgrows the budget: the newest is preempted (its pages
    freed on every rank's pool, as rank 0 books them), recomputes its KV and ends with the tokens it
    gives alone."""
    arch, one, two = pair
    if arch != "llava":
        pytest.skip("preemption is the engine's, the same for every family: one is enough here")
    params = SamplingParams(max_new_tokens=80, ignore_eos=True)
    names = ("astronaut", "coffee", "rocket")
    probe = engine_of(one, 1)
    for name in names:
        probe.open(name, small_photos[name])
    held = probe.store.device_bytes()
    alone = {n: tokens(probe.generate(n, "Describe it.", params, remember=False)) for n in names}
    eng = engine_of(two, 2, budget=held + (3 * 32 + 120) * two.kv_bytes_per_token)
    for name in names:
        eng.open(name, small_photos[name])
    gens = [eng.start(n, "Describe it.", params, remember=False) for n in names]
    while not all(g.done for g in gens):
        eng.step([g for g in gens if not g.done])
    assert all(g.error is None for g in gens), [repr(g.error) for g in gens]
    assert eng.num_preemptions >= 1
    assert {g.session_id: tokens(g.answer) for g in gens} == alone


def test_a_size_the_heads_or_gpus_do_not_allow_is_refused_naming_both_numbers(tmp_path_factory) -> None:
    text = type("Text", (), {"num_attention_heads": 32, "num_key_value_heads": 8})()
    check_tensor_parallel(8, text, num_gpus=8)
    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not divide the model's 32 attention heads"):
        check_tensor_parallel(3, text, num_gpus=8)
    with pytest.raises(ValueError, match="tensor_parallel_size 16 does not divide the model's 8 key-value heads"):
        check_tensor_parallel(16, type("Text", (), {"num_attention_heads": 64, "num_key_value_heads": 8})(), None)
    with pytest.raises(ValueError, match="tensor_parallel_size 8 exceeds the 4 GPU"):
        check_tensor_parallel(8, text, num_gpus=4)
    # at start, before any rank process: the tiny llava has 4 heads
    folder = checkpoint(tmp_path_factory, "llava")
    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not divide the model's 4 attention heads"):
        LlavaModel.from_pretrained(folder, device="cpu", dtype="float32", tensor_parallel_size=3)


def test_a_worker_places_one_replica_per_group_of_tensor_parallel_gpus() -> None:
    """``devices=auto``: G GPUs run G / tensor_parallel_size replicas, each on the first GPU of its group
    (its other ranks take the GPUs after it); one group is one replica on the model's own device."""
    from llava_sessions.config import resolve_devices

    two = Settings(tensor_parallel_size=2)
    assert resolve_devices(two, cuda_count=8) == ["cuda:0", "cuda:2", "cuda:4", "cuda:6"]
    assert resolve_devices(two, cuda_count=2) == [""] and resolve_devices(two, cuda_count=5) == ["cuda:0", "cuda:2"]
    assert resolve_devices(Settings(tensor_parallel_size=4), cuda_count=4) == [""]
    assert resolve_devices(Settings(), cuda_count=4) == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
