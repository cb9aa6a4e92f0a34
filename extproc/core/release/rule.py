"""The release-rule seam: what every rule answers, and what it is told.

A release rule decides how many held requests a model pool may release now.
It is only that arithmetic. What the rules share is built once per pool,
below them (``pool.py``):

* the load estimate (``estimate.py``): what the engines hold now, with our
  own requests counted exactly;
* endpoint health (``health.py``): whose metrics can be trusted now.

The band rules (reserved waiting, idle-only) sit above the rule
(``core/bands.py``), and endpoint picking sits beside it (``picking.py``). So
a new rule cannot get the accounting subtly wrong: it never does any.

A rule is told every release, finish, usable scrape and release the engine
refused as full. It answers
``allowance`` for the pool, ``endpoint_allowance`` for one endpoint (endpoint
picking), ``next_change_in`` when its allowance grows with time alone, and a
``snapshot`` for telemetry. One class per rule, one module each, registered
by its config name in ``release/__init__.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from extproc.core.release.estimate import LoadEstimate
from extproc.core.release.health import EndpointHealth
from extproc.core.values.engine_load import EngineLimits, EngineLoad


@dataclass(frozen=True)
class RuleSettings:
    """A model's settings that a rule may read (None: not set).

    Named as the config's keys (``requires`` lists them by these names), but
    for ``max_itl_s``: the config's ``max_inter_token_latency_ms``, in seconds.
    """

    target_waiting: int
    # Per endpoint: the cap on what the engine may hold (adaptive), or on our requests (static_concurrency).
    max_in_flight: int | None = None
    # Requests per second for the whole pool (static_rate).
    release_rate: float | None = None
    # The adaptive limit's optional ceilings, and the window the inter-token latency is averaged over.
    max_itl_s: float | None = None
    max_kv_usage: float | None = None
    itl_window_s: float = 2.0
    # The engine's batch size per endpoint, when the operator knows it.
    max_running: int | None = None


@dataclass(frozen=True)
class RuleSnapshot:
    """What telemetry shows of a rule for one endpoint; None where the rule has no such number."""

    # Requests the rule lets the endpoint hold (running + waiting).
    limit: float | None = None
    # The engine's recent inter-token latency, where the rule measures it.
    itl_s: float | None = None


class ReleaseRule:
    """How many held requests one model pool may release now (see the module docstring)."""

    # The config's `gate:` value.
    name: ClassVar[str]
    # RuleSettings fields the rule cannot work without: the config refuses a model that leaves one unset.
    requires: ClassVar[tuple[str, ...]] = ()
    # Whether the rule can say what each endpoint may take (endpoint picking needs it).
    per_endpoint: ClassVar[bool] = True
    # Whether the rule reads the engines' metrics: only then does a degraded endpoint change anything.
    uses_metrics: ClassVar[bool] = True

    def __init__(self, settings: RuleSettings, estimate: LoadEstimate, health: EndpointHealth) -> None:
        missing = [field for field in self.requires if getattr(settings, field) is None]
        if missing:
            raise ValueError(f"{self.name} needs {', '.join(missing)}")
        self.settings = settings
        self.estimate = estimate
        self.health = health

    def allowance(self, now: float) -> int:
        """Requests the pool may get now, endpoints not told apart (negative: more are out than allowed)."""
        raise NotImplementedError

    def endpoint_allowance(self, endpoint: str, now: float) -> int:
        """Requests ``endpoint`` may get now, never negative (only for rules with ``per_endpoint``)."""
        raise NotImplementedError(f"{self.name} has no per-endpoint state")

    def set_endpoints(self, endpoints: Sequence[str]) -> None:
        """The pool's members changed (the estimate and health already know)."""

    def record_release(self, now: float) -> None:
        """A request was released (the estimate has counted it)."""

    def record_finish(self, now: float) -> None:
        """A released request finished (the estimate has counted it)."""

    def record_scrape(self, endpoint: str, load: EngineLoad, started_at: float, held_then: float | None) -> None:
        """A usable scrape of ``endpoint`` (failed and frozen ones never reach a rule).

        ``held_then`` is what the endpoint held when the scrape started, our
        requests counted exactly, where ours can be told apart per endpoint;
        else None.
        """

    def record_limits(self, endpoint: str, limits: EngineLimits) -> None:
        """What the engine at ``endpoint`` says of its own limits (read once it answers)."""

    def runs(self, endpoint: str) -> float | None:
        """What the rule believes ``endpoint`` runs at once (None: it does not know)."""
        return self.settings.max_running

    def record_refusal(self, endpoint: str, now: float, held: float) -> None:
        """The engine at ``endpoint`` refused requests as full (its own queue cap) while holding ``held``: its
        counter rose on a scrape (``held`` as ``record_scrape``'s), or a release was answered so."""

    def next_change_in(self, now: float) -> float | None:
        """Seconds until the allowance grows with no event at all (a rate), else None."""
        return None

    def snapshot(self, endpoint: str) -> RuleSnapshot:
        return RuleSnapshot()
