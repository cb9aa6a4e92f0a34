"""Whether requests got out of the queue within their TTFT objective, per class and tenant: the status page's view.

A request with a time-to-first-token objective (its band's, or its own as far
as the band trusts it) has a deadline; the core reports its slack, deadline -
now, when it leaves the queue (``RequestEvent.slack_s``). The verdict is taken
at the step that ends its time in the queue, because that part of its first
token's time is the scheduler's (the engine's prefill comes after):

* **met**: released with slack >= 0;
* **missed**: released with slack < 0, or refused (queue timeout, drain) or
  abandoned once its deadline had passed: it waited past its objective and
  never got a token from us in time;
* **neither**: refused or abandoned *before* its deadline (a queue cap at the
  door, the drain, a client that gave up early). The scheduler did not let it
  run late: it was turned away, or left, for a reason the refusal counters
  and the abandon counter already tell, so counting it as a miss would make
  the attainment move with the caps rather than with lateness. Requests
  without an objective are neither too.

A **preemption** (a released request of a preemptible band ended before its
response began, for a higher band's objective) is counted on its own: its
release was already judged, and the client's retry is a new request.

:class:`Objectives` keeps the totals since start per band and, for the last
minute, each outcome with its tenant (the client's id: the page lists the
largest tenants by name, as it does for the queue) and its slack at release.
The minute is bounded in memory (``RECENT_MAX`` outcomes per model); past that
the page's window is shorter and says how long. Prometheus has the same counts
as series (``telemetry/``), with bounded tenant labels.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

Outcome = Literal["met", "missed", "preempted"]
MET: Outcome = "met"
MISSED: Outcome = "missed"
PREEMPTED: Outcome = "preempted"

WINDOW_S = 60.0
# Outcomes kept per model for the window (about 200 bytes each, with its tenant's string): at more than
# RECENT_MAX / WINDOW_S requests per second the window covers less than a minute.
RECENT_MAX = 8192


def verdict(released: bool, slack_s: float) -> Outcome | None:
    """``met`` or ``missed`` for a request whose objective's slack was ``slack_s`` as it left the queue; None: neither.

    ``released``: it went to the engine; else it was refused or abandoned,
    which misses only once the deadline has passed (see the module docstring).
    """
    if slack_s < 0:
        return MISSED
    return MET if released else None


@dataclass(frozen=True)
class Counts:
    met: int = 0
    missed: int = 0
    preempted: int = 0


@dataclass(frozen=True)
class Recent:
    """A class's (or a tenant's) outcomes in the window, and the slack of its releases (negative: released late)."""

    met: int
    missed: int
    preempted: int
    slack_p50_s: float | None
    slack_min_s: float | None


@dataclass(frozen=True)
class TenantRecent(Recent):
    tenant: str


@dataclass(frozen=True)
class BandObjectives:
    name: str
    since_start: Counts
    recent: Recent
    # The tenants with the most outcomes in the window, ties by name; the rest summed.
    top_tenants: tuple[TenantRecent, ...]
    other: Counts
    other_tenants: int


@dataclass(frozen=True)
class ObjectivesStatus:
    # What "recent" covers: WINDOW_S, or less while the window holds RECENT_MAX outcomes.
    window_s: float
    bands: tuple[BandObjectives, ...]


class _Tally:
    """Outcomes counted, and the slacks at release seen, while a status is built."""

    __slots__ = ("counts", "slacks")

    def __init__(self) -> None:
        self.counts: dict[Outcome, int] = {MET: 0, MISSED: 0, PREEMPTED: 0}
        self.slacks: list[float] = []

    def add(self, outcome: Outcome, slack_s: float | None, n: int = 1) -> None:
        self.counts[outcome] += n
        if slack_s is not None:
            self.slacks.append(slack_s)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def recent(self) -> Recent:
        return Recent(*self._row())

    def of(self, tenant: str) -> TenantRecent:
        return TenantRecent(*self._row(), tenant=tenant)

    def _row(self) -> tuple[int, int, int, float | None, float | None]:
        c, slacks = self.counts, self.slacks
        p50, least = (statistics.median(slacks), min(slacks)) if slacks else (None, None)
        return c[MET], c[MISSED], c[PREEMPTED], p50, least


class Objectives:
    """One model's outcomes: totals per band since start, and the last minute's with tenant and slack."""

    def __init__(self, bands: Iterable[str], clock: Callable[[], float] = time.monotonic,
                 window_s: float = WINDOW_S, most: int = RECENT_MAX) -> None:
        self._clock = clock
        self._window_s = window_s
        self._totals: dict[str, dict[Outcome, int]] = {band: {MET: 0, MISSED: 0, PREEMPTED: 0} for band in bands}
        # (when, band, tenant, outcome, slack at release or None), oldest first.
        self._recent: deque[tuple[float, str, str, Outcome, float | None]] = deque(maxlen=most)

    def record(self, band: str, tenant: str, outcome: Outcome, slack_s: float | None = None) -> None:
        """One outcome; ``slack_s`` for a release (the status page's slack at release), else None."""
        self._totals[band][outcome] += 1
        now = self._clock()
        self._recent.append((now, band, tenant, outcome, slack_s))
        self._forget(now)

    def _forget(self, now: float) -> None:
        """Drop the outcomes older than the window. As they come, not only when the status is read: a page nobody
        opens kept ``most`` outcomes per model for good (1.6 MB each at the default; the soak saw it grow)."""
        recent = self._recent
        while recent and recent[0][0] < now - self._window_s:
            recent.popleft()

    def status(self, top: int) -> ObjectivesStatus:
        """The totals, and the window's outcomes per band and its ``top`` tenants (the rest summed)."""
        now = self._clock()
        self._forget(now)
        recent = self._recent
        window_s = self._window_s
        if len(recent) == recent.maxlen:
            window_s = min(window_s, now - recent[0][0])
        bands = {band: _Tally() for band in self._totals}
        tenants: dict[str, dict[str, _Tally]] = {band: {} for band in self._totals}
        for _, band, tenant, outcome, slack_s in recent:
            bands[band].add(outcome, slack_s)
            tally = tenants[band].get(tenant)
            if tally is None:
                tally = tenants[band][tenant] = _Tally()
            tally.add(outcome, slack_s)
        return ObjectivesStatus(window_s, tuple(
            self._band(band, bands[band], tenants[band], top) for band in self._totals
        ))

    def _band(self, band: str, recent: _Tally, tenants: dict[str, _Tally], top: int) -> BandObjectives:
        ranked = sorted(tenants.items(), key=lambda item: (-item[1].total, item[0]))
        shown, rest = ranked[:top], ranked[top:]
        other = _Tally()
        for _, tally in rest:
            for outcome, n in tally.counts.items():
                other.add(outcome, None, n)
        return BandObjectives(
            name=band,
            since_start=Counts(**self._totals[band]),
            recent=recent.recent(),
            top_tenants=tuple(tally.of(tenant) for tenant, tally in shown),
            other=Counts(**other.counts),
            other_tenants=len(rest),
        )
