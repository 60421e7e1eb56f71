"""Requests held at the public port while the worker has no generation slot free, instead of refused.

The worker answers at most ``max_concurrent_generations`` requests at once; one past that is refused
at admission, before anything of it was done, with ``503 overloaded`` and the internal
:data:`~llava_sessions.wire.contract.SLOT_WAIT_HEADER`. TorchServe itself refuses a request with its
own 503 (``ServiceUnavailableException``: no worker free, ``maxNumSequence`` job groups open, a
session's job queue full), also before the worker saw it. Load tools (guidellm, aiperf) do not retry,
and vLLM queues such requests; so the front holds them here, in arrival order, and sends each again
when a relayed request ends (a slot may have freed), up to ``queue_timeout_s``. Only past that
deadline, or with ``queue_max_requests`` already waiting, does the client get the 503, in OpenAI's
error shape with ``Retry-After``.

Only the first waiter polls by itself (every :data:`HEAD_POLL_S`): slots freed without a relay ending
at this front (a client that left, a session closed elsewhere) are found without every waiter
knocking at once.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

__all__ = ["HEAD_POLL_S", "SlotQueue"]

#: Seconds between the first waiter's own tries while no relay ends.
HEAD_POLL_S = 0.2
#: Seconds between checks that a waiting client is still connected.
CLIENT_CHECK_S = 0.25


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

    @property
    def num_waiting(self) -> int:
        """Requests waiting now."""
        return len(self._waiters)

    def wait(self, deadline: float, gone: Callable[[], bool], *, again: bool = False) -> bool:
        """Wait until the request should be sent again: a relay ended (:meth:`wake_one`), or it is first
        in line and :data:`HEAD_POLL_S` passed.

        Args:
            deadline: ``time.monotonic()`` past which it waits no more.
            gone: whether the client has left (checked every :data:`CLIENT_CHECK_S`).
            again: it was woken before and refused again: it keeps its place at the head of the line.

        Returns:
            True: send it again. False: give up (the line is full, the deadline passed, or the client left).
        """
        event = threading.Event()
        with self._lock:
            if not again and len(self._waiters) >= self.max_waiting:
                return False
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
