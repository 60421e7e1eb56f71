"""What the service handles: TorchServe's rows in, a result per row out, and the jobs in flight between calls.

Plain data shared by the service (:mod:`.service`) and its chat-completions part (:mod:`.chat_jobs`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .chat_codec import ChatStream
from .codec import JSON, AddImageCommand, ChatCommand, GenerateCommand, OpenCommand
from .engine import Generation, ImageTask
from .errors import ServiceError

__all__ = ["Job", "Row", "RowResult"]


@dataclass
class Row:
    """One row of a TorchServe batch.

    Attributes:
        request_id: TorchServe's request id (stable across a job's continuations).
        session_id: the sequence id header's value (``X-Amzn-SageMaker-Session-Id``), or None.
        minted: TorchServe minted ``session_id`` because the request came without one.
        body: the request body (bytes, or the dict TorchServe decoded); None on continuations.
        accept: the request's ``Accept`` header (``application/jsonlines`` asks a chat stream in
            JSON lines rather than server-sent events), or None.
    """

    request_id: str
    session_id: str | None
    minted: bool
    body: Any
    accept: str | None = None


@dataclass
class RowResult:
    """What to answer for one row: ``body`` bytes, HTTP ``status``, response ``headers``,
    ``content_type``, and ``stop`` for the stopping criterion (None: whole response; False: a
    chunk, more follow; True: the last chunk)."""

    body: bytes
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    content_type: str = JSON
    stop: bool | None = None


@dataclass
class Job:
    """An open or a generation in flight, across ``handle()`` calls (keyed by TorchServe's request id)."""

    request_id: str
    session_id: str
    command: GenerateCommand | OpenCommand | AddImageCommand | ChatCommand
    last_seen: float
    work: Generation | ImageTask
    own_group: bool = True  # the TorchServe job group is this session's own (not the shared NEW_SESSION)
    t0: float = 0.0  # admission time (perf_counter), for an open's total_ms
    intake_timings: dict[str, float] = field(default_factory=dict)  # an image's fetch and decode, ms
    calls: int = 0  # handle() calls this job was part of
    ahead: int = 0  # steps run by run_ahead() since the job was last in a handle() call
    sent: bool = False  # a streamed frame went out (status and headers are fixed)
    emitted: int = 0  # token events already sent (streaming)
    error: ServiceError | None = None
    one_shot: bool = False  # a chat request without a session: its session is removed when it ends
    opened: bool = False  # a chat request that opened its session (NEW_SESSION): new-session headers
    stream: ChatStream | None = None  # a streamed chat answer's events
    frames: list[bytes] = field(default_factory=list)  # a chat stream's last events, one per call
    urls: dict[str, str] = field(default_factory=dict)  # image URL -> content key, kept when it ends
