"""The local endpoint's routing and transport: sticky sessions over TorchServe backends, least-loaded
placement, SageMaker's ``PREFIX_AWARE`` strategy for requests without a session, health probes, and
the one HTTP call to a backend's ``/invocations``.
"""

from __future__ import annotations

import http.client
import threading
import time
from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence, Set
from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import urlsplit

__all__ = ["PROBE_INTERVAL_S", "BackendGone", "BackendRef", "BackendTimeout", "Router", "forward", "ping"]

#: Seconds between /ping probes of a backend marked down.
PROBE_INTERVAL_S = 1.0


@dataclass
class BackendRef:
    """One backend as the router sees it."""

    index: int
    url: str
    log_dir: str = ""
    healthy: bool = True
    last_probe: float = 0.0

    @property
    def host_port(self) -> tuple[str, int]:
        """``(host, port)`` of the backend's inference API."""
        parts = urlsplit(self.url)
        return parts.hostname or "127.0.0.1", parts.port or 80


#: Prefix keys a router remembers (least recently served forgotten first).
MAX_PREFIXES = 100_000


class Router:
    """Sticky session routing over backends: id → backend index, least-loaded placement.

    With ``prefix_aware``, a request without a session goes where a request of the same prefix key
    was last served (SageMaker's ``PREFIX_AWARE``: the key is the ``PrefixAwareId`` and the body's first
    ``PrefixLength`` bytes; the caller makes it), unless that backend has ``concurrency_threshold``
    requests outstanding or is down; otherwise to the least-loaded one.

    Thread-safe. ``sessions`` counts only sessions this router saw open and not yet close.
    """

    def __init__(
        self,
        backends: Sequence[BackendRef],
        *,
        probe_interval_s: float = PROBE_INTERVAL_S,
        prefix_aware: bool = False,
        concurrency_threshold: int = 1024,
    ) -> None:
        if not backends:
            raise ValueError("at least one backend")
        self.backends = list(backends)
        self.probe_interval_s = probe_interval_s
        self.prefix_aware = prefix_aware
        self.concurrency_threshold = concurrency_threshold
        self._sessions: dict[str, int] = {}
        self._prefixes: OrderedDict[Hashable, int] = OrderedDict()
        self._outstanding: dict[int, int] = {b.index: 0 for b in self.backends}
        self._lock = threading.Lock()

    def for_prefix(self, key: Hashable) -> int | None:
        """The healthy backend that last served ``key``, or the longest key that begins ``key`` (a
        conversation's next turn begins with its last turn's text: SageMaker "routes requests that share
        the same prefix to the same instance"), and has room under the concurrency threshold; or None.
        A key is ``(PrefixAwareId, prefix)``, the prefix ``bytes`` or ``str``."""
        if not self.prefix_aware:
            return None
        with self._lock:
            index = self._prefixes.get(key)
            if index is None:
                index = self._longest_prefix_of(key)
            if index is None or not self.backends[index].healthy:
                return None
            return index if self._outstanding[index] < self.concurrency_threshold else None

    def _longest_prefix_of(self, key: Hashable) -> int | None:
        """The backend of the longest stored key of the same ``PrefixAwareId`` whose prefix begins
        ``key``'s (a linear scan of at most ``MAX_PREFIXES``: a development tool's router)."""
        if not (isinstance(key, tuple) and len(key) == 2):
            return None
        app, prefix = key
        best, best_len = None, 0
        for stored, index in self._prefixes.items():
            other_app, other = cast(tuple, stored)
            if other_app == app and type(other) is type(prefix) and len(other) > best_len and prefix.startswith(other):
                best, best_len = index, len(other)
        return best

    def served(self, key: Hashable, index: int) -> None:
        """Record that backend ``index`` served a request of prefix ``key``."""
        if not self.prefix_aware:
            return
        with self._lock:
            self._prefixes[key] = index
            self._prefixes.move_to_end(key)
            if len(self._prefixes) > MAX_PREFIXES:
                self._prefixes.popitem(last=False)

    def outstanding(self, index: int, delta: int) -> None:
        """Count a request to backend ``index`` in (``+1``) or out (``-1``)."""
        with self._lock:
            self._outstanding[index] += delta

    def lookup(self, session_id: str) -> int | None:
        """Return the backend index holding ``session_id``, or None if unknown."""
        with self._lock:
            return self._sessions.get(session_id)

    def least_loaded(self, exclude: Set[int] = frozenset()) -> int | None:
        """Return the healthy backend with the fewest sessions (lowest index on ties), or None."""
        self._probe_down(exclude)
        with self._lock:
            counts = {b.index: 0 for b in self.backends if b.healthy and b.index not in exclude}
            for index in self._sessions.values():
                if index in counts:
                    counts[index] += 1
        if not counts:
            return None
        return min(counts, key=lambda index: (counts[index], index))

    def opened(self, session_id: str, index: int) -> None:
        """Record that ``session_id`` lives on backend ``index``."""
        with self._lock:
            self._sessions[session_id] = index

    def closed(self, session_id: str) -> None:
        """Forget ``session_id`` (no error if unknown)."""
        with self._lock:
            self._sessions.pop(session_id, None)

    def mark_down(self, index: int) -> list[str]:
        """Mark backend ``index`` down and forget its sessions; return the forgotten ids."""
        with self._lock:
            backend = self.backends[index]
            backend.healthy = False
            backend.last_probe = time.monotonic()
            lost = [sid for sid, where in self._sessions.items() if where == index]
            for sid in lost:
                del self._sessions[sid]
        return lost

    def snapshot(self) -> dict[str, Any]:
        """Return the ``/debug/sessions`` view."""
        with self._lock:
            sessions = dict(self._sessions)
        return {
            "backends": [
                {
                    "index": b.index,
                    "url": b.url,
                    "healthy": b.healthy,
                    "sessions": sum(1 for index in sessions.values() if index == b.index),
                    "log_dir": b.log_dir,
                }
                for b in self.backends
            ],
            "sessions": sessions,
        }

    def _probe_down(self, exclude: Set[int]) -> None:
        now = time.monotonic()
        for backend in self.backends:
            if backend.healthy or backend.index in exclude or now - backend.last_probe < self.probe_interval_s:
                continue
            backend.last_probe = now
            if ping(backend) == 200:
                backend.healthy = True


