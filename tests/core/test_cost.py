"""Pure helpers of the policies: cost estimates and measurements, Retry-After, the priority body rewrite."""

from __future__ import annotations

import json
from typing import Any

import pytest

from extproc.adapters.ext_proc.attach.priority_body import with_priority
from extproc.adapters.protocol.answers import ANSWERS, MAX_RETRY_AFTER_S, retry_after_s
from extproc.core.cost import Charge, CostModel, CostWeights, DecodeRate
from extproc.core.drain_time import RATE_WINDOW_S, ReleaseRate
from extproc.core.values.outcomes import Refusal

pytestmark = pytest.mark.unit


def test_estimate_from_content_length_and_max_tokens() -> None:
    model = CostModel(CostWeights(input_weight=1, output_weight=2, bytes_per_token=4, body_overhead_bytes=80))
    estimate = model.estimate("t", content_length=4080, max_tokens=100)
    assert (estimate.prompt_tokens, estimate.output_tokens, estimate.cost) == (1000, 100, 1200)
    # No max_tokens: the default, until the tenant's own answers were measured.
    assert model.estimate("t", 80, None).output_tokens == CostWeights.default_output_tokens
    # No Content-Length (chunked upload): the tenant's average prompt so far
    # (a body that is all structure still counts one prompt token).
    assert model.estimate("t", None, 1).prompt_tokens == pytest.approx(1000 * 0.8 + 1 * 0.2)


def test_measure_charges_what_the_occupancy_allowed_capped_by_max_tokens() -> None:
    model = CostModel(CostWeights(input_weight=1, output_weight=1, body_overhead_bytes=0))
    estimate = model.estimate("t", content_length=400, max_tokens=500)  # 100 prompt + 500 output
    # 2 s at 50 tokens/s per sequence: at most 100 tokens came out (it stopped early).
    assert model.measure("t", estimate, occupancy_s=2.0, decode_rate=50.0) == Charge(100, 200)
    # 60 s would allow 3000: capped by max_tokens.
    assert model.measure("t", estimate, occupancy_s=60.0, decode_rate=50.0) == Charge(500, 600)
    # No decode rate known: the estimate stands.
    assert model.measure("t", estimate, occupancy_s=2.0, decode_rate=None) == Charge(500, estimate.cost)


def test_output_average_learns_from_measurements() -> None:
    model = CostModel(CostWeights(default_output_tokens=1000))
    for _ in range(40):
        estimate = model.estimate("t", None, None)
        model.measure("t", estimate, occupancy_s=1.0, decode_rate=20.0)
    assert model.estimate("t", None, None).output_tokens == pytest.approx(20, rel=0.01)
    assert model.estimate("other", None, None).output_tokens == 1000


def test_decode_rate_is_tokens_per_running_sequence() -> None:
    rate = DecodeRate()
    rate.record("e1", generated=0, running=4, at=0.0)
    assert rate.rate is None
    rate.record("e1", generated=400, running=4, at=1.0)  # 400 tokens/s over 4 sequences
    assert rate.rate == 100
    rate.record("e1", generated=10, running=4, at=2.0)  # counter reset: engine restarted, no sample
    rate.record("e1", generated=None, running=4, at=3.0)  # engine without the counter
    assert rate.rate == 100
    rate.record("e2", generated=0, running=0, at=0.0)
    rate.record("e2", generated=0, running=0, at=1.0)  # nothing running says nothing
    assert rate.rate == 100


def test_retry_after_is_the_drain_time_within_bounds() -> None:
    rate = ReleaseRate()

    def retry_after(backlog: int, now: float) -> int | None:
        return retry_after_s(Refusal.MODEL_QUEUE_FULL, rate.drain_s(backlog, now))

    assert retry_after(5, now=0.0) == MAX_RETRY_AFTER_S  # nothing released lately
    for i in range(20):
        rate.record(i * 0.5)  # 2 per second
    assert retry_after(10, now=9.9) == 5
    assert retry_after(0, now=9.9) == 1
    assert retry_after(10_000, now=9.9) == MAX_RETRY_AFTER_S
    assert rate.per_second(now=10.0 + RATE_WINDOW_S) == 0
    assert retry_after_s(Refusal.SHUTTING_DOWN) == 1
    assert retry_after_s(Refusal.MODEL_NOT_FOUND) is None


@pytest.mark.parametrize(
    "body",
    [
        {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
        {"model": "m", "priority": -100},
        {"model": "m", "messages": [{"role": "user", "content": 'my "priority" is high'}]},
        {},
    ],
)
def test_priority_is_written_over_whatever_the_client_sent(body: dict[str, Any]) -> None:
    for raw in (json.dumps(body).encode(), b"  \n" + json.dumps(body, indent=2).encode()):
        rewritten = with_priority(raw, 2)
        assert rewritten is not None
        assert json.loads(rewritten) == {**body, "priority": 2}


def test_a_body_that_is_not_an_object_is_left_alone() -> None:
    assert with_priority(b'["priority"]', 1) is None
    assert with_priority(b"not json", 1) is None
    assert with_priority(b'{"priority": broken', 1) is None


def test_every_reason_has_one_answer() -> None:
    assert set(ANSWERS) == set(Refusal)
    assert all(400 <= answer.status < 600 for answer in ANSWERS.values())
