"""What a model pool's engines hold now: our requests counted exactly, the rest from the scrapes.

Fairness only survives if the engine's own FIFO stays short: whatever waits
inside the engine is served in arrival order, whoever sent it. Every release
rule therefore needs to know what the engine holds *now*, and all of them
read it from this one object.

The engine reports its queue through ``/metrics``, but a scrape is old when
it arrives, and an engine shows a new request there late: real vLLM 50-400 ms
after it was sent (tokenising, the hand-over to the engine core, the next
step's stats; measured in docs/gate.md), our simulator as long by default.
Any fixed "a release is visible after X ms" would be tuned to one engine and
machine, and each request it under-counts is one more waiting in the
engine's FIFO. So the estimate rests on what the processor knows exactly:

* **ours** — our released requests that have not finished. The ext_proc
  stream ends when the response ends, so this count is exact at every
  moment, whatever any scrape shows.
* **foreign** — what the engine holds that is not ours (traffic around the
  gateway, another gateway), from the newest scrape: its running + waiting
  less every request of ours that was in flight when that scrape started.
  Where a scrape lags, our requests are missing from it and foreign reads
  low (never below 0); where it is on time, foreign is exact. Without
  foreign traffic, the error is nil.

In a cluster (``core/cluster.py``) "ours" is the cluster's: the other
instances' requests in flight, as Redis last told us (``record_others``),
count with ours — now, and at a scrape's start (the last figure told before
it). Only without endpoint picking: with picking ours are counted per
endpoint, and the other instances' requests show up as foreign.

``held = ours + foreign`` is what the engine holds now; it never counts
fewer of our own requests than are in flight, and traffic around the gateway
shows up at the next scrape that sees it. The same numbers at the scrape's
start (``max(scraped, ours then)``) feed the adaptive limit.

A request released while the engine had a free slot by this estimate
(``into_free_slot``, ``Pool.free_slots``) is run by the engine rather than
queued, so the estimate counts it as running (``slots``) until the next scrape
shows it; any other release counts as waiting until then.

Pure: the caller passes ``now`` (a monotonic clock).
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from extproc.core.values.engine_load import EngineLoad


@dataclass
class _Scraped:
    """One endpoint's newest usable scrape."""

    load: EngineLoad | None = None
    started_at: float = float("-inf")
    # Our requests in flight when that scrape started: on this endpoint (endpoint
    # picking) or in the whole pool (without picking, ours cannot be attributed).
    ours_then: int = 0


@dataclass(frozen=True)
class LoadNow:
    """What some endpoints hold now.

    ``slots`` is what they run: the newest scrapes' running plus the releases
    sent into free slots since those scrapes started.
    """

    held: float
    slots: float
    into_slots_since: int
    # The engine's waiting queue now: a field, not a property, because every release reads it.
    waiting: float = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "waiting", max(0.0, self.held - self.slots))


