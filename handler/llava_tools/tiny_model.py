"""Build random-weight LLaVA checkpoints that load exactly like a llava-hf folder.

``llava-tiny-model --size {tiny,bench,7b} --out DIR [--seed N]`` writes a folder that
``LlavaForConditionalGeneration.from_pretrained`` and ``AutoProcessor.from_pretrained`` load
with no hub access: a real :class:`transformers.LlavaConfig` (CLIP vision tower at 336 px,
patch 14 → 576 image tokens; LLaMA text model), random weights, a byte-level BPE tokenizer
trained with ``tokenizers`` on a small built-in corpus, the ``<image>`` token, the llava-1.5
chat template (``USER: <image>\\n... ASSISTANT:``) and a processor config with
``num_additional_image_tokens=1`` (the llava-hf value; see shared/notes/llava-transformers.md).

Sizes:

* ``tiny``: a few MB, loads in well under 2 s; for tests.
* ``bench``: llava-1.5's proportions scaled down for a CPU (the text model dominates, the vision
  tower is ~5% of a full prefill's FLOPs, 576 image tokens), so a follow-up question is cheap
  and a full prefill expensive, as on the real model.
* ``7b``: exactly llava-1.5-7b's architecture (7,063,427,072 parameters; public config of
  ``llava-hf/llava-1.5-7b-hf``). Only built in memory on a GPU (:func:`build_model`); the CLI
  refuses it without CUDA. Its tokenizer is still the small one, so its text is meaningless.

The answers of these models are meaningless; everything else about the serving path is real.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

#: llava-1.5 chat template in the llava-hf form: optional system text first, then per message
#: ``ROLE: `` with images first (``<image>\\n``) and texts each followed by a space; the
#: generation prompt is ``ASSISTANT:``.
LLAVA15_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] != 'system' %}{{ message['role'].upper() + ': ' }}{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] + ' ' }}{% else %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] + ' ' }}{% endfor %}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)

IMAGE_TOKEN = "<image>"
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>", IMAGE_TOKEN]

#: Built-in training corpus for the byte-level BPE tokenizer: plain English about images, so
#: questions and answers tokenise into words rather than bytes.
_CORPUS = """
A chat between a curious human and an artificial intelligence assistant.
The assistant gives helpful, detailed, and polite answers to the human's questions.
What is in this image? Describe the image in detail. What color is the cat?
How many people are in the picture? Is there a dog? What is the man holding?
The image shows a cat sitting on a wooden table next to a window with sunlight.
There are two people standing near a red car parked on a busy street in the city.
A cup of coffee, a camera, a small plant and an astronaut in a white space suit.
The coins on the table are made of silver and copper, some are old and worn.
A rocket is launching into a clear blue sky, leaving a trail of white smoke.
The horse is brown with a white stripe, grazing in a green field under the trees.
What is written on the sign? Where was this photo taken? What time of day is it?
Answer the question using a single word or phrase. Please be brief and precise.
Yes. No. Maybe. I think so. It looks like a chelsea cat or a tabby cat.
The colors are red, green, blue, yellow, orange, purple, black, white and gray.
In the background there is a building, a mountain, a river and some clouds.
Numbers: one two three four five six seven eight nine ten 0 1 2 3 4 5 6 7 8 9.
Punctuation and symbols: , . ; : ! ? ' " ( ) [ ] { } - _ + = / \\ * & % $ # @
Café, naïve, über, 日本語, emoji 🙂 and other unicode text appear sometimes.
USER: What is in this image? ASSISTANT: A cat sitting on a table.
USER: Is there a flag in the picture? ASSISTANT: Yes, there is a flag on the suit.
USER: Describe the background. ASSISTANT: The background is dark with a blue sky.
USER: What colors do you see? ASSISTANT: White, black, red and blue.
"""


@dataclass(frozen=True)
class SizeSpec:
    """Architecture numbers of one checkpoint size (text = LLaMA, vision = CLIP ViT)."""

    text_hidden: int
    text_layers: int
    text_heads: int
    text_kv_heads: int
    text_intermediate: int
    vision_hidden: int
    vision_layers: int
    vision_heads: int
    vision_intermediate: int
    max_positions: int
    vocab_size: int | None  # None: the trained tokenizer's size
    init_range: float


SIZES: dict[str, SizeSpec] = {
    "tiny": SizeSpec(64, 2, 4, 4, 128, 32, 2, 2, 64, 1024, None, 0.5),
    # llava-1.5-7b scaled for a CPU: text 4096 x 32 layers → 768 x 6 (the same 128 hidden per layer
    # and head size, MLP ratio 2.69), vision 1024 x 24 → 176 x 6 so the vision tower stays ~1/20 of
    # the text model (7b: 0.30 B vs 6.7 B parameters); 576 image tokens
    "bench": SizeSpec(768, 6, 6, 6, 2064, 176, 6, 4, 704, 4096, None, 0.02),
    # exact llava-1.5-7b (llava-hf/llava-1.5-7b-hf config.json)
    "7b": SizeSpec(4096, 32, 32, 32, 11008, 1024, 24, 16, 4096, 4096, 32064, 0.02),
}


def _train_tokenizer(vocab_size: int = 2048):
    """Train a byte-level BPE on the built-in corpus; returns a ``PreTrainedTokenizerFast``.

    BOS ``<s>`` is prepended by the post-processor, as LLaMA tokenizers do.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = [line for line in _CORPUS.splitlines() if line.strip()]
    tok.train_from_iterator(lines * 4, trainer=trainer)
    bos_id = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos_id)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        extra_special_tokens={"image_token": IMAGE_TOKEN},
        model_max_length=4096,
        padding_side="left",
    )
    fast.chat_template = LLAVA15_CHAT_TEMPLATE
    return fast


