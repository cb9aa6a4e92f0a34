"""What one model's scheduler holds now, as plain values: the status page's and ``/readyz``'s view.

Built on request by :meth:`ModelDispatcher.status` from state the dispatcher
keeps anyway, so serving the page costs the hot path nothing: no counter is
updated per request for it. Only the largest tenants of each band are listed
(``top``), the rest summed, so the answer stays small however many tenants
are queued.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TenantQueued:
    tenant: str
    queued: int


@dataclass(frozen=True)
class BandStatus:
    """One priority class: what is queued in it, the largest tenants first."""

    name: str
    queued: int
    top_tenants: tuple[TenantQueued, ...]
    # Requests queued by tenants beyond the top ones, and how many such tenants.
    other_queued: int
    other_tenants: int


@dataclass(frozen=True)
class EndpointStatus:
    """One engine endpoint as the release side sees it."""

    url: str
    # The last usable scrape (None: none yet) and how long ago it started.
    running: float | None
    waiting: float | None
    scraped_ago_s: float | None
    # What the release rule lets it hold (running + waiting); None where the rule has no such number.
    limit: float | None
    # Metrics unusable now (the rule falls back to a cautious cap), or the engine unreachable.
    degraded: bool
    down: bool
    # Released requests counted against it and not finished (with endpoint picking; 0 otherwise).
    in_flight: int
    # What the operator must fix about the engine's own settings ("": nothing), e.g. a queue cap too tight.
    warning: str = ""


@dataclass(frozen=True)
class ClusterStatus:
    """A model's seat in an active-active cluster (``cluster.py``)."""

    # Live instances at the last round trip, this one included.
    instances: int
    # The cluster's Redis cannot be reached: this instance releases on its own share.
    degraded: bool


@dataclass(frozen=True)
class ModelStatus:
    name: str
    rule: str
    # Whether the rule reads the engines' metrics (static rules do not: they need no scrape to work).
    uses_metrics: bool
    # The configured pool-wide release rate (`static_rate`: requests per second), else None.
    rule_rate: float | None
    queued: int
    in_flight: int
    # Releases per second over the last ten seconds.
    release_rate: float
    bands: tuple[BandStatus, ...]
    endpoints: tuple[EndpointStatus, ...]
    # None: one instance schedules the model alone.
    cluster: ClusterStatus | None = None

    @property
    def known(self) -> bool:
        """Whether the pool is known well enough to gate: a usable scrape of some endpoint since start, where the rule
        needs one; or no engine up (no member, or every one down): its requests are held until one is (the cold
        start), which needs no scrape."""
        return (not self.uses_metrics or any(e.scraped_ago_s is not None for e in self.endpoints)
                or all(e.down for e in self.endpoints))


def band_status(name: str, lengths: dict[str, int], top: int) -> BandStatus:
    """``lengths`` (tenant -> queued) as the ``top`` largest, ties by name, and the rest summed."""
    ranked = sorted(lengths.items(), key=lambda item: (-item[1], item[0]))
    shown, rest = ranked[:top], ranked[top:]
    return BandStatus(
        name=name,
        queued=sum(lengths.values()),
        top_tenants=tuple(TenantQueued(t, n) for t, n in shown),
        other_queued=sum(n for _, n in rest),
        other_tenants=len(rest),
    )
