"""``policy: locality`` on its own (the shared suite, tests/core/policies/test_policy_conformance.py, checks its bounds), the
prefix signature and the account of the engines' caches it orders by."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.core.policies import POLICIES
from extproc.core.policies.locality import LOOKAHEAD, OVERTAKES, QUANTUM_REQUESTS, LocalityBand
from extproc.core.prefix import Prefix, signature
from extproc.core.prefix_cache import EndpointCache, PrefixCaches
from extproc.core.values.engine_load import EngineLoad
from tests.propertyutil import examples

pytestmark = pytest.mark.unit

_numbers = itertools.count()


@dataclass(eq=False)
class Req:
    hit: float = 0.0
    number: int = 0

    def __post_init__(self) -> None:
        self.number = next(_numbers)

    def cached_tokens(self) -> float:
        return self.hit


def band() -> LocalityBand[Req]:
    return LocalityBand(lambda tenant: 1.0, Req.cached_tokens)


def test_a_request_is_overtaken_by_at_most_overtakes_later_requests_of_its_tenant() -> None:
    queue = band()
    first = Req(hit=0)
    queue.push("a", first)
    later = [Req(hit=2048) for _ in range(3 * OVERTAKES)]
    for request in later:
        queue.push("a", request)
    order = []
    for _ in range(len(later) + 1):
        _, item = queue.pop()
        queue.charge("a", 10)
        order.append(item)
    assert order.index(first) == OVERTAKES  # the cached ones went first, until it had been passed OVERTAKES times
    assert order[:OVERTAKES] == later[:OVERTAKES]


def test_only_the_first_lookahead_requests_are_candidates() -> None:
    queue = band()
    for _ in range(LOOKAHEAD):
        queue.push("a", Req(hit=0))
    cached = Req(hit=2048)
    queue.push("a", cached)
    assert queue.pop()[1] is not cached


def test_within_the_quantum_the_longest_hit_goes_first_beyond_it_fairness_wins() -> None:
    queue = band()
    queue.push("a", Req(hit=0))
    queue.push("b", Req(hit=100))
    queue.push("b", Req(hit=100))
    queue.charge("b", 10)  # b's largest charge: 10, its quantum 2 x 10
    assert queue.pop()[0] == "b"  # b is 10 above a: within its quantum, and its request is cached
    queue.charge("b", 10)
    assert queue.counter("b") - queue.counter("a") == 20
    assert queue.pop()[0] == "b"  # 20 above: still within
    queue.push("b", Req(hit=100))
    queue.charge("b", 10)
    assert queue.counter("b") - queue.counter("a") > QUANTUM_REQUESTS * 10
    assert queue.pop()[0] == "a"  # beyond the quantum: the fair share decides


costs = st.lists(st.tuples(st.sampled_from("abc"), st.floats(1, 100)), min_size=1, max_size=60)


@settings(max_examples=examples(100), deadline=None)
@given(pushes=costs, pops=st.integers(1, 60))
def test_with_nothing_cached_it_is_exactly_vtc(pushes: list[tuple[str, float]], pops: int) -> None:
    vtc = POLICIES["vtc"].new_band(lambda t: 1.0, Req.cached_tokens)
    locality = POLICIES["locality"].new_band(lambda t: 1.0, Req.cached_tokens)
    cost = {}
    for tenant, price in pushes:
        request = Req()
        cost[request] = price
        vtc.push(tenant, request)
        locality.push(tenant, request)
    for _ in range(min(pops, len(pushes))):
        one, two = vtc.pop(), locality.pop()
        assert one == two
        vtc.charge(one[0], cost[one[1]])
        locality.charge(two[0], cost[two[1]])


def test_the_signature_chains_full_blocks_only() -> None:
    doc = b"d" * 2000
    one = signature(doc + b"question one", block_bytes=512, max_blocks=16, bytes_per_token=4)
    two = signature(doc + b"another question", block_bytes=512, max_blocks=16, bytes_per_token=4)
    assert len(one.blocks) == len(two.blocks) == 3  # 2012 and 2016 bytes: 3 full blocks, the rest not hashed
    assert one.blocks == two.blocks and one.tokens == 3 * 128
    other = signature(b"e" + doc, block_bytes=512, max_blocks=16, bytes_per_token=4)
    assert not set(other.blocks) & set(one.blocks)  # a different first byte: nothing shared, chained
    longer = signature(doc * 20, block_bytes=512, max_blocks=16, bytes_per_token=4)
    assert len(longer.blocks) == 16  # bounded


def prefix(*blocks: int) -> Prefix:
    return Prefix(blocks, 100.0)


def test_the_account_holds_what_was_released_and_evicts_the_least_recent() -> None:
    cache = EndpointCache()
    cache.scraped(EngineLoad(0, 0, kv_capacity_tokens=1000))
    assert cache.released(prefix(1, 2, 3), 0, ("e", 0)) == 0
    assert cache.expected(prefix(1, 2, 3, 4)) == 300  # its three leading blocks
    assert cache.expected(prefix(1, 9)) == 100
    cache.released(prefix(5, 6), 500, ("e", 1))  # 200 + 500 more tokens: 1,000 held
    assert cache.expected(prefix(1, 2, 3)) == 300
    cache.released(prefix(7), 0, ("e", 2))  # one more block: the oldest goes, its last block first
    assert cache.expected(prefix(1, 2, 3)) == 200


def test_the_engines_counters_correct_the_account() -> None:
    caches = PrefixCaches()
    page = EngineLoad(0, 0, prefix_queries=0, prefix_hits=0)
    caches.scraped("e", page)
    caches.released("e", prefix(1, 2), 0)
    for n in range(1, 30):  # each interval: 200 tokens predicted, the engine finds 50
        caches.released("e", prefix(1, 2), 0)
        caches.scraped("e", EngineLoad(0, 0, prefix_queries=400 * n, prefix_hits=50 * n))
    assert caches.factor("e") == pytest.approx(0.25, abs=0.02)
    assert caches.expected(prefix(1, 2), "e") == pytest.approx(50, abs=5)
    caches.scraped("e", EngineLoad(0, 0, prefix_queries=0, prefix_hits=0))  # restarted: counters went down
    assert caches.expected(prefix(1, 2), "e") == 0
