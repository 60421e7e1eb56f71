"""A scripted session against a local TorchServe: ``python -m llava_tools.demo [--model-dir DIR]``.

This is what ``make demo`` runs. Without ``--model-dir`` it builds the ``tiny`` random-weight
checkpoint (answers are gibberish; everything else is the real serving path). Then it

1. starts a local TorchServe with the handler (:class:`llava_tools.serve.server.LocalServer`, free port),
2. opens a session on a real photograph (scikit-image's astronaut, saved as JPEG),
3. asks three questions: one streamed (pieces printed as they arrive), one that refers to the
   previous answer (remembered history), one independent (``remember=False``),
4. closes the session, prints a transcript with each turn's time to first token (measured here
   and reported by the server) and reused (cached) prompt tokens, and stops the server.

Exit status 0 on success, 1 on any failure.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from llava_client import Answer, LlavaError, SessionClient
from llava_client.cli import terminal_text
from llava_sessions.errors import counted

from ..cli import checkpoint_folder_problem
from .samples import sample_photo

__all__ = ["main"]

_BANNER = """\
llava-sessions demo: one image, three questions, one session
============================================================"""

_TINY_NOTE = """\
NOTE: no --model-dir given, so this uses the `tiny` checkpoint: a LLaVA with RANDOM weights built on
the fly. Its answers are gibberish; the serving path (TorchServe, sessions, KV-cache reuse,
streaming) is the real one. To run on a real model, download a llava-hf checkpoint folder and run
    make demo MODEL_DIR=/path/to/llava-1.5-7b-hf
(or: python -m llava_tools.demo --model-dir /path/to/llava-1.5-7b-hf)."""


@dataclass
class _Turn:
    label: str
    question: str
    answer: Answer


def _say(text: str = "") -> None:
    print(text, flush=True)


def _save_photo(directory: Path) -> Path:
    path = directory / "astronaut.jpg"
    path.write_bytes(sample_photo("astronaut"))
    return path


def _turn_line(answer: Answer, *, streamed: bool) -> str:
    """The turn's numbers: a streamed answer's first token as this client saw it; a whole answer's time
    here (its first token is not seen here), each beside the server's own time to first token."""
    usage = answer.usage
    server = f"{answer.ttft_ms:.0f} ms reported by the server" if answer.ttft_ms is not None else ""
    if streamed:
        timing = f"time to first token: {answer.client_ttft_ms:.0f} ms measured here" + (
            f", {server}" if server else ""
        )
    else:
        timing = f"whole answer in {answer.client_total_ms:.0f} ms measured here (not streamed)" + (
            f", first token {server}" if server else ""
        )
    return (
        f"    {timing} | "
        f"reused tokens: {usage.cached_tokens} of {usage.prompt_tokens} prompt tokens | "
        f"{usage.generated_tokens} tokens, finish: {answer.finish_reason}"
    )


def run(model_dir: Path | None, *, max_new_tokens: int, work_dir: Path) -> int:
    """Build (if needed), serve, chat, print; return the exit status."""
    from llava_tools.serve import LocalServer

    if model_dir is None:
        from llava_tools.tiny_model import write_checkpoint

        t0 = time.perf_counter()
        model_dir = Path(write_checkpoint("tiny", work_dir / "tiny-llava", seed=0))
        _say(f"[1/4] built the tiny checkpoint in {time.perf_counter() - t0:.1f} s: {model_dir}")
    else:
        _say(f"[1/4] model folder: {model_dir}")
    photo = _save_photo(work_dir)
    t0 = time.perf_counter()
    with LocalServer(model_dir, startup_timeout_s=900.0) as server:
        _say(f"[2/4] TorchServe is serving at {server.url} (started in {time.perf_counter() - t0:.1f} s)")
        with SessionClient.from_url(server.url) as client:
            turns = _chat(client, photo, max_new_tokens)
    _say("[4/4] stopped the server")
    _say()
    first, second = turns[0].answer.usage, turns[1].answer.usage
    _say(
        f"Turn 1 reused {first.cached_tokens} cached prompt tokens (the image prefix computed when the session "
        f"opened); turn 2 reused {second.cached_tokens} (image prefix and history) and prefilled only "
        f"{second.prompt_tokens - second.cached_tokens} new ones."
    )
    _say()
    _say(_NEXT_STEPS.replace("{venv}", _venv()).replace("{photo}", _photo_for_next_steps()))
    return 0


