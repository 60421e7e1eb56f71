"""``llava-local-endpoint``: a SageMaker-runtime look-alike on 127.0.0.1 over N local TorchServes
(:mod:`.endpoint`), its sticky and ``PREFIX_AWARE`` routing (:mod:`.routing`), its HTTP proxy
(:mod:`.runtime_front`) and SageMaker's wire shapes (:mod:`.sagemaker_wire`). A development and test
tool, not a production router."""

from .endpoint import (
    MAX_BODY_BYTES,
    BackendRef,
    LocalEndpoint,
    Router,
    RouterServer,
    encode_event,
    main,
    model_error_body,
    payload_part_event,
    stream_error_event,
)

__all__ = [
    "MAX_BODY_BYTES",
    "BackendRef",
    "LocalEndpoint",
    "Router",
    "RouterServer",
    "encode_event",
    "main",
    "model_error_body",
    "payload_part_event",
    "stream_error_event",
]
