"""Chat templating and tokenization: a :class:`~llava_sessions.conversation.Chat` to token ids.

The checkpoint's own chat template renders the conversation (never a hand-written prompt string,
docs/platform.md), and each ``<image>`` expands to the processor's count of
placeholder tokens for that image. A video's ``<video>`` expands the same way, to its own count, but
of the *image* placeholder id: the engine feeds every placeholder's embedding from feature rows (the
model never sees the placeholder ids, only ``inputs_embeds``), so one id for both keeps every
prefix rule (sharing, reuse, the feature-row index) one rule. No forward passes here.
"""

from __future__ import annotations

import re
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
        processor: the checkpoint's processor (``apply_chat_template``, ``tokenizer``, ``image_token``,
            and ``video_token`` for a model with a video path).
        image_token_id: the id of the image placeholder token (``config.image_token_id``).
        video_token_id: the id of the video placeholder token (``config.video_token_id``), None for a
            model without a video path.

    Attributes:
        tokenizer: the processor's tokenizer.
        image_token: the placeholder text (``<image>``); image_token_id: its id.
        video_token: the video placeholder text (``<video>``), None without a video path.
    """

    def __init__(self, processor: Any, image_token_id: int, video_token_id: int | None = None) -> None:
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.image_token: str = getattr(processor, "image_token", "<image>")
        self.image_token_id = image_token_id
        self.video_token: str | None = getattr(processor, "video_token", None) if video_token_id is not None else None
        self.video_token_id = video_token_id
        self._prefix_memo: OrderedDict[tuple[Any, ...], list[int]] = OrderedDict()

    def messages(self, chat: Chat, prompt: str | None) -> list[dict]:
        """Chat messages: optional system, each user message opened by its media (an ``image`` part
        per image, a ``video`` part per video, in conversation order), remembered answers as assistant
        messages, then ``prompt`` as the last user message (opened by the pending media)."""
        messages: list[dict] = []
        if chat.system_prompt:
            messages.append({"role": "system", "content": [{"type": "text", "text": chat.system_prompt}]})
        index = 0

        def media(n: int) -> list[dict]:
            nonlocal index
            parts = [{"type": "video" if i in chat.videos else "image"} for i in range(index, index + n)]
            index += n
            return parts

        for turn in chat.turns:
            content = media(turn.images) + [{"type": "text", "text": turn.prompt}]
            messages.append({"role": "user", "content": content})
            messages.append({"role": "assistant", "content": [{"type": "text", "text": turn.answer}]})
        if prompt is not None:
            content = media(chat.pending_images) + [{"type": "text", "text": prompt}]
            messages.append({"role": "user", "content": content})
        return messages

    def conversation_text(self, chat: Chat, prompt: str) -> str:
        """Chat-template the full conversation with the generation prompt (``<image>`` not expanded)."""
        messages = self.messages(chat, prompt)
        return self.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def tokenize(self, text: str, image_tokens: Sequence[int], videos: frozenset[int] = frozenset()) -> list[int]:
        """Tokenize templated text, expanding the i-th medium's placeholder (``<image>``, or
        ``<video>`` for the indexes in ``videos``) to ``image_tokens[i]`` image placeholder ids (what
        the processors do, with one id for both: module docstring), with the tokenizer's special
        tokens (BOS).

        Raises:
            ValueError: the text holds other placeholders than ``image_tokens`` and ``videos`` say,
                in number or in order (a template that moves a video before an image of its message).
        """
        marks = [self.image_token] + ([self.video_token] if self.video_token else [])
        pattern = "|".join(re.escape(m) for m in marks)
        kinds = [m == self.video_token for m in re.findall(pattern, text)]
        expected = [i in videos for i in range(len(image_tokens))]
        if kinds != expected:
            raise ValueError(
                f"the text's placeholders ({kinds.count(False)} images, {kinds.count(True)} videos) are not the "
                f"conversation's ({expected.count(False)} images, {expected.count(True)} videos, in this order)"
            )
        # The placeholder is an added token, split off before the text around it is tokenized, so
        # one copy per image tokenizes its neighbours exactly as n copies do: expand the ids, not
        # the text (a 576-token image then costs the tokenizer one token, not 576).
        ids = self.tokenizer(text, add_special_tokens=True)["input_ids"]
        placeholders = {self.image_token_id} | ({self.video_token_id} if self.video_token else set())
        if sum(1 for token in ids if token in placeholders) == len(image_tokens):
            out: list[int] = []
            counts = iter(image_tokens)
            for token in ids:
                if token in placeholders:
                    out.extend([self.image_token_id] * next(counts))
                else:
                    out.append(token)
            return out
        # a tokenizer that does not keep the placeholder whole: expand the text, as the processors do
        parts = re.split(pattern, text)
        expanded = parts[0] + "".join(
            self.image_token * n + part for n, part in zip(image_tokens, parts[1:], strict=True)
        )
        return list(self.tokenizer(expanded, add_special_tokens=True)["input_ids"])

    def conversation_ids(self, chat: Chat, prompt: str) -> list[int]:
        """Token ids of the full chat-templated conversation ending in the generation prompt."""
        return self.tokenize(self.conversation_text(chat, prompt), chat.image_tokens, chat.videos)

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
        key = (chat.system_prompt, chat.pending_images, chat.image_tokens, chat.videos)
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
