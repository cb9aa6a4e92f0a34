"""What the adapters report of a model beside the core's events: admissions, refusals, signatures, round trips.

They take the same road as the core's (``core/values/report.py``): into the model's
recorder (model.py), which writes their series.
"""

from __future__ import annotations

from dataclasses import dataclass

from extproc.core.values.outcomes import Refusal


@dataclass(frozen=True, slots=True)
class Admitted:
    """The servicer admitted a request by ``name`` (a served name, or the pattern it matched)."""

    name: str
    # The class it asked for and the one it got, when it was downgraded.
    requested: str | None = None
    granted: str | None = None


@dataclass(frozen=True, slots=True)
class TurnedAway:
    """The servicer answered a request before its tenant was known (a bad body, overload, a missing tenant...)."""

    refusal: Refusal


@dataclass(frozen=True, slots=True)
class Signed:
    """The servicer computed a request's prefix signature: ``blocks`` leading blocks hashed."""

    blocks: int


@dataclass(frozen=True, slots=True)
class ServedElsewhere:
    """The gateway served a release on another endpoint than the pick (a fallback was taken)."""


@dataclass(frozen=True, slots=True)
class ClusterTrip:
    """One round trip to the cluster's Redis: ``seconds`` when it succeeded (None: it failed)."""

    seconds: float | None
    instances: int | None = None


AdapterEvent = Admitted | TurnedAway | Signed | ServedElsewhere | ClusterTrip
