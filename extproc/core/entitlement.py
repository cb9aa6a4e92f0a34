"""What a tenant is entitled to, and which band a request gets: the one it asks for, limited by that.

A scheduling rule, so it lives in the core: a tenant entitled to `standard`
and `batch` that asks for `interactive` is downgraded to the next lower band
it may use (never upgraded), and refused when there is none. A request that
asks for no band, or for one that does not exist, gets the tenant's default.
What a request asks for (a header, an objective, its body) is the adapter's
reading; this module only decides.
"""

from __future__ import annotations

from dataclasses import dataclass

from extproc.core.values.outcomes import Refusal, Refused


@dataclass(frozen=True)
class Tenant:
    """One tenant: every setting of it the program reads, as the config resolved them (inherited, defaulted).

    The config builds these straight from the file's ``tenants:`` entries, so
    a new tenant setting is a field here and one in the file's struct; the
    queue caps (``caps.py``), the policies (its weight) and :func:`grant` read it.
    """

    # The bands it may use, by name, highest first.
    bands: tuple[str, ...]
    # The band of a request that asks for none (or for one that does not exist).
    default_band: str
    # Its share against other backlogged tenants (the band's policy).
    weight: float = 1.0
    # Requests of this tenant a model may hold; one more is refused.
    max_queued: int = 1_000


@dataclass(frozen=True)
class Granted:
    """The band a request is queued in (an index into the bands, highest first)."""

    band: int
    # The band it asked for, when it was downgraded.
    requested: int | None = None


def grant(bands: tuple[str, ...], tenant: Tenant, name: str, asked: str) -> Granted:
    """The band tenant ``name`` gets when it asks for ``asked``; raises Refused when it may use none at or below it.

    ``bands`` are every band's name, highest first; the tenant's are a subset.
    """
    if asked not in bands:  # none, or a band that does not exist
        return Granted(bands.index(tenant.default_band))
    requested = bands.index(asked)
    if asked in tenant.bands:
        return Granted(requested)
    lower = [bands.index(b) for b in tenant.bands if bands.index(b) > requested]
    if not lower:
        raise Refused(Refusal.PRIORITY_NOT_ALLOWED, f"tenant {name!r} may not use priority {asked!r}; "
                      f"its classes are {', '.join(tenant.bands)}")
    return Granted(min(lower), requested=requested)
