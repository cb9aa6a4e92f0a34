"""Per-model loop between held requests, the fair queue and the release side.

Each held request is an ``asyncio.Future`` that the ext_proc stream awaits.
Dispatch — pop from the fair queue while the band's allowance lasts — runs
only when something changed: a request arrived, a response finished, a scrape
reported (or, for a rate, the next release fell due). There is no polling
loop; an idle model costs nothing.

Every request that enters ends exactly one way: released (future result),
refused (future exception :class:`~extproc.core.outcomes.Refused`), or
abandoned (its client left: the stream's task was cancelled and the entry is
removed at once). A request over a queue cap is refused before it enters
(``submit`` raises). Outcomes are named here; what the client hears is the
ext_proc adapter's choice.

The loop decides nothing itself; each question has its own module:

* which request goes next: ``fair_queue.py`` and the band's policy (``policies/``);
* how many may go now: ``bands.py`` above the model's release rule (``release/``);
* where each goes (endpoint picking) and what the engines hold: ``release/pool.py``;
* whether a request may enter at all: ``caps.py``;
* what a release costs (``policy: vtc``): ``cost.py``, estimated at release,
  corrected when its stream ends;
* what each endpoint's prefix cache likely holds (``prefix_cache.py``): the
  ``locality`` policy's order, picking's preference, the cost's cached part;
* when to retry after a refusal: ``drain_time.py``;
* what may go now and to whom: its release strategy (``strategy.py``): this
  instance alone, or a seat of a cluster of instances (``cluster.py``);
* how a request leaves the queue, whichever decided: ``outlet.py``.

It takes plain values (built by ``adapters/wiring.py`` from the config),
reports through :class:`~extproc.core.report.DispatchReport`, and leaves its
deadlines (a queued request's longest wait, a rate's next release) to the
injected :class:`~extproc.core.timers.Timers`: the core keeps no event loop.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from extproc.core.bands import Band, BandAdmission
from extproc.core.caps import QueueCaps
from extproc.core.cost import CostModel, CostWeights, DecodeRate
from extproc.core.engine_load import EngineLimits, EngineLoad
from extproc.core.entitlement import Tenant
from extproc.core.fair_queue import FairQueue
from extproc.core.outcomes import Refusal, Refused
from extproc.core.outlet import Held, Outlet
from extproc.core.policies import Policy
from extproc.core.preemption import AGAIN_AFTER_S, Need, Preemption
from extproc.core.prefix import NO_PREFIX, Prefix
from extproc.core.prefix_cache import PrefixCaches
from extproc.core.release.answer import Answer
from extproc.core.release.pool import Pool
from extproc.core.release.rule import ReleaseRule, RuleSettings
from extproc.core.report import Change, Charged, DispatchReport, EndpointEvent, PoolEvent, RequestEvent, Step
from extproc.core.status import EndpointStatus, ModelStatus, band_status
from extproc.core.strategy import LocalRelease, ReleaseStrategy
from extproc.core.timers import Timers

__all__ = ["Held", "LiveSettings", "ModelDispatcher", "shutting_down"]

# Builds a model's release strategy on its outlet (default: LocalRelease, this instance alone).
StrategyFactory = Callable[[Outlet], ReleaseStrategy]


def shutting_down() -> Refused:
    """The refusal while the processor drains (a new exception each time: one is raised per request)."""
    return Refused(Refusal.SHUTTING_DOWN, "the gateway is restarting; retry shortly")


@dataclass(frozen=True)
class LiveSettings:
    """A model's settings that a dispatcher takes while it holds requests (:meth:`ModelDispatcher.reconfigure`).

    They change what happens next, never what is queued: a weight is read at
    each charge, a cap at each arrival, a band's settings at each release. Any
    other setting (the policy, the bands' names, endpoint picking) shapes the
    queue or the pool themselves and needs a new dispatcher.
    """

    bands: tuple[Band, ...]
    tenant: Callable[[str], Tenant]
    cost: CostWeights
    max_queued: int
    max_queue_wait_s: float
    reserved_waiting: int
    rule: type[ReleaseRule]
    rule_settings: RuleSettings


class ModelDispatcher:
    """One model's held requests: where the servicer submits them and ends them, and every event about its pool arrives.

    It exists so that the servicer and the scrapers talk to one object per
    model whatever decides the releases; each decision is delegated (see the
    module docstring).
    """

    def __init__(
        self,
        name: str,
        pool: Pool,
        bands: tuple[Band, ...],
        report: DispatchReport,
        clock: Callable[[], float] = time.monotonic,
        *,
        policy: Policy,
        timers: Timers,
        tenant: Callable[[str], Tenant],
        cost: CostWeights,
        max_queued: int,
        max_queue_wait_s: float,
        reserved_waiting: int,
        max_preemptions_per_s: float = 0.0,
        strategy: StrategyFactory | None = None,
    ) -> None:
        self.name = name
        self.pool = pool
        self._bands = bands
        self._max_queue_wait_s = max_queue_wait_s
        self._report = report
        self._clock = clock
        self._timers = timers
        # Read through self._tenant at every use, so that reconfigure() reaches the policies' weights.
        self._tenant = tenant
        self._caps = QueueCaps(name, bands, self._tenant_of, max_queued)
        self._queue: FairQueue[Held] = FairQueue(len(bands), lambda: policy.new_band(lambda t: self._tenant(t).weight))
        preemption = Preemption(max_preemptions_per_s)
        admission = BandAdmission(bands, pool, reserved_waiting, self._queue.band_len)
        # What each endpoint's prefix cache likely holds (requests with a prefix signature only).
        self._caches = PrefixCaches()
        self._outlet = Outlet(
            name, self._queue, pool, bands, admission, report, clock,
            lambda name, cost: policy.service(cost, self._tenant(name).weight), preemption,
            priced=self._priced, hit=self._hit_at,
        )
        self._strategy = (strategy or (lambda outlet: LocalRelease(outlet, timers)))(self._outlet)
        self._cost = CostModel(cost)
        self._decode_rate = DecodeRate()
        self._probe: Callable[[tuple[str, ...]], None] | None = None

    def probe_with(self, probe: Callable[[tuple[str, ...]], None]) -> None:
        """Ask ``probe`` to look at endpoints after a request to them ended; their slots wait for its answer.

        The adapter that can reach the engines (``adapters/engines/probe.py``)
        calls it, and answers through :meth:`record_probe`
        (``core/release/unconfirmed.py`` says why).
        """
        self._probe = probe
        self.pool.probe_ends = True

    def _tenant_of(self, name: str) -> Tenant:
        return self._tenant(name)

    def reconfigure(self, settings: LiveSettings) -> None:
        """Take new settings for what comes next; every held request keeps its place, band and deadline.

        The bands must keep their names and order (a queued request's band is
        its index). A changed release rule or rule setting starts the rule
        afresh (an adaptive limit is learned again within a few scrapes) on
        the same load estimate and endpoint health: what is in flight stays
        counted. A request already queued keeps the wait limit it was queued
        with. Dispatches at once: a raised limit releases now.
        """
        names = tuple(b.name for b in settings.bands)
        if names != tuple(b.name for b in self._bands):
            raise ValueError(f"the bands {names} are not the dispatcher's {tuple(b.name for b in self._bands)}")
        self._bands = settings.bands
        self._tenant = settings.tenant
        self._max_queue_wait_s = settings.max_queue_wait_s
        self._caps = QueueCaps(self.name, settings.bands, self._tenant_of, settings.max_queued)
        self._outlet.bands = settings.bands
        self._outlet.admission.reconfigure(settings.bands, settings.reserved_waiting)
        self._cost.weights = settings.cost
        if (type(self.pool.rule), self.pool.settings) != (settings.rule, settings.rule_settings):
            self.pool.reconfigure(settings.rule, settings.rule_settings)
        self.dispatch()

    def queued_by_tenant(self) -> dict[tuple[str, str], int]:
        """How many requests each (band name, tenant) has queued now (telemetry recounts its gauges from it)."""
        return {(band.name, tenant): count for index, band in enumerate(self._bands)
                for tenant, count in self._queue.tenant_lengths(index).items()}

    @property
    def queued(self) -> int:
        return len(self._queue)

    def queued_in(self, band: int) -> int:
        """Requests held in ``band`` (the servicer sheds the lowest class present first)."""
        return self._queue.band_len(band)

    @property
    def in_flight(self) -> int:
        """Released requests whose streams have not ended."""
        return self.pool.in_flight

    def status(self, top: int) -> ModelStatus:
        """A read-only snapshot for the status page (``core/status.py``); ``top`` tenants listed per band."""
        now = self._clock()
        pool = self.pool
        degraded, down = set(pool.degraded(now)), set(pool.down())
        endpoints = []
        for url in pool.endpoints:
            load = pool.health.last_good(url)
            good_at = pool.health.good_at(url)
            endpoints.append(EndpointStatus(
                url=url,
                running=load.running if load is not None else None,
                waiting=load.waiting if load is not None else None,
                scraped_ago_s=now - good_at if load is not None else None,
                limit=pool.rule.snapshot(url).limit,
                degraded=url in degraded,
                down=url in down,
                warning=pool.warnings.get(url, ""),
            ))
        return ModelStatus(
            name=self.name,
            rule=pool.rule.name,
            uses_metrics=pool.rule.uses_metrics,
            rule_rate=pool.settings.release_rate,
            queued=len(self._queue),
            in_flight=pool.in_flight,
            release_rate=self._outlet.release_rate.per_second(now),
            bands=tuple(band_status(b.name, self._queue.tenant_lengths(i), top) for i, b in enumerate(self._bands)),
            endpoints=tuple(endpoints),
            cluster=self._strategy.cluster(),
        )

    def submit(
        self,
        tenant: str,
        band: int,
        *,
        content_length: int | None = None,
        max_tokens: float | None = None,
        affinity: str = "",
        prefix: Prefix = NO_PREFIX,
        eligible: frozenset[str] | None = None,
        ttft_objective_s: float | None = None,
        retried: bool = False,
    ) -> Held:
        """Queue a request and dispatch; the returned future may already be resolved.

        ``affinity`` groups requests that share a prompt prefix (endpoint picking
        keeps them on one engine); empty means the tenant. ``prefix`` is its
        prompt's signature (``core/prefix.py``). ``eligible`` limits
        where it may go (endpoint picking). ``ttft_objective_s`` is the
        client's own objective (the band decides how far to trust it);
        ``retried``: the client says it is a retry, so it is never preempted.
        Raises :class:`~extproc.core.outcomes.Refused` when a queue cap leaves no room.
        """
        now = self._clock()
        overflow = self._caps.check(self._queue, tenant, band)
        if overflow is not None:
            self._outlet.refused(None, tenant, band, overflow.refusal, 0.0)
            self._report(PoolEvent(decision_s=self._clock() - now))
            raise Refused(overflow.refusal, overflow.message + "; retry later",
                          drain_s=self._outlet.release_rate.drain_s(overflow.backlog, now))
        estimate = self._cost.estimate(tenant, content_length, max_tokens)
        rules = self._bands[band]
        objective = rules.objective_s(ttft_objective_s)
        queue_wait = rules.queue_wait_s(self._max_queue_wait_s)
        held = Held(tenant, band, now, asyncio.get_running_loop().create_future(), estimate,
                    affinity=affinity or tenant, prefix=prefix, eligible=eligible, ttft_objective_s=objective,
                    deadline=now + (objective if objective is not None else queue_wait), retried=retried)
        if prefix.blocks:
            held.expected_hit = self._expected_hit
        first = self._queue.head(band, tenant) is None
        self._queue.push(band, tenant, held)
        self._outlet.admission.arrived(band, now)
        self._report(RequestEvent(Step.QUEUED, self._bands[band].name, tenant))
        held.expiry = self._timers.at(now + queue_wait, lambda: self._expire(held))
        self._strategy.queued(band, tenant, first, now)
        self._preempt_at_risk(now)
        self._report(PoolEvent(decision_s=self._clock() - now, cost_clamped=estimate.clamped))
        return held

    def _cache_of(self, held: Held) -> str:
        """Whose cache account a release's prefix goes into: its endpoint; without picking, the pool's one or all as one."""
        if held.endpoint is not None:
            return held.endpoint
        endpoints = self.pool.endpoints
        return endpoints[0] if len(endpoints) == 1 else ""

    def _expected_hit(self, held: Held) -> float:
        """The prompt tokens ``held`` would find cached if released now: where picking would look, at best."""
        if not self.pool.pick_endpoints:
            return self._caches.expected(held.prefix, self._cache_of(held))
        health = self.pool.health
        return self._caches.best(held.prefix, (e for e in self.pool.endpoints
                                               if not health.is_down(e) and (held.eligible is None or e in held.eligible)))

    def _hit_at(self, held: Held) -> Callable[[str], float] | None:
        """Per endpoint, the prompt tokens ``held`` would find cached there (picking weighs them); None: no signature."""
        if not held.prefix.blocks:
            return None
        return lambda endpoint: self._caches.expected(held.prefix, endpoint)

    def _priced(self, held: Held) -> None:
        """``held`` goes to its endpoint: its prefix joins that cache's account, its estimate prices the cached part."""
        prefix = held.prefix
        if not prefix.blocks:
            return
        estimate = held.estimate
        cache = self._cache_of(held)
        rest = max(0.0, estimate.prompt_tokens - prefix.tokens) + estimate.output_tokens
        predicted = self._caches.released(cache, prefix, rest)
        held.estimate = self._cost.cached_at(estimate, predicted, self._caches.factor(cache))

    def end(self, held: Held) -> None:
        """The request's stream is over, whatever happened; safe to call more than once.

        Queued: its client left, forget it now. Released: its response has
        finished (or failed, or its client left), which frees an engine slot.
        Refused: nothing left to do.
        """
        if held.ended:
            return
        held.ended = True
        if held.released:
            now = self._clock()
            self._outlet.preemption.ended(held, now)
            self._outlet.waiting_above.pop(held, None)
            # Before the finish, whose dispatch would refill the slot: it waits for a sign of life.
            # With nothing queued, nothing would be sent into a dead engine: no need to look.
            probe = self.pool.record_end(held.endpoint, now) if len(self._queue) else ()
            self._finish(held, now)
            if probe and self._probe is not None:
                self._probe(probe)
            self._preempt_at_risk(self._clock())
        elif self._queue.remove(held.band, held.tenant, held):
            self._outlet.resolve(held)
            self._outlet.abandoned(held, held.band)

    def _finish(self, held: Held, now: float) -> float:
        """A released request is over (it ended, or was preempted): free its place and charge what it cost; its occupancy."""
        occupancy = self.pool.record_finish(held, now)
        measured = self._cost.measure(held.tenant, held.estimate, occupancy, self._decode_rate.rate,
                                      self._caches.factor(self._cache_of(held)))
        self._queue.correct(held.band, held.tenant, measured.cost - held.estimate.cost)
        self._report(Charged(held.tenant, held.estimate.prompt_tokens, measured.output_tokens, measured.cost,
                             measured.cached_tokens))
        self._report(PoolEvent(in_flight=self.pool.in_flight))
        self._strategy.ended(held.band, held.tenant, held.estimate.cost, measured.cost, self._clock())
        return occupancy

    def _needs(self, now: float) -> list[Need]:
        """The higher-band requests with an objective that wait for a slot, most urgent first (preemption.py).

        Those queued here in a band that is not preemptible, and those
        released into an engine without a free slot while it still queues.
        """
        outlet = self._outlet
        estimate = outlet.pool.estimate.now()
        if not outlet.engine_full(estimate):
            outlet.waiting_above.clear()  # the engine queues nothing: whoever was released runs
            if not any(self._queue.band_len(i) for i, band in enumerate(self._bands) if not band.preemptible):
                return []
        waiting = list(outlet.waiting_above)
        for index, band in enumerate(self._bands):
            if band.preemptible or not self._queue.band_len(index):
                continue
            heads = (self._queue.head(index, tenant) for tenant in self._queue.tenant_lengths(index))
            waiting.extend(head for head in heads if head is not None)
        again = now - AGAIN_AFTER_S
        deadlines = sorted(((due, held) for held in waiting
                            if (due := held.objective_due) is not None and held.room_made_at <= again),
                           key=lambda pair: pair[0])
        # Others waiting inside the engine (not these, which the estimate counts too) may be
        # served before them (an engine in arrival order).
        others = max(0, int(estimate.waiting) - len(outlet.waiting_above))
        return [Need(held, deadline, others + ahead) for ahead, (deadline, held) in enumerate(deadlines)]

    def _preempt_at_risk(self, now: float) -> None:
        """End the preemptible requests a higher band's objective at risk needs the slots of (preemption.py)."""
        preemption = self._outlet.preemption
        if not preemption.candidates:
            return
        for victim in preemption.victims(self._needs(now), now):
            self._preempt(victim, now)

    def _preempt(self, victim: Held, now: float) -> None:
        """End ``victim`` here at once, and tell its stream to answer 503 preempted.

        Its slot counts as free from now: Envoy resets the upstream request as
        it answers, and the engine aborts it within a step. Its stream's own
        end later finds it ended. It is charged what it ran (a refund of the rest).
        """
        victim.ended = True
        self._report(RequestEvent(Step.PREEMPTED, self._bands[victim.band].name, victim.tenant,
                                  now - victim.released_at, slack_s=victim.slack_s(now)))
        if victim.preempted is not None and not victim.preempted.done():
            victim.preempted.set_result(None)
        self._finish(victim, now)

    def record_response(self, held: Held, answer: Answer) -> None:
        """A released request's response began: what the engine answered (:class:`Answer`).

        ``DOWN`` (the engine unreachable, reset before answering) marks its
        endpoint down before the stream ends, so the slot it frees is not
        handed to the next held request: they wait for the engine, or go to an
        endpoint that is up. ``FULL`` (the engine refused it, its own queue
        cap reached) cuts the endpoint's limit and leaves it up.
        """
        if not held.released or held.ended:
            return
        held.started = True
        self._outlet.preemption.started(held)
        self._outlet.waiting_above.pop(held, None)
        self._release_outcome(held.endpoint, answer)

    def record_served(self, held: Held, endpoint: str) -> None:
        """The gateway reports where ``held`` was served; another endpoint than the pick means the pick failed it."""
        if not held.released or held.ended or held.endpoint is None or endpoint == held.endpoint:
            return
        if endpoint not in self.pool.endpoints:
            return  # not a member (yet): nothing to count it against
        picked, held.endpoint = held.endpoint, endpoint
        self.pool.record_moved(held, endpoint)
        self._release_outcome(picked, Answer.DOWN)

    def _release_outcome(self, endpoint: str | None, answer: Answer) -> None:
        """How a release to ``endpoint`` went; a change in who is down dispatches."""
        down = self.pool.down()
        target = self.pool.record_response(endpoint, answer, self._clock())
        if answer is Answer.DOWN:
            self._report(EndpointEvent(target, Change.RELEASE_FAILED))
        elif answer is Answer.FULL:
            limit = self.pool.rule.snapshot(target).limit if target is not None else None
            self._report(EndpointEvent(target, Change.REFUSED_FULL, limit=limit))
        if self.pool.down() != down:
            self.dispatch()  # reports the change; an endpoint back up takes held requests at once

    def record_probe(self, endpoint: str, alive: bool, started_at: float) -> None:
        """A probe of ``endpoint`` (started at ``started_at``): its engine answered, or nothing listens (down)."""
        down = self.pool.down()
        if self.pool.record_probe(endpoint, alive, started_at) or self.pool.down() != down:
            self.dispatch()  # slots confirmed free, or who is down changed (dispatch reports it)

    def serves(self, eligible: frozenset[str] | None = None) -> bool:
        """Whether an endpoint (of ``eligible``, when given) is there and not down to take a request."""
        return self.pool.serves(eligible)

    def record_scrape(self, endpoint: str, load: EngineLoad | None, started_at: float, *, reachable: bool = True) -> None:
        """A scrape's outcome (``load`` None: failed; ``reachable=False``: its connection was refused)."""
        refused = self.pool.record_scrape(endpoint, load, started_at, reachable=reachable)
        if load is None:
            self._report(EndpointEvent(endpoint, Change.SCRAPE_FAILED))
        else:
            self._decode_rate.record(endpoint, load.generation_tokens, load.running, started_at)
            self._caches.scraped(endpoint, load)
            snapshot = self.pool.rule.snapshot(endpoint)
            self._report(EndpointEvent(endpoint, Change.SCRAPED, load, snapshot.itl_s, snapshot.limit, refused=refused))
        self._strategy.scraped(self._clock())
        self._preempt_at_risk(self._clock())

    def record_limits(self, endpoint: str, limits: EngineLimits) -> None:
        """What the engine at ``endpoint`` says of its own limits: they bound the rule; a cap too tight is told."""
        pool = self.pool
        if endpoint not in pool.endpoints:
            return
        pool.rule.record_limits(endpoint, limits)
        warning = limits.too_tight(pool.rule.settings.target_waiting, pool.rule.runs(endpoint))
        pool.warnings[endpoint] = warning
        said = ", ".join(f"{k} {v}" for k, v in vars(limits).items() if v is not None) or "nothing of its limits"
        note = f"model {self.name}: engine {endpoint} says {said}" + (f"; {warning}" if warning else "")
        self._report(EndpointEvent(endpoint, Change.LIMITS, note=note, warning=bool(warning)))
        self.dispatch()

    def set_endpoints(self, endpoints: tuple[str, ...]) -> None:
        """The pool's membership changed (DNS); forget the telemetry of endpoints that left."""
        gone = set(self.pool.endpoints) - set(endpoints)
        self._caches.forget(gone)
        for endpoint in gone:
            self._report(EndpointEvent(endpoint, Change.LEFT))
        self.pool.set_endpoints(endpoints)

    def reject_all(self, refused: Callable[[], Refused] = shutting_down) -> None:
        """Refuse every queued request with ``refused()`` (default ``shutting_down``: draining ran out of time)."""
        outlet = self._outlet
        while len(self._queue):
            band, _, held = self._queue.pop()
            answer = refused()
            if held.future.done():  # its stream was cancelled a moment ago, as in dispatch()
                outlet.abandoned(held, band)
            else:
                outlet.refused(held, held.tenant, band, answer.refusal, self._clock() - held.enqueued_at)
            outlet.resolve(held, answer)

    def dispatch(self) -> None:
        """Let go what may go now (the strategy decides), and preempt for an objective at risk."""
        self._strategy.changed(self._clock())
        self._preempt_at_risk(self._clock())

    def _expire(self, held: Held) -> None:
        if not self._queue.remove(held.band, held.tenant, held):
            return
        now = self._clock()
        waited = now - held.enqueued_at
        band_name = self._bands[held.band].name
        self._outlet.refused(held, held.tenant, held.band, Refusal.QUEUE_TIMEOUT, waited)
        self._outlet.resolve(held, Refused(
            Refusal.QUEUE_TIMEOUT,
            f"request waited {waited:.1f}s in the {band_name!r} queue for model {self.name!r} without capacity; "
            "retry later",
            drain_s=self._outlet.release_rate.drain_s(self._queue.band_len(held.band), now), queue_wait_s=waited,
        ))
