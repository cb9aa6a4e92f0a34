"""Prefix signatures through a model's dispatcher: the locality order, the cached part of the cost, prefix picking."""

from __future__ import annotations

import asyncio
import itertools
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.core.cost import CostWeights
from extproc.core.dispatcher import Held
from extproc.core.policies.locality import OVERTAKES
from extproc.core.prefix import Prefix, signature
from extproc.core.values.engine_load import EngineLoad
from extproc.core.values.report import Charged
from tests.helpers.locality_dispatch import dispatcher
from tests.propertyutil import examples

pytestmark = pytest.mark.unit

DOC_BYTES = 8_000  # ~2,000 tokens at 4 bytes a token: 15 blocks of 512 bytes


def document(name: str) -> Prefix:
    return signature(name.encode() * DOC_BYTES, block_bytes=512, max_blocks=16, bytes_per_token=4)


async def released_documents(policy: str) -> list[str]:
    """A RAG tenant's questions on two documents, alternating, beside a flood; one in flight at a time."""
    d = dispatcher(policy)
    order: list[tuple[str, Held]] = []
    for i in range(8):
        name = "AB"[i % 2]
        order.append((name, d.submit("rag", 0, content_length=DOC_BYTES + 200, max_tokens=10,
                                     prefix=document(name))))
        order.append(("-", d.submit("flood", 0, content_length=DOC_BYTES + 200, max_tokens=10)))
    sequence: list[str] = []
    while len(sequence) < len(order):
        (name, held), = [(n, h) for n, h in order if h.released and not h.ended]
        sequence.append(name)
        d.end(held)
    return [name for name in sequence if name != "-"]


async def test_locality_releases_a_tenants_questions_on_a_cached_document_together() -> None:
    assert await released_documents("vtc") == list("ABABABAB")  # arrival order
    got = await released_documents("locality")
    assert sorted(got) == sorted("ABABABAB")
    switches = sum(a != b for a, b in zip(got, got[1:], strict=False))
    assert switches <= 2  # grouped: A's questions while A is cached, then B's


async def test_a_release_onto_its_cached_prefix_is_charged_the_cached_price_and_corrected_by_the_engine() -> None:
    charges: list[Charged] = []
    d = dispatcher("vtc", report=lambda event: charges.append(event) if isinstance(event, Charged) else None)
    d.record_scrape("e1", EngineLoad(0, 0, prefix_queries=0, prefix_hits=0), 0.0)
    first = d.submit("rag", 0, content_length=DOC_BYTES + 80, max_tokens=10, prefix=document("A"))
    d.end(first)
    second = d.submit("rag", 0, content_length=DOC_BYTES + 80, max_tokens=10, prefix=document("A"))
    assert first.estimate.cached_tokens == 0 and first.estimate.cost == 2_000 + 2 * 10
    assert second.estimate.cached_tokens == 15 * 128  # 15 full blocks of the 2,000-token prompt
    weights = CostWeights()

    def price(cached: float) -> float:
        return (2_000 - cached) * weights.input_weight + cached * weights.cached_input_weight + 2 * 10

    assert second.estimate.cost == pytest.approx(price(1_920))
    # The engine's counters found a quarter of the hits the account predicted: the end charges that.
    d.record_scrape("e1", EngineLoad(0, 1, prefix_queries=4_000, prefix_hits=480), 0.0)
    d.end(second)
    assert charges[-1].cached_tokens == pytest.approx(480)
    assert charges[-1].cost == pytest.approx(price(480))


async def test_picking_sends_a_prefix_where_it_is_cached_while_load_allows() -> None:
    d = dispatcher("locality", ("e1", "e2"), pick=True)
    first = d.submit("rag", 0, content_length=DOC_BYTES + 80, max_tokens=10, prefix=document("A"))
    d.end(first)
    again = d.submit("rag", 0, content_length=DOC_BYTES + 80, max_tokens=10, prefix=document("A"))
    assert again.endpoint == first.endpoint  # cached there, and it has room
    other = d.submit("rag", 0, content_length=DOC_BYTES + 80, max_tokens=10, prefix=document("A"))
    assert other.endpoint != first.endpoint  # the cached endpoint is full: load wins


pages = st.builds(
    EngineLoad, st.just(0.0), st.just(1.0),
    prefix_queries=st.one_of(st.none(), st.floats(allow_nan=True)),
    prefix_hits=st.one_of(st.none(), st.floats(allow_nan=True)),
    kv_capacity_tokens=st.one_of(st.none(), st.floats(allow_nan=True)),
)
steps = st.lists(st.one_of(
    st.tuples(st.just("submit"), st.sampled_from(["a", "b", "c"]), st.sampled_from(["", "A", "B", "C"])),
    st.tuples(st.just("end"), st.integers(0, 50)),
    st.tuples(st.just("leave"), st.integers(0, 50)),
    st.tuples(st.just("scrape"), st.sampled_from(["e1", "e2"]), pages),
), max_size=80)


@settings(max_examples=examples(150), deadline=None)
@given(script=steps, pick=st.booleans())
def test_with_prefixes_every_request_ends_once_in_a_bounded_order_and_every_charge_is_sane(
    script: list[tuple[Any, ...]], pick: bool,
) -> None:
    async def run() -> None:
        charges: list[Charged] = []
        ticks = itertools.count()
        d = dispatcher("locality", ("e1", "e2"), pick=pick, clock=lambda: float(next(ticks)),
                       report=lambda event: charges.append(event) if isinstance(event, Charged) else None)
        every: list[Held] = []
        for step in script:
            if step[0] == "submit":
                prefix = document(step[2]) if step[2] else Prefix((), 0.0)
                every.append(d.submit(step[1], 0, content_length=DOC_BYTES + 200, max_tokens=10, prefix=prefix))
            elif step[0] == "scrape":
                d.record_scrape(step[1], step[2], 0.0)
            else:
                pool = [h for h in every if not h.ended and h.released == (step[0] == "end")]
                if pool:
                    d.end(pool[step[1] % len(pool)])
        for _ in range(len(every) + 1):
            for held in [h for h in every if h.released and not h.ended]:
                d.end(held)
        assert d.queued == 0 and d.in_flight == 0
        assert all(h.ended and h.future.done() and h.future.exception() is None for h in every)
        for charge in charges:
            assert math.isfinite(charge.cost) and charge.cost > 0
            assert 0 <= charge.cached_tokens <= charge.prompt_tokens - 1
        # Released in an order where none was overtaken by more than OVERTAKES later requests of its tenant.
        for tenant in "abc":
            mine = [h for h in every if h.request.tenant == tenant and h.released]
            for i, held in enumerate(mine):
                assert sum(later.released_at < held.released_at for later in mine[i + 1:]) <= OVERTAKES

    asyncio.run(run())
