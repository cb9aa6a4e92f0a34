"""How a held request leaves one model's queue: the one release step every release strategy shares.

A strategy (``strategy.py``) decides what may go now and to whom; whichever
it is, a request it lets go leaves the same way: an endpoint picked, the pool
and the fair queue charged, its future resolved and the release reported.
The outlet also carries what a strategy reads to decide (the queue, the pool,
the bands' admission), so a strategy needs the outlet, never the dispatcher.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from extproc.core.bands import Band, BandAdmission
from extproc.core.cost import Estimate
from extproc.core.drain_time import ReleaseRate
from extproc.core.fair_queue import FairQueue
from extproc.core.outcomes import Refusal, Refused
from extproc.core.preemption import Preemption
from extproc.core.prefix import NO_PREFIX, Prefix
from extproc.core.release.estimate import LoadNow
from extproc.core.release.health_log import HealthLog
from extproc.core.release.pool import Pool
from extproc.core.report import DispatchReport, RequestEvent, Step
from extproc.core.timers import Timer


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
    # Its prompt's prefix signature (NO_PREFIX: the model computes none).
    prefix: Prefix = field(default=NO_PREFIX, repr=False)
    endpoint: str | None = None
    # After the pick, the other endpoints in order of preference (the gateway's fallbacks).
    fallbacks: tuple[str, ...] = ()
    # The endpoints it may go to (a gateway's subset hint); None: any of the pool.
    eligible: frozenset[str] | None = None
    # Its time-to-first-token objective (the band's, tightened by the client's as
    # far as the band trusts it: Band.objective_s); None: none.
    ttft_objective_s: float | None = None
    # When it should be released by, for ordering (deadline policy): enqueued_at +
    # the objective, or + the band's longest queue wait where it has none.
    deadline: float = math.inf
    released_at: float = math.nan
    # Its response has begun (its headers came): it can no longer be preempted.
    started: bool = False
    # The client says it is a retry (x-stainless-retry-count): never preempted.
    retried: bool = False
    # When a preemptible request was last ended to make room for it (preemption.py).
    room_made_at: float = -math.inf
    # Resolved when it is preempted after its release: its stream answers 503 preempted.
    preempted: asyncio.Future[None] | None = field(default=None, repr=False)
    # Whether its response's headers are read for a failed release (a sample: they cost a message).
    checked: bool = False
    # The prompt tokens it would find cached if released now (the dispatcher's account); None: no signatures.
    expected_hit: Callable[[Held], float] | None = field(default=None, repr=False)

    def cached_tokens(self) -> float:
        """What the ``locality`` policy orders by (``policies.base.Cached``)."""
        return self.expected_hit(self) if self.expected_hit is not None else 0.0

    @property
    def objective_due(self) -> float | None:
        """When its TTFT objective runs out (``deadline`` without the queue-wait fallback); None: no objective."""
        return None if self.ttft_objective_s is None else self.enqueued_at + self.ttft_objective_s

    def slack_s(self, now: float) -> float | None:
        """Its objective's slack at ``now``: how long before its TTFT deadline (negative: past it); None: no objective."""
        due = self.objective_due
        return None if due is None else due - now