def build_config(
    size: str, vocab_size: int, image_token_id: int, pad_token_id: int, *, bos_token_id: int = 1, eos_token_id: int = 2
):
    """Return the :class:`transformers.LlavaConfig` of ``size`` (336 px, patch 14 → 576 image tokens).

    Raises:
        KeyError: unknown size.
    """
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    spec = SIZES[size]
    vision = CLIPVisionConfig(
        hidden_size=spec.vision_hidden,
        intermediate_size=spec.vision_intermediate,
        num_hidden_layers=spec.vision_layers,
        num_attention_heads=spec.vision_heads,
        image_size=336,
        patch_size=14,
        projection_dim=768 if size == "7b" else spec.vision_hidden,
        hidden_act="quick_gelu",
        layer_norm_eps=1e-5,
    )
    text = LlamaConfig(
        vocab_size=spec.vocab_size or vocab_size,
        hidden_size=spec.text_hidden,
        intermediate_size=spec.text_intermediate,
        num_hidden_layers=spec.text_layers,
        num_attention_heads=spec.text_heads,
        num_key_value_heads=spec.text_kv_heads,
        max_position_embeddings=spec.max_positions,
        rms_norm_eps=1e-5,
        initializer_range=spec.init_range,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        tie_word_embeddings=False,
    )
    return LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=image_token_id,
        projector_hidden_act="gelu",
        vision_feature_select_strategy="default",
        vision_feature_layer=-2,
        image_seq_length=576,
        pad_token_id=pad_token_id,  # type: ignore[call-arg]  # a PretrainedConfig keyword
        tie_word_embeddings=False,
    )


def build_processor(tokenizer):
    """Return a ``LlavaProcessor`` (PIL CLIP image processor at 336 px, llava-1.5 chat template)."""
    from transformers import LlavaProcessor
    from transformers.models.clip import CLIPImageProcessorPil

    image_processor = CLIPImageProcessorPil(
        size={"shortest_edge": 336},
        crop_size={"height": 336, "width": 336},
        do_center_crop=True,
        image_mean=[0.48145466, 0.4578275, 0.40821073],
        image_std=[0.26862954, 0.26130258, 0.27577711],
    )
    return LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=14,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=LLAVA15_CHAT_TEMPLATE,
        image_token=IMAGE_TOKEN,
    )


def build_model(size: str, *, seed: int = 0, device: str = "cpu", dtype=None):
    """Build ``(model, processor)`` of ``size`` with random weights, in memory.

    Args:
        size: one of :data:`SIZES`.
        seed: torch seed for the weights (same seed → same weights).
        device: where to build (``"cuda"`` for ``7b``: 14.13 GB in fp16).
        dtype: torch dtype; default float32.

    Returns:
        ``(LlavaForConditionalGeneration in eval mode, LlavaProcessor)``.
    """
    import torch
    from transformers import LlavaForConditionalGeneration
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tokenizer = _train_tokenizer()
    processor = build_processor(tokenizer)
    config = build_config(
        size,
        vocab_size=len(tokenizer),
        image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlavaForConditionalGeneration(config)
    if dtype is not None:
        model = model.to(dtype)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model.eval(), processor


def write_checkpoint(size: str, out: str | Path, *, seed: int = 0) -> Path:
    """Build ``size`` and save it as a llava-hf style folder at ``out``; returns the folder.

    Raises:
        RuntimeError: ``size == "7b"`` without CUDA.
    """
    import torch

    if size == "7b" and not torch.cuda.is_available():
        raise RuntimeError(
            "--size 7b is built on a GPU machine only (14 GB of fp16 weights); use build_model('7b', device='cuda')"
        )
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model, processor = build_model(
        size, seed=seed, device="cuda" if size == "7b" else "cpu", dtype=torch.float16 if size == "7b" else None
    )
    model.save_pretrained(out)
    processor.save_pretrained(out)
    (out / "llava_sessions_build.json").write_text(
        json.dumps({"size": size, "seed": seed, "random_weights": True}, indent=1)
    )
    return out


def main(argv: list[str] | None = None) -> int:
    """CLI entry ``llava-tiny-model``."""
    parser = argparse.ArgumentParser(prog="llava-tiny-model", description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        path = write_checkpoint(args.size, args.out, seed=args.seed)
    except RuntimeError as exc:
        print(f"llava-tiny-model: {exc}", file=sys.stderr)
        return 2
    print(f"llava-tiny-model: wrote {args.size} checkpoint (random weights) to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
