"""One model's scheduling state, with one owner: everything the dispatcher's events change, and the one release step.

:class:`ModelState` owns, for one model, the live settings (the bands among
them, stored here once), the fair queue of held requests, the band demand
(``bands.py``: who arrives, each band's credit towards its minimum share),
the preemption book (``preemption.py``: who may be ended, who waits in the
engine), the pricing (``pricing.py``: cost estimates and the account of the
engines' prefix caches), the recent release rate and the requests in flight
per band (with the queue, the demand an autoscaler reads: ``demand.py``).
Nothing else writes them: the dispatcher (``dispatcher.py``) hands it each
event and the release strategy (``strategy.py``) asks it questions and lets
requests go through it, as the :class:`~extproc.core.strategy.Outlet` it
implements (and a cluster seat as the :class:`~extproc.core.cluster.ClusterOutlet`). Whichever
strategy decides, a request leaves the queue the same way (:meth:`release`):
an endpoint picked, the pool and the fair queue charged, its future resolved
and the release reported.

It reads the pool (``release/pool.py``) and tells it of releases and finishes;
the pool's own events (scrapes, probes, membership) reach it from the
dispatcher. Pure: time is passed in; the queued requests' longest waits
(``expiry.py``) and the futures the streams await (which it only resolves) are
the injected :class:`~extproc.core.timers.Timers`' to make.

**No engine up** (a pool scaled to zero, its engines starting, every one
down): a queued request whose class's wait runs out is kept, up to the
model's cold-start wait since it arrived (``LiveSettings.cold_start_wait_s``),
and refused ``queue_timeout`` then if still no engine is up; once one is, the
held requests go in class and fairness order as ever.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial

from extproc.core.bands import Band, BandAllowance
from extproc.core.caps import overflow
from extproc.core.cluster import Backlog
from extproc.core.cost import CostWeights
from extproc.core.demand import Demand, DemandGauge
from extproc.core.drain_time import ReleaseRate
from extproc.core.entitlement import Tenant
from extproc.core.expiry import Expiry
from extproc.core.fair_queue import FairQueue
from extproc.core.held import Held, Request
from extproc.core.policies import Policy
from extproc.core.preemption import Preemption
from extproc.core.pricing import Pricing
from extproc.core.release.health_log import HealthLog
from extproc.core.release.pool import Pool
from extproc.core.release.rule import ReleaseRule, RuleSettings
from extproc.core.timers import Timers
from extproc.core.values.engine_load import EngineLoad
from extproc.core.values.outcomes import Refusal, Refused
from extproc.core.values.report import Charged, DispatchReport, RequestEvent, Step
from extproc.core.values.status import ClusterStatus, ModelStatus, band_status


@dataclass(frozen=True)
class LiveSettings:
    """A model's settings that it takes while it holds requests (:meth:`ModelState.reconfigure`).

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
    # The band's engine_priority is written into each body and the engines order their queues by it: True (the
    # operator says so), False (never), None (where every engine says it does: Pool.priority_first).
    engine_priority: bool | None = None
    # How long a queued request is kept past its class's wait while no engine of the pool is up, from its arrival.
    cold_start_wait_s: float = 0.0


