"""``policy: deadline`` beyond the shared contract (tests/core/policies/test_policy_conformance.py runs it there too).

* Inside a tenant: earliest deadline first, and a request is overtaken only by
  requests that arrived before its deadline minus the smallest objective.
* Among tenants: an urgent head goes before a lax tenant's at an equal counter,
  but a tenant sending only urgent requests gets at most one request more than
  its share (the window); with equal deadlines the policy is exactly ``vtc``.
* The dispatcher's requests carry their deadline to it (``Held.deadline``), and
  the config refuses it with a cluster.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.adapters.config import ConfigError, parse_config
from extproc.adapters.timers import LoopTimers
from extproc.core.bands import Band
from extproc.core.cost import CostWeights
from extproc.core.dispatcher import ModelDispatcher
from extproc.core.entitlement import Tenant
from extproc.core.held import Held
from extproc.core.policies import POLICIES
from extproc.core.policies.deadline import DeadlineBand
from extproc.core.policies.vtc import VirtualTokenCounter
from tests.helpers.endpoint_down import Report
from tests.helpers.gate import make_gate
from tests.propertyutil import examples

pytestmark = pytest.mark.unit

SMALLEST_OBJECTIVE = 0.5
OBJECTIVES = st.floats(SMALLEST_OBJECTIVE, 60)


@dataclass(frozen=True, eq=False)
class Request:
    """A queued request (identity-hashed, as Held): when it arrived and when it is due."""

    arrival: float
    deadline: float


def equal_weights(tenant: str) -> float:
    return 1.0


def test_the_dispatchers_requests_are_typed_for_it() -> None:
    """Held is what the policy orders in production: mypy checks it against the policy's item bound."""
    band: DeadlineBand[Held] = DeadlineBand(equal_weights)
    assert len(band) == 0


@settings(max_examples=examples(200), deadline=None)
@given(ops=st.lists(st.one_of(st.tuples(st.floats(0, 5), OBJECTIVES), st.none()), max_size=120))
def test_inside_a_tenant_only_arrivals_before_a_deadline_less_the_smallest_objective_overtake_it(
    ops: list[tuple[float, float] | None],
) -> None:
    """Pushes (time since the last, objective) and pops (None) of one tenant."""
    band: DeadlineBand[Request] = DeadlineBand(equal_weights)
    now = 0.0
    queued: list[Request] = []
    released: list[Request] = []

    def pop() -> None:
        _, item = band.pop()
        assert item.deadline == min(r.deadline for r in queued)
        queued.remove(item)
        # Everything it overtook stays queued; what overtook it arrived before its deadline - the smallest objective.
        for earlier in released:
            if earlier.arrival > item.arrival:
                assert earlier.arrival < item.deadline - SMALLEST_OBJECTIVE
        released.append(item)

    for op in ops:
        if op is None:
            if queued:
                pop()
            continue
        since, objective = op
        now += since
        request = Request(now, now + objective)
        band.push("t", request)
        queued.append(request)
    while queued:
        pop()


def test_equal_deadlines_leave_in_arrival_order() -> None:
    band: DeadlineBand[Request] = DeadlineBand(equal_weights)
    requests = [Request(float(i), 10.0) for i in range(5)]
    for request in requests:
        band.push("t", request)
    assert [band.pop()[1] for _ in requests] == requests


def test_an_urgent_head_goes_before_a_lax_tenant_at_an_equal_counter() -> None:
    """Both at counter 0; the lax tenant joined first, so vtc alone would serve it first."""
    lax, urgent = Request(0.0, 60.0), Request(1.0, 3.0)
    fair: VirtualTokenCounter[Request] = VirtualTokenCounter(equal_weights)
    band: DeadlineBand[Request] = DeadlineBand(equal_weights)
    for queue in (fair, band):
        queue.push("lax", lax)
        queue.push("urgent", urgent)
    assert fair.pop()[0] == "lax"
    assert band.pop()[0] == "urgent"


def test_a_tenant_sending_only_urgent_requests_gets_its_share_and_one_request_more() -> None:
    """Equal costs: the window lets it one request past its half, no more (without it, it would get them all)."""
    band: DeadlineBand[Request] = DeadlineBand(equal_weights)
    counts = {"urgent": 0, "lax": 0}
    for i in range(2):
        band.push("urgent", Request(float(i), i + 1.0))
        band.push("lax", Request(float(i), i + 60.0))
    for n in range(1, 101):
        tenant, item = band.pop()
        band.charge(tenant, 10.0)
        counts[tenant] += 1
        band.push(tenant, Request(item.arrival + 2, item.arrival + 2 + (1.0 if tenant == "urgent" else 60.0)))
        assert counts["urgent"] <= n / 2 + 1
    assert counts["urgent"] == 51


