"""The worker core: what TorchServe's worker process loads through ``handler/llava_handler.py``.

Request path: :mod:`.wire.framing` (TorchServe's requests in, frames out) → :mod:`.service` (the body
loaded, its dialect decided once) → :mod:`.native` or :mod:`.chat` (each dialect's protocol, serving
and replies) → :mod:`.engine` (sessions' tensors, prefill, decode) → :mod:`.model` (transformers'
LLaVA), with the sessions and their memory in :mod:`.sessions`, images in :mod:`.images`, sampling in
:mod:`.sampling`, the SageMaker header contract in :mod:`.wire.contract`, wiring in :mod:`.worker` and
TorchServe metrics in :mod:`.metrics`. Nothing here imports ``llava_tools``.
"""
