"""Prometheus metrics at GET /metrics (names mirror SGLang's, prefixed `jengine:`).

Engine-side values are read from `engine.stats()` at scrape time (a custom collector), so they are
never stale and need no thread of their own. The step-latency histogram is the one exception: a
histogram must observe each step once, but the engine reports only its most recent step latencies
(a bounded list). At each scrape the steps new since the previous scrape are the entries after
the previous scrape's last few values; if those are gone (more steps than the list keeps between
two scrapes), the whole list is taken and the overflow is lost to the histogram. Scrape more often
than the engine's list wraps (256 steps) and every step is observed exactly once.
Server-side values (HTTP requests by route and status, end-to-end latency, time to first token)
are observed by the routes themselves.

With data-parallel replicas (--dp-size M, jengine/server/replicas.py) every engine value above is
the sum over replicas, and the gauges a router or an operator reads per replica (queue depth,
running set, KV usage) are repeated as `jengine:replica_*` families with a `replica` label. Each
replica's step latencies are followed separately into the one histogram.

Each app has its own CollectorRegistry, so several servers (tests) can live in one process.
"""

from __future__ import annotations

import threading
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                    120.0, 300.0)
_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

# (stats key, metric name, help) for values the engine counts from its start.
_ENGINE_COUNTERS = (
    ("requests_total", "jengine:num_requests", "Requests finished by the engine"),
    ("prompt_tokens_total", "jengine:prompt_tokens", "Prompt tokens of finished requests"),
    ("generation_tokens_total", "jengine:generation_tokens", "Tokens generated"),
    ("cache_hit_tokens_total", "jengine:cache_hit_tokens", "Prompt tokens served from the prefix cache"),
    ("retractions_total", "jengine:num_retractions", "Requests retracted for KV capacity"),
)
_ENGINE_GAUGES = (
    ("num_running", "jengine:num_running_reqs", "Requests in the running set"),
    ("num_waiting", "jengine:num_queue_reqs", "Requests waiting for admission (queue depth)"),
    ("kv_used_tokens", "jengine:kv_used_tokens", "KV pool tokens in use (running requests and the prefix cache)"),
    ("kv_total_tokens", "jengine:kv_total_tokens", "KV pool capacity in tokens"),
)


# Gauges repeated per replica (stats key, metric name, help), when the engine has replicas.
_REPLICA_GAUGES = (
    ("num_running", "jengine:replica_num_running_reqs", "Requests in a replica's running set"),
    ("num_waiting", "jengine:replica_num_queue_reqs", "Requests waiting in a replica's queue"),
    ("kv_used_tokens", "jengine:replica_kv_used_tokens", "A replica's KV pool tokens in use"),
    ("kv_total_tokens", "jengine:replica_kv_total_tokens", "A replica's KV pool capacity in tokens"),
)

_OVERLAP = 4  # values matched to find where the previous scrape stopped


def _after_overlap(seen_tail: list[float], recent: list[float]) -> int:
    """Index in `recent` just past the (latest) occurrence of `seen_tail`; 0 if it is not there."""
    k = len(seen_tail)
    if k == 0:
        return 0
    for end in range(len(recent), k - 1, -1):
        if recent[end - k:end] == seen_tail:
            return end
    return 0


class _EngineCollector:
    def __init__(self, metrics: "ServerMetrics"):
        self.metrics = metrics

    def collect(self):
        stats = self.metrics.engine_stats()
        for key, name, doc in _ENGINE_COUNTERS:
            if key in stats:
                yield CounterMetricFamily(name, doc, value=float(stats[key]))
        for key, name, doc in _ENGINE_GAUGES:
            if key in stats:
                yield GaugeMetricFamily(name, doc, value=float(stats[key]))
        total = stats.get("kv_total_tokens") or 0
        usage = float(stats.get("kv_used_tokens", 0)) / total if total else 0.0
        yield GaugeMetricFamily("jengine:token_usage", "KV pool usage fraction (0..1)", value=usage)
        yield GaugeMetricFamily("jengine:num_http_in_flight",
                                "Requests the HTTP server is waiting on", value=self.metrics.in_flight())
        replicas = stats.get("replicas") or ()
        for key, name, doc in _REPLICA_GAUGES if replicas else ():
            family = GaugeMetricFamily(name, doc, labels=["replica"])
            for i, replica in enumerate(replicas):
                family.add_metric([str(i)], float(replica.get(key, 0)))
            yield family


class ServerMetrics:
    def __init__(self, engine: Any, in_flight=lambda: 0):
        self.engine = engine
        self.in_flight = in_flight
        self.registry = CollectorRegistry(auto_describe=True)
        self._lock = threading.Lock()
        self._last_seen: dict[int, list[float]] = {}  # per replica: the latency list's tail at
        # the previous scrape
        self.http_requests = Counter("jengine:http_requests", "HTTP requests by route and status",
                                     ["route", "status"], registry=self.registry)
        self.e2e_latency = Histogram("jengine:e2e_request_latency_seconds",
                                     "Request latency from arrival to final token",
                                     buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.ttft = Histogram("jengine:time_to_first_token_seconds",
                              "Streaming requests: arrival to first output chunk",
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.step_latency = Histogram("jengine:step_latency_seconds", "Engine step latency",
                                      buckets=_STEP_BUCKETS, registry=self.registry)
        self.registry.register(_EngineCollector(self))

    def engine_stats(self) -> dict:
        stats = self.engine.stats()
        self._observe_new_steps(stats)
        return stats

    def _observe_new_steps(self, stats: dict) -> None:
        with self._lock:
            for i, engine_stats in enumerate(stats.get("replicas") or [stats]):
                recent = [float(x) for x in engine_stats.get("step_latency_seconds") or ()]
                start = _after_overlap(self._last_seen.get(i, []), recent)
                for seconds in recent[start:]:
                    self.step_latency.observe(seconds)
                if recent:
                    self._last_seen[i] = recent[-_OVERLAP:]

    def render(self) -> bytes:
        return generate_latest(self.registry)
