"""Cost poisoning: whatever a client or an engine page says, costs and policy counters stay finite and bounded.

Two requests with ``"max_tokens": 1e308`` once made the ``vtc`` floor
infinite for good: every later tenant tied at inf with the flooder and lost
the tie-break, so a newcomer waited behind the whole flood. The properties
here feed hostile values to every registered policy through the same path the
dispatcher takes (estimate, charge, measure, correct) and check the counters
and the newcomer's fair bound; the examples pin down what the client hears.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from typing import Any, NamedTuple

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.adapters.config import ConfigError, parse_config
from extproc.adapters.telemetry import Telemetry
from extproc.core.cost import DEFAULT_CONTEXT_TOKENS, CostModel, CostWeights, DecodeRate, Estimate
from extproc.core.dispatcher import Held
from extproc.core.policies import POLICIES, BandPolicy, Policy
from extproc.core.policies.vtc import MAX_SERVICE, VirtualTokenCounter
from extproc.core.values.engine_load import EngineLimits
from tests.helpers.locality_dispatch import dispatcher
from tests.helpers.processor import Stream, headers_message, make_processor
from tests.propertyutil import examples

pytestmark = pytest.mark.unit

# What a hostile client, a broken engine page or a buggy caller can hand the core.
NASTY = st.sampled_from([math.nan, math.inf, -math.inf, 1e308, 1e20, -5.0, 0.0, 0.5, -1e308, 5e-324])
HOSTILE_FLOATS = st.one_of(NASTY, st.floats(allow_nan=True, allow_infinity=True),
                           st.integers(-(10**30), 10**30).map(float))
HOSTILE_LENGTHS = st.one_of(st.none(), st.integers(-(10**25), 10**25), st.sampled_from([0, 18446744073709551615]))


# Deadlines, for ``policy: deadline``: the hostile tenant's requests are the most urgent.
URGENT, LAX = 0.0, 1.0


class Queued(NamedTuple):
    """A queued request as a band sees it (``deadline``: read by ``policy: deadline``; its hit by ``locality``)."""

    tenant: str
    number: int
    deadline: float = LAX

    def cached_tokens(self) -> float:
        """Read by ``policy: locality``: a hostile (urgent) request claims an infinite or a NaN hit."""
        return (math.inf if self.number % 2 else math.nan) if self.deadline == URGENT else 0.0


def finite_counters(band: BandPolicy[Any], tenants: Iterable[str]) -> bool:
    """Every counter the band keeps (and its floor: an unknown tenant's) is finite; True for counterless policies."""
    counter = getattr(band, "counter", None)
    return counter is None or all(math.isfinite(counter(t)) for t in [*tenants, "never-seen"])


def test_poisoned_max_tokens_no_longer_make_the_floor_infinite() -> None:
    """The issue's case under vtc: a flood of 1e308 requests, then two newcomers."""
    model, band = CostModel(CostWeights()), VirtualTokenCounter[int](lambda tenant: 1.0)

    def release() -> str:
        tenant, _ = band.pop()
        estimate = model.estimate(tenant, 200, 1e308 if tenant == "flood" else 50)
        band.charge(tenant, estimate.cost)
        band.correct(tenant, model.measure(tenant, estimate, math.inf, math.nan).cost - estimate.cost)
        return tenant

    for i in range(10):
        band.push("flood", i)
    assert [release(), release()] == ["flood", "flood"]
    band.push("honest", 100)
    band.push("newcomer", 101)
    assert finite_counters(band, ["flood", "honest", "newcomer"])
    # The newcomers join at the flood's counter and lose the tie once; the
    # flood's next (finite) charge then puts them ahead. At inf they tied forever.
    assert [release() for _ in range(3)] == ["flood", "honest", "newcomer"]
    assert band.counter("flood") <= 3 * 3 * DEFAULT_CONTEXT_TOKENS


@pytest.mark.parametrize("max_tokens", [1e308, 1e20, math.inf, math.nan, -5.0, 0.0])
@pytest.mark.parametrize("content_length", [None, 0, -1, 10**20])
def test_an_estimate_is_clamped_to_the_models_context(max_tokens: float, content_length: int | None) -> None:
    weights = CostWeights(input_weight=1, output_weight=2, max_context_tokens=1000)
    estimate = CostModel(weights).estimate("t", content_length, max_tokens)
    assert 1 <= estimate.prompt_tokens <= 1000 and 1 <= estimate.output_tokens <= 1000
    assert 3 <= estimate.cost <= 3000
    assert estimate.clamped == (content_length == 10**20 or not max_tokens <= 1000)
    # A whole number beyond the context is that context (the engine refuses it; we only must not overflow).
    assert CostModel(weights).estimate("t", 10**20, 1e308).cost == 3000
    assert not CostModel(weights).estimate("t", 4080, 1000).clamped


@pytest.mark.parametrize(("occupancy", "rate"), [(math.inf, 50.0), (math.nan, 50.0), (1.0, math.inf), (1.0, math.nan),
                                                 (1e300, 1e300), (-5.0, 50.0)])
def test_a_measurement_from_garbage_is_bounded(occupancy: float, rate: float) -> None:
    model = CostModel(CostWeights(output_weight=1, input_weight=0, max_context_tokens=1000))
    estimate = model.estimate("t", None, None)  # no max_tokens: only the context caps the measurement
    measured = model.measure("t", estimate, occupancy, rate)
    assert 1 <= measured.cost <= 1000 and 1 <= measured.output_tokens <= 1000
    assert math.isfinite(model.estimate("t", None, None).output_tokens)  # the tenant's average too


def test_the_decode_rate_learns_only_from_finite_samples() -> None:
    rate = DecodeRate()
    rate.record("e", generated=0, running=4, at=0.0)
    rate.record("e", generated=400, running=4, at=1.0)
    assert rate.rate == 100
    garbage = [(math.nan, 4.0), (math.inf, 4.0), (800.0, math.nan), (1e308, 4.0), (-1e308, 4.0), (1200.0, math.inf)]
    for at, (generated, running) in enumerate(garbage, start=2):
        rate.record("e", generated=generated, running=running, at=float(at))
    assert rate.rate is not None and math.isfinite(rate.rate)
    rate.record("f", generated=0, running=1, at=0.0)
    rate.record("f", generated=1e308, running=1, at=1e-300)  # a finite jump whose rate is inf
    assert rate.rate is not None and math.isfinite(rate.rate)


async def test_unset_the_context_is_the_engines_largest_and_until_it_says_the_default() -> None:
    d = dispatcher("vtc", ("e1", "e2"))
    assert d.submit("t", 0, content_length=None, max_tokens=1e9).estimate.max_tokens == DEFAULT_CONTEXT_TOKENS
    d.record_limits("e1", EngineLimits(max_model_len=512))
    d.record_limits("e2", EngineLimits(max_model_len=2048))
    d.record_limits("e1", EngineLimits())  # an endpoint that says nothing changes nothing
    assert d.submit("t", 0, content_length=None, max_tokens=1e9).estimate.max_tokens == 2048
    model = CostModel(CostWeights(max_context_tokens=1000))
    model.engine_context = 2048
    assert model.context == 1000  # a configured context is kept whatever the engine says


def test_context_length_is_validated_and_infinite_numbers_are_refused() -> None:
    model = {"name": "m", "endpoints": ["http://127.0.0.1:1"]}
    assert parse_config({"models": [model]}).models[0].cost_weights().max_context_tokens is None  # the engine's
    assert parse_config({"models": [{**model, "max_context_tokens": 8192}]}).models[0].cost_weights() \
        .max_context_tokens == 8192
    with pytest.raises(ConfigError) as raised:
        parse_config({"models": [{**model, "max_context_tokens": 0, "cost": {"output_weight": math.inf}}],
                      "tenants": {"x": {"weight": math.inf}}})
    assert raised.value.errors == (
        "models[0].max_context_tokens: must be an integer >= 1, got 0",
        "models[0].cost.output_weight: must be a number >= 0, got inf",
        "tenants.x.weight: must be a number > 0, got inf",
    )


# --- what the client hears ------------------------------------------------------------------


def with_limits(**fields: Any) -> pb.ProcessingRequest:
    message = headers_message()
    for name, value in fields.items():
        message.metadata_context.filter_metadata["extproc"].fields[name].CopyFrom(struct_pb2.Value(**value))
    return message


@pytest.mark.parametrize(
    ("fields", "param", "shown"),
    [
        ({"max_tokens": {"number_value": -5}}, "max_tokens", "-5"),
        ({"max_tokens": {"number_value": 0}}, "max_tokens", "0"),
        ({"max_tokens": {"number_value": 12.5}}, "max_tokens", "12.5"),
        ({"max_tokens": {"string_value": "nan"}}, "max_tokens", '"nan"'),
        ({"max_tokens": {"string_value": "12"}}, "max_tokens", '"12"'),
        ({"max_tokens": {"bool_value": True}}, "max_tokens", "true"),
        ({"max_tokens": {"number_value": math.nan}}, "max_tokens", "nan"),
        ({"max_tokens": {"number_value": 8}, "max_completion_tokens": {"string_value": "x"}},
         "max_completion_tokens", '"x"'),
        ({"max_tokens": {"number_value": -1}, "max_completion_tokens": {"number_value": 8}}, "max_tokens", "-1"),
    ],
)
async def test_an_invalid_output_limit_is_a_400_naming_the_field(fields: dict[str, Any], param: str, shown: str) -> None:
    telemetry = Telemetry()
    processor, dispatcher = make_processor(telemetry)
    answer = await Stream(processor, with_limits(**fields)).answers.get()
    reply = answer.immediate_response
    assert reply.status.code == 400
    error = json.loads(reply.body)["error"]
    assert error == {"message": f"{param} must be an integer >= 1, got {shown}", "type": "invalid_request_error",
                     "param": param, "code": "invalid_max_tokens"}
    assert any(h.header.key == "x-extproc-reason" and h.header.raw_value == b"invalid_max_tokens"
               for h in reply.headers.set_headers)
    assert dispatcher.queued == 0 and dispatcher.in_flight == 0
    rejected = [s for m in telemetry.registry.collect() for s in m.samples
                if m.name == "extproc_rejected" and s.name.endswith("_total")]
    assert [(s.labels["model"], s.labels["reason"], s.value) for s in rejected] == [("m", "invalid_max_tokens", 1.0)]


async def test_a_huge_whole_limit_is_released_and_charged_at_most_the_context() -> None:
    processor, dispatcher = make_processor()
    submitted: list[Held] = []
    submit = dispatcher.submit

    def spy(*args: Any, **kwargs: Any) -> Held:
        submitted.append(submit(*args, **kwargs))
        return submitted[-1]

    dispatcher.submit = spy  # type: ignore[method-assign]
    stream = Stream(processor, with_limits(max_tokens={"number_value": 1e308}, max_completion_tokens={"number_value": 1e20}))
    answer = await stream.answers.get()
    assert answer.HasField("request_headers")  # released, not refused: the engine judges the size
    [held] = submitted
    context = DEFAULT_CONTEXT_TOKENS
    assert held.estimate.max_tokens == context
    # No Content-Length, no average yet: the least prompt, one token.
    assert held.estimate.cost == CostWeights.input_weight * 1 + CostWeights.output_weight * context
    stream.close()
    await stream.task


# --- properties: every policy, hostile inputs -------------------------------------------------


def run_cost_path(
    policy: Policy, weights: dict[str, float], model: CostModel, rate: DecodeRate, steps: list[dict[str, Any]],
    newcomer_at: int, in_flight: int,
) -> tuple[BandPolicy[Any], dict[str, float], float]:
    """The dispatcher's cost path on one band: release (estimate, charge), scrape, finish (measure, correct).

    Tenant "h" sends hostile values, "a" honest ones; both stay backlogged.
    "n" joins once at ``newcomer_at``. Returns the band, the service each
    other tenant gained (charges plus corrections) between the newcomer's
    arrival and its release, and the bound on that: U + 2·K·E, with U the most
    service one estimate charged, E the largest correction and K the most in
    flight. (Under vtc the newcomer starts at the smallest backlogged counter,
    or the floor, which corrections since the last pick may have left up to
    K·E above it; another tenant is picked only while its counter is not above
    the newcomer's, so it gains at most that, one more charge U, and the
    corrections still to come, K·E.) A policy with a window adds it:
    ``window_requests`` more charges U, which "h", always the most urgent, may
    take.
    """
    band = policy.new_band(lambda tenant: weights[tenant], Queued.cached_tokens)
    context = float(model.context)
    for i in range(3):
        band.push("h", Queued("h", i, URGENT))
        band.push("a", Queued("a", i))
    pending: list[tuple[str, Estimate, float]] = []
    gained = {"h": 0.0, "a": 0.0}
    unit = error = 0.0
    waiting = False
    for index, step in enumerate(steps):
        if index == newcomer_at:
            band.push("n", Queued("n", 0))
            waiting = True
        while len(pending) >= in_flight or (pending and step["finish"]):
            tenant, estimate, occupancy = pending.pop(0)
            rate.record("e", step["generated"], step["running"], step["at"])
            measured = model.measure(tenant, estimate, occupancy, rate.rate).cost
            assert math.isfinite(measured) and 0 < measured <= model.price(context, context)
            band.correct(tenant, measured - estimate.cost)
            correction = policy.service(measured, weights[tenant]) - policy.service(estimate.cost, weights[tenant])
            error = max(error, abs(correction))
            if waiting:
                gained[tenant] += correction
        tenant, item = band.pop()
        if item == Queued("n", 0):
            return band, gained, unit * (1 + policy.window_requests) + 2 * in_flight * error
        hostile = tenant == "h"
        estimate = model.estimate(tenant, step["length"] if hostile else 480,
                                  step["max_tokens"] if hostile else 100.0)
        assert math.isfinite(estimate.cost) and 0 < estimate.cost <= model.price(context, context)
        service = policy.service(estimate.cost, weights[tenant])
        unit = max(unit, service)
        band.charge(tenant, estimate.cost)
        if waiting:
            gained[tenant] += service
        pending.append((tenant, estimate, step["occupancy"]))
        band.push(tenant, Queued(tenant, index + 3, URGENT if hostile else LAX))
        assert finite_counters(band, "ha")
        assert rate.rate is None or math.isfinite(rate.rate)
    return band, gained, math.inf  # the newcomer was never released within the run


STEP = st.fixed_dictionaries({
    "max_tokens": st.one_of(st.none(), HOSTILE_FLOATS),
    "length": HOSTILE_LENGTHS,
    "occupancy": HOSTILE_FLOATS,
    "generated": st.one_of(st.none(), HOSTILE_FLOATS),
    "running": HOSTILE_FLOATS,
    "at": HOSTILE_FLOATS,
    "finish": st.booleans(),
})


@pytest.mark.parametrize("name", sorted(POLICIES))
@settings(max_examples=examples(100), deadline=None)
@given(
    steps=st.lists(STEP, min_size=40, max_size=40),
    newcomer_at=st.integers(0, 12),
    in_flight=st.integers(1, 4),
    weights=st.fixed_dictionaries({t: st.floats(0.25, 4) for t in "han"}),
    context=st.integers(1, 1_000_000),
)
def test_hostile_inputs_keep_counters_finite_and_a_newcomer_within_its_bound(
    name: str, steps: list[dict[str, Any]], newcomer_at: int, in_flight: int, weights: dict[str, float], context: int,
) -> None:
    policy = POLICIES[name]
    model = CostModel(CostWeights(max_context_tokens=context))
    band, gained, bound = run_cost_path(policy, weights, model, DecodeRate(), steps, newcomer_at, in_flight)
    assert finite_counters(band, "han")
    assert math.isfinite(bound), "the newcomer was not released within 28 releases after it joined"
    # No tenant ahead of the newcomer gained more than U + 2·K·E of service while it waited.
    for tenant, service in gained.items():
        assert service <= bound * (1 + 1e-9) + 1e-9, (tenant, service, bound)


@pytest.mark.parametrize("name", sorted(POLICIES))
@settings(max_examples=examples(100), deadline=None)
@given(charges=st.lists(st.tuples(st.sampled_from("ab"), HOSTILE_FLOATS, HOSTILE_FLOATS), max_size=40),
       weight=st.sampled_from([5e-324, 1e-300, 0.25, 1.0, 1e300]))
def test_a_caller_passing_garbage_cannot_make_a_counter_infinite(
    name: str, charges: list[tuple[str, float, float]], weight: float,
) -> None:
    """Defence in depth: the policy itself clamps what a buggy caller charges or corrects."""
    band = POLICIES[name].new_band(lambda tenant: weight, Queued.cached_tokens)
    band.push("a", Queued("a", 0))
    band.push("b", Queued("b", 1))
    for tenant, cost, delta in charges:
        band.charge(tenant, cost)
        band.correct(tenant, delta)
        assert finite_counters(band, "ab")
    counter = getattr(band, "counter", None)
    if counter is not None:
        assert all(abs(counter(t)) <= 2 * len(charges) * MAX_SERVICE for t in "ab")
    band.push("late", Queued("late", 2))
    assert finite_counters(band, "ab")
    assert sorted(band.pop()[0] for _ in range(3)) == ["a", "b", "late"]
