"""Build random-weight LLaVA checkpoints that load exactly like a llava-hf folder.

``llava-tiny-model --arch {llava,llava-next,llava-onevision,llava-next-video} --size {tiny,bench,7b} --out DIR
[--seed N]`` writes a folder that the architecture's ``...ForConditionalGeneration.from_pretrained``
and ``AutoProcessor.from_pretrained`` load with no hub access: the real transformers config class,
random weights, a byte-level BPE tokenizer trained with ``tokenizers`` on a small built-in corpus,
the ``<image>`` token, the family's chat template and processor config. Architectures (the hub
checkpoints each one mirrors):

* ``llava`` (llava-hf/llava-1.5-7b-hf): ``LlavaForConditionalGeneration``, CLIP at 336 px, patch 14
  → 576 image tokens whatever the image; LLaMA text model; ``USER: <image>\\n... ASSISTANT:``;
  ``num_additional_image_tokens=1`` (the llava-hf value; see docs/platform.md).
* ``llava-next`` (llava-hf/llava-v1.6-mistral-7b-hf): ``LlavaNextForConditionalGeneration``, the
  same CLIP tower with "anyres" tiling over llava-v1.6's grid pinpoints (336x672 .. 672x672), so the
  image tokens depend on the image size (2,928 for a 672x672 photo); ``[INST] <image>\\n... [/INST]``.
* ``llava-onevision`` (llava-hf/llava-onevision-qwen2-0.5b-ov-hf): ``LlavaOnevisionForConditionalGeneration``,
  SigLIP at 384 px, patch 14 (729 tokens per tile), ``anyres_max_9``; Qwen2 text model (GQA) with
  ChatML (``<|im_start|>user <image>\\n...<|im_end|>``), no BOS. With more than one image in a
  conversation each image is one base tile plus a newline token (730), as the model was trained.
  Videos: 196 tokens per frame and a newline.
* ``llava-next-video`` (llava-hf/LLaVA-NeXT-Video-7B-hf): ``LlavaNextVideoForConditionalGeneration``,
  LLaVA-NeXT's CLIP tower and anyres images, and videos: each 336 px frame average-pooled to 144
  tokens; ``USER: <image>\\n<video>\\n... ASSISTANT:``; its ``video_preprocessor_config.json`` says
  336 (shortest edge, then a center crop).

Sizes:

* ``tiny``: a few MB, loads in well under 2 s; for tests.
* ``bench``: llava-1.5's proportions scaled down for a CPU (the text model dominates, the vision
  tower is ~5% of a full prefill's FLOPs, 576 image tokens), so a follow-up question is cheap
  and a full prefill expensive, as on the real model.
* ``7b``: exactly llava-1.5-7b's architecture (7,063,427,072 parameters; public config of
  ``llava-hf/llava-1.5-7b-hf``). Only built in memory on a GPU (:func:`build_model`); the CLI
  refuses it without CUDA. Its tokenizer is still the small one. ``llava`` only.

The answers of these models are meaningless; everything else about the serving path is real.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .hub_layout import to_hub_layout

#: llava-1.5 chat template in the llava-hf form: optional system text first, then per message
#: ``ROLE: `` with images first (``<image>\\n``) and texts each followed by a space; the
#: generation prompt is ``ASSISTANT:``.
LLAVA15_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] != 'system' %}{{ message['role'].upper() + ': ' }}{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] + ' ' }}{% else %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'video') %}{{ '<video>\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] + ' ' }}{% endfor %}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)

#: llava-v1.6-mistral style: optional system text first, then ``[INST] `` + images (``<image>\\n``)
#: + text + `` [/INST]`` per user message and `` answer</s>`` per assistant message; the generation
#: prompt is empty (the model answers after ``[/INST]``).
LLAVA_NEXT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] + '\n\n' }}{% endfor %}"
    "{% elif message['role'] == 'user' %}{{ '[INST] ' }}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] }}{% endfor %}"
    "{{ ' [/INST]' }}"
    "{% else %}{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ ' ' + content['text'] + '</s>' }}{% endfor %}{% endif %}"
    "{% endfor %}"
)

#: ChatML (Qwen2, llava-onevision): ``<|im_start|>role `` + images (``<image>\\n``), then videos
#: (``<video>\\n``), as llava-onevision's own template orders them, + text + ``<|im_end|>\\n`` per
#: message; the generation prompt is ``<|im_start|>assistant\\n``.
CHATML_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + ' ' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'video') %}{{ '<video>\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] }}{% endfor %}"
    "{% endif %}{{ '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

IMAGE_TOKEN = "<image>"
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>", IMAGE_TOKEN]
#: ChatML's turn markers (llava-onevision); ``<|im_end|>`` ends an answer there.
CHATML_TOKENS = ["<|im_start|>", "<|im_end|>", "<video>"]

#: The architectures ``--arch`` builds: name → transformers model class name.
ARCHS: dict[str, str] = {
    "llava": "LlavaForConditionalGeneration",
    "llava-next": "LlavaNextForConditionalGeneration",
    "llava-onevision": "LlavaOnevisionForConditionalGeneration",
    "llava-next-video": "LlavaNextVideoForConditionalGeneration",
}


def next_video_preprocessor() -> dict[str, Any]:
    """LLaVA-NeXT-Video-7B-hf's ``video_preprocessor_config.json`` (imported when called: seconds)."""
    from llava_sessions.model.video import VIDEO_DEFAULTS

    crop = {"size": {"shortest_edge": 336}, "crop_size": {"height": 336, "width": 336}, "do_center_crop": True}
    names = {"video_processor_type": "LlavaNextVideoVideoProcessor", "processor_class": "LlavaNextVideoProcessor"}
    return {**VIDEO_DEFAULTS["LlavaNextVideoForConditionalGeneration"], **crop, **names}


