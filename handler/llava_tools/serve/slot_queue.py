"""Requests held at the public port while the worker has no generation slot free, instead of refused.

The worker answers at most ``max_concurrent_generations`` requests at once; one past that is refused
at admission, before anything of it was done, with ``503 overloaded`` and the internal
:data:`~llava_sessions.wire.contract.SLOT_WAIT_HEADER`. TorchServe itself refuses a request with its
own 503 (``ServiceUnavailableException``: no worker free, ``maxNumSequence`` job groups open, a
session's job queue full), also before the worker saw it. Load tools (guidellm, aiperf) do not retry,
and vLLM queues such requests; so the proxy holds them here, in arrival order, and sends each again
when a relayed request ends (a slot may have freed), up to ``queue_timeout_s``. Only past that
deadline, or with ``queue_max_requests`` already waiting, does the client get the 503, in OpenAI's
error shape with ``Retry-After``.

Only the first waiter polls by itself (every :data:`HEAD_POLL_S`): slots freed without a relay ending
at this proxy (a client that left, a session closed elsewhere) are found without every waiter
knocking at once.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TypeVar

from .http_wire import openai_error

__all__ = ["HEAD_POLL_S", "STILL_BUSY", "TORCHSERVE_REFUSED", "SlotQueue", "SlotsTaken", "slot_refusal"]

#: Seconds between the first waiter's own tries while no relay ends.
HEAD_POLL_S = 0.2
#: Seconds between checks that a waiting client is still connected.
CLIENT_CHECK_S = 0.25
_T = TypeVar("_T")
#: TorchServe's own refusal type (no worker free, ``maxNumSequence`` job groups open, a session's job
#: queue full): refused before the worker saw the request, so it may be held and sent again.
TORCHSERVE_REFUSED = b'"ServiceUnavailableException"'
#: What a request held past ``queue_timeout_s`` (or with the line full) is told when TorchServe refused it.
STILL_BUSY = "the server is busy: no generation slot freed in time; retry shortly"


def slot_refusal(status: bytes, marked: bool, head: bytes, body: bytes) -> bytes | None:
    """The reply to give a client for a relayed whole reply (``status``, ``head``, ``body``) if it is a
    refusal for want of a slot, else None: the worker's ``503`` ``marked`` with
    :data:`~llava_sessions.wire.contract.SLOT_WAIT_HEADER` as it came, TorchServe's own 503 as
    ``503 overloaded`` with ``Retry-After`` in OpenAI's error object (the shape both dialects' clients read)."""
    if status != b"503":
        return None
    if TORCHSERVE_REFUSED in body:
        return openai_error(503, "Service Unavailable", STILL_BUSY, "overloaded", retry_after_s=1)
    return head + body if marked else None


class SlotsTaken(Exception):
    """TorchServe or the worker refused the request for want of a slot, before anything of it was
    done; ``reply``: the refusal as the client would get it."""

    def __init__(self, reply: bytes) -> None:
        super().__init__("no generation slot")
        self.reply = reply


class SlotQueue:
    """The requests waiting for a generation slot, first come first served (module docstring).

    Args:
        max_waiting: requests that may wait at once (0: none; every refusal goes to its client).
        timeout_s: how long one request may wait in all, seconds.
    """

    def __init__(self, max_waiting: int, timeout_s: float) -> None:
        self.max_waiting = max_waiting
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._waiters: deque[threading.Event] = deque()
        self._held = 0  # requests in :meth:`hold` after a refusal (waiting, or sent again)

    def hold(self, send: Callable[[], _T], gone: Callable[[], bool]) -> _T:
        """``send()`` (one relay of the request), sent again each time the request should be (:meth:`wait`)
        while it raises :class:`SlotsTaken`, for up to :attr:`timeout_s`.

        Raises:
            SlotsTaken: still refused when the line was full, the deadline passed or ``gone()`` said the
                client left (the last refusal).
        """
        deadline = time.monotonic() + self.timeout_s
        again = held = False
        try:
            while True:
                try:
                    return send()
                except SlotsTaken:
                    if not held:
                        with self._lock:
                            if self._held >= self.max_waiting:
                                raise
                            self._held += 1
                        held = True
                    if not self.wait(deadline, gone, again=again):
                        raise
                    again = True
        finally:
            if held:
                with self._lock:
                    self._held -= 1

    def wait(self, deadline: float, gone: Callable[[], bool], *, again: bool = False) -> bool:
        """Wait until the request should be sent again: a relay ended (:meth:`wake_one`), or it is first
        in line and :data:`HEAD_POLL_S` passed.

        Args:
            deadline: ``time.monotonic()`` past which it waits no more.
            gone: whether the client has left (checked every :data:`CLIENT_CHECK_S`).
            again: it was woken before and refused again: it keeps its place at the head of the line.

        Returns:
            True: send it again. False: give up (the deadline passed, or the client left).
        """
        event = threading.Event()
        with self._lock:
            if again:
                self._waiters.appendleft(event)
            else:
                self._waiters.append(event)
        try:
            started = time.monotonic()
            while True:
                now = time.monotonic()
                if now >= deadline:
                    return False
                if event.wait(min(deadline - now, CLIENT_CHECK_S, HEAD_POLL_S)):
                    if gone():  # woken for a slot its client no longer wants: the next waiter's
                        self.wake_one()
                        return False
                    return True
                if gone():
                    return False
                with self._lock:
                    first = bool(self._waiters) and self._waiters[0] is event
                if first and time.monotonic() - started >= HEAD_POLL_S:
                    return True
        finally:
            with self._lock:
                try:
                    self._waiters.remove(event)
                except ValueError:
                    pass  # woken: already taken off the line

    def wake_one(self) -> None:
        """A relayed request ended (a slot may be free): the first waiter tries again."""
        with self._lock:
            if self._waiters:
                self._waiters.popleft().set()
