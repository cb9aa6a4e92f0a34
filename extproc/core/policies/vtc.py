"""``policy: vtc``: virtual token counters, tenants share weighted tokens rather than turns.

The counters follow Sheng et al., *Fairness in Serving Large Language Models*
(OSDI 2024):

* each tenant has a counter of the service it received, divided by its
  weight; the backlogged tenant with the smallest counter goes next (ties: the
  one backlogged longest);
* a release is charged its estimated cost at once, and corrected when the
  response ends and its real cost is known;
* a tenant that becomes backlogged again is lifted to the smallest counter of
  the backlogged tenants (or, with none, to that of the last tenant picked), so
  idle time is not banked: a tenant that was away does not get a burst.

Bound (checked by the conformance test, whose service is cost / weight): for
two continuously backlogged tenants, let U be the largest weighted real cost of one request, E the largest weighted
error of one estimate and K the most requests in flight at once. At every
moment the weighted real cost of everything released to the two differs by at
most ``U + K * E``. (When tenant i is picked its counter is the smallest; each
counter differs from the real released cost by the errors of its in-flight
requests, at most K * E together; the pick then adds at most U.) With exact
estimates this is the classic one-request bound U.

Counters stay finite whatever they are told. The cost model already bounds
every estimate and measurement by the model's context (cost.py), but one
infinite charge would make the floor infinite for good: every tenant joining
later would tie at inf with the tenant flooding, and lose the tie-break to it.
So each weighted charge or correction is clamped to ``±MAX_SERVICE`` (far above
any real request) and a NaN counts as nothing; a charge and its correction
clamp symmetrically, so a clamped pair still nets to zero.

Picking is a scan of the backlogged tenants of the band: about 4 µs with 10
of them, 160 µs with 1 000 (measured); a heap would be the next step if bands
with thousands of backlogged tenants become common.

Pure: no clock and no I/O, like the rest of the scheduling core.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Hashable
from typing import Any, TypeVar

from extproc.core.policies.base import ClusterForm, ExpectedHit, Policy, TenantQueues, TenantWeight

Item = TypeVar("Item", bound=Hashable)

# Above this many idle entries the counters are swept of tenants that a return
# would lift anyway; keeps memory bounded by the active tenants.
_SWEEP_SLACK = 64
# The most weighted service one charge or correction may add or take: a
# million-token context at weight 1e-3 and price 1e3 per token is 1e12. Counters
# that only ever grow by finite steps this size stay finite (and exact to well
# below one token) for longer than any process lives.
MAX_SERVICE = 1e12


def _bounded(service: float) -> float:
    """``service`` clamped to ``±MAX_SERVICE``; NaN (nothing known) is 0."""
    return 0.0 if math.isnan(service) else min(max(service, -MAX_SERVICE), MAX_SERVICE)


class VirtualTokenCounter(TenantQueues[Item]):
    """One band under cost-weighted fair queueing (see the module docstring)."""

    def __init__(self, weight: TenantWeight) -> None:
        super().__init__()
        self._weight = weight
        # When each backlogged tenant (re)joined the backlog: the tie-break.
        self._joined: dict[str, int] = {}
        self._sequence = itertools.count()
        # Weighted service received. A tenant without an entry is at the floor.
        self._counters: dict[str, float] = {}
        # The counter of the last tenant picked (never decreases): where a
        # tenant joining an empty band starts.
        self._floor = 0.0

    def counter(self, tenant: str) -> float:
        return self._counters.get(tenant, self._floor)

    @property
    def remembered(self) -> int:
        """The tenants the band keeps state for, backlogged or idle above the floor: its memory, which the sweep
        bounds by the active tenants however many come and go."""
        return len(self._counters)

    def push(self, tenant: str, item: Item) -> None:
        queue = self._queues.get(tenant)
        if queue is None:
            lift = min((self._counters[t] for t in self._queues), default=self._floor)
            self._counters[tenant] = max(self.counter(tenant), lift)
            queue = self._queues[tenant] = self._new_queue()
            self._joined[tenant] = next(self._sequence)
        queue.append(item)
        self._size += 1

    def pop(self) -> tuple[str, Item]:
        """Head of the backlogged tenant with the least weighted service; IndexError when empty."""
        if not self._queues:
            raise IndexError("pop from an empty band")
        tenant, lowest, position = self._pick()
        self._floor = max(self._floor, lowest)
        queue = self._queues[tenant]
        item = queue.popleft() if not position else self._take_at(tenant, position)
        if not queue:
            self._leave(tenant)
        self._size -= 1
        if len(self._counters) > 2 * len(self._queues) + _SWEEP_SLACK:
            self._sweep()
        return tenant, item

    def _pick(self) -> tuple[str, float, int]:
        """The backlogged tenant whose request goes next, the smallest backlogged counter (the floor rises to it),
        and the request's position in the tenant's queue (0: its head; only ``locality`` picks another)."""
        tenant = min(self._queues, key=self._rank)
        return tenant, self._counters[tenant], 0

    def _take_at(self, tenant: str, position: int) -> Item:
        """Dequeue the tenant's request at ``position`` (> 0), for a policy whose ``_pick`` chooses one."""
        raise NotImplementedError("this policy serves each tenant's queue in order")

    def _rank(self, tenant: str) -> tuple[float, int]:
        """Least weighted service first; ties: backlogged longest."""
        return self._counters[tenant], self._joined[tenant]

    def charge(self, tenant: str, cost: float) -> None:
        """Add a release's estimated cost (before weighting) to the tenant's counter."""
        self._add(tenant, cost)

    def correct(self, tenant: str, delta: float) -> None:
        """Adjust by real cost minus the estimate charged (negative: it cost less)."""
        self._add(tenant, delta)

    def _add(self, tenant: str, cost: float) -> float:
        """Add ``cost`` (before weighting) to the tenant's counter; the weighted service added."""
        service = _bounded(cost / self._weight(tenant))
        self._counters[tenant] = self.counter(tenant) + service
        return service

    def _leave(self, tenant: str) -> None:
        super()._leave(tenant)
        del self._joined[tenant]

    def _sweep(self) -> None:
        """Forget idle tenants at or below the floor: their return lifts them there anyway."""
        for tenant in [t for t, c in self._counters.items() if t not in self._queues and c <= self._floor]:
            del self._counters[tenant]



