"""The release gate: how many held requests may go to a model pool *now*.

Fairness only survives if the engine's own FIFO stays short: whatever waits
inside vLLM is served in arrival order, whoever sent it. So the gate keeps the
engine's waiting queue near ``target_waiting`` and holds the rest in our fair
queues, where order can still change.

The engine reports its queue through ``/metrics``, but a scrape is a snapshot
that is already old when it arrives. Between two scrapes the gate corrects it
with what it knows exactly:

* **released but not yet visible**: requests we released shortly before the
  scrape started, or after it, cannot be in that snapshot. They count as
  waiting. A release is taken to be visible to a scrape that started at least
  ``VISIBILITY_GRACE_S`` after it (the Envoy hop to the engine is ~1 ms; the
  grace over-counts for a moment rather than under-counts).
* **finished since the scrape**: when the engine has a waiting queue, every
  request that finishes frees a slot that the head of that queue takes, so a
  completion seen after the snapshot lowers the estimated waiting by one.

    estimated_waiting = max(0, scraped_waiting - finished_since) + unseen
    allowance         = target_waiting * endpoints - estimated_waiting

With no usable metrics (never scraped, failing, or older than
``stale_after_s``) the gate falls back to a fixed in-flight ceiling of
``fallback_max_in_flight`` per endpoint: traffic keeps flowing, slowly, and a
broken scrape can never open the flood gates.

Bands share the engine without sharing a ceiling (see docs/policies.md):

* bands below the first may use the allowance only down to ``reserve``
  (``allowance(now, reserve)``), so a burst of the first band always finds
  room in the engine's queue, however deep the lower bands' backlog;
* an idle-only band (``idle_allowance``) is released only into an *idle*
  engine: the estimated waiting queue is empty and the estimated occupancy
  (running + waiting, corrected like waiting) is below ``share`` of the
  engine's capacity — ``max_running`` when configured, else the most requests
  it was ever seen running. Such releases are sized to free slots, so they
  are not counted as unseen *waiting* and never eat the allowance of the
  bands above. With ``share`` 1 and no configured capacity the band also
  probes past the learned capacity, one request per scrape (doubling until the
  engine first shows a waiting queue), so it finds the engine's real size;
  a probe that does not fit waits in the engine and stops the band until
  the queue is empty again.

Pure: the caller passes ``now`` (a monotonic clock) to every method.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from enum import Enum

VISIBILITY_GRACE_S = 0.05


@dataclass(frozen=True)
class EngineLoad:
    """One endpoint's queue as its ``/metrics`` reported it."""

    waiting: float
    running: float
    # The engine's cumulative generated-token counter, when its dialect has one
    # (the cost model derives a per-sequence decode rate from it).
    generation_tokens: float | None = None


class GateMode(Enum):
    METRICS = "metrics"
    FALLBACK = "fallback"


