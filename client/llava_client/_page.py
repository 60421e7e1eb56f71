"""The chat page's logic without Gradio (``llava-web``): each browser tab's session and transcript
(:class:`WebChat`), and what the page says: its sentences for errors and answers, and the frames
of a video it shows. :mod:`llava_client.web` lays it out in Gradio."""

from __future__ import annotations

import html
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ._client import Session, SessionClient
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
from ._transport import aws_setup_hint
from ._types import Answer

__all__ = [
    "DEFAULT_MAX_NEW_TOKENS",
    "MAX_NEW_TOKENS_LIMIT",
    "START_HINT",
    "VIDEO_FRAMES",
    "Messages",
    "TabChat",
    "WebChat",
    "answer_stats",
    "explain",
    "sample_frames",
    "shown",
    "warn",
]

log = logging.getLogger(__name__)

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
    hint = aws_setup_hint(error)  # boto3 without a region or credentials: what to set, not a class name
    if hint is not None:
        return f"{what}{hint}."
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


#: The max-new-tokens slider's default (tokens).
DEFAULT_MAX_NEW_TOKENS = 128
#: The slider's top: the server's default ``max_new_tokens_cap`` (tokens).
MAX_NEW_TOKENS_LIMIT = 1024

Messages = list[dict[str, str]]


@dataclass
class TabChat:
    """One browser tab: its session (None before an image), its transcript (chat messages) and the
    frames shown of its video (empty for images)."""

    session: Session | None = None
    messages: Messages = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    frames: list[Any] = field(default_factory=list)


def _kept(tab: TabChat) -> str:
    """What a refused open, reset or add leaves: the tab's session and conversation, as they were."""
    if tab.session is None:
        return ""
    return f" Session `{tab.session.id}` and its conversation are kept as they were."


def _recovered(session: Session, recoveries: int) -> str:
    """The note when ``session`` was reopened during a call (its ``recoveries`` had been ``recoveries``)."""
    if session.recoveries <= recoveries:
        return ""
    return (
        " The server had lost this session (a restart or an eviction); it was reopened on the same "
        f"images with the remembered turns as session `{session.id}`."
    )


