"""The processor's own Prometheus metrics.

One registry per server instance (not prometheus_client's global one) so that
tests can run several processors in one Python process. Each model's
dispatcher reports through a :class:`ModelTelemetry` (the core's
``DispatchReport``), which writes that model's series.

Tenant labels are bounded: a tenant named under ``tenants:`` in the config
(and ``identity.default_tenant``) is its own label value, every other tenant
id shares the one value ``other``. A tenant id is whatever the auth layer
put in a header, unbounded; a label value per id would grow Prometheus
without limit. Refusals decided before the tenant is known (bad body,
unknown model, a missing tenant or a class it may not use) carry
``tenant="(none)"``; the processor's own shedding (``overloaded``) comes
after admission, so it carries the tenant, and its class in ``extproc_shed``.

Counters (and the queue-depth gauge) are created at zero for every label
value known from the config (models x classes x tenants x reasons), so a
dashboard shows 0, not "no data", before the first event.

TTFT objectives (``objectives.py`` says which request met or missed its own,
and why a request refused before its deadline is neither): the verdicts per
class and tenant, the preemptions, and the slack at release. The slack is two
histograms, by sign: on-time releases' slack, late releases' lateness. One
histogram over negative and positive values would break its ``_sum``, a
counter that ``rate()`` reads a decrease of as a reset (OpenMetrics forbids
``_sum`` on a histogram with negative buckets), and ``histogram_quantile``
assumes the lowest bucket starts at 0.
"""

from __future__ import annotations

import logging
import math
import platform
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Generic, TypeVar, overload

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, PlatformCollector, ProcessCollector

from extproc.adapters.logs import DECISIONS
from extproc.adapters.objectives import MET, MISSED, PREEMPTED, Objectives, verdict
from extproc.core.engine_load import EngineLoad
from extproc.core.outcomes import Refusal
from extproc.core.report import Change, Charged, EndpointEvent, Event, PoolEvent, RequestEvent, Step

# Queue waits span milliseconds (idle engine) to minutes (a flood in batch).
WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# Taking in one arrival costs microseconds; a dispatch that releases a burst, or a stalled loop, milliseconds.
DECISION_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.1)
# Slack (and lateness) at release: objectives span 50 ms (a client's own) to a minute (the middle classes'
# default); lateness reaches the longest queue wait (120 s by default, a few minutes at most).
SLACK_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)

# Endpoint health changes, as the core's events tell them (core/release/health_log.py).
HEALTH = logging.getLogger("extproc.health")
# The engine refusing requests at its own queue cap is logged at most this often per endpoint.
REJECTIONS_LOG_S = 10.0

OTHER_TENANT = "other"
NO_TENANT = "(none)"
UNKNOWN_MODEL = "(unknown)"
# Refusals the ext_proc adapter decides before a request reaches a model's queue: all the model label
# can be when the model is not served, and the refusals a known model gets before its tenant is known.
_UNKNOWN_MODEL_REASONS = (Refusal.MODEL_MISSING, Refusal.MODEL_NOT_FOUND, Refusal.INVALID_BODY, Refusal.BODY_TOO_LARGE)
_ADMISSION_REASONS = (Refusal.INVALID_MAX_TOKENS, Refusal.INVALID_TTFT_OBJECTIVE, Refusal.TENANT_MISSING,
                      Refusal.PRIORITY_NOT_ALLOWED, Refusal.NO_ENDPOINT, Refusal.SHUTTING_DOWN)
# Refusals of a request whose tenant is known: a queue cap, its queue timeout, the drain, shedding.
_QUEUE_REASONS = (Refusal.TENANT_QUEUE_FULL, Refusal.BAND_QUEUE_FULL, Refusal.MODEL_QUEUE_FULL,
                  Refusal.QUEUE_TIMEOUT, Refusal.SHUTTING_DOWN, Refusal.OVERLOADED)


def _package_version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


class TenantLabels:
    """The bounded set of tenant label values: the configured names, and ``other`` for everyone else."""

    def __init__(self, names: Iterable[str]) -> None:
        self._names = frozenset(names)
        self.values = (*sorted(self._names), OTHER_TENANT)

    def __call__(self, tenant: str) -> str:
        return tenant if tenant in self._names else OTHER_TENANT


M = TypeVar("M", Counter, Gauge, Histogram)


