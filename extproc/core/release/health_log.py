"""Telling the report and the operator when endpoint health changes: once per change, not per dispatch.

The dispatcher calls :meth:`HealthLog.note` before each dispatch; an
endpoint turning degraded or usable again, and the pool going onto or off the
fallback caps, each become one report call and one log line.
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
        self._fallback: bool | None = None

    def note(self, now: float) -> None:
        degraded = set(self._pool.degraded(now))
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
        fallback = bool(degraded)
        if fallback != self._fallback:
            self._report.fallback(fallback)
            if fallback and self._fallback is not None:
                log.warning("model %s: gating on the fallback in-flight limits", self._model)
            elif self._fallback is not None:
                log.info("model %s: engine metrics usable again, gating on the engine queue", self._model)
            self._fallback = fallback