class Gate:
    """Release accounting for one model pool (one or more engine endpoints)."""

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        target_waiting: int,
        fallback_max_in_flight: int,
        stale_after_s: float,
    ) -> None:
        self._target = target_waiting * len(endpoints)
        self._fallback_limit = fallback_max_in_flight * len(endpoints)
        self._stale_after_s = stale_after_s
        # endpoint -> (load, monotonic time the scrape started); None: no usable sample.
        self._samples: dict[str, tuple[EngineLoad, float] | None] = dict.fromkeys(endpoints)
        # Released and not finished, in release order: request -> (release time,
        # whether it may wait in the engine: False for releases sized to free slots).
        self._in_flight: dict[Hashable, tuple[float, bool]] = {}
        # The most requests the pool was seen running, and whether it was ever seen queueing.
        self._peak_running = 0.0
        self._seen_waiting = False
        # (finished at, released at) of requests finished since the oldest snapshot.
        self._finished: deque[tuple[float, float]] = deque()

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    def record_scrape(self, endpoint: str, load: EngineLoad | None, started_at: float) -> None:
        """A scrape of ``endpoint`` that started at ``started_at`` returned ``load`` (None: failed)."""
        self._samples[endpoint] = None if load is None else (load, started_at)
        pool = self.engine_load()
        if pool is not None:
            self._peak_running = max(self._peak_running, pool.running)
            self._seen_waiting = self._seen_waiting or pool.waiting > 0
        oldest = self._oldest_snapshot()
        if oldest is not None:
            while self._finished and self._finished[0][0] <= oldest:
                self._finished.popleft()

    def record_release(self, request: Hashable, now: float, *, into_free_slot: bool = False) -> None:
        self._in_flight[request] = (now, not into_free_slot)

    def record_finish(self, request: Hashable, now: float) -> float:
        """Note a finished request; returns how long it was released (its occupancy)."""
        released_at, _ = self._in_flight.pop(request)
        self._finished.append((now, released_at))
        return now - released_at

    def mode(self, now: float) -> GateMode:
        for sample in self._samples.values():
            if sample is None or now - sample[1] > self._stale_after_s:
                return GateMode.FALLBACK
        return GateMode.METRICS

    def engine_load(self) -> EngineLoad | None:
        """The pool's last scraped load (sum over endpoints), if every endpoint has one."""
        samples = list(self._samples.values())
        if any(s is None for s in samples):
            return None
        return EngineLoad(
            waiting=sum(s[0].waiting for s in samples if s),
            running=sum(s[0].running for s in samples if s),
        )

    def _corrections(self) -> tuple[EngineLoad, int, int, int]:
        """The snapshot, finished since it, and unseen releases (that may wait / into free slots)."""
        oldest = self._oldest_snapshot()
        load = self.engine_load()
        if oldest is None or load is None:
            raise ValueError("no complete snapshot to estimate from")
        horizon = oldest - VISIBILITY_GRACE_S
        finished_since = sum(1 for done, released in self._finished if done > oldest and released < horizon)
        may_wait = into_slots = 0
        for released, waits in reversed(self._in_flight.values()):
            if released < horizon:
                break
            if waits:
                may_wait += 1
            else:
                into_slots += 1
        return load, finished_since, may_wait, into_slots

    def estimated_waiting(self) -> float:
        """The engine's waiting queue now, by the correction in the module docstring."""
        load, finished_since, may_wait, _ = self._corrections()
        return max(0.0, load.waiting - finished_since) + may_wait

    def allowance(self, now: float, reserve: int = 0) -> int:
        """How many requests may be released now (never negative), leaving ``reserve`` to higher bands."""
        if self.mode(now) is GateMode.FALLBACK:
            return max(0, self._fallback_limit - reserve - len(self._in_flight))
        return max(0, int(self._target - reserve - self.estimated_waiting()))

    def idle_allowance(self, now: float, share: float, reserve: int, max_running: int | None) -> int:
        """How many requests of an idle-only band fit in the engine now (see the module docstring).

        Without usable metrics idleness cannot be seen: the band gets the
        fallback ceiling less ``reserve`` (at least one slot) for the bands above.
        """
        if self.mode(now) is GateMode.FALLBACK:
            return max(0, self._fallback_limit - max(1, reserve) - len(self._in_flight))
        load, finished_since, may_wait, into_slots = self._corrections()
        if max(0.0, load.waiting - finished_since) + may_wait > 0:
            return 0
        occupancy = max(0.0, load.waiting + load.running - finished_since) + may_wait + into_slots
        capacity = max_running if max_running is not None else self._peak_running
        free = math.ceil(share * capacity - occupancy)
        if free >= 1:
            return free
        if share < 1 or max_running is not None or into_slots:
            return 0
        # Probe: one more per scrape, doubling until the engine first queued.
        return 1 if self._seen_waiting else max(1, int(occupancy))

    def _oldest_snapshot(self) -> float | None:
        starts = [s[1] for s in self._samples.values() if s is not None]
        return min(starts) if len(starts) == len(self._samples) else None
