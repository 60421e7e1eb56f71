"""``llava-tiny-model``: random-weight llava-hf checkpoints of each family, built with transformers'
own classes, tokenizer and chat template and loaded exactly like the hub's (:mod:`.builder`)."""

from .builder import ARCHS, SIZES, SizeSpec, build_config, build_model, build_processor, write_checkpoint
from .cli import main

__all__ = ["ARCHS", "SIZES", "SizeSpec", "build_config", "build_model", "build_processor", "main", "write_checkpoint"]
