"""WorkerMetrics against TorchServe's own metrics cache (the ``[METRICS]`` lines the frontend parses).

No model and no server: payloads are plain data (what :meth:`WorkerMetrics.collect` returns), the
cache is TorchServe 0.12's ``MetricsCacheYamlImpl`` with its shipped metrics.yaml, and the lines are
read from its logger as the frontend would read them from the worker's stdout.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time

import pytest

from llava_sessions.metrics import WorkerMetrics

LINE = re.compile(r"^\[METRICS\]llava_(\w+)\.\w+:([0-9.e+-]+)\|#([^|]*)\|#type:(\w+)\|")


@pytest.fixture()
def cache():
    import ts
    from ts.metrics.metric_cache_yaml_impl import MetricsCacheYamlImpl

    cache = MetricsCacheYamlImpl(os.path.join(os.path.dirname(ts.__file__), "configs", "metrics.yaml"))
    cache.initialize_cache()
    return cache


@pytest.fixture()
def lines(caplog):
    """The metric lines written so far, parsed: ``[(name, value, dimensions, type)]``."""
    caplog.set_level(logging.INFO, logger="ts.metrics.caching_metric")

    def read() -> list[tuple[str, float, str, str]]:
        out = []
        for record in caplog.records:
            m = LINE.match(record.getMessage())
            if m:
                out.append((m.group(1), float(m.group(2)), m.group(3), m.group(4)))
        caplog.clear()
        return out

    return read


def payload(sessions: int, kv: int, generated: int, ttft_ms: list[float], rates: list[float]) -> dict:
    return {
        "gauges": {("OpenSessions", ()): sessions, ("SessionBytes", ("kv",)): kv},
        "counters": {("GeneratedTokens", ()): generated, ("Errors", ("overloaded",)): 1},
        "ttft_ms": ttft_ms,
        "decode_tokens_per_s": rates,
    }


def test_gauges_go_out_when_they_change_counters_as_increments_samples_each(cache, lines) -> None:
    metrics = WorkerMetrics(cache, background=False)
    metrics.publish(payload(2, 100, 10, [250.0], [30.0]))
    first = lines()
    assert ("OpenSessions", 2, "ModelName:llava,Replica:0", "GAUGE") in first
    assert ("SessionBytes", 100, "ModelName:llava,Replica:0,Tier:kv", "GAUGE") in first
    assert ("GeneratedTokens", 10, "ModelName:llava,Replica:0", "COUNTER") in first
    assert ("Errors", 1, "ModelName:llava,Replica:0,Code:overloaded", "COUNTER") in first
    assert ("TimeToFirstTokenSeconds", 0.25, "ModelName:llava,Replica:0", "HISTOGRAM") in first
    assert ("DecodeTokensPerSecond", 30, "ModelName:llava,Replica:0", "GAUGE") in first
    # nothing changed but the token counter and a new answer: only those lines
    metrics.publish(payload(2, 100, 14, [100.0], [40.0]))
    assert sorted(n for n, *_ in lines()) == ["DecodeTokensPerSecond", "GeneratedTokens", "TimeToFirstTokenSeconds"]
    metrics.publish(payload(2, 100, 14, [], []))
    assert lines() == []
    # another replica's gauges are its own, even with equal values
    metrics.publish(payload(2, 100, 3, [], []), replica=1)
    assert {(n, v) for n, v, d, _ in lines() if "Replica:1" in d} == {
        ("OpenSessions", 2),
        ("SessionBytes", 100),
        ("GeneratedTokens", 3),
        ("Errors", 1),
    }


def test_a_replica_started_again_counts_on_from_its_new_zero(cache, lines) -> None:
    """A replica process that died and was started again reports its counters from 0: what it counted
    since is the increment (TorchServe refuses a negative one, and the total must not go back)."""
    metrics = WorkerMetrics(cache, background=False)
    metrics.publish(payload(2, 100, 40, [], []), replica=1)
    lines()
    metrics.publish(payload(0, 0, 3, [], []), replica=1)  # the new process: 3 tokens so far
    written = lines()
    assert ("GeneratedTokens", 3, "ModelName:llava,Replica:1", "COUNTER") in written
    assert not [line for line in written if line[1] < 0 and line[3] == "COUNTER"]
    metrics.publish(payload(0, 0, 5, [], []), replica=1)
    assert [(n, v) for n, v, *_ in lines() if n == "GeneratedTokens"] == [("GeneratedTokens", 2)]


def test_the_background_writer_merges_what_queued_up_and_loses_no_sample(cache, lines) -> None:
    metrics = WorkerMetrics(cache)
    metrics.publish(payload(1, 50, 5, [10.0], [20.0]))
    assert metrics.flush()
    assert ("GeneratedTokens", 5, "ModelName:llava,Replica:0", "COUNTER") in lines()
    with metrics._cond:  # hold the writer back while three payloads queue up
        for k in range(3):
            metrics.publish(payload(1 + k, 50, 6 + k, [float(k)], [float(k)]))
    assert metrics.flush()
    written = lines()
    assert [v for n, v, *_ in written if n == "OpenSessions"] == [3]  # the latest gauge only
    assert [v for n, v, *_ in written if n == "GeneratedTokens"] == [3]  # 5 -> 8 in one increment
    assert sorted(v for n, v, *_ in written if n == "TimeToFirstTokenSeconds") == [0.0, 0.001, 0.002]
    assert [v for n, v, *_ in written if n == "DecodeTokensPerSecond"] == [2]
    assert [t.name for t in threading.enumerate()].count("llava-metrics") == 1


def test_the_writer_writes_at_most_once_per_interval_and_merges_the_calls_between(cache, lines) -> None:
    """With ``interval_s`` the first payload goes out at once; the ones published within the interval
    wait and leave as one write (latest gauges, summed counters, every sample) once it has passed."""
    metrics = WorkerMetrics(cache, interval_s=2.0)  # far past a loaded machine's scheduling delays
    metrics.publish(payload(1, 50, 5, [10.0], [20.0]))
    assert metrics.flush()
    assert ("GeneratedTokens", 5, "ModelName:llava,Replica:0", "COUNTER") in lines()
    t0 = time.monotonic()
    for k in range(3):  # three calls right after: nothing is written until the interval is over
        metrics.publish(payload(2 + k, 50, 6 + k, [float(k)], [float(k)]))
    time.sleep(0.2)
    assert lines() == []
    assert metrics.flush()
    assert time.monotonic() - t0 >= 1.75
    written = lines()
    assert [v for n, v, *_ in written if n == "OpenSessions"] == [4]
    assert [v for n, v, *_ in written if n == "GeneratedTokens"] == [3]  # 5 -> 8 in one increment
    assert sorted(v for n, v, *_ in written if n == "TimeToFirstTokenSeconds") == [0.0, 0.001, 0.002]


def test_publishing_never_raises(cache, lines) -> None:
    metrics = WorkerMetrics(cache, background=False)
    metrics.publish({"gauges": None})  # malformed: logged at debug, nothing written
    metrics.publish(payload(1, 1, 1, [], []))
    assert lines()
    WorkerMetrics(None).publish(payload(1, 1, 1, [], []))  # no cache: observe only
