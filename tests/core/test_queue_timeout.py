"""A queued request is refused ``queue_timeout`` only once it has waited its class's limit, by the dispatcher's clock.

Event-loop timers may fire early by that clock (libuv, under uvloop, times them
from the loop's cached time); the refusal must not come early with them.
"""

from __future__ import annotations

import asyncio

import pytest

from extproc.adapters.timers import LoopTimers
from extproc.core.bands import Band
from extproc.core.cost import CostWeights
from extproc.core.dispatcher import ModelDispatcher
from extproc.core.entitlement import Tenant
from extproc.core.policies import POLICIES
from extproc.core.values.outcomes import Refusal, Refused
from tests.helpers.endpoint_down import Report
from tests.helpers.gate import make_gate

pytestmark = pytest.mark.unit

LIMIT_S = 0.05


async def test_a_timer_that_fires_early_by_the_dispatchers_clock_does_not_refuse_early() -> None:
    now = [0.0]
    dispatcher = ModelDispatcher(
        "m", make_gate(kind="static_concurrency", max_in_flight=1), (Band("standard", LIMIT_S),),
        Report(), lambda: now[0],
        policy=POLICIES["round_robin"], tenant=lambda _: Tenant(("standard",), "standard", weight=1.0, max_queued=100),
        cost=CostWeights(), max_queued=100, max_queue_wait_s=120.0, reserved_waiting=0, timers=LoopTimers(lambda: now[0]),
    )
    running = dispatcher.submit("alice", 0)
    waiting = dispatcher.submit("alice", 0)
    assert running.future.done() and not waiting.future.done()
    # The loop's timer fires after LIMIT_S of its time, while the dispatcher's clock says 0.02 s.
    now[0] = 0.02
    await asyncio.sleep(2 * LIMIT_S)
    assert not waiting.future.done() and dispatcher.queued == 1
    # Once the dispatcher's clock has passed the limit, the re-armed timer refuses it.
    now[0] = LIMIT_S + 0.001
    with pytest.raises(Refused) as err:
        await asyncio.wait_for(waiting.future, 1.0)
    assert err.value.refusal is Refusal.QUEUE_TIMEOUT
    assert err.value.queue_wait_s is not None and err.value.queue_wait_s >= LIMIT_S
    assert dispatcher.queued == 0
    running.future.cancel()
