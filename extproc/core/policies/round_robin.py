"""``policy: round_robin`` (the default): tenants take turns, one request each.

Each tenant has its own FIFO; the backlogged tenants form a rotation, and
serving a tenant moves it to the back. A tenant that arrives (or returns
after its queue ran empty) joins at the back, so it is served before any
tenant already in the rotation is served twice: a newcomer waits at most one
round, however deep the flood in front of it. Returning tenants do not bank
the time they were idle. It counts requests, not their cost, and ignores
weights: its service is 1 per release, its estimates are exact (E = 0), so
its bound is one request.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from typing import Any, TypeVar

from extproc.core.policies.base import ClusterForm, ExpectedHit, Policy, TenantQueues, TenantWeight

Item = TypeVar("Item", bound=Hashable)


class TenantRoundRobin(TenantQueues[Item]):
    """One priority band: a FIFO per tenant, served in rotation."""

    def __init__(self) -> None:
        super().__init__()
        self._rotation: deque[str] = deque()

    def push(self, tenant: str, item: Item) -> None:
        queue = self._queues.get(tenant)
        if queue is None:
            queue = self._queues[tenant] = self._new_queue()
            self._rotation.append(tenant)
        queue.append(item)
        self._size += 1

    def pop(self) -> tuple[str, Item]:
        """Take the head of the next tenant's FIFO; raises IndexError when empty."""
        tenant = self._rotation.popleft()
        queue = self._queues[tenant]
        item = queue.popleft()
        if queue:
            self._rotation.append(tenant)
        else:
            del self._queues[tenant]
        self._size -= 1
        return tenant, item

    def _leave(self, tenant: str) -> None:
        super()._leave(tenant)
        self._rotation.remove(tenant)

    def charge(self, tenant: str, cost: float) -> None:
        """Round-robin counts requests, not their cost."""

    def correct(self, tenant: str, delta: float) -> None:
        """Round-robin counts requests, not their cost."""


def _new_band(weight: TenantWeight, hit: ExpectedHit) -> TenantRoundRobin[Any]:
    return TenantRoundRobin()


POLICY = Policy("round_robin", _new_band, service=lambda cost, weight: 1.0, cluster=ClusterForm.COUNTER)
