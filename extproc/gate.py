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

Pure: the caller passes ``now`` (a monotonic clock) to every method.
"""

from __future__ import annotations

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
        # Released and not finished, in release order: request -> release time.
        self._in_flight: dict[Hashable, float] = {}
        # (finished at, released at) of requests finished since the oldest snapshot.
        self._finished: deque[tuple[float, float]] = deque()

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    def record_scrape(self, endpoint: str, load: EngineLoad | None, started_at: float) -> None:
        """A scrape of ``endpoint`` that started at ``started_at`` returned ``load`` (None: failed)."""
        self._samples[endpoint] = None if load is None else (load, started_at)
        oldest = self._oldest_snapshot()
        if oldest is not None:
            while self._finished and self._finished[0][0] <= oldest:
                self._finished.popleft()

    def record_release(self, request: Hashable, now: float) -> None:
        self._in_flight[request] = now

    def record_finish(self, request: Hashable, now: float) -> None:
        released_at = self._in_flight.pop(request)
        self._finished.append((now, released_at))

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

    def estimated_waiting(self) -> float:
        """The engine's waiting queue now, by the correction in the module docstring."""
        oldest = self._oldest_snapshot()
        load = self.engine_load()
        if oldest is None or load is None:
            raise ValueError("no complete snapshot to estimate from")
        horizon = oldest - VISIBILITY_GRACE_S
        finished_since = sum(1 for done, released in self._finished if done > oldest and released < horizon)
        unseen = 0
        for released in reversed(self._in_flight.values()):
            if released < horizon:
                break
            unseen += 1
        return max(0.0, load.waiting - finished_since) + unseen

    def allowance(self, now: float) -> int:
        """How many requests may be released now (never negative)."""
        if self.mode(now) is GateMode.FALLBACK:
            return max(0, self._fallback_limit - len(self._in_flight))
        return max(0, int(self._target - self.estimated_waiting()))

    def _oldest_snapshot(self) -> float | None:
        starts = [s[1] for s in self._samples.values() if s is not None]
        return min(starts) if len(starts) == len(self._samples) else None
