"""Active-active: one model's dispatcher as one seat of a cluster of processor instances.

Several ``extproc serve`` instances behind one Envoy (it spreads the ext_proc
streams over them) must behave as one: together they keep the engine's queue
at target, and they share fairness as if one queue held every request. Each
request stays held in the instance whose stream holds it; what the instances
share lives in Redis (``adapters/cluster/``), and a Redis script decides every
release atomically. This module is the core's side of that: what a seat tells
the cluster (an :class:`Ask`), what it is told back (a :class:`Grant`), and
what it does on its own while the cluster cannot be reached.

**Capacity.** The release rule still computes its headroom on this instance,
from its own scrapes, but the load estimate counts the other instances'
requests in flight as ours (``release/estimate.py``, ``record_others``). So
``headroom + ours + others`` is the most the *cluster* may have in flight
after the release: the ask's per-band ``caps``. The script sums what every
live instance has in flight now (each instance publishes its exact count with
every ask, under a lease) and grants only what fits under the cap. Counts are
absolute, never increments: a lost reply or a repeated ask cannot count a
request twice, and a dead instance's count lapses with its lease.

**Fairness.** Each ask also carries this instance's backlog: every tenant
with requests queued here, per band, with the service its next request would
add to the tenant's counter (``Policy.service``: 1 for round-robin, weighted
cost for ``vtc``). The script keeps the counters cluster-wide and hands each
free slot to the backlogged tenant with the smallest counter, wherever it is
held; a slot for a tenant held elsewhere is queued for that instance and
wakes it. The grant names the (band, tenant) pairs this instance releases;
which of the tenant's requests goes is its FIFO's head here.

**Degraded.** While Redis cannot be reached, each seat releases on its own by
its local policy, capped at ``cap / N`` of each band's cap (N: the
instances last seen alive, at least the configured count), so N instances
together stay within one instance's limit. The first successful ask after the
outage rejoins: it republishes the exact count in flight and the backlog.

Pure: the adapter passes ``now`` and does the round trips.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Protocol


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
class Ask:
    """What one seat tells the cluster with each round trip."""

    # Our requests released and not finished: exact, published as is (never an increment).
    in_flight: int
    # Per band: the most requests the whole cluster may have in flight once this band released.
    caps: tuple[int, ...]
    backlog: tuple[Backlog, ...]
    # Per (band, tenant): real service minus the service charged at release, since the last ask.
    corrections: tuple[tuple[int, str, float], ...]


@dataclass(frozen=True, slots=True)
class Grant:
    """The cluster's answer: what this seat releases now."""

    # (band, tenant) per release, in the order decided.
    releases: tuple[tuple[int, str], ...]
    # The other live instances' requests in flight (and slots granted them, not yet taken).
    others_in_flight: int
    # Live instances, this one included.
    instances: int


class ClusterLink(Protocol):
    """The adapter that carries a seat's asks to the cluster (``adapters/cluster/``)."""

    def wanted(self, urgent: bool) -> None:
        """Something changed: ask soon. ``urgent``: now; else shortly, gathered with other such changes."""


@dataclass
class ClusterSeat:
    """One dispatcher's standing in the cluster (see the module docstring)."""

    link: ClusterLink
    # Instances expected (the config's list), for the degraded share before any was seen.
    expected_instances: int = 1
    degraded: bool = True  # until the first ask succeeds
    instances: int = 1
    _corrections: dict[tuple[int, str], float] = field(default_factory=dict)
    _fresh: set[tuple[int, str]] = field(default_factory=set)

    def arrived(self, band: int, tenant: str) -> None:
        """``tenant``'s FIFO in ``band`` here was empty and is not any more."""
        self._fresh.add((band, tenant))

    def correct(self, band: int, tenant: str, delta_service: float) -> None:
        """A released request's real service differed from its charge: carried by the next ask."""
        if delta_service:
            key = (band, tenant)
            self._corrections[key] = self._corrections.get(key, 0.0) + delta_service

    def ask(self, in_flight: int, caps: tuple[int, ...], backlog: Iterator[Backlog]) -> Ask:
        corrections = tuple((band, tenant, delta) for (band, tenant), delta in self._corrections.items())
        self._corrections.clear()
        entries = tuple(replace(e, fresh=True) if (e.band, e.tenant) in self._fresh else e for e in backlog)
        self._fresh.clear()
        return Ask(in_flight, caps, entries, corrections)

    def lost(self, ask: Ask) -> None:
        """The ask never reached Redis (or its answer was lost): the next one carries what it carried."""
        for band, tenant, delta in ask.corrections:
            self.correct(band, tenant, delta)
        self._fresh.update((e.band, e.tenant) for e in ask.backlog if e.fresh)

    def joined(self, grant: Grant) -> None:
        self.degraded = False
        self.instances = max(1, grant.instances)

    def share(self, cap: int, ours: int) -> int:
        """Degraded: what this seat may still release of a band whose cluster-wide cap is ``cap``."""
        return cap // max(self.instances, self.expected_instances) - ours


def backlog(
    tenant_lengths: Callable[[int], dict[str, int]], bands: int, service: Callable[[int, str], float]
) -> Iterator[Backlog]:
    """Every (band, tenant) queued here, with the service of the tenant's next request."""
    for band in range(bands):
        for tenant, count in tenant_lengths(band).items():
            yield Backlog(band, tenant, count, service(band, tenant))
