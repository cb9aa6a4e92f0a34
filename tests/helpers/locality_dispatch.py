"""What other test modules share of test_locality_dispatch.py's: dispatcher (written for its tests)."""

from __future__ import annotations

from collections.abc import Callable

from extproc.adapters.timers import LoopTimers
from extproc.core.cost import CostWeights
from extproc.core.dispatcher import ModelDispatcher
from extproc.core.policies import POLICIES
from extproc.core.values.report import DispatchReport
from tests.helpers.endpoint_down import Report
from tests.helpers.gate import make_gate
from tests.helpers.reload_core import BANDS, tenants


def dispatcher(policy: str, endpoints: tuple[str, ...] = ("e1",), *, pick: bool = False,
               report: DispatchReport | None = None, clock: Callable[[], float] = lambda: 0.0) -> ModelDispatcher:
    """One slot in flight per endpoint; by default one instant, so the order is the policy's alone."""
    pool = make_gate(endpoints, kind="static_concurrency", max_in_flight=1, pick=pick)
    return ModelDispatcher(
        "m", pool, BANDS, report or Report(), clock, policy=POLICIES[policy], tenant=tenants({}), cost=CostWeights(),
        max_queued=1_000, max_queue_wait_s=120.0, reserved_waiting=0, timers=LoopTimers(clock),
    )
