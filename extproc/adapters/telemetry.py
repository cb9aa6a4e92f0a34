"""The processor's own Prometheus metrics.

One registry per server instance (not prometheus_client's global one) so that
tests can run several processors in one Python process. Each model's
dispatcher reports through a :class:`ModelTelemetry` (the core's
``DispatchReport``), which writes that model's series.
"""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from extproc.adapters.logs import DECISIONS
from extproc.core.engine_load import EngineLoad
from extproc.core.outcomes import Refusal

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
        self.cost_clamped = Counter(
            "extproc_cost_clamped",
            "Requests whose max_tokens or Content-Length was beyond the model's max_context_tokens "
            "(the vtc cost counts at most the context).",
            ["model"],
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
            "Mean inter-token latency over the adaptive rule's short window (histogram deltas).",
            ["model", "endpoint"],
            registry=r,
        )
        self.gate_limit = Gauge(
            "extproc_gate_limit",
            "Requests the release rule lets the endpoint hold (running + waiting): adaptive, learned online; "
            "static_concurrency, max_in_flight.",
            ["model", "endpoint"],
            registry=r,
        )
        self.endpoint_degraded = Gauge(
            "extproc_endpoint_degraded",
            "1 while the endpoint's metrics are failing, garbage or stale (capped at its fallback limit).",
            ["model", "endpoint"],
            registry=r,
        )
        self.endpoint_up = Gauge(
            "extproc_endpoint_up",
            "0 while the endpoint's engine is unreachable (connection refused, release failures, its own 503): "
            "nothing is released to it; 1 once it answers again.",
            ["model", "endpoint"],
            registry=r,
        )
        self.release_failures = Counter(
            "extproc_release_failures",
            "Released requests that failed before the engine answered (unreachable, reset) or that it answered 503; "
            "endpoint '(unknown)' where the pool cannot tell which endpoint took it.",
            ["model", "endpoint"],
            registry=r,
        )
        self.gate_fallback = Gauge(
            "extproc_gate_fallback",
            "1 while the gate runs on its fallback in-flight limit (engine metrics unusable).",
            ["model"],
            registry=r,
        )
        self.draining = Gauge(
            "extproc_draining", "1 from SIGTERM until the process exits (health NOT_SERVING).", registry=r
        )

    def per_endpoint_gauges(self) -> tuple[Gauge, ...]:
        """Gauges labelled (model, endpoint): cleared when an endpoint leaves its pool."""
        return (self.engine_waiting, self.engine_running, self.engine_kv_usage, self.engine_itl,
                self.gate_limit, self.endpoint_degraded, self.endpoint_up)


class ModelTelemetry:
    """One model's series, written from what its dispatcher reports (``core/report.py``), and its decision lines."""

    def __init__(self, telemetry: Telemetry, model: str) -> None:
        self._t = telemetry
        self._model = model
        # Asked once, at start-up (logging is set up before the dispatchers are built): with
        # DEBUG off a decision costs one attribute test, not a logging call per request.
        self._decisions = DECISIONS.isEnabledFor(logging.DEBUG)

    def refused(self, refusal: Refusal) -> None:
        self._t.rejected.labels(self._model, refusal.value).inc()

    def held(self, band: str, waited_s: float) -> None:
        self._t.queue_wait.labels(self._model, band).observe(waited_s)

    def released(self, band: str) -> None:
        self._t.released.labels(self._model, band).inc()

    def cost_clamped(self) -> None:
        self._t.cost_clamped.labels(self._model).inc()

    def abandoned(self, band: str) -> None:
        self._t.abandoned.labels(self._model, band).inc()

    def queue_depth(self, band: str, depth: int) -> None:
        self._t.queue_depth.labels(self._model, band).set(depth)

    def in_flight(self, count: int) -> None:
        self._t.in_flight.labels(self._model).set(count)

    def scraped(self, endpoint: str, load: EngineLoad, itl_s: float | None, limit: float | None) -> None:
        self._t.engine_waiting.labels(self._model, endpoint).set(load.waiting)
        self._t.engine_running.labels(self._model, endpoint).set(load.running)
        if load.kv_usage is not None:
            self._t.engine_kv_usage.labels(self._model, endpoint).set(load.kv_usage)
        if itl_s is not None:
            self._t.engine_itl.labels(self._model, endpoint).set(itl_s)
        if limit is not None:
            self._t.gate_limit.labels(self._model, endpoint).set(limit)

    def scrape_failed(self, endpoint: str) -> None:
        self._t.scrape_errors.labels(self._model, endpoint).inc()

    def endpoint_left(self, endpoint: str) -> None:
        for gauge in self._t.per_endpoint_gauges():
            try:
                gauge.remove(self._model, endpoint)
            except KeyError:
                pass

    def endpoint_degraded(self, endpoint: str, degraded: bool) -> None:
        self._t.endpoint_degraded.labels(self._model, endpoint).set(1 if degraded else 0)

    def endpoint_up(self, endpoint: str, up: bool) -> None:
        self._t.endpoint_up.labels(self._model, endpoint).set(1 if up else 0)

    def release_failed(self, endpoint: str | None) -> None:
        self._t.release_failures.labels(self._model, endpoint or "(unknown)").inc()

    def decided(self, tenant: str, band: str, waited_s: float, outcome: str) -> None:
        if not self._decisions:
            return
        wait_ms = round(waited_s * 1000, 1)
        DECISIONS.debug(
            "%s %s tenant=%s class=%s wait_ms=%s", outcome, self._model, tenant, band, wait_ms,
            extra={"tenant": tenant, "class": band, "model": self._model, "wait_ms": wait_ms, "outcome": outcome},
        )

    def fallback(self, active: bool) -> None:
        self._t.gate_fallback.labels(self._model).set(1 if active else 0)
