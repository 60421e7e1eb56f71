"""TorchServe entry for llava-sessions: walk the batch, call the service, set per-row status/headers.

All logic lives in the worker core ``llava_sessions`` (worker wiring, codec, service, engine, store). This file only adapts
TorchServe's context: the sequence id / start headers in, per-row status, headers, content type
and stopping criteria out (shared/notes/torchserve-sagemaker.md). It never raises out of
``handle()`` (that would fail every row of the batch) and never uses
``send_intermediate_predict_response`` (it crashes sequence continuous batching).
"""

from __future__ import annotations

import logging
import os

from llava_sessions.replicas import ReplicaRouter
from llava_sessions.service import Row, SessionService
from llava_sessions.worker import build_service, quiet_worker_logs

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
        self.service = build_service(
            yaml_config.get("handler") or {},
            env=os.environ,
            archive_dir=props.get("model_dir"),
            gpu_id=props.get("gpu_id"),
            end_header=context.header_key_sequence_end,
            metrics=getattr(context, "metrics", None),
            batch_size=yaml_config.get("batchSize"),
        )
        quiet_worker_logs(self.service.settings.log_level)
        self.initialized = True

    def handle(self, data, context):
        """Serve one batch: returns one body (bytes) per row and sets ``context.stopping_criteria``."""
        service = self.service
        if data is None or service is None:
            return None
        try:
            rows = [
                Row(
                    request_id=context.get_request_id(i),
                    session_id=context.get_sequence_id(i),
                    minted=bool(context.get_request_header(i, context.header_key_sequence_start)),
                    body=(row or {}).get("body", (row or {}).get("data")),
                    accept=context.get_request_header(i, "Accept") or context.get_request_header(i, "accept"),
                )
                for i, row in enumerate(data)
            ]
            results = service.handle(rows)
        except Exception:  # noqa: BLE001 - last line of defence: never fail the whole batch
            log.exception("batch failed")
            results = [service.internal_error() for _ in data]
        for i, result in enumerate(results):
            context.set_response_status(result.status, "", i)
            context.set_response_content_type(i, result.content_type)
            for key, value in result.headers.items():
                context.set_response_header(i, key, value)
        context.stopping_criteria = [lambda _output, stop=r.stop: stop for r in results]
        service.emit_metrics()
        return [r.body for r in results]
