"""Multi-turn image chat sessions: :class:`SessionClient`, :class:`Session`, :class:`AnswerStream`.

Usage::

    from llava_client import SessionClient

    client = SessionClient.from_url("http://127.0.0.1:8080")          # llava-serve / TorchServe
    # client = SessionClient.from_endpoint("my-llava-endpoint")        # SageMaker stateful endpoint
    with client.open_session("photo.jpg") as session:                 # path, bytes, PIL image, URL, s3:// URI
        answer = session.ask("What is in this image?", max_new_tokens=64)
        print(answer.text, answer.usage.cached_tokens)

        with session.stream("Describe it in detail.") as stream:      # iterator of text pieces
            for piece in stream:
                print(piece, end="", flush=True)
        print(stream.answer.timings["ttft_ms"])                       # the Answer, once complete

        session.ask("Is it daytime?", remember=False)                 # not added to the history
        session.reset()                                                # forget the history, keep the image
    # leaving the block closes the session (close() is idempotent)

Streams: :mod:`._streaming`; retries: :mod:`._base_client`; recovery of a lost session: :mod:`._sessions`.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from . import _chat
from ._base_client import (
    DEFAULT_MAX_RETRIES,
    DEFAULT_RESTART_WAIT_S,
    INITIAL_RETRY_DELAY_S,
    MAX_RETRY_DELAY_S,
    BaseClient,
    should_retry,
)
from ._chat import ChatReply, ChatSession
from ._conversation import Conversation
from ._images import MAX_BODY_BYTES, ImageInput, VideoInput, describe_image, video_payload
from ._sessions import Session, open_session_request
from ._streaming import AnswerStream, ChatStream
from ._transport import DEFAULT_TIMEOUT, HttpTransport

#: The environment variable a server's API key is read from (``llava-serve --api-key``'s too).
API_KEY_ENV = "LLAVA_API_KEY"

__all__ = [
    "DEFAULT_MAX_RETRIES",
    "DEFAULT_RESTART_WAIT_S",
    "INITIAL_RETRY_DELAY_S",
    "MAX_BODY_BYTES",
    "MAX_RETRY_DELAY_S",
    "AnswerStream",
    "Session",
    "SessionClient",
    "should_retry",
]

log = logging.getLogger("llava_client")


class SessionClient(BaseClient):
    """Opens image chat sessions over an injected transport.

    Args: the transport, ``max_retries``, ``auto_recover``, ``max_body_bytes``, ``restart_wait_s``, as
    :class:`~llava_client._base_client.BaseClient` (retries and the request limit live there).

    Use :meth:`from_url` / :meth:`from_endpoint` for the common cases. ``with SessionClient(...)``
    closes the transport at the end.
    """

    @classmethod
    def from_url(
        cls,
        base_url: str,
        *,
        timeout: float | tuple[float, float] = DEFAULT_TIMEOUT,
        api_key: str | None = None,
        **kwargs: Any,
    ) -> SessionClient:
        """A client for ``{base_url}/invocations`` over plain HTTP (``llava-serve``, a local container);
        ``api_key``: the server's ``--api-key``, sent as ``Authorization: Bearer <key>`` (default: the
        ``LLAVA_API_KEY`` environment variable, if set)."""
        key = api_key if api_key is not None else os.environ.get(API_KEY_ENV)
        headers = {"Authorization": f"Bearer {key}"} if key else None
        return cls(HttpTransport(base_url, timeout=timeout, headers=headers), **kwargs)

    @classmethod
    def from_endpoint(
        cls,
        endpoint_name: str,
        *,
        region_name: str | None = None,
        client: Any = None,
        session: Any = None,
        timeout: float | tuple[float, float] = DEFAULT_TIMEOUT,
        endpoint_url: str | None = None,
        inference_component_name: str | None = None,
        prefix_aware_id: str | None = None,
        **kwargs: Any,
    ) -> SessionClient:
        """A client for a SageMaker endpoint (see :class:`~llava_client.SageMakerTransport`);
        ``endpoint_url``: another SageMaker runtime URL (``llava-local-endpoint``: dummy credentials);
        ``prefix_aware_id``: the application's id for ``PREFIX_AWARE`` routing (``PrefixAwareId``)."""
        from .sagemaker import SageMakerTransport

        transport = SageMakerTransport(
            endpoint_name,
            client=client,
            session=session,
            region_name=region_name,
            timeout=timeout,
            endpoint_url=endpoint_url,
            inference_component_name=inference_component_name,
            prefix_aware_id=prefix_aware_id,
        )
        return cls(transport, **kwargs)

    def open_session(
        self,
        image: ImageInput | None = None,
        *,
        video: VideoInput | None = None,
        num_frames: int | None = None,
        fps: float | None = None,
        system_prompt: str | None = None,
    ) -> Session:
        """Open a session on ``image``, or on ``video``, and return it (use it as a context manager to
        close it).

        Args:
            image: a local path, image file bytes, a PIL image (sent inline, base64), an
                ``http(s)://`` URL or an ``s3://bucket/key`` URI (fetched by the server).
            video: instead of ``image``, a video (a model with a video path: LLaVA-OneVision or
                LLaVA-NeXT-Video): a local
                MP4 or WebM file or its bytes (sent inline, within the request limit), an
                ``http(s)://`` URL or an ``s3://`` URI; its frames are sampled uniformly by the server.
            num_frames, fps: with ``video``, how its frames are sampled (one or neither: the server's
                ``video_num_frames``).
            system_prompt: replaces the server's default system prompt for this session.

        Raises:
            PayloadTooLarge: an inline image whose request would exceed ``max_body_bytes``
                (checked before sending: pass an S3 URI or URL instead).
            InvalidRequest: the server cannot use the image (``image_invalid``, ``image_fetch_failed``,
                ``image_url_forbidden``) or the request is malformed.
            APIStatusError, APIConnectionError: as for any call.
            FileNotFoundError: a local path that does not exist.
            ValueError: neither or both of ``image`` and ``video``.
        """
        if (image is None) == (video is None):
            raise ValueError("give an image or a video to open the session on")
        if video is not None:
            medium = {"video": video_payload(video, num_frames=num_frames, fps=fps)}
            opened = open_session_request(self, medium, system_prompt)
            log.debug("opened session %s on %s", opened.session_id, describe_image(medium))
            return Session(self, opened, medium, system_prompt)
        payload, downsized = self.inline_image(image)
        opened = open_session_request(self, payload, system_prompt)
        log.debug("opened session %s on %s", opened.session_id, describe_image(payload))
        session = Session(self, opened, payload, system_prompt)
        if downsized is not None:
            session.downsized.append(downsized)
        return session

    def chat_session(self) -> ChatSession:
        """Open a session for the chat dialect (AWS's ``{"requestType": "NEW_SESSION"}``): it holds no
        image until a conversation brings one. See :mod:`llava_client._chat`.

        Raises:
            APIStatusError, APIConnectionError: as for any call.
        """
        session_id, _, _ = self.invoke_open({"requestType": "NEW_SESSION"}, "NEW_SESSION")
        return ChatSession(self, session_id)

    def conversation(
        self,
        *,
        session: ChatSession | None = None,
        system_prompt: str | None = None,
        cache_salt: str | None = None,
        references: bool = True,
    ) -> Conversation:
        """A conversation this client keeps and resends each turn, each image's bytes sent once and
        named by its ``uuid`` afterwards (:mod:`llava_client._conversation`): without a session the
        server's conversation cache serves the resent part; with ``session`` (a :meth:`chat_session`)
        the session does. ``cache_salt``: shared cached state only within an equal salt; ``references``:
        False sends every image's bytes every turn (SageMaker ``PREFIX_AWARE`` over several instances)."""
        return Conversation(
            self, session=session, system_prompt=system_prompt, cache_salt=cache_salt, references=references
        )

    def complete(self, messages: list[dict[str, Any]], **params: Any) -> ChatReply:
        """A sessionless chat completion: ``messages`` (OpenAI's format; images as ``image_url`` parts,
        see :func:`~llava_client.image_part`) answered outside any session. ``params``: OpenAI's
        (``max_tokens``, ``temperature``, ``top_p``, ``stop``, ``seed``, ...).

        Raises:
            APIStatusError, APIConnectionError: as for any call.
        """
        return _chat.complete(self, messages, "", **params)

    def stream_chat(self, messages: list[dict[str, Any]], **params: Any) -> ChatStream:
        """As :meth:`complete`, a :class:`~llava_client.ChatStream` of the answer (sent now): text
        deltas as they come, the last event with ``finish_reason`` and ``usage``."""
        return _chat.stream(self, messages, "", **params)
