"""The scheduling core: strict bands, per-tenant FIFO, round-robin, exactly-once."""

from __future__ import annotations

import itertools
from collections import Counter
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.core.fair_queue import FairQueue
from extproc.core.policies.round_robin import TenantRoundRobin
from tests.propertyutil import examples

pytestmark = pytest.mark.unit


def drain(queue: FairQueue[int]) -> list[tuple[int, str, int]]:
    out = []
    while len(queue):
        out.append(queue.pop())
    return out


def test_power_user_flood_does_not_delay_newcomers() -> None:
    q: FairQueue[int] = FairQueue(bands=1)
    for i in range(500):
        q.push(0, "A", i)
    q.pop()  # A is being served when B and C arrive
    q.push(0, "B", 1000)
    q.push(0, "C", 1001)
    order = [tenant for _, tenant, _ in drain(q)]
    assert order[:4] == ["A", "B", "C", "A"]
    assert order.count("A") == 499


def test_strict_priority_between_bands() -> None:
    q: FairQueue[int] = FairQueue(bands=3)
    q.push(2, "batch-user", 1)
    q.push(1, "std-user", 2)
    q.push(0, "chat-user", 3)
    q.push(2, "batch-user", 4)
    assert [item for _, _, item in drain(q)] == [3, 2, 1, 4]


def test_remove_of_queued_item_and_of_unknown_item() -> None:
    q: FairQueue[int] = FairQueue(bands=2)
    q.push(0, "A", 1)
    q.push(0, "B", 2)
    assert q.remove(0, "A", 1)
    assert not q.remove(0, "A", 1)
    assert not q.remove(1, "B", 2)  # wrong band: not there
    assert len(q) == 1 and q.band_len(0) == 1
    assert q.pop() == (0, "B", 2)
    with pytest.raises(IndexError):
        q.pop()


def test_a_returning_tenant_rejoins_at_the_back() -> None:
    band: TenantRoundRobin[int] = TenantRoundRobin()
    band.push("A", 1)
    band.push("B", 2)
    band.push("B", 3)
    assert band.pop() == ("A", 1)  # A's queue is now empty: A leaves the rotation
    band.push("A", 4)  # ...and comes back behind B
    assert [band.pop() for _ in range(3)] == [("B", 2), ("A", 4), ("B", 3)]


def test_queue_needs_a_band() -> None:
    with pytest.raises(ValueError):
        FairQueue(bands=0)


# --- properties --------------------------------------------------------------

TENANTS = st.sampled_from(["a", "b", "c", "d", "e"])
# An operation is a push (band, tenant), a pop, or a removal of the n-th queued item.
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("push"), st.integers(0, 2), TENANTS),
        st.tuples(st.just("pop")),
        st.tuples(st.just("remove"), st.integers(0, 1000)),
    ),
    max_size=200,
)


@settings(max_examples=examples(300))
@given(OPS)
def test_every_item_leaves_exactly_once_and_fifo_within_tenant(ops: list[tuple[Any, ...]]) -> None:
    q: FairQueue[int] = FairQueue(bands=3)
    queued: dict[int, tuple[int, str]] = {}
    left: list[int] = []
    popped: list[tuple[int, str, int]] = []
    next_id = 0
    for op in ops:
        if op[0] == "push":
            q.push(op[1], op[2], next_id)
            queued[next_id] = (op[1], op[2])
            next_id += 1
        elif op[0] == "pop" and queued:
            highest_waiting = min(b for b, _ in queued.values())
            band, tenant, item = q.pop()
            assert band == highest_waiting  # strict priority
            assert queued.pop(item) == (band, tenant)
            popped.append((band, tenant, item))
        elif op[0] == "remove" and queued:
            item = sorted(queued)[op[1] % len(queued)]
            band, tenant = queued.pop(item)
            assert q.remove(band, tenant, item)
            left.append(item)
        assert len(q) == len(queued)
    for band, tenant, item in drain(q):
        assert queued.pop(item) == (band, tenant)
        popped.append((band, tenant, item))
    left += [item for _, _, item in popped]
    assert sorted(left) == list(range(next_id))  # nothing lost, nothing twice
    for key in {(b, t) for b, t, _ in popped}:  # ids grow in push order
        ids = [item for b, t, item in popped if (b, t) == key]
        assert ids == sorted(ids)


@settings(max_examples=examples(300))
@given(st.lists(st.tuples(TENANTS, st.integers(1, 20)), min_size=1, max_size=8))
def test_fifo_within_tenant_and_no_starvation(backlogs: list[tuple[str, int]]) -> None:
    """All tenants backlogged at once: served in rounds, each tenant's items in order."""
    band: TenantRoundRobin[tuple[str, int]] = TenantRoundRobin()
    sizes: Counter[str] = Counter()
    for tenant, count in backlogs:
        for _ in range(count):
            band.push(tenant, (tenant, sizes[tenant]))
            sizes[tenant] += 1
    served: list[tuple[str, int]] = []
    while len(band):
        served.append(band.pop()[1])
    for tenant in sizes:
        seqs = [n for t, n in served if t == tenant]
        assert seqs == list(range(sizes[tenant]))  # FIFO within the tenant
    # No starvation: while a tenant is backlogged, the others are served at most
    # once between two of its services.
    for tenant in sizes:
        positions = [i for i, (t, _) in enumerate(served) if t == tenant]
        for a, b in itertools.pairwise(positions):
            between = Counter(t for t, _ in served[a + 1 : b])
            assert all(n <= 1 for n in between.values())


@settings(max_examples=examples(300))
@given(
    st.lists(st.tuples(TENANTS, st.integers(1, 10)), min_size=1, max_size=5),
    st.integers(0, 30),
    st.sampled_from(["x", "y"]),
)
def test_newcomer_waits_at_most_one_round(backlogs: list[tuple[str, int]], served_before: int, newcomer: str) -> None:
    band: TenantRoundRobin[int] = TenantRoundRobin()
    n = 0
    for tenant, count in backlogs:
        for _ in range(count):
            band.push(tenant, n)
            n += 1
    for _ in range(min(served_before, len(band) - 1)):
        band.pop()
    backlogged = {t for t, _ in backlogs} if len(band) else set()
    band.push(newcomer, -1)
    served: list[str] = []
    while True:
        tenant, item = band.pop()
        if item == -1:
            break
        served.append(tenant)
    # Before the newcomer, each other tenant is served at most once.
    assert all(c <= 1 for c in Counter(served).values())
    assert set(served) <= backlogged
