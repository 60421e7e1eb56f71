"""The native dialect's requests: pydantic models of its JSON bodies over ``POST /invocations``, and
the commands they become (:class:`OpenCommand`, :class:`GenerateCommand`, :class:`AddImageCommand`,
:class:`ResetCommand`, :class:`CloseCommand`; a command remembers whether it came in the AWS
sample's shape, and only the encoders look at that).

Requests are a union discriminated on ``"type"``:

- ``open_session``  ``{"type", "image": {"url" | "s3_uri" | "base64"}, "system_prompt"?}``, or with
  ``"video": {"url" | "s3_uri" | "base64", "num_frames"? | "fps"?}`` in place of ``image``
- ``add_image``     ``{"type", "image"}``; ``add_video`` ``{"type", "video"}``
- ``generate``      ``{"type", "prompt", "parameters"?, "stream"?, "remember"?}``
- ``reset``         ``{"type"}``
- ``close_session`` ``{"type", "session_id"?}``
- the AWS TorchServe LLaVA sample's requests, accepted unchanged:
  ``start_session`` ``{"type", "path", "session_id"?}`` and
  ``send_text_prompt`` ``{"type", "prompt_text", "session_id"?}``
  (sample: aws-samples/sagemaker-genai-hosting-examples, LLava/torchserve; its client sends
  ``session_id`` in the body, which is accepted and ignored: the session header is authoritative).

A body with ``messages`` or ``requestType`` is the chat dialect's (``llava_sessions.chat``): the
service decides the dialect once, before either validates.

:func:`parse_request` turns a body (bytes, str or the dict TorchServe already decoded) into one
of these models or raises :class:`~llava_sessions.errors.ServiceError`. Inbound models forbid
unknown fields; error messages name the field and never echo prompts or image bytes.

The replies' models (streamed lines in the SageMaker LMI / TGI JSON-lines format included) live in
:mod:`.responses`, the SageMaker session headers in ``llava_sessions.wire.contract``, image
sources in ``llava_sessions.wire.inbound``.
No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal, Union, get_args

from pydantic import (
    Field,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from ..conversation import Turn
from ..errors import ErrorCode, ServiceError
from ..results import ContextPolicy
from ..sampling.params import SAMPLING_BOUNDS, SamplingBound, SamplingParams
from ..wire.inbound import (
    S3_URI_RE,
    SAFE_KEY_RE,
    CacheSalt,
    ImageSource,
    Inbound,
    VideoSource,
    check_text,
    invalid,
    load_body,
    validation_error,
)

__all__ = [
    "REQUEST_TYPES",
    "AddImageCommand",
    "CloseCommand",
    "Command",
    "GenerateCommand",
    "OpenCommand",
    "ResetCommand",
    "SAMPLING_BOUNDS",
    "AddImageRequest",
    "AddVideoRequest",
    "CloseSessionRequest",
    "GenerateParameters",
    "GenerateRequest",
    "HistoryTurn",
    "ImageSource",
    "OpenSessionRequest",
    "Request",
    "ResetRequest",
    "SamplingBound",
    "VideoSource",
    "SendTextPromptRequest",
    "StartSessionRequest",
    "parse_request",
    "validate_request",
]


# ============================================================================================
# Requests
# ============================================================================================


class GenerateParameters(Inbound):
    """Sampling parameters of one generation; every field is optional.

    ``None`` means "the server default". ``max_new_tokens`` is also capped by the server
    (``Settings.max_new_tokens_cap``) in :func:`parse_request`.
    """

    max_new_tokens: Annotated[int, SAMPLING_BOUNDS["max_new_tokens"].field()] | None = None
    temperature: Annotated[float, SAMPLING_BOUNDS["temperature"].field()] | None = None
    top_p: Annotated[float, SAMPLING_BOUNDS["top_p"].field()] | None = None
    top_k: Annotated[int, SAMPLING_BOUNDS["top_k"].field()] | None = None  # 0 = off
    repetition_penalty: Annotated[float, SAMPLING_BOUNDS["repetition_penalty"].field()] | None = None
    do_sample: bool = False
    seed: Annotated[int, SAMPLING_BOUNDS["seed"].field()] | None = None
    stop: Annotated[list[Annotated[str, Field(min_length=1, max_length=64)]], Field(max_length=4)] = Field(
        default_factory=list
    )
    details: bool = False  # include the per-token list with log-probs
    n: Annotated[int, SAMPLING_BOUNDS["n"].field()] = 1  # answers sampled from the one prompt
    session_choice: Annotated[int, SAMPLING_BOUNDS["session_choice"].field()] = 0  # the one the session keeps

    @field_validator("stop")
    @classmethod
    def _stop_text(cls, value: list[str]) -> list[str]:
        for item in value:
            check_text(item)
        return value


class _RequestBase(Inbound):
    #: True for the AWS sample's request types; the service answers those in the sample's shape.
    legacy: ClassVar[bool] = False

    def canonical(
        self,
    ) -> OpenSessionRequest | GenerateRequest | AddImageRequest | AddVideoRequest | ResetRequest | CloseSessionRequest:
        """Return the equivalent canonical request (``self`` for canonical types)."""
        return self  # type: ignore[return-value]


class HistoryTurn(Inbound):
    """One past exchange handed to ``open_session`` to restore a conversation exactly; ``images``:
    the images added (``add_image``) before this turn's question, in order, and ``videos`` the videos
    (``add_video``), which the chat template renders after them (the session's first image or video
    always opens the first turn)."""

    prompt: Annotated[str, Field(min_length=1)]
    answer: str
    images: Annotated[list[ImageSource], Field(max_length=16)] = Field(default_factory=list)
    videos: Annotated[list[VideoSource], Field(max_length=4)] = Field(default_factory=list)

    @field_validator("prompt", "answer")
    @classmethod
    def _turn_text(cls, value: str) -> str:
        return check_text(value)


class OpenSessionRequest(_RequestBase):
    """Open a session on an image, or on a video (``video`` in place of ``image``). Reply:
    :class:`OpenSessionResponse`.

    ``history`` (optional) restores a conversation: the turns are remembered as if they had been
    asked in this session, and prefilled with the image, so the next question continues it
    exactly (clients use it to recover a session the server lost).
    """

    type: Literal["open_session"]
    image: ImageSource | None = None
    video: VideoSource | None = None
    system_prompt: str | None = None
    history: Annotated[list[HistoryTurn], Field(max_length=256)] = Field(default_factory=list)
    cache_salt: CacheSalt | None = None

    @field_validator("system_prompt")
    @classmethod
    def _system_text(cls, value: str | None) -> str | None:
        return value if value is None else check_text(value)

    @model_validator(mode="after")
    def _one_medium(self) -> OpenSessionRequest:
        if (self.image is None) == (self.video is None):
            raise PydanticCustomError("open_medium", "give exactly one of image, video")
        return self

    @property
    def medium(self) -> ImageSource:
        """The opening image or video (a :class:`VideoSource` is an image source with its sampling)."""
        return self.video if self.video is not None else self.image  # type: ignore[return-value]


class GenerateRequest(_RequestBase):
    """Ask one question in the session. Reply: :class:`GenerateResponse` or JSON lines of :class:`StreamLine`.

    ``remember=False`` answers without appending the turn to the conversation. ``context_policy``
    (default: the server's setting) says what happens when the turn does not fit the context:
    ``truncate`` drops the oldest remembered turns (then clips an unset ``max_new_tokens``),
    ``error`` answers 422 ``context_length_exceeded``.
    """

    type: Literal["generate"]
    prompt: Annotated[str, Field(min_length=1)]
    parameters: GenerateParameters = Field(default_factory=GenerateParameters)
    stream: bool = False
    remember: bool = True
    context_policy: Literal["truncate", "error"] | None = None

    @field_validator("parameters", mode="before")
    @classmethod
    def _null_parameters(cls, value: Any) -> Any:
        return {} if value is None else value  # "parameters": null means the defaults

    @field_validator("prompt")
    @classmethod
    def _prompt_text(cls, value: str) -> str:
        if not value.strip():
            raise PydanticCustomError("blank", "must not be blank")
        return check_text(value)


class AddImageRequest(_RequestBase):
    """Append an image to the session's conversation (the header names the session): it opens the
    next question, which may refer to every image of the session. Reply: :class:`AddImageResponse`.
    ``image`` is given as for ``open_session`` (base64, URL or S3)."""

    type: Literal["add_image"]
    image: ImageSource


class AddVideoRequest(_RequestBase):
    """Append a video to the session's conversation, as ``add_image`` does an image (on a model
    with a video path). Reply: :class:`AddImageResponse`."""

    type: Literal["add_video"]
    video: VideoSource


class ResetRequest(_RequestBase):
    """Forget the conversation, keep the images. Reply: :class:`ResetResponse`."""

    type: Literal["reset"]


class CloseSessionRequest(_RequestBase):
    """Close the session. Reply: :class:`CloseResponse`.

    ``session_id`` is accepted for the AWS sample's client (which sends it) and otherwise
    ignored: the ``X-Amzn-SageMaker-Session-Id`` header names the session.
    """

    type: Literal["close_session"]
    session_id: str | None = None


class StartSessionRequest(_RequestBase):
    """AWS sample alias of ``open_session``: ``path`` is an image URL or ``s3://`` URI.

    Reply: :class:`StartSessionResponse`. ``session_id`` (sent as null by the sample) is ignored.
    """

    legacy: ClassVar[bool] = True
    type: Literal["start_session"]
    path: Annotated[str, Field(min_length=1, max_length=8192)]
    session_id: str | None = None

    @field_validator("path")
    @classmethod
    def _path_shape(cls, value: str) -> str:
        if value.startswith("s3://") and not S3_URI_RE.match(value):
            raise PydanticCustomError("s3_uri_format", "must be an image URL or look like s3://bucket/key")
        return value

    def canonical(self) -> OpenSessionRequest:
        """Return the equivalent ``open_session`` request (``s3://`` paths become ``s3_uri``)."""
        if self.path.startswith("s3://"):
            image = ImageSource(s3_uri=self.path)
        else:
            image = ImageSource(url=self.path)
        return OpenSessionRequest(type="open_session", image=image)


class SendTextPromptRequest(_RequestBase):
    """AWS sample alias of ``generate`` (non-streaming, default parameters).

    Reply: :class:`SendTextPromptResponse`. ``session_id`` (sent by the sample) is ignored.
    """

    legacy: ClassVar[bool] = True
    type: Literal["send_text_prompt"]
    prompt_text: Annotated[str, Field(min_length=1)]
    session_id: str | None = None

    @field_validator("prompt_text")
    @classmethod
    def _prompt_text(cls, value: str) -> str:
        if not value.strip():
            raise PydanticCustomError("blank", "must not be blank")
        return check_text(value)

    def canonical(self) -> GenerateRequest:
        """Return the equivalent ``generate`` request."""
        return GenerateRequest(type="generate", prompt=self.prompt_text)


NativeRequest = (
    OpenSessionRequest
    | GenerateRequest
    | AddImageRequest
    | AddVideoRequest
    | ResetRequest
    | CloseSessionRequest
    | StartSessionRequest
    | SendTextPromptRequest
)
"""Any inbound request of the native dialect, canonical types first."""

Request = Annotated[NativeRequest, Field(discriminator="type")]
"""Any inbound request, told apart by ``"type"``; ``request.canonical()`` maps the AWS sample aliases
to canonical types."""

#: The valid values of ``"type"``, canonical first.
REQUEST_TYPES: tuple[str, ...] = tuple(
    get_args(model.model_fields["type"].annotation)[0] for model in get_args(NativeRequest)
)

_REQUEST_ADAPTER: TypeAdapter[Any] = TypeAdapter(Request)


def parse_request(
    body: bytes | bytearray | str | dict,
    *,
    max_body_bytes: int,
    max_prompt_chars: int,
    max_new_tokens_cap: int,
) -> NativeRequest:
    """Decode and validate one native request body (:func:`~llava_sessions.wire.inbound.load_body`,
    then :func:`validate_request`).

    Args:
        body: the raw body (bytes / bytearray / str), or the dict TorchServe already decoded
            from an ``application/json`` body.
        max_body_bytes: largest body in bytes (a dict is measured as compact UTF-8 JSON).
        max_prompt_chars: longest ``prompt`` / ``prompt_text`` / ``system_prompt`` in characters.
        max_new_tokens_cap: largest ``parameters.max_new_tokens`` accepted.

    Returns:
        One of the request models (see :data:`Request`).

    Raises:
        ServiceError: ``payload_too_large`` (413) for a body over ``max_body_bytes``;
            ``invalid_request`` (400) for a body that is not a JSON object, a missing or unknown
            ``type``, or unknown / missing fields; ``invalid_parameter`` (400) for a value out of
            range, including a prompt over ``max_prompt_chars`` or ``max_new_tokens`` over the cap.
            Messages name fields (``parameters.top_p: must be > 0 and <= 1``), never their content.
    """
    data = load_body(body, max_body_bytes)
    return validate_request(data, max_prompt_chars=max_prompt_chars, max_new_tokens_cap=max_new_tokens_cap)


def validate_request(data: Any, *, max_prompt_chars: int, max_new_tokens_cap: int) -> NativeRequest:
    """Validate one decoded native body (by ``type``) under the server's limits.

    Raises:
        ServiceError: as :func:`parse_request`, the body's size and JSON aside.
    """
    _check_type(data)
    try:
        request = _REQUEST_ADAPTER.validate_python(data)
    except ValidationError as exc:
        raise validation_error(exc) from None
    _check_limits(request, max_prompt_chars=max_prompt_chars, max_new_tokens_cap=max_new_tokens_cap)
    return request


def _check_type(data: Any) -> None:
    """Raise invalid_request unless ``data`` is an object whose ``type`` is one of :data:`REQUEST_TYPES`."""
    valid = ", ".join(REQUEST_TYPES)
    if not isinstance(data, dict):
        raise invalid("request body must be a JSON object with a 'type' field")
    if "type" not in data:
        raise invalid(
            f"missing field 'type'; valid types: {valid}; or send an OpenAI chat-completions body "
            "('messages') or an AWS session body ('requestType': 'NEW_SESSION' or 'CLOSE')"
        )
    rtype = data["type"]
    if not isinstance(rtype, str):
        raise invalid(f"field 'type' must be a string; valid types: {valid}")
    if rtype not in REQUEST_TYPES:
        shown = f" {rtype!r}" if SAFE_KEY_RE.match(rtype) and len(rtype) <= 32 else ""
        raise invalid(f"unknown type{shown}; valid types: {valid}")


def _check_limits(request: Any, *, max_prompt_chars: int, max_new_tokens_cap: int) -> None:
    """Apply the server's configurable limits, which the models cannot know."""
    texts: list[tuple[str, str | None]] = []
    if isinstance(request, GenerateRequest):
        texts.append(("prompt", request.prompt))
        limit = request.parameters.max_new_tokens
        if limit is not None and limit > max_new_tokens_cap:
            raise ServiceError(
                ErrorCode.INVALID_PARAMETER, f"parameters.max_new_tokens: must be <= {max_new_tokens_cap}"
            )
    elif isinstance(request, SendTextPromptRequest):
        texts.append(("prompt_text", request.prompt_text))
    elif isinstance(request, OpenSessionRequest):
        texts.append(("system_prompt", request.system_prompt))
        texts.extend((f"history[{i}].prompt", turn.prompt) for i, turn in enumerate(request.history))
    for name, text in texts:
        if text is not None and len(text) > max_prompt_chars:
            raise ServiceError(
                ErrorCode.INVALID_PARAMETER,
                f"{name}: longer than {max_prompt_chars} characters ({len(text)} given); shorten it",
            )


# ============================================================================================
# Commands: what a validated request asks of the engine, the server's defaults applied
# ============================================================================================


@dataclass(frozen=True)
class OpenCommand:
    """Open a session on ``image``, an image's source or a :class:`VideoSource` (``legacy``: reply in
    the AWS sample's ``start_session`` shape)."""

    kind: ClassVar[str] = "open_session"

    image: ImageSource
    system_prompt: str | None
    history: tuple[Turn, ...] = ()
    legacy: bool = False
    history_images: tuple[ImageSource, ...] = ()  # the images the history's turns place, in order
    salt: str | None = None  # the open's cache_salt: what the session holds is shared within it only


@dataclass(frozen=True)
class GenerateCommand:
    """Answer ``prompt`` in the session.

    Attributes:
        prompt: the question (plain text).
        params: sampling parameters with the server's defaults applied.
        remember: the turn joins the history.
        stream: reply as JSON lines, a chunk per ``handle()`` call.
        details: include the per-token list in the reply's details.
        legacy: reply in the AWS sample's ``send_text_prompt`` shape (``{"response_text"}``).
        context_policy: ``truncate`` or ``error`` when the turn does not fit the context.
        clip_max_new_tokens: ``params.max_new_tokens`` is the server default, not the request's,
            so it may be clipped to the room left.
    """

    kind: ClassVar[str] = "generate"

    prompt: str
    params: SamplingParams
    remember: bool = True
    stream: bool = False
    details: bool = False
    legacy: bool = False
    context_policy: ContextPolicy = "truncate"
    clip_max_new_tokens: bool = False


@dataclass(frozen=True)
class AddImageCommand:
    """Append ``image`` (an image's source or a :class:`VideoSource`) to the session's conversation."""

    kind: ClassVar[str] = "add_image"

    image: ImageSource


@dataclass(frozen=True)
class ResetCommand:
    """Forget the conversation, keep the images."""

    kind: ClassVar[str] = "reset"


@dataclass(frozen=True)
class CloseCommand:
    """Close the session."""

    kind: ClassVar[str] = "close_session"


Command = Union[OpenCommand, GenerateCommand, AddImageCommand, ResetCommand, CloseCommand]  # noqa: UP007
