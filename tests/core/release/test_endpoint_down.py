"""An unreachable engine: the pool releases nothing to it, and takes it back on the first sign of life.

The state machine of ``core/release/health.py`` (down on a refused scrape or a
failed release, up on a later answer) and what the pool and the dispatcher
make of it, without a network: time is passed in. Also how the processor
reads a failed release from the response headers (``release_outcome.py``).
"""

from __future__ import annotations

import asyncio

import pytest

from extproc.adapters.ext_proc.attach.release_outcome import UPSTREAM_TIME_HEADER, engine_answer
from extproc.adapters.protocol.dialects import DIALECTS
from extproc.adapters.timers import LoopTimers
from extproc.core.bands import Band
from extproc.core.cost import CostWeights
from extproc.core.dispatcher import ModelDispatcher
from extproc.core.entitlement import Tenant
from extproc.core.policies import POLICIES
from extproc.core.release import RULES
from extproc.core.release.answer import Answer
from extproc.core.release.health import CHECK_EVERY, PROBATION_S
from extproc.core.values.engine_load import EngineLoad
from tests.helpers.endpoint_down import Report
from tests.helpers.gate import make_gate

pytestmark = pytest.mark.unit

IDLE = EngineLoad(waiting=0, running=0)


@pytest.mark.parametrize("kind", sorted(RULES))
def test_a_refused_scrape_stops_every_release_until_a_later_scrape_answers(kind: str) -> None:
    gate = make_gate(kind=kind, max_in_flight=4, release_rate=100.0)
    gate.record_scrape("e1", IDLE, started_at=0.0)
    assert gate.allowance(0.05) > 0
    gate.record_scrape("e1", None, started_at=0.1, reachable=False)
    assert gate.down() == ["e1"] and gate.allowance(0.2) == 0 and gate.allowance(60.0) == 0
    # A scrape that started before it went down proves nothing about now.
    gate.record_scrape("e1", IDLE, started_at=0.05)
    assert gate.down() == ["e1"]
    # Any answer after it, even a broken page, shows a live engine: the usual fallback applies.
    gate.record_scrape("e1", None, started_at=0.3)
    assert gate.down() == [] and gate.allowance(0.3) > 0


def test_a_failed_release_marks_its_endpoint_down_and_an_answer_brings_it_back() -> None:
    gate = make_gate()
    gate.record_scrape("e1", IDLE, started_at=0.0)
    gate.record_release("r1", 0.0)
    assert gate.record_response(None, Answer.DOWN, 0.1) == "e1"  # a pool of one: it went there
    assert gate.down() == ["e1"] and gate.allowance(0.1) == 0
    gate.record_response(None, Answer.SERVED, 0.2)
    assert gate.down() == [] and gate.allowance(0.2) > 0


def test_without_picking_a_failure_in_a_pool_of_several_names_no_endpoint() -> None:
    gate = make_gate(endpoints=("e1", "e2"))
    assert gate.record_response(None, Answer.DOWN, 0.1) is None
    assert gate.down() == []


def test_a_down_endpoint_is_never_picked_and_its_share_is_not_counted() -> None:
    picked = make_gate(endpoints=("e1", "e2"), pick=True)
    balanced = make_gate(endpoints=("e1", "e2"), kind="static_concurrency", max_in_flight=4)
    for gate in (picked, balanced):
        for e in ("e1", "e2"):
            gate.record_scrape(e, IDLE, started_at=0.0)
        both = gate.allowance(0.1)
        gate.record_scrape("e1", None, started_at=0.1, reachable=False)
        assert 0 < gate.allowance(0.2) < both
    assert {tuple(picked.ranked(f"key{i}", 0.2)) for i in range(20)} == {("e2",)}  # not even as a fallback
    assert balanced.allowance(0.2) == 4


def test_metric_rules_without_picking_cap_the_pool_at_the_fallback_of_the_endpoints_up() -> None:
    gate = make_gate(endpoints=("e1", "e2"), fallback=4)
    for e in ("e1", "e2"):
        gate.record_scrape(e, IDLE, started_at=0.0)
    gate.record_scrape("e1", None, started_at=0.1, reachable=False)
    assert gate.allowance(0.2) == 4


