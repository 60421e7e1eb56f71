"""The native dialect's commands: a validated body becomes one of five, with the server's defaults.

Our own ``type`` bodies (``open_session``, ``generate``, ``add_image``, ``reset``, ``close_session``)
and the AWS TorchServe LLaVA sample's (``start_session``, ``send_text_prompt``) become one of
:class:`OpenCommand`, :class:`GenerateCommand`, :class:`AddImageCommand`, :class:`ResetCommand`,
:class:`CloseCommand`; a command remembers whether it came in the sample's shape, and only the
encoders (:mod:`.responses`) look at that. No torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Union

from ..config import Settings
from ..images.source import ImageSource
from ..results import ContextPolicy
from ..sampling.params import SamplingParams
from ..sessions.conversation import Turn
from .protocol import AddImageRequest, CloseSessionRequest, GenerateRequest, OpenSessionRequest, validate_request

__all__ = [
    "AddImageCommand",
    "CloseCommand",
    "Command",
    "GenerateCommand",
    "OpenCommand",
    "ResetCommand",
    "decode_command",
]


@dataclass(frozen=True)
class OpenCommand:
    """Open a session on ``image`` (``legacy``: reply in the AWS sample's ``start_session`` shape)."""

    kind: ClassVar[str] = "open_session"

    image: ImageSource
    system_prompt: str | None
    history: tuple[Turn, ...] = ()
    legacy: bool = False
    history_images: tuple[ImageSource, ...] = ()  # the images the history's turns place, in order


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
    """Append ``image`` to the session's conversation."""

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


def decode_command(data: Any, settings: Settings) -> Command:
    """Validate one decoded native body (:func:`.protocol.validate_request`) and return its command,
    with the server's defaults applied.

    Raises:
        ServiceError: ``invalid_request`` / ``invalid_parameter`` (400).
    """
    s = settings
    request = validate_request(data, max_prompt_chars=s.max_prompt_chars, max_new_tokens_cap=s.max_new_tokens_cap)
    legacy = request.legacy
    canonical = request.canonical()
    if isinstance(canonical, OpenSessionRequest):
        history = tuple(Turn(t.prompt, t.answer, len(t.images)) for t in canonical.history)
        images = tuple(image for t in canonical.history for image in t.images)
        return OpenCommand(canonical.image, canonical.system_prompt or s.system_prompt, history, legacy, images)
    if isinstance(canonical, GenerateRequest):
        p = canonical.parameters
        params = SamplingParams(
            max_new_tokens=p.max_new_tokens or s.default_max_new_tokens,
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k,
            repetition_penalty=p.repetition_penalty,
            do_sample=p.do_sample,
            seed=p.seed,
            stop=tuple(p.stop),
            logprobs=p.details or canonical.stream,
        )
        return GenerateCommand(
            canonical.prompt,
            params,
            remember=canonical.remember,
            stream=canonical.stream,
            details=p.details,
            legacy=legacy,
            context_policy=canonical.context_policy or s.context_policy,
            clip_max_new_tokens=p.max_new_tokens is None,
        )
    if isinstance(canonical, AddImageRequest):
        return AddImageCommand(canonical.image)
    if isinstance(canonical, CloseSessionRequest):
        return CloseCommand()
    return ResetCommand()
