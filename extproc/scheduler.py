"""The scheduling core: who goes next, among the requests held for one model.

Pure data structures, no I/O and no clock: the adapters decide *when* to
release (see ``gate.py``); this module decides *which* request.

Order of service:

* **Priority bands, strictly.** Band 0 (e.g. ``interactive``) is always served
  before band 1, and so on. A lower band only moves when every higher band
  is empty.
* **Round-robin across tenants inside a band.** Each tenant has its own FIFO;
  the backlogged tenants form a rotation, and serving a tenant moves it to the
  back. A tenant that arrives (or returns after its queue ran empty) joins at
  the back, so it is served before any tenant already in the rotation is
  served twice: a newcomer waits at most one round, however deep the flood in
  front of it. Returning tenants do not bank the time they were idle.
  Cost-aware alternatives with the same interface live in ``policies.py``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

from extproc.policies import BandPolicy, TenantQueues

Item = TypeVar("Item", bound=Hashable)


class TenantRoundRobin(TenantQueues[Item]):
    """One priority band: a FIFO per tenant, served in rotation."""

    def __init__(self) -> None:
        super().__init__()
        self._rotation: deque[str] = deque()

    def push(self, tenant: str, item: Item) -> None:
        queue = self._queues.get(tenant)
        if queue is None:
            queue = self._queues[tenant] = deque()
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


class FairQueue(Generic[Item]):
    """All requests held for one model: priority bands of tenant rotations."""

    def __init__(self, bands: int, policy: Callable[[], BandPolicy[Item]] = TenantRoundRobin) -> None:
        if bands < 1:
            raise ValueError("a queue needs at least one priority band")
        self._bands: list[BandPolicy[Item]] = [policy() for _ in range(bands)]

    def __len__(self) -> int:
        return sum(len(b) for b in self._bands)

    def band_len(self, band: int) -> int:
        return len(self._bands[band])

    def push(self, band: int, tenant: str, item: Item) -> None:
        self._bands[band].push(tenant, item)

    def first_band(self) -> int | None:
        """The highest band holding a request (the only one strict priority may serve), or None."""
        return next((index for index, band in enumerate(self._bands) if band), None)

    def pop(self) -> tuple[int, str, Item]:
        """The next request to release: (band, tenant, item). IndexError when empty."""
        index = self.first_band()
        if index is None:
            raise IndexError("pop from an empty FairQueue")
        tenant, item = self._bands[index].pop()
        return index, tenant, item

    def remove(self, band: int, tenant: str, item: Item) -> bool:
        return self._bands[band].remove(tenant, item)

    def tenant_len(self, tenant: str) -> int:
        """Requests of ``tenant`` queued in every band."""
        return sum(band.tenant_len(tenant) for band in self._bands)

    def charge(self, band: int, tenant: str, cost: float) -> None:
        self._bands[band].charge(tenant, cost)

    def correct(self, band: int, tenant: str, delta: float) -> None:
        self._bands[band].correct(tenant, delta)
