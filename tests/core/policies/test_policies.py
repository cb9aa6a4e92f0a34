"""Band policies (pure): virtual token counters against round-robin, no banking.

The bound every policy keeps is checked for each in test_policy_conformance.py.
"""

from __future__ import annotations

import pytest

from extproc.core.fair_queue import FairQueue
from extproc.core.policies.round_robin import TenantRoundRobin
from extproc.core.policies.vtc import VirtualTokenCounter

pytestmark = pytest.mark.unit


def vtc(weights: dict[str, float] | None = None) -> VirtualTokenCounter[int]:
    return VirtualTokenCounter(lambda tenant: (weights or {}).get(tenant, 1.0))


def serve(band: VirtualTokenCounter[int], costs: dict[str, float], n: int) -> list[str]:
    order = []
    for _ in range(n):
        tenant, _ = band.pop()
        band.charge(tenant, costs[tenant])
        order.append(tenant)
    return order


def test_cheap_requests_get_as_much_service_as_expensive_ones() -> None:
    band = vtc()
    for i in range(100):
        band.push("heavy", i)
        band.push("light", 1000 + i)
    order = serve(band, {"heavy": 10, "light": 1}, 55)
    # 5 heavy requests (50) and 50 light ones (50): equal service, not equal counts.
    assert order.count("heavy") == 5 and order.count("light") == 50


def test_round_robin_counts_requests_whatever_they_cost() -> None:
    band: TenantRoundRobin[int] = TenantRoundRobin()
    for i in range(10):
        band.push("heavy", i)
        band.push("light", 100 + i)
    band.charge("heavy", 1e9)  # ignored
    assert [band.pop()[0] for _ in range(4)] == ["heavy", "light", "heavy", "light"]


def test_weights_scale_the_share() -> None:
    band = vtc({"gold": 3.0})
    for i in range(100):
        band.push("gold", i)
        band.push("free", 1000 + i)
    order = serve(band, {"gold": 1, "free": 1}, 40)
    assert order.count("gold") == 30 and order.count("free") == 10


def test_a_returning_tenant_does_not_bank_its_idle_time() -> None:
    band = vtc()
    for i in range(20):
        band.push("busy", i)
    serve(band, {"busy": 5}, 10)  # busy alone: its counter climbs to 50
    band.push("back", 100)
    band.push("back", 101)
    band.push("back", 102)
    # Lifted to busy's counter (a tie, which the longer-backlogged busy wins),
    # not left at 0: the two alternate instead of back taking three in a row.
    assert band.counter("back") == band.counter("busy") == 50
    assert serve(band, {"busy": 5, "back": 5}, 4) == ["busy", "back", "busy", "back"]


def test_a_tenant_joining_an_empty_band_starts_at_the_last_pick() -> None:
    band = vtc()
    band.push("early", 1)
    serve(band, {"early": 100}, 1)  # band empty again; early's counter is 100
    band.push("late", 2)  # joins an empty band: lifted to where early was picked (0), not ahead of it
    band.push("early", 3)
    assert band.counter("late") == 0 and band.counter("early") == 100
    assert serve(band, {"late": 1, "early": 1}, 2) == ["late", "early"]


def test_corrections_refund_what_was_overcharged() -> None:
    band = vtc()
    for i in range(10):
        band.push("a", i)
        band.push("b", 100 + i)
    serve(band, {"a": 10, "b": 10}, 2)
    band.correct("a", -8)  # a's request cost 2, not 10
    assert band.pop()[0] == "a"


def test_remove_and_lengths() -> None:
    band = vtc()
    band.push("a", 1)
    band.push("a", 2)
    assert band.tenant_len("a") == 2 and len(band) == 2
    assert band.remove("a", 1) and not band.remove("a", 1) and not band.remove("zz", 1)
    assert band.pop() == ("a", 2)
    assert len(band) == 0 and band.tenant_len("a") == 0


def test_idle_tenants_at_the_floor_are_forgotten() -> None:
    band = vtc()
    for t in range(200):  # 200 tenants come and go once
        band.push(f"t{t}", t)
        serve(band, {f"t{t}": 0}, 1)
    assert band.remembered < 100


def test_fair_queue_runs_a_policy_per_band() -> None:
    queue: FairQueue[int] = FairQueue(2, vtc)
    queue.push(1, "low", 1)
    queue.push(0, "high", 2)
    assert queue.first_band() == 0 and queue.tenant_len("low") == 1
    band, tenant, item = queue.pop()
    queue.charge(band, tenant, 5)
    queue.correct(band, tenant, -5)
    assert (band, tenant, item) == (0, "high", 2) and queue.first_band() == 1
