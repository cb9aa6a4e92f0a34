"""Priority bands as the core sees them for one model: their settings, and how much of the engine each may use now.

Work conservation comes first: a band below the first is held back only by
what the bands above it need *now*. The invariant: no slot the engine has free
stays free while a request is held, except the reserve an idle-only band
leaves free for a band above it that has work now, at most half the engine.
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
  chat finds a place in the engine's queue without waiting for a slot. It
  keeps no free slot for them: it is entitled to the engine, not only to
  what nobody else needs, and the bands above keep their place by strict
  priority, ``reserved_waiting`` and preemption for an objective at risk;
* an idle-only band, while a band above has work now, goes only into free
  slots (never into the engine's queue), and not into all of them: it leaves
  a reserve free for the bands above (:class:`Reservation`), so a request of
  theirs finds a slot at once and the engine's steps, which lengthen with
  every sequence in them, stay short; and it runs at most
  ``idle_running_share`` of the engine's capacity (the operator's cap) —
  ``max_running`` when configured, else the most requests it was ever seen
  running. The reserve is lent again the moment the bands above stop
  arriving (a wake-up then, :meth:`BandAllowance.next_change_in`). With
  ``share`` 1, no configured capacity and the engine full by the capacity
  learned so far, it probes past it (doubling, by at most ``target_waiting``
  a scrape, until the engine first shows a waiting queue, then one request
  per scrape), so it finds the engine's real size. Without
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
# While a band above an idle-only band has work now, the idle-only band leaves at least this share of the engine's
# capacity free for the bands above, beyond what they hold. An engine's step lengthens with every sequence in it, and a
# first token waits for about two steps: a chat beside a full engine started 1.12-1.13x later (p99) than on an idle one
# (the simulator's 16 sequences of 20 ms steps, 0.5 ms more a sequence), 1.07-1.10x with this share (6 of 16) kept
# free; 2 slots of 16 kept free gave 1.11-1.12x, 5 of 16 up to 1.10x (docs/batches.md). To the nearest slot: 1 of 4.
RESERVE_SHARE = 0.35
# More when the bands above were seen to hold more at once lately (enough for them to go back to that peak, and one
# more), up to this share of the capacity: the idle-only band keeps the rest while they have work.
MAX_RESERVE_SHARE = 0.5
# The time constant of the decaying peak of what the bands above an idle-only band held at once.
PEAK_S = 10.0
# A wake-up for a band that stops arriving comes this much after the moment, so that it has stopped by then.
_AFTER_S = 1e-6

# The model's one release step (``model_state.py``): a request of the band leaves the queue at ``now``, ``free``: into
# a free slot by the load estimate; False if its client had already left (nothing was released).
Release = Callable[[int, float, bool], bool]


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
    # The least share of the engine's capacity an idle-only band leaves free for
    # the bands above while one has work now (Reservation): their first tokens
    # against the band's throughput while they come.
    reserve_share: float = RESERVE_SHARE
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

    def stops_arriving_in(self, band: int, now: float) -> float | None:
        """How long until ``band`` no longer arrives now if nothing more comes; None: it does not arrive now."""
        self._decay(now)
        count = self._recent[band]
        return ARRIVING_S * math.log(count / ARRIVING_COUNT) if count >= ARRIVING_COUNT else None

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


class Reservation:
    """The free slots an idle-only band leaves to the bands above it while one of them has work now.

    Kubernetes API Priority and Fairness keeps part of a level's seats
    unlendable (``lendablePercent``); here the part kept follows what the
    bands above were seen to need: :data:`RESERVE_SHARE` of the engine's
    capacity, or enough for them to go back to the most they held at once
    lately (a peak decaying over :data:`PEAK_S`) and one more, whichever is
    more; at least one slot, at most :data:`MAX_RESERVE_SHARE` of the
    capacity. The slots are free ones, beyond those the bands above hold: a
    request of theirs that arrives finds one at once, whether or not a lent
    slot could be taken back for it (a downgraded request's stream cannot
    be), and the engine's step is not full. A few float updates per release
    and end.
    """

    def __init__(self, bands: int) -> None:
        self._in_flight = [0] * bands
        # Per band: the decaying peak of what the bands above it held at once.
        self._peak = [0.0] * bands
        self._at = 0.0

    def released(self, band: int, now: float) -> None:
        self._in_flight[band] += 1
        self._observe(now)

    def finished(self, band: int, now: float) -> None:
        self._in_flight[band] -= 1
        self._observe(now)

    def above(self, band: int) -> int:
        """Requests of the bands above ``band`` released and not finished."""
        return sum(self._in_flight[:band])

    def below(self, band: int) -> int:
        """Requests of the bands below ``band`` released and not finished."""
        return sum(self._in_flight[band + 1:])

    def slots(self, band: int, capacity: float, share: float = RESERVE_SHARE) -> int:
        """The free slots kept for the bands above ``band`` while one has work, on an engine of ``capacity``.

        It changes only as requests are released and end (the peak is
        decayed then), never by time alone: each change is an event the
        dispatcher acts on, so the idle-only band is never left waiting
        for a slot a lapse of time has freed.
        """
        most = max(1, math.floor(MAX_RESERVE_SHARE * capacity))
        back_to_peak = math.ceil(self._peak[band]) + 1 - self.above(band)
        kept = math.floor(share * capacity + 0.5)  # to the nearest slot
        return min(most, max(1, kept, back_to_peak))

    def _observe(self, now: float) -> None:
        decay = math.exp(-(now - self._at) / PEAK_S) if now > self._at else 1.0
        self._at = max(self._at, now)
        above = 0
        for band, held in enumerate(self._in_flight):
            self._peak[band] = max(float(above), self._peak[band] * decay)
            above += held


class BandAllowance:
    """How many requests of each band may go now, and which band goes next (see the module docstring)."""

    def __init__(self, bands: tuple[Band, ...], pool: Pool, reserved_waiting: int, held: Callable[[int], int],
                 firm: Callable[[int], int] | None = None) -> None:
        self._bands = bands
        self._pool = pool
        self._reserved_waiting = reserved_waiting
        # How many requests each band holds queued here (the fair queue's count), and how many of them are firm:
        # once released they keep their slot to the end (a stream, a retry, a band that is not preemptible).
        self._held = held
        self._firm = firm or held
        self.activity = BandActivity(len(bands))
        self.shares = BandShares(bands, self.activity)
        self.reservation = Reservation(len(bands))
        # The engine orders its waiting queue by the band's priority (vLLM's --scheduling-policy priority, with the
        # band's engine_priority in each body): a request of a lower band waiting in it is behind every higher one.
        self.priority_queue = False

    def reconfigure(self, bands: tuple[Band, ...], reserved_waiting: int) -> None:
        """New settings for the same bands (names and order kept: their arrival counts stay valid)."""
        self._bands = bands
        self._reserved_waiting = reserved_waiting
        self.shares.reconfigure(bands)

    def arrived(self, band: int, now: float, requested_s: float | None = None,
                model_wait_s: float = math.inf) -> tuple[float | None, float]:
        """A request of ``band`` is queued: counted as arriving; its TTFT objective (its own, ``requested_s``, as far
        as the band trusts it: :meth:`Band.objective_s`) and how long it may stay queued (:meth:`Band.queue_wait_s`,
        the model's limit ``model_wait_s``)."""
        self.activity.arrived(band, now)
        rules = self._bands[band]
        return rules.objective_s(requested_s), rules.queue_wait_s(model_wait_s)

    def released(self, band: int, now: float) -> None:
        """A request of ``band`` was released to the engine outside :meth:`release_round` (a cluster's grant)."""
        self.reservation.released(band, now)

    def finished(self, band: int, now: float) -> None:
        """A released request of ``band`` is over (it ended, or was preempted)."""
        self.reservation.finished(band, now)

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

    def next_change_in(self, now: float) -> float | None:
        """How long until an idle-only band holding requests is lent the reserve by time alone (None: only an event
        changes it): the moment its bands above, none of them holding requests, stop arriving."""
        for band, rules in enumerate(self._bands):
            if not rules.idle_only or not self._held(band) or any(self._held(above) for above in range(band)):
                continue
            lapses = [lapse for above in range(band) if (lapse := self.activity.stops_arriving_in(above, now)) is not None]
            if lapses:
                return max(lapses) + _AFTER_S
        return None

    def into_free_slots(self, band: int, now: float) -> bool:
        """Whether ``band`` goes only into free slots now: idle-only, while a band above has work now, or while it
        holds streams (a stream queued in the engine cannot be taken back for a request above that comes later).

        Even in an engine that orders its queue by priority: what it queued there would take the next slot that
        frees before a request of the bands above released for it arrives (an engine takes requests in a
        moment after they are sent), and the waiting it showed would cut the gate's limit for the bands above.
        """
        return self._bands[band].idle_only and (self._firm(band) > 0 or self.wanted_above(band, now))

    def release_round(self, now: float, limit: Callable[[int, float], int] | None, release: Release) -> bool:
        """Let go what may go now; whether requests stay held (a wake-up may then be due: ``strategy.py``).

        Pops while the first band's allowance lasts (``limit``: a further limit per band, a cluster seat's share),
        each release from the band its shares pick, through ``release`` (the model's one release step,
        ``model_state.py``: False if the request's client had already left). The strategy asks for the whole
        round in one call, and it runs here, where the allowance, the shares and the queue's counts (``held``) are.
        """
        first = self._first()
        if first is None:
            return False
        room = self._pool.room(now)
        free = room[1]  # the engine's free slots, read once a round
        allowance, allowance_band = self._limited(first, now, limit, room), first
        while allowance > 0:
            band = self.pick(first, now)
            if release(band, now, free > 0):
                self.reservation.released(band, now)
                allowance -= 1
                free -= 1
            first = self._first()
            if first is None:
                return False
            if first != allowance_band:  # a higher band ran empty: ask again for this one
                allowance, allowance_band = self._limited(first, now, limit), first
        return True

    def _first(self) -> int | None:
        """The highest band holding requests (the only one strict priority serves), or None."""
        held = self._held
        for band in range(len(self._bands)):
            if held(band):
                return band
        return None

    def _limited(self, band: int, now: float, limit: Callable[[int, float], int] | None,
                 room: tuple[int, int] | None = None) -> int:
        allowance = max(0, self.headroom(band, now, room))
        return allowance if limit is None else min(allowance, limit(band, now))

    def headroom(self, band: int, now: float, room: tuple[int, int] | None = None) -> int:
        """The band's allowance before it is floored at 0 (a cluster adds it to what is in flight); ``room``: the
        pool's headroom and free slots, where the caller asked for both already (``Pool.room``)."""
        pool_room, free = (self._pool.headroom(now), None) if room is None else room
        room_now = pool_room + self.passed(band)
        return room_now if band == 0 else self._below_first(band, now, room_now, free)

    def _below_first(self, band: int, now: float, room: int, free: int | None) -> int:
        """:meth:`headroom` of a band below the first, whose pool room (``passed`` included) is ``room``."""
        above = self.wanted_above(band, now)
        if self._bands[band].idle_only and (above or self._firm(band) > 0):
            return self._idle_allowance(band, now, above)
        if not above:
            return room  # nobody above needs anything now: all of it is lent
        if self.priority_queue:
            return room  # what it queues in the engine waits behind whatever comes above
        # Every free slot goes, whatever is reserved; of the engine's queue room, reserved_waiting is kept.
        return min(room, max(self._pool.free_slots(now) if free is None else free, room - self._reserved_waiting))

    def passed(self, band: int) -> int:
        """In an engine whose queue is ordered by priority: how many of what it queues a request of ``band`` would
        pass, so they do not count against it. Those are of the bands below, and the engine takes its waiting
        requests highest band first, so what waits is theirs first: the engine's queue, at most the bands below's
        requests in flight."""
        if not self.priority_queue or band == len(self._bands) - 1:
            return 0
        below = self.reservation.below(band)
        return int(min(self._pool.load_now().waiting, below)) if below else 0

    def reserve(self, band: int) -> int:
        """The free slots idle-only ``band`` keeps for the bands above while one has work (:class:`Reservation`)."""
        return self.reservation.slots(band, self._pool.capacity(), self._bands[band].reserve_share)

    def _idle_allowance(self, band: int, now: float, above: bool) -> int:
        """An idle-only band's free slots: while a band above has work now (``above``), less its reserve and within
        its share; else (it holds streams) all of them."""
        pool, settings = self._pool, self._pool.settings
        if not pool.uses_metrics or pool.degraded(now):
            return max(0, pool.allowance(now) - (max(1, self._reserved_waiting) if above else 0))
        estimate = pool.load_now()
        if estimate.waiting > 0:
            return 0
        share = self._bands[band].idle_running_share if above else 1.0
        capacity = pool.capacity()
        room = math.ceil(share * capacity - estimate.held)
        firm = self._firm(band) > 0
        # Work that can be taken back keeps nothing free: a request above that needs its slot ends it (preemption.py).
        reserve = self.reserve(band) if firm and above else 0
        free = min(room, math.ceil(capacity - estimate.held) - reserve)
        if free >= 1:
            return free
        if room >= 1 or share < 1 or settings.max_running is not None or estimate.into_slots_since:
            return 0
        # Probe: growing (doubling, at most target_waiting a scrape, so a probe
        # that does not fit leaves no more than the target waiting) until the
        # engine first queued, then one more per scrape; streams only until then
        # (one that queues cannot be taken back for a request above).
        if pool.seen_waiting:
            return 0 if firm else 1
        return max(1, min(int(estimate.held), settings.target_waiting))
