"""Where an image comes from: the :class:`ImageSource` both dialects name images by (no torch).

A URL is vetted when fetched (scheme, host, resolved address: :mod:`.fetch`); an S3 URI must look
like ``s3://bucket/key``; base64 is the encoded file (a ``data:image/...;base64,`` prefix accepted).
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from ..wire.inbound import Inbound

__all__ = ["S3_URI_RE", "ImageSource"]

#: What an S3 URI must look like: ``s3://<bucket of 3-255 characters>/<key>``.
S3_URI_RE = re.compile(r"^s3://[^/\s]{3,255}/[^\s].{0,1023}\Z", re.DOTALL)


class ImageSource(Inbound):
    """Where an image comes from: exactly one of ``url``, ``s3_uri`` or ``base64``.

    ``url`` is vetted when fetched (scheme, host, resolved address: see ``images.py``);
    ``s3_uri`` must look like ``s3://bucket/key``; ``base64`` is the encoded file (a
    ``data:image/...;base64,`` prefix is accepted).
    """

    url: Annotated[str, Field(min_length=1, max_length=8192)] | None = None
    s3_uri: Annotated[str, Field(min_length=1, max_length=1100)] | None = None
    base64: Annotated[str, Field(min_length=1)] | None = None

    @field_validator("url")
    @classmethod
    def _not_data(cls, value: str | None) -> str | None:
        if value is not None and value[:5].lower() == "data:":
            raise PydanticCustomError("data_uri_in_url", "a data: URI goes in image.base64 (url is fetched)")
        return value

    @field_validator("s3_uri")
    @classmethod
    def _s3_shape(cls, value: str | None) -> str | None:
        if value is not None and not S3_URI_RE.match(value):
            raise PydanticCustomError("s3_uri_format", "must look like s3://bucket/key")
        return value

    @model_validator(mode="after")
    def _exactly_one(self) -> ImageSource:
        given = [name for name in ("url", "s3_uri", "base64") if getattr(self, name) is not None]
        if len(given) != 1:
            raise PydanticCustomError("image_source", "give exactly one of url, s3_uri, base64")
        return self

    @property
    def kind(self) -> Literal["url", "s3_uri", "base64"]:
        """Which source is set: ``"url"``, ``"s3_uri"`` or ``"base64"``."""
        if self.url is not None:
            return "url"
        if self.s3_uri is not None:
            return "s3_uri"
        return "base64"
