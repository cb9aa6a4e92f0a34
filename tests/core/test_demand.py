"""The demand an autoscaler reads (core/demand.py), and a pool with no engine up holding its requests (the cold start).

The dispatcher in simulated time: the clock and the timers are the test's, so
a queue wait and a cold-start wait run out exactly when the test says.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from typing import Any

import pytest

from extproc.core.bands import Band
from extproc.core.cost import CostWeights
from extproc.core.dispatcher import Held, ModelDispatcher
from extproc.core.entitlement import Tenant
from extproc.core.policies import POLICIES
from extproc.core.release.pool import Pool
from extproc.core.values.engine_load import EngineLoad
from extproc.core.values.outcomes import Refusal, Refused
from extproc.core.values.report import Event, RequestEvent, Step
from tests.helpers.gate import make_gate

pytestmark = pytest.mark.unit

# Strict priority (the lower class has no minimum share of the releases): the class order is plain to see.
BANDS = (Band("interactive", max_queue_wait_s=1.0), Band("standard", max_queue_wait_s=1.0, min_share=0.0))
TENANTS = ("t1", "t2", "t3", "t4", "t5")


class Clock:
    """The dispatcher's clock and timers: :meth:`advance` moves the clock and runs every timer due, in order."""

    def __init__(self) -> None:
        self.now = 0.0
        self._armed: list[tuple[float, int, Callable[[], None]]] = []

    def __call__(self) -> float:
        return self.now

    def at(self, deadline: float, callback: Callable[[], None]) -> Clock:
        self._armed.append((deadline, len(self._armed), callback))
        return self

    def cancel(self) -> None:
        raise AssertionError("not cancelled here")

    def future(self) -> asyncio.Future[Any]:
        return asyncio.get_running_loop().create_future()

    def advance(self, to: float) -> None:
        while due := sorted(a for a in self._armed if a[0] <= to):
            self._armed.remove(due[0])
            self.now = max(self.now, due[0][0])
            due[0][2]()
        self.now = to


class Releases(list[tuple[str, str]]):
    """The (class, tenant) of each release, in order."""

    def __call__(self, event: Event) -> None:
        if isinstance(event, RequestEvent) and event.step is Step.RELEASED:
            self.append((event.band, event.tenant))


def dispatcher(clock: Clock, report: Releases, pool: Pool, *, cold_start_s: float = 30.0) -> ModelDispatcher:
    return ModelDispatcher(
        "m", pool, BANDS, report, clock,
        policy=POLICIES["round_robin"], timers=clock,
        tenant=lambda _: Tenant(("interactive", "standard"), "standard", max_queued=100),
        cost=CostWeights(), max_queued=1000, max_queue_wait_s=120.0, reserved_waiting=0,
        cold_start_wait_s=cold_start_s,
    )


def down(d: ModelDispatcher, at: float) -> None:
    for endpoint in d.endpoints:
        d.record_scrape(endpoint, None, at, reachable=False)


async def test_with_no_engine_up_requests_are_kept_past_their_wait_and_go_in_class_and_fair_order_when_one_answers(
) -> None:
    clock, releases = Clock(), Releases()
    d = dispatcher(clock, releases, make_gate(max_running=4))
    down(d, 0.0)
    held = [d.submit(tenant, band) for band in (1, 0) for tenant in TENANTS for _ in range(5)]  # 25 standard first
    assert d.queued == 50 and releases == []
    demand = d.demand()
    assert demand.held == (25, 25) and demand.ready == 0
    assert demand.engines == 50 / (4 + 3) and demand.drain_s == math.inf  # the size the operator gave
    clock.advance(10.0)  # each class's wait (1 s) ran out long ago: kept, no engine being up
    assert d.queued == 50 and not any(h.future.done() for h in held)
    d.record_scrape("e1", EngineLoad(waiting=0, running=0), started_at=10.0)  # the engine answers
    first = len(releases)
    assert first == 4 + 3  # its limit: max_running + target_waiting
    # Interactive first, its tenants in turn; the standard class waits while interactive requests are held.
    assert releases == [("interactive", t) for t in TENANTS] + [("interactive", "t1"), ("interactive", "t2")]
    while d.queued:  # the engine serves them: each end lets the next go
        clock.advance(clock.now + 0.1)
        for h in [h for h in held if h.future.done() and not h.ended]:
            d.end(h)
    assert len(releases) == 50 and [band for band, _ in releases[:25]] == ["interactive"] * 25
    assert all(h.future.result() >= 0 for h in held)
    assert clock.now < 30.0  # all before the cold-start wait ran out


async def test_with_no_engine_up_a_request_is_refused_once_its_cold_start_wait_runs_out() -> None:
    clock, releases = Clock(), Releases()
    d = dispatcher(clock, releases, make_gate(), cold_start_s=30.0)
    down(d, 0.0)
    early = d.submit("t1", 0)
    clock.advance(5.0)
    later = d.submit("t2", 0)
    clock.advance(29.9)
    assert not early.future.done()
    clock.advance(30.0)
    with pytest.raises(Refused) as refused:
        early.future.result()
    assert refused.value.refusal is Refusal.QUEUE_TIMEOUT and refused.value.queue_wait_s == 30.0
    assert "no engine of the pool was up" in refused.value.message
    assert refused.value.drain_s == math.inf  # nothing released: Retry-After says the most it says
    assert not later.future.done()
    clock.advance(35.0)
    assert later.future.done() and d.queued == 0 and releases == []


