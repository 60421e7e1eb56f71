"""A request's way through the worker, counted: files, function returns and calls back up (tiny model).

Drives the TorchServe entry (``handler/llava_handler.py``) in process with TorchServe's context API
(the methods and attributes ``ts.context.Context`` gives a handler; a stand-in here, since no frontend
runs), and records every Python call and return in the worker's code (``handler/``) with
``sys.setprofile`` while one request is served, over every ``handle()`` call it takes:

- **files**: distinct modules of the worker the request passes through;
- **returns**: function returns in them;
- **calls back up**: calls into a module that is already on the stack below the caller's module (the
  request went down from it and comes back up into it: the shape the layout rules forbid);
- **the wire's way down / back**: modules called while no module of the engine (``engine/``,
  ``model/``, ``sessions/``) is on the stack, before the engine's first ``step`` (down: the body
  read, validated, its images fetched, the engine's API called) and after it (back: the frames
  written).

Requests: one OpenAI chat turn with an image (inline base64) in a session opened with AWS's
``{"requestType": "NEW_SESSION"}``, and one native ``generate`` in a session opened on the same image.
The counts do not depend on the machine; run it on two checkouts to compare them.

Usage: python benchmarks/trace_request.py [--max-tokens 4] [--json PATH]

``--json`` also writes the counts and the wire's ways per request (``tests/project/test_layout.py`` holds
them to the layout's goal: at most 12 files each way, no call back up).
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
import tempfile
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "handler"))

from llava_handler import LlavaHandler  # noqa: E402
from llava_tools.demo.samples import sample_photo  # noqa: E402
from llava_tools.tiny_model import write_checkpoint  # noqa: E402

#: The engine's API module, and the modules below the wire (the wire's way does not count them).
ENGINE_API = "llava_sessions/engine/engine.py"
ENGINE_LAYER = ("llava_sessions/engine/", "llava_sessions/model/", "llava_sessions/sessions/")

SESSION = "X-Amzn-SageMaker-Session-Id"
START = "X-Amzn-SageMaker-New-Session-Id"
END = "X-Amzn-SageMaker-Closed-Session-Id"


class Context:
    """TorchServe's handler context for one batch of one row (``ts.context.Context``'s API)."""

    header_key_sequence_id = SESSION
    header_key_sequence_start = START
    header_key_sequence_end = END

    def __init__(self, model_dir: Path, request_id: str = "", session_id: str | None = None) -> None:
        self.system_properties = {"model_dir": str(model_dir), "gpu_id": None}
        self.model_yaml_config = {"handler": {"model_dir": str(model_dir), "device": "cpu", "dtype": "float32"}}
        self.metrics = None
        self.request_id, self.session_id = request_id, session_id
        self.headers: dict[str, str] = {}
        self.status = 0
        self.stopping_criteria: list[Callable[[Any], Any]] = []

    def get_request_id(self, idx: int = 0) -> str:
        return self.request_id

    def get_sequence_id(self, idx: int) -> str | None:
        return self.session_id

    def get_request_header(self, idx: int, key: str) -> str | None:
        return None

    def set_response_status(self, code: int = 200, phrase: str = "", idx: int = 0) -> None:
        self.status = code

    def set_response_content_type(self, idx: int, value: str) -> None:
        self.headers["Content-Type"] = value

    def set_response_header(self, idx: int, key: str, value: str) -> None:
        self.headers[key] = value


def serve(handler: LlavaHandler, model_dir: Path, body: dict[str, Any] | None, session_id: str | None) -> bytes:
    """One request through ``handler.handle`` and its continuations; returns its body bytes."""
    rid = uuid.uuid4().hex
    out = b""
    data: list[dict[str, Any]] = [{"body": json.dumps(body).encode()}]
    while True:
        ctx = Context(model_dir, rid, session_id)
        out += handler.handle(data, ctx)[0]
        if ctx.stopping_criteria[0](None) is not False:
            return out
        data = [{}]


class Tracer:
    """``sys.setprofile`` hook counting files, returns and calls back up in ``root``'s modules."""

    def __init__(self, root: Path) -> None:
        self.root = str(root)
        self.files: set[str] = set()
        self.returns = 0
        self.back_up = 0
        self.back_up_pairs: Counter[tuple[str, str]] = Counter()
        self.stack: list[str] = []
        self.down: list[str] = []  # the wire's way, in the order first called
        self.back: list[str] = []
        self.stepped = False

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        name = frame.f_code.co_filename
        if not name.startswith(self.root) or event not in ("call", "return"):
            return
        module = str(Path(name).relative_to(self.root))
        if event == "call":
            if self.stack and module != self.stack[-1] and module in self.stack[:-1]:
                self.back_up += 1
                self.back_up_pairs[(self.stack[-1], module)] += 1
            self.files.add(module)
            if module == ENGINE_API and frame.f_code.co_name == "step":
                self.stepped = True
            if not any(m.startswith(ENGINE_LAYER) for m in [*self.stack, module]):
                way = self.back if self.stepped else self.down
                if module not in way:
                    way.append(module)
            self.stack.append(module)
        else:
            self.returns += 1
            if self.stack:
                self.stack.pop()


