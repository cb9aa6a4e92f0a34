"""The cluster's decisions (adapters/cluster/schedule.lua) on a real Redis, one round trip at a time.

Each call is what an instance's link sends: its exact count in flight, its
per-band caps and its backlog. The instances here are names; the decisions
are Redis's, so the tests read like the design's promises (docs/cluster.md).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest
import redis.asyncio as aioredis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis.exceptions import ResponseError

from extproc.adapters.cluster.link import SCRIPT
from extproc.adapters.cluster.wire import Trip, decode_grant, encode_trip
from extproc.core.cluster import Ask, Backlog
from tests.propertyutil import examples
from tests.redisutil import RedisServer

pytestmark = pytest.mark.integration

KEY = "extproc:m"


@dataclass(frozen=True)
class Answer:
    """A grant with its releases as (band, tenant) pairs, to read the decisions at a glance."""

    releases: tuple[tuple[int, str], ...]
    others_in_flight: int
    instances: int


class Cluster:
    def __init__(self, client: aioredis.Redis) -> None:
        self.client = client
        self.script = client.register_script(SCRIPT)

    async def ask(
        self, instance: str, in_flight: int, caps: tuple[int, ...], backlog: list[tuple[Any, ...]],
        lease_ms: int = 2000, form: str = "counter", shares: tuple[float, ...] = (),
    ) -> Answer:
        ask = Ask(in_flight, caps, tuple(Backlog(*entry) for entry in backlog), (), shares)
        grant = decode_grant(await self.trip(Trip(instance, lease_ms, "extproc:wake:", "m", form, ask)))
        return Answer(tuple((r.band, r.tenant) for r in grant.releases), grant.others_in_flight, grant.instances)

    async def trip(self, trip: Trip) -> bytes:
        reply: bytes = await self.script(keys=[KEY], args=[encode_trip(trip)])
        return reply


@pytest.fixture
async def cluster(redis_server: RedisServer) -> AsyncIterator[Cluster]:
    client = aioredis.from_url(redis_server.url)
    yield Cluster(client)
    await client.aclose()


async def test_two_instances_never_exceed_the_cap_together(cluster: Cluster) -> None:
    a = await cluster.ask("a", 0, (4,), [(0, "alice", 10, 1.0, True)])
    b = await cluster.ask("b", 0, (4,), [(0, "bob", 10, 1.0, True)])
    assert len(a.releases) == 4 and b.releases == ()  # a took the 4 free slots; b sees them taken
    assert b.others_in_flight == 4 and b.instances == 2
    # a finishes two: the next trip (by either) hands them out, in turns. bob joined at alice's
    # counter (idle time is not banked) and was served less recently: bob, then alice.
    b = await cluster.ask("b", 0, (4,), [(0, "bob", 10, 1.0, False)])
    assert b.releases == ()  # a's count in Redis is still 4 until a says otherwise
    a = await cluster.ask("a", 2, (4,), [(0, "alice", 6, 1.0, False)])
    assert a.releases == ((0, "alice"),) and a.others_in_flight == 1  # bob's slot waits at b, counted
    b = await cluster.ask("b", 0, (4,), [(0, "bob", 10, 1.0, False)])
    assert b.releases == ((0, "bob"),)  # claimed
    assert b.others_in_flight == 3


async def test_a_newcomer_anywhere_goes_before_the_flood_is_served_again(cluster: Cluster) -> None:
    a = await cluster.ask("a", 0, (3,), [(0, "flood", 50, 1.0, True)])
    assert len(a.releases) == 3
    b = await cluster.ask("b", 0, (3,), [(0, "flood", 50, 1.0, True), (0, "new", 1, 1.0, True)])
    assert b.releases == ()
    # One slot frees at a: whoever asks, it goes to the newcomer at b, not to the flood at a.
    a = await cluster.ask("a", 2, (3,), [(0, "flood", 47, 1.0, False)])
    assert a.releases == ()
    b = await cluster.ask("b", 0, (3,), [(0, "flood", 50, 1.0, False), (0, "new", 1, 1.0, False)])
    assert b.releases == ((0, "new"),)


async def test_vtc_counters_are_cluster_wide(cluster: Cluster) -> None:
    # heavy costs 10 per request, light 1: with 11 slots, light gets about 10 for heavy's 1.
    await cluster.ask("a", 0, (0,), [(0, "heavy", 20, 10.0, True)])
    b = await cluster.ask("b", 0, (11,), [(0, "light", 20, 1.0, True)])
    a = await cluster.ask("a", 0, (11,), [(0, "heavy", 20, 10.0, False)])
    light = sum(1 for _, t in b.releases if t == "light")
    heavy = len(a.releases) + sum(1 for _, t in b.releases if t == "heavy")
    assert (heavy, light) in {(1, 10), (2, 9)}, (heavy, light)


async def test_a_higher_band_anywhere_holds_the_lower_bands_everywhere(cluster: Cluster) -> None:
    b = await cluster.ask("b", 0, (2, 2), [(0, "chat", 5, 1.0, True)])
    assert len(b.releases) == 2
    a = await cluster.ask("a", 0, (3, 3), [(1, "batch", 5, 1.0, True)])
    assert a.releases == ()  # the free slot goes to b's interactive request, not a's batch
    b = await cluster.ask("b", 2, (3, 3), [(0, "chat", 3, 1.0, False)])
    assert b.releases == ((0, "chat"),)


async def test_a_lower_band_anywhere_gets_its_minimum_share_of_the_releases(cluster: Cluster) -> None:
    """Chats at b hold the engine; standard work at a still gets a quarter of the releases, cluster-wide."""
    caps, shares = (8, 8), (0.0, 0.25)
    flying = {"a": 0, "b": 0}
    queued = {"a": 50, "b": 50}
    released: list[int] = []

    async def trip(name: str, band: int, tenant: str, fresh: bool) -> None:
        answer = await cluster.ask(name, flying[name], caps, [(band, tenant, queued[name], 1.0, fresh)], shares=shares)
        flying[name] += len(answer.releases)
        queued[name] -= len(answer.releases)
        released.extend(b for b, _ in answer.releases)

    await trip("b", 0, "chat", True)
    await trip("a", 1, "review", True)
    assert released == [0] * 8  # the chats took every slot before standard asked
    for _ in range(16):  # a chat ends at b and a review at a, in turns; each instance asks after its own
        for name, band, tenant in (("b", 0, "chat"), ("a", 1, "review")):
            flying[name] = max(0, flying[name] - 1)
            await trip(name, band, tenant, False)
    later = released[8:]
    assert later.count(1) == len(later) // 4, later  # one release in four while both held requests


async def test_a_dead_instances_slots_and_grants_lapse_with_its_lease(cluster: Cluster) -> None:
    dead = await cluster.ask("dead", 0, (4,), [(0, "alice", 9, 1.0, True)], lease_ms=300)
    assert len(dead.releases) == 4
    live = await cluster.ask("live", 0, (4,), [(0, "bob", 9, 1.0, True)])
    assert live.releases == () and live.instances == 2
    await asyncio.sleep(0.4)  # "dead" never asks again
    live = await cluster.ask("live", 0, (4,), [(0, "bob", 9, 1.0, False)])
    assert len(live.releases) == 4 and live.instances == 1 and live.others_in_flight == 0


async def test_an_instance_that_leaves_takes_its_count_and_backlog_with_it(cluster: Cluster) -> None:
    gone = await cluster.ask("gone", 0, (4,), [(0, "alice", 9, 1.0, True)])
    assert len(gone.releases) == 4
    await cluster.trip(Trip("gone", 2000, "extproc:wake:", "m", "counter"))  # a clean stop: no ask
    live = await cluster.ask("live", 0, (4,), [(0, "bob", 9, 1.0, True)])
    assert len(live.releases) == 4 and live.instances == 1 and live.others_in_flight == 0


async def test_the_script_refuses_a_cluster_form_it_does_not_implement(cluster: Cluster) -> None:
    with pytest.raises(ResponseError, match="counter"):
        await cluster.ask("a", 0, (4,), [(0, "alice", 1, 1.0, True)], form="deficit")


@pytest.mark.parametrize("emptied", [False, True])
async def test_a_tenant_keeps_its_credit_unless_its_queue_really_emptied(cluster: Cluster, emptied: bool) -> None:
    """vtc: heavy costs 10, light 1. Light's count in Redis running out must not cost it its credit."""
    a = await cluster.ask("a", 0, (1,), [(0, "heavy", 20, 10.0, True)])
    assert len(a.releases) == 1  # heavy: counter 10
    # light joins at heavy's counter; turns: light 11, heavy 20 (a slot for a), light 12.
    b = await cluster.ask("b", 0, (4,), [(0, "light", 2, 1.0, True)])
    assert b.releases == ((0, "light"), (0, "light"))
    # light's published count ran out: a's trip takes its slot and the one free, both heavy (30).
    a = await cluster.ask("a", 1, (5,), [(0, "heavy", 19, 10.0, False)])
    assert a.releases == ((0, "heavy"), (0, "heavy"))
    # b publishes light again. Queued there all along (not fresh) it kept its credit (12 < 30) and
    # takes all 5 free slots; really emptied and back (fresh), it joins at 30 and turns resume.
    b = await cluster.ask("b", 2, (10,), [(0, "light", 5, 1.0, emptied)])
    a = await cluster.ask("a", 3, (10,), [(0, "heavy", 17, 10.0, False)])
    assert (len(b.releases), len(a.releases)) == ((4, 1) if emptied else (5, 0))