def ping(backend: BackendRef, timeout_s: float = 1.0) -> int | None:
    """The status of the backend's ``GET /ping``, or None (no answer within ``timeout_s``)."""
    host, port = backend.host_port
    connection = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        connection.request("GET", "/ping")
        response = connection.getresponse()
        response.read()
        return response.status
    except (OSError, http.client.HTTPException):
        return None
    finally:
        connection.close()


class BackendGone(Exception):
    """The backend did not answer: refused (nothing sent) or dropped the connection."""

    def __init__(self, reason: str, *, refused: bool) -> None:
        super().__init__(reason)
        self.refused = refused


class BackendTimeout(Exception):
    """The backend accepted the request but did not answer within the read timeout."""


def forward(
    backend: BackendRef, body: bytes, headers: Mapping[str, str], timeout_s: float
) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    """POST ``body`` with ``headers`` to the backend's ``/invocations``; return the open connection
    and its response (the caller reads and closes them).

    Raises:
        BackendGone: refused or unreachable (``refused``: nothing was sent) or the connection dropped.
        BackendTimeout: no answer within ``timeout_s`` seconds.
    """
    host, port = backend.host_port
    connection = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        connection.connect()
    except ConnectionRefusedError as exc:
        connection.close()
        raise BackendGone(f"refused the connection ({exc})", refused=True) from None
    except OSError as exc:
        connection.close()
        raise BackendGone(f"unreachable ({exc})", refused=True) from None
    try:
        connection.request("POST", "/invocations", body=body, headers=dict(headers))
        response = connection.getresponse()
    except TimeoutError:
        connection.close()
        raise BackendTimeout() from None
    except (OSError, http.client.HTTPException) as exc:
        connection.close()
        raise BackendGone(f"dropped the connection ({type(exc).__name__})", refused=False) from None
    return connection, response