def traced(call: Callable[[], bytes]) -> tuple[Tracer, bytes]:
    tracer = Tracer(REPO / "handler")
    sys.setprofile(tracer)
    try:
        out = call()
    finally:
        sys.setprofile(None)
    return tracer, out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--json", type=Path, help="write the counts and the wire's ways here")
    args = parser.parse_args()
    model_dir = write_checkpoint("tiny", Path(tempfile.mkdtemp()) / "tiny", seed=0, max_positions=1024)
    handler = LlavaHandler()
    handler.initialize(Context(model_dir))
    photo = base64.b64encode(sample_photo()).decode()
    uri = "data:image/jpeg;base64," + photo
    chat = {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "image_url", "image_url": {"url": uri}}, {"type": "text", "text": "What is it?"}],
            }
        ],
        "max_tokens": args.max_tokens,
        "temperature": 0,
    }
    generate = {"type": "generate", "prompt": "What is it?", "parameters": {"max_new_tokens": args.max_tokens}}
    opened = json.loads(serve(handler, model_dir, {"type": "open_session", "image": {"base64": photo}}, None))
    serve(handler, model_dir, generate, opened["session_id"])  # warm: every lazy import and cache is made
    rows, report = [], {}
    for name, body in (("chat turn with an image", chat), ("native generate", generate)):
        if body is chat:
            sid = json.loads(serve(handler, model_dir, {"requestType": "NEW_SESSION"}, None))["session_id"]
        else:
            sid = opened["session_id"]
        tracer, out = traced(lambda body=body, sid=sid: serve(handler, model_dir, body, sid))
        assert b'"error"' not in out, out[:300]
        rows.append((name, len(tracer.files), tracer.returns, tracer.back_up, sorted(tracer.files)))
        report[name] = {
            "files": sorted(tracer.files),
            "returns": tracer.returns,
            "calls_back_up": tracer.back_up,
            "down": tracer.down,
            "back": tracer.back,
        }
        print(f"{name}: the wire's way down, {len(tracer.down)} files: {', '.join(tracer.down)}")
        print(f"{name}: the wire's way back, {len(tracer.back)} files: {', '.join(tracer.back)}")
        ups = ", ".join(f"{a} -> {b} x{n}" for (a, b), n in tracer.back_up_pairs.most_common())
        print(f"{name}: calls back up: {ups or 'none'}")
    print(f"{'request':<26} {'files':>6} {'returns':>8} {'calls back up':>14}")
    for name, files, returns, back_up, _ in rows:
        print(f"{name:<26} {files:>6} {returns:>8} {back_up:>14}")
    for name, *_, modules in rows:
        print(f"\n{name}: {', '.join(modules)}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
