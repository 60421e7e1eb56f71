"""Client for llava-sessions: multi-turn chat about one image, over HTTP or a SageMaker endpoint.

::

    from llava_client import SessionClient

    client = SessionClient.from_url("http://127.0.0.1:8080")        # or SessionClient.from_endpoint("name")
    with client.open_session("photo.jpg") as session:
        print(session.ask("What is in this image?").text)
        with session.stream("And in the background?") as stream:
            for piece in stream:
                print(piece, end="", flush=True)

See :mod:`llava_client._client` for streams, retries and session recovery; ``llava-chat`` for a
terminal chat; ``python -m llava_tools.demo`` for a scripted local demo.
"""

from ._chat import ChatReply, ChatSession, image_part, video_part
from ._client import (
    DEFAULT_MAX_RETRIES,
    DEFAULT_RESTART_WAIT_S,
    INITIAL_RETRY_DELAY_S,
    MAX_BODY_BYTES,
    MAX_RETRY_DELAY_S,
    AnswerStream,
    Session,
    SessionClient,
    should_retry,
)
from ._conversation import Conversation
from ._exceptions import (
    APIConnectionError,
    APIStatusError,
    APITimeoutError,
    AuthenticationError,
    ContextLengthExceeded,
    ImageLimitExceeded,
    InternalServerError,
    InvalidRequest,
    LlavaError,
    Overloaded,
    PayloadTooLarge,
    RateLimited,
    SessionBusy,
    SessionEvicted,
    SessionExpired,
    SessionGone,
    SessionNotFound,
    error_class,
)
from ._images import ImageInput
from ._streaming import ChatStream, ChatStreamEvent, ChatUsage
from ._transport import DEFAULT_TIMEOUT, HttpTransport, RawResponse, Transport, parse_session_header
from ._types import AddedImage, Answer, GenerationParams, Recovery, Token, Usage
from .sagemaker import SageMakerTransport

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_MAX_RETRIES",
    "DEFAULT_RESTART_WAIT_S",
    "DEFAULT_TIMEOUT",
    "INITIAL_RETRY_DELAY_S",
    "MAX_BODY_BYTES",
    "MAX_RETRY_DELAY_S",
    "APIConnectionError",
    "APIStatusError",
    "APITimeoutError",
    "AddedImage",
    "Answer",
    "AnswerStream",
    "AuthenticationError",
    "ChatReply",
    "ChatSession",
    "ChatStream",
    "ChatStreamEvent",
    "ChatUsage",
    "ContextLengthExceeded",
    "Conversation",
    "GenerationParams",
    "HttpTransport",
    "ImageInput",
    "ImageLimitExceeded",
    "InternalServerError",
    "InvalidRequest",
    "LlavaError",
    "Overloaded",
    "PayloadTooLarge",
    "RateLimited",
    "RawResponse",
    "Recovery",
    "SageMakerTransport",
    "Session",
    "SessionBusy",
    "SessionClient",
    "SessionEvicted",
    "SessionExpired",
    "SessionGone",
    "SessionNotFound",
    "Token",
    "Transport",
    "Usage",
    "error_class",
    "image_part",
    "video_part",
    "parse_session_header",
    "should_retry",
]
