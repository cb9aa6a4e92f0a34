"""A slot freed by an ended request waits for a sign of life (``core/release/unconfirmed.py``), without a network.

An engine that dies cuts every request it serves at once; their freed slots
must not be refilled into it. Each end is held until a probe, a scrape or a
checked response that started after it shows the engine alive; a probe the
engine refuses marks it down. Time is passed in.
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
from extproc.core.release.answer import Answer
from extproc.core.release.pool import Pool
from extproc.core.release.unconfirmed import UnconfirmedEnds
from extproc.core.values.engine_load import EngineLoad
from tests.helpers.gate import make_gate

pytestmark = pytest.mark.unit

IDLE = EngineLoad(waiting=0, running=0)


def probing(**options: object) -> Pool:
    gate = make_gate(kind="static_concurrency", max_in_flight=2, **options)  # type: ignore[arg-type]
    gate.probe_ends = True
    for endpoint in gate.endpoints:
        gate.record_scrape(endpoint, IDLE, started_at=0.0)
    return gate


def test_an_end_holds_its_slot_until_the_engine_shows_life_after_it() -> None:
    gate = probing()
    gate.record_release("a", 0.1)
    gate.record_release("b", 0.1)
    assert gate.record_end(None, 1.0) == ("e1",)  # a pool of one: probe it
    gate.record_finish("a", 1.0)
    assert gate.allowance(1.0) == 0  # the slot "a" freed is not refilled yet
    assert not gate.record_alive("e1", 0.9)  # life before the end proves nothing of it
    assert gate.allowance(1.0) == 0
    assert gate.record_alive("e1", 1.001)
    assert gate.allowance(1.001) == 1


def test_a_scrape_or_a_checked_response_after_the_end_confirms_it_too() -> None:
    for confirm in ("scrape", "response"):
        gate = probing()
        gate.record_release("a", 0.1)
        gate.record_end(None, 1.0)
        gate.record_finish("a", 1.0)
        if confirm == "scrape":
            gate.record_scrape("e1", None, started_at=1.1)  # a failed page proves nothing
            assert gate.unconfirmed() == 1 and gate.allowance(1.2) == 1  # 2 slots, one held
            gate.record_scrape("e1", IDLE, started_at=1.2)
        else:
            gate.record_response("e1", Answer.SERVED, 1.2)
        assert gate.unconfirmed() == 0, confirm


def test_a_refused_probe_marks_the_engine_down_and_nothing_goes_to_it() -> None:
    gate = probing()
    gate.record_release("a", 0.1)
    gate.record_release("b", 0.1)
    for request in ("a", "b"):  # the engine dies: every request it served ends at once
        gate.record_end(None, 1.0)
        gate.record_finish(request, 1.0)
        assert gate.allowance(1.0) == 0
    assert not gate.record_probe("e1", False, 1.0)
    assert gate.down() == ["e1"] and gate.allowance(1.1) == 0
    assert gate.unconfirmed() == 0  # what it held is gone; its return starts afresh
    gate.record_scrape("e1", IDLE, started_at=3.0)
    assert gate.down() == [] and gate.allowance(3.0) == 2


def test_a_probe_that_answers_brings_a_down_endpoint_back() -> None:
    gate = probing()
    gate.record_probe("e1", False, 1.0)
    assert gate.down() == ["e1"]
    gate.record_probe("e1", True, 0.5)  # started before it went down: proves nothing
    assert gate.down() == ["e1"]
    gate.record_probe("e1", True, 2.0)
    assert gate.down() == []


def test_with_picking_an_end_holds_only_its_endpoints_slot() -> None:
    gate = make_gate(endpoints=("e1", "e2"), pick=True, kind="static_concurrency", max_in_flight=1)
    gate.probe_ends = True
    gate.record_release("a", 0.0, "e1")
    gate.record_release("b", 0.0, "e2")
    assert gate.record_end("e1", 1.0) == ("e1",)
    gate.record_finish("a", 1.0)
    assert gate.allowance(1.0) == 0
    gate.record_end("e2", 1.0)
    gate.record_finish("b", 1.0)
    gate.record_alive("e2", 1.01)
    assert gate.allowance(1.01) == 1 and gate.ranked("k", 1.01)[0] == "e2"


def test_without_picking_a_pool_end_waits_for_every_endpoint_up() -> None:
    ends = UnconfirmedEnds(("e1", "e2"), per_endpoint=False)
    assert ends.ended(None, 1.0) == ("e1", "e2")
    assert ends.waits_on("e1") and ends.waits_on("e2")
    assert not ends.alive("e1", 1.1, up=("e1", "e2"))
    assert not ends.waits_on("e1") and ends.waits_on("e2")  # e1 need not be probed again
    assert ends.count() == 1
    assert ends.gone("e2", up=("e1",))  # the other is down: e1's life is enough
    assert ends.count() == 0


def test_without_a_prober_ends_free_their_slots_at_once() -> None:
    gate = make_gate(kind="static_concurrency", max_in_flight=1)
    gate.record_release("a", 0.0)
    assert gate.record_end(None, 1.0) == ()
    gate.record_finish("a", 1.0)
    assert gate.allowance(1.0) == 1


async def test_a_crash_cuts_what_the_engine_held_and_the_queue_waits_for_its_return() -> None:
    now = [0.0]
    probed: list[tuple[str, ...]] = []
    pool = make_gate(kind="static_concurrency", max_in_flight=2)
    dispatcher = ModelDispatcher(
        "m", pool, (Band("standard", 60.0),),
        lambda _: None, lambda: now[0],
        policy=POLICIES["round_robin"], tenant=lambda _: Tenant(("standard",), "standard", weight=1.0, max_queued=100),
        cost=CostWeights(), max_queued=100, max_queue_wait_s=120.0, reserved_waiting=0, timers=LoopTimers(lambda: now[0]),
    )
    dispatcher.probe_with(probed.append)
    held = [dispatcher.submit("alice", 0) for _ in range(6)]
    running = [h for h in held if h.future.done()]
    assert len(running) == 2
    # A normal end: its slot goes once the probe that followed it answers.
    now[0] = 1.0
    dispatcher.end(running[0])
    assert probed == [("e1",)] and dispatcher.queued == 4
    dispatcher.record_probe("e1", True, 1.0001)
    assert dispatcher.queued == 3
    # The engine dies: both requests it runs end at once, and neither slot is refilled.
    now[0] = 2.0
    for h in [h for h in held if h.future.done() and not h.ended]:
        dispatcher.end(h)
    assert dispatcher.queued == 3 and dispatcher.in_flight == 0
    dispatcher.record_probe("e1", False, 2.0)
    assert pool.down() == ["e1"] and dispatcher.queued == 3
    now[0] = 5.0
    dispatcher.record_scrape("e1", IDLE, 4.9)  # back
    assert dispatcher.queued == 1 and dispatcher.in_flight == 2
    for h in held:
        h.future.cancel()
        dispatcher.end(h)
    await asyncio.sleep(0)


async def test_with_nothing_queued_an_end_is_not_held_nor_looked_at() -> None:
    probed: list[tuple[str, ...]] = []
    pool = make_gate(kind="static_concurrency", max_in_flight=1)
    dispatcher = ModelDispatcher(
        "m", pool, (Band("standard", 60.0),),
        lambda _: None, lambda: 0.0,
        policy=POLICIES["round_robin"], tenant=lambda _: Tenant(("standard",), "standard", weight=1.0, max_queued=100),
        cost=CostWeights(), max_queued=100, max_queue_wait_s=120.0, reserved_waiting=0, timers=LoopTimers(lambda: 0.0),
    )
    dispatcher.probe_with(probed.append)
    alone = dispatcher.submit("alice", 0)
    dispatcher.end(alone)
    assert probed == [] and pool.allowance(0.0) == 1
    arrival = dispatcher.submit("alice", 0)
    assert arrival.future.done()
    dispatcher.end(arrival)
    await asyncio.sleep(0)
