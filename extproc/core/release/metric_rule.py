"""What the rules that read the engines' metrics share: their own arithmetic while the metrics can be
trusted, the fallback caps where they cannot.

A degraded endpoint (``health.py``) gets at most its fallback cap of our
requests, whatever the rule would say. Without endpoint picking the pool is
one unit: one degraded endpoint puts the whole pool on the caps (Envoy
spreads requests over every endpoint, so ours on each are not known). A down
endpoint is degraded too, and its cap is not counted: the pool's caps are
those of the endpoints that are up.
"""

from __future__ import annotations

from extproc.core.release.rule import ReleaseRule


class MetricRule(ReleaseRule):
    """A rule whose arithmetic (``room``: how many more by the metrics, unfloored) reads the scraped load."""

    def allowance(self, now: float) -> int:
        if self.health.degraded(now):
            return sum(self.health.fallback_limit(e) for e in self.health.serving()) - self.estimate.cluster_in_flight
        return int(self.room(None))

    def endpoint_allowance(self, endpoint: str, now: float) -> int:
        if not self.health.healthy(endpoint, now):
            return max(0, self.health.fallback_limit(endpoint) - self.estimate.in_flight_on(endpoint))
        return max(0, int(self.room(endpoint)))

    def room(self, endpoint: str | None) -> float:
        """More requests ``endpoint`` (None: the whole pool) may take by this rule, its metrics trusted."""
        raise NotImplementedError
