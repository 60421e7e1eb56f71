"""``llava-web``: a chat page about an image, in the browser, talking to the server through ``llava_client``.

Drop or paste an image (that opens a session), or upload a video (on a model with a video path: its
:data:`VIDEO_FRAMES` frames sampled uniformly by the server, shown as a strip), ask questions and watch each answer stream in token
by token; under every answer: the server's time to first token, how many prompt tokens the server
reused from the session's KV cache, the tokens generated and the finish reason. "Add an image to
this session" adds one more (the next questions are about every image, the earlier ones' cache kept). "Reset
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
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

from ._client import SessionClient
from ._page import (
    DEFAULT_MAX_NEW_TOKENS,
    MAX_NEW_TOKENS_LIMIT,
    START_HINT,
    VIDEO_FRAMES,
    Messages,
    TabChat,
    WebChat,
    answer_stats,
    explain,
    sample_frames,
)
from ._transport import aws_setup_hint, port_argument, url_argument

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


def build_app(chat: WebChat, *, title: str = "LLaVA image chat", target: str = "") -> Any:
    """Build the Gradio page (``gradio.Blocks``) over ``chat``.

    Element ids (for tests and custom CSS): ``llava-image``, ``llava-add-image``, ``llava-video``, ``llava-frames``,
    ``llava-chat``, ``llava-question``, ``llava-send``, ``llava-reset``, ``llava-new-image``,
    ``llava-status``.

    Raises:
        ImportError: Gradio is not installed (``pip install 'llava-sessions[web]'``).
    """
    import gradio as gr

    on = _callbacks(chat, gr)
    with gr.Blocks(title=title) as app:
        gr.Markdown(
            f"## {title}\nA session holds the image (or video) it opened on; follow-up questions reuse its cached "
            f'features and KV cache; more images may join it, and "New image" opens a new session. {target}'
        )
        with gr.Row():
            with gr.Column(scale=2):
                image, more, video, frames = _media_inputs(gr)
                max_new = gr.Slider(
                    1, MAX_NEW_TOKENS_LIMIT, value=DEFAULT_MAX_NEW_TOKENS, step=1, label="Max new tokens"
                )
                temperature = gr.Slider(0.0, 2.0, value=0.0, step=0.05, label="Temperature (0 = greedy)")
                with gr.Row():
                    reset = gr.Button("Reset conversation", elem_id="llava-reset")
                    new_image = gr.Button("New image", elem_id="llava-new-image")
            with gr.Column(scale=3):
                chatbot, question, send, status = _chat_column(gr)
        # the uploads reach the handlers unprocessed (a path): a file that is no image is the server's
        # to refuse, in a sentence on the page, not a trace in Gradio's preprocessing
        image.change(on["on_image"], [image], [chatbot, status], concurrency_limit=None, preprocess=False)
        more.input(on["on_add_image"], [more], [chatbot, status], concurrency_limit=None, preprocess=False)
        video.change(on["on_video"], [video], [chatbot, status, frames], concurrency_limit=None)
        for trigger in (send.click, question.submit):
            trigger(on["on_ask"], [question, max_new, temperature], [chatbot, status, question], concurrency_limit=None)
        reset.click(on["on_reset"], None, [chatbot, status], concurrency_limit=None)
        new_image.click(on["on_new_image"], None, [image, more, video, frames, chatbot, status], concurrency_limit=None)
        chatbot.clear(on["on_clear"], None, [image, status], concurrency_limit=None)
        app.unload(on["on_unload"])
    return app


def _callbacks(chat: WebChat, gr: Any) -> dict[str, Any]:
    """The page's event handlers over ``chat``, by name (each tab is Gradio's ``session_hash``)."""

    def tab_id(request: gr.Request) -> str:
        return str(request.session_hash)

    def on_image(image: Any, request: gr.Request) -> tuple[Messages, str]:
        messages, status = chat.open_image(tab_id(request), _upload_path(image))
        return list(messages), status  # a refused image: the conversation as it was

    def on_add_image(image: Any, request: gr.Request) -> tuple[Messages, str]:
        status = chat.add_image(tab_id(request), _upload_path(image))
        return list(chat.tab(tab_id(request)).messages), status

    def on_video(path: Any, request: gr.Request) -> tuple[Messages, str, list[Any]]:
        messages, status, frames = chat.open_video(tab_id(request), path)
        return list(messages), status, list(frames)  # a refused video: the conversation as it was

    def on_ask(
        question: str, max_new: float, temperature: float, request: gr.Request
    ) -> Iterator[tuple[Messages, str, str]]:
        for messages, status in chat.ask(tab_id(request), question, int(max_new), temperature):
            yield list(messages), status, ""

    def on_reset(request: gr.Request) -> tuple[Messages, str]:
        messages, status = chat.reset(tab_id(request))
        return list(messages), status  # a refused reset: the conversation as it was

    def on_new_image(request: gr.Request) -> tuple[None, None, None, list[Any], Messages, str]:
        chat.leave(tab_id(request))
        return None, None, None, [], [], START_HINT

    def on_clear(request: gr.Request) -> tuple[None, str]:
        chat.leave(tab_id(request))
        return None, f"Chat cleared, session closed. {START_HINT}"

    def on_unload(request: gr.Request) -> None:
        chat.leave(tab_id(request))

    return {name: f for name, f in locals().items() if name.startswith("on_")}


def _upload_path(value: Any) -> Any:
    """The server-side path of an unprocessed upload (Gradio's file payload ``{"path": ...}``), or the value."""
    return value.get("path") if isinstance(value, dict) else value


def _media_inputs(gr: Any) -> tuple[Any, Any, Any, Any]:
    """The page's image input, the input adding an image to the session, its video upload and the
    strip of a video's sampled frames (made in the caller's column)."""
    image = gr.Image(type="filepath", sources=["upload", "clipboard"], label="Image", elem_id="llava-image", height=320)
    more = gr.Image(
        type="filepath",
        sources=["upload", "clipboard"],
        label="Add an image to this session",
        elem_id="llava-add-image",
        height=160,
    )
    video = gr.File(
        label="…or a video (LLaVA-OneVision, LLaVA-NeXT-Video)",
        file_types=[".mp4", ".mov", ".webm", ".mkv"],
        type="filepath",
        elem_id="llava-video",
    )
    frames = gr.Gallery(label="Sampled frames", elem_id="llava-frames", columns=VIDEO_FRAMES, height=110)
    return image, more, video, frames


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
        try:
            if args.endpoint_url:
                import boto3

                runtime = boto3.client("sagemaker-runtime", endpoint_url=args.endpoint_url, region_name=args.region)
            client = SessionClient.from_endpoint(args.endpoint, region_name=args.region, client=runtime)
        except Exception as exc:  # boto3 without a region: told in one line, with what to set
            hint = aws_setup_hint(exc)
            if hint is None:
                raise
            print(f"llava-web: {hint}", file=sys.stderr)
            return 2
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
