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
  honour (``tools``, audio parts, ...) is refused with a 400 that names it, never ignored
  (:data:`UNSUPPORTED_FIELDS`, :func:`check_unsupported`; a vLLM field set to what this server does
  anyway, ``echo: false``, is accepted: :data:`SAME_AS_OURS`); a field nobody defines (LiteLLM's
  ``sagemaker_base_url``, Strands' ``image_url.format``) is ignored with a warning, as vLLM does
  (:class:`~.messages.ChatInbound`).
- **AWS's session bodies**: ``{"requestType": "NEW_SESSION"}`` and ``{"requestType": "CLOSE"}``
  (aws/model-hosting-container-standards' convention; extra fields refused, as there).

:func:`parse_chat_body` and :func:`parse_session_body` validate the dict the service decoded
(``llava_sessions.wire.inbound.load_body``);
:meth:`ChatCompletionRequest.conversation` maps the messages onto our conversation model
(:mod:`.messages`: system prompt, remembered turns with the images opening each user message, the last
user message as the question); :mod:`.command` makes the command the serving runs from it. No torch here.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from ..errors import ErrorCode, ServiceError
from ..sampling.grammar import choice_grammar, json_grammar, regex_grammar
from ..wire.contract import NEW_SESSION_LITERAL
from ..wire.inbound import CacheSalt, Inbound, validation_error
from .messages import ChatConversation, ChatInbound, ChatMessage, ImagePart, TextPart, VideoPart, conversation_of

__all__ = [
    "SAME_AS_OURS",
    "UNSUPPORTED_FIELDS",
    "ChatCompletionRequest",
    "ChatConversation",
    "ChatMessage",
    "ImagePart",
    "JsonSchemaFormat",
    "ResponseFormat",
    "SessionControlRequest",
    "StructuredOutputs",
    "TextPart",
    "VideoPart",
    "check_unsupported",
    "parse_chat_body",
    "parse_session_body",
]


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
    "add_special_tokens": True,  # the prompt starts with the tokenizer's BOS, as generate()'s does
}

_UNSET = object()


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
        """The messages as our conversation (:func:`~.messages.conversation_of`).

        Raises:
            ServiceError: invalid_request naming ``messages[i]`` (see :func:`~.messages.conversation_of`).
        """
        return conversation_of(self.messages)


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
