"""A chat body's messages: the content parts a message may hold, the message, and the conversation
a messages list makes (a system prompt, remembered turns, the question).

- **Content parts** (:data:`Part`): OpenAI's ``text`` and ``image_url`` parts, and ``video_url`` parts;
  vLLM's ``uuid`` names a media part, SGLang's ``num_frames`` / ``fps`` sample a video.
- **Messages** (:class:`ChatMessage`): roles ``system`` (or ``developer``), ``user``, ``assistant``.
- **The conversation** (:func:`conversation_of`): leading system messages, then user and assistant
  turns alternating, ending with the user's question; what the engine's conversation model holds.

Every chat object ignores a field it does not define, as vLLM's request models do, and logs its name
(never its value) once per process at WARNING (:class:`ChatInbound`). What a body may not ask at all
is :mod:`.protocol`'s to refuse. No torch here.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

from pydantic import ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from ..errors import ErrorCode, ServiceError
from ..wire.inbound import ImageUuid, Inbound, check_text

__all__ = [
    "ChatConversation",
    "ChatInbound",
    "ChatMessage",
    "ImagePart",
    "ImageUrl",
    "Part",
    "TextPart",
    "VideoPart",
    "VideoUrl",
    "conversation_of",
    "ignored_names",
]

log = logging.getLogger(__name__)

_warned: set[str] = set()


def ignored_names() -> frozenset[str]:
    """The field names ignored so far in this process (each logged once), as ``where.name``."""
    return frozenset(_warned)


class ChatInbound(Inbound):
    """Base of the chat dialect's request models: a field the model does not define is accepted and
    ignored (it reaches nothing: only declared fields are read), and its name logged once at WARNING.
    ``_where``: how the field's place is named in that log line (``image_url.``, ``messages[].``)."""

    model_config = ConfigDict(extra="allow")
    _where: ClassVar[str] = ""

    @model_validator(mode="after")
    def _warn_ignored(self) -> ChatInbound:
        for name in self.model_extra or {}:
            where = f"{self._where}{name}" if name.isidentifier() and len(name) <= 64 else f"{self._where}<field>"
            if where not in _warned:
                _warned.add(where)
                log.warning("ignored request field: %s", where)
        return self


# ============================================================================================
# Content parts (OpenAI's shapes; vLLM's ``uuid`` on a media part; SGLang's ``num_frames`` / ``fps``)
# ============================================================================================


class TextPart(ChatInbound):
    """A ``{"type": "text", "text": ...}`` content part (vLLM also takes ``input_text``, and a part
    with ``text`` alone)."""

    _where: ClassVar[str] = "messages[].content[]."

    type: Literal["text", "input_text"]
    text: str

    @field_validator("text")
    @classmethod
    def _valid(cls, value: str) -> str:
        return check_text(value)


class ImageUrl(ChatInbound):
    """``image_url``'s object: ``url`` (https, s3 or a base64 data URI) and OpenAI's ``detail`` hint
    (accepted; the model sees every image at its own input resolution)."""

    _where: ClassVar[str] = "messages[].content[].image_url."

    url: Annotated[str, Field(min_length=1)]
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(ChatInbound):
    """A ``{"type": "image_url", "image_url": {"url": ...}}`` content part, in vLLM's shape with an
    optional ``uuid`` (the client's name for the image): ``{"type": "image_url", "image_url": null,
    "uuid": "u1"}`` names an image an earlier request of the same salt sent with that uuid, without
    its bytes."""

    _where: ClassVar[str] = "messages[].content[]."

    type: Literal["image_url", "input_image"]
    image_url: ImageUrl | Annotated[str, Field(min_length=1)] | None
    uuid: ImageUuid | None = None

    @property
    def url(self) -> tuple[str, str] | None:
        """``(the URL, where it sits in the part)``: ``image_url.url``, or ``image_url`` itself when
        given as a bare string (as vLLM takes it, and in ``input_image`` parts); None: by uuid alone."""
        return _url_of(self.image_url, "image_url")

    @model_validator(mode="after")
    def _url_or_uuid(self) -> ImagePart:
        if self.image_url is None and self.uuid is None:
            raise PydanticCustomError("image_reference", "give image_url, or a uuid an earlier request sent")
        return self


