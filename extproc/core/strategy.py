"""What may go now and to whom: the seam between a model's dispatcher and whoever decides its releases.

The dispatcher tells its strategy what happened (a request queued, a release
ended, something else changed, a scrape came in) and the strategy lets
requests go through the model's :class:`Outlet` (``model_state.py`` is the
one implementation): the few questions a strategy asks of the model, and the
one release step every strategy shares. Two strategies:

* :class:`LocalRelease`: this instance decides alone. It pops from the fair
  queue while the first band's allowance lasts (a lower band's minimum share
  of those releases included, ``bands.py``), and wakes itself when a rate's
  next release falls due.
* :class:`~extproc.core.cluster.ClusterSeat`: a cluster of instances decides
  (``cluster.py``); cut off from it, the seat releases locally on its share.

The dispatcher holds one and never asks which.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from extproc.core.status import ClusterStatus
from extproc.core.timers import Timer, Timers

# An extra per-band limit on what may go now (a cluster seat's share), from the band and ``now``.
Limit = Callable[[int, float], int]


class Outlet(Protocol):
    """What a release strategy reads of one model, and how it lets a request go (a cluster seat needs more:
    ``cluster.ClusterOutlet``)."""

    @property
    def queued(self) -> int:
        """Requests held now."""

    def clock(self) -> float: ...

    def first_band(self) -> int | None:
        """The highest band holding a request (the only one strict priority serves), or None."""

    def pick(self, first: int, now: float) -> int:
        """The band whose request goes next, ``first`` being the highest holding any (``bands.py``, ``BandShares``)."""

    def allowance(self, band: int, now: float) -> int:
        """How many requests of ``band`` may go now (the band rules above the release rule)."""

    def free_slots(self, now: float) -> int:
        """Slots the engines have free now by the load estimate (``Pool.free_slots``)."""

    def next_release_in(self, now: float) -> float | None:
        """How long until the release rule lets more go by time alone (a rate); None: only an event will."""

    def release_next(self, band: int, now: float, *, free: bool) -> bool:
        """Release the request the band's policy picks; False if its client had already left.

        ``free``: the engine has a slot free for it by the load estimate (the
        strategy counts them down from :meth:`free_slots`, read once a round).
        """

    def note_health(self, now: float) -> None:
        """Report endpoint health that changed since the last look (once per change)."""


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
        if self._outlet.queued == 1:
            self._alone(band, now)
        else:
            self.changed(now)

    def _alone(self, band: int, now: float) -> None:
        """The round :meth:`changed` makes when the request just queued is the only one held (most arrivals).

        Its band is the first holding any and the round ends once it left (or
        its client had): one allowance, one release, no wake-up to schedule
        but while it stays. The same calls in the same order as the loop's
        first pass, without the loop's rereads of the queue.
        """
        outlet = self._outlet
        outlet.note_health(now)
        if self._allowance(band, now) <= 0:
            self._schedule_wakeup(now)
            return
        free = outlet.free_slots(now)
        outlet.release_next(outlet.pick(band, now), now, free=free > 0)

    def ended(self, band: int, tenant: str, charged: float, measured: float, now: float) -> None:
        self.changed(now)

    def scraped(self, now: float) -> None:
        self.changed(now)

    def cluster(self) -> ClusterStatus | None:
        return None

    def changed(self, now: float) -> None:
        """Pop from the fair queue while the first band's allowance lasts, each release from the band its shares pick."""
        outlet = self._outlet
        outlet.note_health(now)
        allowance, allowance_band = 0, None
        free = None  # the engine's free slots, read at the first release of the round
        while (first := outlet.first_band()) is not None:
            if first != allowance_band:  # a higher band ran empty: ask again for this one
                allowance, allowance_band = self._allowance(first, now), first
            if allowance <= 0:
                break
            if free is None:
                free = outlet.free_slots(now)
            if outlet.release_next(outlet.pick(first, now), now, free=free > 0):
                allowance -= 1
                free -= 1
        self._schedule_wakeup(now)

    def _allowance(self, band: int, now: float) -> int:
        allowance = self._outlet.allowance(band, now)
        return allowance if self._limit is None else min(allowance, self._limit(band, now))

    def _schedule_wakeup(self, now: float) -> None:
        if not self._outlet.queued or self._wakeup is not None:  # asked first: an end with nothing queued stops here
            return
        due = self._outlet.next_release_in(now)
        if due is None:
            return

        def wake() -> None:
            self._wakeup = None
            self.changed(self._outlet.clock())

        self._wakeup = self._timers.at(now + due, wake)
