"""``llava-web``: a chat page about an image, in the browser, talking to the server through ``llava_client``.

Drop or paste an image (that opens a session), or upload a video (on a model with a video path: its
:data:`VIDEO_FRAMES` frames sampled uniformly by the server, shown as a strip), ask questions and watch each answer stream in token
by token; under every answer: the server's time to first token, how many prompt tokens the server
reused from the session's KV cache, the tokens generated and the finish reason. "Reset
conversation" forgets the history and keeps the image (and its cached prefix); "New image" closes
the session and starts over. Each browser tab has its own session; it is closed when the tab's
chat is cleared or the page is left, and otherwise expires by the server's TTL.

::

    llava-web --url http://127.0.0.1:8080          # llava-serve / llava-local-endpoint / a container
    llava-web --endpoint my-llava [--region us-east-1]   # a SageMaker endpoint
    llava-web --endpoint llava-local --endpoint-url http://127.0.0.1:8090 --region us-east-1  # llava-local-endpoint

The page binds to 127.0.0.1:7860 by default (``--host``, ``--port``). Needs the ``[web]`` extra
(Gradio). Errors appear in the page as sentences (:func:`explain`); a session the server lost is
reopened by ``llava_client`` from the tab's history and the page says so.
"""

# No ``from __future__ import annotations``: Gradio finds the ``gr.Request`` parameter of the
# callbacks in build_app by their evaluated annotations.
import argparse
import html
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

from ._client import Session, SessionClient
from ._exceptions import SessionBusy
from ._page_text import START_HINT, VIDEO_FRAMES, answer_stats, explain, sample_frames, shown, warn
from ._transport import port_argument, url_argument

__all__ = [
    "DEFAULT_MAX_NEW_TOKENS",
    "VIDEO_FRAMES",
    "ChatPage",
    "TabChat",
    "WebChat",
    "answer_stats",
    "build_app",
    "explain",
    "main",
    "sample_frames",
]

log = logging.getLogger(__name__)

#: The max-new-tokens slider's default (tokens).
DEFAULT_MAX_NEW_TOKENS = 128
#: The slider's top: the server's default ``max_new_tokens_cap`` (tokens).
MAX_NEW_TOKENS_LIMIT = 1024

Messages = list[dict[str, str]]


@dataclass
class TabChat:
    """One browser tab: its session (None before an image) and its transcript (chat messages)."""

    session: Session | None = None
    messages: Messages = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


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
        """Close the tab's session (if any) and open one on ``image`` (a path, bytes or PIL image).

        ``image`` None (the image was removed) only closes the session.
        """
        tab = self.tab(tab_id)
        with tab.lock:
            closed = self._close(tab)
            tab.messages = []
            if image is None:
                return [], closed or START_HINT
            try:
                tab.session = self.client.open_session(image)
            except Exception as exc:  # noqa: BLE001 - shown in the page
                log.info("open failed: %s", type(exc).__name__)
                return [], warn(explain(exc, doing="opening the image"))
            s = tab.session
            took = s.open_timings.get("total_ms")
            took_text = f" in {took:.0f} ms" if took is not None else ""
            note = "".join(f" Note: {done}." for done in s.downsized)
            return [], (
                f"Session `{s.id}` opened{took_text}: the image takes {s.image_tokens} tokens, "
                f"its features and KV cache stay on the server. Ask a question.{note}"
            )

    def open_video(self, tab_id: str, path: str | None) -> tuple[Messages, str, list[Any]]:
        """Close the tab's session (if any) and open one on the video at ``path``, its
        :data:`VIDEO_FRAMES` frames sampled by the server; returns the transcript, the status and the
        sampled frames for the strip. ``path`` None (the video was removed) only closes the session."""
        tab = self.tab(tab_id)
        with tab.lock:
            closed = self._close(tab)
            tab.messages = []
            if path is None:
                return [], closed or START_HINT, []
            try:
                tab.session = self.client.open_session(video=path, num_frames=VIDEO_FRAMES)
            except Exception as exc:  # noqa: BLE001 - shown in the page
                log.info("open failed: %s", type(exc).__name__)
                return [], warn(explain(exc, doing="opening the video")), []
            s = tab.session
            frames = sample_frames(path)
            took = s.open_timings.get("total_ms")
            took_text = f" in {took:.0f} ms" if took is not None else ""
            return (
                [],
                (
                    f"Session `{s.id}` opened{took_text}: {len(frames)} frames of the video take {s.image_tokens} "
                    "tokens, their features and KV cache stay on the server. Ask a question."
                ),
                frames,
            )

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
        note = ""
        if session.recoveries > recoveries:
            note = (
                " The server had lost this session (a restart or an eviction); it was reopened on the same "
                f"image with the remembered turns as session `{session.id}`."
            )
        yield messages, f"{stats}.{note}"

    def reset(self, tab_id: str) -> tuple[Messages, str]:
        """Forget the conversation, keep the image and its session (the cached image prefix stays)."""
        tab = self.tab(tab_id)
        with tab.lock:
            tab.messages = []
            if tab.session is None:
                return [], START_HINT
            try:
                tab.session.reset()
            except Exception as exc:  # noqa: BLE001 - shown in the page
                return [], warn(explain(exc, doing="resetting the conversation"))
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