class LoadEstimate:
    """Release and finish bookkeeping plus the newest scrapes, for one model pool.

    ``per_endpoint``: each release names its endpoint (endpoint picking), so
    ours are counted per endpoint; otherwise only for the pool as a whole.
    ``stale_after_s`` bounds how long a scrape may take: finishes are kept that
    long, because a scrape still running may have seen them in flight.
    """

    def __init__(self, endpoints: Sequence[str], *, stale_after_s: float, per_endpoint: bool = False) -> None:
        self.endpoints: tuple[str, ...] = ()
        self._stale_after_s = stale_after_s
        self._per_endpoint = per_endpoint
        self._scraped: dict[str, _Scraped] = {}
        # Released and not finished, in release order:
        # request -> (release time, endpoint or None, released into a free slot).
        self._in_flight: dict[Hashable, tuple[float, str | None, bool]] = {}
        self._in_flight_on: Counter[str | None] = Counter()
        # (finished at, released at, endpoint) of requests a scrape still running may
        # have seen in flight (a scrape takes at most stale_after_s).
        self._finished: deque[tuple[float, float, str | None]] = deque()
        # The most requests the pool was seen running, and whether it was ever seen queueing.
        self.peak_running = 0.0
        self.seen_waiting = False
        # The other instances' requests in flight (a cluster), with when each figure was told:
        # the last one older than a scrape may take, and every newer one.
        self.others = 0
        self._others_told: deque[tuple[float, int]] = deque()
        # What now() answered per endpoint since the last change: a release round asks it several
        # times (the rule's room, the free slots) with nothing changed in between.
        self._now: dict[str | None, LoadNow] = {}
        self.set_endpoints(endpoints)

    def set_endpoints(self, endpoints: Sequence[str]) -> None:
        """The pool's members changed; a newcomer has no scrape yet, a leaver's is forgotten."""
        self.endpoints = tuple(endpoints)
        self._scraped = {e: self._scraped.get(e) or _Scraped() for e in self.endpoints}
        self._now.clear()

    @property
    def in_flight(self) -> int:
        """Our requests released and not finished."""
        return len(self._in_flight)

    @property
    def cluster_in_flight(self) -> int:
        """Our requests and the other instances' (a cluster) released and not finished."""
        return len(self._in_flight) + self.others

    def record_others(self, now: float, others: int) -> None:
        """The cluster's other instances have ``others`` requests in flight (as of ``now``)."""
        self.others = others
        self._now.clear()
        told = self._others_told
        if not told or told[-1][1] != others:
            told.append((now, others))
        while len(told) > 1 and told[1][0] < now - self._stale_after_s:
            told.popleft()

    def _others_at(self, t: float) -> int:
        """The other instances' in-flight count last told before ``t`` (0: none told yet; errs high on foreign)."""
        return next((count for at, count in reversed(self._others_told) if at < t), 0)

    def in_flight_on(self, endpoint: str) -> int:
        """Our requests released to ``endpoint`` and not finished (endpoint picking)."""
        return self._in_flight_on[endpoint]

    def record_release(self, request: Hashable, now: float, endpoint: str | None, into_free_slot: bool, *,
                       before: bool = False) -> LoadNow | None:
        """Count a release; with ``before``, what the whole pool held just before it (``Pool.released``)."""
        load = self.now() if before else None
        self._in_flight[request] = (now, endpoint, into_free_slot)
        self._in_flight_on[endpoint] += 1
        self._now.clear()
        return load

    def record_moved(self, request: Hashable, endpoint: str) -> None:
        """``request`` runs on ``endpoint`` after all (the gateway fell back to it): count it there."""
        released_at, old, into_free_slot = self._in_flight[request]
        self._in_flight[request] = (released_at, endpoint, into_free_slot)
        self._in_flight_on[old] -= 1
        self._in_flight_on[endpoint] += 1
        self._now.clear()

    def record_finish(self, request: Hashable, now: float) -> float:
        """Note a finished request; returns how long it was released (its occupancy)."""
        released_at, endpoint, _ = self._in_flight.pop(request)
        self._in_flight_on[endpoint] -= 1
        self._now.clear()
        self._finished.append((now, released_at, endpoint))
        while self._finished and self._finished[0][0] < now - self._stale_after_s:
            self._finished.popleft()
        return now - released_at

    def record_scrape(self, endpoint: str, load: EngineLoad, started_at: float) -> float | None:
        """Take a usable scrape of ``endpoint`` (one of ours) that started at ``started_at``.

        Returns what the endpoint held when the scrape started — at least what
        we had in it — where ours can be told apart per endpoint; else None.
        """
        scraped = self._scraped[endpoint]
        ours_then = self._ours_at(started_at, endpoint if self._per_endpoint else None)
        scraped.load, scraped.started_at, scraped.ours_then = load, started_at, ours_then
        self._now.clear()
        pool = self.pool_load()
        if pool is not None:
            self.peak_running = max(self.peak_running, pool.running)
            self.seen_waiting = self.seen_waiting or pool.waiting > 0
        if self._per_endpoint or len(self._scraped) == 1:
            return max(load.running + load.waiting, ours_then)
        return None

    def _ours_at(self, t: float, endpoint: str | None) -> int:
        """Our requests in flight at time ``t`` (on ``endpoint``; None: anywhere)."""
        def counts(released: float, ep: str | None) -> bool:
            return released < t and (endpoint is None or ep == endpoint)

        ours = sum(1 for released, ep, _ in self._in_flight.values() if counts(released, ep))
        ours += sum(1 for done, released, ep in self._finished if done > t and counts(released, ep))
        return ours + (self._others_at(t) if endpoint is None and not self._per_endpoint else 0)

    def pool_load(self) -> EngineLoad | None:
        """The pool's last scraped load (sum over endpoints), if every endpoint has one."""
        loads = [s.load for s in self._scraped.values()]
        if not loads or any(load is None for load in loads):
            return None
        return EngineLoad(waiting=sum(x.waiting for x in loads if x), running=sum(x.running for x in loads if x))

    def now(self, endpoint: str | None = None) -> LoadNow:
        """What ``endpoint`` (None: the whole pool) holds now: ours exactly, plus the foreign part of its scrapes.

        For the whole pool: with endpoint picking each scrape recorded ours on
        its own endpoint, so the foreign parts add up per endpoint; without,
        each recorded the pool's in-flight count, and the largest of those is
        subtracted once (the scrapes started within a scrape interval of each
        other). Kept until the next change: asked again meanwhile, the same answer.
        """
        known = self._now.get(endpoint)
        if known is not None:
            return known
        self._now[endpoint] = known = self._compute(endpoint)
        return known

    def _compute(self, endpoint: str | None) -> LoadNow:
        # One pass over the scrapes (every release asks anew: the release before changed ours).
        states = self._scraped.values() if endpoint is None else (self._scraped[endpoint],)
        per_endpoint = self._per_endpoint or endpoint is not None
        foreign: float = 0
        scraped: float = 0
        running: float = 0
        most_ours_then = 0
        snapshot = math.inf
        for s in states:
            load = s.load
            if load:
                if per_endpoint:
                    foreign += max(0.0, load.running + load.waiting - s.ours_then)
                else:
                    scraped += load.running + load.waiting
                running += load.running
            if s.ours_then > most_ours_then:
                most_ours_then = s.ours_then
            if s.started_at < snapshot:
                snapshot = s.started_at
        if endpoint is not None:
            ours_now = self._in_flight_on[endpoint]
        else:
            ours_now = self.in_flight if self._per_endpoint else self.cluster_in_flight
            if not self._per_endpoint:
                foreign = max(0.0, scraped - most_ours_then)
        into_slots = 0
        for released, ep, into_slot in reversed(self._in_flight.values()):
            if released < snapshot:
                break
            into_slots += into_slot and (endpoint is None or ep == endpoint)
        return LoadNow(held=ours_now + foreign, slots=running + into_slots,
                       into_slots_since=into_slots)
