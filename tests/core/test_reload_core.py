"""A dispatcher reconfigured while it holds requests (ModelDispatcher.reconfigure): nothing queued is lost or reordered.

A reload (adapters/reload.py) hands a live dispatcher new tenants, weights,
caps and rule settings. Whatever it is told, every request queued before
still ends exactly once, each tenant's requests in a class still leave in
arrival order, and the new settings govern what happens next.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.core.bands import Band
from extproc.core.cost import CostWeights
from extproc.core.dispatcher import Held, LiveSettings
from extproc.core.release import RULES, RuleSettings
from extproc.core.values.outcomes import Refusal, Refused
from tests.helpers.reload_core import BANDS, dispatcher, tenants
from tests.propertyutil import examples

pytestmark = pytest.mark.unit

TENANTS = ("alice", "bob", "carol")


def live(weights: dict[str, float], in_flight: int, max_queued: int = 1_000, bands: tuple[Band, ...] = BANDS,
         tenant_cap: int = 1_000) -> LiveSettings:
    return LiveSettings(
        bands=bands, tenant=tenants(weights, tenant_cap), cost=CostWeights(), max_queued=max_queued,
        max_queue_wait_s=120.0, reserved_waiting=0, rule=RULES["static_concurrency"],
        rule_settings=RuleSettings(3, max_in_flight=in_flight),
    )


Op = tuple[Any, ...]
ops = st.lists(st.one_of(
    st.tuples(st.just("submit"), st.sampled_from(TENANTS), st.integers(0, 1)),
    st.tuples(st.just("end"), st.integers(0, 50)),
    st.tuples(st.just("leave"), st.integers(0, 50)),
    st.tuples(st.just("reload"), st.dictionaries(st.sampled_from(TENANTS), st.floats(0.1, 10.0)), st.integers(1, 4)),
), max_size=60)


async def _run(policy: str, script: list[Op]) -> None:
    d = dispatcher(policy, {}, 2)
    submitted: dict[tuple[str, int], list[Held]] = {}
    every: list[Held] = []
    ended: Counter[int] = Counter()
    abandoned: set[int] = set()

    def check_order() -> None:
        """What was released of each (tenant, class) queue is a prefix of what entered it (less who left): arrival order."""
        for queue in submitted.values():
            released = [h.released for h in queue if id(h) not in abandoned]
            assert released == sorted(released, reverse=True), released

    def end(held: Held) -> None:
        d.end(held)
        ended[id(held)] += 1

    for op in script:
        if op[0] == "submit":
            held = d.submit(op[1], op[2], max_tokens=16)
            submitted.setdefault((op[1], op[2]), []).append(held)
            every.append(held)
        elif op[0] in ("end", "leave"):
            # end: a released request's response finished; leave: a queued client went away.
            pool = [h for h in every if not h.ended and h.released == (op[0] == "end")]
            if pool:
                held = pool[op[1] % len(pool)]
                if not held.released:
                    abandoned.add(id(held))
                end(held)
        else:
            queued = d.queued
            d.reconfigure(live(op[1], op[2]))
            assert d.queued <= queued  # a reconfiguration only ever releases (a raised limit)
        check_order()
    # Afterwards every request ends: each released one finishes, which lets the next go.
    for _ in range(len(every) + 1):
        for held in [h for h in every if h.released and not h.ended]:
            end(held)
    check_order()
    assert d.queued == 0 and d.in_flight == 0
    assert all(h.ended or h.released for h in every)
    assert all(count == 1 for count in ended.values())
    assert all(h.future.done() and h.future.exception() is None for h in every)  # nothing was refused
    assert {id(h) for h in every if not h.released} == abandoned  # released, unless its client left


@settings(max_examples=examples(150), deadline=None)
@given(policy=st.sampled_from(["vtc", "round_robin"]), script=ops)
def test_reloading_never_loses_or_reorders_queued_requests(policy: str, script: list[Op]) -> None:
    asyncio.run(_run(policy, script))


async def _releases(reloaded: dict[str, float] | None) -> list[str]:
    """The order alice's and bob's queued requests leave in, one slot, the weights changed once all are queued."""
    d = dispatcher("vtc", {}, 1)
    first = d.submit("carol", 1, max_tokens=16)  # holds the one slot while the others queue
    queued = [d.submit(tenant, 1, max_tokens=16) for _ in range(8) for tenant in ("alice", "bob")]
    if reloaded is not None:
        d.reconfigure(live(reloaded, 1))
    order: list[str] = []
    running = first
    for _ in range(len(queued)):
        d.end(running)
        running = next(h for h in queued if h.released and not h.ended)
        order.append(running.request.tenant)
    d.end(running)
    return order


def mean_rank(order: list[str], tenant: str) -> float:
    ranks = [i for i, t in enumerate(order) if t == tenant]
    return sum(ranks) / len(ranks)


async def test_a_changed_weight_governs_the_requests_already_queued() -> None:
    same = await _releases(None)
    heavier = await _releases({"bob": 4.0})
    assert sorted(same) == sorted(heavier)  # the same requests, all served
    # Equal weights interleave; bob at weight 4 goes about four times as often, so his requests leave earlier.
    assert abs(mean_rank(same, "bob") - mean_rank(same, "alice")) <= 1
    assert mean_rank(heavier, "bob") + 3 < mean_rank(heavier, "alice")


async def test_new_caps_govern_the_next_arrival_and_a_raised_limit_releases_at_once() -> None:
    d = dispatcher("round_robin", {}, 1)
    held = [d.submit("alice", 1) for _ in range(4)]
    assert [h.released for h in held] == [True, False, False, False]
    d.reconfigure(live({}, in_flight=3, tenant_cap=3))
    assert [h.released for h in held] == [True, True, True, False]  # two more slots, taken at once
    d.submit("alice", 1)
    d.submit("alice", 1)  # three queued: the new cap
    with pytest.raises(Refused) as refused:
        d.submit("alice", 1)
    assert refused.value.refusal is Refusal.TENANT_QUEUE_FULL


async def test_a_tenant_cap_lowered_below_its_backlog_keeps_the_backlog_and_refuses_the_next() -> None:
    d = dispatcher("round_robin", {}, 1)
    held = [d.submit("alice", 1) for _ in range(5)]
    d.reconfigure(live({}, in_flight=1, tenant_cap=2))
    assert d.queued == 4  # nothing queued is dropped for a lower cap
    with pytest.raises(Refused) as refused:
        d.submit("alice", 1)
    assert refused.value.refusal is Refusal.TENANT_QUEUE_FULL
    for h in held:
        d.end(h)
    assert d.queued == 0


def test_the_bands_must_keep_their_names() -> None:
    async def run() -> None:
        d = dispatcher("round_robin", {}, 1)
        with pytest.raises(ValueError, match="bands"):
            d.reconfigure(live({}, 1, bands=(Band("interactive"), Band("bulk"))))

    asyncio.run(run())


async def test_changed_band_settings_apply_to_the_next_arrival() -> None:
    d = dispatcher("round_robin", {}, 1)
    d.submit("alice", 1)
    d.submit("alice", 1)
    tighter = (BANDS[0], replace(BANDS[1], max_queued=1))
    d.reconfigure(live({}, 1, bands=tighter))
    with pytest.raises(Refused) as refused:
        d.submit("bob", 1)
    assert refused.value.refusal is Refusal.BAND_QUEUE_FULL


async def test_reject_all_answers_with_the_reason_given() -> None:
    d = dispatcher("round_robin", {}, 1)
    running, waiting = d.submit("alice", 1), d.submit("alice", 1)
    d.reject_all(lambda: Refused(Refusal.MODEL_NOT_FOUND, "removed"))
    assert running.released
    with pytest.raises(Refused) as refused:
        await waiting.future
    assert refused.value.refusal is Refusal.MODEL_NOT_FOUND and refused.value.message == "removed"
