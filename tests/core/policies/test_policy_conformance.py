"""The contract of a fairness policy, run on every registered one (extproc/core/policies), on both paths.

A new policy passes these before the config accepts its name:

* every request ends exactly once (popped or removed), each tenant's in its
  order: arrival, or earliest deadline first for a ``by_deadline`` policy, none
  overtaken by more than ``overtakes`` later requests of its tenant (a
  ``locality`` policy's reordering; 0 for the others: strictly in order);
* no starvation within a band: a tenant that joins is served within a number
  of releases that does not grow with the backlog in front of it;
* its own fairness bound: between continuously backlogged tenants the service
  released (the policy's own measure, ``Policy.service``) differs by at most
  ``U + K·E``, plus ``window_requests`` requests' worth for a policy that may
  move a tenant ahead (see :class:`extproc.core.policies.base.Policy`).

Every request carries a deadline (as ``Held.deadline``): its arrival on a
clock that ticks once per request, plus an objective the example draws.
Policies that ignore deadlines must pass unchanged.

Each runs on two paths, with the same properties and the same bounds:
``single`` is one instance's band policy; ``script`` is the policy's cluster
form (``Policy.cluster``) as a cluster runs it: the Redis script
(adapters/cluster/schedule.lua) on a real Redis decides every pop, from the
backlog, service and corrections a seat would send (core/cluster.py), in the
script's own schema (adapters/cluster/wire.py). A policy without a cluster
form is not run on the script path: the config refuses it with a cluster.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import AsyncIterator, Callable, Hashable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, replace
from typing import Any, Protocol

import pytest
import redis.asyncio as aioredis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extproc.adapters.cluster.link import SCRIPT
from extproc.adapters.cluster.wire import Trip, decode_grant, encode_trip
from extproc.adapters.config import ConfigError, parse_config
from extproc.core.cluster import Ask, Backlog, Correction
from extproc.core.fair_queue import FairQueue
from extproc.core.policies import POLICIES, Policy
from tests.propertyutil import examples
from tests.redisutil import RedisServer

pytestmark = pytest.mark.parametrize("name", sorted(POLICIES))

TENANTS = st.sampled_from(["a", "b", "c", "d"])
WEIGHTS = st.fixed_dictionaries({t: st.floats(0.25, 4) for t in "abcdx"})
COSTS = st.floats(1, 100)
OBJECTIVES = st.floats(0.5, 50)  # seconds, on a clock that ticks once per request
HITS = st.sampled_from([0.0, 0.0, 16.0, 128.0, 2048.0])  # cached prompt tokens; equal ones tie
# Function-scoped fixtures (the path factory) serve every example: each example builds its own path.
SETTINGS = settings(max_examples=examples(200), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@dataclass(frozen=True)
class Request:
    """A queued request: numbered in arrival order (one tick of the clock each), due by ``deadline``.

    ``hit``: the prompt tokens it would find cached (``ExpectedHit``, what a
    locality policy orders by). Policies that ignore it must pass unchanged.
    """

    number: int
    deadline: float
    hit: float = 0.0

    @classmethod
    def due(cls, number: int, objective: float, hit: float = 0.0) -> Request:
        return cls(number, number + objective, hit)

    def cached_tokens(self) -> float:
        return self.hit


def order(policy: Policy) -> Callable[[Request], tuple[float, ...]]:
    """The order the policy promises within a tenant: by deadline (ties: arrival), or by arrival."""
    if policy.by_deadline:
        return lambda request: (request.deadline, request.number)
    return lambda request: (request.number,)


class Path(Protocol):
    """One band of a policy as one of the two paths runs it."""

    def __len__(self) -> int: ...

    def tenant_len(self, tenant: str) -> int: ...

    def push(self, tenant: str, item: Hashable, cost: float) -> None:
        """Queue ``item``; ``cost`` is what its release is charged (its estimate)."""

    async def pop(self) -> tuple[str, Any]:
        """Release the next request (charged its cost); IndexError when none is queued."""
        ...

    def remove(self, tenant: str, item: Hashable) -> bool: ...

    def ended(self, tenant: str, estimate: float, real: float) -> None:
        """A release of ``tenant`` ended: it was charged ``estimate`` and cost ``real``."""


class Single:
    """The policy's band on one instance."""

    def __init__(self, policy: Policy, weights: dict[str, float]) -> None:
        self._band = policy.new_band(lambda tenant: weights[tenant], Request.cached_tokens)
        self._costs: dict[Hashable, float] = {}

    def __len__(self) -> int:
        return len(self._band)

    def tenant_len(self, tenant: str) -> int:
        return self._band.tenant_len(tenant)

    def push(self, tenant: str, item: Hashable, cost: float) -> None:
        self._costs[item] = cost
        self._band.push(tenant, item)

    async def pop(self) -> tuple[str, Any]:
        tenant, item = self._band.pop()
        self._band.charge(tenant, self._costs.pop(item))
        return tenant, item

    def remove(self, tenant: str, item: Hashable) -> bool:
        self._costs.pop(item, None)
        return self._band.remove(tenant, item)

    def ended(self, tenant: str, estimate: float, real: float) -> None:
        self._band.correct(tenant, real - estimate)


