"""The worker's metrics, published through TorchServe's metrics API (Prometheus on the metrics port).

:class:`WorkerMetrics` collects what the service observes (each answer's time to first token and
decode rate, errors by code) and, on :meth:`WorkerMetrics.emit`, reads the engine's and the store's
counters: gauges are set when they changed, counters advanced by their change since the last
emission, samples recorded and then cleared. Names are ``llava_<Name>`` with the ``ModelName`` and
``Replica`` dimensions (TorchServe 0.12 metrics API: ``context.metrics.add_metric_to_cache``;
docs/architecture.md).

Each metric update is a ``[METRICS]`` line the worker prints and TorchServe's frontend parses, about
20 us of Python each plus the frontend's parsing. So the lines are written by a background thread
after ``handle()`` returned (the answer goes out first), payloads that queued up meanwhile are
merged, and an unchanged gauge is not sent again (benchmarks/concurrency.py, serving overhead).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .engine import SessionEngine
    from .errors import ServiceError
    from .results import Answer

__all__ = ["WorkerMetrics"]

log = logging.getLogger(__name__)

#: Extra dimensions of the metrics that have them (beyond ``ModelName``).
_DIMS = {"SessionBytes": ["Tier"], "Demotions": ["Tier"], "Errors": ["Code"], "KVPoolBytes": ["Pages"]}
_MetricKey = tuple[str, tuple[str, ...]]


def _pool_gauges(engine: SessionEngine) -> dict[_MetricKey, float]:
    """The replica's KV pool: ``KVPoolBytes`` of the pages some session holds (each shared page once:
    below the sessions' ``kv`` bytes when they share an image prefix) and of the pages allocated
    (held or free)."""
    pool = engine.runner.pool
    return {("KVPoolBytes", ("used",)): pool.num_used_bytes(), ("KVPoolBytes", ("allocated",)): pool.pages.nbytes()}


class WorkerMetrics:
    """Observations of one worker and their publication.

    Args:
        cache: TorchServe's metrics cache (``context.metrics``), or None (observe only, emit nothing).
        background: write the metric lines from a background thread (:meth:`publish`); False:
            in the caller's thread.
        interval_s: the background writer writes at most once per ``interval_s`` seconds; what is
            published in between is merged into its next write (0: after every call). Every line
            the worker prints is parsed by TorchServe's frontend on the same CPUs as the requests.
    """

    def __init__(self, cache: Any = None, *, background: bool = True, interval_s: float = 0.0) -> None:
        self._cache = cache
        self._background = background
        self._interval_s = interval_s
        self._last_write = float("-inf")
        self._objects: dict[str, Any] = {}
        self._counters_sent: dict[_MetricKey, float] = {}
        self._gauges_sent: dict[_MetricKey, float] = {}
        self._pending: list[tuple[dict[str, Any], int]] = []
        self._cond = threading.Condition()
        self._writing = False
        self._writer: threading.Thread | None = None
        self.errors_by_code: Counter[str] = Counter()
        self.num_cache_hits = 0
        self.num_cache_misses = 0
        #: Requests the worker holds between ``handle()`` calls (answers, opens, requests waiting for
        #: images), set by the service after each call: 0 once every client was answered or left.
        self.num_in_flight = 0
        self._ttft_ms: list[float] = []
        self._decode_tokens_per_s: list[float] = []

    def observe_answer(self, answer: Answer) -> None:
        """Record a finished answer's ``ttft`` (ms; none for an answer aborted before its first
        token) and ``decode_tokens_per_s``."""
        if "ttft" in answer.timings:
            self._ttft_ms.append(answer.timings["ttft"])
        self._decode_tokens_per_s.append(answer.timings.get("decode_tokens_per_s", 0.0))

    def observe_cache(self, hit: bool) -> None:
        """Count a chat request without a session as a conversation-cache hit (some of its prompt
        was served from cached KV) or a miss."""
        if hit:
            self.num_cache_hits += 1
        else:
            self.num_cache_misses += 1

    def count_error(self, error: ServiceError) -> None:
        """Count one error reply by its code."""
        self.errors_by_code[error.code.value] += 1

    def snapshot(self, engine: SessionEngine) -> dict[str, dict[_MetricKey, float]]:
        """Current gauges and monotonic counters: ``{"gauges": {(name, dims): value}, "counters": {...}}``."""
        store = engine.store
        by_tier = store.bytes_by_tier()
        st = store.stats
        return {
            "gauges": {
                ("OpenSessions", ()): len(store),
                ("RequestsInFlight", ()): self.num_in_flight,
                ("SessionBytes", ("kv",)): by_tier["kv"],
                ("SessionBytes", ("features",)): by_tier["features"],
                ("SessionBytes", ("image",)): by_tier["image"],
                ("ConversationCacheEntries", ()): store.num_cache_entries,
                ("ConversationCacheBytes", ()): store.num_cache_bytes,
                ("KVOffloadBytes", ()): store.offload.num_bytes,
                **_pool_gauges(engine),
            },
            "counters": {
                ("Demotions", ("kv",)): st.num_demotions_kv,
                ("Demotions", ("features",)): st.num_demotions_features,
                ("Restores", ()): st.num_restores,
                ("KVOffloads", ()): st.num_kv_offloads,
                ("SessionsEvicted", ()): st.num_evicted,
                ("SessionsExpired", ()): st.num_expired,
                ("ConversationCacheHits", ()): self.num_cache_hits,
                ("ConversationCacheMisses", ()): self.num_cache_misses,
                ("ConversationCacheEvictions", ()): st.num_cache_evictions,
                ("ReusedPromptTokens", ()): engine.num_reused_tokens,
                ("PrefilledPromptTokens", ()): engine.num_prefilled_tokens,
                ("GeneratedTokens", ()): engine.num_generated_tokens,
                ("Preemptions", ()): engine.num_preemptions,
                **{("Errors", (code,)): n for code, n in self.errors_by_code.items()},
            },
        }

    def collect(self, engine: SessionEngine) -> dict[str, Any]:
        """Take what :meth:`publish` sends: the snapshot plus the answers' samples since the last call
        (which are cleared). Plain data (picklable), so a replica process can hand it to the worker."""
        payload: dict[str, Any] = {
            **self.snapshot(engine),
            "ttft_ms": list(self._ttft_ms),
            "decode_tokens_per_s": list(self._decode_tokens_per_s),
        }
        self._ttft_ms.clear()
        self._decode_tokens_per_s.clear()
        return payload

    def emit(self, engine: SessionEngine) -> None:
        """Publish this worker's metrics (replica 0): :meth:`collect`, then :meth:`publish`."""
        self.publish(self.collect(engine))

    def publish(self, payload: dict[str, Any], replica: int = 0) -> None:
        """Send one replica's gauges, counter increments and samples (a :meth:`collect` payload) to
        TorchServe's metrics cache: queued for the background writer (or written now when
        ``background`` is off). Thread-safe; never raises: metrics must never hurt serving."""
        if self._cache is None:
            return
        if not self._background:
            with self._cond:
                self._write([(payload, replica)])
            return
        with self._cond:
            self._pending.append((payload, replica))
            if self._writer is None:
                self._writer = threading.Thread(target=self._run, name="llava-metrics", daemon=True)
                self._writer.start()
            self._cond.notify()

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every queued payload is written; returns False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._pending and not self._writing, timeout_s)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._pending))
            wait_s = self._last_write + self._interval_s - time.monotonic()
            if wait_s > 0:  # what is published meanwhile joins this write
                time.sleep(wait_s)
            with self._cond:
                batch, self._pending = self._pending, []
                self._writing = True
            try:
                self._write(batch)
                self._last_write = time.monotonic()
            finally:
                with self._cond:
                    self._writing = False
                    self._cond.notify_all()

    def _write(self, batch: list[tuple[dict[str, Any], int]]) -> None:
        """Write payloads in order: per replica, the last gauges and counters and every sample.

        Every metric carries the ``Replica`` dimension (0..N-1): the container's total is the sum
        over it. A counter goes out as its increment since the last write; one that went down is a
        replica started again after its process died, counting from 0, so all of it is the increment
        (TorchServe refuses a negative counter update). Time to first token goes out in seconds
        (Prometheus' default histogram buckets are in seconds); the decode rate is a gauge, so only
        the latest answer's is sent.
        """
        try:
            from ts.metrics.metric_type_enum import MetricTypes

            merged: dict[int, dict[str, Any]] = {}
            for payload, replica in batch:
                into = merged.setdefault(replica, {"ttft_ms": [], "decode_tokens_per_s": []})
                into["gauges"], into["counters"] = payload["gauges"], payload["counters"]
                into["ttft_ms"] += payload["ttft_ms"]
                into["decode_tokens_per_s"] += payload["decode_tokens_per_s"]
            updates: list[tuple[str, tuple[str, ...], str, float, Any, str]] = []
            for replica, payload in merged.items():
                label = str(replica)
                for (name, dims), value in payload["gauges"].items():
                    sent_key = (name, (*dims, label))
                    if self._gauges_sent.get(sent_key) != value:
                        self._gauges_sent[sent_key] = value
                        unit = "Bytes" if name.endswith("Bytes") else "Count"
                        updates.append((name, dims, label, value, MetricTypes.GAUGE, unit))
                for (name, dims), value in payload["counters"].items():
                    sent_key = (name, (*dims, label))
                    sent = self._counters_sent.get(sent_key, 0)
                    delta = value - sent if value >= sent else value  # a restarted replica counts from 0
                    if delta:
                        self._counters_sent[sent_key] = value
                        updates.append((name, dims, label, delta, MetricTypes.COUNTER, "Count"))
                for v in payload["ttft_ms"]:
                    updates.append(("TimeToFirstTokenSeconds", (), label, v / 1000.0, MetricTypes.HISTOGRAM, "s"))
                for v in payload["decode_tokens_per_s"][-1:]:
                    updates.append(("DecodeTokensPerSecond", (), label, v, MetricTypes.GAUGE, "Count"))
            for name, dims, label, value, mtype, unit in updates:
                metric = self._objects.get(name)
                if metric is None:
                    metric = self._cache.add_metric_to_cache(
                        f"llava_{name}", unit, ["ModelName", "Replica", *_DIMS.get(name, [])], mtype
                    )
                    self._objects[name] = metric
                metric.add_or_update(value, ["llava", label, *dims])
        except Exception:  # noqa: BLE001 - metrics must never hurt serving
            log.debug("metrics emission failed", exc_info=True)
