"""The processor's own metrics: what an operator reads, with a tenant label that stays bounded.

Unit tests drive real dispatchers (built from a config, as the server builds
them) and read the real Prometheus registry; the integration test sends real
requests through Envoy and reads the processor's /metrics page.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path

import aiohttp
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from extproc.adapters.config import Config, load_config, parse_config
from extproc.adapters.runtime import Dispatchers, build_runtimes
from extproc.adapters.telemetry import Telemetry
from extproc.adapters.telemetry.model import DEMAND_READ_S
from extproc.adapters.telemetry.objectives import (
    MET,
    MISSED,
    PREEMPTED,
    WINDOW_S,
    BandObjectives,
    Counts,
    Objectives,
    Recent,
    TenantRecent,
)
from extproc.adapters.wiring import tenant_labels
from extproc.core.dispatcher import ModelDispatcher
from extproc.core.values.engine_load import EngineLoad
from extproc.core.values.outcomes import Refusal, Refused
from extproc.core.values.report import RequestEvent, Step
from extproc.tools.power_user import chat
from extproc.tools.stack import start_stack
from tests.paths import ROOT
from tests.stackutil import TENANT_KEYS, metric, read_metrics, write_stack_config

ENDPOINT = "http://127.0.0.1:1"
CONFIG_MODELS = [{"name": "m", "endpoints": [ENDPOINT], "advanced": {"fallback_max_in_flight": 1}, "max_queue_wait_s": 60}]
CONFIG = parse_config({"models": CONFIG_MODELS, "tenants": {"alice": {"max_queued": 1}, "bob": {}}})
LABELLED = {"alice", "bob", "anonymous", "other"}  # the config's tenants, its default tenant, everyone else


def samples(registry: CollectorRegistry, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {tuple(sorted(s.labels.items())): s.value for m in registry.collect() for s in m.samples if s.name == name}


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return sum(v for key, v in samples(registry, name).items() if labels.items() <= dict(key).items())


def build(config: Config = CONFIG) -> tuple[Telemetry, Mapping[str, ModelDispatcher]]:
    telemetry = Telemetry()
    return telemetry, Dispatchers(build_runtimes(config, telemetry))


@pytest.mark.unit
def test_counters_exist_at_zero_for_every_known_label_value_before_any_request() -> None:
    telemetry, _ = build()
    r = telemetry.registry
    released = samples(r, "extproc_released_total")
    # models x classes x (named tenants + default tenant + other): 1 x 3 x 4.
    assert len(released) == 12 and set(released.values()) == {0}
    assert {dict(k)["tenant"] for k in released} == LABELLED
    for name in ("extproc_abandoned_total", "extproc_queue_depth"):
        assert len(samples(r, name)) == 12 and set(samples(r, name).values()) == {0}
    for name in ("extproc_charged_prompt_tokens_total", "extproc_charged_output_tokens_total",
                 "extproc_charged_cost_total"):
        assert {dict(k)["tenant"] for k in samples(r, name)} == LABELLED
    # Refusals the queue decides, per tenant; those decided before the tenant is known, as "(none)".
    assert r.get_sample_value("extproc_rejected_total", {"model": "m", "reason": "queue_timeout", "tenant": "alice"}) == 0
    assert r.get_sample_value("extproc_rejected_total",
                              {"model": "(unknown)", "reason": "model_not_found", "tenant": "(none)"}) == 0
    assert r.get_sample_value("extproc_decision_latency_seconds_count", {"model": "m"}) == 0
    assert r.get_sample_value("extproc_gate_fallback", {"model": "m"}) == 0


@pytest.mark.unit
def test_build_info_and_process_metrics_are_on_the_processors_registry() -> None:
    r = Telemetry().registry
    [(labels, one)] = samples(r, "extproc_build_info").items()
    assert one == 1 and dict(labels)["version"] not in ("", "unknown") and dict(labels)["python"].count(".") == 2
    assert (r.get_sample_value("process_resident_memory_bytes") or 0) > 0
    assert (r.get_sample_value("process_start_time_seconds") or 0) > 0
    assert samples(r, "python_info")


@pytest.mark.unit
async def test_per_tenant_series_never_take_a_client_tenant_id_and_depth_counts_exactly() -> None:
    telemetry, dispatchers = build()
    dispatcher = dispatchers["m"]
    r = telemetry.registry
    first = dispatcher.submit("alice", 1, content_length=480, max_tokens=50)
    assert first.future.done()  # released: the fallback limit is 1
    held = [dispatcher.submit(tenant, 1) for tenant in ("alice", "mallory-1", "mallory-2", "bob")]
    with pytest.raises(Refused):
        dispatcher.submit("alice", 1)  # alice's own cap (1 queued)
    assert value(r, "extproc_queue_depth", tenant="alice") == 1
    assert value(r, "extproc_queue_depth", tenant="other") == 2
    assert value(r, "extproc_queue_depth", tenant="bob") == 1
    assert value(r, "extproc_rejected_total", reason="tenant_queue_full", tenant="alice") == 1
    # Every arrival was timed, refused or not.
    assert r.get_sample_value("extproc_decision_latency_seconds_count", {"model": "m"}) == 6

    dispatcher.end(held[1])  # mallory-1 leaves
    dispatcher.end(first)  # frees the slot: alice's next goes
    assert value(r, "extproc_abandoned_total", tenant="other") == 1
    assert value(r, "extproc_released_total", tenant="alice") == 2
    dispatcher.reject_all()
    assert value(r, "extproc_rejected_total", reason="shutting_down", tenant="other") == 1
    assert value(r, "extproc_rejected_total", reason="shutting_down", tenant="bob") == 1
    # Up and down exactly: every queued request left once.
    assert set(samples(r, "extproc_queue_depth").values()) == {0}
    tenants = {dict(k)["tenant"] for m in r.collect() for s in m.samples for k in [tuple(s.labels.items())]
               if "tenant" in s.labels}
    assert tenants <= LABELLED | {"(none)"}, tenants


@pytest.mark.unit
async def test_a_finished_request_charges_its_tokens_and_vtc_cost_to_its_tenant() -> None:
    telemetry, dispatchers = build()
    dispatcher = dispatchers["m"]
    r = telemetry.registry
    held = dispatcher.submit("stranger", 0, content_length=480, max_tokens=50)
    assert r.get_sample_value("extproc_charged_cost_total", {"model": "m", "tenant": "other"}) == 0  # not yet: running
    dispatcher.end(held)
    # No decode rate known (no scrape): the estimate stands. (480 - 80) / 4 = 100 prompt, 50 output,
    # 1 x 100 + 2 x 50 = 200 units.
    assert r.get_sample_value("extproc_charged_prompt_tokens_total", {"model": "m", "tenant": "other"}) == 100
    assert r.get_sample_value("extproc_charged_output_tokens_total", {"model": "m", "tenant": "other"}) == 50
    assert r.get_sample_value("extproc_charged_cost_total", {"model": "m", "tenant": "other"}) == 200


# The compose demo's shape: tenants named only by their API keys, no tenants: section.
KEYS_ONLY = parse_config({"models": CONFIG_MODELS, "envoy": {"api_keys": {"key-alice": "alice", "key-bob": "bob"}}})


@pytest.mark.unit
def test_an_api_keys_tenant_is_known_by_name_and_the_label_set_stays_the_configs() -> None:
    labels = tenant_labels(KEYS_ONLY)
    assert set(labels.values) == LABELLED
    assert (labels("alice"), labels("bob"), labels("mallory"), labels("anonymous")) == ("alice", "bob", "other", "anonymous")
    # Named in both places: one value, not two.
    both = parse_config({"models": CONFIG_MODELS, "tenants": {"alice": {}}, "envoy": {"api_keys": {"k": "alice"}}})
    assert tenant_labels(both).values == ("alice", "anonymous", "other")
    # The compose demo's own config: its four tenants have keys and no tenants: entries.
    demo = load_config(ROOT / "extproc" / "data" / "compose.yaml")
    assert tenant_labels(demo).values == ("alice", "anonymous", "bob", "carol", "dave", "other")


@pytest.mark.unit
async def test_an_api_keys_tenant_is_on_the_metrics_page_by_name() -> None:
    telemetry, dispatchers = build(KEYS_ONLY)
    for tenant in ("alice", "mallory"):
        dispatchers["m"].end(dispatchers["m"].submit(tenant, 1))
    page = {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(generate_latest(telemetry.registry).decode())
            for s in family.samples}
    assert metric(page, "extproc_released_total", model="m", tenant="alice") == 1
    assert metric(page, "extproc_released_total", model="m", tenant="bob") == 0  # there at 0 from the start
    assert metric(page, "extproc_released_total", model="m", tenant="other") == 1  # mallory has no key
    assert {dict(labels).get("tenant") for (_, labels) in page} <= LABELLED | {"(none)", None}


@pytest.mark.unit
async def test_a_good_scrape_stamps_its_time_and_kv_usage_is_a_ratio() -> None:
    telemetry, dispatchers = build()
    r = telemetry.registry
    before = time.time()
    dispatchers["m"].record_scrape(ENDPOINT, EngineLoad(2, 3, kv_usage=0.25), time.monotonic())
    stamped = r.get_sample_value("extproc_endpoint_last_scrape_timestamp_seconds", {"model": "m", "endpoint": ENDPOINT})
    assert stamped is not None and before <= stamped <= time.time()
    assert r.get_sample_value("extproc_engine_kv_usage_ratio", {"model": "m", "endpoint": ENDPOINT}) == 0.25
    assert r.get_sample_value("extproc_scrape_errors_total", {"model": "m", "endpoint": ENDPOINT}) == 0
    assert r.get_sample_value("extproc_endpoint_degraded", {"model": "m", "endpoint": ENDPOINT}) == 0
    dispatchers["m"].record_scrape(ENDPOINT, None, time.monotonic())  # a failed one does not
    assert r.get_sample_value(
        "extproc_endpoint_last_scrape_timestamp_seconds", {"model": "m", "endpoint": ENDPOINT}
    ) == stamped
    dispatchers["m"].set_endpoints(())  # it left: its time goes with it
    assert r.get_sample_value("extproc_endpoint_last_scrape_timestamp_seconds", {"model": "m", "endpoint": ENDPOINT}) is None


@pytest.mark.integration
async def test_an_operator_sees_every_tenant_the_config_names_by_name(tmp_path: Path) -> None:
    """Through real Envoy: alice and bob are under tenants:, carol and dave only have API keys (the demo's shape).

    A tenant with no key cannot pass api_key_auth, so ``other`` stays at 0 here (the unit tests send it).
    """
    config = write_stack_config(tmp_path, {"m1": {}}, tenants={"alice": {}, "bob": {}})
    sent = {"alice": 3, "bob": 2, "carol": 1, "dave": 1}
    started = time.time()
    async with await start_stack(config, tmp_path) as stack, aiohttp.ClientSession() as session:
        outcomes = await asyncio.gather(*(
            chat(session, stack.envoy_url, tenant, "m1", api_key=TENANT_KEYS[tenant], max_tokens=8)
            for tenant, n in sent.items() for _ in range(n)
        ))
        assert all(o.status == 200 for o in outcomes), [o.error for o in outcomes if o.status != 200]
        async with session.post(f"{stack.envoy_url}/v1/chat/completions", headers={"authorization": "Bearer key-carol"},
                                json={"model": "nope", "messages": []}) as response:
            assert response.status == 404
        page = await read_metrics(stack.metrics_url)
    named = LABELLED | {"carol", "dave"}
    released = {t: metric(page, "extproc_released_total", model="m1", tenant=t) for t in named}
    assert released == {"alice": 3, "bob": 2, "carol": 1, "dave": 1, "other": 0, "anonymous": 0}
    assert {dict(labels).get("tenant") for (_, labels) in page} <= named | {"(none)", None}
    assert metric(page, "extproc_queue_wait_seconds_count", tenant="carol") == 1
    assert metric(page, "extproc_rejected_total", model="(unknown)", reason="model_not_found", tenant="(none)") == 1
    assert ("extproc_rejected_total", (("model", "m1"), ("reason", "queue_timeout"), ("tenant", "alice"))) in page
    # Charged per tenant: prompt tokens from Content-Length, at most max_tokens of output each, priced 1 and 2.
    prompt = metric(page, "extproc_charged_prompt_tokens_total", tenant="alice")
    output = metric(page, "extproc_charged_output_tokens_total", tenant="alice")
    assert prompt >= 3 and 3 <= output <= 3 * 8
    assert metric(page, "extproc_charged_cost_total", tenant="alice") == pytest.approx(prompt + 2 * output)
    assert metric(page, "extproc_decision_latency_seconds_count", model="m1") == sum(sent.values())
    scraped = metric(page, "extproc_endpoint_last_scrape_timestamp_seconds", model="m1")
    assert started <= scraped <= time.time()
    assert metric(page, "extproc_build_info") == 1 and metric(page, "process_cpu_seconds_total") > 0


# TTFT objectives: events fed straight into the model's telemetry, as the core reports them.
BANDS = ("interactive", "standard", "batch")


def feed(telemetry: Telemetry, *events: RequestEvent, model: str = "m") -> None:
    """Each event as the core reports it; a request that leaves the queue was queued first."""
    report = telemetry.models[model]
    for event in events:
        if event.step is not Step.PREEMPTED and event.dequeued:
            report(RequestEvent(Step.QUEUED, event.band, event.tenant))
        report(event)


@pytest.mark.unit
def test_objective_and_preemption_series_exist_at_zero_with_bounded_labels() -> None:
    telemetry, _ = build()
    r = telemetry.registry
    verdicts = samples(r, "extproc_objective_requests_total")
    # classes x (named tenants + default + other) x (met, missed): 3 x 4 x 2.
    assert len(verdicts) == 24 and set(verdicts.values()) == {0}
    assert {dict(k)["outcome"] for k in verdicts} == {"met", "missed"}
    assert {dict(k)["tenant"] for k in verdicts} == LABELLED
    preemptions = samples(r, "extproc_preemptions_total")
    assert len(preemptions) == 12 and set(preemptions.values()) == {0}
    for name in ("extproc_release_slack_seconds_count", "extproc_release_lateness_seconds_count",
                 "extproc_preempted_occupancy_seconds_total"):
        assert {dict(k)["priority"] for k in samples(r, name)} == set(BANDS), name
        assert set(samples(r, name).values()) == {0}, name


@pytest.mark.unit
def test_met_missed_or_neither_is_decided_by_the_slack_when_a_request_leaves_the_queue() -> None:
    telemetry, _ = build()
    r = telemetry.registry
    feed(
        telemetry,
        RequestEvent(Step.RELEASED, "interactive", "alice", waited_s=0.5, slack_s=4.5),  # met
        RequestEvent(Step.RELEASED, "interactive", "alice", waited_s=0.2, slack_s=0.0),  # met, with no time to spare
        RequestEvent(Step.RELEASED, "interactive", "mallory", waited_s=6, slack_s=-1.0),  # missed: released late
        RequestEvent(Step.REFUSED, "standard", "bob", waited_s=70, refusal=Refusal.QUEUE_TIMEOUT, slack_s=-10.0),  # missed
        RequestEvent(Step.ABANDONED, "interactive", "bob", waited_s=7, slack_s=-2.0),  # missed: it left after its deadline
        RequestEvent(Step.ABANDONED, "interactive", "bob", waited_s=1, slack_s=4.0),  # neither: it left in time
        RequestEvent(Step.REFUSED, "standard", "bob", waited_s=3, refusal=Refusal.SHUTTING_DOWN, slack_s=57.0),  # neither
        RequestEvent(Step.RELEASED, "batch", "alice", waited_s=1),  # neither: no objective
    )
    # A refusal at the door: it never entered the queue, and has no slack.
    telemetry.models["m"](RequestEvent(Step.REFUSED, "interactive", "bob", refusal=Refusal.TENANT_QUEUE_FULL,
                                       dequeued=False))

    def outcomes(**labels: str) -> dict[str, float]:
        return {o: value(r, "extproc_objective_requests_total", outcome=o, **labels) for o in ("met", "missed")}

    assert outcomes(priority="interactive", tenant="alice") == {"met": 2, "missed": 0}
    assert outcomes(priority="interactive", tenant="other") == {"met": 0, "missed": 1}  # mallory is not named
    assert outcomes(priority="interactive", tenant="bob") == {"met": 0, "missed": 1}
    assert outcomes(priority="standard") == {"met": 0, "missed": 1}
    assert outcomes(priority="batch") == {"met": 0, "missed": 0}
    # The slack of on-time releases, the lateness of late ones: each histogram only non-negative values.
    slack = {"model": "m", "priority": "interactive"}
    assert r.get_sample_value("extproc_release_slack_seconds_count", slack) == 2
    assert r.get_sample_value("extproc_release_slack_seconds_sum", slack) == 4.5
    assert r.get_sample_value("extproc_release_slack_seconds_bucket", {**slack, "le": "0.005"}) == 1
    assert r.get_sample_value("extproc_release_lateness_seconds_count", slack) == 1
    assert r.get_sample_value("extproc_release_lateness_seconds_sum", slack) == 1.0
    assert r.get_sample_value("extproc_release_lateness_seconds_count", {**slack, "priority": "standard"}) == 0
    # The other series are as before: every queued request left the queue once.
    assert set(samples(r, "extproc_queue_depth").values()) == {0}
    assert value(r, "extproc_rejected_total", reason="queue_timeout", tenant="bob") == 1


@pytest.mark.unit
@pytest.mark.parametrize("refusal", [None, Refusal.PREEMPTED], ids=["step only", "with its refusal"])
def test_a_preemption_is_counted_once_per_class_and_tenant_and_is_not_a_refusal(refusal: Refusal | None) -> None:
    telemetry, _ = build()
    r = telemetry.registry
    feed(telemetry, RequestEvent(Step.RELEASED, "batch", "alice", waited_s=3))
    # Preempted 0.75 s after its release; it is no longer in the queue, whatever the event says of that.
    for tenant, ran_s in (("alice", 0.75), ("carol", 0.25)):
        telemetry.models["m"](RequestEvent(Step.PREEMPTED, "batch", tenant, waited_s=ran_s, refusal=refusal))
    assert value(r, "extproc_preemptions_total", priority="batch", tenant="alice") == 1
    assert value(r, "extproc_preemptions_total", priority="batch", tenant="other") == 1
    assert value(r, "extproc_preemptions_total") == 2
    assert r.get_sample_value("extproc_preempted_occupancy_seconds_total", {"model": "m", "priority": "batch"}) == 1.0
    # Counted released (it was), never refused as well; the queue's depth is untouched.
    assert value(r, "extproc_released_total") == 1
    assert value(r, "extproc_rejected_total") == 0
    assert set(samples(r, "extproc_queue_depth").values()) == {0}
    # No objective verdict of its own: its release was judged when it went.
    assert value(r, "extproc_objective_requests_total") == 0
    [batch] = [b for b in telemetry.models["m"].objectives.status(10).bands if b.name == "batch"]
    assert batch.since_start == Counts(preempted=2)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.unit
def test_the_status_view_keeps_totals_and_the_last_minute_per_tenant_largest_first() -> None:
    clock = Clock()
    objectives = Objectives(BANDS, clock)
    objectives.record("interactive", "old", MET, 9.0)
    clock.now += 61  # out of the window, still in the totals
    for slack in (1.0, 3.0, -0.5):
        objectives.record("interactive", "alice", MET if slack >= 0 else MISSED, slack)
    objectives.record("interactive", "bob", MET, 2.0)
    objectives.record("interactive", "carol", MISSED)  # refused after its deadline: no slack at release
    objectives.record("batch", "alice", PREEMPTED)
    status = objectives.status(top=2)
    assert status.window_s == WINDOW_S
    interactive, standard, batch = status.bands
    assert interactive.name == "interactive"
    assert interactive.since_start == Counts(met=4, missed=2)
    assert interactive.recent == Recent(met=3, missed=2, preempted=0, slack_p50_s=1.5, slack_min_s=-0.5)
    assert [t.tenant for t in interactive.top_tenants] == ["alice", "bob"]  # most outcomes first, ties by name
    assert interactive.top_tenants[0] == TenantRecent(2, 1, 0, 1.0, -0.5, tenant="alice")
    assert (interactive.other, interactive.other_tenants) == (Counts(missed=1), 1)
    assert standard == BandObjectives("standard", Counts(), Recent(0, 0, 0, None, None), (), Counts(), 0)
    assert batch.recent.preempted == 1 and batch.top_tenants[0].slack_p50_s is None
    # The JSON the page reads.
    assert asdict(status)["bands"][0]["top_tenants"][0] == {
        "met": 2, "missed": 1, "preempted": 0, "slack_p50_s": 1.0, "slack_min_s": -0.5, "tenant": "alice"}


@pytest.mark.unit
def test_the_window_is_bounded_in_memory_and_then_says_how_long_it_covers() -> None:
    clock = Clock()
    objectives = Objectives(BANDS, clock, most=4)
    for _ in range(10):
        objectives.record("interactive", "alice", MET, 1.0)
        clock.now += 1
    status = objectives.status(top=10)
    # The last four outcomes, over the last 4 s; the totals count all ten.
    assert status.window_s == 4 and status.bands[0].recent.met == 4 and status.bands[0].since_start.met == 10


@pytest.mark.unit
def test_the_window_keeps_only_its_minute_whether_or_not_the_status_is_read() -> None:
    clock = Clock()
    objectives = Objectives(BANDS, clock)
    start = clock.now
    for _ in range(600):  # ten minutes, one outcome a second, and nobody reads the page
        objectives.record("interactive", "alice", MET, 1.0)
        clock.now += 1
    clock.now = start  # read where the clock began, the status forgets nothing itself: it shows what was held
    assert objectives.status(top=10).bands[0].recent.met == WINDOW_S + 1  # the last minute only


@pytest.mark.unit
async def test_deferred_events_are_written_after_the_pass_and_a_failing_writer_loses_no_other_event() -> None:
    from extproc.adapters.telemetry.deferral import Deferral

    written: list[str] = []

    def write(event: str) -> None:
        if event == "bad":
            raise ValueError(event)
        written.append(event)

    deferral = Deferral()
    deferral.start(asyncio.get_running_loop())
    for event in ("a", "bad", "b"):
        deferral(write, event)
    assert written == []  # held until the loop's next pass
    await asyncio.sleep(0)
    assert written == ["a", "b"]
    deferral.stop()
    deferral(write, "c")
    assert written == ["a", "b", "c"]  # at once once stopped


@pytest.mark.unit
async def test_the_demand_series_are_read_from_the_dispatcher_when_scraped_without_a_tenant_label() -> None:
    """What an autoscaler reads (core/demand.py): per class held and in flight, the engines needed, GIE's pool series."""
    telemetry, dispatchers = build(parse_config({"models": [{**CONFIG_MODELS[0], "max_running": 4}]}))
    dispatcher, r = dispatchers["m"], telemetry.registry
    assert r.get_sample_value("extproc_engines_needed", {"model": "m"}) == 0
    assert r.get_sample_value("extproc_engine_capacity_requests", {"model": "m"}) == 4 + 3  # max_running + target
    dispatcher.record_scrape(ENDPOINT, EngineLoad(waiting=0, running=0, kv_usage=0.5), time.monotonic())
    held = [dispatcher.submit("alice", band) for band in (0, 0, 1) for _ in range(4)]  # 7 go, 5 are held
    await asyncio.sleep(DEMAND_READ_S * 2)  # a new scrape reads anew
    demand = samples(r, "extproc_demand_requests")
    assert {dict(k)["priority"]: v for k, v in demand.items() if dict(k)["state"] == "in_flight"} == {
        "interactive": 7, "standard": 0, "batch": 0}
    assert {dict(k)["priority"]: v for k, v in demand.items() if dict(k)["state"] == "held"} == {
        "interactive": 1, "standard": 4, "batch": 0}
    assert r.get_sample_value("extproc_engines_needed", {"model": "m"}) == 12 / 7
    assert r.get_sample_value("extproc_drain_seconds", {"model": "m"}) == 5 / 0.7  # 7 released in the last 10 s
    assert r.get_sample_value("inference_pool_ready_pods", {"name": "m"}) == 1
    assert r.get_sample_value("inference_pool_average_queue_size", {"name": "m"}) == 5  # held here + engine's waiting
    assert r.get_sample_value("inference_pool_average_kv_cache_utilization", {"name": "m"}) == 0.5
    assert r.get_sample_value("inference_pool_average_running_requests", {"name": "m"}) == 0
    for h in held:
        h.future.cancel()
        dispatcher.end(h)
    await asyncio.sleep(DEMAND_READ_S * 2)
    assert r.get_sample_value("extproc_engines_needed", {"model": "m"}) == 0
    assert r.get_sample_value("extproc_drain_seconds", {"model": "m"}) == 0