class Script:
    """The policy's cluster form: one seat's FIFOs here, every pop decided by the script on Redis.

    Each pop is one round trip asking for one slot (nothing in flight, a cap
    of one), with this seat's whole backlog: each tenant's count, the service
    of its head, whether its FIFO was empty since the last trip (fresh), and
    the corrections of releases that ended meanwhile, as ``ClusterSeat`` sends them.
    """

    def __init__(self, policy: Policy, weights: dict[str, float], client: aioredis.Redis) -> None:
        assert policy.cluster is not None
        self._form = str(policy.cluster)
        self._service: Callable[[str, float], float] = lambda tenant, cost: policy.service(cost, weights[tenant])
        self._script = client.register_script(SCRIPT)
        self._fifos: FairQueue[Hashable] = FairQueue(1)
        self._costs: dict[Hashable, float] = {}
        self._fresh: set[str] = set()
        self._corrections: dict[str, float] = {}

    def __len__(self) -> int:
        return len(self._fifos)

    def tenant_len(self, tenant: str) -> int:
        return self._fifos.tenant_len(tenant)

    def push(self, tenant: str, item: Hashable, cost: float) -> None:
        if not self._fifos.tenant_len(tenant):
            self._fresh.add(tenant)
        self._costs[item] = cost
        self._fifos.push(0, tenant, item)

    async def pop(self) -> tuple[str, Any]:
        if not len(self._fifos):
            raise IndexError("pop from an empty band")
        backlog = tuple(
            Backlog(0, tenant, count, self._service(tenant, self._costs[self._fifos.head(0, tenant)]),
                    fresh=tenant in self._fresh)
            for tenant, count in self._fifos.tenant_lengths(0).items()
        )
        corrections = tuple(Correction(0, tenant, delta) for tenant, delta in self._corrections.items())
        self._fresh.clear()
        self._corrections.clear()
        trip = Trip("seat", 60_000, "conformance:wake:", "m", self._form, Ask(0, (1,), backlog, corrections))
        grant = decode_grant(await self._script(keys=["conformance:m"], args=[encode_trip(trip)]))
        (release,) = grant.releases
        item = self._fifos.take(0, release.tenant)
        assert item is not None
        del self._costs[item]
        return release.tenant, item

    def remove(self, tenant: str, item: Hashable) -> bool:
        self._costs.pop(item, None)
        return self._fifos.remove(0, tenant, item)

    def ended(self, tenant: str, estimate: float, real: float) -> None:
        delta = self._service(tenant, real) - self._service(tenant, estimate)
        self._corrections[tenant] = self._corrections.get(tenant, 0.0) + delta


# Builds a fresh path for one example: ``async with new_path(policy, weights) as queue``.
PathFactory = Callable[[Policy, dict[str, float]], AbstractAsyncContextManager[Path]]


@pytest.fixture(params=[pytest.param("single", marks=pytest.mark.unit),
                        pytest.param("script", marks=pytest.mark.integration)])
def new_path(request: pytest.FixtureRequest, name: str) -> PathFactory:
    if request.param == "single":
        @asynccontextmanager
        async def single(policy: Policy, weights: dict[str, float]) -> AsyncIterator[Path]:
            yield Single(policy, weights)

        return single
    if POLICIES[name].cluster is None:
        pytest.skip(f"{name} has no cluster form: the config refuses it with a cluster (test below)")
    server: RedisServer = request.getfixturevalue("redis_server")

    @asynccontextmanager
    async def script(policy: Policy, weights: dict[str, float]) -> AsyncIterator[Path]:
        client = aioredis.from_url(server.url)
        try:
            await client.flushall()
            yield Script(policy, weights, client)
        finally:
            await client.aclose()

    return script


