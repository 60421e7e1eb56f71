"""A TorchServe handler at TorchServe's floor: it answers every request at once, running no model.

The floor comparison of ``benchmarks/concurrency.py`` serves it with the same TorchServe config as
ours (sequence + continuous batching, batchSize, maxBatchDelay, the session header keys, our
log4j2.xml), so what a request costs there is what any handler's request path costs here.

``LLAVA_FLOOR_BODY_FILE`` (optional) names a file whose bytes are the reply, so the floor can answer
with exactly our 1-token answer's body and headers (size and encoding isolated from our work);
otherwise the reply is ``{"ok": true}``. Every reply carries the request's session id header, as ours do.
"""

from __future__ import annotations

import os


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
        self.initialized = True

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
        return [self.body for _ in data]
