"""Which priority class a request gets: the one it asks for, limited by what its tenant may use.

A scheduling rule, so it lives in the core: a tenant entitled to `standard`
and `batch` that asks for `interactive` is downgraded to the next lower class
it may use (never upgraded), and refused when there is none. A request that
asks for no class, or for one that does not exist, gets the tenant's default.
What a request asks for (a header, an objective, its body) is the adapter's
reading; this module only decides.
"""

from __future__ import annotations

from dataclasses import dataclass

from extproc.core.outcomes import Refusal, Refused


@dataclass(frozen=True)
class Granted:
    """The band a request is queued in (an index into the classes, highest first)."""

    band: int
    # The band it asked for, when it was downgraded.
    requested: int | None = None


def grant(classes: tuple[str, ...], allowed: tuple[str, ...], default: str, tenant: str, asked: str) -> Granted:
    """The class ``tenant`` gets when it asks for ``asked``; raises Refused when it may use none at or below it.

    ``classes`` are every class, highest first; ``allowed`` the tenant's (a
    subset); ``default`` the class of a request that asks for none.
    """
    if asked not in classes:  # none, or a class that does not exist
        return Granted(classes.index(default))
    requested = classes.index(asked)
    if asked in allowed:
        return Granted(requested)
    lower = [classes.index(c) for c in allowed if classes.index(c) > requested]
    if not lower:
        raise Refused(Refusal.PRIORITY_NOT_ALLOWED, f"tenant {tenant!r} may not use priority {asked!r}; "
                      f"its classes are {', '.join(allowed)}")
    return Granted(min(lower), requested=requested)
