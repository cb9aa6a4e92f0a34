"""Each model's recorder: every event of one model, core's and adapters', written to its series and logs.

Each model's dispatcher reports through a :class:`ModelTelemetry` (the core's
``DispatchReport``); the servicer and the cluster link report the adapters'
own events (events.py) to the same one. Its series' children for every known
(class, tenant value) are looked up once and created at zero, so a dashboard
shows 0, not "no data", before the first event. While the processor serves,
events are written after the replies ready with them (deferral.py).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import Counter

from extproc.adapters.telemetry.deferral import Deferral
from extproc.adapters.telemetry.events import AdapterEvent, Admitted, ClusterTrip, ServedElsewhere, Signed, TurnedAway
from extproc.adapters.telemetry.labels import NO_TENANT, TenantLabels
from extproc.adapters.telemetry.objectives import MET, MISSED, PREEMPTED, Objectives, verdict
from extproc.adapters.telemetry.series import Series
from extproc.core.demand import Demand
from extproc.core.values.engine_load import EngineLoad
from extproc.core.values.outcomes import Refusal
from extproc.core.values.report import Change, Charged, EndpointEvent, Event, PoolEvent, RequestEvent, Step

# Endpoint health changes, as the core's events tell them (core/release/health_log.py).
HEALTH = logging.getLogger("extproc.health")
# Where the per-request decision lines go (adapters/logs.py says their shape): one line per request that entered
# a queue, and one more if it was preempted after its release; the Batch API's runner adds its lines' attempts.
DECISIONS = logging.getLogger("extproc.decisions")
# The engine refusing requests at its own queue cap is logged at most this often per endpoint.
REJECTIONS_LOG_S = 10.0
# One reading of a model's demand serves every series of one scrape (read within this long of each other).
DEMAND_READ_S = 0.1


class _DemandReading:
    """A model's demand, read once per scrape: each of its series asks, within microseconds of the others."""

    def __init__(self, read: Callable[[], Demand], clock: Callable[[], float]) -> None:
        self._read = read
        self._clock = clock
        self._at = -math.inf
        self._last: Demand | None = None

    def __call__(self) -> Demand:
        now = self._clock()
        if self._last is None or now - self._at > DEMAND_READ_S:
            self._last, self._at = self._read(), now
        return self._last


class ModelTelemetry:
    """One model's series, its decision lines and its health log lines: every report of the model comes here.

    The core's events (``core/values/report.py``) and the adapters' own (the
    servicer's admissions, the cluster link's round trips) take this one road.
    """

    def __init__(self, series: Series, model: str, priorities: Iterable[str], tenants: TenantLabels,
                 clock: Callable[[], float] = time.monotonic, deferral: Deferral | None = None) -> None:
        priorities = tuple(priorities)
        # Where each event goes to be written: at once, unless the processor's deferral runs.
        self._defer = deferral or Deferral()
        self._t = t = series
        self._model = model
        self._priorities = priorities
        t.cost_clamped.labels(model)
        t.served_elsewhere.labels(model)
        t.gate_fallback.labels(model)
        self._decision = t.decision_latency.labels(model)
        self._prefix_blocks = t.prefix_blocks.labels(model)
        self._in_flight = t.in_flight.labels(model)
        self._names: dict[str, Counter] = {}
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

    def count_in_flight(self, in_flight: Callable[[], int]) -> None:
        """Read the model's in-flight gauge from ``in_flight`` when it is scraped: it changes with every release and
        end, so reporting each change would cost every request a gauge write that nobody reads."""
        self._in_flight.set_function(in_flight)

    def read_demand(self, demand: Callable[[], Demand]) -> None:
        """Read the model's demand series (and the pool's, under GIE's names) from ``demand`` when they are scraped,
        for the same reason: they change with every request."""
        t, model, now = self._t, self._model, _DemandReading(demand, self._clock)

        def of_band(state: str, band: int) -> Callable[[], float]:
            return lambda: (now().held if state == "held" else now().in_flight)[band]

        for band, priority in enumerate(self._priorities):
            for state in ("held", "in_flight"):
                t.demand.labels(model, priority, state).set_function(of_band(state, band))
        t.engines_needed.labels(model).set_function(lambda: now().engines)
        t.engine_capacity.labels(model).set_function(lambda: math.nan if (n := now().per_engine) is None else n)
        t.drain_seconds.labels(model).set_function(lambda: now().drain_s)
        t.pool_ready.labels(model).set_function(lambda: now().ready)
        t.pool_queue.labels(model).set_function(lambda: now().mean_queue)
        t.pool_running.labels(model).set_function(lambda: now().mean_running)
        t.pool_kv.labels(model).set_function(lambda: now().mean_kv_usage)

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
        self._defer.settle()  # a depth still to change under the old labels would be counted twice
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
        self._defer(self._handlers[type(event)], event)

    def _charged_event(self, event: Charged) -> None:
        prompt, cached, output, units = self._charged[self._tenant(event.tenant)]
        prompt.inc(event.prompt_tokens)
        cached.inc(event.cached_tokens)
        output.inc(event.output_tokens)
        units.inc(event.cost)

    def _admitted(self, event: Admitted) -> None:
        counter = self._names.get(event.name)
        if counter is None:  # the names are the config's (a served name, a pattern): a few children, looked up once
            counter = self._names[event.name] = self._t.model_names.labels(self._model, event.name)
        counter.inc()
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
            self._took_in(event.decision_s, event.cost_clamped)
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
        if event.tag:  # a batch line (adapters/batches): "<batch>/<line>"
            fields["batch_line"] = event.tag
            line += f" batch_line={event.tag}"
        DECISIONS.debug("%s", line, extra=fields)

    def _took_in(self, decision_s: float | None, cost_clamped: bool) -> None:
        """An arrival taken in (queued, or refused at the door): how long that took, and whether its cost was clamped."""
        if decision_s is not None:
            self._decision.observe(decision_s)
        if cost_clamped:
            self._t.cost_clamped.labels(self._model).inc()

    def _pool(self, event: PoolEvent) -> None:
        self._took_in(event.decision_s, event.cost_clamped)
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
