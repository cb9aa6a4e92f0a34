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
* when to retry after a refusal: ``drain_time.py``;
* in a cluster of instances, which of them releases what: ``cluster.py`` (the
  dispatcher asks, the cluster grants; on its own while the cluster is unreachable).

It takes plain values (built by ``adapters/wiring.py`` from the config),
reports through :class:`~extproc.core.report.DispatchReport`, and leaves its
deadlines (a queued request's longest wait, a rate's next release) to the
injected :class:`~extproc.core.timers.Timers`: the core keeps no event loop.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from extproc.core.bands import BandAdmission, BandRules
from extproc.core.caps import QueueCaps, TenantLimits
from extproc.core.cluster import Ask, ClusterSeat, Grant, backlog
from extproc.core.cost import CostModel, CostWeights, DecodeRate, Estimate
from extproc.core.drain_time import ReleaseRate
from extproc.core.engine_load import EngineLoad
from extproc.core.fair_queue import FairQueue
from extproc.core.outcomes import Refusal, Refused
from extproc.core.policies import Policy
from extproc.core.release.health_log import HealthLog
from extproc.core.release.pool import Pool
from extproc.core.report import DispatchReport
from extproc.core.status import ClusterStatus, EndpointStatus, ModelStatus, band_status
from extproc.core.timers import Timer, Timers


def shutting_down() -> Refused:
    """The refusal while the processor drains (a new exception each time: one is raised per request)."""
    return Refused(Refusal.SHUTTING_DOWN, "the gateway is restarting; retry shortly")


@dataclass(eq=False)
class Held:
    """One request in the queue; identity-hashed so equal-looking requests stay distinct."""

    tenant: str
    band: int
    enqueued_at: float
    future: asyncio.Future[float] = field(repr=False)
    # What the release is charged (vtc), corrected when its stream ends.
    estimate: Estimate = field(repr=False)
    expiry: Timer | None = field(default=None, repr=False)
    released: bool = False
    ended: bool = False
    # Prefix-cache affinity key (endpoint picking) and the endpoint picked on release.
    affinity: str = ""
    endpoint: str | None = None
    # After the pick, the other endpoints in order of preference (the gateway's fallbacks).
    fallbacks: tuple[str, ...] = ()
    # The endpoints it may go to (a gateway's subset hint); None: any of the pool.
    eligible: frozenset[str] | None = None
    # The client's time-to-first-token objective, when it named one.
    ttft_objective_s: float | None = None
    # Whether its response's headers are read for a failed release (a sample: they cost a message).
    checked: bool = False


