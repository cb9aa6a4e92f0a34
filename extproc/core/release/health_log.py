"""Telling the report when endpoint health changes: once per change, not per dispatch.

The dispatcher calls :meth:`HealthLog.note` before each dispatch, twice per
request; it looks at the endpoints only when something may have changed (an
event about their health, the pool's rule, or a usable page going stale), so
a dispatch where nothing did costs a comparison. An
endpoint going down (its engine unreachable) or up again, turning degraded or
usable again, and the pool going onto or off the fallback caps, each become
one event. Each carries, in its ``note``, the line an operator should read;
the adapter logs it (the core does no I/O).
"""

from __future__ import annotations

import math

from extproc.core.release.pool import Pool
from extproc.core.values.report import Change, DispatchReport, EndpointEvent, PoolEvent


class HealthLog:
    """What was last reported of each endpoint's health, so that only changes are reported."""

    def __init__(self, model: str, pool: Pool, report: DispatchReport) -> None:
        self._model = model
        self._pool = pool
        self._report = report
        self._degraded: set[str] = set()
        self._down: set[str] = set()
        # Endpoints whose up/down state was reported: each is reported once at first, then on changes.
        self._reported: set[str] = set()
        self._fallback: bool | None = None
        # What the last look saw (the pool's health version), and until when that look stays true.
        self._version = -1
        self._until = -math.inf

    def note(self, now: float) -> None:
        pool = self._pool
        version = pool.health_version
        if version == self._version and now <= self._until:
            return
        self._look(now)
        self._version = version
        self._until = pool.stable_until(now)

    def _look(self, now: float) -> None:
        self._note_down()
        unusable = set(self._pool.degraded(now))
        degraded = unusable - self._down  # a down endpoint is reported as down, not as degraded
        for endpoint in degraded - self._degraded:
            # Not scraped yet (start-up, a new DNS member): nothing to tell, the scraper reports failures.
            scraped = self._pool.last_good(endpoint) is not None
            self._report(EndpointEvent(endpoint, Change.DEGRADED, note=(
                f"model {self._model}: metrics of {endpoint} unusable (failing or stale), capping it at "
                f"{self._pool.fallback_limit(endpoint)} in flight") if scraped else ""))
        for endpoint in self._degraded - degraded:
            self._report(EndpointEvent(endpoint, Change.USABLE, note=f"model {self._model}: metrics of {endpoint} usable again"))
        self._degraded = degraded
        fallback = bool(unusable)
        if fallback != self._fallback:
            note = "" if self._fallback is None else (
                f"model {self._model}: gating on the fallback in-flight limits" if fallback
                else f"model {self._model}: engine metrics usable again, gating on the engine queue")
            self._report(PoolEvent(fallback=fallback, note=note))
            self._fallback = fallback

    def _note_down(self) -> None:
        down = set(self._pool.down())
        for endpoint in set(self._pool.endpoints) - self._reported - down:
            self._report(EndpointEvent(endpoint, Change.UP))
        self._reported = set(self._pool.endpoints)
        for endpoint in sorted(down - self._down):
            self._report(EndpointEvent(endpoint, Change.DOWN, note=(
                f"model {self._model}: engine at {endpoint} unreachable, releasing nothing to it until it answers "
                f"again ({len(self._pool.endpoints) - len(down)} of {len(self._pool.endpoints)} endpoints up)")))
        for endpoint in sorted(self._down - down):
            self._report(EndpointEvent(endpoint, Change.UP, note=f"model {self._model}: engine at {endpoint} reachable again"))
        self._down = down
