"""The processor's series, declared once as a table: name, help, labels (and buckets) for each.

:class:`Series` declares every metric as a class attribute (:func:`_counter`,
:func:`_gauge`, :func:`_histogram`) and builds them on the registry it is
given, so tests can run several processors in one process, each on its own
registry. The table is the one place a series is named and described; what
writes each series is the per-model recorder (model.py).

TTFT objectives (``objectives.py`` says which request met or missed its own,
and why a request refused before its deadline is neither): the verdicts per
class and tenant, the preemptions, and the slack at release. The slack is two
histograms, by sign: on-time releases' slack, late releases' lateness. One
histogram over negative and positive values would break its ``_sum``, a
counter that ``rate()`` reads a decrease of as a reset (OpenMetrics forbids
``_sum`` on a histogram with negative buckets), and ``histogram_quantile``
assumes the lowest bucket starts at 0.

The demand (``core/demand.py``): what an autoscaler scales the engines on,
one series per model (and class) with no tenant label, read from the
dispatcher when Prometheus scrapes; and the same pool under the Gateway API
Inference Extension's own names (``inference_pool_*{name}``, the model's
name), where they mean what its endpoint picker's mean. The queries that use
them are in docs/reference/metrics.md and docs/guides/autoscaling.md.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar, overload

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Queue waits span milliseconds (idle engine) to minutes (a flood in batch).
WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# Taking in one arrival costs microseconds; a dispatch that releases a burst, or a stalled loop, milliseconds.
DECISION_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.1)
# Slack (and lateness) at release: objectives span 50 ms (a client's own) to a minute (the middle classes'
# default); lateness reaches the longest queue wait (120 s by default, a few minutes at most).
SLACK_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)

M = TypeVar("M", Counter, Gauge, Histogram)


class _Series(Generic[M]):
    """One metric's declaration on :class:`Series`; each instance holds the metric built on its registry."""

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
    def __get__(self, owner: None, cls: type[Series]) -> _Series[M]: ...
    @overload
    def __get__(self, owner: Series, cls: type[Series]) -> M: ...

    def __get__(self, owner: Series | None, cls: type[Series]) -> _Series[M] | M:
        if owner is not None:  # only before __init__ built the instance's metrics
            raise AttributeError(self.name)
        return self


def _counter(name: str, documentation: str, *labels: str) -> _Series[Counter]:
    return _Series(Counter, name, documentation, labels)


def _gauge(name: str, documentation: str, *labels: str) -> _Series[Gauge]:
    return _Series(Gauge, name, documentation, labels)


def _histogram(name: str, documentation: str, *labels: str, buckets: tuple[float, ...]) -> _Series[Histogram]:
    return _Series(Histogram, name, documentation, labels, buckets)


class Series:
    """The processor's series on one registry: declared once below, built for each instance.

    Each class attribute is a :func:`_counter`, :func:`_gauge` or
    :func:`_histogram` declaration; an instance reads it as the metric of its
    own registry.
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
    # TTFT objectives (adapters/telemetry/objectives.py: what met and missed mean).
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
        "class needed their slot (an idle-only class's at once, another's for an objective at risk).",
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
    # The demand (core/demand.py), read when scraped: what an autoscaler scales the engines on.
    demand = _gauge(
        "extproc_demand_requests",
        "Requests of the model per class held here (state held) or released to its engines and not finished (state "
        "in_flight): the demand on its engines, whatever the engines' own queues show.",
        "model", "priority", "state",
    )
    engines_needed = _gauge(
        "extproc_engines_needed",
        "Engines the model's demand needs now: its requests held and in flight over what one endpoint holds at its "
        "learned limit (extproc_engine_capacity_requests); 1 while anything is held and that is not known yet.",
        "model",
    )
    engine_capacity = _gauge(
        "extproc_engine_capacity_requests",
        "What one endpoint of the model holds at its learned limit (running + waiting): the mean over its ready "
        "endpoints, the last one seen while none is ready, else max_running + target_waiting; NaN: not known yet.",
        "model",
    )
    drain_seconds = _gauge(
        "extproc_drain_seconds",
        "How long the model's held requests take to leave at the release rate of the last 10 s: 0 with none held, "
        "+Inf while nothing is released (no engine up).",
        "model",
    )
    # The Gateway API Inference Extension's pool metrics, under their names (label `name`: the model).
    pool_ready = _gauge(
        "inference_pool_ready_pods",
        "The number of ready pods in the inference server pool: endpoints up with usable metrics (as GIE's endpoint "
        "picker reports it; `name` is the model).",
        "name",
    )
    pool_queue = _gauge(
        "inference_pool_average_queue_size",
        "The average number of requests pending in the model server queue, per ready pod: the engines' waiting and "
        "the requests this gateway holds for them (the whole queue while no pod is ready).",
        "name",
    )
    pool_running = _gauge(
        "inference_pool_average_running_requests",
        "The average number of running requests across the ready model servers of the pool.",
        "name",
    )
    pool_kv = _gauge(
        "inference_pool_average_kv_cache_utilization",
        "The average kv cache utilization (0..1) across the ready model servers of the pool.",
        "name",
    )
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
    asyncio_tasks = _gauge("extproc_asyncio_tasks", "Tasks on the processor's event loop, read at the scrape (a "
                           "number that keeps growing under steady traffic is a leak).")
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
    # TLS on the gRPC port (listen.tls; adapters/grpc/tls.py).
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

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        # In the instance's own dict, the metrics are plain attributes: no descriptor call on the hot path.
        for attr, series in vars(Series).items():
            if isinstance(series, _Series):
                self.__dict__[attr] = series.build(registry)

    @classmethod
    def declared(cls) -> list[_Series[Any]]:
        """Every series declared above, in order: what the metrics reference (docs/reference/metrics.md) is written from."""
        return [series for series in vars(cls).values() if isinstance(series, _Series)]

    def per_endpoint_gauges(self) -> tuple[Gauge, ...]:
        """Gauges labelled (model, endpoint): cleared when an endpoint leaves its pool."""
        return (self.engine_waiting, self.engine_running, self.engine_kv_usage, self.engine_itl,
                self.gate_limit, self.endpoint_degraded, self.endpoint_up, self.last_scrape)
