"""Images both dialects take: where one comes from (``wire/inbound.py``'s ``ImageSource``), its fetch
under the SSRF guard (:mod:`.fetch`), its decode under a pixel cap (:mod:`.decode`). No torch."""

from .decode import DECODE_FORMATS, decode_image
from .fetch import fetch_image_bytes

__all__ = ["DECODE_FORMATS", "decode_image", "fetch_image_bytes"]
