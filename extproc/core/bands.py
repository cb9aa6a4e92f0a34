"""Priority bands as the core sees them for one model: their settings, and how much of the engine each may use now.

Work conservation comes first: a band below the first is held back only by
what the bands above it need *now*, and never from a slot the engine has free.
All the band rules sit here, above the release rule, which knows nothing of
bands:

* the first band may use the rule's whole allowance;
* a band below it is lent the rule's whole allowance while no band above it
  has work now: none of their requests is held here and none is arriving
  (:class:`BandActivity`: a decaying count of arrivals over a couple of
  seconds, not an average of what they held);
* while a band above has work now, a lower band still gets every *free slot*
  of the engine (``Pool.free_slots``: its capacity less what it holds by the
  load estimate, none while it queues); what it leaves to the bands above is
  ``reserved_waiting`` of the engine's queue room beyond those slots, so a
  chat finds a place in the engine's queue without waiting for a slot;
* an idle-only band, while a band above has work now, goes only into free
  slots (never into the engine's queue), up to ``idle_running_share`` of the
  engine's capacity — ``max_running`` when configured, else the most
  requests it was ever seen running. With ``share`` 1 and no configured
  capacity it also probes past the learned capacity (doubling, by at most
  ``target_waiting`` a scrape, until the engine first shows a waiting queue,
  then one request per scrape), so it finds the engine's real size. Without
  usable metrics (or with a rule that ignores them) free slots cannot be
  seen: the band gets the ordinary allowance less ``reserved_waiting``, at
  least one slot;
* an idle-only band with nothing above it working is released like any
  other, into the engine's queue up to the target, so a batch load alone
  keeps the engine as busy as sending it straight would.

Strict priority (only the highest band holding requests may release) is the
fair queue's (``fair_queue.py``), with one exception kept here: a lower band
with requests held gets at least its *minimum share* of the releases while a
band above it takes the rest (:class:`BandShares`), so under sustained
top-class load no band but an idle-only one waits without bound.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from extproc.core.release.pool import Pool

# The time constant of a band's arrival count: it "arrives now" while the count is at least ARRIVING_COUNT
# (one request within the last ~1.4 s, or a steady stream of one every 2 s or more often).
ARRIVING_S = 2.0
ARRIVING_COUNT = 0.5
# The time constant of the arrival counts that give a band its default minimum share (its share of arrivals).
SHARE_S = 60.0
# The most a default (arrival-share) minimum share takes: the bands above keep at least the rest.
MAX_DEFAULT_SHARE = 0.5


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
    # Released only into free slots while a higher band has work now.
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
    # The least share of releases it gets while it has requests held and a band above
    # takes the rest (BandShares). None: its share of all recent arrivals (what FIFO
    # would give it), at most MAX_DEFAULT_SHARE; 0: strict priority (the config's
    # default for an idle-only band).
    min_share: float | None = None

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


class BandActivity:
    """How each band's requests arrive: whether they arrive now, and each band's share of arrivals lately.

    Two exponentially decaying counts of arrivals per band: over
    :data:`ARRIVING_S` (a band "arrives now" while its count is at least
    :data:`ARRIVING_COUNT`) and over :data:`SHARE_S` (the default minimum
    share). What the bands below keep for a band follows what it does now, not
    an average of what it held: an average kept slots empty for chats that had
    stopped coming, and a busy hour's average reserved the whole engine.
    A few float updates per arrival.
    """

    def __init__(self, bands: int) -> None:
        self._recent = [0.0] * bands
        self._lately = [0.0] * bands
        self._at = 0.0

    def arrived(self, band: int, now: float) -> None:
        self._decay(now)
        self._recent[band] += 1.0
        self._lately[band] += 1.0

    def arriving(self, band: int, now: float) -> bool:
        """Whether requests of ``band`` arrive now (one in the last ~1.4 s, or one every 2 s or more often)."""
        self._decay(now)
        return self._recent[band] >= ARRIVING_COUNT

    def arrival_share(self, band: int, now: float) -> float:
        """``band``'s share of all the requests that arrived lately (0 when none did): what FIFO would serve of it."""
        self._decay(now)
        total = sum(self._lately)
        return self._lately[band] / total if total > 0 else 0.0

    def _decay(self, now: float) -> None:
        elapsed = now - self._at
        if elapsed <= 0:
            return
        recent, lately = math.exp(-elapsed / ARRIVING_S), math.exp(-elapsed / SHARE_S)
        self._recent = [count * recent for count in self._recent]
        self._lately = [count * lately for count in self._lately]
        self._at = now


