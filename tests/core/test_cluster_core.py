"""A cluster seat as a dispatcher's release strategy (core/cluster.py): what it asks, what a grant releases, cut off."""

from __future__ import annotations

import pytest

from extproc.adapters.timers import LoopTimers
from extproc.core.bands import Band
from extproc.core.cluster import Backlog, ClusterOutlet, ClusterSeat, Grant, Release
from extproc.core.cost import CostWeights
from extproc.core.dispatcher import ModelDispatcher
from extproc.core.entitlement import Tenant
from extproc.core.policies import POLICIES
from extproc.core.release.pool import Pool
from extproc.core.values.engine_load import EngineLoad
from tests.helpers.endpoint_down import Report
from tests.helpers.gate import make_gate

pytestmark = pytest.mark.unit


class Link:
    def __init__(self) -> None:
        self.asks: list[bool] = []

    def wanted(self, urgent: bool) -> None:
        self.asks.append(urgent)


def grant(*releases: tuple[int, str], others: int = 0, instances: int = 1) -> Grant:
    return Grant(others, instances, tuple(Release(band, tenant) for band, tenant in releases))


def seat_of(
    max_in_flight: int = 4, policy: str = "round_robin", expected: int = 1
) -> tuple[ModelDispatcher, ClusterSeat, Link, Pool]:
    link = Link()
    timers = LoopTimers(lambda: 0.0)
    seats: list[ClusterSeat] = []

    def strategy(outlet: ClusterOutlet) -> ClusterSeat:
        seats.append(ClusterSeat(outlet, timers, link, expected_instances=expected))
        return seats[0]

    pool = make_gate(kind="static_concurrency", max_in_flight=max_in_flight)
    dispatcher = ModelDispatcher(
        "m", pool, (Band("standard", 60.0),),
        Report(), lambda: 0.0,
        policy=POLICIES[policy], tenant=lambda _: Tenant(("standard",), "standard", weight=1.0, max_queued=100),
        cost=CostWeights(), max_queued=100, max_queue_wait_s=120.0, reserved_waiting=0, timers=timers, strategy=strategy,
    )
    return dispatcher, seats[0], link, pool


async def test_a_joined_seat_releases_only_what_the_cluster_grants() -> None:
    dispatcher, seat, link, pool = seat_of()
    seat.granted(grant(instances=2))
    alice = [dispatcher.submit("alice", 0) for _ in range(3)]
    bob = dispatcher.submit("bob", 0)
    assert not any(h.future.done() for h in [*alice, bob])  # capacity is free, but the cluster decides
    assert link.asks[:2] == [True, True]  # alice and bob are new here: the cluster hears at once

    ask = seat.ask()
    assert ask.in_flight == 0 and ask.caps == (4,)
    assert ask.shares == (0.5,)  # all the arrivals, at most a half (the first band's share: never used)
    # Both are new here since the last ask: if no other instance holds them, they join the backlog now.
    assert set(ask.backlog) == {Backlog(0, "alice", 3, 1.0, fresh=True), Backlog(0, "bob", 1, 1.0, fresh=True)}
    assert not any(e.fresh for e in seat.ask().backlog)

    seat.granted(grant((0, "bob"), (0, "alice"), others=1, instances=2))
    assert bob.future.done() and alice[0].future.done() and not alice[1].future.done()
    # The other instances' request counts as ours: 2 here + 1 there, of a cap of 4.
    ask = seat.ask()
    assert ask.in_flight == 2 and ask.caps == (4,)
    assert pool.allowance(0.0) == 1  # the rule counts them


async def test_a_grant_for_a_tenant_that_left_is_skipped() -> None:
    dispatcher, seat, _, _ = seat_of()
    seat.granted(grant())
    held = dispatcher.submit("alice", 0)
    dispatcher.end(held)  # its client left
    seat.granted(grant((0, "alice"), (0, "nobody")))
    assert dispatcher.in_flight == 0 and dispatcher.queued == 0


async def test_cut_off_from_the_cluster_a_seat_releases_its_share_of_the_cap() -> None:
    dispatcher, seat, _, _ = seat_of(max_in_flight=6, expected=3)
    held = [dispatcher.submit("alice", 0) for _ in range(5)]
    # Not joined yet (as when Redis is down): it releases 6 // 3 = 2 on its own, not the whole cap.
    assert sum(h.future.done() for h in held) == 2
    seat.lost(seat.ask())
    assert sum(h.future.done() for h in held) == 2
    # Back: the cluster decides again, and the share no longer applies.
    seat.granted(grant(*((0, "alice"),) * 3, instances=3))
    assert sum(h.future.done() for h in held) == 5


async def test_cost_corrections_travel_with_the_next_ask_and_survive_a_lost_one() -> None:
    dispatcher, seat, _, _ = seat_of(policy="vtc")
    seat.granted(grant())
    for at, generated in ((0.0, 0.0), (1.0, 10.0)):  # a decode rate of 10 tokens/s: measured costs
        dispatcher.record_scrape("e1", EngineLoad(waiting=0, running=1, generation_tokens=generated), at)
    held = dispatcher.submit("alice", 0, max_tokens=100)
    ask = seat.ask()
    assert ask.backlog[0].service == held.estimate.cost  # vtc's service: cost / weight 1
    seat.granted(grant((0, "alice")))
    dispatcher.end(held)  # finished at once: it cost less than estimated
    lost = seat.ask()
    (correction,) = lost.corrections
    assert (correction.band, correction.tenant) == (0, "alice") and correction.delta < 0
    seat.lost(lost)
    assert seat.ask().corrections == lost.corrections


async def test_a_scrape_asks_the_cluster_only_when_it_lets_this_instance_release() -> None:
    dispatcher, seat, link, _ = seat_of(max_in_flight=2)
    seat.granted(grant())
    held = [dispatcher.submit("alice", 0) for _ in range(3)]
    link.asks.clear()
    dispatcher.record_scrape("e1", EngineLoad(waiting=0, running=0), 0.0)
    assert link.asks == [True]  # room for 2: the cluster hears at once
    seat.granted(grant((0, "alice"), (0, "alice")))
    assert sum(h.future.done() for h in held) == 2
    link.asks.clear()
    dispatcher.record_scrape("e1", EngineLoad(waiting=0, running=2), 0.1)
    assert link.asks == []  # full: nothing to release here; the next trip takes its numbers anyway
