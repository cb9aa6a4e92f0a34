"""The release gate: how many held requests may go to a model pool *now*.

Fairness only survives if the engine's own FIFO stays short: whatever waits
inside the engine is served in arrival order, whoever sent it. So the gate
keeps the engine's waiting queue near ``target_waiting`` and holds the rest in
our fair queues, where order can still change.

The engine reports its queue through ``/metrics``, but a scrape is a snapshot
that is already old when it arrives. Between two scrapes the gate corrects it
with what it knows exactly:

* **released but not yet visible** (``unseen``): requests we released shortly
  before the scrape started, or after it, cannot be in that snapshot. A
  release is taken to be visible to a scrape that started at least
  ``VISIBILITY_GRACE_S`` after it (the Envoy hop to the engine is ~1 ms; the
  grace over-counts for a moment rather than under-counts).
* **finished since the scrape** (``finished``): a request that was in the
  snapshot and has finished since frees its place in the engine. The end of a
  response reaches us a little after the engine let go of it, so a finish
  within ``VISIBILITY_GRACE_S`` of the scrape's start may already be in the
  snapshot and is not counted (counting it twice would overfill the engine;
  the next scrape shows it either way).

Variants (``gate:`` in the model config), all on the same accounting:

``adaptive`` (default)
    ``allowance = limit - (running + waiting - finished + unseen)`` per
    endpoint, with ``limit`` learned online by
    :class:`extproc.controller.ConcurrencyLimit`: the engine's capacity plus
    ``target_waiting``, cut by the optional inter-token latency and KV usage
    ceilings. A completion is refilled at once.
``waiting_target``
    The original rule: ``allowance = target_waiting - (max(0, waiting -
    finished) + unseen)``. While the engine does not queue it releases at most
    ``target_waiting`` per scrape.
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
  engine: the estimated waiting queue is empty and the estimated occupancy
  (running + waiting, corrected like waiting) is below ``share`` of the
  engine's capacity — ``max_running`` when configured, else the most requests
  it was ever seen running. Such releases are sized to free slots: the
  waiting rule does not count them as unseen *waiting*, and the adaptive
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
from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from enum import Enum

from extproc.controller import ConcurrencyLimit, EngineLoad

__all__ = ["EngineLoad", "Gate", "GateMode", "GATE_KINDS", "VISIBILITY_GRACE_S"]

VISIBILITY_GRACE_S = 0.05
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


@dataclass
class _Estimate:
    """A snapshot (summed over endpoints) and its corrections: requests finished
    since it, and releases it cannot contain yet.

    ``unseen_into_slots`` are the unseen releases of idle-only bands, sized to
    free batch slots: they occupy the engine but are not expected to wait.
    """

    waiting: float
    running: float
    finished: int = 0
    unseen: int = 0
    unseen_into_slots: int = 0

    @property
    def waiting_now(self) -> float:
        """The engine's waiting queue now (the waiting rule's estimate)."""
        return max(0.0, self.waiting - self.finished) + self.unseen - self.unseen_into_slots


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
    # (finished at, released at, endpoint) of requests that may still correct a snapshot.
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

    def record_scrape(self, endpoint: str, load: EngineLoad | None, started_at: float) -> None:
        """A scrape of ``endpoint`` that started at ``started_at`` returned ``load`` (None: failed)."""
        state = self._state.get(endpoint)
        if state is None:  # removed from the pool while the scrape ran
            return
        state.failing = load is None
        if load is None:
            return
        sent = state.release_after_content
        if load == state.load and sent is not None and sent < started_at - VISIBILITY_GRACE_S:
            # Work was sent and the page did not move: it is frozen (a cache, a hung
            # exporter); its data is as old as its first appearance and goes stale.
            return
        if load != state.load:
            state.release_after_content = None
        state.load, state.started_at, state.last_running = load, started_at, load.running
        state.limit.observe(load, started_at)
        pool = self.engine_load()
        if pool is not None:
            self._peak_running = max(self._peak_running, pool.running)
            self._seen_waiting = self._seen_waiting or pool.waiting > 0
        self._prune(started_at)

    def record_release(
        self, request: Hashable, now: float, endpoint: str | None = None, *, into_free_slot: bool = False
    ) -> None:
        self._in_flight[request] = (now, endpoint, into_free_slot)
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
        self._finished.append((now, released_at, endpoint))
        self._prune(now)
        return now - released_at

    def _prune(self, now: float) -> None:
        """Forget finishes no usable snapshot can still be corrected by."""
        usable = [s.started_at for s in self._state.values() if self._healthy(s, now)]
        cutoff = min(usable) if usable else now - self.stale_after_s
        while self._finished and self._finished[0][0] <= cutoff:
            self._finished.popleft()

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
        """The states' last snapshot, corrected since the oldest of them (``endpoint`` None: whole pool)."""
        snapshot = min(s.started_at for s in states)
        horizon = snapshot - VISIBILITY_GRACE_S
        estimate = _Estimate(
            waiting=sum(s.load.waiting for s in states if s.load),
            running=sum(s.load.running for s in states if s.load),
        )
        for done, released, ep in self._finished:
            if (endpoint is None or ep == endpoint) and done > snapshot + VISIBILITY_GRACE_S and released < horizon:
                estimate.finished += 1
        for released, ep, into_slot in reversed(self._in_flight.values()):
            if released < horizon:
                break
            if endpoint is None or ep == endpoint:
                estimate.unseen += 1
                estimate.unseen_into_slots += into_slot
        return estimate

    def _mine(self, endpoint: str) -> int:
        return sum(1 for _, ep, _ in self._in_flight.values() if ep == endpoint)

    def _headroom(self, states: Sequence[_Endpoint], endpoint: str | None) -> float:
        estimate = self._estimate(states, endpoint)
        if self.kind == "waiting_target":
            return self.target_waiting * len(states) - estimate.waiting_now
        limit = sum(s.limit.limit for s in states)
        return limit - (estimate.running + estimate.waiting - estimate.finished + estimate.unseen)

    def endpoint_allowance(self, endpoint: str, now: float) -> int:
        """How many more requests ``endpoint`` may get now (endpoint picking)."""
        state = self._state[endpoint]
        if self.kind == "static_concurrency":
            assert self.max_in_flight is not None
            return max(0, self.max_in_flight - self._mine(endpoint))
        if not self._healthy(state, now):
            return max(0, self.fallback_limit(endpoint) - self._mine(endpoint))
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
        if estimate.waiting_now > 0:
            return 0
        occupancy = max(0.0, estimate.waiting + estimate.running - estimate.finished) + estimate.unseen
        if self.max_running is not None:
            capacity: float = self.max_running * len(self._state)
        else:
            capacity = self._peak_running
        free = math.ceil(share * capacity - occupancy)
        if free >= 1:
            return free
        if share < 1 or self.max_running is not None or estimate.unseen_into_slots:
            return 0
        # Probe: growing (doubling, at most target_waiting a scrape, so a probe
        # that does not fit leaves no more than the target waiting) until the
        # engine first queued, then one more per scrape.
        return 1 if self._seen_waiting else max(1, min(int(occupancy), self.target_waiting))

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
