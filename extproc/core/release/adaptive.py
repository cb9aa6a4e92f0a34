"""``gate: adaptive`` (the default): each endpoint may hold up to a limit learned online.

``allowance = limit - held`` per endpoint, where ``held`` is the load
estimate's (ours exactly, plus the foreign part of the newest scrape) and
``limit`` is learned by :class:`~extproc.core.release.adaptive_limit.ConcurrencyLimit`:
the engine's capacity plus ``target_waiting``, cut by the optional
inter-token latency and KV usage ceilings. A completion is refilled at once,
without waiting for the next scrape. With ``max_running`` (the engine's batch
size, when the operator knows it) the limit starts there instead of ramping
up from ``target_waiting``; ``max_in_flight`` caps it.
"""

from __future__ import annotations

from collections.abc import Sequence

from extproc.core.release.adaptive_limit import ConcurrencyLimit
from extproc.core.release.estimate import LoadEstimate
from extproc.core.release.health import EndpointHealth
from extproc.core.release.metric_rule import MetricRule
from extproc.core.release.rule import RuleSettings, RuleSnapshot
from extproc.core.values.engine_load import EngineLimits, EngineLoad


class Adaptive(MetricRule):
    name = "adaptive"

    def __init__(self, settings: RuleSettings, estimate: LoadEstimate, health: EndpointHealth) -> None:
        super().__init__(settings, estimate, health)
        self._limits: dict[str, ConcurrencyLimit] = {}
        self.set_endpoints(estimate.endpoints)

    def set_endpoints(self, endpoints: Sequence[str]) -> None:
        self._limits = {e: self._limits[e] if e in self._limits else self._new_limit() for e in endpoints}

    def _new_limit(self) -> ConcurrencyLimit:
        # Nothing known yet (no max_running): assume no spare batch capacity, so the
        # first releases can at most fill the engine's queue to target; the limit
        # grows from there.
        s = self.settings
        return ConcurrencyLimit(
            s.target_waiting + (s.max_running or 0),
            target_waiting=s.target_waiting,
            max_itl_s=s.max_itl_s,
            max_kv_usage=s.max_kv_usage,
            itl_window_s=s.itl_window_s,
            cap=s.max_in_flight,
            floor=s.max_running,
        )

    def record_scrape(self, endpoint: str, load: EngineLoad, started_at: float, held_then: float | None) -> None:
        self._limits[endpoint].observe(load, started_at, held=held_then)

    def record_limits(self, endpoint: str, limits: EngineLimits) -> None:
        limit = self._limits.get(endpoint)
        if limit is not None:
            limit.set_engine(limits.max_running, limits.max_held)

    def runs(self, endpoint: str) -> float | None:
        limit = self._limits.get(endpoint)
        return limit.shown or None if limit is not None else None

    def record_refusal(self, endpoint: str, now: float, held: float) -> None:
        limit = self._limits.get(endpoint)
        if limit is not None:
            limit.refused(now, held)

    def room(self, endpoint: str | None) -> float:
        if endpoint is not None:
            return self._limits[endpoint].limit - self.estimate.now(endpoint).held
        total: float = 0
        for limit in self._limits.values():  # a loop, not sum() over a generator: every release asks
            total += limit.limit
        return total - self.estimate.now(None).held

    def snapshot(self, endpoint: str) -> RuleSnapshot:
        limit = self._limits.get(endpoint)
        return RuleSnapshot() if limit is None else RuleSnapshot(limit=limit.limit, itl_s=limit.itl.value())