#: llava-v1.6's grid pinpoints (height, width), the LlavaNextConfig default.
NEXT_GRID_PINPOINTS = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]
_CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
_CLIP_STD = [0.26862954, 0.26130258, 0.27577711]

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
    max_positions_anyres: int = 8192  # context of the llava-next / onevision builds (anyres images are long)


SIZES: dict[str, SizeSpec] = {
    # 4,096 positions as llava-1.5's own: room for several 576-token images (the tests build it with
    # max_positions=1024, so a conversation reaches the context's edge in a few turns)
    "tiny": SizeSpec(64, 2, 4, 4, 128, 32, 2, 2, 64, 4096, None, 0.5),
    # llava-1.5-7b scaled for a CPU: text 4096 x 32 layers → 768 x 6 (the same 128 hidden per layer
    # and head size, MLP ratio 2.69), vision 1024 x 24 → 176 x 6 so the vision tower stays ~1/20 of
    # the text model (7b: 0.30 B vs 6.7 B parameters); 576 image tokens
    "bench": SizeSpec(768, 6, 6, 6, 2064, 176, 6, 4, 704, 4096, None, 0.02, 8192),
    # exact llava-1.5-7b (llava-hf/llava-1.5-7b-hf config.json)
    "7b": SizeSpec(4096, 32, 32, 32, 11008, 1024, 24, 16, 4096, 4096, 32064, 0.02, 4096),
}


