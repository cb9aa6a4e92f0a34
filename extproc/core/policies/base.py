"""What every fairness policy is: the band-policy interface, its shared per-tenant queues, its registry entry.

A band policy holds the requests of one priority band, a queue per tenant (a
FIFO, or by deadline), and decides whose head goes next. ``charge`` and
``correct`` tell it what each release cost (estimated at release, corrected at
the end), for the policies that share cost rather than turns.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Generic, Protocol, TypeVar

Item = TypeVar("Item", bound=Hashable)
# A tenant's weight (> 0; 1 when not configured).
TenantWeight = Callable[[str], float]
# The prompt tokens a queued request would find cached if released now (the model's account of the
# engines' caches, core/pricing.py; 0 where it has no prefix signature): what ``locality`` orders by.
ExpectedHit = Callable[[Any], float]


class BandPolicy(Protocol[Item]):
    """What the fair queue needs from one band."""

    def __len__(self) -> int: ...

    def push(self, tenant: str, item: Item) -> None: ...

    def pop(self) -> tuple[str, Item]:
        """The next request and its tenant; IndexError when the band is empty."""
        ...

    def remove(self, tenant: str, item: Item) -> bool:
        """Drop a queued item (its client left); False if it is not queued here."""
        ...

    def tenant_len(self, tenant: str) -> int: ...

    def head(self, tenant: str) -> Item | None:
        """The tenant's next request, left queued (None: none queued)."""
        ...

    def take(self, tenant: str) -> Item | None:
        """Dequeue the tenant's next request out of the policy's turn (None: none queued).

        For a cluster (``core/cluster.py``), where the turn was decided across instances.
        """
        ...

    def tenant_lengths(self) -> dict[str, int]:
        """Every backlogged tenant and its queued count (the status page; read on request, not per release)."""
        ...

    def charge(self, tenant: str, cost: float) -> None:
        """A request of ``tenant`` was released with this estimated cost."""
        ...

    def correct(self, tenant: str, delta: float) -> None:
        """A released request's real cost turned out ``delta`` above its estimate (negative: below)."""
        ...


class ClusterForm(StrEnum):
    """How a cluster of instances runs a policy: the forms ``adapters/cluster/schedule.lua`` implements.

    ``COUNTER``: every tenant has a counter of the service it received
    (``Policy.service`` per release, corrected at its end); the backlogged
    tenant with the smallest counter goes next (ties: served longest ago); a
    tenant joining the backlog is lifted to the smallest counter of those in
    it. The shared conformance suite checks a policy's cluster form on a real
    Redis against the same bounds as the policy itself.
    """

    COUNTER = "counter"


@dataclass(frozen=True)
class Policy:
    """A policy as the registry knows it.

    ``service`` is what the policy keeps equal between continuously
    backlogged tenants, per release, from the request's cost and its tenant's
    weight. Every policy promises the same bound in its own measure, which
    the shared conformance test (tests/core/policies/test_policy_conformance.py) checks:
    the service released to two such tenants differs by at most ``U + K·E``,
    where U is the most service one request gives, E the largest error of one
    estimate (in service) and K the most requests in flight at once.

    A policy may let some other goal than equal service (a deadline) move a
    tenant ahead of its share, within a window: ``window_requests`` says by how
    many requests' worth of service, each at most the most service one request
    is charged (its estimate). Its bound is then ``U + K·E`` plus that window.

    ``by_deadline``: each tenant's requests leave earliest ``deadline`` first
    (ties: arrival), read from the items (:class:`Deadlined`); otherwise in
    arrival order.

    ``overtakes``: the most later requests of its own tenant that may leave
    before a request (0: each tenant's requests leave in the order above).

    ``cluster`` is how a cluster of instances runs it (None: it cannot be, and
    the config refuses it with a ``cluster:`` section).

    ``new_band`` builds one band's policy from what it may read of the model:
    its tenants' weights, and each queued request's expected cache hit.
    """

    name: str
    new_band: Callable[[TenantWeight, ExpectedHit], BandPolicy[Any]]
    service: Callable[[float, float], float]
    cluster: ClusterForm | None = None
    window_requests: int = 0
    by_deadline: bool = False
    overtakes: int = 0


class Deadlined(Hashable, Protocol):
    """A request a deadline-ordered policy can queue: when it should be released by (``Held.deadline``)."""

    @property
    def deadline(self) -> float: ...


class TenantQueue(Protocol[Item]):
    """One tenant's queued requests, in the order they leave (``[0]`` next); a ``deque`` is one in arrival order."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Item: ...

    def append(self, item: Item) -> None:
        """Queue ``item`` in its place."""

    def popleft(self) -> Item: ...

    def remove(self, item: Item) -> None:
        """Drop ``item``; ValueError if it is not queued."""


class TenantQueues(Generic[Item]):
    """A queue per backlogged tenant: the bookkeeping every band policy shares.

    Subclasses decide whose head goes next (``pop``) and extend ``_leave``,
    called when a tenant's queue runs empty, for their own per-tenant state.
    Each queue is a FIFO unless the subclass's ``_new_queue`` orders it
    otherwise.
    """

    def __init__(self) -> None:
        self._queues: dict[str, TenantQueue[Item]] = {}
        self._size = 0

    def _new_queue(self) -> TenantQueue[Item]:
        """An empty queue for a tenant that joins the backlog: a FIFO."""
        return deque()

    def __len__(self) -> int:
        return self._size

    def tenant_len(self, tenant: str) -> int:
        queue = self._queues.get(tenant)
        return len(queue) if queue is not None else 0

    def tenant_lengths(self) -> dict[str, int]:
        return {tenant: len(queue) for tenant, queue in self._queues.items()}

    def head(self, tenant: str) -> Item | None:
        queue = self._queues.get(tenant)
        return queue[0] if queue else None

    def take(self, tenant: str) -> Item | None:
        queue = self._queues.get(tenant)
        if queue is None:
            return None
        item = queue.popleft()
        self._size -= 1
        if not queue:
            self._leave(tenant)
        return item

    def remove(self, tenant: str, item: Item) -> bool:
        """Drop a queued item (its client left). False if it is not queued here.

        Linear in the tenant's own backlog, which is bounded by the queue caps;
        removing is rare next to pushing and popping.
        """
        queue = self._queues.get(tenant)
        if queue is None:
            return False
        try:
            queue.remove(item)
        except ValueError:
            return False
        self._size -= 1
        if not queue:
            self._leave(tenant)
        return True

    def _leave(self, tenant: str) -> None:
        del self._queues[tenant]
