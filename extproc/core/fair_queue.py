"""The fair queue: who goes next, among the requests held for one model.

Pure data structures, no I/O and no clock: the release side decides *how
many* may go now (``release/``, ``bands.py``); this module decides *which*.

Order of service:

* **Priority bands, strictly.** Band 0 (e.g. ``interactive``) is always served
  before band 1, and so on. A lower band only moves when every higher band
  is empty, or on its minimum share of the releases, which the release side
  keeps (``bands.py``, ``BandShares``) and asks for by band.
* **A fairness policy inside each band** (``extproc/core/policies``): by
  default round-robin across tenants, each with its own FIFO, so a newcomer
  waits at most one round however deep the flood in front of it.

The queue counts what it holds, in all and per tenant, as requests enter
and leave: every arrival asks how many are queued (the caps) and every
release which band goes first, so neither walks the bands.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

from extproc.core.policies.base import BandPolicy
from extproc.core.policies.round_robin import TenantRoundRobin

Item = TypeVar("Item", bound=Hashable)


class FairQueue(Generic[Item]):
    """All requests held for one model: priority bands, each run by a band policy.

    Its counts are plain attributes, read without a call on every arrival and
    every release: ``size`` (all), ``band_sizes`` (per band) and ``tenants``
    (per tenant over every band; a tenant with none has no entry). Only the
    queue writes them.
    """

    def __init__(self, bands: int, policy: Callable[[], BandPolicy[Item]] = TenantRoundRobin) -> None:
        if bands < 1:
            raise ValueError("a queue needs at least one priority band")
        self._bands: list[BandPolicy[Item]] = [policy() for _ in range(bands)]
        self.size = 0
        self.band_sizes = [0] * bands
        self.tenants: dict[str, int] = {}

    def __len__(self) -> int:
        return self.size

    def _entered(self, band: int, tenant: str) -> None:
        self.size += 1
        self.band_sizes[band] += 1
        self.tenants[tenant] = self.tenants.get(tenant, 0) + 1

    def _left(self, band: int, tenant: str) -> None:
        self.size -= 1
        self.band_sizes[band] -= 1
        left = self.tenants[tenant] - 1
        if left:
            self.tenants[tenant] = left
        else:
            del self.tenants[tenant]

    def band_len(self, band: int) -> int:
        return self.band_sizes[band]

    def push(self, band: int, tenant: str, item: Item) -> bool:
        """Queue ``item``; whether it is ``tenant``'s first queued in ``band`` (it joins the band's backlog)."""
        policy = self._bands[band]
        first = policy.head(tenant) is None
        policy.push(tenant, item)
        self._entered(band, tenant)
        return first

    def first_band(self) -> int | None:
        """The highest band holding a request (the only one strict priority may serve), or None."""
        if self.size:
            for index, size in enumerate(self.band_sizes):
                if size:
                    return index
        return None

    def pop(self, band: int | None = None) -> tuple[int, str, Item]:
        """The next request to release: (band, tenant, item), of ``band`` (None: the first holding any). IndexError when empty."""
        index = self.first_band() if band is None else band
        if index is None or not self.band_sizes[index]:
            raise IndexError("pop from an empty FairQueue band")
        tenant, item = self._bands[index].pop()
        self._left(index, tenant)
        return index, tenant, item

    def head(self, band: int, tenant: str) -> Item | None:
        """``tenant``'s next request in ``band``, left queued (None: none)."""
        return self._bands[band].head(tenant)

    def take(self, band: int, tenant: str) -> Item | None:
        """Dequeue ``tenant``'s next request in ``band`` whatever the policy's turn (a cluster decided it)."""
        item = self._bands[band].take(tenant)
        if item is not None:
            self._left(band, tenant)
        return item

    def remove(self, band: int, tenant: str, item: Item) -> bool:
        removed = self._bands[band].remove(tenant, item)
        if removed:
            self._left(band, tenant)
        return removed

    def tenant_len(self, tenant: str) -> int:
        """Requests of ``tenant`` queued in every band."""
        return self.tenants.get(tenant, 0)

    def tenant_lengths(self, band: int) -> dict[str, int]:
        """Every tenant with requests queued in ``band``, and how many."""
        return self._bands[band].tenant_lengths()

    def charge(self, band: int, tenant: str, cost: float) -> None:
        self._bands[band].charge(tenant, cost)

    def correct(self, band: int, tenant: str, delta: float) -> None:
        self._bands[band].correct(tenant, delta)