def _train_tokenizer(vocab_size: int = 2048, *, chatml: bool = False, video: bool = False):
    """Train a byte-level BPE on the built-in corpus; returns a ``PreTrainedTokenizerFast``.

    BOS ``<s>`` is prepended by the post-processor, as LLaMA tokenizers do. ``chatml``: Qwen2's way
    instead: no BOS, ``<|im_start|>`` / ``<|im_end|>`` special tokens, ``<|im_end|>`` is EOS.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS + (CHATML_TOKENS if chatml else ["<video>"] if video else []),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = [line for line in _CORPUS.splitlines() if line.strip()]
    tok.train_from_iterator(lines * 4, trainer=trainer)
    if not chatml:
        bos_id = tok.token_to_id("<s>")
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos_id)]
        )
    extra = {"image_token": IMAGE_TOKEN, **({"video_token": "<video>"} if chatml or video else {})}
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None if chatml else "<s>",
        eos_token="<|im_end|>" if chatml else "</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        extra_special_tokens=extra,
        model_max_length=32768 if chatml else 4096,
        padding_side="left",
    )
    fast.chat_template = CHATML_CHAT_TEMPLATE if chatml else LLAVA15_CHAT_TEMPLATE
    return fast


def _tower_kwargs(
    spec: Any, vocab_size: int, pad_token_id: int, bos_token_id: int | None, eos_token_id: int, arch: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The text model's and the vision tower's config keywords of ``spec`` (a :data:`SIZES` entry)."""
    text_kwargs: dict[str, Any] = dict(
        vocab_size=spec.vocab_size or vocab_size,
        hidden_size=spec.text_hidden,
        intermediate_size=spec.text_intermediate,
        num_hidden_layers=spec.text_layers,
        num_attention_heads=spec.text_heads,
        max_position_embeddings=spec.max_positions if arch == "llava" else spec.max_positions_anyres,
        rms_norm_eps=1e-5 if arch != "llava-onevision" else 1e-6,
        initializer_range=spec.init_range,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        tie_word_embeddings=False,
    )
    vision_kwargs: dict[str, Any] = dict(
        hidden_size=spec.vision_hidden,
        intermediate_size=spec.vision_intermediate,
        num_hidden_layers=spec.vision_layers,
        num_attention_heads=spec.vision_heads,
        patch_size=14,
    )
    return text_kwargs, vision_kwargs