def _url_of(value: ImageUrl | VideoUrl | str | None, key: str) -> tuple[str, str] | None:
    """A media part's ``(URL, where it sits in the part)`` from its ``key`` field's ``value``: the
    object's ``url``, or the field itself when given as a bare string; None when the part has none."""
    if value is None:
        return None
    if isinstance(value, str):
        return value, key
    return value.url, f"{key}.url"


class VideoUrl(ChatInbound):
    """``video_url``'s object: ``url`` (https, s3 or a ``data:video/...;base64,`` URI)."""

    _where: ClassVar[str] = "messages[].content[].video_url."

    url: Annotated[str, Field(min_length=1)]


class VideoPart(ChatInbound):
    """A ``{"type": "video_url", "video_url": {"url": ...}}`` content part (vLLM's shape, with its
    optional ``uuid``), and how its frames are sampled, on the part as SGLang takes them:
    ``num_frames`` or ``fps``, never both (neither: the server's ``video_num_frames``). A model
    without a video path answers it with 400 ``video_unsupported``."""

    _where: ClassVar[str] = "messages[].content[]."

    type: Literal["video_url"]
    video_url: VideoUrl | Annotated[str, Field(min_length=1)] | None
    uuid: ImageUuid | None = None
    num_frames: Annotated[int, Field(ge=1)] | None = None
    fps: Annotated[float, Field(gt=0.0, le=240.0)] | None = None

    @property
    def url(self) -> tuple[str, str] | None:
        """``(the URL, where it sits in the part)``, as :attr:`ImagePart.url`; None: by uuid alone."""
        return _url_of(self.video_url, "video_url")

    @model_validator(mode="after")
    def _valid(self) -> VideoPart:
        if self.video_url is None and self.uuid is None:
            raise PydanticCustomError("video_reference", "give video_url, or a uuid an earlier request sent")
        if self.num_frames is not None and self.fps is not None:
            raise PydanticCustomError("video_sampling", "give num_frames or fps, not both")
        return self


Part = Annotated[TextPart | ImagePart | VideoPart, Field(discriminator="type")]