# An operation: push (tenant, cost, objective), pop, remove the n-th queued item, or a release's
# end (estimate, then real = estimate + delta) reported for the tenant.
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("push"), TENANTS, COSTS, OBJECTIVES, HITS),
        st.tuples(st.just("pop")),
        st.tuples(st.just("remove"), st.integers(0, 1000)),
        st.tuples(st.just("cost"), TENANTS, COSTS, st.floats(-50, 50)),
    ),
    max_size=200,
)


@SETTINGS
@given(ops=OPS, weights=WEIGHTS)
async def test_every_request_ends_exactly_once_in_its_tenants_order(
    new_path: PathFactory, name: str, ops: list[tuple[Any, ...]], weights: dict[str, float]
) -> None:
    policy = POLICIES[name]
    first = order(policy)
    async with new_path(policy, weights) as queue:
        queued: dict[Request, str] = {}
        ended: list[int] = []
        ids = itertools.count()

        passed: dict[Request, int] = {}  # how many later requests of its tenant left before it

        async def pop() -> None:
            tenant, item = await queue.pop()
            # The tenant's first queued request in the policy's order, or one at most
            # ``overtakes`` later requests of its tenant have gone before.
            assert queued.pop(item) == tenant
            for earlier in (r for r, t in queued.items() if t == tenant and first(r) < first(item)):
                passed[earlier] = passed.get(earlier, 0) + 1
                assert passed[earlier] <= policy.overtakes
            ended.append(item.number)

        for op in ops:
            if op[0] == "push":
                item = Request.due(next(ids), op[3], op[4])
                queue.push(op[1], item, op[2])
                queued[item] = op[1]
            elif op[0] == "pop" and queued:
                await pop()
            elif op[0] == "remove" and queued:
                item = sorted(queued, key=lambda r: r.number)[op[1] % len(queued)]
                assert queue.remove(queued.pop(item), item)
                assert not queue.remove("a", item) and not queue.remove("zz", item)
                ended.append(item.number)
            elif op[0] == "cost":
                queue.ended(op[1], op[2], op[2] + op[3])
            assert len(queue) == len(queued)
            assert all(queue.tenant_len(t) == list(queued.values()).count(t) for t in "abcd")
        while len(queue):
            await pop()
        with pytest.raises(IndexError):
            await queue.pop()
        assert sorted(ended) == list(range(next(ids)))  # nothing lost, nothing twice


@SETTINGS
@given(
    backlogs=st.lists(st.tuples(TENANTS, st.integers(1, 60)), min_size=1, max_size=6),
    served_before=st.integers(0, 100),
    costs=st.fixed_dictionaries({t: COSTS for t in "abcdx"}),
    weights=WEIGHTS,
    newcomer=st.sampled_from(["x", "a"]),
    objectives=st.fixed_dictionaries({t: OBJECTIVES for t in "abcdx"}),
    hits=st.fixed_dictionaries({t: HITS for t in "abcdx"}),
)
async def test_a_tenant_that_joins_is_served_however_deep_the_backlog(
    new_path: PathFactory, name: str, backlogs: list[tuple[str, int]], served_before: int, costs: dict[str, float],
    weights: dict[str, float], newcomer: str, objectives: dict[str, float], hits: dict[str, float],
) -> None:
    """Exact costs; the newcomer is new ("x") or returns after its own backlog ran out ("a")."""
    policy = POLICIES[name]
    async with new_path(policy, weights) as queue:
        ids = itertools.count()
        for tenant, count in backlogs:
            for _ in range(count):
                queue.push(tenant, Request.due(next(ids), objectives[tenant], hits[tenant]), costs[tenant])
        for _ in range(min(served_before, len(queue))):
            await queue.pop()
        if queue.tenant_len(newcomer):
            newcomer = "x"
        others = {t for t in "abcd" if queue.tenant_len(t)}
        service = {t: policy.service(costs[t], weights[t]) for t in "abcdx"}
        # While the newcomer waits, each other tenant can gain at most about one
        # request's service (U) more than the newcomer has, and its window more
        # (one of its own requests each): a bound in releases.
        rounds = math.ceil(max(service.values()) / min(service.values())) + 1 + policy.window_requests
        mark = Request.due(next(ids), objectives[newcomer], hits[newcomer])
        queue.push(newcomer, mark, costs[newcomer])
        waited = 0
        while (await queue.pop())[1] != mark:
            waited += 1
        assert waited <= len(others) * rounds