# --- a property: whatever the instances do, in any order --------------------------------------

STEPS = st.lists(
    st.tuples(st.integers(0, 2), st.integers(0, 3), st.lists(st.sampled_from("wxyz"), max_size=3)),
    min_size=1, max_size=30,
)


@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cap=st.integers(1, 6), steps=STEPS)
async def test_any_interleaving_stays_under_the_cap_grants_only_what_is_queued_and_serves_everyone(
    cluster: Cluster, cap: int, steps: list[tuple[int, int, list[str]]]
) -> None:
    """Three instances: finishes, arrivals and round trips in any order, one cap for the cluster."""
    await cluster.client.flushall()
    names = ("a", "b", "c")
    in_flight = dict.fromkeys(names, 0)
    queued: dict[str, dict[str, int]] = {n: {} for n in names}
    fresh: dict[str, set[str]] = {n: set() for n in names}

    async def trip(name: str) -> None:
        backlog = [(0, t, k, 1.0, t in fresh[name]) for t, k in queued[name].items() if k]
        fresh[name].clear()
        grant = await cluster.ask(name, in_flight[name], (cap,), backlog, lease_ms=60_000)
        for band, tenant in grant.releases:
            assert band == 0 and queued[name].get(tenant, 0) > 0, (name, tenant, queued[name])  # nothing phantom
            queued[name][tenant] -= 1
            in_flight[name] += 1
        pending = sum([await cluster.client.llen(f"{KEY}:p:{n}") for n in names])  # schedule.lua: key('pending', n)
        assert sum(in_flight.values()) + pending <= cap  # the cap holds across instances, grants in transit counted

    for index, finishes, arrivals in steps:
        name = names[index]
        in_flight[name] -= min(finishes, in_flight[name])
        for tenant in arrivals:
            if not queued[name].get(tenant):
                fresh[name].add(tenant)
            queued[name][tenant] = queued[name].get(tenant, 0) + 1
        await trip(name)
    # Everyone finishes and asks again until nothing is left: every queued request is released.
    # A request may take two rounds here: a slot is held until its instance's next trip (its
    # finish is published only then), and a slot granted to another instance waits for its claim.
    for _ in range(2 * sum(sum(q.values()) for q in queued.values()) + 3):
        for name in names:
            in_flight[name] = 0
            await trip(name)
    assert all(k == 0 for q in queued.values() for k in q.values()), queued
