"""Priority bands as the core sees them for one model: their limits, and how much of the engine each may use now.

The bands share the engine without sharing a ceiling (docs/policies.md). All
the band rules sit here, above the release rule, which knows nothing of bands:

* the first band may use the rule's whole allowance;
* a band below it leaves room for the bands above it: their usual demand
  (:class:`BandDemand`: what they held on average, queued or in flight, over
  the last :data:`DEMAND_WINDOW_S` or so) beyond what they hold now, and at
  least ``reserved_waiting``. So a burst of chats finds room in the engine
  however deep the lower bands' backlog, and a band nobody above uses keeps
  nothing back. A preemptible band keeps only ``reserved_waiting`` while
  preemption is on: when a higher band needs a slot, one is made for it
  (``preemption.py``), so nothing stands empty meanwhile;
* an idle-only band, while the bands above it had demand in the window, is
  released only into an *idle* engine: the estimated waiting queue is empty
  and what the engine holds is below ``share`` of its capacity (less the
  reservation) — ``max_running`` when configured, else the most requests it
  was ever seen running. Such releases are sized to free slots: the load
  estimate does not count them as waiting, and the adaptive limit keeps
  ``target_waiting`` above the engine's capacity, so they never eat the
  allowance of the bands above. With ``share`` 1 and no configured capacity
  the band also probes past the learned capacity (doubling, by at most
  ``target_waiting`` a scrape, until the engine first shows a waiting queue,
  then one request per scrape), so it finds the engine's real size; a probe
  that does not fit waits in the engine and stops the band until the queue
  is empty again. Without usable metrics (or with a rule that ignores them)
  idleness cannot be seen: the band gets the ordinary allowance less the
  reserve, at least one slot, for the bands above;
* an idle-only band alone (nothing above it in the window) is released like
  any other: into the engine's queue up to the target, so a batch load alone
  keeps the engine as busy as sending it straight would (work conservation).

Strict priority itself (only the highest band holding requests may release)
is the fair queue's (``fair_queue.py``).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from extproc.core.release.pool import Pool

# The window of the higher bands' demand (BandDemand): the time constant of its mean, the span of its peak.
DEMAND_WINDOW_S = 30.0


@dataclass(frozen=True)
class Band:
    """One band (a priority class): every setting of it the program reads, as the config resolved them.

    The config builds these straight from the file's ``bands:`` entries, so a
    new band setting is a field here and one in the file's struct. The same
    bands serve every model; what depends on the model is resolved by the
    reader (:meth:`queue_wait_s`).
    """

    name: str
    # A request still queued after this long is refused (queue_timeout); None: the model's.
    max_queue_wait_s: float | None = None
    # Requests of this band the model may hold; None: only the model's cap.
    max_queued: int | None = None
    # Released only while no higher band waits and the engine is idle.
    idle_only: bool = False
    # "Idle": the engine's waiting queue is empty and it runs fewer than this
    # share of its capacity.
    idle_running_share: float = 1.0
    # The body's `priority` for engine_priority models (vLLM: lower runs first);
    # the config's default is the band's position.
    engine_priority: int = 0
    # The time-to-first-token objective of its requests (None: none; the config's
    # default is 5 s for the first of several bands, 60 s for the middle ones).
    ttft_objective_s: float | None = None
    # How far a request's own objective (identity.ttft_headers) may tighten the
    # band's: not below this (None: a request's own objective is not trusted).
    min_ttft_objective_s: float | None = None
    # Its released requests may be ended (503 preempted) for a higher band whose
    # objective is at risk, while their response has not begun (default: the
    # lowest of several bands).
    preemptible: bool = False

    def queue_wait_s(self, model_wait_s: float) -> float:
        """How long a request of this band may stay queued for a model whose own limit is ``model_wait_s``."""
        return model_wait_s if self.max_queue_wait_s is None else self.max_queue_wait_s

    def objective_s(self, requested_s: float | None) -> float | None:
        """A request's TTFT objective: its own (``requested_s``) as far as the band trusts it, else the band's.

        A request may only tighten the band's objective, and not below
        ``min_ttft_objective_s``; without that floor its own is ignored.
        """
        if requested_s is None or self.min_ttft_objective_s is None:
            return self.ttft_objective_s
        ceiling = self.ttft_objective_s if self.ttft_objective_s is not None else math.inf
        return max(self.min_ttft_objective_s, min(requested_s, ceiling))


class BandDemand:
    """How many requests the bands above each band have had lately (queued here or in flight): their mean and peak.

    What the bands below keep free for them (their reservation) follows the
    mean instead of a hand-set number: chats that hold 2 requests on average
    have room kept for 2 (less what they hold now), a class unused for a
    while for none. The mean is a time-weighted moving average over
    :data:`DEMAND_WINDOW_S`: the peak would keep room for the largest burst
    all the time, and starved a batch flood next to steady chats (measured:
    22 of 48 batch requests timed out). Whether anyone above asked at all in
    the window (the peak) decides whether an idle-only band is held to free
    slots. Counted per band on every release, end and queueing: a few
    integer updates per request; the window's maximum is a monotone deque
    (amortised O(1)).
    """

    def __init__(self, bands: int) -> None:
        self._now = [0] * bands
        # Per band: the moving average of what the bands above it held, as of _at.
        self._mean = [0.0] * bands
        self._at = 0.0
        # Per band: (until when, demand of the bands above it), for values that held
        # until a change; decreasing in demand, so the first is the window's peak.
        self._peaks: list[deque[tuple[float, int]]] = [deque() for _ in range(bands)]

    def change(self, band: int, delta: int, now: float) -> None:
        """``band`` has ``delta`` more requests queued or in flight (a queueing, a release out of a cap, an end)."""
        self._average(now)
        above = sum(self._now[:band + 1])  # what the band below ``band`` saw above it until now
        for lower in range(band + 1, len(self._now)):
            peaks = self._peaks[lower]
            while peaks and peaks[-1][1] <= above:
                peaks.pop()
            peaks.append((now, above))
            above += self._now[lower]
        self._now[band] += delta

    def above(self, band: int) -> int:
        """What the bands above ``band`` hold now (queued or in flight)."""
        return sum(self._now[:band])

    def mean_above(self, band: int, now: float) -> float:
        """What the bands above ``band`` held on average lately (a moving average over :data:`DEMAND_WINDOW_S`)."""
        self._average(now)
        return self._mean[band]

    def _average(self, now: float) -> None:
        """Move every band's average to ``now``: what was held since the last change counts for its duration."""
        elapsed = now - self._at
        if elapsed <= 0:
            return
        keep = math.exp(-elapsed / DEMAND_WINDOW_S)
        above = 0
        for band in range(len(self._now)):
            self._mean[band] = keep * self._mean[band] + (1 - keep) * above
            above += self._now[band]
        self._at = now

    def peak_above(self, band: int, now: float) -> int:
        """The most the bands above ``band`` held at once in the last :data:`DEMAND_WINDOW_S` (now included)."""
        peaks = self._peaks[band]
        while peaks and peaks[0][0] < now - DEMAND_WINDOW_S:
            peaks.popleft()
        return max(self.above(band), peaks[0][1] if peaks else 0)