class ModelState:
    """One model's held requests and everything decided about them (see the module docstring)."""

    def __init__(
        self, name: str, pool: Pool, settings: LiveSettings, report: DispatchReport, clock: Callable[[], float],
        timers: Timers, policy: Policy, max_preemptions_per_s: float,
    ) -> None:
        self.name = name
        self._pool = pool
        self._settings = settings
        self._report = report
        self._clock = clock
        self._policy = policy
        self._timers = timers
        self._pricing = Pricing(pool, settings.cost)
        self._queue: FairQueue[Held] = FairQueue(
            len(settings.bands), lambda: policy.new_band(self._weight, self._pricing.expected_hit))
        # Per band, the held requests that keep their slot to the end once released (``_firm``).
        self._firm_held = [0] * len(settings.bands)
        self.band_allowance = BandAllowance(settings.bands, pool, settings.reserved_waiting,
                                        self._queue.band_sizes.__getitem__, self._firm_held.__getitem__)
        self._preemption = Preemption(max_preemptions_per_s)
        self._release_rate = ReleaseRate()
        # Released and not finished, per band; the engines' size, arrivals and times in flight (demand.py).
        self._in_flight = [0] * len(settings.bands)
        self._demand = DemandGauge()
        self._health_log = HealthLog(name, pool, report)
        self._expiry = Expiry(timers, clock, self._expire)
        # A strategy's round (strategy.Outlet) is one call: the health log's note, the band rules' round itself.
        self.note_health: Callable[[float], None] = self._health_log.note
        self.release_round: Callable[[float, Callable[[int, float], int] | None], bool] = partial(
            self.band_allowance.release_round, release=self._release_next)
        self.engine_order: str | None = None  # every request asks: kept as it changes (_follow_engine_priority)
        self._follow_engine_priority()

    def reconfigure(self, settings: LiveSettings) -> None:
        """Take new settings for what comes next (the same bands, by name and order: a queued request's band is its index).

        A changed release rule or rule setting starts the rule afresh on the
        same load estimate and endpoint health (``Pool.reconfigure``).
        """
        names = tuple(b.name for b in settings.bands)
        if names != tuple(b.name for b in self._settings.bands):
            raise ValueError(f"the bands {names} are not the dispatcher's {tuple(b.name for b in self._settings.bands)}")
        self._settings = settings
        self.band_allowance.reconfigure(settings.bands, settings.reserved_waiting)
        self._pricing.reweigh(settings.cost)
        pool = self._pool
        if (pool.rule_type, pool.settings) != (settings.rule, settings.rule_settings):
            pool.reconfigure(settings.rule, settings.rule_settings)
        self._follow_engine_priority()

    def _follow_engine_priority(self) -> None:
        """``engine_order``: which ``priority`` values the engines run first ("lower", "higher") where the band's is
        written into each body; None: none is written. As configured, else as every engine said
        (``LiveSettings.engine_priority``). Followed wherever it may change: the settings, what an engine said, the
        pool's members. The bands count what is queued below them as passed while the engines order by priority."""
        configured = self._settings.engine_priority
        said = self._pool.priority_first()
        self.engine_order = said if configured is None else (said or "lower") if configured else None
        self.band_allowance.priority_queue = self.engine_order is not None

    def _weight(self, tenant: str) -> float:
        return self._settings.tenant(tenant).weight

    # --- the door --------------------------------------------------------------------------------

    def _refusal(self, tenant: str, band: int, now: float, tag: str = "") -> Refused | None:
        """The refusal of a new request over a queue cap (reported), or None if it may enter."""
        settings = self._settings
        over = overflow(self.name, self._queue, tenant, settings.tenant(tenant).max_queued, band, settings.bands[band],
                        settings.max_queued)
        if over is None:
            return None
        self._refused(None, tenant, band, over.refusal, 0.0, tag)
        return Refused(over.refusal, over.message + "; retry later", drain_s=self._release_rate.drain_s(over.backlog, now))

    def expect(self, tenant: str, content_length: int | None, max_tokens: float | None) -> tuple[float, float]:
        """The prompt and output tokens such a request would be charged (a budget's reservation); nothing learnt."""
        return self._pricing.expect(tenant, content_length, max_tokens)

    def enqueue(self, request: Request, now: float, content_length: int | None, max_tokens: float | None,
                ttft_objective_s: float | None) -> tuple[Held, bool]:
        """Queue ``request``, priced and given its deadlines; whether it is its tenant's first queued in its band.
        Raises :class:`~extproc.core.values.outcomes.Refused` (reported) over a queue cap; QUEUED is the dispatcher's."""
        band, tenant = request.band, request.tenant
        refused = self._refusal(tenant, band, now, request.tag)
        if refused is not None:
            raise refused
        objective, queue_wait = self.band_allowance.arrived(band, now, ttft_objective_s, self._settings.max_queue_wait_s)
        self._preemption.arrived(band, now, objective)
        held = Held(request, now, self._timers.future(),
                    self._pricing.estimate(tenant, content_length, max_tokens), ttft_objective_s=objective,
                    deadline=now + (objective if objective is not None else queue_wait), queue_wait_s=queue_wait)
        first = self._queue.push(band, tenant, held)
        held.firm = self._firm(held)
        self._firm_held[band] += held.firm
        self._demand.arrived(now)
        self._expiry.add(held)
        return held, first

    # --- the release step, and what a strategy reads (strategy.Outlet, cluster.ClusterOutlet) ------

    @property
    def bands(self) -> int:
        return len(self._settings.bands)

    @property
    def queued(self) -> int:
        return self._queue.size

    @property
    def in_flight(self) -> int:
        return self._pool.in_flight

    def clock(self) -> float:
        return self._clock()

    def first_band(self) -> int | None:
        return self._queue.first_band()

    def share(self, band: int, now: float) -> float:
        return self.band_allowance.share(band, now)

    def allowance(self, band: int, now: float) -> int:
        return self.band_allowance.allowance(band, now)

    def cap(self, band: int, now: float) -> int:
        return self.band_allowance.headroom(band, now) + self._pool.cluster_in_flight

    def free_slots(self, now: float) -> int:
        return self._pool.free_slots(now)

    def next_release_in(self, now: float) -> float | None:
        """How long until more may go by time alone: the release rule's (a rate), or an idle-only band's reserve lent."""
        due = [d for d in (self._pool.next_change_in(now), self.band_allowance.next_change_in(now)) if d is not None]
        return min(due) if due else None

    def service(self, tenant: str, cost: float) -> float:
        return self._policy.service(cost, self._weight(tenant))

    def record_others(self, now: float, others: int) -> None:
        self._pool.record_others(now, others)

    def backlog(self) -> Iterator[Backlog]:
        for band in range(len(self._settings.bands)):
            for tenant, count in self._queue.tenant_lengths(band).items():
                head = self._queue.head(band, tenant)
                yield Backlog(band, tenant, count, 0.0 if head is None else self.service(tenant, head.estimate.cost))

    def _release_next(self, band: int, now: float, free: bool) -> bool:
        """The release step of a round (``bands.Release``): the request the band's policy picks."""
        band, tenant, held = self._queue.pop(band)
        return self.release(band, tenant, held, now, free=free)

    def release_head(self, band: int, tenant: str, now: float, *, free: bool) -> bool:
        held = self._queue.take(band, tenant)
        if held is None or not self.release(band, tenant, held, now, free=free):
            return False
        self.band_allowance.released(band, now)  # a round counts its own (BandAllowance.release_round)
        return True

    def _firm(self, held: Held) -> bool:
        """Whether ``held``, once released, keeps its slot to the end: it is a stream (its response begins as the
        engine accepts it, and a response begun is never cut) or of a band that is not preemptible.

        A retry is never taken back either, but it is not counted: each request is retried at most once after a
        take-back, so retries are a bounded share of what a band runs, and counting them would keep a reserve free
        for a whole band of work that can be taken back.
        """
        request = held.request
        return not (request.whole and self._settings.bands[request.band].preemptible)

    def _dequeued(self, held: Held) -> None:
        """``held`` left the queue, whichever way."""
        self._firm_held[held.request.band] -= held.firm

    def release(self, band: int, tenant: str, held: Held, now: float, *, free: bool) -> bool:
        """``held`` left the queue to be released: release it, unless its client already left (False)."""
        self._dequeued(held)
        if held.future.done():  # its stream was cancelled a moment ago; end() will not find it
            self._resolve(held)
            self._abandoned(held)
            return False
        held.released, held.released_at = True, now
        request, pool = held.request, self._pool
        ranked = pool.ranked(request.affinity, now, request.eligible, self._pricing.hit_at(held))
        held.endpoint, held.fallbacks = (ranked[0], tuple(ranked[1:])) if ranked else (None, ())
        held.estimate = self._pricing.at_release(held)
        rules = self._settings.bands[band]
        # Counted as running until a scrape shows it: a release into a free slot, and an idle-only band's
        # (sized to free slots, or its probe past the capacity learned so far: one per scrape).
        into_free_slot = free or (rules.idle_only and self.band_allowance.into_free_slots(band, now))
        # Preemption asks whether the engines were full before it, for a request with an objective.
        held.checked, full = pool.released(held, now, held.endpoint, into_free_slot=into_free_slot,
                                           full_before=(book := self._preemption).enabled and held.ttft_objective_s is not None)
        if book.enabled and book.note_release(held, now, self._victim(held, rules, into_free_slot), full) is not None:
            held.preempted = self._timers.future()  # its stream watches for it (follow.py)
        self._release_rate.record(now)
        self._in_flight[band] += 1
        self._queue.charge(band, tenant, held.estimate.cost)
        self._resolve(held)
        self._report(RequestEvent(Step.RELEASED, rules.name, tenant, now - held.enqueued_at, slack_s=held.slack_s(now),
                                  tag=held.request.tag))
        return True

    def _victim(self, held: Held, rules: Band, into_free_slot: bool) -> tuple[bool, bool] | None:
        """Whether ``held``, just released, is a victim to be, as :meth:`Preemption.note_release` asks: its band
        idle-only, and it queued in an engine that serves in arrival order; None: it cannot be one (a stream begins as
        the engine accepts it; a retry is never preempted)."""
        request = held.request
        if not (rules.preemptible and request.whole and not request.retried):
            return None
        return rules.idle_only, not into_free_slot and not self.band_allowance.priority_queue

    # --- a held request's end ----------------------------------------------------------------------

    def started(self, held: Held) -> bool:
        """A released request's response began (it can no longer be preempted); False if it was not released or ended."""
        if not held.released or held.ended:
            return False
        held.started = True
        self._preemption.started(held)
        return True

    def moved(self, held: Held, endpoint: str) -> str | None:
        """``held`` was served at ``endpoint`` instead of its pick: counted there; the pick it failed (None: nothing moved)."""
        if not held.released or held.ended or held.endpoint is None or endpoint == held.endpoint:
            return None
        if endpoint not in self._pool.endpoints:
            return None  # not a member (yet): nothing to count it against
        picked, held.endpoint = held.endpoint, endpoint
        self._pool.record_moved(held, endpoint)
        return picked

    def ended(self, held: Held, now: float) -> tuple[str, ...]:
        """A released request's stream ended by itself: the endpoints to probe before its slot is refilled."""
        held.ended = True
        self._preemption.ended(held, now)
        # Before the finish, whose dispatch would refill the slot: it waits for a sign of life.
        # With nothing queued, nothing would be sent into a dead engine: no need to look.
        return self._pool.record_end(held.endpoint, now) if len(self._queue) else ()

    def abandon(self, held: Held) -> None:
        """A request that was not released ended (its client left, or it was refused): it leaves the queue if there."""
        held.ended = True
        if self._queue.remove(held.request.band, held.request.tenant, held):
            self._dequeued(held)
            self._resolve(held)
            self._abandoned(held)

    def finish(self, held: Held, now: float) -> float:
        """A released request is over (it ended, or was preempted): free its place, charge what it cost; the cost measured."""
        occupancy = self._pool.record_finish(held, now)
        self.band_allowance.finished(held.request.band, now)
        self._in_flight[held.request.band] -= 1
        self._demand.finished(now - held.released_at)
        measured = held.charge = self._pricing.measure(held, occupancy)
        request, estimate = held.request, held.estimate
        self._queue.correct(request.band, request.tenant, measured.cost - estimate.cost)
        self._report(Charged(request.tenant, estimate.prompt_tokens, measured.output_tokens, measured.cost,
                             measured.cached_tokens))
        return measured.cost

    # --- preemption (preemption.py decides; this ends) ----------------------------------------------

    def victims(self, now: float) -> list[Held]:
        """The preemptible requests to end now, for the higher-band requests whose objective is at risk."""
        book = self._preemption
        # Nobody in need (none queued here, none waiting in the engine): no victim, and the book need not be asked
        # (once its bucket is filling, it refills all the same when next asked).
        if not self._queue.size and not book.waiting_above and book.filled_at is not None:
            return []
        if not book.candidates:
            return []
        pool = self._pool
        load = pool.load_now()
        # What the engine queues: never more than it holds beyond its capacity, where that is known (a gate
        # without metrics counts all it released as waiting).
        capacity = pool.capacity()
        waiting = min(load.waiting, max(0.0, load.held - capacity)) if capacity > 0 else load.waiting
        # In an engine that orders its queue by priority, what the bands below queue is passed, not waited behind.
        waiting = max(0.0, waiting - self.band_allowance.passed(0))
        return book.victims(book.needs(pool.engine_full(load), waiting, self._queued_needs(), now), now)

    def _queued_needs(self) -> Iterator[Held]:
        """The head of each tenant's queue in each band above the lowest preemptible one (a victim is of a lower band)."""
        queue = self._queue
        bands = self._settings.bands
        lowest = max((index for index, band in enumerate(bands) if band.preemptible), default=0)
        for index in range(lowest):
            if not queue.band_len(index):
                continue
            for tenant in queue.tenant_lengths(index):
                head = queue.head(index, tenant)
                if head is not None:
                    yield head

    def preempt(self, victim: Held, now: float) -> None:
        """End ``victim`` here at once, and tell its stream to answer 503 preempted.

        Its slot counts as free from now (:meth:`finish` follows): Envoy resets
        the upstream request as it answers, and the engine aborts it within a
        step. Its stream's own end later finds it ended. It is charged what it
        ran (a refund of the rest).
        """
        victim.ended = True
        request = victim.request
        self._report(RequestEvent(Step.PREEMPTED, self._settings.bands[request.band].name, request.tenant,
                                  now - victim.released_at, slack_s=victim.slack_s(now), tag=request.tag))
        if victim.preempted is not None and not victim.preempted.done():
            victim.preempted.set_result(None)

    # --- refusals ----------------------------------------------------------------------------------

    def reject_all(self, refused: Callable[[], Refused]) -> None:
        """Refuse every queued request with ``refused()``."""
        while len(self._queue):
            band, _, held = self._queue.pop()
            self._dequeued(held)
            answer = refused()
            if held.future.done():  # its stream was cancelled a moment ago, as in release()
                self._abandoned(held)
            else:
                self._refused(held, held.request.tenant, band, answer.refusal, self._clock() - held.enqueued_at)
            self._resolve(held, answer)

    def _expire(self, held: Held) -> None:
        """``held``'s wait ran out: refused, unless no engine is up and its cold-start wait has not (then kept)."""
        now = self._clock()
        cold = not self._pool.serves()
        if cold and held.enqueued_at + self._settings.cold_start_wait_s > now:
            self._expiry.keep(held, held.enqueued_at + self._settings.cold_start_wait_s)
            return
        request = held.request
        if not self._queue.remove(request.band, request.tenant, held):
            return
        self._dequeued(held)
        waited = now - held.enqueued_at
        band_name = self._settings.bands[request.band].name
        why = "while no engine of the pool was up" if cold else "without capacity"
        self._refused(held, request.tenant, request.band, Refusal.QUEUE_TIMEOUT, waited)
        self._resolve(held, Refused(
            Refusal.QUEUE_TIMEOUT,
            f"request waited {waited:.1f}s in the {band_name!r} queue for model {self.name!r} {why}; retry later",
            drain_s=self._release_rate.drain_s(self._queue.band_len(request.band), now), queue_wait_s=waited,
        ))

    def _refused(self, held: Held | None, tenant: str, band: int, refusal: Refusal, waited: float,
                 tag: str = "") -> None:
        """Report a refusal: of ``held``, which was queued and has left the queue; None: at the door, never queued."""
        slack = None if held is None else held.slack_s(self._clock())
        self._report(RequestEvent(Step.REFUSED, self._settings.bands[band].name, tenant, waited, refusal, held is not None,
                                  slack_s=slack, tag=tag if held is None else held.request.tag))

    def _abandoned(self, held: Held) -> None:
        """Report a queued request whose client left; it has left the queue."""
        now = self._clock()
        request = held.request
        self._report(RequestEvent(Step.ABANDONED, self._settings.bands[request.band].name, request.tenant,
                                  now - held.enqueued_at, slack_s=held.slack_s(now), tag=request.tag))

    def _resolve(self, held: Held, refused: Refused | None = None) -> None:
        self._expiry.discard(held)
        if held.future.done():
            return
        if refused is None:
            held.future.set_result(self._clock() - held.enqueued_at)
        else:
            held.future.set_exception(refused)

    # --- the pool's events that reach the pricing, and what is read on request -----------------------

    def scraped(self, endpoint: str, load: EngineLoad, started_at: float) -> None:
        """A usable scrape of ``endpoint``: the pricing learns its decode rate and cache hits."""
        self._pricing.scraped(endpoint, load, started_at)

    def engine_said(self, max_model_len: int | None) -> None:
        """An engine said its limits (the pool has them): the pricing's clamp where none is configured, and whether
        the engines order their queues by priority."""
        self._pricing.engine_context(max_model_len)
        self._follow_engine_priority()

    def left(self, endpoints: set[str]) -> None:
        """Endpoints that left the pool: the pricing forgets their caches, and what they said of their queues."""
        self._pricing.forget(endpoints)
        self._follow_engine_priority()

    def queued_in(self, band: int) -> int:
        return self._queue.band_len(band)

    def queued_by_tenant(self) -> dict[tuple[str, str], int]:
        return {(band.name, tenant): count for index, band in enumerate(self._settings.bands)
                for tenant, count in self._queue.tenant_lengths(index).items()}

    def demand(self) -> Demand:
        """What the held and in-flight requests ask of the engines now (``demand.py``)."""
        now = self._clock()
        return self._demand.read(self._pool, tuple(self._queue.band_sizes), tuple(self._in_flight),
                                 self._release_rate.per_second(now), self._settings.bands, self._settings.max_queue_wait_s, now)

    def status(self, top: int, cluster: ClusterStatus | None) -> ModelStatus:
        now = self._clock()
        pool = self._pool
        return ModelStatus(
            name=self.name, rule=pool.rule_type.name, uses_metrics=pool.uses_metrics,
            rule_rate=pool.settings.release_rate,
            queued=len(self._queue),
            in_flight=pool.in_flight,
            release_rate=self._release_rate.per_second(now),
            bands=tuple(band_status(b.name, self._queue.tenant_lengths(i), top) for i, b in enumerate(self._settings.bands)),
            endpoints=pool.endpoint_statuses(now),
            cluster=cluster,
        )