def build_config(
    size: str,
    vocab_size: int,
    image_token_id: int,
    pad_token_id: int,
    *,
    bos_token_id: int | None = 1,
    eos_token_id: int = 2,
    arch: str = "llava",
    video_token_id: int | None = None,
    kv_heads: int | None = None,
):
    """Return the transformers config of ``arch`` at ``size``: a ``LlavaConfig`` (336 px, patch 14 →
    576 image tokens), a ``LlavaNextConfig`` (the same tower, llava-v1.6's grid pinpoints) or a
    ``LlavaOnevisionConfig`` (SigLIP 384 px, patch 14; Qwen2 text model, GQA with a third of the heads).

    ``kv_heads`` replaces the text model's key-value heads (default: the size's; a third of the heads
    for OneVision), e.g. an even count for a model sharded over 2 ranks.

    Raises:
        KeyError: unknown size or arch.
        ValueError: ``7b`` for an arch other than ``llava``; ``kv_heads`` does not divide the heads.
    """
    from transformers import (
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaNextConfig,
        LlavaOnevisionConfig,
        Qwen2Config,
        SiglipVisionConfig,
    )

    spec, _ = SIZES[size], ARCHS[arch]
    if size == "7b" and arch != "llava":
        raise ValueError("--size 7b is llava-1.5-7b's exact shape; build llava-next / llava-onevision as tiny or bench")
    if kv_heads is not None and (kv_heads < 1 or spec.text_heads % kv_heads):
        raise ValueError(f"kv_heads {kv_heads} does not divide the {spec.text_heads} attention heads")
    text_kwargs, vision_kwargs = _tower_kwargs(spec, vocab_size, pad_token_id, bos_token_id, eos_token_id, arch)
    vision: Any
    text: Any
    if arch == "llava-onevision":
        vision = SiglipVisionConfig(image_size=384, vision_use_head=False, **vision_kwargs)
        text = Qwen2Config(num_key_value_heads=kv_heads or max(1, spec.text_heads // 3), **text_kwargs)
        return LlavaOnevisionConfig(
            vision_config=vision,
            text_config=text,
            image_token_index=image_token_id,
            video_token_index=image_token_id + 1 if video_token_id is None else video_token_id,
            vision_feature_select_strategy="full",
            vision_feature_layer=-1,
            vision_aspect_ratio="anyres_max_9",
            pad_token_id=pad_token_id,  # type: ignore[call-arg]  # a PretrainedConfig keyword
            tie_word_embeddings=False,
        )
    vision = CLIPVisionConfig(
        image_size=336,
        projection_dim=768 if size == "7b" else spec.vision_hidden,
        hidden_act="quick_gelu",
        layer_norm_eps=1e-5,
        **vision_kwargs,
    )
    text = LlamaConfig(num_key_value_heads=kv_heads or spec.text_kv_heads, **text_kwargs)
    common: dict[str, Any] = dict(
        vision_config=vision,
        text_config=text,
        image_token_index=image_token_id,
        projector_hidden_act="gelu",
        vision_feature_select_strategy="default",
        vision_feature_layer=-2,
        image_seq_length=576,
        pad_token_id=pad_token_id,
        tie_word_embeddings=False,
    )
    if arch == "llava-next":
        return LlavaNextConfig(image_grid_pinpoints=NEXT_GRID_PINPOINTS, **common)
    if arch == "llava-next-video":
        return _next_video_config(common, image_token_id + 1 if video_token_id is None else video_token_id)
    return LlavaConfig(**common)


def _next_video_config(common: dict[str, Any], video_token_id: int) -> Any:
    """LLaVA-NeXT-Video's config over llava-1.5's towers (``common``): llava-v1.6's grid pinpoints for
    images, each video frame average-pooled by 2 (LLaVA-NeXT-Video-7B-hf's)."""
    from transformers import LlavaNextVideoConfig

    return LlavaNextVideoConfig(
        image_grid_pinpoints=NEXT_GRID_PINPOINTS,
        video_token_index=video_token_id,
        spatial_pool_mode="average",
        spatial_pool_stride=2,
        **common,
    )


def build_processor(tokenizer, arch: str = "llava"):
    """Return the processor of ``arch``: a ``LlavaProcessor`` (PIL CLIP image processor at 336 px), a
    ``LlavaNextProcessor`` (PIL anyres image processor, llava-v1.6's pinpoints) or a
    ``LlavaOnevisionProcessor`` (PIL, 384 px, anyres_max_9; image-only), with the family's chat template."""
    from transformers import LlavaNextProcessor, LlavaProcessor
    from transformers.models.clip import CLIPImageProcessorPil
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
        LlavaOnevisionImageProcessorPil,
    )

    image_processor: Any
    if arch == "llava-onevision":
        image_processor = LlavaOnevisionImageProcessorPil(
            size={"height": 384, "width": 384}, image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5]
        )
        from transformers import LlavaOnevisionProcessor

        from llava_sessions.model import image_only_processor_class

        return image_only_processor_class(LlavaOnevisionProcessor)(
            image_processor=image_processor,
            tokenizer=tokenizer,
            num_image_tokens=729,
            vision_feature_select_strategy="full",
            chat_template=CHATML_CHAT_TEMPLATE,
            image_token=IMAGE_TOKEN,
            vision_aspect_ratio="anyres_max_9",
        )
    common: dict[str, Any] = dict(
        tokenizer=tokenizer,
        patch_size=14,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        image_token=IMAGE_TOKEN,
    )
    clip: dict[str, Any] = dict(  # CLIP at 336 px, as llava-1.5 and llava-v1.6 preprocess
        size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336}, image_mean=_CLIP_MEAN, image_std=_CLIP_STD
    )
    if arch == "llava-next":
        image_processor = LlavaNextImageProcessorPil(image_grid_pinpoints=NEXT_GRID_PINPOINTS, **clip)
        return LlavaNextProcessor(image_processor=image_processor, chat_template=LLAVA_NEXT_CHAT_TEMPLATE, **common)
    if arch == "llava-next-video":
        from transformers import LlavaNextVideoProcessor

        from llava_sessions.model import image_only_processor_class

        image_processor = LlavaNextImageProcessorPil(image_grid_pinpoints=NEXT_GRID_PINPOINTS, **clip)
        return image_only_processor_class(LlavaNextVideoProcessor)(
            image_processor=image_processor, chat_template=LLAVA15_CHAT_TEMPLATE, video_token="<video>", **common
        )
    image_processor = CLIPImageProcessorPil(do_center_crop=True, **clip)
    return LlavaProcessor(image_processor=image_processor, chat_template=LLAVA15_CHAT_TEMPLATE, **common)


