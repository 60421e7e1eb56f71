"""Which fields of a chat body are honoured, refused by name, or ignored with a warning, and the
content parts a message may hold (``text``, ``image_url``, ``video_url``: :data:`Part`).

Three kinds, as vLLM's OpenAI server treats them (its request models ignore fields they do not
define and log them; issue 32 item 4):

- **Defined and honoured**: the fields :mod:`.protocol`'s models declare.
- **Defined elsewhere, not honoured here**: OpenAI's (``tools``, ``audio``, ...) and vLLM's
  extensions this server does not implement (``guided_json``, ``echo``, ...): a 400 ``invalid_parameter`` that
  names the field (:func:`check_unsupported`), so a user never silently gets something other than
  what was asked; a vLLM field set to what this server does anyway (``echo: false``,
  ``use_beam_search: false``, ...) is accepted. ``session_id`` is refused too: the session travels in a header.
- **Defined by nobody**: what wrappers add (LiteLLM's ``sagemaker_base_url``, Strands' ``format``
  inside ``image_url``): ignored, and each such name (never its value) logged once per process at
  WARNING (:class:`ChatInbound`).
"""

from __future__ import annotations

import logging
from typing import Annotated, ClassVar, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from ..errors import ErrorCode, ServiceError
from ..wire.inbound import ImageUuid, Inbound, check_text

__all__ = [
    "SAME_AS_OURS",
    "UNSUPPORTED_FIELDS",
    "ChatInbound",
    "ImagePart",
    "ImageUrl",
    "Part",
    "TextPart",
    "VideoPart",
    "VideoUrl",
    "check_unsupported",
    "ignored_names",
]

log = logging.getLogger(__name__)

_VLLM = "vLLM's {} is not supported by this server"

#: Request fields OpenAI or vLLM define that this server does not honour, each refused by name with
#: what to do instead (OpenAI: platform.openai.com/docs/api-reference/chat/create; vLLM:
#: docs.vllm.ai "OpenAI-Compatible Server", extra parameters of the chat API).
UNSUPPORTED_FIELDS: dict[str, str] = {
    "tools": "tool calling is not supported by this model server",
    "tool_choice": "tool calling is not supported by this model server",
    "functions": "function calling is not supported by this model server",
    "function_call": "function calling is not supported by this model server",
    "parallel_tool_calls": "tool calling is not supported by this model server",
    "audio": "audio output is not supported",
    "modalities": "only text output is supported; leave modalities out",
    "prediction": "predicted outputs are not supported",
    "reasoning_effort": "reasoning_effort is not supported by this model",
    "web_search_options": "web search is not supported",
    "store": "stored completions are not supported",
    "metadata": "stored completions (metadata) are not supported",
    "service_tier": "service tiers are not supported",
    "verbosity": "verbosity is not supported by this model",
    **{
        name: f"vLLM's older {name} is not supported; use structured_outputs (or response_format)"
        for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend")
    },
    "session_id": "unknown field; the session travels in the X-Amzn-SageMaker-Session-Id header (boto3: SessionId=)",
    **{
        name: _VLLM.format(name)
        for name in (
            "bad_words",
            "allowed_token_ids",
            "prompt_logprobs",
            "truncate_prompt_tokens",
            "length_penalty",
            "use_beam_search",
            "best_of",
            "echo",
            "add_generation_prompt",
            "continue_final_message",
            "add_special_tokens",
            "chat_template",
            "chat_template_kwargs",
            "logits_processors",
            "return_tokens_as_token_ids",
            "priority",
            "request_id",
            "kv_transfer_params",
            "vllm_xargs",
        )
    },
}

#: vLLM fields whose value is what this server does anyway: that value is accepted (and ignored).
SAME_AS_OURS: dict[str, object] = {
    "bad_words": [],
    "echo": False,
    "add_generation_prompt": True,
    "continue_final_message": False,
    "use_beam_search": False,
    "best_of": 1,
    "length_penalty": 1.0,
    "priority": 0,
}

_warned: set[str] = set()
_UNSET = object()


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


def check_unsupported(data: dict) -> None:
    """Refuse what a chat body asks that this server cannot honour, before its models validate it.

    Raises:
        ServiceError: invalid_parameter naming a field of :data:`UNSUPPORTED_FIELDS`, or a
            content part type other than ``text`` / ``image_url`` / ``video_url``; invalid_request naming
            ``messages[i].role`` for tool and function messages.
    """
    for name, why in UNSUPPORTED_FIELDS.items():
        value = data.get(name)
        if value is not None and value != SAME_AS_OURS.get(name, _UNSET):
            raise ServiceError(ErrorCode.INVALID_PARAMETER, f"{name}: {why}", param=name)
    messages = data.get("messages")
    if not isinstance(messages, list):
        return
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            continue
        role = msg.get("role")
        if role in ("tool", "function") or msg.get("tool_calls") or msg.get("function_call"):
            param = f"messages[{i}].role"
            message = "tool and function messages are not supported by this model server"
            raise ServiceError(ErrorCode.INVALID_REQUEST, f"{param}: {message}", param=param)
        content = msg.get("content")
        for j, part in enumerate(content if isinstance(content, list) else []):
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind not in ("text", "image_url", "video_url", "input_text", "input_image"):
                shown = kind if kind.isidentifier() and len(kind) <= 32 else "this type"
                raise ServiceError(
                    ErrorCode.INVALID_PARAMETER,
                    f"messages[{i}].content[{j}].type: {shown!r} parts are not supported; this model server "
                    "reads 'text', 'image_url' and 'video_url' parts (or 'input_text' and 'input_image')",
                    param=f"messages[{i}].content[{j}].type",
                )


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
        if self.image_url is None:
            return None
        if isinstance(self.image_url, str):
            return self.image_url, "image_url"
        return self.image_url.url, "image_url.url"

    @model_validator(mode="after")
    def _url_or_uuid(self) -> ImagePart:
        if self.image_url is None and self.uuid is None:
            raise PydanticCustomError("image_reference", "give image_url, or a uuid an earlier request sent")
        return self


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
        if self.video_url is None:
            return None
        if isinstance(self.video_url, str):
            return self.video_url, "video_url"
        return self.video_url.url, "video_url.url"

    @model_validator(mode="after")
    def _valid(self) -> VideoPart:
        if self.video_url is None and self.uuid is None:
            raise PydanticCustomError("video_reference", "give video_url, or a uuid an earlier request sent")
        if self.num_frames is not None and self.fps is not None:
            raise PydanticCustomError("video_sampling", "give num_frames or fps, not both")
        return self


Part = Annotated[TextPart | ImagePart | VideoPart, Field(discriminator="type")]