class LargestCharge(VirtualTokenCounter[Item]):
    """``vtc`` that remembers each tenant's largest weighted charge: the unit of a policy's window past fairness.

    ``deadline`` and ``locality`` let a tenant go ahead of the smallest counter
    by some of its own requests' worth, so a tenant of small requests cannot
    jump by a large one's worth.
    """

    def __init__(self, weight: TenantWeight) -> None:
        super().__init__(weight)
        self._largest: dict[str, float] = {}

    def largest(self, tenant: str) -> float:
        """The largest weighted charge of ``tenant`` (0 before its first)."""
        return self._largest.get(tenant, 0.0)

    @property
    def remembered(self) -> int:
        """As ``vtc``'s, counting too a tenant whose largest charge outlived its counter (the sweep takes both)."""
        return len(self._counters.keys() | self._largest.keys())

    def charge(self, tenant: str, cost: float) -> None:
        self._largest[tenant] = max(self.largest(tenant), self._add(tenant, cost))

    def _sweep(self) -> None:
        super()._sweep()
        self._largest = {t: w for t, w in self._largest.items() if t in self._counters}


def _new_band(weight: TenantWeight, hit: ExpectedHit) -> VirtualTokenCounter[Any]:
    return VirtualTokenCounter(weight)


POLICY = Policy("vtc", _new_band, service=lambda cost, weight: cost / weight, cluster=ClusterForm.COUNTER)
