"""``llava-chat``: chat about an image in the terminal, with a SageMaker endpoint or a local server.

Examples::

    llava-chat --url http://127.0.0.1:8080 --image photo.jpg
    llava-chat --endpoint my-llava --region us-east-1 --image s3://bucket/photo.jpg --verbose
    llava-chat --url http://127.0.0.1:8080 --image photo.jpg -q "What is in this image?"
    printf 'What is it?\\nWhat color?\\n' | llava-chat --url http://127.0.0.1:8080 --image photo.jpg
    llava-chat --url http://127.0.0.1:8080 --video clip.mp4 --num-frames 8 -q "What happens?"

Answers stream as they are generated. Commands: ``/reset`` forgets the conversation,
``/add PATH|URL`` adds an image to the conversation (the next question may refer to every image),
``/image PATH|URL`` starts over on another image, ``/quit`` (or end of input) leaves.
When standard input is not a terminal, each line is a question (or a command).
"""

from __future__ import annotations

import argparse
import difflib
import logging
import sys
import time
from typing import TextIO

from ._chat import video_part
from ._client import API_KEY_ENV, Session, SessionClient
from ._exceptions import LlavaError
from ._transport import aws_setup_hint, url_argument
from ._types import Answer

__all__ = ["main", "terminal_text"]


def terminal_text(text: str) -> str:
    """``text`` safe for a terminal: control characters (which a model's answer may hold, ``\\r`` or a
    form feed that would overwrite the prompt, an escape sequence) shown as U+FFFD; new lines and tabs kept."""
    return "".join(c if c.isprintable() or c in "\n\t" else "\ufffd" for c in text)


_HELP = (
    "commands: /reset (forget the conversation), /add PATH|URL (add an image or a video), /image PATH|URL "
    "(a new session on an image), /video PATH|URL (a new session on a video), /help, /quit"
)

#: File endings taken for a video (PyAV reads them), so /image and /add say what to use.
VIDEO_SUFFIXES = (".mp4", ".mov", ".webm", ".mkv", ".avi", ".m4v")


def _is_video(source: str) -> bool:
    return source.lower().split("?", 1)[0].endswith(VIDEO_SUFFIXES)


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llava-chat",
        description="Chat about an image with a llava-sessions server (SageMaker endpoint or local URL).",
        epilog=_HELP,
    )
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument(
        "--endpoint", metavar="NAME", help="SageMaker endpoint name (AWS credentials from the environment)"
    )
    where.add_argument(
        "--url", metavar="URL", type=url_argument, help="server base URL, e.g. http://127.0.0.1:8080 (llava-serve)"
    )
    parser.add_argument("--region", metavar="R", help="AWS region of the endpoint")
    parser.add_argument(
        "--api-key",
        metavar="KEY",
        help=f"with --url: the server's --api-key, sent as 'Authorization: Bearer KEY' (default: ${API_KEY_ENV})",
    )
    parser.add_argument(
        "--endpoint-url",
        metavar="URL",
        help="the SageMaker runtime's URL for --endpoint, e.g. llava-local-endpoint's http://127.0.0.1:8090 "
        "(boto3 still needs credentials: dummy ones do for a local endpoint)",
    )
    medium = parser.add_mutually_exclusive_group(required=True)
    medium.add_argument("--image", metavar="PATH|URL", help="local image file, http(s) URL or s3:// URI")
    medium.add_argument(
        "--video",
        metavar="PATH|URL",
        help="instead of --image, a video (MP4 or WebM file, http(s) URL or s3:// URI) on a model with a video "
        "path (LLaVA-OneVision, LLaVA-NeXT-Video); its frames are sampled uniformly by the server",
    )
    parser.add_argument(
        "--num-frames", type=int, metavar="N", help="with --video: frames to sample (default: the server's)"
    )
    parser.add_argument("-q", "--question", metavar="TEXT", help="ask one question, print the answer and exit")
    parser.add_argument("--system-prompt", metavar="TEXT", help="replace the server's default system prompt")
    parser.add_argument("--max-new-tokens", type=int, metavar="N", help="longest answer in tokens")
    parser.add_argument("--temperature", type=float, metavar="T", help="sampling temperature (0 or unset: greedy)")
    parser.add_argument(
        "--timeout", type=float, default=120.0, metavar="S", help="read timeout in seconds (default 120)"
    )
    parser.add_argument(
        "--stateless",
        action="store_true",
        help="hold no session: resend the conversation every turn, as OpenAI clients do (the server's "
        "conversation cache serves the part it saw; the image goes once, then by its uuid)",
    )
    parser.add_argument("--cache-salt", metavar="SALT", help="with --stateless: the cache_salt sent with every turn")
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="after each answer, print time to first token and reused (cached) tokens",
    )
    return parser