class ChatMessage(ChatInbound):
    """One message: ``role`` and ``content`` (a string, or a list of text and image parts; images in
    user messages only; an assistant's may be null, as OpenAI's replies with tool calls have it). A
    part without ``type`` is typed by its one key (``image_url`` or ``text``), as vLLM does. ``name``
    is accepted (it does not reach the chat template)."""

    _where: ClassVar[str] = "messages[]."

    role: Literal["system", "developer", "user", "assistant"]
    content: str | Annotated[list[Part], Field(min_length=1, max_length=64)] | None
    name: Annotated[str, Field(max_length=64)] | None = None
    # what a reply's message carries when a client appends it to the conversation as it came
    # (OpenAI's ChatCompletionMessage): accepted when empty; tool calls are refused before this
    refusal: None = None
    tool_calls: Annotated[list[Any], Field(max_length=0)] | None = None
    function_call: None = None
    audio: None = None
    annotations: list[Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _type_bare_parts(cls, data: Any) -> Any:
        content = data.get("content") if isinstance(data, dict) else None
        if not isinstance(content, list):
            return data
        typed = []
        for part in content:
            keys = part.keys() & {"image_url", "video_url", "text"} if isinstance(part, dict) else set()
            if isinstance(part, dict) and "type" not in part and len(keys) == 1:
                part = {"type": next(iter(keys)) if keys != {"text"} else "text", **part}
            typed.append(part)
        return {**data, "content": typed}

    @field_validator("content")
    @classmethod
    def _valid(cls, value: Any, info: ValidationInfo) -> Any:
        if value is None and info.data.get("role") != "assistant":
            raise PydanticCustomError("content_required", "required in system and user messages")
        return check_text(value) if isinstance(value, str) else value

    def text(self) -> str:
        """The message's text: the string, or its text parts joined with newlines (vLLM's joining)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "\n".join(p.text for p in self.content if isinstance(p, TextPart))

    def image_parts(self) -> list[ImagePart | VideoPart]:
        """The message's media parts in the order the chat template renders them: its images, then its
        videos, each in their own order (llava-onevision's template renders a message so)."""
        if self.content is None or isinstance(self.content, str):
            return []
        images: list[ImagePart | VideoPart] = [p for p in self.content if isinstance(p, ImagePart)]
        return images + [p for p in self.content if isinstance(p, VideoPart)]


def _pairs(runs: list[tuple[str, list[int]]]) -> list[tuple[tuple[str, list[int]], tuple[str, list[int]]]]:
    """``[a, b, c, d]`` → ``[(a, b), (c, d)]``: user and assistant runs as turns."""
    return [(runs[k], runs[k + 1]) for k in range(0, len(runs) - 1, 2)]


@dataclass(frozen=True)
class _Turn:
    prompt: str
    answer: str
    images: int


@dataclass(frozen=True)
class ChatConversation:
    """A messages list as our conversation: ``system_prompt``, remembered ``turns`` (each with the
    number of images opening its user message), the ``question`` and the images opening it."""

    system_prompt: str | None
    turns: tuple[_Turn, ...]
    question: str
    question_images: int


def conversation_of(messages: Sequence[ChatMessage]) -> ChatConversation:
    """Map a chat body's ``messages`` onto our conversation: leading system (or developer) messages as the system
    prompt, then user and assistant turns alternating, ending with the user's question.
    Consecutive messages of one role are one message: their texts joined with newlines, their
    images in order (the llava-hf templates place a message's images before its text).

    Raises:
        ServiceError: invalid_request naming ``messages[i]`` when the order is not that (a system
            message after the first turn, an answer last), or an assistant or system message holds
            an image.
    """
    runs: list[tuple[str, list[int]]] = []  # (role, message indexes), consecutive roles merged
    for i, msg in enumerate(messages):
        role: str = "system" if msg.role == "developer" else msg.role
        if runs and runs[-1][0] == role:
            runs[-1][1].append(i)
        else:
            runs.append((role, [i]))
    system: str | None = None
    if runs[0][0] == "system":
        system = _joined(messages, runs.pop(0)[1], "a system message holds text only")
    for offset, (role, indexes) in enumerate(runs):
        want = "user" if offset % 2 == 0 else "assistant"
        if role == "system":
            raise _bad(
                f"messages[{indexes[0]}].role",
                "system and developer messages may only lead the conversation (the chat template has "
                "no place for one later); put its text in a user message",
            )
        if role != want:
            raise _bad(
                f"messages[{indexes[0]}].role",
                f"expected {'a user' if want == 'user' else 'an assistant'} message here: system messages "
                "may lead, then user and assistant messages alternate, ending with the user's",
            )
        if role == "assistant":
            _joined(messages, indexes, "an assistant message holds text only")
    if not runs or runs[-1][0] != "user":
        raise _bad("messages", "the last message must be the user's (the question to answer)")
    turns = [
        _Turn(_joined(messages, u), _joined(messages, a), _images(messages, u)) for (_, u), (_, a) in _pairs(runs[:-1])
    ]
    question = runs[-1][1]
    return ChatConversation(system, tuple(turns), _joined(messages, question), _images(messages, question))


def _joined(messages: Sequence[ChatMessage], indexes: list[int], no_images: str | None = None) -> str:
    """The text of the messages at ``indexes``, joined with newlines; ``no_images``: refuse an image."""
    for i in indexes:
        if no_images and messages[i].image_parts():
            raise _bad(f"messages[{i}].content", no_images)
    return "\n".join(messages[i].text() for i in indexes)


def _images(messages: Sequence[ChatMessage], indexes: list[int]) -> int:
    return sum(len(messages[i].image_parts()) for i in indexes)


def _bad(param: str, message: str) -> ServiceError:
    return ServiceError(ErrorCode.INVALID_REQUEST, f"{param}: {message}", param=param)
