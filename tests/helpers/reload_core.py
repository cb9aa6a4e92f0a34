"""What other test modules share of test_reload_core.py's: BANDS, dispatcher, tenants (written for its tests)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from extproc.adapters.timers import LoopTimers
from extproc.core.bands import Band
from extproc.core.cost import CostWeights
from extproc.core.dispatcher import ModelDispatcher
from extproc.core.entitlement import Tenant
from extproc.core.policies import POLICIES
from tests.helpers.endpoint_down import Report
from tests.helpers.gate import make_gate

BANDS = (Band("interactive", 120.0), Band("batch", 120.0))


def tenants(weights: dict[str, float], max_queued: int = 1_000) -> Callable[[str], Tenant]:
    every = Tenant(tuple(b.name for b in BANDS), "batch", max_queued=max_queued)
    return lambda name: replace(every, weight=weights.get(name, 1.0))


def dispatcher(policy: str, weights: dict[str, float], in_flight: int) -> ModelDispatcher:
    clock = lambda: 0.0  # noqa: E731 - one instant: the order is the policy's alone
    return ModelDispatcher(
        "m", make_gate(kind="static_concurrency", max_in_flight=in_flight), BANDS, Report(), clock,
        policy=POLICIES[policy], tenant=tenants(weights), cost=CostWeights(), max_queued=1_000,
        max_queue_wait_s=120.0, reserved_waiting=0, timers=LoopTimers(clock),
    )
