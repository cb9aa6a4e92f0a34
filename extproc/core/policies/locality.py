"""``policy: locality``: the longest expected cache hit first, inside a deficit quantum of cost-weighted fairness.

A request whose prompt's leading blocks are still in the engine's KV cache
skips their prefill. Which requests find their prefix cached depends on the
order of release: a document's questions released together hit, the same
questions spread between a flood's requests find it evicted. This policy
orders by that, within a bound of ``vtc``'s fair share. It follows Cao et
al., *Locality-aware Fair Scheduling in LLM Serving* (2025, arXiv
2501.14312), whose Deficit Longest Prefix Match (DLPM) lets a client's
request go by its prefix match while the client's deficit counter allows it.

* **Among tenants: ``vtc``'s counters** (service = cost / weight, charged at
  release, corrected at the end, a tenant rejoining the backlog lifted to the
  smallest counter). Locality may choose among the backlogged tenants whose
  counter is within the tenant's **deficit quantum** of the smallest counter:
  :data:`QUANTUM_REQUESTS` requests' worth of the tenant's own service (the
  largest weighted charge it has been charged, as ``deadline``'s window).
  Beyond it, fairness wins: a tenant is never picked above the smallest
  counter plus its quantum.
* **Within the quantum: the longest expected cache hit first.** Of the
  candidates of those tenants (the first :data:`LOOKAHEAD` requests of each
  tenant's queue, at most :data:`SCORED` in all), the one with the most prompt tokens expected cached
  (the band's ``hit``, :data:`~extproc.core.policies.base.ExpectedHit`: the model's account of the
  endpoints' caches, ``core/pricing.py``) goes. Ties, and so a band with nothing
  cached: the smaller counter, then backlogged longest, then the tenant's
  earlier request. With no hit anywhere this is exactly ``vtc``.
* **Within a tenant: bounded reordering.** A tenant's request may go before
  earlier ones of its own (its questions on a cached document before its
  question on another), but none is overtaken by more than
  :data:`OVERTAKES` later requests of its tenant: once a request has been,
  no later one is a candidate until it has gone. So none starves.

Bound (checked by the conformance test: ``Policy.window_requests`` =
:data:`QUANTUM_REQUESTS`, ``Policy.overtakes`` = :data:`OVERTAKES`): for two
continuously backlogged tenants the weighted real cost released to each
differs by at most ``U + K·E + Q·W``, where U, E and K are ``vtc``'s (the most
service of one request, of one estimate's error, the most in flight), W the
most service one request is charged and Q = :data:`QUANTUM_REQUESTS`. When
tenant i is picked its counter is at most the smallest plus ``Q·w_i`` ≤ Q·W;
the rest of ``vtc``'s argument is unchanged. DLPM's own bound is of the same
form (its quantum plus one request, per client pair).

Cost: a pick finds ``vtc``'s choice (a scan of the backlogged tenants), then
scores at most :data:`SCORED` requests, each a bisection over its prefix's
blocks per endpoint: the fair choice's tenant first, then the tenants within
their quantum in the order they joined the backlog. With more tenants than
that inside the quantum, the later ones are served by fairness alone
(measured in docs/locality.md). No cluster form (``Policy.cluster`` is None): the
cluster's script cannot see the engines' caches.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar, cast

from extproc.core.policies import vtc
from extproc.core.policies.base import Policy, TenantQueue, TenantWeight
from extproc.core.policies.vtc import LargestCharge

Local = TypeVar("Local", bound=Hashable)

# The deficit quantum, in requests' worth of the tenant's own largest charge.
QUANTUM_REQUESTS = 2
# How many of each tenant's queued requests are candidates.
LOOKAHEAD = 8
# The most later requests of its own tenant that may go before a request.
OVERTAKES = 8
# The most requests scored per pick: the cost of a pick stays bounded however many tenants are backlogged.
SCORED = 64


class LocalityQueue(Generic[Local]):
    """One tenant's requests in arrival order, each with how many later ones of its tenant went before it."""

    __slots__ = ("_items", "_passed")

    def __init__(self) -> None:
        self._items: deque[Local] = deque()
        self._passed: deque[int] = deque()

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, index: int) -> Local:
        return self._items[index]

    def append(self, item: Local) -> None:
        self._items.append(item)
        self._passed.append(0)

    def popleft(self) -> Local:
        self._passed.popleft()
        return self._items.popleft()

    def remove(self, item: Local) -> None:
        index = self._items.index(item)  # ValueError if it is not queued, as the protocol says
        del self._items[index]
        del self._passed[index]

    def candidates(self) -> int:
        """How many of the first requests may go next: up to LOOKAHEAD, none past one overtaken OVERTAKES times."""
        for index in range(min(LOOKAHEAD, len(self._passed))):
            if self._passed[index] >= OVERTAKES:
                return index + 1
        return min(LOOKAHEAD, len(self._items))

    def take_at(self, index: int) -> Local:
        """Dequeue the request at ``index``; every earlier one has been overtaken once more."""
        for earlier in range(index):
            self._passed[earlier] += 1
        item = self._items[index]
        del self._items[index]
        del self._passed[index]
        return item


class LocalityBand(LargestCharge[Local]):
    """One band: ``vtc``'s counters, the longest expected cache hit first within each tenant's quantum.

    ``hit``: the prompt tokens a queued request would find cached if released now.
    """

    def __init__(self, weight: TenantWeight, hit: Callable[[Local], float]) -> None:
        super().__init__(weight)
        self._hit = hit

    def quantum(self, tenant: str) -> float:
        """How far above the smallest counter the tenant's counter may be and locality still choose it."""
        return QUANTUM_REQUESTS * self.largest(tenant)

    def _new_queue(self) -> TenantQueue[Local]:
        return LocalityQueue()

    def _pick(self) -> tuple[str, float, int]:
        fair = min(self._queues, key=self._rank)  # vtc's pick: always a candidate
        lowest = self._counters[fair]
        best: tuple[float, float, int, int] | None = None
        choice = (fair, 0)
        budget = SCORED
        for tenant in itertools.chain((fair,), (t for t in self._queues if t != fair)):
            counter = self._counters[tenant]
            if counter > lowest + self.quantum(tenant):
                continue
            queue = self._queue(tenant)
            joined = self._joined[tenant]
            for index in range(min(queue.candidates(), budget)):
                hit = self._hit(queue[index])
                # Most cached first (NaN: nothing); ties: smaller counter, backlogged longer, earlier request.
                rank = (-hit if hit > 0 else 0.0, counter, joined, index)
                if best is None or rank < best:
                    best, choice = rank, (tenant, index)
                budget -= 1
            if budget <= 0:
                break
        return choice[0], lowest, choice[1]

    def _take_at(self, tenant: str, position: int) -> Local:
        return self._queue(tenant).take_at(position)

    def _queue(self, tenant: str) -> LocalityQueue[Local]:
        return cast(LocalityQueue[Local], self._queues[tenant])

POLICY = Policy("locality", LocalityBand, service=vtc.POLICY.service, window_requests=QUANTUM_REQUESTS,
                overtakes=OVERTAKES)
