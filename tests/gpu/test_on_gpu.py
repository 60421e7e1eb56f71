"""The engine on a GPU (issue 59 item 6): the code only a CUDA device runs, against ``model.generate``.

The tiny checkpoint in fp32 on the GPU (``LLAVA_TEST_DEVICE``, ``cuda`` under ``make test-gpu``):
- the decode step captured as CUDA graphs and replayed, reading the pages each way (``gather``,
  ``flex``: FlexAttention compiled, ``auto``), answers eight sessions together exactly as a
  from-scratch ``generate`` answers each, and as the same static pass run eagerly (each step launched
  before the host reads the last one's tokens: async scheduling, an engine's default on a GPU);
- a follow-up prefilled as the rows of one captured step, whose pass fails, leaves no position and
  no page behind, and the retry answers as ``generate``;
- bf16 stays within :data:`BF16_TOLERANCE` of fp32 on the first answer's logits;
- llava-1.5's vision tower, captured with the decode graphs, gives each image the eager features;
- LLaVA-NeXT's and OneVision's towers captured per tile count give each image its eager features;
- an image's prompt prefilled by a captured prefill graph (``model/gpu/prefill_graphs.py``) answers as
  ``generate`` and as the same static pass run eagerly;
- with q/k/v and gate/up fused and the norms and MLP compiled, the replayed step answers as before;
- a step's inputs staged through pinned buffers (``model/gpu/staging.py``) land whole, step after step;
- llava-1.5's preprocessing on the GPU (``model/gpu/pixels.py``) is the processor's within one level.

Skipped unless ``LLAVA_TEST_DEVICE`` names a device or CUDA is present (CI has none). With
``LLAVA_TEST_DEVICE=cpu`` the same tests run here, every static step eager (what a CPU engine runs),
which is how their logic is checked without a GPU; the assertions about captured graphs then hold
trivially. ``make test-gpu`` also runs the core tests that compare the engine with itself (batched
against alone, preempted against alone, async scheduling against in step) with ``tests/conftest.py``'s
``llava`` on the GPU, and a video session of each video architecture against ``generate``
(``tests/core/test_video_session.py``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from engine_fixtures import decode, make_engine
from llava_sessions.engine import SessionEngine
from llava_sessions.engine.model_runner import new_graphs, new_prefill_graphs
from llava_sessions.model import LlavaModel
from llava_sessions.model.gpu.graphs import DecodeGraphs
from llava_sessions.model.gpu.regions import compile_layers, uncompile_layers
from llava_sessions.model.gpu.tile_graphs import TileGraphs
from llava_sessions.model.kv.paged import KVPool, SessionKV
from llava_sessions.model.kv.pages import reserve
from llava_sessions.sampling.sampler import SamplingParams
from test_decode_graphs import N, reference as text_reference
from test_projections import answers
from test_tile_graphs import pictures

DEVICE = os.environ.get("LLAVA_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else "")
pytestmark = pytest.mark.skipif(
    not DEVICE or (DEVICE.startswith("cuda") and not torch.cuda.is_available()),
    reason="no GPU: make test-gpu on a CUDA device (LLAVA_TEST_DEVICE)",
)

#: Largest |logit| difference, relative to the largest |logit|, between the tiny model in bf16 and in
#: fp32 on the first answer's first position (bf16 keeps 8 bits of mantissa, ~0.4% per rounding, and
#: the vision tower's and the language model's roundings add up): about twice the worst the 2-core CPU
#: measured over the four photographs (0.030-0.112).
BF16_TOLERANCE = 0.2
QUESTIONS = ("What is in this image?", "Describe the colours.")


@pytest.fixture(scope="module")
def gpu_model(tiny_model_dir: Path) -> LlavaModel:
    """The tiny checkpoint in fp32 on :data:`DEVICE`."""
    torch.manual_seed(0)
    return LlavaModel.from_pretrained(tiny_model_dir, device=DEVICE, dtype="float32")


def question_inputs(llava: LlavaModel, image: bytes, question: str) -> Any:
    """The processor's inputs for the chat-templated ``question`` about ``image``, on the model's
    device, the pixel values in its dtype."""
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    text = llava.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = llava.processor(text=text, images=decode(image), return_tensors="pt").to(llava.device)
    inputs["pixel_values"] = inputs["pixel_values"].to(llava.dtype)
    return inputs


def reference(llava: LlavaModel, image: bytes, question: str) -> list[int]:
    """``model.generate``'s greedy tokens from scratch on the chat-templated question about ``image``."""
    inputs = question_inputs(llava, image, question)
    with torch.inference_mode():
        out = llava.model.generate(**inputs, max_new_tokens=N, min_new_tokens=N, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def with_read(llava: LlavaModel, read: str) -> SessionEngine:
    """An engine of the paged layout whose static decode step reads the pages as ``read``, captured as
    CUDA graphs on a GPU (its pool fixed at the fixtures' 100 MB)."""
    eng = make_engine(llava, cuda_graphs=True)
    runner = eng.runner
    assert runner.graphs is not None and runner.pool is not None
    if runner.graphs.paged_read != read:
        runner.read_pages(read)  # type: ignore[arg-type]
    assert runner.graphs is not None
    return eng


def together(eng: SessionEngine, asks: dict[str, str]) -> dict[str, list[int]]:
    """Every session's greedy answer to its question, decoded in one batch."""
    params = SamplingParams(max_new_tokens=N, ignore_eos=True)
    gens = {sid: eng.start(sid, q, params, remember=False) for sid, q in asks.items()}
    while not all(g.done for g in gens.values()):
        eng.step([g for g in gens.values() if not g.done])
    assert all(g.error is None for g in gens.values()), [repr(g.error) for g in gens.values()]
    return {sid: [t.id for t in g.answer.tokens] for sid, g in gens.items()}


@pytest.mark.parametrize("read", ["gather", "flex", "auto"])
def test_replayed_steps_answer_eight_sessions_as_generate_and_as_the_same_pass_eagerly(gpu_model, photos, read):
    """Eight sessions (four photographs, two questions) answer together: the step replayed from its
    graphs (8 rows: FlexAttention under ``flex`` and ``auto``, the gather under ``gather``), then the
    same static pass run eagerly (``replay`` off), then each equal to ``generate`` alone."""
    eng = with_read(gpu_model, read)
    graphs = eng.runner.graphs
    assert isinstance(graphs, DecodeGraphs)
    on_gpu = gpu_model.device.type == "cuda"
    assert (graphs.steps.num_graphs > 0) == on_gpu
    asks = {}
    for name in sorted(photos):
        for j, question in enumerate(QUESTIONS):
            sid = f"{name}-{j}"
            eng.open(sid, photos[name])
            asks[sid] = question
    assert graphs.reads_flex(8) == (read != "gather")
    replayed = together(eng, asks)
    assert (graphs.steps.num_replays > 0) == on_gpu
    graphs.steps.replay = False
    eager = together(eng, asks)
    graphs.steps.replay = True
    assert eager == replayed
    for sid, question in asks.items():
        assert replayed[sid] == reference(gpu_model, photos[sid.rsplit("-", 1)[0]], question), sid


def test_a_follow_up_prefilled_as_one_step_s_rows_rolls_back_a_failed_pass(gpu_model, monkeypatch):
    """A 40-token follow-up after a 300-token prefix, prefilled as the rows of one static step (a
    replayed graph on a GPU): its pass fails once (the GPU's error, raised from the step), and the
    holder's table, the pool's free pages and the graphs' prefill count are as before; the retry's
    greedy answer equals ``generate``'s on the whole prompt."""
    text = gpu_model.config.text_config
    shape = (text.num_hidden_layers, gpu_model.num_kv_heads, gpu_model.head_dim, gpu_model.dtype, gpu_model.device)
    pool = KVPool(*shape, page_size=16, num_pages=200, fixed=True)
    ids = gpu_model.processor.tokenizer("Describe the view from the window in a few words, please. " * 40)["input_ids"]
    ids = ids[:340]
    session = SessionKV(pool)
    gpu_model.prefill(session, ids[:300], None)
    graphs = DecodeGraphs(gpu_model, pool, max_rows=64, max_len=gpu_model.max_positions, paged_read="gather")
    if gpu_model.device.type == "cuda":
        graphs.capture()
    free, run = pool.pool.num_free_pages, graphs.run

    def fails_once(*args: Any) -> Any:
        monkeypatch.setattr(graphs, "run", run)
        raise torch.AcceleratorError("an illegal memory access was encountered")  # what a GPU's fault raises

    monkeypatch.setattr(graphs, "run", fails_once)
    with pytest.raises(torch.AcceleratorError):
        graphs.prefill(session.table, ids[300:])
    assert session.table.num_tokens == 300 and pool.pool.num_free_pages == free and graphs.num_prefills == 0
    logits = graphs.prefill(session.table, ids[300:])
    assert logits is not None and session.table.num_tokens == 340 and graphs.num_prefills == 1
    tokens = [int(logits.argmax())]
    while len(tokens) < N:
        assert reserve(pool.pool, session.table, 1) == []
        tokens.append(int(graphs.run([session.table], [tokens[-1]])[0].argmax()))
    assert tokens == text_reference(gpu_model, ids)
    pool.check([session.table, graphs.table])


def test_bf16_logits_stay_within_tolerance_of_fp32(tiny_model_dir, gpu_model, photos):
    """The first answer position's logits of the tiny model in bf16 against fp32 on the same device,
    image and question: the largest difference within :data:`BF16_TOLERANCE` of the largest logit
    (the 2-core CPU measured 0.030-0.112 over the four photographs, the top token the same in each).
    Greedy answers are not compared: a random model's near ties flip under bf16's rounding."""
    half = LlavaModel.from_pretrained(tiny_model_dir, device=DEVICE, dtype="bfloat16")
    for name, image in photos.items():
        full_logits, half_logits = (first_logits(m, image) for m in (gpu_model, half))
        worst = float((full_logits - half_logits).abs().max() / full_logits.abs().max())
        assert worst <= BF16_TOLERANCE, (name, worst)


def first_logits(llava: LlavaModel, image: bytes) -> torch.Tensor:
    """Logits ``[vocab]`` float32 of the first answer position for :data:`QUESTIONS`' first about ``image``."""
    with torch.inference_mode():
        return llava.model(**question_inputs(llava, image, QUESTIONS[0])).logits[0, -1].float()


def test_the_vision_tower_replayed_gives_each_image_its_eager_features(gpu_model, photos):
    """An engine with decode graphs on a GPU also captures llava-1.5's ``get_image_features`` at its
    fixed input (336 px, the tiny model's as llava-1.5's); four photographs encoded in one call replay one by one and
    each gets the features the eager tower gives it alone. On a CPU nothing is captured and the same
    call runs eagerly."""
    graph = make_engine(gpu_model, cuda_graphs=True).runner.vision_graph
    on_gpu = gpu_model.device.type == "cuda"
    assert (graph is not None) == on_gpu
    images = [decode(photos[name]) for name in sorted(photos)]
    with torch.inference_mode():
        replayed = gpu_model.encode_images(images, tower=graph)
        alone = [gpu_model.encode_images([image])[0] for image in images]
    assert len(replayed) == len(images)
    for got, want in zip(replayed, alone, strict=True):
        assert got.shape == want.shape and torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    assert graph is None or graph.num_replays >= len(images)


def test_an_image_prompt_prefilled_by_replay_answers_as_generate_and_as_the_same_pass_eagerly(gpu_model, photos):
    """Each photograph's whole templated prompt (its image's placeholders among the tokens) prefilled
    through the captured prefill graphs, then through the same static pass eagerly: the same last
    logits (fp32), and the greedy answer decoded after them equals ``generate``'s. An engine with graphs
    opens an image through a replay."""
    pool = KVPool(*pool_shape(gpu_model), page_size=16, num_pages=400, fixed=True)
    graphs = new_graphs(gpu_model, pool, "gather")
    prefills = new_prefill_graphs(gpu_model, pool, graphs)
    assert graphs is not None and prefills is not None
    on_gpu = gpu_model.device.type == "cuda"
    assert (prefills.chunks.num_graphs > 0) == on_gpu
    for name in sorted(photos):
        inputs = question_inputs(gpu_model, photos[name], QUESTIONS[0])
        ids = inputs["input_ids"][0].tolist()
        features = gpu_model.encode_images([decode(photos[name])])[0]
        firsts = []
        for replay in (True, False):
            prefills.chunks.replay = replay
            cache = SessionKV(pool)
            firsts.append(prefills.prefill(cache.table, ids, 0, features))
            tokens = [int(firsts[-1].argmax())]
            while len(tokens) < N:
                assert reserve(pool.pool, cache.table, 1) == []
                tokens.append(int(graphs.run([cache.table], [tokens[-1]])[0].argmax()))
            assert tokens == reference(gpu_model, photos[name], QUESTIONS[0]), (name, replay)
            cache.release()
        torch.testing.assert_close(firsts[0], firsts[1], rtol=1e-5, atol=1e-5)
    assert prefills.chunks.num_replays == (len(photos) if on_gpu else 0)
    eng = make_engine(gpu_model, cuda_graphs=True)
    eng.open("s", photos["coffee"])
    replays = eng.runner.prefill_graphs.chunks.num_replays + eng.runner.prefill_graphs.chunks.num_eager  # type: ignore[union-attr]
    assert replays >= 1 and together(eng, {"s": QUESTIONS[0]})["s"] == reference(
        gpu_model, photos["coffee"], QUESTIONS[0]
    )


def pool_shape(llava: LlavaModel) -> tuple:
    """The KV pool's shape arguments for ``llava``: layers, KV heads, head size, dtype, device."""
    text = llava.config.text_config
    return (text.num_hidden_layers, llava.num_kv_heads, llava.head_dim, llava.dtype, llava.device)


@pytest.mark.parametrize("arch", ["llava-next", "llava-onevision"])
def test_tiled_towers_replayed_per_tile_count_give_each_image_its_eager_features(tmp_path, photos, arch):
    """A tiny LLaVA-NeXT and OneVision on the GPU: the tower and projector captured at every tile count;
    three photographs of three shapes (three tile counts) encoded through the replays get the features
    the model's own eager path gives them. On a CPU nothing is captured."""
    from llava_tools.tiny_model import write_checkpoint

    torch.manual_seed(0)
    llava = LlavaModel.from_pretrained(
        write_checkpoint("tiny", tmp_path, seed=0, arch=arch), device=DEVICE, dtype="float32"
    )
    graphs = TileGraphs.capture(llava.model, llava.architecture, llava.device, llava.dtype)
    assert (graphs is not None) == (llava.device.type == "cuda")
    images = pictures(photos)
    want = llava.encode_images(images)
    got = llava.encode_images(images, tower=graphs)
    assert graphs is None or (graphs.num_replays == len(images) and graphs.tower.num_graphs == len(graphs.counts))
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and torch.allclose(g, w, rtol=1e-5, atol=1e-5)


def test_fused_and_compiled_layers_replayed_answer_as_the_model_as_loaded(tiny_model_dir, photos):
    """The tiny model on the GPU with its projections fused and its norms and MLP compiled (Inductor's
    kernels, captured inside the decode graphs): three sessions' greedy answers through the replayed step
    equal the model's as loaded, fp32; undone, it answers so again."""
    llava = LlavaModel.from_pretrained(tiny_model_dir, device=DEVICE, dtype="float32")
    text = llava.model.model.language_model
    expected, _ = answers(llava, photos, cuda_graphs=True)
    assert min(compile_layers(text).values()) > 0  # what the compile setting does before an engine starts
    try:
        got, eng = answers(llava, photos, cuda_graphs=True)
    finally:
        uncompile_layers(text)
    assert got == expected
    assert (eng.runner.graphs is not None and eng.runner.graphs.steps.num_replays > 0) == (llava.device.type == "cuda")
    assert answers(llava, photos, cuda_graphs=True)[0] == expected


def test_staged_uploads_land_whole_through_pinned_buffers_that_grow_and_wait_for_the_last_copies():
    """``HostStaging`` (a step's inputs copied without blocking the host): sources of growing size, one
    name each, into strided device slices, three steps in a row: each lands whole; on a GPU the pinned
    buffer grows to the largest and the next step's ``begin`` waits for the last step's copies."""
    from llava_sessions.model.gpu.staging import HostStaging

    device = torch.device(DEVICE)
    staging = HostStaging(device)
    assert staging.pinned is (device.type == "cuda")
    dst = torch.zeros(8, 64, dtype=torch.int32, device=device)
    for step, width in enumerate((4, 40, 12)):
        src = torch.arange(8 * width, dtype=torch.int32).view(8, width) + step
        staging.begin()
        staging.upload("table", dst[:, :width], src)  # a strided slice of a device buffer
        staging.end()
        staging.begin()
        assert torch.equal(dst[:, :width].cpu(), src)
    if staging.pinned:
        assert staging._pinned is not None and staging._pinned["table"].numel() >= 8 * 40


def test_llava_1_5_preprocessing_on_the_gpu_is_the_processors_within_one_level(gpu_model):
    """``model/gpu/pixels.py`` on the GPU (the ``image_preprocessing: device`` setting): each photograph's
    pixel values within one 8-bit level of transformers' Pillow processor's, at most 0.5% of them apart."""
    from test_pixels import MAX_LEVEL_DIFFERENCE, PHOTOS, level_differences, photo

    for name in PHOTOS:
        diff = level_differences(gpu_model, photo(name), DEVICE)
        assert diff.max().item() <= MAX_LEVEL_DIFFERENCE + 1e-3, name
        assert (diff > 0.5).float().mean().item() < 0.005, name


@pytest.mark.skipif(not DEVICE.startswith("cuda"), reason="the host's waits for a CUDA device")
def test_an_image_chunk_s_embedding_makes_the_host_wait_for_nothing(gpu_model, photos):
    """The mixed step embeds an image's chunk between its decode replay and its prefill replay
    (``LlavaModel.embed``): under PyTorch's sync debug mode "error" any op there that waits for the
    device raises; the embedding is the features merged into the placeholders."""
    feats = gpu_model.encode_images([decode(photos["astronaut"])], 1)[0]
    ids = [1, 2, *([gpu_model.image_token_id] * int(feats.shape[0])), 7]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.inference_mode():
            embeds = gpu_model.embed(ids, 0, feats)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(embeds[0, 2:-1], feats.to(embeds.dtype))
