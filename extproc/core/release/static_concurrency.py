"""``gate: static_concurrency``: at most ``max_in_flight`` of our requests per endpoint; metrics unused.

A fixed ceiling, the baseline every metric-driven rule is measured against.
It ignores the engines' metrics, so whether they can be read does not matter
to it; traffic around the gateway is not seen at all. Only a down endpoint
(its engine unreachable, ``health.py``) changes it: its cap is not counted.
"""

from __future__ import annotations

from extproc.core.release.rule import ReleaseRule, RuleSnapshot


class StaticConcurrency(ReleaseRule):
    name = "static_concurrency"
    requires = ("max_in_flight",)
    uses_metrics = False

    @property
    def _cap(self) -> int:
        cap = self.settings.max_in_flight
        assert cap is not None  # `requires`
        return cap

    def allowance(self, now: float) -> int:
        return self._cap * len(self.health.serving()) - self.estimate.cluster_in_flight

    def endpoint_allowance(self, endpoint: str, now: float) -> int:
        return max(0, self._cap - self.estimate.in_flight_on(endpoint))

    def snapshot(self, endpoint: str) -> RuleSnapshot:
        return RuleSnapshot(limit=self._cap)