def build_app(chat: WebChat, *, title: str = "LLaVA image chat", target: str = "") -> Any:
    """Build the Gradio page (``gradio.Blocks``) over ``chat``.

    Element ids (for tests and custom CSS): ``llava-image``, ``llava-video``, ``llava-frames``,
    ``llava-chat``, ``llava-question``, ``llava-send``, ``llava-reset``, ``llava-new-image``,
    ``llava-status``.

    Raises:
        ImportError: Gradio is not installed (``pip install 'llava-sessions[web]'``).
    """
    import gradio as gr

    def tab_id(request: gr.Request) -> str:
        return str(request.session_hash)

    def on_image(image: Any, request: gr.Request) -> tuple[Messages, str]:
        return chat.open_image(tab_id(request), image)

    def on_video(path: Any, request: gr.Request) -> tuple[Messages, str, list[Any]]:
        return chat.open_video(tab_id(request), path)

    def on_ask(
        question: str, max_new: float, temperature: float, request: gr.Request
    ) -> Iterator[tuple[Messages, str, str]]:
        for messages, status in chat.ask(tab_id(request), question, int(max_new), temperature):
            yield list(messages), status, ""

    def on_reset(request: gr.Request) -> tuple[Messages, str]:
        return chat.reset(tab_id(request))

    def on_new_image(request: gr.Request) -> tuple[None, None, list[Any], Messages, str]:
        chat.leave(tab_id(request))
        return None, None, [], [], START_HINT

    def on_clear(request: gr.Request) -> tuple[None, str]:
        chat.leave(tab_id(request))
        return None, f"Chat cleared, session closed. {START_HINT}"

    def on_unload(request: gr.Request) -> None:
        chat.leave(tab_id(request))

    with gr.Blocks(title=title) as app:
        gr.Markdown(
            f"## {title}\nA session holds the image (or video) it opened on; follow-up questions reuse its cached "
            f"features and KV cache, and a new image opens a new session. {target}"
        )
        with gr.Row():
            with gr.Column(scale=2):
                image, video, frames = _media_inputs(gr)
                max_new = gr.Slider(
                    1, MAX_NEW_TOKENS_LIMIT, value=DEFAULT_MAX_NEW_TOKENS, step=1, label="Max new tokens"
                )
                temperature = gr.Slider(0.0, 2.0, value=0.0, step=0.05, label="Temperature (0 = greedy)")
                with gr.Row():
                    reset = gr.Button("Reset conversation", elem_id="llava-reset")
                    new_image = gr.Button("New image", elem_id="llava-new-image")
            with gr.Column(scale=3):
                chatbot, question, send, status = _chat_column(gr)
        image.change(on_image, [image], [chatbot, status], concurrency_limit=None)
        video.change(on_video, [video], [chatbot, status, frames], concurrency_limit=None)
        for trigger in (send.click, question.submit):
            trigger(on_ask, [question, max_new, temperature], [chatbot, status, question], concurrency_limit=None)
        reset.click(on_reset, None, [chatbot, status], concurrency_limit=None)
        new_image.click(on_new_image, None, [image, video, frames, chatbot, status], concurrency_limit=None)
        chatbot.clear(on_clear, None, [image, status], concurrency_limit=None)
        app.unload(on_unload)
    return app


def _media_inputs(gr: Any) -> tuple[Any, Any, Any]:
    """The page's image input, its video upload and the strip of a video's sampled frames (made in
    the caller's column)."""
    image = gr.Image(type="filepath", sources=["upload", "clipboard"], label="Image", elem_id="llava-image", height=320)
    video = gr.File(
        label="…or a video (LLaVA-OneVision, LLaVA-NeXT-Video)",
        file_types=[".mp4", ".mov", ".webm", ".mkv"],
        type="filepath",
        elem_id="llava-video",
    )
    frames = gr.Gallery(label="Sampled frames", elem_id="llava-frames", columns=VIDEO_FRAMES, height=110)
    return image, video, frames


