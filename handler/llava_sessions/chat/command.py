"""A validated chat request as the command the chat serving runs: OpenAI's and vLLM's parameters as ours
(``temperature`` 1.0 by default, as OpenAI's), image URLs as image sources. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from pydantic import ValidationError

from ..config import Settings
from ..errors import ErrorCode, ServiceError
from ..sampling.params import UNTIL_CONTEXT_END, SamplingParams
from ..wire.inbound import ImageSource, VideoSource
from .protocol import ChatCompletionRequest, ChatConversation, VideoPart

__all__ = ["ChatCommand", "ChatImage", "chat_command", "image_source_of"]


#: An image's or a video's source (:func:`_source_of`).
_Source = TypeVar("_Source", bound=ImageSource)


@dataclass(frozen=True)
class ChatCommand:
    """Answer a whole resent conversation (OpenAI ``messages``).

    Attributes:
        conversation: the messages as our conversation (system, turns, question; image counts).
        images: every image and video of the conversation in the template's order (a message's images,
            then its videos): where its bytes come from, or its uuid alone.
        salt: the request's ``cache_salt`` (None: unsalted).
        params: sampling parameters with the server's defaults applied.
        clip_max_new_tokens: the request set no answer limit: it runs until the context ends
            (``params.max_new_tokens`` is :data:`~llava_sessions.sampling.params.UNTIL_CONTEXT_END`,
            lowered to the room the context leaves).
        stream: answer as a stream of chunks; include_usage: end it with a usage chunk;
            continuous_usage: every chunk carries the usage so far (vLLM's ``continuous_usage_stats``).
        top_logprobs: most likely alternatives per token (with ``params.logprobs``).
        model: the model name the reply carries (the served model's).
        keep_stop: the reply's text keeps the stop sequence it ended on (vLLM's
            ``include_stop_str_in_output``; OpenAI leaves it out).
    """

    kind: ClassVar[str] = "chat"

    conversation: ChatConversation
    images: tuple[ChatImage, ...]
    params: SamplingParams
    clip_max_new_tokens: bool
    stream: bool
    include_usage: bool
    model: str
    salt: str | None = None
    keep_stop: bool = False
    continuous_usage: bool = False


@dataclass(frozen=True)
class ChatImage:
    """One image (or video: ``source`` a :class:`~llava_sessions.wire.inbound.VideoSource`) of a chat
    request: ``source`` (None for a reference by ``uuid`` alone), the client's ``uuid`` for it (or
    None), and ``param``, where it sits in the request (for errors)."""

    source: ImageSource | None
    uuid: str | None
    param: str
    video: bool = False


def image_source_of(url: str, param: str) -> ImageSource:
    """The image source an ``image_url`` names: ``s3://`` → S3, ``data:`` → base64, else a URL.

    Raises:
        ServiceError: invalid_parameter naming ``param`` (a data URI that is not a base64 image, a
            malformed S3 URI, a URL over 8,192 characters).
    """
    return _source_of(ImageSource, "image", url, param, {})


def video_source_of(url: str, param: str, num_frames: int | None, fps: float | None) -> VideoSource:
    """The video source a ``video_url`` names (``s3://`` → S3, ``data:video/...;base64,`` → base64,
    else a URL), sampled by ``num_frames`` or ``fps``.

    Raises:
        ServiceError: invalid_parameter naming ``param``, as :func:`image_source_of`.
    """
    return _source_of(VideoSource, "video", url, param, {"num_frames": num_frames, "fps": fps})


def _source_of(cls: type[_Source], kind: str, url: str, param: str, extra: dict[str, Any]) -> _Source:
    """``cls`` (an image's or a video's source) for ``url``, whose data URI must be ``data:<kind>/``."""
    try:
        if url.startswith("s3://"):
            return cls(s3_uri=url, **extra)
        if url.startswith("data:"):
            if not url.startswith(f"data:{kind}/") or ";base64," not in url[:100]:
                raise ServiceError(
                    ErrorCode.INVALID_PARAMETER,
                    f"{param}: a data URI must look like data:{kind}/<type>;base64,<data>",
                    param=param,
                )
            return cls(base64=url, **extra)
        return cls(url=url, **extra)
    except ValidationError:
        raise ServiceError(
            ErrorCode.INVALID_PARAMETER,
            f"{param}: must be an https URL, an s3://bucket/key URI or a data:{kind}/...;base64, URI",
            param=param,
        ) from None


def _media(request: ChatCompletionRequest) -> list[ChatImage]:
    """Every image and video part of the request, in the template's order (a message's images, then
    its videos); a video part naming no sampling takes ``mm_processor_kwargs``'.

    Raises:
        ServiceError: invalid_parameter naming the part (:func:`image_source_of`, :func:`video_source_of`).
    """
    media: list[ChatImage] = []
    for i, msg in enumerate(request.messages):
        content = msg.content if isinstance(msg.content, list) else []
        for part in msg.image_parts():
            param = f"messages[{i}].content[{next(j for j, p in enumerate(content) if p is part)}]"
            url = part.url
            source: ImageSource | None = None
            if url is not None and isinstance(part, VideoPart):
                frames, fps = part.num_frames, part.fps
                if frames is None and fps is None and request.mm_processor_kwargs is not None:
                    frames, fps = request.mm_processor_kwargs.num_frames, request.mm_processor_kwargs.fps
                source = video_source_of(url[0], f"{param}.{url[1]}", frames, fps)
            elif url is not None:
                source = image_source_of(url[0], f"{param}.{url[1]}")
            media.append(ChatImage(source, part.uuid, param, isinstance(part, VideoPart)))
    return media


def chat_command(request: ChatCompletionRequest, settings: Settings, model: str) -> ChatCommand:
    """The command of a validated chat-completions request, with the server's defaults.

    ``temperature`` unset is OpenAI's default 1.0 (sampled); 0 is greedy. The request's ``model`` is
    accepted and the reply names the served model (``model``), as vLLM's and TGI's servers do.

    Raises:
        ServiceError: invalid_request (message order), invalid_parameter (image URLs, a structured
            output's schema or pattern).
    """
    conversation = request.conversation()
    images = _media(request)
    limit = request.answer_limit
    temperature = 1.0 if request.temperature is None else request.temperature
    params = SamplingParams(
        max_new_tokens=limit or UNTIL_CONTEXT_END,
        temperature=temperature,
        top_p=request.top_p,
        top_k=request.top_k,
        repetition_penalty=request.repetition_penalty,
        do_sample=temperature > 0,
        seed=request.seed,
        stop=request.stop_list,
        logprobs=request.logprobs,
        frequency_penalty=request.frequency_penalty,
        min_p=request.min_p,
        min_tokens=request.min_tokens,
        ignore_eos=request.ignore_eos,
        stop_token_ids=tuple(request.stop_token_ids or ()),
        logit_bias=request.token_biases(),
        skip_special_tokens=request.skip_special_tokens,
        presence_penalty=request.presence_penalty,
        top_logprobs=request.top_logprobs or 0,
        grammar=request.grammar(),
        n=request.n,
        session_choice=request.session_choice,
    )
    options = request.stream_options
    include_usage = bool(options and options.include_usage)
    return ChatCommand(
        conversation,
        tuple(images),
        params,
        limit is None,
        request.stream,
        include_usage,
        model,
        request.cache_salt,
        request.include_stop_str_in_output,
        include_usage and bool(options and options.continuous_usage_stats),  # vLLM: only with include_usage
    )