plans = st.lists(st.tuples(COSTS, COSTS, OBJECTIVES, HITS), min_size=1, max_size=8)  # (estimate, real cost, objective, hit)


@SETTINGS
@given(
    plan=st.fixed_dictionaries({t: plans for t in "abc"}),
    tenants=st.integers(2, 3),
    weights=WEIGHTS,
    in_flight=st.integers(1, 6),
    steps=st.integers(10, 200),
    completions=st.lists(st.integers(0, 5), min_size=200, max_size=200),
)
async def test_backlogged_tenants_stay_within_the_policys_bound(
    new_path: PathFactory, name: str, plan: dict[str, list[tuple[float, float, float, float]]], tenants: int,
    weights: dict[str, float], in_flight: int, steps: int, completions: list[int],
) -> None:
    """|service released to A - to B| <= U + K·E (+ the policy's window) at every moment, for every pair."""
    policy = POLICIES[name]
    async with new_path(policy, weights) as queue:
        names = "abc"[:tenants]
        pushed = dict.fromkeys(names, 0)
        planned: dict[Request, tuple[float, float]] = {}  # its (estimate, real cost): each tenant's plan in turn
        released = dict.fromkeys(names, 0.0)  # real service of everything released
        pending: list[tuple[str, float, float]] = []  # in flight: (tenant, estimate, real cost)

        def push(tenant: str, number: int) -> None:
            estimate, real, objective, hit = plan[tenant][pushed[tenant] % len(plan[tenant])]
            pushed[tenant] += 1
            item = Request.due(number, objective, hit)
            planned[item] = estimate, real
            queue.push(tenant, item, estimate)

        for i in range(2 * tenants):  # every tenant stays backlogged: each release is replaced
            push(names[i % tenants], i)

        def service(tenant: str, cost: float) -> float:
            return policy.service(cost, weights[tenant])

        requests = [(t, est, real) for t in names for est, real, _, _ in plan[t]]
        unit = max(service(t, real) for t, _, real in requests)
        error = max(abs(service(t, real) - service(t, est)) for t, est, real in requests)
        # How far the policy may move a tenant ahead: requests' worth, each at most the largest estimate.
        window = policy.window_requests * max(service(t, est) for t, est, _ in requests)
        for step in range(steps):
            # Some in-flight requests finish (any order), then one more is released.
            for _ in range(min(completions[step], len(pending))):
                queue.ended(*pending.pop(completions[step] % len(pending)))
            while len(pending) >= in_flight:
                queue.ended(*pending.pop(0))
            tenant, item = await queue.pop()
            push(tenant, 10_000 + step)
            estimate, real = planned.pop(item)
            pending.append((tenant, estimate, real))
            released[tenant] += service(tenant, real)
            for a, b in itertools.combinations(names, 2):
                assert abs(released[a] - released[b]) <= unit + in_flight * error + window + 1e-6


MODEL = {"endpoints": ["http://127.0.0.1:1"]}
CLUSTER = {"redis_url": "redis://127.0.0.1:6379/0"}


@pytest.mark.unit
def test_the_config_offers_every_registered_policy_and_a_cluster_only_those_with_a_cluster_form(name: str) -> None:
    model = {"name": "m", **MODEL, "policy": name}
    assert parse_config({"models": [model]}).models[0].policy == name
    if POLICIES[name].cluster is not None:
        assert parse_config({"models": [model], "cluster": CLUSTER}).models[0].policy == name
    else:
        with pytest.raises(ConfigError, match=r"models\[0\]\.policy"):
            parse_config({"models": [model], "cluster": CLUSTER})


@pytest.mark.unit
def test_a_policy_without_a_cluster_form_is_refused_with_a_cluster(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(POLICIES, name, replace(POLICIES[name], cluster=None))
    models = [{"name": "m", **MODEL}, {"name": "n", **MODEL, "policy": name}]
    with pytest.raises(ConfigError, match=rf"models\[1\]\.policy: {name} has no cluster form"):
        parse_config({"models": models, "cluster": CLUSTER})
    assert parse_config({"models": models}).models[1].policy == name
