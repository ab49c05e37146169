"""Prometheus metrics of one gateway app (its own registry: no process-wide globals).

Owns: the metric families and their names. Never: records payloads or trajectory ids as labels
(label values stay low-cardinality: endpoint, status, flag, kind, upstream URL).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from datapool.lifecycle.hooks import CompletionHooks
from datapool.steps.faults import FAULT_REASONS
from datapool.steps.writer import PoolWriter
from gateway.upstream.replicas import Replica, UpstreamPool
from gateway.upstream.weight_update import PauseReport

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 600)


class GatewayMetrics:
    """Counters, histograms and gauges exposed at ``/metrics``."""

    def __init__(
        self,
        upstreams: UpstreamPool,
        write_queue_depth: Callable[[], float],
        writer: PoolWriter | None = None,
        hooks: CompletionHooks | None = None,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        if writer is not None:
            r.register(PoolWriterCollector(writer))
        if hooks is not None:
            r.register(CompletionHooksCollector(hooks))
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
            "Steps by the flags the gateway set (ids_missing, ids_incomplete, aborted, "
            "truncated, resend, ...); prefix breaks, found at commit, are "
            "trajgate_pool_prefix_breaks_total.",
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
        self.weight_update_pause = Histogram(
            "trajgate_weight_update_pause_seconds",
            "Full-weight updates: how long new calls were held (drain, reload, registration).",
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.weight_update_calls = Counter(
            "trajgate_weight_update_calls",
            "Calls met by full-weight updates: drained (finished within the limit), aborted "
            "(still sampling at the limit), held (arrived during the pause), kept (in flight "
            "across a 'keep' reload), split_unknown (kept, tokens before it unknown).",
            ["fate"],
            registry=r,
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
        exact = Gauge(
            "trajgate_upstream_exact_continuation",
            "1 when the replica serves exact continuation (probed), 0 when it does not, -1 while "
            "its probe has not ended (a call extending a turn then waits for it, briefly).",
            ["upstream"],
            registry=r,
        )
        for replica in upstreams.replicas:
            healthy.labels(replica.url).set_function(_reader(replica, "healthy"))
            exact.labels(replica.url).set_function(_serves_exact(replica))
            in_flight.labels(replica.url).set_function(_reader(replica, "in_flight"))

    def record_weight_update(self, report: PauseReport) -> None:
        self.weight_update_pause.observe(report.pause_ms / 1000)
        self.weight_update_calls.labels("drained").inc(report.drained_calls)
        self.weight_update_calls.labels("aborted").inc(report.aborted_calls)
        self.weight_update_calls.labels("held").inc(report.held_calls)
        self.weight_update_calls.labels("kept").inc(report.kept_calls)
        self.weight_update_calls.labels("split_unknown").inc(report.split_unknown_calls)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _reader(replica: Replica, attribute: str) -> Callable[[], float]:
    return lambda: float(getattr(replica, attribute))


def _serves_exact(replica: Replica) -> Callable[[], float]:
    return lambda: -1.0 if replica.serves_exact is None else float(replica.serves_exact)


class PoolWriterCollector(Collector):
    """The pool writer's counters, read at scrape time (the writer thread only bumps ints).

    What a storage fault did is visible here: ``trajgate_pool_faults_total{reason}``
    (failed database operations: disk_full, locked, unreachable, read_only, io_error, other),
    ``trajgate_pool_calls_failed_total`` (calls whose commit failed),
    ``trajgate_pool_calls_refused_total`` (answered 503), ``trajgate_pool_calls_unrecorded_total``
    (served without a step under on_write_failure='serve'), and ``trajgate_pool_writable``.
    """

    def __init__(self, writer: PoolWriter) -> None:
        self.writer = writer

    def describe(self) -> Iterator[Metric]:
        return iter(())  # collected lazily; nothing to check at registration

    def collect(self) -> Iterator[Metric]:
        stats = self.writer.stats
        faults = CounterMetricFamily(
            "trajgate_pool_faults",
            "Database operations of the gateway (a batch commit, a lookup a call needed, a pool "
            "API request) that failed on a storage fault, by reason.",
            labels=["reason"],
        )
        for reason in FAULT_REASONS:
            faults.add_metric([reason], stats.faults_by_reason.get(reason, 0))
        yield faults
        simple = (
            (
                "trajgate_pool_calls_failed",
                "Calls whose commit failed (then refused or served unrecorded).",
                stats.failed_calls,
            ),
            (
                "trajgate_pool_calls_committed",
                "Calls committed to the pool.",
                stats.committed_calls,
            ),
            (
                "trajgate_pool_calls_rejected",
                "Calls refused with 409 because their trajectory was closed.",
                stats.rejected_calls,
            ),
            (
                "trajgate_pool_calls_refused",
                "Calls answered 503 because the pool could not take them "
                "(failed commit, full write queue, or refused up front after a failure).",
                stats.refused_calls,
            ),
            (
                "trajgate_pool_calls_unrecorded",
                "Calls served without a step because on_write_failure='serve' and the pool failed.",
                stats.unrecorded_calls,
            ),
            (
                "trajgate_pool_steps_compacted",
                "Step payloads moved into Parquet files.",
                stats.compacted_steps,
            ),
            (
                "trajgate_pool_compaction_failures",
                "Compactions that failed (payloads stay in SQL; no file is left behind).",
                stats.compaction_failures,
            ),
            (
                "trajgate_pool_orphan_files_deleted",
                "Unregistered payload files deleted by upkeep.",
                stats.orphan_files_deleted,
            ),
            (
                "trajgate_pool_upkeep_failures",
                "Upkeep rounds (idle completion, compaction, orphan deletion) that failed.",
                stats.upkeep_failures,
            ),
        )
        for name, documentation, value in simple:
            yield CounterMetricFamily(name, documentation, value=value)
        breaks = CounterMetricFamily(
            "trajgate_pool_prefix_breaks",
            "Committed steps whose prompt does not extend the trajectory's latest step (flag "
            "prefix_break), by divergence_kind; a re-send or retry of the same prompt is no break.",
            labels=["kind"],
        )
        for kind, count in sorted(self.writer.store.prefix_breaks.items()):
            breaks.add_metric([kind], count)
        yield breaks
        yield GaugeMetricFamily(
            "trajgate_pool_writable",
            "1 while the pool takes writes; 0 from a failed commit until the next good one.",
            value=1.0 if self.writer.writable else 0.0,
        )


class CompletionHooksCollector(Collector):
    """The completion-hook runner's counters (``datapool.lifecycle.hooks.HookStats``) at scrape
    time."""

    def __init__(self, hooks: CompletionHooks) -> None:
        self.hooks = hooks

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        stats = self.hooks.stats
        for name, documentation, value in (
            (
                "trajgate_completion_hooks_runs",
                "Completed trajectories whose reward functions and curation rules ran to the end.",
                stats.runs,
            ),
            (
                "trajgate_completion_hooks_failures",
                "Hook claims or runs that raised (retried once their lease passes).",
                stats.failures,
            ),
            (
                "trajgate_completion_hooks_lost_claims",
                "Due trajectories another gateway claimed first.",
                stats.lost_claims,
            ),
            (
                "trajgate_completion_hooks_overrun_leases",
                "Hook runs that outlasted their lease and were taken over (so repeated).",
                stats.overrun_leases,
            ),
        ):
            yield CounterMetricFamily(name, documentation, value=value)
        reward_functions = CounterMetricFamily(
            "trajgate_reward_function_runs",
            "Reward function runs on completed trajectories, by configured function and outcome "
            "(ok, or failed: recorded as a failed reward, never as a value).",
            labels=["function", "outcome"],
        )
        for (function, outcome), count in sorted(stats.reward_function_runs.items()):
            reward_functions.add_metric([function, outcome], count)
        yield reward_functions
