"""The model side of a worker: loading a LLaVA-family checkpoint, its chat template, its KV caches
and the forward passes (:class:`LlavaModel`). The only package that knows an architecture.

=================== ===============================================================
module              owns
=================== ===============================================================
``loading``         architecture, model and processor from a local folder; device, dtype
``templating``      ``ChatTemplate``: a ``Chat`` to chat-templated token ids
``kv``              the KV cache's storage (a pool in pages) and its transformers ``Cache`` adapters
``llava``           ``LlavaModel``: vision tower, prefill, batched decode
``video``           a checkpoint's video path: token counts, frame preprocessing, ``EncodedVideo``
``fused``           a decode step and a prefill chunk in one pass; a sliding window's context cap
``packed_linears``  a CPU model's linears over oneDNN-prepacked weights
``parallel``        tensor parallel: rank 0's passes mirrored on the other ranks
``gpu``             what only a GPU runs: CUDA graphs, pinned copies, compiled layers
=================== ===============================================================
"""

from __future__ import annotations

from .kv import KVPool, SessionKV, SlotsCache, cache_len
from .llava import LlavaModel
from .loading import (
    ARCHITECTURES,
    checkpoint_architecture,
    image_only_processor_class,
    load_model,
    load_processor,
    resolve_device,
    resolve_dtype,
)
from .templating import ChatTemplate
from .video import EncodedVideo, is_sampled_video

__all__ = [
    "ARCHITECTURES",
    "ChatTemplate",
    "EncodedVideo",
    "KVPool",
    "SlotsCache",
    "LlavaModel",
    "SessionKV",
    "cache_len",
    "checkpoint_architecture",
    "is_sampled_video",
    "image_only_processor_class",
    "load_model",
    "load_processor",
    "resolve_device",
    "resolve_dtype",
]
