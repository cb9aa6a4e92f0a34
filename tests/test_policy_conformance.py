"""The contract of a fairness policy, run on every registered one (extproc/core/policies).

A new policy passes these before the config accepts its name:

* every request ends exactly once (popped or removed), each tenant's in arrival order;
* no starvation within a band: a tenant that joins is served within a number
  of releases that does not grow with the backlog in front of it;
* its own fairness bound: between continuously backlogged tenants the service
  released (the policy's own measure, ``Policy.service``) differs by at most
  ``U + K·E`` (see :class:`extproc.core.policies.base.Policy`).
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.adapters.config import parse_config
from extproc.core.policies import POLICIES, BandPolicy, Policy

pytestmark = [pytest.mark.unit, pytest.mark.parametrize("name", sorted(POLICIES))]

TENANTS = st.sampled_from(["a", "b", "c", "d"])
WEIGHTS = st.fixed_dictionaries({t: st.floats(0.25, 4) for t in "abcdx"})
COSTS = st.floats(1, 100)


def band(policy: Policy, weights: dict[str, float]) -> BandPolicy[Any]:
    return policy.new_band(lambda tenant: weights[tenant])


# An operation: push (tenant), pop, remove the n-th queued item, or a cost report
# (charge, then correct by a delta) that a release of the tenant would make.
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("push"), TENANTS),
        st.tuples(st.just("pop")),
        st.tuples(st.just("remove"), st.integers(0, 1000)),
        st.tuples(st.just("cost"), TENANTS, COSTS, st.floats(-50, 50)),
    ),
    max_size=200,
)


@settings(max_examples=200, deadline=None)
@given(ops=OPS, weights=WEIGHTS)
def test_every_request_ends_exactly_once_in_arrival_order(name: str, ops: list[tuple[Any, ...]],
                                                          weights: dict[str, float]) -> None:
    queue = band(POLICIES[name], weights)
    queued: dict[int, str] = {}
    ended: list[int] = []
    served: list[tuple[str, int]] = []
    ids = itertools.count()
    for op in ops:
        if op[0] == "push":
            item = next(ids)
            queue.push(op[1], item)
            queued[item] = op[1]
        elif op[0] == "pop" and queued:
            tenant, item = queue.pop()
            assert queued.pop(item) == tenant
            served.append((tenant, item))
        elif op[0] == "remove" and queued:
            item = sorted(queued)[op[1] % len(queued)]
            assert queue.remove(queued.pop(item), item)
            assert not queue.remove("a", item) and not queue.remove("zz", item)
            ended.append(item)
        elif op[0] == "cost":
            queue.charge(op[1], op[2])
            queue.correct(op[1], op[3])
        assert len(queue) == len(queued)
        assert all(queue.tenant_len(t) == list(queued.values()).count(t) for t in "abcd")
    while len(queue):
        tenant, item = queue.pop()
        assert queued.pop(item) == tenant
        served.append((tenant, item))
    with pytest.raises(IndexError):
        queue.pop()
    ended += [item for _, item in served]
    assert sorted(ended) == list(range(next(ids)))  # nothing lost, nothing twice
    for tenant in "abcd":
        mine = [item for t, item in served if t == tenant]
        assert mine == sorted(mine)


@settings(max_examples=200, deadline=None)
@given(
    backlogs=st.lists(st.tuples(TENANTS, st.integers(1, 60)), min_size=1, max_size=6),
    served_before=st.integers(0, 100),
    costs=st.fixed_dictionaries({t: COSTS for t in "abcdx"}),
    weights=WEIGHTS,
    newcomer=st.sampled_from(["x", "a"]),
)
def test_a_tenant_that_joins_is_served_however_deep_the_backlog(
    name: str, backlogs: list[tuple[str, int]], served_before: int, costs: dict[str, float],
    weights: dict[str, float], newcomer: str,
) -> None:
    """Exact costs; the newcomer is new ("x") or returns after its own backlog ran out ("a")."""
    policy = POLICIES[name]
    queue = band(policy, weights)
    for tenant, count in backlogs:
        for _ in range(count):
            queue.push(tenant, object())
    for _ in range(min(served_before, len(queue))):
        tenant, _ = queue.pop()
        queue.charge(tenant, costs[tenant])
    if queue.tenant_len(newcomer):
        newcomer = "x"
    others = {t for t in "abcd" if queue.tenant_len(t)}
    service = {t: policy.service(costs[t], weights[t]) for t in "abcdx"}
    # While the newcomer waits, each other tenant can gain at most about one
    # request's service (U) more than the newcomer has: a bound in releases.
    rounds = math.ceil(max(service.values()) / min(service.values())) + 1
    mark = object()
    queue.push(newcomer, mark)
    waited = 0
    while True:
        tenant, item = queue.pop()
        queue.charge(tenant, costs[tenant])
        if item is mark:
            break
        waited += 1
    assert waited <= len(others) * rounds


plans = st.lists(st.tuples(COSTS, COSTS), min_size=1, max_size=8)  # (estimated cost, real cost)


@settings(max_examples=200, deadline=None)
@given(
    plan=st.fixed_dictionaries({t: plans for t in "abc"}),
    tenants=st.integers(2, 3),
    weights=WEIGHTS,
    in_flight=st.integers(1, 6),
    steps=st.integers(10, 200),
    completions=st.lists(st.integers(0, 5), min_size=200, max_size=200),
)
def test_backlogged_tenants_stay_within_the_policys_bound(
    name: str, plan: dict[str, list[tuple[float, float]]], tenants: int, weights: dict[str, float],
    in_flight: int, steps: int, completions: list[int],
) -> None:
    """|service released to A - to B| <= U + K·E at every moment, for every pair."""
    policy = POLICIES[name]
    queue = band(policy, weights)
    names = "abc"[:tenants]
    served = dict.fromkeys(names, 0)
    released = dict.fromkeys(names, 0.0)  # real service of everything released
    pending: list[tuple[str, float]] = []  # in flight: (tenant, real cost - estimate)
    for i in range(2 * tenants):  # every tenant stays backlogged: each release is replaced
        queue.push(names[i % tenants], i)

    def service(tenant: str, cost: float) -> float:
        return policy.service(cost, weights[tenant])

    requests = [(t, est, real) for t in names for est, real in plan[t]]
    unit = max(service(t, real) for t, _, real in requests)
    error = max(abs(service(t, real) - service(t, est)) for t, est, real in requests)
    for step in range(steps):
        # Some in-flight requests finish (any order), then one more is released.
        for _ in range(min(completions[step], len(pending))):
            tenant, delta = pending.pop(completions[step] % len(pending))
            queue.correct(tenant, delta)
        while len(pending) >= in_flight:
            tenant, delta = pending.pop(0)
            queue.correct(tenant, delta)
        tenant, _ = queue.pop()
        queue.push(tenant, 10_000 + step)
        estimate, real = plan[tenant][served[tenant] % len(plan[tenant])]
        served[tenant] += 1
        queue.charge(tenant, estimate)
        pending.append((tenant, real - estimate))
        released[tenant] += service(tenant, real)
        for a, b in itertools.combinations(names, 2):
            assert abs(released[a] - released[b]) <= unit + in_flight * error + 1e-6


def test_the_config_offers_every_registered_policy(name: str) -> None:
    model = {"name": "m", "endpoints": ["http://127.0.0.1:1"], "policy": name}
    assert parse_config({"models": [model]}).models[0].policy == name
