"""Chat templating and tokenization: a :class:`~llava_sessions.conversation.Chat` to token ids.

The checkpoint's own chat template renders the conversation (never a hand-written prompt string,
shared/notes/llava-transformers.md), and each ``<image>`` expands to the processor's count of
placeholder tokens for that image. No forward passes here.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from ..conversation import Chat, common_prefix_len

__all__ = ["PREFIX_MEMO_SIZE", "ChatTemplate"]

#: Prefixes of image-only conversations remembered by :meth:`ChatTemplate.prefix_ids` (least recently used go).
PREFIX_MEMO_SIZE = 64


class ChatTemplate:
    """The checkpoint's chat template and tokenizer, applied to conversations.

    Args:
        processor: the checkpoint's processor (``apply_chat_template``, ``tokenizer``, ``image_token``).
        image_token_id: the id of the image placeholder token (``config.image_token_id``).

    Attributes:
        tokenizer: the processor's tokenizer.
        image_token: the placeholder text (``<image>``); image_token_id: its id.
    """

    def __init__(self, processor: Any, image_token_id: int) -> None:
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.image_token: str = getattr(processor, "image_token", "<image>")
        self.image_token_id = image_token_id
        self._prefix_memo: OrderedDict[tuple[Any, ...], list[int]] = OrderedDict()

    def messages(self, chat: Chat, prompt: str | None) -> list[dict]:
        """Chat messages: optional system, each user message opened by its images, remembered
        answers as assistant messages, then ``prompt`` as the last user message (opened by the
        pending images)."""
        messages: list[dict] = []
        if chat.system_prompt:
            messages.append({"role": "system", "content": [{"type": "text", "text": chat.system_prompt}]})
        for turn in chat.turns:
            content = [{"type": "image"}] * turn.images + [{"type": "text", "text": turn.prompt}]
            messages.append({"role": "user", "content": content})
            messages.append({"role": "assistant", "content": [{"type": "text", "text": turn.answer}]})
        if prompt is not None:
            content = [{"type": "image"}] * chat.pending_images + [{"type": "text", "text": prompt}]
            messages.append({"role": "user", "content": content})
        return messages

    def conversation_text(self, chat: Chat, prompt: str) -> str:
        """Chat-template the full conversation with the generation prompt (``<image>`` not expanded)."""
        messages = self.messages(chat, prompt)
        return self.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def tokenize(self, text: str, image_tokens: Sequence[int]) -> list[int]:
        """Tokenize templated text, expanding the i-th ``<image>`` to ``image_tokens[i]`` placeholders
        (what the processors do), with the tokenizer's special tokens (BOS).

        Raises:
            ValueError: the text holds a different number of ``<image>`` than ``image_tokens``.
        """
        parts = text.split(self.image_token)
        if len(parts) - 1 != len(image_tokens):
            raise ValueError(f"{len(parts) - 1} image placeholders in the text for {len(image_tokens)} images")
        # The placeholder is an added token, split off before the text around it is tokenized, so
        # one copy per image tokenizes its neighbours exactly as n copies do: expand the ids, not
        # the text (a 576-token image then costs the tokenizer one token, not 576).
        ids = self.tokenizer(text, add_special_tokens=True)["input_ids"]
        if ids.count(self.image_token_id) == len(image_tokens):
            out: list[int] = []
            counts = iter(image_tokens)
            for token in ids:
                if token == self.image_token_id:
                    out.extend([token] * next(counts))
                else:
                    out.append(token)
            return out
        # a tokenizer that does not keep the placeholder whole: expand the text, as the processors do
        expanded = parts[0] + "".join(
            self.image_token * n + part for n, part in zip(image_tokens, parts[1:], strict=True)
        )
        return list(self.tokenizer(expanded, add_special_tokens=True)["input_ids"])

    def conversation_ids(self, chat: Chat, prompt: str) -> list[int]:
        """Token ids of the full chat-templated conversation ending in the generation prompt."""
        return self.tokenize(self.conversation_text(chat, prompt), chat.image_tokens)

    def prefix_ids(self, chat: Chat) -> list[int]:
        """Token ids every next question shares: system prompt, images and turns, whatever the question.

        Found as the common prefix of two conversations that differ only in their last question,
        so it holds for any chat template. Without turns the result is memoised (the last
        :data:`PREFIX_MEMO_SIZE` system prompt / image layouts).
        """

        def compute() -> list[int]:
            a = self.conversation_ids(chat, "A")
            b = self.conversation_ids(chat, "Z")
            return a[: common_prefix_len(a, b)]

        if chat.turns:
            return compute()
        key = (chat.system_prompt, chat.pending_images, chat.image_tokens)
        if key in self._prefix_memo:
            self._prefix_memo.move_to_end(key)
        else:
            self._prefix_memo[key] = compute()
            while len(self._prefix_memo) > PREFIX_MEMO_SIZE:  # anyres image sizes make many keys
                self._prefix_memo.popitem(last=False)
        return list(self._prefix_memo[key])

    def count_text_tokens(self, text: str) -> int:
        """Number of tokens of ``text`` alone (no special tokens)."""
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])
