"""``GET /metrics``: the engine's counters and the server's latency histograms in Prometheus
text format, in a registry of their own (one per server, so several can live in one process).

The engine's numbers come from ``Engine.metrics()`` read in the engine thread at scrape time
(``refresh``); the histograms are observed by the engine thread as tokens are handed over
(``EngineLoop``'s observer interface: ``first_token``, ``inter_token``, ``finished``).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

PREFIX = "mambacache"
LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                     10.0, 30.0, 60.0)
# Engine.metrics() key -> (metric name, help); counters are cumulative since the server started.
ENGINE_COUNTERS = {
    "prompt_tokens": ("prompt_tokens", "Prompt tokens of finished requests"),
    "cached_tokens": ("cached_prompt_tokens", "Prompt tokens served from the radix cache"),
    "computed_prefill_tokens": ("computed_prefill_tokens", "Prompt tokens run through the model"),
    "preemptions": ("preemptions", "Requests preempted for memory"),
    "num_steps": ("engine_steps", "Engine steps"),
    # [host tier] cache.host_memory_bytes (0 while off)
    "host_hit_tokens": ("host_hit_tokens", "Prompt tokens served from host-resident KV and states"),
    "bytes_demoted": ("host_demoted_bytes", "Bytes copied from the device to the host tier"),
    "bytes_promoted": ("host_promoted_bytes", "Bytes copied from the host tier to the device"),
    "load_wait_s": ("host_load_wait_seconds", "Host seconds spent issuing tier copies"),
    "load_wait_steps": ("host_load_wait_steps", "Steps a request sat out for its load"),
}
ENGINE_GAUGES = {
    "hit_rate": ("cache_hit_rate", "Cached / prompt tokens of finished requests"),
    "token_usage": ("kv_pool_usage", "Share of the KV page pool in use"),
    "mamba_usage": ("state_pool_usage", "Share of the recurrent-state slot pool in use"),
    "running_requests": ("running_requests", "Requests in the running batch"),
    "waiting_requests": ("waiting_requests", "Requests queued in the engine"),
    "host_usage": ("host_pool_usage", "Share of the host tier's bytes in use"),
}


class _EngineCollector:
    """Yields the engine's counters and gauges from the last ``Engine.metrics()`` snapshot."""

    def __init__(self):
        self.snapshot: dict[str, Any] = {}

    def collect(self):
        for key, (name, doc) in ENGINE_COUNTERS.items():
            fam = CounterMetricFamily(f"{PREFIX}_{name}", doc)
            fam.add_metric([], float(self.snapshot.get(key, 0)))
            yield fam
        for key, (name, doc) in ENGINE_GAUGES.items():
            fam = GaugeMetricFamily(f"{PREFIX}_{name}", doc)
            fam.add_metric([], float(self.snapshot.get(key, 0)))
            yield fam


class ServerMetrics:
    """The server's Prometheus registry; also the ``EngineLoop`` observer."""

    def __init__(self):
        self.registry = CollectorRegistry()
        self.engine = _EngineCollector()
        self.registry.register(self.engine)
        hist = lambda name, doc: Histogram(f"{PREFIX}_{name}", doc, buckets=LATENCY_BUCKETS_S,
                                           registry=self.registry)
        self.ttft = hist("time_to_first_token_seconds", "Submit to first token")
        self.itl = hist("inter_token_latency_seconds", "Between two token hand-overs")
        self.e2e = hist("e2e_request_latency_seconds", "Submit to finish")
        self.requests = Counter(f"{PREFIX}_requests", "Requests ended, by finish reason",
                                ["finish_reason"], registry=self.registry)
        self.rejected = Counter(f"{PREFIX}_requests_rejected", "Requests refused, by reason",
                                ["reason"], registry=self.registry)
        self.generation_tokens = Counter(f"{PREFIX}_generation_tokens", "Tokens generated",
                                         registry=self.registry)

    # observer interface (engine thread)
    def first_token(self, s: float) -> None:
        self.ttft.observe(s)

    def inter_token(self, s: float) -> None:
        self.itl.observe(s)

    def finished(self, out: Any, e2e_s: float) -> None:
        self.e2e.observe(e2e_s)
        self.requests.labels(out.finish_reason).inc()
        self.generation_tokens.inc(len(out.output_token_ids))

    def render(self, engine_metrics: dict[str, Any]) -> bytes:
        """The text exposition with ``engine_metrics`` (an ``Engine.metrics()`` dict)."""
        self.engine.snapshot = engine_metrics
        return generate_latest(self.registry)
