"""A TorchServe handler at TorchServe's floor: it answers every request at once, running no model.

The floor comparison of ``benchmarks/concurrency.py`` serves it with the same TorchServe config as
ours (sequence + continuous batching, batchSize, maxBatchDelay, the session header keys, our
log4j2.xml), so what a request costs there is what any handler's request path costs here.

``LLAVA_FLOOR_BODY_FILE`` (optional) names a file whose bytes are the reply, so the floor can answer
with exactly our 1-token answer's body and headers (size and encoding isolated from our work);
otherwise the reply is ``{"ok": true}``. Every reply carries the request's session id header, as ours do.

``LLAVA_FLOOR_MODEL_DIR`` (optional) names a checkpoint: the handler then also runs the forward passes
of our 1-token follow-up, bare (a 12-token prefill over a cached 581-token prefix, then the cache
cropped back, as ``remember: false`` does), and reports their time as ``details.timings.total_ms``: a
floor for a handler that runs the same model work, with none of our per-call code around it.
"""

from __future__ import annotations

import json
import os
import time


class FloorHandler:
    """TorchServe custom handler: one fixed JSON reply per row, status 200, no stopping criterion."""

    def __init__(self) -> None:
        self.initialized = False
        self.body = b'{"ok": true}'
        self.session_header = "X-Amzn-SageMaker-Session-Id"

    def initialize(self, context) -> None:
        """Read the reply body (``LLAVA_FLOOR_BODY_FILE``) once."""
        path = os.environ.get("LLAVA_FLOOR_BODY_FILE")
        if path:
            with open(path, "rb") as f:
                self.body = f.read()
        model_dir = os.environ.get("LLAVA_FLOOR_MODEL_DIR")
        self.llava = None
        if model_dir:
            from llava_sessions.model import LlavaModel

            self.llava = LlavaModel.from_pretrained(model_dir, device="cpu", dtype="float32")
            text_ids = [t for t in range(3, 600) if t != self.llava.image_token_id]  # no image placeholder
            self.ids = [text_ids[i % len(text_ids)] for i in range(581 + 12)]
            self.cache = self.llava.new_cache()
            self.llava.prefill(self.cache, self.ids[:581], None)
        self.initialized = True

    def _forward(self) -> bytes:
        """The bare model work of a 1-token follow-up; returns the reply with its time as total_ms."""
        from llava_sessions.model.kv.cache import undo_pass

        t0 = time.perf_counter()
        logits = self.llava.prefill(self.cache, self.ids, None)
        int(logits.argmax())
        undo_pass(self.cache, 581)
        total_ms = (time.perf_counter() - t0) * 1000.0
        return json.dumps({"details": {"timings": {"total_ms": round(total_ms, 3)}}}).encode()

    def handle(self, data, context):
        """Answer every row at once with the fixed body."""
        if data is None:
            return None
        for i in range(len(data)):
            context.set_response_status(200, "", i)
            context.set_response_content_type(i, "application/json")
            session_id = context.get_sequence_id(i)
            if session_id:
                context.set_response_header(i, self.session_header, session_id)
        context.stopping_criteria = [lambda _output: None for _ in data]
        return [self.body if self.llava is None else self._forward() for _ in data]
