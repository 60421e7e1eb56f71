"""The engine the core tests step: the ``tiny`` model, a store with room for everything unless a test
gives a budget, and every invariant checked after every step and admission."""

from __future__ import annotations

import functools
from typing import Any

import torch

from llava_sessions.engine import EngineLimits, SessionEngine
from llava_sessions.images.fetch import decode_image
from llava_sessions.sessions.store import SessionStore

#: The tests' image decoder (the server's, with a pixel cap no test photo reaches).
decode = functools.partial(decode_image, max_pixels=40_000_000)


#: How the engine tests run answers, as :func:`make_engine` keyword arguments: each step at its own
#: shape (``eager``, a CPU's default), and through the static decode step a GPU replays as CUDA graphs
#: (run eagerly on this CPU, over a fixed pool), with and without async scheduling.
LAYOUTS: dict[str, dict[str, Any]] = {
    "eager": {},
    "static": {"cuda_graphs": True, "async_scheduling": False},
    "ahead": {"cuda_graphs": True, "async_scheduling": True},
}


def make_engine(
    llava: Any,
    budget: int | None = None,
    *,
    limits: EngineLimits | None = None,
    store_kw: dict[str, Any] | None = None,
    **engine_kw: Any,
) -> SessionEngine:
    """A :class:`SessionEngine` on ``llava`` with ``check_invariants`` on: a store of ``budget``
    device bytes (default 10 GB, or 100 MB when ``cuda_graphs`` fixes the pool at the budget), 1 GB
    of host bytes, 16 sessions and a 20-minute TTL (``store_kw`` overrides any), ``limits`` (default:
    ``max_new_tokens_cap`` 512) and the engine's keyword arguments."""
    if budget is None:
        budget = 10**8 if engine_kw.get("cuda_graphs") else 10**10
    kw: dict[str, Any] = {"device_budget_bytes": budget, "host_budget_bytes": 10**9, "max_sessions": 16, "ttl_s": 1200}
    kw.update(store_kw or {})
    store = SessionStore(kv_bytes_per_token=llava.kv_bytes_per_token, **kw)
    limits = limits or EngineLimits(max_new_tokens_cap=512)
    return SessionEngine(llava, store, decode, limits, check_invariants=True, **engine_kw)


def reference(
    llava,
    image_bytes: bytes,
    turns: list[tuple[str, str]],
    prompt: str,
    system_prompt: str | None = None,
    max_new_tokens: int = 12,
) -> list[int]:
    """Greedy tokens of ``model.generate`` from scratch on the chat-templated conversation."""
    messages = []
    if system_prompt:
        messages.append({"role": "system", "content": [{"type": "text", "text": system_prompt}]})
    for i, (q, a) in enumerate(turns + [(prompt, None)]):
        content = ([{"type": "image"}] if i == 0 else []) + [{"type": "text", "text": q}]
        messages.append({"role": "user", "content": content})
        if a is not None:
            messages.append({"role": "assistant", "content": [{"type": "text", "text": a}]})
    text = llava.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = llava.processor(text=text, images=decode(image_bytes), return_tensors="pt")
    with torch.inference_mode():
        out = llava.model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()