class _Chat:
    """One chat: the session, the turn loop and its printing."""

    def __init__(self, client: SessionClient, args: argparse.Namespace, out: TextIO, err: TextIO) -> None:
        self.client = client
        self.args = args
        self.out = out
        self.err = err
        self.session: Session | None = None

    def open(self, image: str, *, video: bool = False) -> None:
        if video:
            new = self.client.open_session(
                video=image, num_frames=self.args.num_frames, system_prompt=self.args.system_prompt
            )
        else:
            new = self.client.open_session(image, system_prompt=self.args.system_prompt)
        old, self.session = self.session, new
        if old is not None:
            try:
                old.close()
            except LlavaError as exc:
                self.note(f"closing the previous session failed: {exc}")
        for done in new.downsized:  # always said: the server sees another file than the one given
            self.note(f"[{done}]")
        for warning in new.open_warnings:  # always said too: the server did otherwise than asked
            self.note(f"[server: {warning}]")
        if self.args.verbose:
            expires = new.expires_at.strftime("%Y-%m-%d %H:%M:%SZ") if new.expires_at else "?"
            what = "video" if video else "image"
            self.note(f"[session {new.id} on {image}: {new.image_tokens} {what} tokens, expires {expires}]")

    def close(self) -> None:
        if self.session is not None:
            try:
                self.session.close()
            except LlavaError as exc:
                self.note(f"closing the session failed: {exc}")

    def note(self, text: str) -> None:
        print(text, file=self.err, flush=True)

    def write(self, piece: str) -> None:
        """An answer's piece on stdout, its control characters shown as U+FFFD (:func:`terminal_text`)."""
        self.out.write(terminal_text(piece))

    def ask(self, question: str, *, prefix: str = "") -> bool:
        """Stream one answer to stdout; returns False when interrupted."""
        assert self.session is not None
        params = {}
        if self.args.max_new_tokens is not None:
            params["max_new_tokens"] = self.args.max_new_tokens
        if self.args.temperature is not None:
            params["temperature"] = self.args.temperature
        if prefix:
            self.out.write(prefix)
        try:
            with self.session.stream(question, **params) as stream:
                for piece in stream:
                    self.write(piece)
                    self.out.flush()
        except KeyboardInterrupt:
            self.out.write("\n")
            self.note("[interrupted]")
            return False
        finally:
            self.out.flush()
        self.out.write("\n")
        self.out.flush()
        answer = stream.answer
        if answer is not None and answer.truncated_turns:  # always said: the model forgot something
            self.note(_truncation(answer))
        if answer is not None and self.args.verbose:
            self.note(_stats(answer))
        return True

    def command(self, line: str) -> bool:
        """Run a /command; return False to quit."""
        name, _, rest = line.partition(" ")
        if name in ("/quit", "/exit", "/q"):
            return False
        if name in ("/help", "/?"):
            self.note(_HELP)
            return True
        if name == "/reset":
            assert self.session is not None
            self.session.reset()
            self.note("[conversation forgotten; same images]")
        elif name == "/add":
            assert self.session is not None
            if not rest.strip():
                self.note("usage: /add PATH|URL")
            else:
                source = rest.strip()
                added = self.session.add_video(source) if _is_video(source) else self.session.add_image(source)
                if added.downsized is not None:
                    self.note(f"[{added.downsized}]")
                for warning in added.warnings:
                    self.note(f"[server: {warning}]")
                self.note(f"[image {added.images} added: {added.image_tokens} image tokens]")
        elif name in ("/image", "/video"):
            source = rest.strip()
            if not source:
                self.note(f"usage: {name} PATH|URL")
            elif name == "/image" and _is_video(source):
                self.note(f"{source} is a video: /video {source}")
            else:
                self.open(source, video=name == "/video")
                self.note(f"[new session on {source}]")
        else:
            self.note(f"unknown command {name}; {_HELP}")
        return True

    def loop(self, lines, interactive: bool) -> int:
        """Answer each line; returns the exit status: piped input (a script) that runs out gets 1 when
        any line failed; at a terminal, an error already shown and recovered from (the chat went on)
        leaves 0, and so does a ``/quit`` anywhere: the user ended the chat, its errors already shown."""
        status = 0
        for raw in lines:
            line = raw.strip()
            if not line:
                continue
            try:
                if line.startswith("/"):
                    if not self.command(line):
                        return 0
                    continue
                self.ask(line, prefix="llava> " if interactive else "")
            except (LlavaError, OSError) as exc:  # OSError: /image or /add with a missing file
                self.note(f"error: {exc}")
                status = 0 if interactive else 1
        return status


