"""The release gate: how many held requests may go to a model pool *now*.

Fairness only survives if the engine's own FIFO stays short: whatever waits
inside the engine is served in arrival order, whoever sent it. So the gate
keeps the engine's waiting queue near ``target_waiting`` and holds the rest in
our fair queues, where order can still change.

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

``held_now = ours + foreign`` is what the engine holds now; it never counts
fewer of our own requests than are in flight, and traffic around the gateway
shows up at the next scrape that sees it. The same numbers at the scrape's
start (``max(scraped, ours then)``) feed the adaptive limit.

Variants (``gate:`` in the model config), all on the same accounting:

``adaptive`` (default)
    ``allowance = limit - held_now`` per endpoint, with ``limit`` learned
    online by :class:`extproc.core.adaptive_limit.ConcurrencyLimit`: the engine's
    capacity plus ``target_waiting``, cut by the optional inter-token latency
    and KV usage ceilings. A completion is refilled at once.
``waiting_target``
    The original rule: ``allowance = target_waiting - waiting_now``, where
    ``waiting_now = held_now - running`` (the engine runs what the scrape saw
    running, plus the idle-band releases sent into free slots since). It never
    learns capacity beyond what it has seen running: while the engine does not
    queue it releases ``target_waiting`` more per scrape that shows the last
    ones running.
``static_concurrency``
    At most ``max_in_flight`` of our requests per endpoint; metrics unused.
``static_rate``
    At most ``release_rate`` requests per second for the pool; metrics unused.

**Degraded endpoints.** An endpoint whose last scrape failed, or whose last
good scrape is older than ``stale_after_s``, is *degraded*: the metric-driven
variants then cap our in-flight requests on it at
``max(fallback_max_in_flight, last good running / 2)`` — half of what the
engine ran when we could last see it, never less than the configured floor.
Traffic keeps flowing, a broken scrape can never open the flood gates, and the
next good scrape restores the normal rule. Without endpoint picking the pool
is one unit: one degraded endpoint degrades the pool (Envoy spreads requests
over all endpoints, so ours cannot be attributed).

**Endpoint picking** (``endpoint_picking: true``): each release is assigned
an endpoint — the affinity key's rendezvous-hash favourite (prefix-cache
reuse) while its room is within ``target_waiting`` of the emptiest endpoint's,
else the endpoint with the most room — and the accounting above runs per
endpoint.

**Priority bands** share the engine without sharing a ceiling (see
docs/policies.md):

* bands below the first may use the allowance only down to ``reserve``
  (``allowance(now, reserve)``), so a burst of the first band always finds
  room in the engine's queue, however deep the lower bands' backlog;
* an idle-only band (``idle_allowance``) is released only into an *idle*
  engine: the estimated waiting queue is empty and ``held_now`` is below
  ``share`` of the
  engine's capacity — ``max_running`` when configured, else the most requests
  it was ever seen running. Such releases are sized to free slots: the
  waiting rule does not count them as waiting, and the adaptive
  limit keeps ``target_waiting`` above the engine's capacity, so they never
  eat the allowance of the bands above. With ``share`` 1 and no configured
  capacity the band also probes past the learned capacity (doubling, by at
  most ``target_waiting`` a scrape, until the engine first shows a waiting
  queue, then one request per scrape), so it finds the engine's real size; a
  probe that does not fit waits in the engine and stops the band until the
  queue is empty again.

Pure: the caller passes ``now`` (a monotonic clock) to every method.
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter, deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from enum import Enum

from extproc.core.adaptive_limit import ConcurrencyLimit
from extproc.core.engine_load import EngineLoad

__all__ = ["Gate", "GateMode", "GATE_KINDS"]

GATE_KINDS = ("adaptive", "waiting_target", "static_concurrency", "static_rate")
_METRIC_KINDS = ("adaptive", "waiting_target")


class GateMode(Enum):
    METRICS = "metrics"
    FALLBACK = "fallback"


@dataclass
class _Endpoint:
    """What the gate knows about one endpoint."""

    limit: ConcurrencyLimit
    load: EngineLoad | None = None  # last good scrape
    started_at: float = float("-inf")  # when that scrape started
    # Our requests in flight when that scrape started: on this endpoint (endpoint
    # picking) or in the whole pool (without picking, ours cannot be attributed).
    ours_then: int = 0
    failing: bool = True  # the latest scrape failed (or there was none yet)
    last_running: float = 0.0
    # First release to this endpoint after its current page content appeared.
    release_after_content: float | None = None


@dataclass
class _Bucket:
    """Token bucket for ``static_rate``: one request of burst."""

    rate: float
    tokens: float = 1.0
    at: float | None = None

    def refill(self, now: float) -> None:
        if self.at is not None:
            self.tokens = min(1.0, self.tokens + (now - self.at) * self.rate)
        self.at = now


@dataclass(frozen=True)
class _Estimate:
    """What some endpoints hold now (see the module docstring).

    ``slots`` is what they run: the newest scrapes' running plus the idle-band
    releases sent into free slots since those scrapes started.
    """

    held: float
    slots: float
    into_slots_since: int

    @property
    def waiting(self) -> float:
        """The engine's waiting queue now (the waiting rule's estimate)."""
        return max(0.0, self.held - self.slots)


@dataclass
class Gate:
    """Release accounting for one model pool (one or more engine endpoints)."""

    endpoints: Sequence[str]
    target_waiting: int
    fallback_max_in_flight: int
    stale_after_s: float
    kind: str = "adaptive"
    max_in_flight: int | None = None
    release_rate: float | None = None
    max_itl_s: float | None = None
    max_kv_usage: float | None = None
    itl_window_s: float = 2.0
    pick_endpoints: bool = False
    # The engine's batch size per endpoint, when the operator knows it: the adaptive
    # limit then starts at it (+ target_waiting) instead of ramping up from
    # target_waiting, and an idle-only band fills up to it instead of probing.
    max_running: int | None = None
    _state: dict[str, _Endpoint] = field(init=False, default_factory=dict)
    # Released and not finished, in release order:
    # request -> (release time, endpoint or None, released into a free slot).
    _in_flight: dict[Hashable, tuple[float, str | None, bool]] = field(init=False, default_factory=dict)
    _in_flight_on: Counter[str | None] = field(init=False, default_factory=Counter)
    # (finished at, released at, endpoint) of requests a scrape still running may
    # have seen in flight (a scrape takes at most stale_after_s).
    _finished: deque[tuple[float, float, str | None]] = field(init=False, default_factory=deque)
    _bucket: _Bucket | None = field(init=False, default=None)
    # The most requests the pool was seen running, and whether it was ever seen queueing.
    _peak_running: float = field(init=False, default=0.0)
    _seen_waiting: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        if self.kind not in GATE_KINDS:
            raise ValueError(f"unknown gate kind {self.kind!r}")
        if self.kind == "static_concurrency" and self.max_in_flight is None:
            raise ValueError("static_concurrency needs max_in_flight")
        if self.kind == "static_rate":
            if self.release_rate is None:
                raise ValueError("static_rate needs release_rate")
            if self.pick_endpoints:
                raise ValueError("static_rate does not pick endpoints (it has no per-endpoint state)")
            self._bucket = _Bucket(self.release_rate)
        self.set_endpoints(self.endpoints)

    # --- membership and events -------------------------------------------------

    def set_endpoints(self, endpoints: Sequence[str]) -> None:
        """The pool's endpoints changed (DNS); new ones start degraded until scraped."""
        self.endpoints = tuple(endpoints)
        self._state = {e: self._state.get(e) or self._new_endpoint() for e in self.endpoints}

    def _new_endpoint(self) -> _Endpoint:
        # Nothing known yet (no max_running): assume no spare batch capacity, so the
        # first releases can at most fill the engine's queue to target; the limit
        # grows from there.
        limit = ConcurrencyLimit(
            self.target_waiting + (self.max_running or 0),
            target_waiting=self.target_waiting,
            max_itl_s=self.max_itl_s,
            max_kv_usage=self.max_kv_usage,
            itl_window_s=self.itl_window_s,
            cap=self.max_in_flight,
        )
        return _Endpoint(limit)

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    def _attributed(self) -> bool:
        """Whether each of our requests is known to be on one endpoint."""
        return self.pick_endpoints or len(self._state) == 1

    def _ours_at(self, t: float, endpoint: str | None) -> int:
        """Our requests in flight at time ``t`` (on ``endpoint``; None: anywhere)."""
        def counts(released: float, ep: str | None) -> bool:
            return released < t and (endpoint is None or ep == endpoint)

        ours = sum(1 for released, ep, _ in self._in_flight.values() if counts(released, ep))
        return ours + sum(1 for done, released, ep in self._finished if done > t and counts(released, ep))

    def record_scrape(self, endpoint: str, load: EngineLoad | None, started_at: float) -> None:
        """A scrape of ``endpoint`` that started at ``started_at`` returned ``load`` (None: failed)."""
        state = self._state.get(endpoint)
        if state is None:  # removed from the pool while the scrape ran
            return
        state.failing = load is None
        if load is None:
            return
        sent = state.release_after_content
        if load == state.load and sent is not None and sent < started_at - self.stale_after_s:
            # Work was sent longer ago than any usable page may lag, and the page did
            # not move: it is frozen (a cache, a hung exporter); its data is as old as
            # its first appearance and goes stale.
            return
        if load != state.load:
            state.release_after_content = None
        ours_then = self._ours_at(started_at, endpoint if self.pick_endpoints else None)
        state.load, state.started_at, state.ours_then, state.last_running = load, started_at, ours_then, load.running
        # What the engine held when the scrape started: at least what we had in it.
        held = max(load.running + load.waiting, ours_then) if self._attributed() else None
        state.limit.observe(load, started_at, held=held)
        pool = self.engine_load()
        if pool is not None:
            self._peak_running = max(self._peak_running, pool.running)
            self._seen_waiting = self._seen_waiting or pool.waiting > 0

    def record_release(
        self, request: Hashable, now: float, endpoint: str | None = None, *, into_free_slot: bool = False
    ) -> None:
        self._in_flight[request] = (now, endpoint, into_free_slot)
        self._in_flight_on[endpoint] += 1
        # Only a release that surely went to an endpoint can prove its page frozen.
        target = endpoint if endpoint is not None else self.endpoints[0] if len(self.endpoints) == 1 else None
        state = self._state.get(target) if target is not None else None
        if state is not None and state.release_after_content is None:
            state.release_after_content = now
        if self._bucket is not None:
            self._bucket.refill(now)
            self._bucket.tokens -= 1

    def record_finish(self, request: Hashable, now: float) -> float:
        """Note a finished request; returns how long it was released (its occupancy)."""
        released_at, endpoint, _ = self._in_flight.pop(request)
        self._in_flight_on[endpoint] -= 1
        self._finished.append((now, released_at, endpoint))
        while self._finished and self._finished[0][0] < now - self.stale_after_s:
            self._finished.popleft()
        return now - released_at

    # --- health ------------------------------------------------------------------

    def _healthy(self, state: _Endpoint, now: float) -> bool:
        return not state.failing and now - state.started_at <= self.stale_after_s

    def degraded(self, now: float) -> list[str]:
        """Endpoints whose metrics are unusable now (static variants do not use metrics)."""
        if self.kind not in _METRIC_KINDS:
            return []
        return [e for e, s in self._state.items() if not self._healthy(s, now)]

    def mode(self, now: float) -> GateMode:
        if self.degraded(now):
            return GateMode.FALLBACK
        return GateMode.METRICS

    def fallback_limit(self, endpoint: str) -> int:
        """In-flight cap on a degraded endpoint, derived from its last good state."""
        return max(self.fallback_max_in_flight, int(self._state[endpoint].last_running // 2))

    def last_good(self, endpoint: str) -> EngineLoad | None:
        """The endpoint's last usable scrape (None: never scraped successfully)."""
        return self._state[endpoint].load

    def limit(self, endpoint: str) -> float:
        """The learned adaptive limit (requests the engine should hold)."""
        return self._state[endpoint].limit.limit

    def pressure(self, endpoint: str) -> float:
        """Use of the tightest latency/KV ceiling at the last scrape (1.0 = at it)."""
        return self._state[endpoint].limit.pressure

    def itl(self, endpoint: str) -> float | None:
        return self._state[endpoint].limit.itl.value()

    def engine_load(self) -> EngineLoad | None:
        """The pool's last scraped load (sum over endpoints), if every endpoint has one."""
        loads = [s.load for s in self._state.values()]
        if not loads or any(load is None for load in loads):
            return None
        return EngineLoad(waiting=sum(x.waiting for x in loads if x), running=sum(x.running for x in loads if x))

    # --- the decision ------------------------------------------------------------

    def _estimate(self, states: Sequence[_Endpoint], endpoint: str | None) -> _Estimate:
        """What ``states`` hold now: ours exactly, plus the foreign part of their newest scrapes.

        ``endpoint`` None: the whole pool, whose scrapes each recorded the pool's
        in-flight count; the largest of those is subtracted once (the scrapes
        started within a scrape interval of each other).
        """
        scraped = sum(s.load.running + s.load.waiting for s in states if s.load)
        ours_then = max(s.ours_then for s in states) if endpoint is None else states[0].ours_then
        ours_now = self.in_flight if endpoint is None else self._in_flight_on[endpoint]
        snapshot = min(s.started_at for s in states)
        into_slots = 0
        for released, ep, into_slot in reversed(self._in_flight.values()):
            if released < snapshot:
                break
            into_slots += into_slot and (endpoint is None or ep == endpoint)
        running = sum(s.load.running for s in states if s.load)
        return _Estimate(held=ours_now + max(0.0, scraped - ours_then), slots=running + into_slots,
                         into_slots_since=into_slots)

    def _headroom(self, states: Sequence[_Endpoint], endpoint: str | None) -> float:
        estimate = self._estimate(states, endpoint)
        if self.kind == "waiting_target":
            return self.target_waiting * len(states) - estimate.waiting
        return sum(s.limit.limit for s in states) - estimate.held

    def endpoint_allowance(self, endpoint: str, now: float) -> int:
        """How many more requests ``endpoint`` may get now (endpoint picking)."""
        state = self._state[endpoint]
        mine = self._in_flight_on[endpoint]
        if self.kind == "static_concurrency":
            assert self.max_in_flight is not None
            return max(0, self.max_in_flight - mine)
        if not self._healthy(state, now):
            return max(0, self.fallback_limit(endpoint) - mine)
        return max(0, int(self._headroom([state], endpoint)))

    def allowance(self, now: float, reserve: int = 0) -> int:
        """How many requests may be released now (never negative), leaving ``reserve`` to higher bands."""
        return max(0, self._allowance(now) - reserve)

    def _allowance(self, now: float) -> int:
        if self._bucket is not None:
            self._bucket.refill(now)
            return int(self._bucket.tokens)
        if self.pick_endpoints:
            return sum(self.endpoint_allowance(e, now) for e in self._state)
        if self.kind == "static_concurrency":
            assert self.max_in_flight is not None
            return self.max_in_flight * len(self._state) - len(self._in_flight)
        if self.mode(now) is GateMode.FALLBACK:
            return sum(self.fallback_limit(e) for e in self._state) - len(self._in_flight)
        return int(self._headroom(list(self._state.values()), None))

    def idle_allowance(self, now: float, share: float, reserve: int) -> int:
        """How many requests of an idle-only band fit in the engine now (see the module docstring).

        Without usable metrics (or with a variant that ignores them) idleness
        cannot be seen: the band gets the ordinary allowance less ``reserve``,
        at least one slot, for the bands above.
        """
        if self.kind not in _METRIC_KINDS or self.mode(now) is GateMode.FALLBACK:
            return self.allowance(now, max(1, reserve))
        estimate = self._estimate(list(self._state.values()), None)
        if estimate.waiting > 0:
            return 0
        if self.max_running is not None:
            capacity: float = self.max_running * len(self._state)
        else:
            capacity = self._peak_running
        free = math.ceil(share * capacity - estimate.held)
        if free >= 1:
            return free
        if share < 1 or self.max_running is not None or estimate.into_slots_since:
            return 0
        # Probe: growing (doubling, at most target_waiting a scrape, so a probe
        # that does not fit leaves no more than the target waiting) until the
        # engine first queued, then one more per scrape.
        return 1 if self._seen_waiting else max(1, min(int(estimate.held), self.target_waiting))

    def next_change_in(self, now: float) -> float | None:
        """Seconds until the allowance grows without any event (``static_rate``), else None."""
        if self._bucket is None:
            return None
        self._bucket.refill(now)
        return max(0.0, (1.0 - self._bucket.tokens) / self._bucket.rate)

    def pick(self, key: str, now: float) -> str | None:
        """The endpoint for the next release of requests with affinity ``key``.

        The key's rendezvous-hash favourite keeps it (its prefix cache is warm)
        while that endpoint has room and at most ``target_waiting`` less room
        than the emptiest one (bounded-load stickiness: a tenant's flood spills
        over instead of queueing on one engine); otherwise the endpoint with
        the most room, ties broken by the hash order.
        """
        ranked = sorted(self._state, key=lambda e: hashlib.blake2b(f"{key}\0{e}".encode(), digest_size=8).digest(),
                        reverse=True)
        room = {e: self.endpoint_allowance(e, now) for e in ranked}
        if not ranked or max(room.values()) < 1:
            return None
        favourite = ranked[0]
        if room[favourite] >= 1 and max(room.values()) - room[favourite] <= self.target_waiting:
            return favourite
        return max(ranked, key=lambda e: room[e])  # max() keeps the first of equals: hash order
