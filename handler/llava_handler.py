"""TorchServe entry for llava-sessions: requests in, the service, each request's frame out.

All logic lives in the worker core ``llava_sessions``: the wiring (``worker``), the service and its
dialects, the engine, the store. TorchServe's context is read and written by the one owner of its
framing (``llava_sessions.wire.framing``: sequence id / start headers in; per-request status, headers,
content type and stopping criteria out; docs/platform.md). This file never
raises out of ``handle()`` (that would fail every request of the batch).
"""

from __future__ import annotations

import logging
import os

from llava_sessions.replicas import ReplicaRouter
from llava_sessions.service import SessionService
from llava_sessions.wire.framing import read_requests, write_replies
from llava_sessions.worker import WorkerOrigin, build_service, quiet_worker_logs

log = logging.getLogger(__name__)


class LlavaHandler:
    """TorchServe custom handler (one instance per worker process)."""

    def __init__(self) -> None:
        self.service: SessionService | ReplicaRouter | None = None
        self.initialized = False

    def initialize(self, context) -> None:
        """Load the model and build the service from the ``handler:`` section of model-config.yaml."""
        props = context.system_properties
        yaml_config = context.model_yaml_config or {}
        origin = WorkerOrigin(
            env=os.environ,
            archive_dir=props.get("model_dir"),
            gpu_id=props.get("gpu_id"),
            end_header=context.header_key_sequence_end,
        )
        self.service = build_service(
            yaml_config.get("handler") or {},
            origin,
            metrics=getattr(context, "metrics", None),
            batch_size=yaml_config.get("batchSize"),
        )
        quiet_worker_logs(self.service.settings.log_level)
        self.initialized = True

    def handle(self, data, context):
        """Serve one batch: returns one body (bytes) per request; framing: :mod:`llava_sessions.wire.framing`."""
        service = self.service
        if data is None or service is None:
            return None
        try:
            results = service.handle(read_requests(data, context))
        except Exception:  # noqa: BLE001 - last line of defence: never fail the whole batch
            log.exception("batch failed")
            results = [service.internal_error() for _ in data]
        bodies = write_replies(context, results)
        service.emit_metrics()
        return bodies