#: What to run next, printed at the end (a server of your own, then a client of your choice).
_NEXT_STEPS = """Next steps
----------
  source {venv}/bin/activate                           # the commands below live there ({venv}/bin)
  llava-tiny-model --out /tmp/tiny-llava               # or any llava-hf checkpoint folder
  llava-serve --model-dir /tmp/tiny-llava --port 8080  # a server of your own (Ctrl-C stops it)
  llava-chat --url http://127.0.0.1:8080 --image {photo}  # a terminal chat
  llava-web --url http://127.0.0.1:8080                            # the chat page
  curl -s localhost:8080/invocations -H 'Content-Type: application/json' \
       -d '{"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 16}'
Protocol: docs/api.md; Python client: README.md (The API at a glance)."""


def _photo_for_next_steps() -> str:
    """A photo for the next steps' ``--image``: the sample astronaut, written once into the virtual
    environment (``<venv>/share/llava-sessions/astronaut.jpg``, which git ignores); its path as shown."""
    path = Path(sys.prefix) / "share" / "llava-sessions" / "astronaut.jpg"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(sample_photo("astronaut"))
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _venv() -> str:
    """The virtual environment this demo runs in (``make install``'s ``.venv``), as a path relative to
    the working directory when it is below it."""
    prefix = Path(sys.prefix)
    try:
        return str(prefix.relative_to(Path.cwd()))
    except ValueError:
        return str(prefix)


def _chat(client: SessionClient, photo: Path, max_new_tokens: int) -> list[_Turn]:
    turns: list[_Turn] = []
    size_kb = photo.stat().st_size / 1024
    t0 = time.perf_counter()
    with client.open_session(photo) as session:
        expires = session.expires_at.strftime("%Y-%m-%d %H:%M:%SZ") if session.expires_at else "?"
        _say(
            f"[3/4] opened session {session.id} on {photo.name} (skimage astronaut, JPEG, {size_kb:.0f} KB) "
            f"in {(time.perf_counter() - t0) * 1000:.0f} ms: {session.image_tokens} image tokens, expires {expires}"
        )
        _say()

        q1 = "What is in this image?"
        _say(f"Q1 (streamed): {q1}")
        print("A1: ", end="", flush=True)
        with session.stream(q1, max_new_tokens=max_new_tokens) as stream:
            for piece in stream:
                print(terminal_text(piece), end="", flush=True)
        _say()
        assert stream.answer is not None
        turns.append(_Turn("Q1 (streamed)", q1, stream.answer))
        _say(_turn_line(stream.answer, streamed=True))

        q2 = "Say that again in fewer words."
        _say(f"Q2 (refers to the previous answer, remembered history): {q2}")
        answer = session.ask(q2, max_new_tokens=max_new_tokens)
        _say(f"A2: {terminal_text(answer.text)}")
        turns.append(_Turn("Q2 (uses history)", q2, answer))
        _say(_turn_line(answer, streamed=False))

        q3 = "Is it daytime in this picture?"
        _say(f"Q3 (independent, remember=False): {q3}")
        answer = session.ask(q3, remember=False, max_new_tokens=max_new_tokens)
        _say(f"A3: {terminal_text(answer.text)}")
        turns.append(_Turn("Q3 (independent)", q3, answer))
        _say(_turn_line(answer, streamed=False))
        _say(f"history kept by the session: {counted(len(session.history), 'turn')} (Q3 was not remembered)")
    _say(f"closed session {session.id}")
    return turns


def main(argv: list[str] | None = None) -> int:
    """Run the demo; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m llava_tools.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, help="a llava-hf checkpoint folder (default: build `tiny`)")
    parser.add_argument("--max-new-tokens", type=int, default=24, help="longest answer in tokens (default 24)")
    args = parser.parse_args(argv)
    _say(_BANNER)
    if args.model_dir is None:
        _say(_TINY_NOTE)
    else:
        _say(f"Model: {args.model_dir}")
        problem = checkpoint_folder_problem(args.model_dir)
        if problem is not None:
            print(f"demo: {problem}", file=sys.stderr)
            return 1
    _say()
    try:
        with tempfile.TemporaryDirectory(prefix="llava-demo-") as tmp:
            return run(args.model_dir, max_new_tokens=args.max_new_tokens, work_dir=Path(tmp))
    except (LlavaError, OSError, RuntimeError) as exc:  # ServerStartError is a RuntimeError
        print(f"demo: failed: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("demo: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
