"""Which released request of a preemptible band to end, and when, so a higher band's priority holds inside the engine.

Once a request is inside the engine it keeps its slot until it finishes, and
vLLM does not preempt a running request for a higher priority when it is
short of slots (only when KV blocks run out). So an interactive request that
arrives while batch work fills the engine waits for a batch request to
finish. The gateway can end such a request itself: its ext_proc stream is
still open, and while the response has not begun Envoy answers the client
our JSON 503 ``preempted`` (with ``Retry-After``) and resets the upstream
request, which the engine aborts at once, freeing the slot.

The rules, in order:

* **A request in need.** A request of a higher band with an objective that
  needs a slot: queued here because the gate is full, or released into an
  engine with no free slot.
* **Lent slots are taken back at once.** A request of an idle-only band
  runs on a slot lent to it while nobody above needed it (``core/bands.py``).
  For a request in need the book ends one of them now, whatever the slack
  and the rate, and, for the first need, those the band left queued in the
  engine while it had it to itself (:attr:`Lent.QUEUED`), as many as the
  engine queues ahead of it: a chat that finds the engine full of batch work
  starts about as on an idle engine, not after the next batch completion.
  Only requests released :data:`LENT_AFTER_S` ago or more: a stream's
  response has begun by then, so what is taken back is work that answers
  when whole (batch lines), never a live stream on its way.
  The waste is bounded by the rules below, which hold for every victim: the
  youngest goes first (one still queued in the engine has made no
  progress), and a victim's retry is never a victim again, so each request
  is ended at most once.
* **Otherwise only for an objective at risk.** With no lent slot to take
  back, a request in need is at risk when its deadline comes sooner than the
  engine is expected to free a slot by itself for it: ``ahead + 1`` times the
  recent interval between completions (measured; while nothing completes,
  the time since the last completion stands in for it). Nobody at risk,
  nothing is preempted. One victim per request at risk; another only if it
  is still waiting and at risk :data:`AGAIN_AFTER_S` later (in an engine that
  serves its queue in arrival order, requests released before it may stand
  ahead of it). A request a slot was taken back for waits as long before it
  is a need again.
* **The victim wastes least.** Among the preemptible requests in flight whose
  response has not begun (their response headers have not come), the one
  released last: the least progress. A different tenant than the last victim
  when there is one, so one tenant does not absorb every preemption.
* **Never twice in a row.** A request that says it is a retry (the OpenAI
  SDKs send ``x-stainless-retry-count``) is never a victim: a preempted
  request comes back as such and then runs to the end.
* **Bounded rate.** For objectives at risk, at most ``max_preemptions_per_s``
  (a token bucket of that rate, holding at most one second's worth); 0 turns
  preemption off, lent slots included.

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
# A lent request is taken back at once only once released this long. A streamed response begins as the engine
# accepts the request (vLLM sends its headers then, within milliseconds): by now a stream's has, and what is still a
# candidate answers only when whole (a batch line). So a live client's stream on its way is never cut for a slot.
LENT_AFTER_S = 0.1


class Lent(enum.Enum):
    """What a preemptible request in flight holds: a slot lent to an idle-only band (taken back at once), or its own."""

    NO = "no"  # of a preemptible band that is not idle-only: ended only for an objective at risk
    QUEUED = "queued"  # idle-only, released into the engine's queue (the band had the engine to itself)
    RUNNING = "running"  # idle-only, released into a free slot


LENT = (Lent.QUEUED, Lent.RUNNING)
ANY = (Lent.NO, *LENT)


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
        self._tokens = min(1.0, rate_per_s)
        self._filled_at: float | None = None
        # Released, response not begun, not a retry: in release order (the last is the youngest).
        self._victims: dict[Held, Lent] = {}
        # Released requests of non-preemptible bands with an objective that went into an
        # engine without a free slot: they may be waiting in it (their needs).
        self._waiting_above: dict[Held, None] = {}
        self._last_tenant: str | None = None
        # The measured interval between completions, and when the last one came.
        self._gap_s: float | None = None
        self._last_end: float | None = None

    @property
    def enabled(self) -> bool:
        return self._rate > 0

    @property
    def candidates(self) -> int:
        """Preemptible requests in flight whose response has not begun."""
        return len(self._victims)

    def released(self, held: Held, now: float, lent: Lent) -> None:
        """``held``, of a preemptible band and not a retry, went to the engine: it may be ended later."""
        if self._last_end is None:
            self._last_end = now
        self._victims[held] = lent

    def waits_in_engine(self, held: Held) -> None:
        """``held``, of a band that is not preemptible and with an objective, went into an engine without a free slot."""
        self._waiting_above[held] = None

    def started(self, held: Held) -> None:
        """Its response began: Envoy can no longer answer for it, and it waits for nothing."""
        self._victims.pop(held, None)
        self._waiting_above.pop(held, None)

    def ended(self, held: Held, now: float) -> None:
        """A released request ended by itself (whatever the outcome): measure the interval between completions."""
        self._victims.pop(held, None)
        self._waiting_above.pop(held, None)
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
        runs), and those ``queued`` here in a band that is not preemptible
        (each band's tenants' heads). ``engine_waiting``: what the engine
        queues by the load estimate.
        """
        if not engine_full:
            self._waiting_above.clear()
        waiting = [*self._waiting_above, *queued]
        again = now - AGAIN_AFTER_S
        deadlines = sorted(((due, held) for held in waiting
                            if (due := held.objective_due) is not None and held.room_made_at <= again),
                           key=lambda pair: pair[0])
        # Others waiting inside the engine (not these, which the estimate counts too) may be
        # served before them (an engine in arrival order).
        others = max(0, int(engine_waiting) - len(self._waiting_above))
        return [Need(held, deadline, others + ahead) for ahead, (deadline, held) in enumerate(deadlines)]

    def victims(self, needs: Iterable[Need], now: float) -> list[Held]:
        """The requests to end now, most urgent need first: lent slots at once, others for an objective at risk."""
        if not self._victims:
            return []
        self._refill(now)
        chosen: list[Held] = []
        queued: int | None = None  # lent requests that may still queue in the engine ahead of every need
        settled = now - LENT_AFTER_S  # lent requests released by then: any stream among them has begun
        for need in needs:
            band = need.held.request.band
            if queued is None:
                queued = need.ahead  # the first need's: what the engine queues before any of them
            # Lent slots at once: those still queued in the engine ahead of it, and one running.
            taken = len(chosen)
            while queued > 0 and (victim := self._choose(band, chosen, (Lent.QUEUED,), settled)) is not None:
                chosen.append(victim)
                queued -= 1
            if (victim := self._choose(band, chosen, LENT, settled)) is not None:
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
        return chosen

    def _choose(self, band: int, taken: list[Held], kinds: tuple[Lent, ...], released_by: float = math.inf) -> Held | None:
        """The youngest candidate of ``kinds`` in a band below ``band`` released by ``released_by``, of another tenant
        than the last victim's if there is one."""
        fallback = None
        for held, kind in reversed(self._victims.items()):
            if held in taken or held.request.band <= band or kind not in kinds or held.released_at > released_by:
                continue
            if held.request.tenant != self._last_tenant:
                self._last_tenant = held.request.tenant
                return held
            fallback = fallback or held
        if fallback is not None:
            self._last_tenant = fallback.request.tenant
        return fallback

    def _refill(self, now: float) -> None:
        if self._filled_at is not None:
            self._tokens = min(max(1.0, self._rate), self._tokens + (now - self._filled_at) * self._rate)
        self._filled_at = now
