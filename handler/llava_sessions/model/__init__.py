"""The model side of a worker: loading a LLaVA-family checkpoint, its chat template, its KV caches
and the forward passes (:class:`LlavaRunner`). The only package that knows an architecture.

=================== ===============================================================
module              owns
=================== ===============================================================
``loading``         architecture, model and processor from a local folder; device, dtype
``templating``      ``ChatTemplate``: a ``Chat`` to chat-templated token ids
``kv_cache``        ``DynamicCache`` helpers, the decode batch's ``BatchKVCache``
``runner``          ``LlavaRunner``: vision tower, prefill, batched decode
``video``           a checkpoint's video path: token counts, frame preprocessing, ``EncodedVideo``
=================== ===============================================================
"""

from __future__ import annotations

from .kv_cache import BatchKVCache, BatchKVLayer, cache_len, crop_cache
from .loading import (
    ARCHITECTURES,
    checkpoint_architecture,
    image_only_processor_class,
    load_model,
    load_processor,
    resolve_device,
    resolve_dtype,
)
from .runner import LlavaRunner
from .templating import ChatTemplate
from .video import EncodedVideo, is_sampled_video

__all__ = [
    "ARCHITECTURES",
    "BatchKVCache",
    "BatchKVLayer",
    "ChatTemplate",
    "EncodedVideo",
    "LlavaRunner",
    "cache_len",
    "checkpoint_architecture",
    "is_sampled_video",
    "crop_cache",
    "image_only_processor_class",
    "load_model",
    "load_processor",
    "resolve_device",
    "resolve_dtype",
]
