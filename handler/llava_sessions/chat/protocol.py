"""The ecosystem's dialect on ``/invocations``: OpenAI chat-completions bodies and AWS's session bodies.

- **Chat completions**: any body with ``messages`` (as LMI, the TGI container and vLLM's SageMaker
  entrypoint accept it; docs/platform.md). The request is OpenAI's "Create chat
  completion" (platform.openai.com/docs/api-reference/chat/create), restricted to what a LLaVA model
  can honour: roles ``system`` (or ``developer``), ``user``, ``assistant``; ``content`` a string or a
  list of ``text`` and ``image_url`` parts (``https://``, ``s3://`` or ``data:image/...;base64,``;
  vLLM's per-part ``uuid`` names an image, and ``"image_url": null`` with a ``uuid`` refers to one an
  earlier request sent); vLLM's top-level ``cache_salt`` scopes what the request shares.
  Structured outputs: OpenAI's ``response_format`` (``json_object``, ``json_schema``) and vLLM's
  ``structured_outputs`` (``json``, ``regex``, ``choice``, ``json_object``) become the answer's
  grammar (:meth:`ChatCompletionRequest.grammar`). A field OpenAI or vLLM defines that we cannot
  honour (``tools``, audio parts, ...) is refused with a 400 that names it, never ignored; a field nobody
  defines (LiteLLM's ``sagemaker_base_url``, Strands' ``image_url.format``) is ignored with a warning,
  as vLLM does (:mod:`.fields`).
- **AWS's session bodies**: ``{"requestType": "NEW_SESSION"}`` and ``{"requestType": "CLOSE"}``
  (aws/model-hosting-container-standards' convention; extra fields refused, as there).

:func:`parse_chat_body` and :func:`parse_session_body` validate the dict the service decoded
(``llava_sessions.wire.inbound.load_body``);
:meth:`ChatCompletionRequest.conversation` maps the messages onto our conversation model (system
prompt, remembered turns with the images opening each user message, the last user message as the
question); :mod:`.command` makes the command the serving runs from it. No torch here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from ..errors import ErrorCode, ServiceError
from ..sampling.grammar import choice_grammar, json_grammar, regex_grammar
from ..wire.contract import NEW_SESSION_LITERAL
from ..wire.inbound import CacheSalt, Inbound, check_text, validation_error
from .fields import ChatInbound, ImagePart, Part, TextPart, VideoPart, check_unsupported

__all__ = [
    "ChatCompletionRequest",
    "ChatConversation",
    "ChatMessage",
    "ImagePart",
    "JsonSchemaFormat",
    "VideoPart",
    "ResponseFormat",
    "SessionControlRequest",
    "StructuredOutputs",
    "TextPart",
    "parse_chat_body",
    "parse_session_body",
]


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


class StreamOptions(ChatInbound):
    """``stream_options``: ``include_usage`` adds a last chunk with empty ``choices`` and the usage;
    with it, vLLM's ``continuous_usage_stats`` puts the usage so far on every chunk too."""

    _where: ClassVar[str] = "stream_options."

    include_usage: bool = False
    continuous_usage_stats: bool = False


class MmProcessorKwargs(ChatInbound):
    """vLLM's ``mm_processor_kwargs``, as far as it concerns a video: ``num_frames`` or ``fps``, the
    sampling of every ``video_url`` part that names none (other keys are ignored with a warning)."""

    _where: ClassVar[str] = "mm_processor_kwargs."

    num_frames: Annotated[int, Field(ge=1)] | None = None
    fps: Annotated[float, Field(gt=0.0, le=240.0)] | None = None

    @model_validator(mode="after")
    def _one_sampling(self) -> MmProcessorKwargs:
        if self.num_frames is not None and self.fps is not None:
            raise PydanticCustomError("video_sampling", "give num_frames or fps, not both")
        return self


class JsonSchemaFormat(ChatInbound):
    """``response_format.json_schema``: OpenAI's ``name``, ``description``, ``schema`` and ``strict``
    (the answer always follows ``schema``: ``strict`` changes nothing here)."""

    _where: ClassVar[str] = "response_format.json_schema."

    name: Annotated[str, Field(max_length=64)] | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(ChatInbound):
    """OpenAI's ``response_format``: ``text`` (free), ``json_object`` (any JSON object) or
    ``json_schema`` (JSON matching ``json_schema.schema``)."""

    _where: ClassVar[str] = "response_format."

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.json_schema is None):
            raise PydanticCustomError("json_schema_required", "type json_schema needs json_schema.schema")
        return self


