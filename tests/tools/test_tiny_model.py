"""The checkpoint builder: real llava-hf layout, determinism, sizes."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import torch

from llava_tools.tiny_model import SIZES, build_config, write_checkpoint


def digest(folder) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def test_cli_writes_a_llava_hf_folder_deterministically(tmp_path):
    """The CLI in a process of its own and ``write_checkpoint`` in this one, same seed: the same bytes."""
    subprocess.run(
        [sys.executable, "-m", "llava_tools.tiny_model", "--size", "tiny", "--out", str(tmp_path / "a"), "--seed", "3"],
        check=True,
        capture_output=True,
    )
    a, b = digest(tmp_path / "a"), digest(write_checkpoint("tiny", tmp_path / "b", seed=3))
    assert a == b  # same seed, same bytes
    assert {"config.json", "model.safetensors", "tokenizer.json", "processor_config.json"} <= set(a)
    processor = json.loads((tmp_path / "a" / "processor_config.json").read_text())
    assert processor["num_additional_image_tokens"] == 1 and processor["patch_size"] == 14
    other = write_checkpoint("tiny", tmp_path / "c", seed=4)
    assert digest(other)["model.safetensors"] != a["model.safetensors"]


def test_tiny_is_small_and_templates_like_llava_15(tiny_model_dir):
    """The tests' checkpoint stays small (what makes it quick to load is its size, checked here, not
    timed), and templates as llava-1.5 does."""
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    assert (tiny_model_dir / "model.safetensors").stat().st_size < 2_000_000  # 984 kB when written
    model = LlavaForConditionalGeneration.from_pretrained(tiny_model_dir)
    processor = AutoProcessor.from_pretrained(tiny_model_dir)
    assert sum(p.numel() for p in model.parameters()) < 500_000
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    assert text == "USER: <image>\nWhat is this? ASSISTANT:"
    cfg = model.config
    assert (cfg.vision_config.image_size, cfg.vision_config.patch_size) == (336, 14)
    assert cfg.image_token_id == processor.tokenizer.convert_tokens_to_ids("<image>")


def test_7b_has_exactly_llava_15_7b_parameters():
    from transformers import LlavaForConditionalGeneration

    config = build_config("7b", vocab_size=0, image_token_id=32000, pad_token_id=32001)
    with torch.device("meta"):  # shapes only: no memory, no GPU
        model = LlavaForConditionalGeneration(config)
    total = sum(p.numel() for p in model.parameters())
    vision = sum(p.numel() for p in model.model.vision_tower.parameters())
    projector = sum(p.numel() for p in model.model.multi_modal_projector.parameters())
    assert total == 7_063_427_072  # llava-hf/llava-1.5-7b-hf
    assert round(vision / 1e6, 1) == 303.5 and round(projector / 1e6, 1) == 21.0


def test_bench_keeps_the_text_model_dominant():
    spec = SIZES["bench"]
    text = 12 * spec.text_hidden**2 * spec.text_layers
    vision = 12 * spec.vision_hidden**2 * spec.vision_layers
    assert 15 < text / vision < 30  # llava-1.5-7b: ~6.7 B text vs ~0.3 B vision


def test_cli_builds_each_architecture_with_the_hub_s_class_names(tmp_path):
    for arch, model_class, processor_class in [
        ("llava-next", "LlavaNextForConditionalGeneration", "LlavaNextProcessor"),
        ("llava-onevision", "LlavaOnevisionForConditionalGeneration", "LlavaOnevisionProcessor"),
    ]:
        out = tmp_path / arch
        done = subprocess.run(
            [sys.executable, "-m", "llava_tools.tiny_model", "--arch", arch, "--out", str(out)],
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0, done.stderr
        assert f"wrote {arch} tiny checkpoint" in done.stdout
        assert json.loads((out / "config.json").read_text())["architectures"] == [model_class]
        assert json.loads((out / "processor_config.json").read_text())["processor_class"] == processor_class
    refused = subprocess.run(
        [
            sys.executable,
            "-m",
            "llava_tools.tiny_model",
            "--arch",
            "llava-next",
            "--size",
            "7b",
            "--out",
            str(tmp_path / "x"),
        ],
        capture_output=True,
        text=True,
    )
    assert refused.returncode == 2 and "llava-tiny-model:" in refused.stderr


def test_the_cli_refuses_a_folder_that_is_not_empty(tmp_path) -> None:
    """Issue 60 item 6: pointed at a folder holding files (a real checkpoint, say), ``llava-tiny-model``
    writes nothing there: exit 2, the files as they were."""
    (tmp_path / "model.safetensors").write_bytes(b"real weights")
    command = [sys.executable, "-m", "llava_tools.tiny_model", "--out", str(tmp_path)]
    refused = subprocess.run(command, capture_output=True, text=True)
    assert refused.returncode == 2 and "is not empty" in refused.stderr and "Traceback" not in refused.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]
    assert (tmp_path / "model.safetensors").read_bytes() == b"real weights"


#: llava-hf/llava-1.5-7b-hf's ``model.safetensors.index.json`` weight names, a layer's index as ``N``: the
#: names vLLM's, SGLang's and TGI's LLaVA loaders read (their CLIP tower under ``vision_model``).
HUB_LLAVA_15_KEYS = {
    "language_model.lm_head.weight",
    "language_model.model.embed_tokens.weight",
    "language_model.model.norm.weight",
    *(
        f"language_model.model.layers.N.{name}.weight"
        for name in (
            "input_layernorm",
            "post_attention_layernorm",
            "mlp.down_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
        )
    ),
    *(f"multi_modal_projector.linear_{i}.{p}" for i in (1, 2) for p in ("weight", "bias")),
    "vision_tower.vision_model.embeddings.class_embedding",
    "vision_tower.vision_model.embeddings.patch_embedding.weight",
    "vision_tower.vision_model.embeddings.position_embedding.weight",
    *(
        f"vision_tower.vision_model.{norm}.{p}"
        for norm in ("pre_layrnorm", "post_layernorm")
        for p in ("weight", "bias")
    ),
    *(
        f"vision_tower.vision_model.encoder.layers.N.{name}.{p}"
        for name in (
            "layer_norm1",
            "layer_norm2",
            "mlp.fc1",
            "mlp.fc2",
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.out_proj",
        )
        for p in ("weight", "bias")
    ),
}


def test_the_checkpoint_names_its_weights_as_llava_hf_s_do_and_loads_as_saved(tiny_model_dir, tmp_path):
    """Every weight of the tiny llava-1.5 has a name of the hub's checkpoint, and every name of the hub's
    is there; transformers loads it to the very tensors the builder made (the other layout, as
    ``save_pretrained`` writes it, loads to the same)."""
    import re

    from safetensors import safe_open
    from transformers import LlavaForConditionalGeneration

    from llava_tools.tiny_model import build_model

    with safe_open(str(tiny_model_dir / "model.safetensors"), "pt") as f:
        keys = set(f.keys())  # noqa: SIM118 - a safetensors handle
    assert {re.sub(r"\.\d+\.", ".N.", k) for k in keys} == HUB_LLAVA_15_KEYS
    built, _ = build_model("tiny", seed=0)
    loaded = LlavaForConditionalGeneration.from_pretrained(tiny_model_dir)
    mine, theirs = built.state_dict(), loaded.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    built.save_pretrained(tmp_path / "saved")  # transformers' own layout: the tower without vision_model
    with safe_open(str(tmp_path / "saved" / "model.safetensors"), "pt") as f:
        assert not any(k.startswith("vision_tower.vision_model.") for k in f.keys())  # noqa: SIM118
    again = LlavaForConditionalGeneration.from_pretrained(tmp_path / "saved").state_dict()
    assert all(torch.equal(again[k], theirs[k]) for k in theirs)


def test_every_architecture_s_tower_is_under_vision_model(tmp_path):
    from safetensors import safe_open

    for arch in ("llava-next", "llava-onevision", "llava-next-video"):
        folder = write_checkpoint("tiny", tmp_path / arch, seed=0, arch=arch)
        with safe_open(str(folder / "model.safetensors"), "pt") as f:
            tower = [k for k in f.keys() if k.startswith("vision_tower.")]  # noqa: SIM118
        assert tower and all(k.startswith("vision_tower.vision_model.") for k in tower), arch