class _Series(Generic[M]):
    """One metric's declaration on :class:`Telemetry`; each instance holds the metric built on its registry."""

    def __init__(self, kind: type[M], name: str, documentation: str, labels: tuple[str, ...],
                 buckets: tuple[float, ...] | None = None) -> None:
        self.kind: type[M] = kind
        self.name = name
        self.documentation = documentation
        self.labels = labels
        self.buckets = buckets

    def build(self, registry: CollectorRegistry) -> M:
        extra: dict[str, Any] = {} if self.buckets is None else {"buckets": self.buckets}
        metric: M = self.kind(self.name, self.documentation, self.labels, registry=registry, **extra)
        return metric

    @overload
    def __get__(self, owner: None, cls: type[Telemetry]) -> _Series[M]: ...
    @overload
    def __get__(self, owner: Telemetry, cls: type[Telemetry]) -> M: ...

    def __get__(self, owner: Telemetry | None, cls: type[Telemetry]) -> _Series[M] | M:
        if owner is not None:  # only before __init__ built the instance's metrics
            raise AttributeError(self.name)
        return self


def _counter(name: str, documentation: str, *labels: str) -> _Series[Counter]:
    return _Series(Counter, name, documentation, labels)


def _gauge(name: str, documentation: str, *labels: str) -> _Series[Gauge]:
    return _Series(Gauge, name, documentation, labels)


def _histogram(name: str, documentation: str, *labels: str, buckets: tuple[float, ...]) -> _Series[Histogram]:
    return _Series(Histogram, name, documentation, labels, buckets)