class _StatelessChat(_Chat):
    """``--stateless``: no session; a :class:`~llava_client.Conversation` resent every turn."""

    def open(self, image: str, *, video: bool = False) -> None:
        self.conversation = self.client.conversation(
            system_prompt=self.args.system_prompt, cache_salt=self.args.cache_salt
        )
        self.images = [] if video else [image]  # they open the next question
        self.videos = [video_part(image, num_frames=self.args.num_frames)] if video else []
        self.sent: list[str] = []  # the images the conversation holds (sent with earlier questions)

    def close(self) -> None:
        """Nothing is held on the server."""

    def ask(self, question: str, *, prefix: str = "") -> bool:
        """Stream one answer to stdout (with --verbose: time to first token, reused tokens and the bytes
        the turn sent); False if interrupted."""
        params = {"temperature": self.args.temperature or 0.0}
        if self.args.max_new_tokens is not None:
            params["max_tokens"] = self.args.max_new_tokens
        self.out.write(prefix)
        t0, ttft_ms = time.perf_counter(), None
        try:
            for piece in self.conversation.ask_stream(question, self.images, videos=self.videos, **params):
                if ttft_ms is None:
                    ttft_ms = (time.perf_counter() - t0) * 1000.0
                self.write(piece)
                self.out.flush()
        except KeyboardInterrupt:
            self.note("\n[interrupted]")
            return False
        self.sent += self.images
        self.images, self.videos = [], []
        self.out.write("\n")
        self.out.flush()
        for warning in self.conversation.last_warnings:
            self.note(f"[server: {warning}]")
        if self.args.verbose:
            usage = self.conversation.last_usage
            reused = f"reused {usage.cached_tokens} of {usage.prompt_tokens} prompt tokens; " if usage else ""
            first = f"time to first token {ttft_ms:.0f} ms; " if ttft_ms is not None else ""
            self.note(f"[{first}{reused}{self.conversation.last_request_bytes:,} bytes sent]")
        return True

    def command(self, line: str) -> bool:
        """As :meth:`_Chat.command`, on the conversation the client holds."""
        name, _, rest = line.partition(" ")
        if name == "/reset":  # as in a session: the turns go, every image opens the next question
            kept = [m for m in self.conversation.messages if m["role"] == "system"]
            self.conversation.messages[:] = kept
            self.images, self.sent = self.sent + self.images, []
            self.note("[conversation forgotten; same images]")
            return True
        source = rest.strip()
        if name in ("/add", "/image", "/video") and source:
            video = name == "/video" or _is_video(source)
            if name == "/image" and video:
                self.note(f"{source} is a video: /video {source}")
                return True
            if name in ("/image", "/video"):
                self.open(source, video=video)
            elif video:
                self.videos.append(video_part(source, num_frames=self.args.num_frames))
            else:
                self.images.append(source)
            self.note(f"[{source} opens the next question]")
            return True
        return super().command(line)


def _aws_hint(exc: Exception) -> str:
    """One line for an error of boto3's configuration (:func:`~._transport.aws_setup_hint`), or a
    botocore error by its name; any other error is raised again."""
    hint = aws_setup_hint(exc)
    if hint is not None:
        return hint
    if type(exc).__module__.startswith("botocore"):
        return f"{type(exc).__name__}: {exc}"
    raise exc