class BandAdmission:
    """How many requests of each band may go now (see the module docstring)."""

    def __init__(self, bands: tuple[Band, ...], pool: Pool, reserved_waiting: int, *, preemption: bool = False) -> None:
        self._bands = bands
        self._pool = pool
        self._reserved_waiting = reserved_waiting
        # Whether preemptible bands are preempted for the bands above (max_preemptions_per_s > 0).
        self._preemption = preemption
        self.demand = BandDemand(len(bands))

    def reconfigure(self, bands: tuple[Band, ...], reserved_waiting: int) -> None:
        """New settings for the same bands (names and order kept: the demand's history stays valid)."""
        self._bands = bands
        self._reserved_waiting = reserved_waiting

    def allowance(self, band: int, now: float) -> int:
        return max(0, self.headroom(band, now))

    def reserve(self, band: int, now: float) -> int:
        """What ``band`` leaves free for the bands above: what they held on average lately beyond what they hold now.

        At least ``reserved_waiting``; none for the first band, and none beyond
        that floor for a preemptible band (preemption makes room when a higher
        band needs it, so nothing need stand empty).
        """
        if band == 0:
            return 0
        if self._preemption and self._bands[band].preemptible:
            return self._reserved_waiting
        usual = math.floor(self.demand.mean_above(band, now) + 0.5)
        return max(self._reserved_waiting, usual - self.demand.above(band))

    def into_free_slots(self, band: int, now: float) -> bool:
        """Whether ``band`` is released only into free slots now: idle-only, while the bands above had demand lately.

        With no demand above it in the window, an idle-only band is released
        like any other (into the engine's queue up to its target), so a batch
        load alone keeps the engine as busy as sending it straight would.
        """
        return self._bands[band].idle_only and self.demand.peak_above(band, now) > 0

    def headroom(self, band: int, now: float) -> int:
        """The band's allowance before it is floored at 0 (a cluster adds it to what is in flight)."""
        rules = self._bands[band]
        if self.into_free_slots(band, now):
            return self._idle_allowance(now, rules.idle_running_share, self.reserve(band, now))
        return self._pool.headroom(now) - self.reserve(band, now)

    def _idle_allowance(self, now: float, share: float, reserve: int) -> int:
        pool, settings = self._pool, self._pool.settings
        if not pool.rule.uses_metrics or pool.degraded(now):
            return max(0, pool.allowance(now) - max(1, reserve))
        estimate = pool.estimate.now()
        if estimate.waiting > 0:
            return 0
        free = math.ceil(share * pool.capacity() - estimate.held) - reserve
        if free >= 1:
            return free
        if share < 1 or reserve or settings.max_running is not None or estimate.into_slots_since:
            return 0
        # Probe: growing (doubling, at most target_waiting a scrape, so a probe
        # that does not fit leaves no more than the target waiting) until the
        # engine first queued, then one more per scrape.
        return 1 if pool.estimate.seen_waiting else max(1, min(int(estimate.held), settings.target_waiting))
