"""What a model's dispatcher reports as it works: four kinds of event, through one call.

The core hands each event to its :class:`DispatchReport` and knows nothing of
Prometheus or logging; the adapter (``telemetry.ModelTelemetry``) turns each
into its series, its decision-log line and, where an event carries a
``note``, the operator's log line. Bands are named by their class; the model
is the reporter's own. Tenants are passed as the client's tenant id: bounding
what becomes a label value is the adapter's business, not the scheduler's.

Events are made on the hot path (a few per request): small slotted records,
and an adapter that ignores one returns at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from extproc.core.values.engine_load import EngineLoad
from extproc.core.values.outcomes import Refusal


class Step(StrEnum):
    """What happened to a request at the queue."""

    QUEUED = "queued"  # it entered the queue
    RELEASED = "released"  # it left the queue for the engine
    REFUSED = "refused"  # it was answered instead: a cap at the door, its queue timeout, the drain
    ABANDONED = "abandoned"  # its client left while it was queued
    PREEMPTED = "preempted"  # released, it was ended before its response began (a higher band's objective)


@dataclass(frozen=True, slots=True)
class RequestEvent:
    """One request's step; every request that reaches the queue reports QUEUED and exactly one step after it.

    QUEUED is reported once the dispatcher has taken the arrival in (``decision_s``): a request released in that
    same moment has reported its RELEASED just before.
    """

    step: Step
    band: str
    tenant: str
    # Time in the queue until this step.
    waited_s: float = 0.0
    refusal: Refusal | None = None
    # Whether this step took it out of the queue (a refusal at the door: it never entered).
    dequeued: bool = True
    # Its TTFT objective's slack at this step: deadline - now (negative: missed); None: no objective.
    # Set on RELEASED, on REFUSED and ABANDONED of a queued request, and on PREEMPTED.
    slack_s: float | None = None
    # The request's tag (``Request.tag``): empty for most.
    tag: str = ""
    # QUEUED: how long the dispatcher took to take the arrival in (as PoolEvent.decision_s for one refused at the
    # door), and whether its cost was clamped (PoolEvent.cost_clamped).
    decision_s: float | None = None
    cost_clamped: bool = False

    @property
    def outcome(self) -> str:
        """``released``, ``refused:<reason>`` or ``abandoned``: the decision log's word for it."""
        return f"refused:{self.refusal.value}" if self.refusal is not None else self.step.value


@dataclass(frozen=True, slots=True)
class Charged:
    """A released request ended; what it was charged in the end (``cost.py``: estimate, then correction)."""

    tenant: str
    prompt_tokens: float
    output_tokens: float
    cost: float
    # Of the prompt tokens, those charged as cached (prefix signatures: cost.py).
    cached_tokens: float = 0.0


class Change(StrEnum):
    """What changed about one endpoint."""

    SCRAPED = "scraped"  # a good scrape (load, and what the release rule shows for it now)
    SCRAPE_FAILED = "scrape_failed"
    LEFT = "left"  # it left the pool: forget what was reported about it
    DEGRADED = "degraded"  # its metrics became unusable: it runs on its fallback cap
    USABLE = "usable"  # its metrics are usable again
    DOWN = "down"  # its engine is unreachable: nothing is released to it
    UP = "up"  # reachable (again)
    RELEASE_FAILED = "release_failed"  # a release failed before the engine answered
    LIMITS = "limits"  # the engine said what it runs and holds at most (note: what, and what is wrong with it)
    REFUSED_FULL = "refused_full"  # the engine refused a release as full (its own queue cap), after Envoy's retries


@dataclass(frozen=True, slots=True)
class EndpointEvent:
    # None: a release failure where the pool cannot tell which endpoint took it.
    endpoint: str | None
    change: Change
    load: EngineLoad | None = None
    itl_s: float | None = None
    # The rule's limit for the endpoint (None: the rule has no such number).
    limit: float | None = None
    # For the operator's log; empty: nothing to say (the change is routine).
    note: str = ""
    # The note is a warning (logged as one), not news.
    warning: bool = False
    # SCRAPED: requests the engine says it refused at its own queue cap since its last page.
    refused: float = 0.0


@dataclass(frozen=True, slots=True)
class PoolEvent:
    """The model as a whole; each field set is one fact, None (or False) says nothing of it.

    Not how many are in flight: that changes with every release and end, and
    is read where it is shown (``ModelDispatcher.in_flight``), not reported.
    """

    # The gate runs on fallback limits (some endpoint degraded), or no longer.
    fallback: bool | None = None
    note: str = ""
    # How long the dispatcher took to take in one arrival (caps, estimate, queue, dispatch).
    decision_s: float | None = None
    # The arrival's max_tokens or Content-Length was beyond the model's context: its cost was clamped.
    cost_clamped: bool = False


Event = RequestEvent | Charged | EndpointEvent | PoolEvent


class DispatchReport(Protocol):
    def __call__(self, event: Event) -> None: ...
