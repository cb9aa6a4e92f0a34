"""Active-active: one model's dispatcher as one seat of a cluster of processor instances.

Several ``extproc serve`` instances behind one Envoy (it spreads the ext_proc
streams over them) must behave as one: together they keep the engine's queue
at target, and they share fairness as if one queue held every request. Each
request stays held in the instance whose stream holds it; what the instances
share lives in Redis (``adapters/cluster/``), and a Redis script decides every
release atomically. This module is the core's side of that: the dispatcher's
release strategy as a seat of the cluster (:class:`ClusterSeat`, behind
``strategy.py``'s seam), what it tells the cluster (an :class:`Ask`), what it
is told back (a :class:`Grant`), and what it does on its own while the
cluster cannot be reached. These dataclasses are also the script's schema:
the adapter sends and reads them as JSON by their field names.

**Capacity.** The release rule still computes its headroom on this instance,
from its own scrapes, but the load estimate counts the other instances'
requests in flight as ours (``release/estimate.py``, ``record_others``). So
``headroom + ours + others`` is the most the *cluster* may have in flight
after the release: the ask's per-band ``caps``. The script sums what every
live instance has in flight now (each instance publishes its exact count with
every ask, under a lease) and grants only what fits under the cap. Counts are
absolute, never increments: a lost reply or a repeated ask cannot count a
request twice, and a dead instance's count lapses with its lease.

**Priority.** Strict between bands, but for each lower band's minimum share
of the releases (``bands.py``, ``BandShares``): the ask carries each band's
share as this instance computes it, and the script keeps each band's credit
cluster-wide.

**Fairness.** Each ask also carries this instance's backlog: every tenant
with requests queued here, per band, with the service its next request would
add to the tenant's counter (``Policy.service``: 1 for round-robin, weighted
cost for ``vtc``). That is the policies' cluster form, ``ClusterForm.COUNTER``
(``policies/base.py``); a policy without one is refused with a cluster. The script keeps the counters cluster-wide and hands each
free slot to the backlogged tenant with the smallest counter, wherever it is
held; a slot for a tenant held elsewhere is queued for that instance and
wakes it. The grant names the (band, tenant) pairs this instance releases;
which of the tenant's requests goes is its FIFO's head here.

**Degraded.** While Redis cannot be reached, each seat releases on its own by
its local policy, capped at ``cap / N`` of each band's cap (N: the
instances last seen alive, at least the configured count), so N instances
together stay within one instance's limit. The first successful ask after the
outage rejoins: it republishes the exact count in flight and the backlog.

Pure: the adapter does the round trips and calls :meth:`ClusterSeat.ask`,
:meth:`~ClusterSeat.granted` and :meth:`~ClusterSeat.lost` around each.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Protocol

from extproc.core.strategy import LocalRelease, Outlet
from extproc.core.timers import Timers
from extproc.core.values.status import ClusterStatus


@dataclass(frozen=True, slots=True)
class Backlog:
    """Requests of one tenant queued here in one band."""

    band: int
    tenant: str
    count: int
    # What the tenant's next request adds to its counter (the policy's service for its estimate).
    service: float
    # Its FIFO here was empty at some point since the last ask: if no instance held it
    # meanwhile, it joins the cluster's backlog anew and is lifted to the others' counters.
    fresh: bool = False


@dataclass(frozen=True, slots=True)
class Correction:
    """Real service minus the service charged at release, of one (band, tenant), since the last ask."""

    band: int
    tenant: str
    delta: float


@dataclass(frozen=True, slots=True)
class Ask:
    """What one seat tells the cluster with each round trip."""

    # Our requests released and not finished: exact, published as is (never an increment).
    in_flight: int
    # Per band: the most requests the whole cluster may have in flight once this band released.
    caps: tuple[int, ...]
    backlog: tuple[Backlog, ...]
    corrections: tuple[Correction, ...]
    # Per band: its minimum share of releases while a band above takes the rest (bands.py, BandShares).
    shares: tuple[float, ...] = ()


@dataclass(frozen=True, slots=True)
class Release:
    """One slot granted: the head of ``tenant``'s FIFO in ``band`` goes."""

    band: int
    tenant: str


@dataclass(frozen=True, slots=True)
class Grant:
    """The cluster's answer: what this seat releases now."""

    # The other live instances' requests in flight (and slots granted them, not yet taken).
    others_in_flight: int
    # Live instances, this one included.
    instances: int
    # In the order decided.
    releases: tuple[Release, ...] = ()


class ClusterOutlet(Outlet, Protocol):
    """What a seat reads of its model besides a local strategy's: what an ask carries, and a release a grant names."""

    @property
    def bands(self) -> int:
        """How many bands the model has."""

    def first_band(self) -> int | None:
        """The highest band holding a request (the only one strict priority serves), or None."""

    def allowance(self, band: int, now: float) -> int:
        """How many requests of ``band`` may go now (the band rules above the release rule)."""

    def free_slots(self, now: float) -> int:
        """Slots the engines have free now by the load estimate (``Pool.free_slots``)."""

    @property
    def in_flight(self) -> int:
        """Our released requests whose streams have not ended."""

    def share(self, band: int, now: float) -> float:
        """``band``'s least share of the releases while a band above takes the rest."""

    def cap(self, band: int, now: float) -> int:
        """The most requests the pool may have in flight, counting other instances', once ``band`` released."""

    def backlog(self) -> Iterator[Backlog]:
        """Every (band, tenant) with requests queued here, with the service of the tenant's next request."""

    def service(self, tenant: str, cost: float) -> float:
        """What a release of ``cost`` adds to ``tenant``'s counter (the policy's service)."""

    def release_head(self, band: int, tenant: str, now: float, *, free: bool) -> bool:
        """Release ``tenant``'s next request in ``band`` whatever the policy's turn (the cluster decided it).

        False if it has none, or its client had already left.
        """

    def record_others(self, now: float, others: int) -> None:
        """The other instances have ``others`` in flight now."""