class Telemetry:
    """The processor's series on one registry: declared once below, built for each instance.

    Each class attribute is a :func:`_counter`, :func:`_gauge` or
    :func:`_histogram` declaration; an instance reads it as the metric of its
    own registry, so tests can run several processors in one process.
    """

    queue_depth = _gauge("extproc_queue_depth", "Requests held in the fair queue.", "model", "priority", "tenant")
    queue_wait = _histogram(
        "extproc_queue_wait_seconds",
        "Time a request spent held before release or rejection.",
        "model", "priority", "tenant", buckets=WAIT_BUCKETS,
    )
    decision_latency = _histogram(
        "extproc_decision_latency_seconds",
        "Time the dispatcher took to take in one arrival (queue caps, cost estimate, queueing, dispatch); the queue "
        "wait is not in it.",
        "model", buckets=DECISION_BUCKETS,
    )
    released = _counter("extproc_released", "Requests released to the engine.", "model", "priority", "tenant")
    rejected = _counter(
        "extproc_rejected",
        "Requests answered by the processor instead of the engine (tenant \"(none)\": refused before the tenant was"
        " known).",
        "model", "reason", "tenant",
    )
    charged_prompt_tokens = _counter(
        "extproc_charged_prompt_tokens",
        "Prompt tokens charged to finished requests (estimated from Content-Length; see docs/configuration.md).",
        "model", "tenant",
    )
    prefix_blocks = _histogram(
        "extproc_prefix_blocks",
        "Leading prompt blocks hashed per request of a model with prefix signatures (models[].prefix); 0: too short "
        "a prompt, or none found in the body.",
        "model", buckets=(0, 1, 2, 4, 8, 16, 32, 64, 128, 256),
    )
    charged_cached_prompt_tokens = _counter(
        "extproc_charged_cached_prompt_tokens",
        "Of the prompt tokens charged, those charged as found in the engine's prefix cache (models with prefix "
        "signatures: the account of what each endpoint holds, confirmed by its prefix-cache counters).",
        "model", "tenant",
    )
    charged_output_tokens = _counter(
        "extproc_charged_output_tokens",
        "Output tokens charged to finished requests (occupancy x decode rate capped by max_tokens; else the estimate).",
        "model", "tenant",
    )
    charged_cost = _counter(
        "extproc_charged_cost",
        "Cost charged to finished requests in vtc units (input_weight x uncached + cached_input_weight x cached prompt"
        " + output_weight x output tokens).",
        "model", "tenant",
    )
    cost_clamped = _counter(
        "extproc_cost_clamped",
        "Requests whose max_tokens or Content-Length was beyond the model's max_context_tokens (the vtc cost counts at "
        "most the context).",
        "model",
    )
    abandoned = _counter("extproc_abandoned", "Requests whose client left while they were queued.", "model", "priority", "tenant")
    # TTFT objectives (adapters/objectives.py: what met and missed mean).
    objective = _counter(
        "extproc_objective_requests",
        "Requests with a TTFT objective by outcome: met (released by its deadline) or missed (released after it, or "
        "refused or abandoned once it had passed); refused or abandoned before it: neither.",
        "model", "priority", "tenant", "outcome",
    )
    release_slack = _histogram(
        "extproc_release_slack_seconds",
        "Time left until a request's TTFT objective deadline when it was released on time (late releases: "
        "extproc_release_lateness_seconds).",
        "model", "priority", buckets=SLACK_BUCKETS,
    )
    release_lateness = _histogram(
        "extproc_release_lateness_seconds",
        "How long past its TTFT objective's deadline a late request was released.",
        "model", "priority", buckets=SLACK_BUCKETS,
    )
    preemptions = _counter(
        "extproc_preemptions",
        "Released requests of a preemptible class ended before their response began (503 preempted) because a higher "
        "class's objective was at risk.",
        "model", "priority", "tenant",
    )
    preempted_occupancy = _counter(
        "extproc_preempted_occupancy_seconds",
        "Time preempted requests had held the engine since their release: the work thrown away.",
        "model", "priority",
    )
    shed = _counter(
        "extproc_shed",
        "Requests the processor refused overloaded under sustained overload, by the class they were granted (the "
        "lowest class present goes first).",
        "model", "priority",
    )
    priority_downgraded = _counter(
        "extproc_priority_downgraded",
        "Requests that asked for a priority class their tenant is not entitled to and got a lower one.",
        "model", "requested", "granted",
    )
    model_names = _counter(
        "extproc_model_name_requests",
        "Requests admitted by the model name the body asked for (a served name, or the pattern that matched it).",
        "model", "name",
    )
    served_elsewhere = _counter(
        "extproc_served_elsewhere",
        "Released requests the gateway reported served by another endpoint than the one picked (a fallback was taken: "
        "the picked endpoint failed).",
        "model",
    )
    in_flight = _gauge("extproc_in_flight", "Released requests whose response has not finished.", "model")
    engine_waiting = _gauge("extproc_engine_waiting", "Engine waiting queue from the last good scrape.", "model", "endpoint")
    engine_running = _gauge("extproc_engine_running", "Engine running requests from the last good scrape.", "model", "endpoint")
    scrape_errors = _counter("extproc_scrape_errors", "Failed or unusable engine /metrics scrapes.", "model", "endpoint")
    engine_kv_usage = _gauge(
        "extproc_engine_kv_usage_ratio",
        "Engine KV-cache usage (0..1) from the last good scrape, where the engine reports it.",
        "model", "endpoint",
    )
    last_scrape = _gauge(
        "extproc_endpoint_last_scrape_timestamp_seconds",
        "Unix time of the endpoint's last good /metrics scrape.",
        "model", "endpoint",
    )
    engine_itl = _gauge(
        "extproc_engine_inter_token_latency_seconds",
        "Mean inter-token latency over the adaptive rule's short window (histogram deltas).",
        "model", "endpoint",
    )
    gate_limit = _gauge(
        "extproc_gate_limit",
        "Requests the release rule lets the endpoint hold (running + waiting): adaptive, learned online; "
        "static_concurrency, max_in_flight.",
        "model", "endpoint",
    )
    endpoint_degraded = _gauge(
        "extproc_endpoint_degraded",
        "1 while the endpoint's metrics are failing, garbage or stale (capped at its fallback limit).",
        "model", "endpoint",
    )
    endpoint_up = _gauge(
        "extproc_endpoint_up",
        "0 while the endpoint's engine is unreachable (connection refused, release failures, its own 503): nothing is "
        "released to it; 1 once it answers again.",
        "model", "endpoint",
    )
    release_failures = _counter(
        "extproc_release_failures",
        "Released requests that failed before the engine answered (unreachable, reset); "
        "endpoint '(unknown)' where the pool cannot tell which endpoint took it.",
        "model", "endpoint",
    )
    release_refused_full = _counter(
        "extproc_release_refused_full",
        "Released requests the engine refused as full (its own queue cap: its 503 or 429) after Envoy's retries, "
        "among the releases whose response the gate checks; each cuts the endpoint's limit.",
        "model", "endpoint",
    )
    engine_rejections = _counter(
        "extproc_engine_rejections",
        "Requests the engine's metrics say it refused at its own queue cap (vLLM's "
        "vllm:admission_rejections_total), from every client: the gateway's and any that bypass it.",
        "model", "endpoint",
    )
    gate_fallback = _gauge(
        "extproc_gate_fallback",
        "1 while the gate runs on its fallback in-flight limit (engine metrics unusable).",
        "model",
    )
    draining = _gauge("extproc_draining", "1 from SIGTERM until the process exits (health NOT_SERVING).")
    # Active-active (a `cluster:` section; adapters/cluster/link.py): one series per model.
    cluster_degraded = _gauge(
        "extproc_cluster_degraded",
        "1 while the cluster's Redis cannot be reached: this instance releases on its own share (each band's cap / "
        "instances).",
        "model",
    )
    cluster_instances = _gauge(
        "extproc_cluster_instances",
        "Live instances of the cluster at the last round trip (this one included).",
        "model",
    )
    cluster_round_trips = _counter(
        "extproc_cluster_round_trips",
        "Round trips to the cluster's Redis (one script call each: publish, claim, decide), by outcome.",
        "model", "outcome",
    )
    cluster_round_trip = _histogram(
        "extproc_cluster_round_trip_seconds",
        "Time of one successful round trip to the cluster's Redis.",
        "model", buckets=DECISION_BUCKETS,
    )
    # TLS on the gRPC port (listen.tls; adapters/ext_proc/tls.py).
    tls_reloads = _counter(
        "extproc_tls_reloads",
        "Reloads of the gRPC port's changed certificate files, by outcome (failed: the previous one still serves).",
        "outcome",
    )

    # Live configuration (adapters/reload.py).
    config_reloads = _counter(
        "extproc_config_reloads",
        "Reloads of the config file (SIGHUP or --watch-config), by outcome (rejected: the previous config still serves).",
        "outcome",
    )
    config_info = _gauge(
        "extproc_config_info", "Always 1; the label is the SHA-256 (first 12 hex digits) of the config file serving.",
        "sha256",
    )
    config_applied = _gauge(
        "extproc_config_last_applied_timestamp_seconds", "When the config serving was loaded (start or last applied reload).",
    )
    envoy_config_stale = _gauge(
        "extproc_envoy_config_stale",
        "1 when `extproc envoy-config` prints another document for the config serving than for the one the process "
        "started with: Envoy must be rolled to the new one.",
    )

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        # CPU, memory, open files, start time (process_*) and the interpreter (python_info), on our registry.
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        Gauge(
            "extproc_build_info", "Always 1; the labels say which extproc and Python run.",
            ["version", "python"], registry=r,
        ).labels(_package_version("extproc-fair"), platform.python_version()).set(1)
        # Each model's reporter, by model name (ModelTelemetry registers itself).
        self.models: dict[str, ModelTelemetry] = {}
        # In the instance's own dict, the metrics are plain attributes: no descriptor call on the hot path.
        for attr, series in vars(Telemetry).items():
            if isinstance(series, _Series):
                self.__dict__[attr] = series.build(r)

    def report(self, model: str) -> ModelTelemetry:
        """Where ``model``'s events go; a model no dispatcher serves reports as ``(unknown)``."""
        reporter = self.models.get(model) or self.models.get(UNKNOWN_MODEL)
        return reporter or ModelTelemetry(self, UNKNOWN_MODEL, (), TenantLabels(()))

    def tls_reloaded(self, outcome: str) -> None:
        self.tls_reloads.labels(outcome=outcome).inc()

    def per_endpoint_gauges(self) -> tuple[Gauge, ...]:
        """Gauges labelled (model, endpoint): cleared when an endpoint leaves its pool."""
        return (self.engine_waiting, self.engine_running, self.engine_kv_usage, self.engine_itl,
                self.gate_limit, self.endpoint_degraded, self.endpoint_up, self.last_scrape)

    def expect(self, models: Iterable[str], tenants: TenantLabels) -> None:
        """Create at zero the refusals the ext_proc adapter counts itself (see the module docstring)."""
        for reason in _UNKNOWN_MODEL_REASONS:
            self.rejected.labels(UNKNOWN_MODEL, reason.value, NO_TENANT)
        for model in models:
            for reason in _ADMISSION_REASONS:
                self.rejected.labels(model, reason.value, NO_TENANT)
            for tenant in tenants.values:
                for reason in _QUEUE_REASONS:
                    self.rejected.labels(model, reason.value, tenant)


