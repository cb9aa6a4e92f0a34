"""Telling the report and the operator when endpoint health changes: once per change, not per dispatch.

The dispatcher calls :meth:`HealthLog.note` before each dispatch; an
endpoint going down (its engine unreachable) or up again, turning degraded or
usable again, and the pool going onto or off the fallback caps, each become
one report call and one log line.
"""

from __future__ import annotations

import logging

from extproc.core.release.pool import Pool
from extproc.core.report import DispatchReport

log = logging.getLogger(__name__)


class HealthLog:
    def __init__(self, model: str, pool: Pool, report: DispatchReport) -> None:
        self._model = model
        self._pool = pool
        self._report = report
        self._degraded: set[str] = set()
        self._down: set[str] = set()
        # Endpoints whose up/down state was reported: each is reported once at first, then on changes.
        self._reported: set[str] = set()
        self._fallback: bool | None = None

    def note(self, now: float) -> None:
        self._note_down()
        unusable = set(self._pool.degraded(now))
        degraded = unusable - self._down  # a down endpoint is reported as down, not as degraded
        for endpoint in degraded - self._degraded:
            self._report.endpoint_degraded(endpoint, True)
            if self._pool.health.last_good(endpoint) is None:
                continue  # not scraped yet (start-up, a new DNS member): the scraper reports failures
            log.warning("model %s: metrics of %s unusable (failing or stale), capping it at %d in flight",
                        self._model, endpoint, self._pool.health.fallback_limit(endpoint))
        for endpoint in self._degraded - degraded:
            self._report.endpoint_degraded(endpoint, False)
            log.info("model %s: metrics of %s usable again", self._model, endpoint)
        self._degraded = degraded
        fallback = bool(unusable)
        if fallback != self._fallback:
            self._report.fallback(fallback)
            if fallback and self._fallback is not None:
                log.warning("model %s: gating on the fallback in-flight limits", self._model)
            elif self._fallback is not None:
                log.info("model %s: engine metrics usable again, gating on the engine queue", self._model)
            self._fallback = fallback

    def _note_down(self) -> None:
        down = set(self._pool.down())
        for endpoint in set(self._pool.endpoints) - self._reported - down:
            self._report.endpoint_up(endpoint, True)
        self._reported = set(self._pool.endpoints)
        for endpoint in sorted(down - self._down):
            self._report.endpoint_up(endpoint, False)
            log.warning("model %s: engine at %s unreachable, releasing nothing to it until it answers again "
                        "(%d of %d endpoints up)", self._model, endpoint,
                        len(self._pool.endpoints) - len(down), len(self._pool.endpoints))
        for endpoint in sorted(self._down - down):
            self._report.endpoint_up(endpoint, True)
            log.info("model %s: engine at %s reachable again", self._model, endpoint)
        self._down = down