class ModelDispatcher:
    def __init__(
        self,
        name: str,
        pool: Pool,
        bands: tuple[BandRules, ...],
        report: DispatchReport,
        clock: Callable[[], float] = time.monotonic,
        *,
        policy: Policy,
        timers: Timers,
        tenant: Callable[[str], TenantLimits],
        cost: CostWeights,
        max_queued: int,
        reserved_waiting: int,
    ) -> None:
        self.name = name
        self.pool = pool
        self._bands = bands
        self._report = report
        self._clock = clock
        self._timers = timers
        self._admission = BandAdmission(bands, pool, reserved_waiting)
        self._caps = QueueCaps(name, bands, tenant, max_queued)
        self._health_log = HealthLog(name, pool, report)
        self._queue: FairQueue[Held] = FairQueue(len(bands), lambda: policy.new_band(lambda t: tenant(t).weight))
        self._service: Callable[[str, float], float] = lambda name, cost: policy.service(cost, tenant(name).weight)
        # Set when the model is scheduled by a cluster of instances (join()).
        self._seat: ClusterSeat | None = None
        self._cost = CostModel(cost)
        self._decode_rate = DecodeRate()
        self._release_rate = ReleaseRate()
        # A wake-up when the next release falls due by time alone (a rate; no other event will come).
        self._wakeup: Timer | None = None

    @property
    def queued(self) -> int:
        return len(self._queue)

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
            ))
        return ModelStatus(
            name=self.name,
            rule=pool.rule.name,
            uses_metrics=pool.rule.uses_metrics,
            rule_rate=pool.settings.release_rate,
            queued=len(self._queue),
            in_flight=pool.in_flight,
            release_rate=self._release_rate.per_second(now),
            bands=tuple(band_status(b.name, self._queue.tenant_lengths(i), top) for i, b in enumerate(self._bands)),
            endpoints=tuple(endpoints),
            cluster=None if self._seat is None else ClusterStatus(self._seat.instances, self._seat.degraded),
        )

    def submit(
        self,
        tenant: str,
        band: int,
        *,
        content_length: int | None = None,
        max_tokens: float | None = None,
        affinity: str = "",
        eligible: frozenset[str] | None = None,
        ttft_objective_s: float | None = None,
    ) -> Held:
        """Queue a request and dispatch; the returned future may already be resolved.

        ``affinity`` groups requests that share a prompt prefix (endpoint picking
        keeps them on one engine); empty means the tenant. ``eligible`` limits
        where it may go (endpoint picking). Raises
        :class:`~extproc.core.outcomes.Refused` when a queue cap leaves no room.
        """
        now = self._clock()
        overflow = self._caps.check(self._queue, tenant, band)
        if overflow is not None:
            self._refused(tenant, self._bands[band].name, overflow.refusal, 0.0)
            self._report.decision(self._clock() - now)
            raise Refused(overflow.refusal, overflow.message + "; retry later",
                          drain_s=self._release_rate.drain_s(overflow.backlog, now))
        loop = asyncio.get_running_loop()
        estimate = self._cost.estimate(tenant, content_length, max_tokens)
        if estimate.clamped:
            self._report.cost_clamped()
        held = Held(tenant, band, now, loop.create_future(), estimate, affinity=affinity or tenant,
                    eligible=eligible, ttft_objective_s=ttft_objective_s)
        new_head = self._queue.head(band, tenant) is None
        self._queue.push(band, tenant, held)
        self._report.queued(self._bands[band].name, tenant, 1)
        held.expiry = self._timers.at(now + self._bands[band].max_queue_wait_s, lambda: self._expire(held))
        if self._seat is not None and new_head:
            self._seat.arrived(band, tenant)
        if (seat := self._deciding_seat()) is not None:
            # The cluster must hear at once of a tenant new here (the fairest may be it) or of
            # room to release; one more request of a tenant already queued can be gathered with others.
            seat.link.wanted(new_head or self._admission.allowance(band, now) > 0)
        else:
            self.dispatch()
        self._report.decision(self._clock() - now)
        return held

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
            occupancy = self.pool.record_finish(held, self._clock())
            measured = self._cost.measure(held.tenant, held.estimate, occupancy, self._decode_rate.rate)
            self._queue.correct(held.band, held.tenant, measured.cost - held.estimate.cost)
            if self._seat is not None:
                self._seat.correct(held.band, held.tenant,
                                   self._service(held.tenant, measured.cost) - self._service(held.tenant, held.estimate.cost))
            self._report.charged(held.tenant, held.estimate.prompt_tokens, measured.output_tokens, measured.cost)
            self._report.in_flight(self.pool.in_flight)
            self.dispatch()
        elif self._queue.remove(held.band, held.tenant, held):
            self._resolve(held)
            self._abandoned(held, held.band)
            self._dequeued(held.band, held.tenant)

    def record_response(self, held: Held, ok: bool) -> None:
        """A released request's response began: from the engine (``ok``), or a release failure.

        A failure (the engine unreachable, reset before answering, or its own
        503) marks its endpoint down before the stream ends, so the slot it
        frees is not handed to the next held request: they wait for the
        engine, or go to an endpoint that is up.
        """
        if not held.released or held.ended:
            return
        down = self.pool.down()
        endpoint = self.pool.record_response(held.endpoint, ok, self._clock())
        if not ok:
            self._report.release_failed(endpoint)
        if self.pool.down() != down:
            self.dispatch()  # reports the change; an endpoint back up takes held requests at once

    def record_served(self, held: Held, endpoint: str) -> None:
        """The gateway reports where ``held`` was served; another endpoint than the pick means the pick failed it."""
        if not held.released or held.ended or held.endpoint is None or endpoint == held.endpoint:
            return
        if endpoint not in self.pool.endpoints:
            return  # not a member (yet): nothing to count it against
        down = self.pool.down()
        self.pool.record_served(held, held.endpoint, endpoint, self._clock())
        self._report.release_failed(held.endpoint)
        held.endpoint = endpoint
        if self.pool.down() != down:
            self.dispatch()

    def serves(self, eligible: frozenset[str] | None = None) -> bool:
        """Whether an endpoint (of ``eligible``, when given) is there and not down to take a request."""
        return self.pool.serves(eligible)

    def record_scrape(self, endpoint: str, load: EngineLoad | None, started_at: float, *, reachable: bool = True) -> None:
        """A scrape's outcome (``load`` None: failed; ``reachable=False``: its connection was refused)."""
        self.pool.record_scrape(endpoint, load, started_at, reachable=reachable)
        if load is None:
            self._report.scrape_failed(endpoint)
        else:
            self._decode_rate.record(endpoint, load.generation_tokens, load.running, started_at)
            snapshot = self.pool.rule.snapshot(endpoint)
            self._report.scraped(endpoint, load, snapshot.itl_s, snapshot.limit)
        if (seat := self._deciding_seat()) is not None:
            # A scrape matters to the cluster only if it lets this instance release: else the next
            # round trip (an end, an arrival, the heartbeat) takes its numbers along anyway.
            now = self._clock()
            self._health_log.note(now)
            first = self._queue.first_band()
            if first is not None and self._admission.allowance(first, now) > 0:
                seat.link.wanted(True)
        else:
            self.dispatch()

    def set_endpoints(self, endpoints: tuple[str, ...]) -> None:
        """The pool's membership changed (DNS); forget the telemetry of endpoints that left."""
        for gone in set(self.pool.endpoints) - set(endpoints):
            self._report.endpoint_left(gone)
        self.pool.set_endpoints(endpoints)

    def reject_all(self) -> None:
        """Refuse every queued request with ``shutting_down`` (draining ran out of time)."""
        while len(self._queue):
            band, _, held = self._queue.pop()
            if held.future.done():  # its stream was cancelled a moment ago, as in dispatch()
                self._abandoned(held, band)
            else:
                self._refused(held.tenant, self._bands[band].name, Refusal.SHUTTING_DOWN,
                              self._clock() - held.enqueued_at)
            self._resolve(held, shutting_down())
            self._dequeued(band, held.tenant)

    def dispatch(self) -> None:
        now = self._clock()
        self._health_log.note(now)
        if (seat := self._deciding_seat()) is not None:
            seat.link.wanted(True)  # the cluster decides: cluster_granted() releases
            return
        allowance, allowance_band = 0, None
        while (first := self._queue.first_band()) is not None:
            if first != allowance_band:  # a higher band ran empty: ask again for this one
                allowance, allowance_band = self._allowance(first, now), first
            if allowance <= 0:
                break
            band, tenant, held = self._queue.pop()
            if self._dequeued_for_release(band, tenant, held, now):
                allowance -= 1
        self._report.in_flight(self.pool.in_flight)
        self._schedule_wakeup(now)

    def _deciding_seat(self) -> ClusterSeat | None:
        """The seat when a cluster that answers decides (its grants release, not this instance's own loop)."""
        return self._seat if self._seat is not None and not self._seat.degraded else None

    def _allowance(self, band: int, now: float) -> int:
        """What ``band`` may release now on this instance's own say (alone, or a cluster seat cut off)."""
        allowance = self._admission.allowance(band, now)
        if self._seat is None:
            return allowance
        return min(allowance, self._seat.share(self._cap(band, now), self.pool.in_flight))

    def _cap(self, band: int, now: float) -> int:
        """The most requests the whole cluster may have in flight once ``band`` released."""
        return self._admission.headroom(band, now) + self.pool.estimate.cluster_in_flight

    # --- a cluster seat (core/cluster.py); the adapter calls these around each round trip -----------

    def join(self, seat: ClusterSeat) -> None:
        """From now on the cluster decides releases (degraded until the first grant)."""
        self._seat = seat

    def cluster_ask(self) -> Ask:
        """What to tell the cluster now: our count in flight, each band's cap, the backlog."""
        assert self._seat is not None
        now = self._clock()
        caps = tuple(self._cap(band, now) for band in range(len(self._bands)))

        def head_service(band: int, tenant: str) -> float:
            head = self._queue.head(band, tenant)
            return 0.0 if head is None else self._service(tenant, head.estimate.cost)

        return self._seat.ask(self.pool.in_flight, caps, backlog(self._queue.tenant_lengths, len(self._bands), head_service))

    def cluster_granted(self, grant: Grant) -> None:
        """The cluster's answer: release the head of each named tenant's FIFO here."""
        assert self._seat is not None
        now = self._clock()
        self._seat.joined(grant)
        self.pool.estimate.record_others(now, grant.others_in_flight)
        for band, tenant in grant.releases:
            held = self._queue.take(band, tenant)
            if held is not None:  # else its client left since the ask: the slot returns with the next ask's count
                self._dequeued_for_release(band, tenant, held, now)
        self._report.in_flight(self.pool.in_flight)

    def cluster_lost(self, ask: Ask) -> None:
        """The cluster could not be asked: release on this instance's share until it answers again."""
        assert self._seat is not None
        self._seat.lost(ask)
        self._seat.degraded = True
        self.dispatch()

    def _dequeued_for_release(self, band: int, tenant: str, held: Held, now: float) -> bool:
        """``held`` left the queue to be released: release it, unless its client already left (False)."""
        self._dequeued(band, tenant)
        if held.future.done():  # its stream was cancelled a moment ago; end() will not find it
            self._resolve(held)
            self._abandoned(held, band)
            return False
        self._release(band, tenant, held, now)
        return True

    def _release(self, band: int, tenant: str, held: Held, now: float) -> None:
        held.released = True
        ranked = self.pool.ranked(held.affinity, now, held.eligible)
        held.endpoint, held.fallbacks = (ranked[0], tuple(ranked[1:])) if ranked else (None, ())
        held.checked = self.pool.check_release(held.endpoint, now)
        self.pool.record_release(held, now, held.endpoint, into_free_slot=self._bands[band].idle_only)
        self._release_rate.record(now)
        self._queue.charge(band, tenant, held.estimate.cost)
        self._resolve(held)
        priority = self._bands[band].name
        self._report.released(priority, tenant)
        self._report.held(priority, tenant, now - held.enqueued_at)
        self._report.decided(tenant, priority, now - held.enqueued_at, "released")

    def _refused(self, tenant: str, priority: str, refusal: Refusal, waited: float) -> None:
        self._report.refused(refusal, tenant)
        self._report.decided(tenant, priority, waited, f"refused:{refusal.value}")

    def _abandoned(self, held: Held, band: int) -> None:
        priority = self._bands[band].name
        self._report.abandoned(priority, held.tenant)
        self._report.decided(held.tenant, priority, self._clock() - held.enqueued_at, "abandoned")

    def _schedule_wakeup(self, now: float) -> None:
        due = self.pool.rule.next_change_in(now)
        if due is None or not len(self._queue) or self._wakeup is not None:
            return

        def wake() -> None:
            self._wakeup = None
            self.dispatch()

        self._wakeup = self._timers.at(now + due, wake)

    def _expire(self, held: Held) -> None:
        now = self._clock()
        waited = now - held.enqueued_at
        if self._queue.remove(held.band, held.tenant, held):
            priority = self._bands[held.band].name
            self._refused(held.tenant, priority, Refusal.QUEUE_TIMEOUT, waited)
            self._report.held(priority, held.tenant, waited)
            self._resolve(held, Refused(
                Refusal.QUEUE_TIMEOUT,
                f"request waited {waited:.1f}s in the {priority!r} queue for model {self.name!r} without capacity; "
                "retry later",
                drain_s=self._release_rate.drain_s(self._queue.band_len(held.band), now), queue_wait_s=waited,
            ))
            self._dequeued(held.band, held.tenant)

    def _resolve(self, held: Held, refused: Refused | None = None) -> None:
        if held.expiry is not None:
            held.expiry.cancel()
        if held.future.done():
            return
        if refused is None:
            held.future.set_result(self._clock() - held.enqueued_at)
        else:
            held.future.set_exception(refused)

    def _dequeued(self, band: int, tenant: str) -> None:
        """A request left the queue: each removal reports once, so the reported depth counts up and down exactly."""
        self._report.queued(self._bands[band].name, tenant, -1)
