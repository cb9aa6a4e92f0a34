"""What may enter a model's queue: the tenant's, the band's and the model's caps, checked before a request is held.

A request over a cap is refused at once rather than queued to time out. The
tenant's own cap is checked first: when its own backlog is the cause, it
should hear so (the ext_proc adapter answers that 429, the others 503).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from extproc.core.bands import Band
from extproc.core.fair_queue import FairQueue
from extproc.core.values.outcomes import Refusal


@dataclass(frozen=True)
class Overflow:
    """A cap a request does not fit under: which, the backlog behind it, and why in words."""

    refusal: Refusal
    backlog: int
    message: str


def overflow(
    model: str, queue: FairQueue[Any], tenant: str, tenant_cap: int, band: int, rules: Band, max_queued: int
) -> Overflow | None:
    """The cap a new request of ``tenant`` (who may hold ``tenant_cap``) in ``band`` (``rules``) would exceed, or None."""
    own = queue.tenants.get(tenant, 0)  # the queue's counts, read without a call: every arrival asks
    if own >= tenant_cap:
        return Overflow(Refusal.TENANT_QUEUE_FULL, own,
                        f"tenant {tenant!r} already has {own} requests queued for model {model!r}")
    in_band = queue.band_sizes[band]
    cap = rules.max_queued
    if cap is not None and in_band >= cap:
        return Overflow(Refusal.BAND_QUEUE_FULL, in_band, f"the {rules.name!r} queue for model {model!r} is full ({cap})")
    queued = queue.size
    if queued >= max_queued:
        return Overflow(Refusal.MODEL_QUEUE_FULL, queued, f"the queue for model {model!r} is full ({max_queued})")
    return None
