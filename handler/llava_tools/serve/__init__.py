"""The server and its proxy: ``llava-serve`` (:mod:`.cli`) over a supervised local TorchServe
(:mod:`.server`), the public port's proxy (:mod:`.front`: a truthful ``/ping``, OpenAI's routes, an
API key, a dead worker's requests held or answered ``503 model_not_ready``) and its image fetches
(:mod:`.image_relay`), TorchServe's files (:mod:`.torchserve_files`) and the container's entrypoint
(:mod:`.container`, ``llava-container-serve``)."""

from .cli import main
from .server import API_KEY_ENV, DEFAULT_STOP_GRACE_S, LocalServer, ServerStartError
from .torchserve_files import MODEL_NAME

__all__ = ["API_KEY_ENV", "DEFAULT_STOP_GRACE_S", "MODEL_NAME", "LocalServer", "ServerStartError", "main"]
