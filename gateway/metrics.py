"""Prometheus metrics of one gateway app (its own registry: no process-wide globals).

Owns: the metric families and their names. Never: records payloads or trajectory ids as labels
(label values stay low-cardinality: endpoint, status, flag, kind, upstream URL).
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from gateway.upstreams import Replica, UpstreamPool

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 600)


class GatewayMetrics:
    """Counters, histograms and gauges exposed at ``/metrics``."""

    def __init__(self, upstreams: UpstreamPool, write_queue_depth: Callable[[], float]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "trajgate_requests",
            "Proxied calls by endpoint and HTTP status.",
            ["endpoint", "status"],
            registry=r,
        )
        self.latency = Histogram(
            "trajgate_request_latency_seconds",
            "Wall time per proxied call.",
            ["endpoint", "stream"],
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.ttft = Histogram(
            "trajgate_time_to_first_token_seconds",
            "Streaming: time to the first sampled token.",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.tokens = Counter(
            "trajgate_tokens",
            "Tokens through the gateway (prompt = in, completion = out).",
            ["direction"],
            registry=r,
        )
        self.steps_written = Counter(
            "trajgate_steps_written", "Steps committed to the pool.", registry=r
        )
        self.step_flags = Counter(
            "trajgate_step_flags",
            "Steps by integrity or quality flag (ids_missing, "
            "ids_incomplete, aborted, truncated, prefix_break, ...).",
            ["flag"],
            registry=r,
        )
        self.attempts_failed = Counter(
            "trajgate_upstream_attempts_failed",
            "Upstream attempts that failed, by outcome.",
            ["outcome"],
            registry=r,
        )
        self.replays = Counter(
            "trajgate_idempotent_replays", "Calls answered from a stored response.", registry=r
        )
        queue = Gauge(
            "trajgate_write_queue_depth", "Calls waiting to be committed to the pool.", registry=r
        )
        queue.set_function(write_queue_depth)
        healthy = Gauge(
            "trajgate_upstream_healthy",
            "1 when the replica passes health checks.",
            ["upstream"],
            registry=r,
        )
        in_flight = Gauge(
            "trajgate_upstream_in_flight",
            "Requests in flight per replica.",
            ["upstream"],
            registry=r,
        )
        for replica in upstreams.replicas:
            healthy.labels(replica.url).set_function(_reader(replica, "healthy"))
            in_flight.labels(replica.url).set_function(_reader(replica, "in_flight"))

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _reader(replica: Replica, attribute: str) -> Callable[[], float]:
    return lambda: float(getattr(replica, attribute))
