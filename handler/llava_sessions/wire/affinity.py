"""Where a chat request without a session should go: the replica that holds its conversation's prefix.

A stateless client (LiteLLM, LangChain, the openai package) resends the whole conversation every
turn; the conversation cache (``SessionEngine.retain``) serves the part seen before, but only on the
replica that saw it. :func:`prefix_key` names what every turn of one conversation (and every
conversation starting alike) shares, keyed like the cache within its salt: the ``cache_salt``, the
system prompt and the first user message, each image of it by its ``uuid`` when it has one (a later
turn may send the uuid alone), else by its URL or inline data. No model, no torch.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from .inbound import salt_of_attributes

__all__ = ["prefix_key"]


def _salt(data: dict, custom_attributes: str | None) -> str:
    salt = data.get("cache_salt")
    return salt if isinstance(salt, str) else salt_of_attributes(custom_attributes) or ""


def _part_identity(part: Any) -> Any:
    """What names one content part in the key: text as is, an image by its uuid, else its URL."""
    if not isinstance(part, dict):
        return part
    if part.get("type") == "image_url":
        uuid = part.get("uuid")
        if isinstance(uuid, str):
            return ["uuid", uuid]
        url = (part.get("image_url") or {}).get("url") if isinstance(part.get("image_url"), dict) else None
        return ["url", hashlib.sha256(str(url).encode()).hexdigest()]
    return [part.get("type"), part.get("text")]


def prefix_key(body: Any, custom_attributes: str | None = None) -> str | None:
    """The routing key of a chat request: SHA-256 over its salt, its leading system message and its
    first user message (:func:`_part_identity` of each part); None when ``body`` (bytes, str or the
    decoded dict) is not a chat-completions body or not JSON.

    Args:
        body: the request body.
        custom_attributes: SageMaker's ``X-Amzn-SageMaker-Custom-Attributes`` (may carry ``cache_salt=``).
    """
    if isinstance(body, (bytes, bytearray, memoryview, str)):
        try:
            body = json.loads(bytes(body) if not isinstance(body, str) else body)
        except (ValueError, RecursionError):
            return None
    if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
        return None
    head: list[Any] = []
    for message in body["messages"]:
        if not isinstance(message, dict):
            return None
        content = message.get("content")
        parts = [_part_identity(p) for p in content] if isinstance(content, list) else [content]
        head.append([message.get("role"), parts])
        if message.get("role") == "user":
            break
    return hashlib.sha256(json.dumps([_salt(body, custom_attributes), head]).encode()).hexdigest()