def _chat_column(gr: Any) -> tuple[Any, Any, Any, Any]:
    """The page's chat, question box, send button and status line (made in the caller's column)."""
    chatbot = gr.Chatbot(label="Chat", elem_id="llava-chat", height=420)
    question = gr.Textbox(label="Question", placeholder="Ask about the image…", elem_id="llava-question", lines=1)
    send = gr.Button("Send", variant="primary", elem_id="llava-send")
    status = gr.Markdown(START_HINT, elem_id="llava-status")
    return chatbot, question, send, status


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="llava-web",
        description="A chat page about an image, in the browser, talking to a llava-sessions server "
        "(llava-serve, a container, or a SageMaker endpoint).",
    )
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument(
        "--url", type=url_argument, help="server base URL, e.g. http://127.0.0.1:8080 (llava-serve, a container)"
    )
    where.add_argument("--endpoint", help="SageMaker endpoint name")
    p.add_argument("--region", help="AWS region of --endpoint")
    p.add_argument(
        "--endpoint-url",
        help="the SageMaker runtime's URL for --endpoint (e.g. llava-local-endpoint's http://127.0.0.1:8090)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address the page binds to (default 127.0.0.1)")
    p.add_argument("--port", type=port_argument, default=7860, help="the page's port (default 7860)")
    return p


class ChatPage:
    """The page, served by Gradio in background threads: :meth:`start`, :attr:`url`, :meth:`stop`.

    Args:
        chat: the page's logic (its client talks to the server).
        host: address to bind (127.0.0.1 keeps the page on this machine).
        port: TCP port of the page.
        target: where the answers come from, shown on the page (a URL or an endpoint name).
    """

    def __init__(self, chat: WebChat, *, host: str = "127.0.0.1", port: int = 7860, target: str = "") -> None:
        self.chat = chat
        self.host = host
        self.port = port
        self.target = target
        self._app: Any = None

    @property
    def url(self) -> str:
        """The page's address (``http://host:port``; a wildcard bind shows as 127.0.0.1)."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "", "::") else self.host
        return f"http://{host}:{self.port}"

    def start(self) -> None:
        """Build and launch the page; returns once it accepts connections.

        Raises:
            OSError: the port is taken (Gradio's message names it).
        """
        os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # no calls home
        app = build_app(self.chat, target=f"Server: `{self.target}`." if self.target else "")
        app.queue(default_concurrency_limit=None)
        app.launch(server_name=self.host, server_port=self.port, prevent_thread_lock=True, quiet=True)
        self._app = app

    def stop(self) -> None:
        """Close every tab's session, then stop the page. Idempotent."""
        self.chat.close_all()
        app, self._app = self._app, None
        if app is not None:
            app.close()


def _answers(url: str) -> bool:
    """Whether anything answers ``GET {url}/ping`` within 3 s (any status: a server that is starting says 503)."""
    import requests

    try:
        requests.get(url.rstrip("/") + "/ping", timeout=3)
    except requests.RequestException:
        return False
    return True


def _check_port(host: str, port: int) -> None:
    """Raise ``OSError`` now when ``host:port`` cannot be bound (Gradio's own message points to its
    environment variables, not to ``--port``)."""
    import socket

    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((host, port))


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``llava-web``; returns the exit status."""
    args = _build_parser().parse_args(argv)
    try:
        import gradio  # noqa: F401
    except ImportError:
        print("llava-web: Gradio is not installed; pip install 'llava-sessions[web]'", file=sys.stderr)
        return 1
    if args.endpoint_url and not args.endpoint:
        print("llava-web: --endpoint-url goes with --endpoint", file=sys.stderr)
        return 2
    if args.url:
        client, target = SessionClient.from_url(args.url), args.url
        if not _answers(args.url):
            print(
                f"llava-web: warning: nothing answers at {args.url} (is the server running?); the page starts "
                "anyway and says so on each request",
                file=sys.stderr,
                flush=True,
            )
    else:
        runtime = None
        if args.endpoint_url:
            import boto3

            runtime = boto3.client("sagemaker-runtime", endpoint_url=args.endpoint_url, region_name=args.region)
        client = SessionClient.from_endpoint(args.endpoint, region_name=args.region, client=runtime)
        target = f"SageMaker endpoint {args.endpoint}" + (f" at {args.endpoint_url}" if args.endpoint_url else "")
    page = ChatPage(WebChat(client), host=args.host, port=args.port, target=target)
    stop = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    with client:
        try:
            _check_port(args.host, args.port)
            page.start()
        except OSError as exc:
            print(f"llava-web: cannot serve the page on {args.host}:{args.port} ({exc.strerror or 'taken'}); "
                  "choose another with --port", file=sys.stderr)  # fmt: skip
            return 1
        try:
            print(f"llava-web: chat page at {page.url} (server: {target}); Ctrl-C stops", flush=True)
            stop.wait()
        finally:
            page.stop()
    print("llava-web: stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