class ClusterLink(Protocol):
    """The adapter that carries a seat's asks to the cluster (``adapters/cluster/``)."""

    def wanted(self, urgent: bool) -> None:
        """Something changed: ask soon. ``urgent``: now; else shortly, gathered with other such changes."""


class ClusterSeat:
    """The release strategy of one model's dispatcher in a cluster (see the module docstring).

    Joined, every release comes from a grant; cut off (``degraded``, and
    until the first grant), it runs :class:`~extproc.core.strategy.LocalRelease`
    capped at its share of each band's cap.
    """

    def __init__(self, outlet: ClusterOutlet, timers: Timers, link: ClusterLink, expected_instances: int = 1) -> None:
        self._outlet = outlet
        self._link = link
        self._local = LocalRelease(outlet, timers, limit=self._share)
        # Instances expected (the config's list), for the degraded share before any was seen.
        self._expected = expected_instances
        self.degraded = True  # until the first ask succeeds
        self.instances = 1
        self._corrections: dict[tuple[int, str], float] = {}
        self._fresh: set[tuple[int, str]] = set()

    # --- the release strategy (strategy.py): what the dispatcher tells it ---------------------------

    def queued(self, band: int, tenant: str, first: bool, now: float) -> None:
        if first:
            self._fresh.add((band, tenant))
        if self.degraded:
            self._local.changed(now)
        else:
            # The cluster must hear at once of a tenant new here (the fairest may be it) or of
            # room to release; one more request of a tenant already queued can be gathered with others.
            self._link.wanted(first or self._outlet.allowance(band, now) > 0)

    def ended(self, band: int, tenant: str, charged: float, measured: float, now: float) -> None:
        delta = self._outlet.service(tenant, measured) - self._outlet.service(tenant, charged)
        if delta:
            key = (band, tenant)
            self._corrections[key] = self._corrections.get(key, 0.0) + delta
        self.changed(now)

    def changed(self, now: float) -> None:
        if self.degraded:
            self._local.changed(now)
        else:
            self._outlet.note_health(now)
            self._link.wanted(True)  # the cluster decides: granted() releases

    def scraped(self, now: float) -> None:
        if self.degraded:
            self._local.changed(now)
            return
        # A scrape matters to the cluster only if it lets this instance release: else the next
        # round trip (an end, an arrival, the heartbeat) takes its numbers along anyway.
        self._outlet.note_health(now)
        first = self._outlet.first_band()
        if first is not None and self._outlet.allowance(first, now) > 0:
            self._link.wanted(True)

    def cluster(self) -> ClusterStatus:
        return ClusterStatus(self.instances, self.degraded)

    # --- the round trip: the adapter calls these around each ----------------------------------------

    def ask(self) -> Ask:
        """What to tell the cluster now: our count in flight, each band's cap, the backlog, the corrections."""
        outlet = self._outlet
        now = outlet.clock()
        corrections = tuple(Correction(band, tenant, delta) for (band, tenant), delta in self._corrections.items())
        self._corrections.clear()
        backlog = tuple(replace(e, fresh=True) if (e.band, e.tenant) in self._fresh else e for e in outlet.backlog())
        self._fresh.clear()
        bands = range(outlet.bands)
        caps = tuple(outlet.cap(band, now) for band in bands)
        shares = tuple(outlet.share(band, now) for band in bands)
        return Ask(outlet.in_flight, caps, backlog, corrections, shares)

    def granted(self, grant: Grant) -> None:
        """The cluster's answer: release the head of each named tenant's FIFO here."""
        outlet = self._outlet
        now = outlet.clock()
        self.degraded = False
        self.instances = max(1, grant.instances)
        outlet.record_others(now, grant.others_in_flight)
        free = outlet.free_slots(now) if grant.releases else 0
        for release in grant.releases:
            # False: none queued (its client left since the ask: the slot returns with the next ask's count).
            if outlet.release_head(release.band, release.tenant, now, free=free > 0):
                free -= 1

    def lost(self, ask: Ask) -> None:
        """The ask never reached Redis (or its answer was lost): release on our share; the next ask carries it again."""
        for c in ask.corrections:
            key = (c.band, c.tenant)
            self._corrections[key] = self._corrections.get(key, 0.0) + c.delta
        self._fresh.update((e.band, e.tenant) for e in ask.backlog if e.fresh)
        self.degraded = True
        self._local.changed(self._outlet.clock())

    def _share(self, band: int, now: float) -> int:
        """Degraded: what this seat may still release of ``band``, its share of the cluster-wide cap."""
        return self._outlet.cap(band, now) // max(self.instances, self._expected) - self._outlet.in_flight