@dataclass(frozen=True, slots=True)
class Admitted:
    """The servicer admitted a request by ``name`` (a served name, or the pattern it matched)."""

    name: str
    # The class it asked for and the one it got, when it was downgraded.
    requested: str | None = None
    granted: str | None = None


@dataclass(frozen=True, slots=True)
class TurnedAway:
    """The servicer answered a request before its tenant was known (a bad body, overload, a missing tenant...)."""

    refusal: Refusal


@dataclass(frozen=True, slots=True)
class Signed:
    """The servicer computed a request's prefix signature: ``blocks`` leading blocks hashed."""

    blocks: int


@dataclass(frozen=True, slots=True)
class ServedElsewhere:
    """The gateway served a release on another endpoint than the pick (a fallback was taken)."""


@dataclass(frozen=True, slots=True)
class ClusterTrip:
    """One round trip to the cluster's Redis: ``seconds`` when it succeeded (None: it failed)."""

    seconds: float | None
    instances: int | None = None


AdapterEvent = Admitted | TurnedAway | Signed | ServedElsewhere | ClusterTrip


class ModelTelemetry:
    """One model's series, its decision lines and its health log lines: every report of the model comes here.

    The core's events (``core/report.py``) and the adapters' own (the
    servicer's admissions, the cluster link's round trips) take this one road.
    """

    def __init__(self, telemetry: Telemetry, model: str, priorities: Iterable[str], tenants: TenantLabels,
                 clock: Callable[[], float] = time.monotonic) -> None:
        priorities = tuple(priorities)
        self._t = telemetry
        self._model = model
        self._priorities = priorities
        telemetry.models[model] = self
        t = telemetry
        t.cost_clamped.labels(model)
        t.served_elsewhere.labels(model)
        t.gate_fallback.labels(model)
        self._decision = t.decision_latency.labels(model)
        self._prefix_blocks = t.prefix_blocks.labels(model)
        self._in_flight = t.in_flight.labels(model)
        self._label(tenants)
        self._slack = {p: t.release_slack.labels(model, p) for p in priorities}
        self._late = {p: t.release_lateness.labels(model, p) for p in priorities}
        self._occupancy = {p: t.preempted_occupancy.labels(model, p) for p in priorities}
        # The status page's view: the same outcomes, with the tenant's own id and the last minute's slack.
        self.objectives = Objectives(priorities, clock)
        # Asked once, at start-up (logging is set up before the dispatchers are built): with
        # DEBUG off a decision costs one attribute test, not a logging call per request.
        self._decisions = DECISIONS.isEnabledFor(logging.DEBUG)
        # Per endpoint: when the engine's refusals were last logged.
        self._rejections_logged: dict[str, float] = {}
        self._clock = clock
        self._handlers: dict[type, Callable[[Any], None]] = {
            RequestEvent: self._request, PoolEvent: self._pool, Charged: self._charged_event,
            EndpointEvent: self._endpoint, Admitted: self._admitted, TurnedAway: self._turned_away,
            ServedElsewhere: self._served_elsewhere, ClusterTrip: self._cluster_trip, Signed: self._signed,
        }

    def _label(self, tenants: TenantLabels) -> None:
        """Look up the children of every (class, tenant value) once.

        ``labels()`` validates and locks on every call, and these are written
        several times per request. Every key exists (known classes x bounded
        tenant values), so each series starts at zero.
        """
        t, model, priorities = self._t, self._model, self._priorities
        self._tenant = tenants
        self._charged = {
            tenant: (t.charged_prompt_tokens.labels(model, tenant), t.charged_cached_prompt_tokens.labels(model, tenant),
                     t.charged_output_tokens.labels(model, tenant), t.charged_cost.labels(model, tenant))
            for tenant in tenants.values
        }
        keys = [(priority, tenant) for priority in priorities for tenant in tenants.values]
        self._released = {key: t.released.labels(model, *key) for key in keys}
        self._abandoned = {key: t.abandoned.labels(model, *key) for key in keys}
        self._shed = {priority: t.shed.labels(model, priority) for priority, _ in keys}
        self._queued = {key: t.queue_depth.labels(model, *key) for key in keys}
        self._waited = {key: t.queue_wait.labels(model, *key) for key in keys}
        self._objective = {(*key, outcome): t.objective.labels(model, *key, outcome)
                           for key in keys for outcome in (MET, MISSED)}
        self._preemptions = {key: t.preemptions.labels(model, *key) for key in keys}

    def relabel(self, tenants: TenantLabels, queued: dict[tuple[str, str], int]) -> None:
        """The config now names other tenants (a reload): new label values, queue depths recounted.

        A queued request was counted under the label its tenant had then; the
        depth gauges are set again from what is queued now (``queued``: by
        class and tenant), so its leaving, counted under the new label, keeps
        them exact. Counters keep what they counted.
        """
        before = list(self._queued)  # a tenant the config no longer names: its depth goes to 0
        self._label(tenants)
        depth: dict[tuple[str, str], int] = dict.fromkeys([*before, *self._queued], 0)
        for (band, tenant), count in queued.items():
            key = (band, tenants(tenant))
            depth[key] = depth.get(key, 0) + count
        for key, count in depth.items():
            self._t.queue_depth.labels(self._model, *key).set(count)

    def __call__(self, event: Event | AdapterEvent) -> None:
        # By type, not by a chain of isinstance tests: several events per request pass here.
        self._handlers[type(event)](event)

    def _charged_event(self, event: Charged) -> None:
        prompt, cached, output, units = self._charged[self._tenant(event.tenant)]
        prompt.inc(event.prompt_tokens)
        cached.inc(event.cached_tokens)
        output.inc(event.output_tokens)
        units.inc(event.cost)

    def _admitted(self, event: Admitted) -> None:
        self._t.model_names.labels(self._model, event.name).inc()
        if event.requested is not None:
            self._t.priority_downgraded.labels(self._model, event.requested, event.granted).inc()

    def _turned_away(self, event: TurnedAway) -> None:
        self._t.rejected.labels(self._model, event.refusal.value, NO_TENANT).inc()

    def _signed(self, event: Signed) -> None:
        self._prefix_blocks.observe(event.blocks)

    def _served_elsewhere(self, event: ServedElsewhere) -> None:
        self._t.served_elsewhere.labels(self._model).inc()

    def _cluster_trip(self, event: ClusterTrip) -> None:
        t, model = self._t, self._model
        t.cluster_round_trips.labels(model, "failed" if event.seconds is None else "ok").inc()
        t.cluster_degraded.labels(model).set(1 if event.seconds is None else 0)
        if event.seconds is not None:
            t.cluster_round_trip.labels(model).observe(event.seconds)
        if event.instances is not None:
            t.cluster_instances.labels(model).set(event.instances)

    def _request(self, event: RequestEvent) -> None:
        key = (event.band, self._tenant(event.tenant))
        if event.step is Step.QUEUED:
            self._queued[key].inc()
            return
        if event.step is Step.PREEMPTED:
            # Released before: not in the queue, and already counted released (not refused as well).
            self._preemptions[key].inc()
            self._occupancy[event.band].inc(event.waited_s)
            self.objectives.record(event.band, event.tenant, PREEMPTED)
        else:
            self._left_queue(event, key)
        if self._decisions:
            self._decided(event)

    def _left_queue(self, event: RequestEvent, key: tuple[str, str]) -> None:
        if event.dequeued:
            self._queued[key].dec()
        released = event.step is Step.RELEASED
        if released:
            self._released[key].inc()
            self._waited[key].observe(event.waited_s)
        elif event.step is Step.ABANDONED:
            self._abandoned[key].inc()
        elif event.refusal is not None:
            self._t.rejected.labels(self._model, event.refusal.value, key[1]).inc()
            if event.refusal is Refusal.OVERLOADED:
                self._shed[event.band].inc()
            if event.refusal is Refusal.QUEUE_TIMEOUT:
                self._waited[key].observe(event.waited_s)
        slack = event.slack_s
        if slack is None:
            return
        outcome = verdict(released, slack)
        if outcome is None:
            return
        self._objective[(*key, outcome)].inc()
        if released:
            if slack >= 0:
                self._slack[event.band].observe(slack)
            else:
                self._late[event.band].observe(-slack)
        self.objectives.record(event.band, event.tenant, outcome, slack if released else None)

    def _decided(self, event: RequestEvent) -> None:
        """The request's decision line: its outcome, its time (queued; a preempted one's: since its release), slack."""
        preempted = event.step is Step.PREEMPTED
        outcome = Step.PREEMPTED.value if preempted else event.outcome
        took = "ran_ms" if preempted else "wait_ms"
        fields: dict[str, object] = {"tenant": event.tenant, "class": event.band, "model": self._model,
                                     took: round(event.waited_s * 1000, 1), "outcome": outcome}
        line = f"{outcome} {self._model} tenant={event.tenant} class={event.band} {took}={fields[took]}"
        if event.slack_s is not None:
            fields["slack_ms"] = round(event.slack_s * 1000, 1)
            line += f" slack_ms={fields['slack_ms']}"
        DECISIONS.debug("%s", line, extra=fields)

    def _pool(self, event: PoolEvent) -> None:
        if event.decision_s is not None:
            self._decision.observe(event.decision_s)
        if event.cost_clamped:
            self._t.cost_clamped.labels(self._model).inc()
        if event.in_flight is not None:
            self._in_flight.set(event.in_flight)
        if event.fallback is not None:
            self._t.gate_fallback.labels(self._model).set(1 if event.fallback else 0)
            if event.note:
                HEALTH.log(logging.WARNING if event.fallback else logging.INFO, event.note)

    def _endpoint(self, event: EndpointEvent) -> None:
        t, model, endpoint = self._t, self._model, event.endpoint or "(unknown)"
        match event.change:
            case Change.SCRAPED if event.load is not None:
                self._scraped(endpoint, event.load, event.itl_s, event.limit)
                if event.load.rejected is not None:
                    self._count_rejections(endpoint, event.refused, event.limit)
            case Change.SCRAPE_FAILED:
                t.scrape_errors.labels(model, endpoint).inc()
            case Change.LEFT:
                for gauge in t.per_endpoint_gauges():
                    try:
                        gauge.remove(model, endpoint)
                    except KeyError:
                        pass
            case Change.DEGRADED | Change.USABLE:
                t.endpoint_degraded.labels(model, endpoint).set(1 if event.change is Change.DEGRADED else 0)
            case Change.DOWN | Change.UP:
                t.endpoint_up.labels(model, endpoint).set(1 if event.change is Change.UP else 0)
            case Change.RELEASE_FAILED:
                t.release_failures.labels(model, endpoint).inc()
            case Change.REFUSED_FULL:
                t.release_refused_full.labels(model, endpoint).inc()
        if event.note:
            warning = event.warning or event.change in (Change.DEGRADED, Change.DOWN)
            HEALTH.log(logging.WARNING if warning else logging.INFO, event.note)

    def _count_rejections(self, endpoint: str, refused: float, limit: float | None) -> None:
        """Mirror the engine's rejection counter; say it in the log when it rises, at most every REJECTIONS_LOG_S."""
        counter = self._t.engine_rejections.labels(self._model, endpoint)
        if not refused:
            return
        counter.inc(refused)
        now = self._clock()
        if now - self._rejections_logged.get(endpoint, -math.inf) >= REJECTIONS_LOG_S:
            self._rejections_logged[endpoint] = now
            cut = f"; the gate's limit is now {limit:g}" if limit is not None else ""
            HEALTH.warning(
                "%s %s: the engine refused %d request(s) at its own queue cap%s. If this repeats, its cap is "
                "below its batch size plus target_waiting, or clients bypass the gateway (docs/engines.md)",
                self._model, endpoint, refused, cut,
            )

    def _scraped(self, endpoint: str, load: EngineLoad, itl_s: float | None, limit: float | None) -> None:
        t, model = self._t, self._model
        t.engine_waiting.labels(model, endpoint).set(load.waiting)
        t.engine_running.labels(model, endpoint).set(load.running)
        t.last_scrape.labels(model, endpoint).set(time.time())
        # Created at zero once the endpoint is known: its failures then show 0, not "no data". So is
        # "degraded", which is otherwise written only on a change (an endpoint whose first scrape came
        # before the first dispatch was never reported degraded, and never got a sample).
        t.scrape_errors.labels(model, endpoint)
        t.release_failures.labels(model, endpoint)
        t.release_refused_full.labels(model, endpoint)
        t.endpoint_degraded.labels(model, endpoint)
        if load.kv_usage is not None:
            t.engine_kv_usage.labels(model, endpoint).set(load.kv_usage)
        if itl_s is not None:
            t.engine_itl.labels(model, endpoint).set(itl_s)
        if limit is not None:
            t.gate_limit.labels(model, endpoint).set(limit)
