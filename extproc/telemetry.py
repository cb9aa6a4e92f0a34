"""The processor's own Prometheus metrics.

One registry per server instance (not prometheus_client's global one) so that
tests can run several processors in one Python process.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Queue waits span milliseconds (idle engine) to minutes (a flood in batch).
WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class Telemetry:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.queue_depth = Gauge(
            "extproc_queue_depth", "Requests held in the fair queue.", ["model", "priority"], registry=r
        )
        self.queue_wait = Histogram(
            "extproc_queue_wait_seconds",
            "Time a request spent held before release or rejection.",
            ["model", "priority"],
            buckets=WAIT_BUCKETS,
            registry=r,
        )
        self.released = Counter(
            "extproc_released", "Requests released to the engine.", ["model", "priority"], registry=r
        )
        self.rejected = Counter(
            "extproc_rejected",
            "Requests answered by the processor instead of the engine.",
            ["model", "reason"],
            registry=r,
        )
        self.abandoned = Counter(
            "extproc_abandoned",
            "Requests whose client left while they were queued.",
            ["model", "priority"],
            registry=r,
        )
        self.priority_downgraded = Counter(
            "extproc_priority_downgraded",
            "Requests that asked for a priority class their tenant is not entitled to and got a lower one.",
            ["model", "requested", "granted"],
            registry=r,
        )
        self.in_flight = Gauge(
            "extproc_in_flight", "Released requests whose response has not finished.", ["model"], registry=r
        )
        self.engine_waiting = Gauge(
            "extproc_engine_waiting",
            "Engine waiting queue from the last good scrape.",
            ["model", "endpoint"],
            registry=r,
        )
        self.engine_running = Gauge(
            "extproc_engine_running",
            "Engine running requests from the last good scrape.",
            ["model", "endpoint"],
            registry=r,
        )
        self.scrape_errors = Counter(
            "extproc_scrape_errors",
            "Failed or unusable engine /metrics scrapes.",
            ["model", "endpoint"],
            registry=r,
        )
        self.engine_kv_usage = Gauge(
            "extproc_engine_kv_usage",
            "Engine KV-cache usage (0..1) from the last good scrape, where the engine reports it.",
            ["model", "endpoint"],
            registry=r,
        )
        self.engine_itl = Gauge(
            "extproc_engine_inter_token_latency_seconds",
            "Mean inter-token latency over the gate's short window (histogram deltas).",
            ["model", "endpoint"],
            registry=r,
        )
        self.gate_limit = Gauge(
            "extproc_gate_limit",
            "Requests the adaptive gate lets the endpoint hold (running + waiting), learned online.",
            ["model", "endpoint"],
            registry=r,
        )
        self.endpoint_degraded = Gauge(
            "extproc_endpoint_degraded",
            "1 while the endpoint's metrics are failing, garbage or stale (capped at its fallback limit).",
            ["model", "endpoint"],
            registry=r,
        )
        self.gate_fallback = Gauge(
            "extproc_gate_fallback",
            "1 while the gate runs on its fallback in-flight limit (engine metrics unusable).",
            ["model"],
            registry=r,
        )

    def per_endpoint_gauges(self) -> tuple[Gauge, ...]:
        """Gauges labelled (model, endpoint): cleared when an endpoint leaves its pool."""
        return (self.engine_waiting, self.engine_running, self.engine_kv_usage, self.engine_itl,
                self.gate_limit, self.endpoint_degraded)
