"""One model pool as the release side sees it: the shared pieces under its release rule, fed in one place.

A pool (one or more engine endpoints serving a model) has one load estimate
(``estimate.py``), one record of endpoint health (``health.py``) and one
release rule (``rule.py``, chosen by the config's ``gate:``). Every event —
a release, a finish, a scrape, a change of members — reaches each piece that
needs it here, in one order, so no rule can miss one. The dispatcher asks the
pool how many may go (through the band rules, ``core/bands.py``) and where
each goes (``picking.py``).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from extproc.core.engine_load import EngineLoad
from extproc.core.release import picking
from extproc.core.release.estimate import LoadEstimate
from extproc.core.release.health import EndpointHealth
from extproc.core.release.rule import ReleaseRule, RuleSettings


class Pool:
    """The release side of one model pool. Pure: the caller passes ``now`` to every method."""

    def __init__(
        self,
        endpoints: Sequence[str],
        rule: type[ReleaseRule],
        settings: RuleSettings,
        *,
        stale_after_s: float,
        fallback_max_in_flight: int,
        pick_endpoints: bool = False,
    ) -> None:
        if pick_endpoints and not rule.per_endpoint:
            raise ValueError(f"{rule.name} does not pick endpoints (it has no per-endpoint state)")
        self.settings = settings
        self.pick_endpoints = pick_endpoints
        self.estimate = LoadEstimate(endpoints, stale_after_s=stale_after_s, per_endpoint=pick_endpoints)
        self.health = EndpointHealth(endpoints, stale_after_s=stale_after_s, fallback_max_in_flight=fallback_max_in_flight)
        self.rule = rule(settings, self.estimate, self.health)

    @property
    def endpoints(self) -> tuple[str, ...]:
        return self.estimate.endpoints

    @property
    def in_flight(self) -> int:
        return self.estimate.in_flight

    def set_endpoints(self, endpoints: Sequence[str]) -> None:
        """The pool's members changed (DNS); new ones start degraded until scraped."""
        self.estimate.set_endpoints(endpoints)
        self.health.set_endpoints(endpoints)
        self.rule.set_endpoints(self.endpoints)

    def record_release(
        self, request: Hashable, now: float, endpoint: str | None = None, *, into_free_slot: bool = False
    ) -> None:
        self.estimate.record_release(request, now, endpoint, into_free_slot)
        self.health.record_release(endpoint, now)
        self.rule.record_release(now)

    def record_finish(self, request: Hashable, now: float) -> float:
        """Note a finished request; returns how long it was released (its occupancy)."""
        occupancy = self.estimate.record_finish(request, now)
        self.rule.record_finish(now)
        return occupancy

    def record_scrape(self, endpoint: str, load: EngineLoad | None, started_at: float) -> None:
        """A scrape of ``endpoint`` that started at ``started_at`` returned ``load`` (None: failed)."""
        if not self.health.record_scrape(endpoint, load, started_at):
            return  # failed, frozen, or of an endpoint that left: nothing to learn from it
        assert load is not None
        held_then = self.estimate.record_scrape(endpoint, load, started_at)
        self.rule.record_scrape(endpoint, load, started_at, held_then)

    def allowance(self, now: float) -> int:
        """How many requests may be released now, never negative (with picking: what the endpoints may take)."""
        if self.pick_endpoints:
            return sum(self.rule.endpoint_allowance(e, now) for e in self.endpoints)
        return max(0, self.rule.allowance(now))

    def degraded(self, now: float) -> list[str]:
        """Endpoints whose metrics are unusable now, where the rule reads metrics at all."""
        return self.health.degraded(now) if self.rule.uses_metrics else []

    def pick(self, key: str, now: float) -> str | None:
        """The endpoint for the next release with affinity ``key`` (None: without picking, or no room)."""
        if not self.pick_endpoints:
            return None
        return picking.pick(key, self.endpoints, lambda e: self.rule.endpoint_allowance(e, now),
                            self.settings.target_waiting)