class StructuredOutputs(ChatInbound):
    """vLLM's ``structured_outputs``: exactly one of ``json`` (a JSON schema, or its text),
    ``regex``, ``choice`` or ``json_object``; its ``grammar`` and ``structural_tag`` are refused
    by name."""

    _where: ClassVar[str] = "structured_outputs."

    json_schema: dict[str, Any] | str | None = Field(None, alias="json")
    regex: Annotated[str, Field(min_length=1, max_length=4096)] | None = None
    choice: Annotated[list[Annotated[str, Field(min_length=1, max_length=1024)]], Field(max_length=256)] | None = None
    json_object: bool | None = None
    grammar: str | None = None
    structural_tag: Any = None

    @model_validator(mode="after")
    def _one_kind(self) -> StructuredOutputs:
        for name in ("grammar", "structural_tag"):
            if getattr(self, name) is not None:
                raise PydanticCustomError("unsupported", f"{name} is not supported; use json, regex or choice")
        given = [self.json_schema is not None, self.regex is not None, self.choice is not None, bool(self.json_object)]
        if sum(given) != 1:
            raise PydanticCustomError("one_kind", "give exactly one of json, regex, choice, json_object")
        return self


class ChatCompletionRequest(ChatInbound):
    """OpenAI's chat-completions request, as far as a LLaVA model can honour it (module docstring).

    Sampling: ``temperature`` defaults to OpenAI's 1.0 (sampled answers); 0 is greedy. ``top_k``
    and ``repetition_penalty`` are accepted as vLLM and TGI accept them, and vLLM's ``min_p``,
    ``min_tokens``, ``ignore_eos``, ``stop_token_ids``, ``include_stop_str_in_output`` and ``skip_special_tokens`` as vLLM
    defines them; ``logit_bias`` as OpenAI's (token id as a string → -100..100). ``max_completion_tokens``
    (or the older ``max_tokens``) bounds the answer, up to the room the context leaves; unset, the
    answer may run until the context ends, as in vLLM and OpenAI.
    """

    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=512)]
    model: Annotated[str, Field(max_length=256)] | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    stop: (
        Annotated[str, Field(min_length=1, max_length=64)]
        | Annotated[list[Annotated[str, Field(min_length=1, max_length=64)]], Field(max_length=4)]
        | None
    ) = None
    seed: Annotated[int, Field(ge=0, le=2**63 - 1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    n: Annotated[int, Field(ge=1)] = 1
    session_choice: Annotated[int, Field(ge=0)] = 0  # ours: the choice (below n) a session keeps as its turn
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    min_tokens: Annotated[int, Field(ge=0)] = 0
    ignore_eos: bool = False
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=64)] | None = None
    logit_bias: Annotated[dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]], Field(max_length=300)] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # vLLM's; its fast detokenizer (llava-hf's tokenizers are fast ones) writes the same text either way
    spaces_between_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    mm_processor_kwargs: MmProcessorKwargs | None = None
    user: Annotated[str, Field(max_length=256)] | None = None
    cache_salt: CacheSalt | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None

    @property
    def stop_list(self) -> tuple[str, ...]:
        """``stop`` as a tuple of strings."""
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def token_biases(self) -> tuple[tuple[int, float], ...]:
        """``logit_bias`` as ``(token id, bias)`` pairs.

        Raises:
            ServiceError: invalid_parameter when a key is not a token id (a decimal integer).
        """
        pairs = []
        for key, bias in (self.logit_bias or {}).items():
            if not (key.isascii() and key.isdecimal() and len(key) <= 9):
                raise ServiceError(
                    ErrorCode.INVALID_PARAMETER, "logit_bias: keys must be token ids (decimal)", param="logit_bias"
                )
            pairs.append((int(key), bias))
        return tuple(pairs)

    def grammar(self) -> str | None:
        """The structured output asked (``response_format`` or ``structured_outputs``) as a grammar
        (:mod:`~llava_sessions.sampling.grammar`), or None for free text.

        Raises:
            ServiceError: invalid_parameter: both fields ask for one, or the schema or pattern is not
                one the grammar library accepts (its reason, naming the field).
        """
        fmt, so = self.response_format, self.structured_outputs
        if so is not None and fmt is not None and fmt.type != "text":
            message = "give response_format or structured_outputs, not both"
            raise ServiceError(ErrorCode.INVALID_PARAMETER, message, param="structured_outputs")
        if so is not None:
            if so.regex is not None:
                return regex_grammar(so.regex, "structured_outputs.regex")
            if so.choice is not None:
                return choice_grammar(so.choice, "structured_outputs.choice")
            schema = so.json_schema
            if isinstance(schema, str):
                schema = _schema_text(schema, "structured_outputs.json")
            return json_grammar(schema, "structured_outputs.json")
        if fmt is None or fmt.type == "text":
            return None
        if fmt.json_schema is None or fmt.type == "json_object":  # json_schema's schema: checked by the model
            return json_grammar(None, "response_format")
        return json_grammar(fmt.json_schema.json_schema, "response_format.json_schema.schema")

    @property
    def answer_limit(self) -> int | None:
        """``max_completion_tokens``, else ``max_tokens``, else None (the server's default)."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def conversation(self) -> ChatConversation:
        """Map the messages onto a conversation: leading system (or developer) messages as the system
        prompt, then user and assistant turns alternating, ending with the user's question.
        Consecutive messages of one role are one message: their texts joined with newlines, their
        images in order (the llava-hf templates place a message's images before its text).

        Raises:
            ServiceError: invalid_request naming ``messages[i]`` when the order is not that (a system
                message after the first turn, an answer last), or an assistant or system message holds
                an image.
        """
        runs: list[tuple[str, list[int]]] = []  # (role, message indexes), consecutive roles merged
        for i, msg in enumerate(self.messages):
            role: str = "system" if msg.role == "developer" else msg.role
            if runs and runs[-1][0] == role:
                runs[-1][1].append(i)
            else:
                runs.append((role, [i]))
        system: str | None = None
        if runs[0][0] == "system":
            system = self._joined(runs.pop(0)[1], "a system message holds text only")
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
                self._joined(indexes, "an assistant message holds text only")
        if not runs or runs[-1][0] != "user":
            raise _bad("messages", "the last message must be the user's (the question to answer)")
        turns = [_Turn(self._joined(u), self._joined(a), self._images(u)) for (_, u), (_, a) in _pairs(runs[:-1])]
        question = runs[-1][1]
        return ChatConversation(system, tuple(turns), self._joined(question), self._images(question))

    def _joined(self, indexes: list[int], no_images: str | None = None) -> str:
        """The text of the messages at ``indexes``, joined with newlines; ``no_images``: refuse an image."""
        for i in indexes:
            if no_images and self.messages[i].image_parts():
                raise _bad(f"messages[{i}].content", no_images)
        return "\n".join(self.messages[i].text() for i in indexes)

    def _images(self, indexes: list[int]) -> int:
        return sum(len(self.messages[i].image_parts()) for i in indexes)


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


class SessionControlRequest(Inbound):
    """AWS's session bodies: ``{"requestType": "NEW_SESSION"}`` (with ``SessionId=NEW_SESSION``)
    opens a session with no image yet; ``{"requestType": "CLOSE"}`` closes the header's session."""

    requestType: str  # noqa: N815 - AWS's field name

    @field_validator("requestType")
    @classmethod
    def _known(cls, value: str) -> str:
        if value not in (NEW_SESSION_LITERAL, "CLOSE"):
            raise PydanticCustomError("request_type", "must be 'NEW_SESSION' or 'CLOSE'")
        return value


#: What to say of a bad value where OpenAI's range differs from our native parameters'.
_HINTS = {
    "temperature": "must be a number between 0 and 2",
    "max_tokens": "must be an integer >= 1",
    "max_completion_tokens": "must be an integer >= 1",
    "top_logprobs": "must be an integer between 0 and 20",
    "logprobs": "must be true or false",
    "n": "must be an integer >= 1",
}


def _bad(param: str, message: str) -> ServiceError:
    return ServiceError(ErrorCode.INVALID_REQUEST, f"{param}: {message}", param=param)


def _schema_text(text: str, param: str) -> dict[str, Any]:
    """A JSON schema given as its text (vLLM's ``structured_outputs.json`` may be a string).

    Raises:
        ServiceError: invalid_parameter naming ``param``: not a JSON object.
    """
    try:
        schema = json.loads(text)
    except ValueError:
        schema = None
    if not isinstance(schema, dict):
        raise ServiceError(ErrorCode.INVALID_PARAMETER, f"{param}: must be a JSON schema object", param=param)
    return schema


def parse_chat_body(data: dict, *, max_prompt_chars: int) -> ChatCompletionRequest:
    """Validate a decoded chat-completions body. ``max_tokens`` / ``max_completion_tokens`` are
    bounded only by the room the context leaves (checked at admission), as vLLM and OpenAI bound them.

    Args:
        data: the JSON object (it has ``messages``).
        max_prompt_chars: longest message text, characters.

    Raises:
        ServiceError: invalid_request (wrong shape, unknown field, message order) or
            invalid_parameter (a value out of range, a field or part type we cannot honour), each
            naming its field in ``message`` and ``param``.
    """
    check_unsupported(data)
    try:
        request = ChatCompletionRequest.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc, strip_tag=False, hints=_HINTS) from None
    if request.top_logprobs and not request.logprobs:
        raise ServiceError(
            ErrorCode.INVALID_PARAMETER, "top_logprobs: needs logprobs set to true", param="top_logprobs"
        )
    for i, msg in enumerate(request.messages):
        if len(msg.text()) > max_prompt_chars:
            raise ServiceError(
                ErrorCode.INVALID_PARAMETER,
                f"messages[{i}].content: longer than {max_prompt_chars} characters; shorten it",
                param=f"messages[{i}].content",
            )
    return request


_SESSION_BODY_HINTS = {"requestType": "must be 'NEW_SESSION' or 'CLOSE'"}


def parse_session_body(data: dict) -> SessionControlRequest:
    """Validate a decoded AWS session body (it has ``requestType`` and no ``messages``).

    Raises:
        ServiceError: invalid_request (an extra field) or invalid_parameter (an unknown ``requestType``).
    """
    try:
        return SessionControlRequest.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc, strip_tag=False, hints=_SESSION_BODY_HINTS) from None
