"""``gate: static_rate``: at most ``release_rate`` requests per second for the pool; metrics unused.

A token bucket with one request of burst. Its allowance grows with time
alone, so it is the one rule with a ``next_change_in``: the dispatcher sets
a wake-up for it instead of polling. It keeps no per-endpoint state, so it
cannot be combined with endpoint picking.
"""

from __future__ import annotations

from extproc.core.release.estimate import LoadEstimate
from extproc.core.release.health import EndpointHealth
from extproc.core.release.rule import ReleaseRule, RuleSettings


class StaticRate(ReleaseRule):
    name = "static_rate"
    requires = ("release_rate",)
    per_endpoint = False
    uses_metrics = False

    def __init__(self, settings: RuleSettings, estimate: LoadEstimate, health: EndpointHealth) -> None:
        super().__init__(settings, estimate, health)
        assert settings.release_rate is not None  # `requires`
        self._rate = settings.release_rate
        self._tokens = 1.0
        self._at: float | None = None

    def _refill(self, now: float) -> None:
        if self._at is not None:
            self._tokens = min(1.0, self._tokens + (now - self._at) * self._rate)
        self._at = now

    def allowance(self, now: float) -> int:
        self._refill(now)
        return int(self._tokens)

    def record_release(self, now: float) -> None:
        self._refill(now)
        self._tokens -= 1

    def next_change_in(self, now: float) -> float | None:
        self._refill(now)
        return max(0.0, (1.0 - self._tokens) / self._rate)
