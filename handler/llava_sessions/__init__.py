"""The worker core: what TorchServe's worker process loads through ``handler/llava_handler.py``.

Request path: :mod:`.codec` (decode_request / encode_*) → :mod:`.service` (admission, scheduler)
→ :mod:`.engine` (sessions' tensors, prefill, decode) → :mod:`.model` (transformers' LLaVA), with
the store in :mod:`.sessions`, the SageMaker header contract in :mod:`.contract`, wiring in
:mod:`.worker` and TorchServe metrics in :mod:`.metrics`. Nothing here imports ``llava_tools``.
"""