def build_model(
    size: str, *, seed: int = 0, device: str = "cpu", dtype=None, arch: str = "llava", kv_heads: int | None = None
):
    """Build ``(model, processor)`` of ``arch`` at ``size`` with random weights, in memory.

    Args:
        size: one of :data:`SIZES`.
        seed: torch seed for the weights (same seed → same weights).
        device: where to build (``"cuda"`` for ``7b``: 14.13 GB in fp16).
        dtype: torch dtype; default float32.
        arch: one of :data:`ARCHS`.
        kv_heads: the text model's key-value heads (:func:`build_config`).

    Returns:
        ``(the arch's ...ForConditionalGeneration in eval mode, its processor)``.

    Raises:
        KeyError, ValueError: as :func:`build_config`.
    """
    import torch
    import transformers
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    chatml, video = arch == "llava-onevision", arch in ("llava-onevision", "llava-next-video")
    tokenizer = _train_tokenizer(chatml=chatml, video=video)
    processor = build_processor(tokenizer, arch)
    config = build_config(
        size,
        vocab_size=len(tokenizer),
        image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        arch=arch,
        video_token_id=tokenizer.convert_tokens_to_ids("<video>") if video else None,
        kv_heads=kv_heads,
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = getattr(transformers, ARCHS[arch])(config)
    if dtype is not None:
        model = model.to(dtype)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model.eval(), processor


def write_checkpoint(
    size: str,
    out: str | Path,
    *,
    seed: int = 0,
    arch: str = "llava",
    max_positions: int | None = None,
    kv_heads: int | None = None,
) -> Path:
    """Build ``arch`` at ``size`` and save it as a llava-hf style folder at ``out``, its weights named as
    the hub's checkpoints name them (:func:`to_hub_layout`); returns the folder.

    ``max_positions`` replaces the text model's context (``max_position_embeddings``, tokens); the
    weights do not depend on it (rotary positions), so the answers are the same within it.

    Raises:
        RuntimeError: ``size == "7b"`` without CUDA.
        KeyError, ValueError: as :func:`build_config`.
    """
    import torch

    if size == "7b" and not torch.cuda.is_available():
        raise RuntimeError(
            "--size 7b is built on a GPU machine only (14 GB of fp16 weights); run it where CUDA is available, "
            "or use --size bench on this one"
        )
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model, processor = build_model(
        size,
        seed=seed,
        device="cuda" if size == "7b" else "cpu",
        dtype=torch.float16 if size == "7b" else None,
        arch=arch,
        kv_heads=kv_heads,
    )
    if max_positions is not None:
        if max_positions < 64:
            raise ValueError("max_positions must be >= 64")
        model.config.text_config.max_position_embeddings = max_positions
    model.save_pretrained(out)
    to_hub_layout(out)
    processor.save_pretrained(out)
    if arch == "llava-next-video":
        (out / "video_preprocessor_config.json").write_text(json.dumps(next_video_preprocessor(), indent=1))
    (out / "llava_sessions_build.json").write_text(
        json.dumps({"arch": arch, "size": size, "seed": seed, "random_weights": True}, indent=1)
    )
    return out
