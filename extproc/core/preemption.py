"""Which released request of a lower band to take back, and when, so a higher band's priority holds inside the engine.

Once a request is inside the engine it keeps its slot until it finishes, and
vLLM does not preempt a running request for a higher priority when it is
short of slots (only when KV blocks run out). So an interactive request that
arrives while lower work fills the engine waits for some of it to finish.
The gateway can end a request itself while its response has not begun: its
ext_proc stream is still open, Envoy answers the client our JSON 503
``preempted`` (with ``Retry-After``) and resets the upstream request, which
the engine aborts at once, freeing the slot. A stream's response begins as
the engine accepts it; an answer that comes whole (a batch line, any
non-streamed request) has not begun until it completes.

The rules, in order:

* **A request in need.** A request of a band with an objective that needs a
  place in the engine: queued here because the gate is full, or released
  into an engine with no free slot.
* **What is cheap is taken back at once.** A request of an idle-only band
  released into the engine's queue while it had the engine to itself
  (:attr:`Place.QUEUED`) may still wait there, ahead of the request in need
  in an engine that serves its queue in arrival order: for the first need,
  as many of them as the engine queues ahead of it are ended now, whatever
  the slack and the rate. They have made no progress, so nothing is lost but
  their client's second (``Retry-After: 1``). Otherwise one idle-only
  request running in a slot lent to it (:attr:`Place.LENT`) is ended now if
  it has run for at most a :data:`CHEAP` part of what the request in need is
  expected to wait for a slot: the take-back saves at least twice the engine
  time it throws away. Neither in an engine that orders its queue by
  priority: the request in need passes what waits there, and a slot freed
  early goes to that before the need reaches the engine.
* **Other work in progress only for an objective at risk.** A request
  running in the engine has cost its prefill and every token since; ending it
  throws that away. So beyond the cheap ones it is ended only for a request
  in need that is at risk: its deadline comes sooner than the engine is
  expected to free a slot by itself for it, ``ahead + 1`` times the recent
  interval between completions (measured; while nothing completes, the time
  since the last completion stands in for it). Nobody at risk, nothing more
  is preempted: a slot lent to a lower band is reclaimed as it drains, as
  Kubernetes API Priority and Fairness reclaims borrowed seats. One victim
  per request at risk; another only if it is still waiting and at risk
  :data:`AGAIN_AFTER_S` later (in an engine that serves its queue in arrival
  order, requests released before it may stand ahead of it). A request a
  slot was taken back for waits as long before it is a need again.
* **The victim wastes least.** Among the requests in flight of a preemptible
  band below the request in need whose answer comes whole (a stream begins as
  the engine accepts it, and a live stream is never cut) and has not begun,
  the one released last: the least progress. A different tenant than the
  last victim when there is one, so one tenant does not absorb every
  preemption.
* **Never twice.** A request that says it is a retry (the OpenAI SDKs send
  ``x-stainless-retry-count``) is never a victim: a preempted request comes
  back as such and then runs to the end. Each request is taken back at most
  once, and its client sees one 503 ``preempted`` at most.
* **Watched only while it may be needed.** A victim's stream asks Envoy for
  its response's headers (that is how it learns the response began): one
  more message each way, the hop's largest cost. A request of an idle-only
  band is always watched (it is taken back cheaply, for any need); one of a
  band that is not idle-only is taken back only for an objective at risk, so
  it is watched only while a band above it with an objective has had an
  arrival in the last :data:`WATCH_S`. A class alone on its model (or whose
  classes above have been quiet for that long) pays nothing for preemption.
* **Bounded rate.** For objectives at risk, at most ``max_preemptions_per_s``
  (a token bucket of that rate, holding at most one second's worth); 0 turns
  preemption off, queued places included.

Every take-back is reported with the engine time it threw away (the time
since its release: ``extproc_preempted_occupancy_seconds_total``), so its cost is
counted, not guessed.

The book (:class:`Preemption`) is the one place that knows who may be
ended and who waits for a slot; the model's state (``model_state.py``) tells
it of every release, response and end, and ends the victims it names.
Pure: time is passed in.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable
from dataclasses import dataclass

from extproc.core.held import Held

# How much one new interval moves the measured interval between completions.
_GAP_WEIGHT = 0.2
# After a victim was ended for a request, how long before it may need another: long
# enough for the engine to abort it and for a scrape to show it (real vLLM shows a
# change 50-400 ms late), so one slot freed is not mistaken for none.
AGAIN_AFTER_S = 1.0
# How long after a band's last arrival with an objective the releases below it are watched: longer than most
# requests run, so what was released in a quiet spell above is rarely still running when the class above returns.
WATCH_S = 60.0


class Place(enum.Enum):
    """Where a released request of a preemptible band went, which says what taking it back costs."""

    OWN = "own"  # a band that is not idle-only: its slot is its own, taken back only for an objective at risk
    LENT = "lent"  # idle-only, into a free slot lent while nobody above needed it: taken back when that is cheap
    QUEUED = "queued"  # idle-only, into the engine's queue while it had the engine to itself: it may still wait there


ANY = (Place.OWN, Place.LENT, Place.QUEUED)
IDLE = (Place.LENT, Place.QUEUED)
# A take-back of work in progress must save the request in need at least this many times the engine time it throws
# away: a lent request is ended at once only if it has run for at most 1 / CHEAP of the need's expected wait.
CHEAP = 2.0


@dataclass(frozen=True)
class Need:
    """A higher-band request waiting for a slot (none was made for it yet), its deadline, and how many wait before it."""

    held: Held
    deadline: float
    ahead: int


class Preemption:
    """One model's preemption book: the preemptible requests in flight, the higher ones waiting in the engine, the decision."""

    def __init__(self, rate_per_s: float) -> None:
        self._rate = rate_per_s
        # Read as attributes: every release and every event asks whether there is anything to do.
        self.enabled = rate_per_s > 0
        self._tokens = min(1.0, rate_per_s)
        self.filled_at: float | None = None  # when the bucket was last filled (None: not started)
        # Released, response not begun, not a retry: in release order (the last is the youngest).
        self._victims: dict[Held, Place] = {}
        # Released requests of non-preemptible bands with an objective that went into an
        # engine without a free slot: they may be waiting in it (their needs).
        self.waiting_above: dict[Held, None] = {}  # read as an attribute, written here only
        self._last_tenant: str | None = None
        # The measured interval between completions, and when the last one came.
        self._gap_s: float | None = None
        self._last_end: float | None = None
        # By band: when a request with an objective last arrived (what makes the releases below it worth watching).
        self._needed_at: dict[int, float] = {}

    @property
    def candidates(self) -> int:
        """Preemptible requests in flight whose response has not begun."""
        return len(self._victims)

    def arrived(self, band: int, now: float, objective_s: float | None) -> None:
        """A request arrived in ``band``: with an objective, the releases below it are watched for a while."""
        if objective_s is not None:
            self._needed_at[band] = now

    def _place(self, band: int, idle_only: bool, queued: bool, now: float) -> Place | None:
        """Where a release of a preemptible ``band`` goes as a victim to be (``queued``: into an engine queue served in
        arrival order); None while it is not worth its stream's watch (only an objective at risk could take it back,
        and no band above with an objective had an arrival for :data:`WATCH_S`)."""
        if idle_only:
            return Place.QUEUED if queued else Place.LENT
        since = now - WATCH_S
        return Place.OWN if any(above < band and at >= since for above, at in self._needed_at.items()) else None

    def released(self, held: Held, now: float, place: Place) -> None:
        """``held``, of a preemptible band and not a retry, went to the engine: it may be ended later."""
        if self._last_end is None:
            self._last_end = now
        self._victims[held] = place

    def note_release(self, held: Held, now: float, victim: tuple[bool, bool] | None, engine_full: bool) -> Place | None:
        """What a release means here, in one call: a victim to be, where it went (``victim``: whether its band is
        idle-only and whether it went into an engine queue served in arrival order; None: it cannot be one), if worth
        its stream's watch (None: not); and a request with an objective (``held``'s) that went into an ``engine_full``
        with none free may wait there."""
        place = None if victim is None else self._place(held.request.band, *victim, now)
        if place is not None:
            self.released(held, now, place)
        if engine_full and held.ttft_objective_s is not None and self._victims:
            self.waits_in_engine(held)
        return place

    def waits_in_engine(self, held: Held) -> None:
        """``held``, with an objective, went into an engine without a free slot: it may wait there for one."""
        self.waiting_above[held] = None

    def started(self, held: Held) -> None:
        """Its response began: Envoy can no longer answer for it, and it waits for nothing."""
        self._victims.pop(held, None)
        self.waiting_above.pop(held, None)

    def ended(self, held: Held, now: float) -> None:
        """A released request ended by itself (whatever the outcome): measure the interval between completions."""
        self._victims.pop(held, None)
        self.waiting_above.pop(held, None)
        if self._last_end is not None:
            gap = now - self._last_end
            self._gap_s = gap if self._gap_s is None else self._gap_s + _GAP_WEIGHT * (gap - self._gap_s)
        self._last_end = now

    def expected_wait_s(self, ahead: int, now: float) -> float:
        """How long a request with ``ahead`` others before it is expected to wait for a slot freed by a completion."""
        since = 0.0 if self._last_end is None else now - self._last_end
        gap = max(self._gap_s or 0.0, since)
        return (ahead + 1) * gap

    def at_risk(self, need: Need, now: float) -> bool:
        return need.deadline - now < self.expected_wait_s(need.ahead, now)

    def needs(self, engine_full: bool, engine_waiting: float, queued: Iterable[Held], now: float) -> list[Need]:
        """The higher-band requests with an objective that wait for a slot, most urgent first.

        Those released into an engine without a free slot while it still
        queues (``engine_full``: none is free now, so whoever was released
        runs), and those ``queued`` here in a band above the lowest preemptible
        one (each band's tenants' heads). ``engine_waiting``: what the engine
        queues by the load estimate.
        """
        if not engine_full:
            self.waiting_above.clear()
        waiting = [*self.waiting_above, *queued]
        again = now - AGAIN_AFTER_S
        deadlines = sorted(((due, held) for held in waiting
                            if (due := held.objective_due) is not None and held.room_made_at <= again),
                           key=lambda pair: pair[0])
        # Others waiting inside the engine (not these, which the estimate counts too) may be
        # served before them (an engine in arrival order).
        others = max(0, int(engine_waiting) - len(self.waiting_above))
        return [Need(held, deadline, others + ahead) for ahead, (deadline, held) in enumerate(deadlines)]

    def victims(self, needs: Iterable[Need], now: float) -> list[Held]:
        """The requests to end now, most urgent need first: what is cheap to take back at once, else only for an
        objective at risk."""
        if not self._victims:
            return []
        self._refill(now)
        chosen: list[Held] = []
        queued: int | None = None  # idle-only requests that may still queue in the engine ahead of every need
        for need in needs:
            band = need.held.request.band
            if queued is None:
                queued = need.ahead  # the first need's: what the engine queues before any of them
            # At once where it wastes nothing: idle-only requests still queued in the engine ahead of it.
            taken = len(chosen)
            while queued > 0 and (victim := self._choose(band, chosen, (Place.QUEUED,))) is not None:
                chosen.append(victim)
                queued -= 1
            # At once where it is cheap: an idle-only request that has run for at most a part of the need's wait
            # (once the interval between completions is measured: without it the wait is not known).
            if len(chosen) == taken and self._gap_s is not None:
                cheap = now - self.expected_wait_s(need.ahead, now) / CHEAP
                if (victim := self._choose(band, chosen, IDLE, released_since=cheap)) is not None:
                    chosen.append(victim)
            if len(chosen) > taken:
                need.held.room_made_at = now
                continue
            if self._tokens < 1 or not self.at_risk(need, now):
                break
            victim = self._choose(band, chosen, ANY)
            if victim is None:
                break
            need.held.room_made_at = now
            chosen.append(victim)
            self._tokens -= 1
        for victim in chosen:
            del self._victims[victim]
            self.waiting_above.pop(victim, None)
        return chosen

    def _choose(self, band: int, taken: list[Held], kinds: tuple[Place, ...],
                released_since: float = -math.inf) -> Held | None:
        """The youngest candidate of ``kinds`` in a band below ``band`` released since ``released_since``, of another
        tenant than the last victim's if there is one."""
        fallback = None
        for held, kind in reversed(self._victims.items()):
            if held.released_at < released_since:
                break  # in release order: every one before is older still
            if held in taken or held.request.band <= band or kind not in kinds:
                continue
            if held.request.tenant != self._last_tenant:
                self._last_tenant = held.request.tenant
                return held
            fallback = fallback or held
        if fallback is not None:
            self._last_tenant = fallback.request.tenant
        return fallback

    def _refill(self, now: float) -> None:
        if self.filled_at is not None:
            self._tokens = min(max(1.0, self._rate), self._tokens + (now - self.filled_at) * self._rate)
        self.filled_at = now