class BandShares:
    """Which band's request goes next: the first band holding requests, but for the minimum shares of the bands below.

    A credit per band below the first that holds requests: each release made
    while it waits adds its share, and a band whose credit reaches 1 goes
    next (the highest such band), paying 1. So a band that holds requests
    throughout gets at least ``share x releases`` of them, less one, however
    busy the bands above (stride scheduling with strict priority for the
    rest, as Kubernetes API Priority and Fairness guarantees each level its
    nominal seats). A band with nothing held keeps no credit: a share is not
    saved up for later.
    """

    def __init__(self, bands: tuple[Band, ...], activity: BandActivity) -> None:
        self._bands = bands
        self._activity = activity
        self._credit = [0.0] * len(bands)

    def reconfigure(self, bands: tuple[Band, ...]) -> None:
        self._bands = bands

    def share(self, band: int, now: float) -> float:
        """The least share of releases ``band`` gets while it holds requests and a band above takes the rest."""
        configured = self._bands[band].min_share
        if configured is not None:
            return configured
        return min(MAX_DEFAULT_SHARE, self._activity.arrival_share(band, now))

    def pick(self, first: int, held: Callable[[int], int], now: float) -> int:
        """The band whose request goes next, given the first band holding any and how many each holds."""
        chosen = first
        for band in range(first + 1, len(self._bands)):
            if not held(band):
                self._credit[band] = 0.0
                continue
            self._credit[band] += self.share(band, now)
            if chosen == first and self._credit[band] >= 1.0:
                chosen = band
        if chosen != first:
            self._credit[chosen] -= 1.0
        return chosen


class BandAdmission:
    """How many requests of each band may go now, and which band goes next (see the module docstring)."""

    def __init__(self, bands: tuple[Band, ...], pool: Pool, reserved_waiting: int, held: Callable[[int], int]) -> None:
        self._bands = bands
        self._pool = pool
        self._reserved_waiting = reserved_waiting
        # How many requests each band holds queued here (the fair queue's count).
        self._held = held
        self.activity = BandActivity(len(bands))
        self.shares = BandShares(bands, self.activity)

    def reconfigure(self, bands: tuple[Band, ...], reserved_waiting: int) -> None:
        """New settings for the same bands (names and order kept: their arrival counts stay valid)."""
        self._bands = bands
        self._reserved_waiting = reserved_waiting
        self.shares.reconfigure(bands)

    def arrived(self, band: int, now: float) -> None:
        """A request of ``band`` was queued."""
        self.activity.arrived(band, now)

    def pick(self, first: int, now: float) -> int:
        """The band whose request goes next (:class:`BandShares`)."""
        return self.shares.pick(first, self._held, now)

    def share(self, band: int, now: float) -> float:
        """``band``'s least share of the releases while a band above takes the rest (:class:`BandShares`)."""
        return self.shares.share(band, now)

    def wanted_above(self, band: int, now: float) -> bool:
        """Whether a band above ``band`` has work now: requests held here, or arriving."""
        return any(self._held(above) or self.activity.arriving(above, now) for above in range(band))

    def allowance(self, band: int, now: float) -> int:
        return max(0, self.headroom(band, now))

    def into_free_slots(self, band: int, now: float) -> bool:
        """Whether ``band`` goes only into free slots now: idle-only, while a band above has work now."""
        return self._bands[band].idle_only and self.wanted_above(band, now)

    def headroom(self, band: int, now: float) -> int:
        """The band's allowance before it is floored at 0 (a cluster adds it to what is in flight)."""
        room = self._pool.headroom(now)
        if band == 0 or not self.wanted_above(band, now):
            return room  # nobody above needs anything now: all of it is lent
        if self._bands[band].idle_only:
            return self._idle_allowance(now, self._bands[band].idle_running_share)
        # Every free slot goes, whatever is reserved; of the engine's queue room, reserved_waiting is kept.
        return min(room, max(self._pool.free_slots(now), room - self._reserved_waiting))

    def _idle_allowance(self, now: float, share: float) -> int:
        pool, settings = self._pool, self._pool.settings
        if not pool.rule.uses_metrics or pool.degraded(now):
            return max(0, pool.allowance(now) - max(1, self._reserved_waiting))
        estimate = pool.estimate.now()
        if estimate.waiting > 0:
            return 0
        free = math.ceil(share * pool.capacity() - estimate.held)
        if free >= 1:
            return free
        if share < 1 or settings.max_running is not None or estimate.into_slots_since:
            return 0
        # Probe: growing (doubling, at most target_waiting a scrape, so a probe
        # that does not fit leaves no more than the target waiting) until the
        # engine first queued, then one more per scrape.
        return 1 if pool.estimate.seen_waiting else max(1, min(int(estimate.held), settings.target_waiting))