class WebChat:
    """The page's logic, one :class:`TabChat` per browser tab (Gradio's ``session_hash``).

    Each method returns what the page shows: ``(messages, status)``, where ``status`` is one line of
    Markdown (the session, the last answer's numbers, or an error sentence). Methods never raise
    for a server error.

    Args:
        client: the ``llava_client`` client every tab's session is opened with.
    """

    def __init__(self, client: SessionClient) -> None:
        self.client = client
        self._tabs: dict[str, TabChat] = {}
        self._lock = threading.Lock()

    def tab(self, tab_id: str) -> TabChat:
        """The tab's state (created on first use)."""
        with self._lock:
            return self._tabs.setdefault(tab_id, TabChat())

    def open_image(self, tab_id: str, image: Any) -> tuple[Messages, str]:
        """Open a session on ``image`` (a path, bytes or PIL image) in place of the tab's session.

        The new session is opened first: a refused image leaves the tab's session and conversation
        as they were. Only a server without room for both (``overloaded``) gets the old one closed
        first, then the image once more. ``image`` None (the image was removed) only closes the session.
        """
        return self._open(tab_id, image, None)[:2]

    def _open(self, tab_id: str, image: Any, video: str | None) -> tuple[Messages, str, list[Any]]:
        tab = self.tab(tab_id)
        what = "the video" if video is not None else "the image"
        with tab.lock:
            if image is None and video is None:
                closed = self._close(tab)
                tab.messages, tab.frames = [], []
                return [], closed or START_HINT, []
            try:
                try:
                    session = self._open_session(image, video)
                except Overloaded:
                    if tab.session is None:
                        raise
                    self._close(tab)  # the user replaces it: make its room, then try once more
                    tab.messages, tab.frames = [], []
                    session = self._open_session(image, video)
            except Exception as exc:  # noqa: BLE001 - shown in the page
                log.info("open failed: %s", type(exc).__name__)
                return tab.messages, warn(explain(exc, doing=f"opening {what}") + _kept(tab)), tab.frames
            self._close(tab)
            tab.session, tab.messages = session, []
            tab.frames = sample_frames(video) if video is not None else []
            took = session.open_timings.get("total_ms")
            took_text = f" in {took:.0f} ms" if took is not None else ""
            if video is not None:
                return (
                    [],
                    (
                        f"Session `{session.id}` opened{took_text}: {len(tab.frames)} frames of the video take "
                        f"{session.image_tokens} tokens, their features and KV cache stay on the server. Ask a question."
                    ),
                    tab.frames,
                )
            note = "".join(f" Note: {done}." for done in session.downsized)
            return (
                [],
                (
                    f"Session `{session.id}` opened{took_text}: the image takes {session.image_tokens} tokens, "
                    f"its features and KV cache stay on the server. Ask a question.{note}"
                ),
                [],
            )

    def _open_session(self, image: Any, video: str | None) -> Session:
        if video is not None:
            return self.client.open_session(video=video, num_frames=VIDEO_FRAMES)
        return self.client.open_session(image)

    def add_image(self, tab_id: str, image: Any) -> str:
        """Add ``image`` (a path, bytes or PIL image) to the tab's session: the next question is about
        it and every earlier image; returns the status line. None (the input was cleared) does nothing."""
        tab = self.tab(tab_id)
        if image is None:
            return 'The added image stays in the session; "New image" starts over.'
        with tab.lock:
            if tab.session is None:
                return warn("Open a session on an image first; then add more images to it.")
            recoveries = tab.session.recoveries
            try:
                added = tab.session.add_image(image)
            except Exception as exc:  # noqa: BLE001 - shown in the page
                log.info("add image failed: %s", type(exc).__name__)
                return warn(explain(exc, doing="adding the image") + _kept(tab))
            tab.messages.append({"role": "user", "content": f"*(image {added.images} added)*"})
            return (
                f"Image {added.images} added to session `{tab.session.id}`: it takes {added.image_tokens} tokens; "
                f"{added.cached_tokens} tokens of the conversation before it were reused. Ask about the images."
                + _recovered(tab.session, recoveries)
            )

    def open_video(self, tab_id: str, path: str | None) -> tuple[Messages, str, list[Any]]:
        """Open a session on the video at ``path`` in place of the tab's session, its
        :data:`VIDEO_FRAMES` frames sampled by the server; returns the transcript, the status and the
        frames for the strip. A refused video (a model without video, a file it cannot read) leaves
        the tab's session, conversation and frames as they were (as :meth:`open_image`). ``path``
        None (the video was removed) only closes the session."""
        return self._open(tab_id, None, path)

    def ask(
        self, tab_id: str, question: str, max_new_tokens: int, temperature: float
    ) -> Iterator[tuple[Messages, str]]:
        """Stream the answer to ``question``: yields the transcript as each text piece arrives.

        ``temperature`` 0 means greedy decoding; above 0, sampling at that temperature.
        """
        tab = self.tab(tab_id)
        question = (question or "").strip()
        if tab.session is None:
            yield tab.messages, warn("Upload or paste an image first (or a video): questions are about it.")
            return
        if not question:
            yield tab.messages, "Type a question first."
            return
        if not tab.lock.acquire(blocking=False):
            yield tab.messages, warn(explain(SessionBusy("busy", status_code=409)))
            return
        try:
            yield from self._ask(tab, question, int(max_new_tokens), float(temperature))
        finally:
            tab.lock.release()

    def _ask(
        self, tab: TabChat, question: str, max_new_tokens: int, temperature: float
    ) -> Iterator[tuple[Messages, str]]:
        session = tab.session
        assert session is not None
        messages = tab.messages
        messages.append({"role": "user", "content": question})
        messages.append({"role": "assistant", "content": ""})
        yield messages, "Answering…"
        sampling: dict[str, Any] = {"do_sample": True, "temperature": temperature} if temperature > 0 else {}
        recoveries = session.recoveries
        text = ""
        try:
            with session.stream(question, max_new_tokens=max_new_tokens, **sampling) as stream:
                for piece in stream:
                    text += piece
                    messages[-1]["content"] = shown(text)
                    yield messages, "Answering…"
            answer = stream.answer
        except Exception as exc:  # noqa: BLE001 - shown in the page
            log.info("answer failed: %s", type(exc).__name__)
            if text:
                messages[-1]["content"] = shown(text) + "\n\n*(answer interrupted)*"
            else:
                del messages[-2:]
            yield messages, warn(explain(exc, doing="answering"))
            return
        assert answer is not None
        stats = answer_stats(answer)
        messages[-1]["content"] = f"{shown(text)}\n\n<small>{html.escape(stats)}</small>"
        yield messages, f"{stats}.{_recovered(session, recoveries)}"

    def reset(self, tab_id: str) -> tuple[Messages, str]:
        """Forget the conversation, keep the image and its session (the cached image prefix stays)."""
        tab = self.tab(tab_id)
        with tab.lock:
            if tab.session is None:
                tab.messages = []
                return [], START_HINT
            recoveries = tab.session.recoveries
            try:
                tab.session.reset()
            except Exception as exc:  # noqa: BLE001 - shown in the page: nothing changed on either side
                log.info("reset failed: %s", type(exc).__name__)
                return tab.messages, warn(explain(exc, doing="resetting the conversation") + _kept(tab))
            tab.messages = []
            if tab.session.recoveries > recoveries:
                return [], (
                    "Conversation reset. The server had lost this session (a restart or an eviction); it was "
                    f"reopened on the same images as session `{tab.session.id}`. Ask a question."
                )
            return [], f"Conversation reset; session `{tab.session.id}` keeps the image. Ask a question."

    def leave(self, tab_id: str) -> None:
        """The tab was closed or its chat cleared: close its session and forget the tab."""
        with self._lock:
            tab = self._tabs.pop(tab_id, None)
        if tab is not None:
            with tab.lock:
                self._close(tab)

    def close_all(self) -> None:
        """Close every tab's session (the page is shutting down)."""
        with self._lock:
            tab_ids = list(self._tabs)
        for tab_id in tab_ids:
            self.leave(tab_id)

    def _close(self, tab: TabChat) -> str:
        session, tab.session = tab.session, None
        if session is None:
            return ""
        try:
            session.close()
        except Exception as exc:  # noqa: BLE001 - the session expires by TTL; say so
            log.info("close failed: %s", type(exc).__name__)
            return f"Could not close session `{session.id}` ({explain(exc)}); it will expire on the server."
        return f"Session `{session.id}` closed."