async def test_held_requests_wait_through_an_outage_and_go_when_the_engine_answers() -> None:
    report = Report()
    now = [0.0]
    dispatcher = ModelDispatcher(
        "m", make_gate(kind="static_concurrency", max_in_flight=2), (Band("standard", 60.0),),
        report, lambda: now[0],
        policy=POLICIES["round_robin"], tenant=lambda _: Tenant(("standard",), "standard", weight=1.0, max_queued=100),
        cost=CostWeights(), max_queued=100, max_queue_wait_s=120.0, reserved_waiting=0, timers=LoopTimers(lambda: now[0]),
    )
    held = [dispatcher.submit("alice", 0) for _ in range(6)]
    running = [h for h in held if h.future.done()]
    assert len(running) == 2 and report.up == {"e1": True}
    # The engine dies: the first failure marks it down before its slot is freed.
    dispatcher.record_response(running[0], Answer.DOWN)
    dispatcher.end(running[0])
    dispatcher.end(running[1])  # cut off mid-response: its slot is free, nothing takes it
    assert report.up == {"e1": False} and report.failures == 1
    assert dispatcher.queued == 4 and dispatcher.in_flight == 0
    now[0] = 0.5
    dispatcher.record_scrape("e1", None, 0.4, reachable=False)
    assert dispatcher.queued == 4
    now[0] = 3.0
    dispatcher.record_scrape("e1", IDLE, 2.9)  # back
    assert report.up == {"e1": True} and dispatcher.queued == 2 and dispatcher.in_flight == 2
    for h in held:
        h.future.cancel()
        dispatcher.end(h)
    await asyncio.sleep(0)


def test_the_response_headers_tell_a_live_engine_a_full_one_and_a_failed_release_apart() -> None:
    upstream = {UPSTREAM_TIME_HEADER: "12"}
    vllm, tgi, llamacpp = (DIALECTS[e].full_statuses for e in ("vllm", "tgi", "llamacpp"))
    assert engine_answer({":status": "200", **upstream}, vllm) is Answer.SERVED
    assert engine_answer({":status": "400", **upstream}, vllm) is Answer.SERVED
    assert engine_answer({":status": "500", **upstream}, vllm) is Answer.SERVED  # one request's error: the engine lives
    assert engine_answer({":status": "503", **upstream}, vllm) is Answer.FULL  # vLLM's queue cap
    assert engine_answer({":status": "429", **upstream}, tgi) is Answer.FULL  # TGI's
    assert engine_answer({":status": "429", **upstream}, vllm) is Answer.SERVED  # not vLLM's way to say it
    assert engine_answer({":status": "503", **upstream}, llamacpp) is Answer.DOWN  # no queue cap: loading, not full
    assert engine_answer({":status": "503"}, vllm) is Answer.DOWN  # Envoy's: unreachable, reset before the response
    assert engine_answer({":status": "504"}, vllm) is Answer.DOWN
    assert engine_answer({":status": "429"}, tgi) is Answer.SERVED  # Envoy's own (its admission bucket), not the engine


def test_an_engine_that_refuses_a_release_as_full_stays_up_and_its_limit_is_cut() -> None:
    gate = make_gate()
    gate.record_scrape("e1", IDLE, started_at=0.0)
    before = gate.allowance(0.1)
    assert gate.record_response(None, Answer.FULL, 0.1) == "e1"
    assert gate.down() == [] and 0 < gate.allowance(0.1) < before


def test_a_sample_of_releases_is_checked_and_every_one_after_a_return() -> None:
    gate = make_gate(endpoints=("e1", "e2"), pick=True)
    checked = [gate.check_release("e1", 0.0) for _ in range(3 * CHECK_EVERY)]
    assert checked[0] and sum(checked) == 3
    gate.record_scrape("e2", None, started_at=1.0, reachable=False)
    gate.record_scrape("e2", IDLE, started_at=2.0)  # back: on probation
    assert all(gate.check_release("e2", 2.0 + PROBATION_S * i / 10) for i in range(10))
    assert sum(gate.check_release("e2", 2.0 + PROBATION_S) for _ in range(CHECK_EVERY)) == 1
