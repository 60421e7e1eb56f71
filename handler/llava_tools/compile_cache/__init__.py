"""``llava-compile-cache``: a model folder's compile cache, written on a GPU before deploying (:mod:`.cli`)."""

from .cli import main

__all__ = ["main"]
