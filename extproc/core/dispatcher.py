"""Per-model glue between held requests, the fair queue and the gate.

Each held request is an ``asyncio.Future`` that the ext_proc stream awaits.
Dispatch — pop from the fair queue while the gate allows — runs only when
something changed: a request arrived, a response finished, or a scrape
reported. There is no polling loop; an idle model costs nothing.

Every request that enters ends exactly one way: released (future result),
refused (future exception :class:`~extproc.core.outcomes.Refused`), or
abandoned (its client left: the stream's task was cancelled and the entry is
removed at once). A request over a queue cap is refused before it enters
(``submit`` raises). Outcomes are named here; what the client hears is the
ext_proc adapter's choice.

The dispatcher takes plain values (:class:`BandRules`, :class:`TenantLimits`,
a :class:`~extproc.core.policies.base.Policy`, a built :class:`Gate`), which
``wiring.py`` makes from the config, and reports through
:class:`~extproc.core.report.DispatchReport`.

Strict priority: only the highest band holding requests may release, each
band within its own allowance (the first band the whole target, the others
less ``reserved_waiting``, an idle-only band only into an idle engine; see
gate.py). With ``policy: vtc`` each release is charged its estimated cost
and corrected when its stream ends (cost.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from extproc.core.bands import BandRules
from extproc.core.cost import CostModel, CostWeights, DecodeRate, Estimate
from extproc.core.drain_time import ReleaseRate
from extproc.core.engine_load import EngineLoad
from extproc.core.fair_queue import FairQueue
from extproc.core.gate import Gate, GateMode
from extproc.core.outcomes import Refusal, Refused
from extproc.core.policies import Policy
from extproc.core.report import DispatchReport

log = logging.getLogger(__name__)


def shutting_down() -> Refused:
    """The refusal while the processor drains (a new exception each time: one is raised per request)."""
    return Refused(Refusal.SHUTTING_DOWN, "the gateway is restarting; retry shortly")


@dataclass(frozen=True)
class TenantLimits:
    """What the core needs to know of a tenant."""

    weight: float
    # Requests of this tenant a model may hold; one more is refused.
    max_queued: int


@dataclass(eq=False)
class Held:
    """One request in the queue; identity-hashed so equal-looking requests stay distinct."""

    tenant: str
    band: int
    enqueued_at: float
    future: asyncio.Future[float] = field(repr=False)
    # What the release is charged (vtc), corrected when its stream ends.
    estimate: Estimate = field(repr=False)
    expiry: asyncio.TimerHandle | None = field(default=None, repr=False)
    released: bool = False
    ended: bool = False
    # Prefix-cache affinity key (endpoint picking) and the endpoint picked on release.
    affinity: str = ""
    endpoint: str | None = None


class ModelDispatcher:
    def __init__(
        self,
        name: str,
        gate: Gate,
        bands: tuple[BandRules, ...],
        report: DispatchReport,
        clock: Callable[[], float] = time.monotonic,
        *,
        policy: Policy,
        tenant: Callable[[str], TenantLimits],
        cost: CostWeights,
        max_queued: int,
        reserved_waiting: int,
    ) -> None:
        self.name = name
        self.gate = gate
        self._bands = bands
        self._tenant = tenant
        self._report = report
        self._clock = clock
        self._max_queued = max_queued
        self._reserved_waiting = reserved_waiting
        self._queue: FairQueue[Held] = FairQueue(len(bands), lambda: policy.new_band(lambda t: self._tenant(t).weight))
        self._cost = CostModel(cost)
        self._decode_rate = DecodeRate()
        self._release_rate = ReleaseRate()
        self._mode: GateMode | None = None
        self._degraded: set[str] = set()
        # static_rate: a wake-up when the next release becomes due (no other event will come).
        self._wakeup: asyncio.TimerHandle | None = None

    @property
    def queued(self) -> int:
        return len(self._queue)

    def submit(
        self,
        tenant: str,
        band: int,
        *,
        content_length: int | None = None,
        max_tokens: float | None = None,
        affinity: str = "",
    ) -> Held:
        """Queue a request and dispatch; the returned future may already be resolved.

        ``affinity`` groups requests that share a prompt prefix (endpoint picking
        keeps them on one engine); empty means the tenant. Raises
        :class:`~extproc.core.outcomes.Refused` when a queue cap leaves no room.
        """
        now = self._clock()
        self._check_caps(tenant, band, now)
        loop = asyncio.get_running_loop()
        estimate = self._cost.estimate(tenant, content_length, max_tokens)
        held = Held(tenant, band, now, loop.create_future(), estimate, affinity=affinity or tenant)
        self._queue.push(band, tenant, held)
        held.expiry = loop.call_later(self._bands[band].max_queue_wait_s, self._expire, held)
        self.dispatch()
        self._update_depth(band)
        return held

    def _check_caps(self, tenant: str, band: int, now: float) -> None:
        """Tenant first: when its own backlog is the cause, it should hear so."""
        name = self.name
        own = self._queue.tenant_len(tenant)
        if own >= self._tenant(tenant).max_queued:
            raise self._overflow(Refusal.TENANT_QUEUE_FULL, own, now,
                                 f"tenant {tenant!r} already has {own} requests queued for model {name!r}")
        in_band = self._queue.band_len(band)
        cap = self._bands[band].max_queued
        if cap is not None and in_band >= cap:
            raise self._overflow(Refusal.BAND_QUEUE_FULL, in_band, now,
                                 f"the {self._bands[band].name!r} queue for model {name!r} is full ({cap})")
        queued = len(self._queue)
        if queued >= self._max_queued:
            raise self._overflow(Refusal.MODEL_QUEUE_FULL, queued, now,
                                 f"the queue for model {name!r} is full ({self._max_queued})")

    def _overflow(self, refusal: Refusal, backlog: int, now: float, message: str) -> Refused:
        self._report.refused(refusal)
        return Refused(refusal, message + "; retry later", drain_s=self._release_rate.drain_s(backlog, now))

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
            occupancy = self.gate.record_finish(held, self._clock())
            measured = self._cost.measure(held.tenant, held.estimate, occupancy, self._decode_rate.rate)
            self._queue.correct(held.band, held.tenant, measured - held.estimate.cost)
            self._report.in_flight(self.gate.in_flight)
            self.dispatch()
        elif self._queue.remove(held.band, held.tenant, held):
            self._resolve(held)
            self._report.abandoned(self._bands[held.band].name)
            self._update_depth(held.band)

    def record_scrape(self, endpoint: str, load: EngineLoad | None, started_at: float) -> None:
        self.gate.record_scrape(endpoint, load, started_at)
        if load is None:
            self._report.scrape_failed(endpoint)
        else:
            self._decode_rate.record(endpoint, load.generation_tokens, load.running, started_at)
            self._report.scraped(endpoint, load, self.gate.itl(endpoint), self.gate.limit(endpoint))
        self.dispatch()

    def set_endpoints(self, endpoints: tuple[str, ...]) -> None:
        """The pool's membership changed (DNS); forget the telemetry of endpoints that left."""
        for gone in set(self.gate.endpoints) - set(endpoints):
            self._report.endpoint_left(gone)
        self.gate.set_endpoints(endpoints)

    def reject_all(self) -> None:
        """Refuse every queued request with ``shutting_down`` (draining ran out of time)."""
        while len(self._queue):
            band, _, held = self._queue.pop()
            self._resolve(held, shutting_down())
            self._update_depth(band)

    def dispatch(self) -> None:
        now = self._clock()
        self._note_mode(now)
        allowance, allowance_band = 0, None
        while (first := self._queue.first_band()) is not None:
            if first != allowance_band:  # a higher band ran empty: ask again for this one
                allowance, allowance_band = self._allowance(first, now), first
            if allowance <= 0:
                break
            band, tenant, held = self._queue.pop()
            self._update_depth(band)
            if held.future.done():  # its stream was cancelled a moment ago; end() will not find it
                self._resolve(held)
                self._report.abandoned(self._bands[band].name)
                continue
            held.released = True
            if self.gate.pick_endpoints:
                held.endpoint = self.gate.pick(held.affinity, now)
            self.gate.record_release(held, now, held.endpoint, into_free_slot=self._bands[band].idle_only)
            self._release_rate.record(now)
            self._queue.charge(band, tenant, held.estimate.cost)
            self._resolve(held)
            priority = self._bands[band].name
            self._report.released(priority)
            self._report.held(priority, now - held.enqueued_at)
            allowance -= 1
        self._report.in_flight(self.gate.in_flight)
        self._schedule_wakeup(now)

    def _schedule_wakeup(self, now: float) -> None:
        due = self.gate.next_change_in(now)
        if due is None or not len(self._queue) or self._wakeup is not None:
            return

        def wake() -> None:
            self._wakeup = None
            self.dispatch()

        self._wakeup = asyncio.get_running_loop().call_later(due, wake)

    def _allowance(self, band: int, now: float) -> int:
        settings = self._bands[band]
        if settings.idle_only:
            return self.gate.idle_allowance(now, settings.idle_running_share, self._reserved_waiting)
        return self.gate.allowance(now, 0 if band == 0 else self._reserved_waiting)

    def _expire(self, held: Held) -> None:
        if self._queue.remove(held.band, held.tenant, held):
            now = self._clock()
            waited = now - held.enqueued_at
            priority = self._bands[held.band].name
            self._report.refused(Refusal.QUEUE_TIMEOUT)
            self._report.held(priority, waited)
            self._resolve(held, Refused(
                Refusal.QUEUE_TIMEOUT,
                f"request waited {waited:.1f}s in the {priority!r} queue for model {self.name!r} without capacity; "
                "retry later",
                drain_s=self._release_rate.drain_s(self._queue.band_len(held.band), now), queue_wait_s=waited,
            ))
            self._update_depth(held.band)

    def _resolve(self, held: Held, refused: Refused | None = None) -> None:
        if held.expiry is not None:
            held.expiry.cancel()
        if held.future.done():
            return
        if refused is None:
            held.future.set_result(self._clock() - held.enqueued_at)
        else:
            held.future.set_exception(refused)

    def _update_depth(self, band: int) -> None:
        self._report.queue_depth(self._bands[band].name, self._queue.band_len(band))

    def _note_mode(self, now: float) -> None:
        degraded = set(self.gate.degraded(now))
        for endpoint in degraded - self._degraded:
            self._report.endpoint_degraded(endpoint, True)
            if self.gate.last_good(endpoint) is None:
                continue  # not scraped yet (start-up, a new DNS member): the scraper reports failures
            log.warning("model %s: metrics of %s unusable (failing or stale), capping it at %d in flight",
                        self.name, endpoint, self.gate.fallback_limit(endpoint))
        for endpoint in self._degraded - degraded:
            self._report.endpoint_degraded(endpoint, False)
            log.info("model %s: metrics of %s usable again", self.name, endpoint)
        self._degraded = degraded
        mode = self.gate.mode(now)
        if mode is not self._mode:
            fallback = mode is GateMode.FALLBACK
            self._report.fallback(fallback)
            if fallback and self._mode is not None:
                log.warning("model %s: gating on the fallback in-flight limits", self.name)
            elif self._mode is not None:
                log.info("model %s: engine metrics usable again, gating on the engine queue", self.name)
            self._mode = mode