def _stats(answer: Answer) -> str:
    usage = answer.usage
    server = answer.ttft_ms
    server_text = f" (server {server:.0f} ms)" if server is not None else ""
    rate = answer.timings.get("decode_tokens_per_s")
    rate_text = f", {rate:.1f} tokens/s" if rate else ""
    return (
        f"[time to first token {answer.client_ttft_ms:.0f} ms{server_text}; reused {usage.cached_tokens} of "
        f"{usage.prompt_tokens} prompt tokens; {usage.generated_tokens} tokens{rate_text}]"
    )


def _truncation(answer: Answer) -> str:
    n = answer.truncated_turns
    turns = "turn" if n == 1 else "turns"
    return f"[context full: the {n} oldest {turns} left the conversation to make room for this one]"


def _input_lines(prompt: str):
    while True:
        try:
            yield input(prompt)
        except EOFError:
            print(file=sys.stderr)
            return


def _unknown_option(parser: argparse.ArgumentParser, argv: list[str]) -> str:
    """The first option in ``argv`` that ``parser`` has not (nor abbreviates), with the closest it has:
    ``unrecognized option --imge (did you mean --image?)``; "" when there is none."""
    known = [s for action in parser._actions for s in action.option_strings]
    for arg in argv:
        if arg == "--":
            break
        name = arg.split("=", 1)[0]
        if not name.startswith("--") or name in known or any(k.startswith(name) for k in known):
            continue
        close = difflib.get_close_matches(name, known, n=1)
        return f"unrecognized option {name}" + (f" (did you mean {close[0]}?)" if close else "")
    return ""


def main(argv: list[str] | None = None) -> int:
    """Run ``llava-chat``; returns the exit status (0 ok, 1 an error, 2 bad arguments, 130 Ctrl-C)."""
    parser = _build_parser()
    unknown = _unknown_option(parser, sys.argv[1:] if argv is None else argv)
    if unknown:  # named before argparse's required-option check would hide it
        parser.error(unknown)
    args = parser.parse_args(argv)
    if args.endpoint_url and not args.endpoint:
        parser.error("--endpoint-url goes with --endpoint")
    if args.cache_salt and not args.stateless:
        parser.error("--cache-salt goes with --stateless")
    if args.num_frames is not None and not args.video:
        parser.error("--num-frames goes with --video")
    if args.api_key and not args.url:
        parser.error("--api-key goes with --url (an endpoint is reached with AWS credentials)")
    logging.basicConfig(level=logging.WARNING, format="llava-chat: %(message)s")
    try:
        if args.endpoint:
            client = SessionClient.from_endpoint(
                args.endpoint, region_name=args.region, timeout=(10.0, args.timeout), endpoint_url=args.endpoint_url
            )
        else:
            client = SessionClient.from_url(args.url, timeout=(10.0, args.timeout), api_key=args.api_key)
    except Exception as exc:  # noqa: BLE001 - botocore's configuration errors (no region), told in one line
        print(f"llava-chat: {_aws_hint(exc)}", file=sys.stderr)
        return 1
    chat = (_StatelessChat if args.stateless else _Chat)(client, args, sys.stdout, sys.stderr)
    source = args.video or args.image
    try:
        try:
            chat.open(source, video=bool(args.video))
        except (LlavaError, OSError, ValueError) as exc:
            chat.note(f"llava-chat: could not open a session on {source}: {exc}")
            return 1
        except Exception as exc:  # noqa: BLE001 - botocore's (no credentials): one line, not a traceback
            chat.note(f"llava-chat: could not open a session on {source}: {_aws_hint(exc)}")
            return 1
        if args.question:
            try:
                return 0 if chat.ask(args.question) else 130
            except LlavaError as exc:
                chat.note(f"error: {exc}")
                return 1
        interactive = sys.stdin.isatty()
        if interactive:
            chat.note(f"Chatting about {source}. {_HELP}")
            return chat.loop(_input_lines("you> "), interactive=True)
        return chat.loop(sys.stdin, interactive=False)
    except KeyboardInterrupt:
        chat.note("")
        return 130
    finally:
        chat.close()
        client.close()


if __name__ == "__main__":
    sys.exit(main())