@settings(max_examples=examples(200), deadline=None)
@given(
    costs=st.fixed_dictionaries({t: st.floats(1, 100) for t in "ulm"}),
    weights=st.fixed_dictionaries({t: st.floats(0.25, 4) for t in "ulm"}),
    others=st.integers(1, 2),
    steps=st.integers(1, 200),
)
def test_an_urgent_tenant_is_never_more_than_one_of_its_requests_past_its_share(
    costs: dict[str, float], weights: dict[str, float], others: int, steps: int,
) -> None:
    """Exact costs, every tenant backlogged, "u" always the most urgent.

    vtc keeps u at most one request (its own, s_u) ahead of every other
    tenant's weighted service; the window adds one more of its own: 2·s_u.
    """
    band: DeadlineBand[Request] = DeadlineBand(lambda tenant: weights[tenant])
    tenants = "ulm"[: 1 + others]
    service = {t: costs[t] / weights[t] for t in tenants}
    released = dict.fromkeys(tenants, 0.0)
    clock = itertools.count()

    def push(tenant: str) -> None:
        now = float(next(clock))
        band.push(tenant, Request(now, now + (SMALLEST_OBJECTIVE if tenant == "u" else 60.0)))

    for tenant in tenants * 2:
        push(tenant)
    for _ in range(steps):
        tenant, _ = band.pop()
        band.charge(tenant, costs[tenant])
        released[tenant] += service[tenant]
        push(tenant)
        for other in tenants[1:]:
            assert released["u"] <= released[other] + 2 * service["u"] + 1e-6


def test_an_idle_tenants_window_is_forgotten_with_its_counter() -> None:
    """Memory stays bounded by the active tenants: the sweep of idle counters takes their windows too."""
    band: DeadlineBand[Request] = DeadlineBand(equal_weights)
    for _ in range(2):
        band.push("busy", Request(0.0, 60.0))
    for i in range(500):  # one busy tenant, and 500 that send one request each
        band.push(f"once-{i}", Request(float(i), 60.0))
        for _ in range(2):
            tenant, _ = band.pop()
            band.charge(tenant, 10.0)
            if tenant == "busy":
                band.push("busy", Request(float(i), 60.0))
    assert not any(band.tenant_len(f"once-{i}") for i in range(500))
    assert band.remembered < 100  # counters and largest charges together
    assert sum(band.largest(f"once-{i}") > 0 for i in range(500)) < 100  # each window went with its counter


@settings(max_examples=examples(200), deadline=None)
@given(ops=st.lists(st.one_of(
    st.tuples(st.just("push"), st.sampled_from("abcd")),
    st.tuples(st.just("pop"), st.floats(1, 100)),
    st.tuples(st.just("correct"), st.sampled_from("abcd"), st.floats(-50, 50)),
), max_size=150), weights=st.fixed_dictionaries({t: st.floats(0.25, 4) for t in "abcd"}))
def test_with_equal_deadlines_it_is_vtc(ops: list[tuple[Any, ...]], weights: dict[str, float]) -> None:
    """Every release, charge and correction alike: the same tenant and request leave as under vtc."""
    fair: VirtualTokenCounter[Request] = VirtualTokenCounter(lambda tenant: weights[tenant])
    band: DeadlineBand[Request] = DeadlineBand(lambda tenant: weights[tenant])
    for i, op in enumerate(ops):
        if op[0] == "push":
            request = Request(float(i), 7.0)
            fair.push(op[1], request)
            band.push(op[1], request)
        elif op[0] == "pop" and len(fair):
            released = fair.pop()
            assert band.pop() == released
            fair.charge(released[0], op[1])
            band.charge(released[0], op[1])
        elif op[0] == "correct":
            fair.correct(op[1], op[2])
            band.correct(op[1], op[2])
    assert len(band) == len(fair)


async def test_the_dispatcher_releases_a_tenants_tighter_objective_first() -> None:
    """A request's own objective (trusted down to 1 s) moves it before the tenant's earlier, laxer request."""
    band = Band("interactive", 60.0, ttft_objective_s=10.0, min_ttft_objective_s=1.0)
    dispatcher = ModelDispatcher(
        "m", make_gate(kind="static_concurrency", max_in_flight=1), (band,), Report(), lambda: 0.0,
        policy=POLICIES["deadline"], tenant=lambda _: Tenant(("interactive",), "interactive", weight=1.0, max_queued=100),
        cost=CostWeights(), max_queued=100, max_queue_wait_s=120.0, reserved_waiting=0, timers=LoopTimers(lambda: 0.0),
    )
    running = dispatcher.submit("alice", 0)
    lax = dispatcher.submit("alice", 0)
    urgent = dispatcher.submit("alice", 0, ttft_objective_s=2.0)
    assert (lax.deadline, urgent.deadline) == (10.0, 2.0)
    assert running.future.done() and not lax.future.done() and not urgent.future.done()
    dispatcher.end(running)
    assert urgent.future.done() and not lax.future.done()
    dispatcher.end(urgent)
    assert lax.future.done()
    dispatcher.end(lax)


def test_the_config_refuses_it_with_a_cluster_at_the_models_policy() -> None:
    model = {"name": "m", "endpoints": ["http://127.0.0.1:1"], "policy": "deadline"}
    assert parse_config({"models": [model]}).models[0].policy == "deadline"
    with pytest.raises(ConfigError, match=r"models\[0\]\.policy: deadline has no cluster form, so a cluster cannot run "
                                          r"it: use round_robin, vtc"):
        parse_config({"models": [model], "cluster": {"redis_url": "redis://127.0.0.1:6379/0"}})