class Outlet:
    """One model's queue, pool and band admission, and the ways a request leaves the queue."""

    def __init__(
        self, name: str, queue: FairQueue[Held], pool: Pool, bands: tuple[Band, ...], admission: BandAdmission,
        report: DispatchReport, clock: Callable[[], float], service: Callable[[str, float], float],
        preemption: Preemption, priced: Callable[[Held], None] | None = None,
        hit: Callable[[Held], Callable[[str], float] | None] | None = None,
    ) -> None:
        self.queue = queue
        # Prices a release at its endpoint (the cost of its cached prompt tokens), before it is charged.
        self._priced = priced
        # Where a release's prefix is likely cached (per endpoint), for picking; None: not known.
        self._hit = hit
        self.pool = pool
        self.bands = bands
        self.admission = admission
        self.report = report
        self.clock = clock
        # What a release of the tenant adds to its counter (the policy's service for a cost).
        self.service = service
        self.release_rate = ReleaseRate()
        self.preemption = preemption
        # Released requests of non-preemptible bands with an objective that went into an
        # engine without a free slot: they may be waiting in it (preemption's needs).
        self.waiting_above: dict[Held, None] = {}
        self._health_log = HealthLog(name, pool, report)

    def note_health(self, now: float) -> None:
        """Report endpoint health that changed since the last look (once per change)."""
        self._health_log.note(now)

    def cap(self, band: int, now: float) -> int:
        """The most requests the pool may have in flight, counting other instances', once ``band`` released."""
        return self.admission.headroom(band, now) + self.pool.estimate.cluster_in_flight

    def release(self, band: int, tenant: str, held: Held, now: float, *, free: bool) -> bool:
        """``held`` left the queue to be released: release it, unless its client already left (False).

        ``free``: the engine has a slot free for it by the load estimate (the
        strategy counts them down from ``Pool.free_slots``, read once a round).
        """
        if held.future.done():  # its stream was cancelled a moment ago; end() will not find it
            self.resolve(held)
            self.abandoned(held, band)
            return False
        held.released, held.released_at = True, now
        hit = self._hit(held) if self._hit is not None else None
        ranked = self.pool.ranked(held.affinity, now, held.eligible, hit)
        held.endpoint, held.fallbacks = (ranked[0], tuple(ranked[1:])) if ranked else (None, ())
        if self._priced is not None:
            self._priced(held)
        held.checked = self.pool.check_release(held.endpoint, now)
        self._note_for_preemption(held, band, now)
        # Counted as running until a scrape shows it: a release into a free slot, and an idle-only band's
        # (sized to free slots, or its probe past the capacity learned so far: one per scrape).
        into_free_slot = free or (self.bands[band].idle_only and self.admission.into_free_slots(band, now))
        self.pool.record_release(held, now, held.endpoint, into_free_slot=into_free_slot)
        self.release_rate.record(now)
        self.queue.charge(band, tenant, held.estimate.cost)
        self.resolve(held)
        self.report(RequestEvent(Step.RELEASED, self.bands[band].name, tenant, now - held.enqueued_at,
                                 slack_s=held.slack_s(now)))
        return True

    def _note_for_preemption(self, held: Held, band: int, now: float) -> None:
        """What preemption must know of a release: a victim to be, or a higher request that may wait in the engine."""
        preemption = self.preemption
        if not preemption.enabled:
            return
        if self.bands[band].preemptible:
            if not held.retried:  # a retry is never preempted: its stream need not watch for it
                held.preempted = asyncio.get_running_loop().create_future()
                preemption.released(held, now)
        elif held.ttft_objective_s is not None and preemption.candidates and self.engine_full(self.pool.estimate.now()):
            self.waiting_above[held] = None

    def engine_full(self, estimate: LoadNow) -> bool:
        """Whether the engine has no free slot, by ``estimate``: it queues, or holds its capacity (when that is known)."""
        if estimate.waiting > 0:
            return True
        capacity = self.pool.capacity()
        return capacity > 0 and estimate.held >= capacity

    def refused(self, held: Held | None, tenant: str, band: int, refusal: Refusal, waited: float) -> None:
        """Report a refusal: of ``held``, which was queued and has left the queue; None: at the door, never queued."""
        slack = None if held is None else held.slack_s(self.clock())
        self.report(RequestEvent(Step.REFUSED, self.bands[band].name, tenant, waited, refusal, held is not None,
                                 slack_s=slack))

    def abandoned(self, held: Held, band: int) -> None:
        """Report a queued request whose client left; it has left the queue."""
        now = self.clock()
        self.report(RequestEvent(Step.ABANDONED, self.bands[band].name, held.tenant, now - held.enqueued_at,
                                 slack_s=held.slack_s(now)))

    def resolve(self, held: Held, refused: Refused | None = None) -> None:
        if held.expiry is not None:
            held.expiry.cancel()
        if held.future.done():
            return
        if refused is None:
            held.future.set_result(self.clock() - held.enqueued_at)
        else:
            held.future.set_exception(refused)
