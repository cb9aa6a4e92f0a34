"""What may go now and to whom: the seam between a model's dispatcher and whoever decides its releases.

The dispatcher tells its strategy what happened (a request queued, a release
ended, something else changed, a scrape came in) and the strategy lets
requests go through the model's :class:`Outlet` (``model_state.py`` is the
one implementation): the few questions a strategy asks of the model, and the
one release step every strategy shares. Two strategies:

* :class:`LocalRelease`: this instance decides alone. Each round pops from
  the fair queue while the first band's allowance lasts (a lower band's
  minimum share of those releases included): one call, run by the band rules
  (``bands.py``) through the model's release step; it wakes itself when a
  rate's next release falls due.
* :class:`~extproc.core.cluster.ClusterSeat`: a cluster of instances decides
  (``cluster.py``); cut off from it, the seat releases locally on its share.

The dispatcher holds one and never asks which.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from extproc.core.timers import Timer, Timers
from extproc.core.values.status import ClusterStatus

# An extra per-band limit on what may go now (a cluster seat's share), from the band and ``now``.
Limit = Callable[[int, float], int]


class Outlet(Protocol):
    """What a release strategy reads of one model, and how it lets requests go (a cluster seat needs more:
    ``cluster.ClusterOutlet``)."""

    def clock(self) -> float: ...

    def note_health(self, now: float) -> None:
        """Report endpoint health that changed since the last look (once per change)."""

    def release_round(self, now: float, limit: Limit | None) -> bool:
        """Let go what may go now, the band rules deciding how many and from which band (``bands.py``), ``limit``
        an extra per-band limit; whether requests stay held. One call per round: the model hands the strategy its
        band rules' own round, which releases through the model's one release step."""

    def next_release_in(self, now: float) -> float | None:
        """How long until the release rule lets more go by time alone (a rate); None: only an event will."""


class ReleaseStrategy(Protocol):
    def queued(self, band: int, tenant: str, first: bool, now: float) -> None:
        """A request was queued; ``first``: its tenant had nothing queued in ``band``."""

    def ended(self, band: int, tenant: str, charged: float, measured: float, now: float) -> None:
        """A released request ended, charged ``charged`` and measured at ``measured`` (costs)."""

    def changed(self, now: float) -> None:
        """Something that may let requests go changed (an endpoint up or down, a wake-up)."""

    def scraped(self, now: float) -> None:
        """A scrape's numbers reached the pool."""

    def cluster(self) -> ClusterStatus | None:
        """The seat's standing in a cluster, for the status page (None: no cluster)."""


class LocalRelease:
    """This instance decides: the dispatch loop and the band's allowance."""

    def __init__(self, outlet: Outlet, timers: Timers, limit: Limit | None = None) -> None:
        self._outlet = outlet
        self._timers = timers
        self._limit = limit
        # A wake-up when the next release falls due by time alone (a rate; no other event will come).
        self._wakeup: Timer | None = None

    def queued(self, band: int, tenant: str, first: bool, now: float) -> None:
        self.changed(now)

    def ended(self, band: int, tenant: str, charged: float, measured: float, now: float) -> None:
        self.changed(now)

    def scraped(self, now: float) -> None:
        self.changed(now)

    def cluster(self) -> ClusterStatus | None:
        return None

    def changed(self, now: float) -> None:
        """A round: pop from the fair queue while the first band's allowance lasts, each release from the band its
        shares pick (``BandAllowance.release_round``); a wake-up if requests stay held."""
        outlet = self._outlet
        outlet.note_health(now)
        if outlet.release_round(now, self._limit):
            self._schedule_wakeup(now)

    def _schedule_wakeup(self, now: float) -> None:
        if self._wakeup is not None:
            return
        due = self._outlet.next_release_in(now)
        if due is None:
            return

        def wake() -> None:
            self._wakeup = None
            self.changed(self._outlet.clock())

        self._wakeup = self._timers.at(now + due, wake)