async def test_with_an_engine_up_the_class_wait_applies_as_ever() -> None:
    clock, releases = Clock(), Releases()
    d = dispatcher(clock, releases, make_gate(kind="static_concurrency", max_in_flight=1))
    d.record_scrape("e1", EngineLoad(waiting=0, running=0), started_at=0.0)
    running, waiting = d.submit("t1", 1), d.submit("t2", 1)
    assert running.future.done() and not waiting.future.done()
    clock.advance(1.0)
    with pytest.raises(Refused, match="without capacity"):
        waiting.future.result()
    d.end(running)


async def test_the_demand_counts_held_and_in_flight_per_class_over_what_one_engine_holds() -> None:
    clock, releases = Clock(), Releases()
    d = dispatcher(clock, releases, make_gate(endpoints=("e1", "e2"), max_running=4, pick=True))
    assert d.demand().engines == 0 and d.demand().drain_s == 0 and d.demand().per_engine == 7
    for endpoint, running, kv in (("e1", 0, 0.25), ("e2", 0, 0.75)):
        d.record_scrape(endpoint, EngineLoad(waiting=0, running=running, kv_usage=kv), started_at=0.0)
    held: list[Held] = [d.submit(t, band) for t in TENANTS for band in (0, 1) for _ in range(3)]  # 30
    demand = d.demand()
    # Released as they came while the two engines had room (7 each: max_running + target_waiting), in each class.
    assert demand.in_flight == (8, 6) and demand.held == (7, 9) and demand.ready == 2 and demand.per_engine == 7
    assert demand.engines == 30 / 7
    assert demand.mean_kv_usage == 0.5 and demand.mean_queue == 16 / 2  # the held ones count as the pool's queue
    clock.advance(0.5)  # 14 released in the last 10 s: 1.4 per second
    assert d.demand().drain_s == pytest.approx(16 / 1.4)
    # Both endpoints leave (scaled to zero): the engines' size is remembered, the demand still counted.
    d.set_endpoints(())
    demand = d.demand()
    assert demand.ready == 0 and demand.per_engine == 7 and demand.engines == 30 / 7 and demand.mean_queue == 16
    for h in held:
        if h.future.done():
            d.end(h)
    # Their time in flight is known now (0.5 s): the flow's places by Little's law, 30 arrivals in the last 10 s, and
    # the 16 held spread over their class's wait (1 s).
    assert sum(d.demand().in_flight) == 0 and d.demand().engines == pytest.approx((30 / 10 * 0.5 + 16 * 0.5 / 1.0) / 7)
    for h in held:
        h.future.cancel()
        d.end(h)
    await asyncio.sleep(0)
    assert d.demand().engines == 0


async def test_the_engines_needed_are_the_arrival_rate_times_the_time_in_flight_and_the_backlog_over_its_wait() -> None:
    clock, releases = Clock(), Releases()
    d = dispatcher(clock, releases, make_gate(max_running=4))  # 7 places an engine
    d.record_scrape("e1", EngineLoad(waiting=0, running=0), started_at=0.0)
    running: list[tuple[float, Held]] = []
    for tick in range(40):  # one request every 0.5 s, each in flight 2 s: 4 at a time, never held
        clock.advance(tick * 0.5)
        for ends, h in [(e, h) for e, h in running if e <= clock.now]:
            d.end(h)
            running.remove((ends, h))
        held = d.submit(TENANTS[tick % 5], 1)
        assert held.future.done()
        running.append((clock.now + 2.0, held))
    demand = d.demand()
    assert demand.held == (0, 0) and sum(demand.in_flight) == 4
    assert demand.engines == pytest.approx(20 / 10 * 2.0 / 7)  # 2 a second for 2 s each: 4 places
    # A burst the engine cannot take: at most 7 in flight (its limit), and what the flow needs is the arrival rate's
    # places, with each held request as the share of a place that starts it within its class's wait (1 s).
    burst = [d.submit(TENANTS[i % 5], 1) for i in range(30)]
    demand = d.demand()
    held_now = demand.held[1]
    assert sum(demand.in_flight) <= 7 and held_now >= 30 - 3
    assert demand.engines == pytest.approx((50 / 10 * 2.0 + held_now * 2.0 / 1.0) / 7)
    for h in burst + [h for _, h in running]:
        h.future.cancel()
        d.end(h)
    await asyncio.sleep(0)


async def test_without_a_known_size_any_demand_needs_one_engine() -> None:
    clock, releases = Clock(), Releases()
    d = dispatcher(clock, releases, make_gate(kind="static_rate", release_rate=1.0))
    down(d, 0.0)
    held = d.submit("t1", 0)
    assert d.demand().per_engine is None and d.demand().engines == 1.0
    held.future.cancel()
    d.end(held)
