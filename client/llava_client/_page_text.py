"""What the chat page says (``llava-web``): its sentences for errors and answers, and the frames of a
video it shows. No Gradio here."""

from __future__ import annotations

import time
from typing import Any

from ._exceptions import (
    APIConnectionError,
    APIStatusError,
    APITimeoutError,
    ContextLengthExceeded,
    InvalidRequest,
    LlavaError,
    Overloaded,
    PayloadTooLarge,
    RateLimited,
    SessionBusy,
    SessionGone,
)
from ._types import Answer

__all__ = ["START_HINT", "VIDEO_FRAMES", "answer_stats", "explain", "sample_frames", "shown", "warn"]

#: The status line while the tab has no session.
START_HINT = "Upload or paste an image (or upload a video) to start a session."
#: Frames the page asks the server to sample from an uploaded video (and shows as a strip).
VIDEO_FRAMES = 8


def sample_frames(path: str, num_frames: int = VIDEO_FRAMES) -> list[Any]:
    """The frames the server samples from the video at ``path`` when asked for ``num_frames``
    (transformers' uniform indices, ``i x total // num_frames``), as RGB PIL images for the page's
    strip; [] for a file PyAV cannot read (the server's answer says why)."""
    try:
        import av

        with av.open(path) as container:
            frames = [frame.to_image() for frame in container.decode(video=0)]
    except Exception:  # noqa: BLE001 - not a video we can read here: the server explains
        return []
    total = len(frames)
    wanted = min(num_frames, total)
    return [frames[i * total // wanted] for i in range(wanted)] if wanted else []


def explain(error: Exception, *, doing: str = "") -> str:
    """One sentence for the page about ``error`` (never a stack trace).

    Args:
        error: what a ``llava_client`` call raised (any exception: unknown ones get a generic line).
        doing: what the page was doing ("opening the image", "answering"), to start the sentence.
    """
    what = f"{doing[:1].upper()}{doing[1:]} failed: " if doing else ""
    if isinstance(error, SessionBusy):
        return f"{what}the previous answer is still being generated; wait for it to finish."
    if isinstance(error, SessionGone):
        return (
            f"{what}the server no longer has this session ({error.code}) and it could not be restored; "
            "upload the image again."
        )
    if isinstance(error, Overloaded | RateLimited):
        retry_after = getattr(error, "retry_after", None)
        wait = f" in about {retry_after:.0f} s" if retry_after else " in a moment"
        return f"{what}the server is busy (all its session memory is in use); try again{wait}."
    if isinstance(error, InvalidRequest | PayloadTooLarge) and error.code and error.code.startswith("video"):
        return f"{what}the server cannot use this video ({error.message})."
    if isinstance(error, PayloadTooLarge):
        if error.code == "image_too_large":
            return f"{what}the image is too large for the server ({error.message})."
        return f"{what}the image is too large to send; use a smaller image (a few MB at most)."
    if isinstance(error, ContextLengthExceeded):
        return f"{what}the question does not fit the model's context; reset the conversation or ask for fewer tokens."
    if isinstance(error, InvalidRequest):
        if error.code and error.code.startswith("image"):
            return f"{what}the server cannot use this file as an image ({error.message}); try a JPEG or PNG."
        return f"{what}the server refused the request: {error.message}"
    if isinstance(error, APITimeoutError):
        return f"{what}the server did not answer in time; try again."
    if isinstance(error, APIConnectionError):
        return f"{what}cannot reach the server; check that it is running (it may be restarting)."
    if isinstance(error, APIStatusError):
        return f"{what}the server answered {error.status_code}: {error.message}"
    if isinstance(error, LlavaError):
        return f"{what}{error}"
    return f"{what}an unexpected error occurred ({type(error).__name__})."


def answer_stats(answer: Answer) -> str:
    """The line shown under an answer: TTFT (server and here), reused tokens, tokens, finish reason."""
    usage = answer.usage
    parts = []
    if answer.ttft_ms is not None:
        parts.append(f"TTFT {answer.ttft_ms:.0f} ms")
    if answer.client_ttft_ms is not None:
        parts.append(f"first token here after {answer.client_ttft_ms:.0f} ms")
    parts.append(f"reused {usage.cached_tokens} of {usage.prompt_tokens} prompt tokens")
    parts.append(f"{usage.generated_tokens} tokens")
    parts.append(f"finish_reason: {answer.finish_reason}")
    if answer.truncated_turns:
        parts.append(f"{answer.truncated_turns} oldest turn(s) left the context")
    return " · ".join(parts)


def warn(sentence: str) -> str:
    """A status line for a problem: a warning sign, the local time (a repeated error reads as new), the sentence."""
    return f"⚠️ [{time.strftime('%H:%M:%S')}] {sentence}"


def shown(text: str) -> str:
    """Answer text for the chat bubble: control characters (random weights make them) as U+FFFD."""
    return "".join(c if c.isprintable() or c in "\n\t" else "\ufffd" for c in text)
