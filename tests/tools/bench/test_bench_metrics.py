"""The benchmark's figures on hand-made runs: fairness, backlog, throughput, arms as config."""

from __future__ import annotations

import datetime
import json
import time
from dataclasses import replace
from pathlib import Path

import pytest
from aiohttp import web

from extproc.adapters.config import ConfigError, parse_config
from extproc.adapters.protocol.contract import REASON_HEADER
from extproc.tools.bench.arms import ARMS, Arm, arm_config, band_objectives, scale_objectives
from extproc.tools.bench.load import LogNormal, Planned, Stream
from extproc.tools.bench.metrics import (
    W_IN,
    W_OUT,
    Capacity,
    attainment,
    backlog_intervals,
    batch_capacity,
    batch_figures,
    class_figures,
    common_horizon,
    conservation,
    empty_slots_while_held,
    fairness,
    first_full,
    held_intervals,
    itl_between,
    jain,
    latency,
    processor,
    refill_gaps,
    service_until,
    slowdown,
    summarize,
    throughput,
    time_mean,
    tokens_until,
)
from extproc.tools.bench.overhead import parse_hey_csv
from extproc.tools.bench.runner import (
    RETRY_HEADER,
    ArmRun,
    Attempt,
    Decision,
    EngineSample,
    PhaseRun,
    Result,
    decisions,
    preempted,
    processor_counters,
    prompt_text,
    replay,
)
from extproc.tools.bench.scenarios import (
    BATCH,
    BATCH_ALONE,
    BATCH_ONLY_TENANT,
    CONSERVATION,
    OBJECTIVES,
    UNLOADED,
    Engine,
    Scenario,
)
from extproc.tools.sim.server import estimate_tokens
from tests.httputil import serving

pytestmark = pytest.mark.unit


def result(tenant: str, sent: float, ttft: float, e2e: float, tokens: int = 10, prompt: int = 0,
           priority: str | None = None, queue_wait: float | None = None) -> Result:
    return Result(tenant, priority, sent, sent, 200, ttft, e2e, queue_wait, prompt, tokens, tokens)


def test_jain_index_known_values() -> None:
    assert jain([5, 5, 5, 5]) == 1.0
    assert jain([1, 0, 0, 0]) == pytest.approx(0.25)
    assert jain([1, 2]) == pytest.approx(9 / 10)
    assert jain([0, 0]) == 1.0


def test_a_tenant_is_backlogged_only_until_its_first_token() -> None:
    results = [result("a", 0, 2, 10), result("a", 1, 3, 5), result("a", 8, 1, 2)]
    # [0, 2) and [1, 4) merge; [8, 9) stands alone; streaming time does not count.
    assert backlog_intervals(results) == [(0, 4), (8, 9)]


def test_fairness_compares_weighted_service_of_tenants_backlogged_through_a_window() -> None:
    # a and b both wait through [0, 10): a is served 30 output tokens in the window, b 10.
    results = [
        result("a", 0, 0, 10, tokens=30),
        result("a", 0, 10.5, 11),  # keeps a backlogged through the window
        result("b", 0, 0, 10, tokens=10),
        result("b", 0, 10.5, 11),
        result("c", 0, 0.1, 1),  # backlogged only briefly: not part of the window
    ]
    even = fairness(results, weight=lambda t: 1.0, window=10.0)
    assert even["windows"] == 1
    assert even["mean"] == pytest.approx(jain([30, 10]))
    # With b weighted 1/3, 10 tokens are worth 30: perfectly fair.
    weighted = fairness(results, weight=lambda t: 1 / 3 if t == "b" else 1.0, window=10.0)
    assert weighted["mean"] == pytest.approx(1.0)


def test_fairness_compares_tenants_only_within_their_priority_class() -> None:
    # x (batch) gets nothing while the interactive tenants are served: strict priority, not unfairness.
    results = [
        result("x", 0, 20, 21, priority="batch"),
        result("u", 0, 0, 10, tokens=20, priority="interactive"),
        result("u", 0, 10.5, 11, priority="interactive"),
        result("v", 0, 0, 10, tokens=20, priority="interactive"),
        result("v", 0, 10.5, 11, priority="interactive"),
    ]
    assert fairness(results, weight=lambda t: 1.0, window=10.0) == {"mean": 1.0, "min": 1.0, "windows": 1}


def test_fairness_without_two_backlogged_tenants_has_no_windows() -> None:
    results = [result("a", 0, 30, 31), result("b", 0, 0.1, 40)]
    assert fairness(results, weight=lambda t: 1.0, window=10.0) == {"mean": None, "min": None, "windows": 0}


def test_service_counts_prompt_at_first_token_and_output_as_it_streams() -> None:
    r = result("a", 0, 2, 12, tokens=100, prompt=40)
    assert service_until(r, 1.9) == 0
    assert service_until(r, 2) == pytest.approx(W_IN * 40)
    assert service_until(r, 7) == pytest.approx(W_IN * 40 + W_OUT * 50)
    assert service_until(r, 99) == pytest.approx(W_IN * 40 + W_OUT * 100)
    assert tokens_until([r], 7) == pytest.approx(50)


def test_throughput_over_the_makespan_and_the_common_horizon() -> None:
    fast = [result("a", 0, 1, 10, tokens=100), result("a", 1, 1, 9, tokens=100)]
    slow = [result("a", 0, 1, 10, tokens=100), result("a", 1, 1, 17, tokens=100)]
    tp = throughput(fast)
    assert tp.makespan == 10 and tp.requests_per_s == pytest.approx(0.2) and tp.tokens_per_s == pytest.approx(20)
    runs = [ArmRun("s", name, 1.0, tuple(rs), (), 1.0, {}) for name, rs in (("fast", fast), ("slow", slow))]
    assert common_horizon(runs) == 10
    # By t=10 the slow arm's second request has streamed half of its tokens.
    assert tokens_until(slow, 10) == pytest.approx(150)


def test_summary_of_a_run_relative_to_direct_fifo() -> None:
    one_token = LogNormal(1, 0)
    scenario = Scenario("s", "test", (Stream("a", one_token, one_token),), focus="b", focus_tenants=frozenset({"b"}),
                        reference_before=5.0)
    fifo = ArmRun("s", "direct-fifo", 0.5, (result("a", 0, 1, 10), result("b", 6, 4, 8)),
                  (EngineSample(1, 5, 16), EngineSample(2, 7, 16), EngineSample(30, 99, 0)), 10.0, {"engine": 2.0})
    gated = ArmRun("s", "extproc-rr", 0.5,
                   (result("a", 0, 1, 20, queue_wait=0.5), result("b", 1, 0.5, 3, queue_wait=0.25),
                    result("b", 6, 1, 4, queue_wait=0.1)),
                   (EngineSample(1, 2, 16), EngineSample(2, 3, 16)), 10.0, {"engine": 1.0, "extproc": 0.5})
    horizon = common_horizon([fifo, gated])
    summary = summarize(scenario, gated, fifo, horizon)
    assert summary["ok"] == 3 and summary["errors"] == []
    assert summary["focus"]["ttft"] == {"p50": 0.5, "p95": 1, "p99": 1}
    assert summary["focus"]["queue_wait"]["p99"] == 0.25
    assert summary["focus_unloaded"]["ttft"]["p99"] == 0.5 and summary["focus_loaded"]["ttft"]["p99"] == 1
    assert summary["engine"]["waiting_max"] == 3
    assert summary["throughput"]["horizon_s"] == 14
    assert summary["cpu_share"] == {"engine": 0.1, "extproc": 0.05}
    fifo_summary = summarize(scenario, fifo, fifo, horizon)
    # Engine samples after the last response do not count.
    assert fifo_summary["engine"]["waiting_max"] == 7
    assert fifo_summary["throughput"]["requests_ratio"] == 1.0


def test_prompt_text_is_counted_as_the_planned_tokens_by_the_simulator() -> None:
    for tokens in (1, 7, 400, 16000):
        assert estimate_tokens(prompt_text(tokens)) == tokens


def test_arm_configs_are_valid_and_overrides_reach_the_model() -> None:
    for arm in ARMS:
        config = parse_config(arm_config(arm, ["alice", "bob"], redis_url="redis://127.0.0.1:6399/0"))
        assert config.envoy.api_keys == {"key-alice": "alice", "key-bob": "bob"}
        assert config.models[0].target_waiting == 3
        # A cluster arm names its instances on distinct ports and the run's Redis; the others have no cluster.
        if arm.instances > 1:
            assert config.cluster is not None and config.cluster.redis_url == "redis://127.0.0.1:6399/0"
            addresses = {a for i in config.cluster.instances.values() for a in (i.grpc, i.metrics)}
            assert len(config.cluster.instances) == arm.instances and len(addresses) == 2 * arm.instances
        else:
            assert config.cluster is None
    with pytest.raises(ValueError, match="redis_url"):
        arm_config(next(a for a in ARMS if a.instances > 1), ["a"])
    tuned = parse_config(arm_config(Arm("t", "extproc", "t", model={"target_waiting": 8}), ["a"]))
    assert tuned.models[0].target_waiting == 8
    # An arm with a setting this code does not have fails with the key path, before anything runs.
    with pytest.raises(ConfigError, match=r"models\[0\]\.policy"):
        parse_config(arm_config(Arm("lottery", "extproc", "lottery", model={"policy": "lottery"}), ["a"]))


def test_hey_csv_rows_become_latencies_of_successful_requests(tmp_path: Path) -> None:
    text = (
        "response-time,DNS+dialup,DNS,Request-write,Response-delay,Response-read,status-code,offset\n"
        "0.0012,0.0001,0.0000,0.0000,0.0011,0.0000,200,0.0010\n"
        "0.0020,0.0000,0.0000,0.0000,0.0019,0.0000,503,0.0040\n"
        "0.0009,0.0000,0.0000,0.0000,0.0008,0.0000,200,0.0070\n"
    )
    run = parse_hey_csv(text, seconds=0.5)
    assert (run.sent, run.ok) == (3, 2)
    assert run.latencies_s == (0.0012, 0.0009)
    assert run.rate == 4.0


_INSTANCE_PAGE = """\
# TYPE extproc_released_total counter
extproc_released_total{{model="m",priority="standard",tenant="alice"}} {released_a}
extproc_released_total{{model="m",priority="standard",tenant="bob"}} 10.0
# TYPE extproc_cluster_round_trips_total counter
extproc_cluster_round_trips_total{{model="m",outcome="ok"}} {trips}
extproc_cluster_round_trips_total{{model="m",outcome="failed"}} 7.0
# TYPE extproc_cluster_round_trip_seconds histogram
extproc_cluster_round_trip_seconds_bucket{{model="m",le="0.001"}} {fast}
extproc_cluster_round_trip_seconds_bucket{{model="m",le="0.005"}} {trips}
extproc_cluster_round_trip_seconds_bucket{{model="m",le="+Inf"}} {trips}
extproc_cluster_round_trip_seconds_count{{model="m"}} {trips}
extproc_cluster_round_trip_seconds_sum{{model="m"}} {seconds}
"""


def test_processor_figures_sum_every_instance_of_a_cluster() -> None:
    """Each instance counts only its own releases and round trips: the cluster's cost is the sum over instances."""
    pages = [_INSTANCE_PAGE.format(released_a=30, trips=50, fast=50, seconds=0.04),
             _INSTANCE_PAGE.format(released_a=50, trips=50, fast=0, seconds=0.16)]
    counters = processor_counters(pages)
    assert counters["released"] == 100 and counters["round_trips_ok"] == 100  # failed round trips left out
    run = ArmRun("s", "cluster-rr", 0.5, (result("a", 0, 1, 2),) * 4, (), 20.0, {"extproc": 0.2}, counters)
    figures = processor(run)
    assert figures == {
        "released": 100, "releases_per_s": 5.0, "cpu_ms_per_request": pytest.approx(50.0),
        "round_trips_per_release": 1.0, "round_trip_mean_ms": pytest.approx(2.0),
        # Half the round trips in the first bucket: p50 is its bound, p99 the next one's.
        "round_trip_p50_ms": 1.0, "round_trip_p99_ms": 5.0,
    }
    # One instance without a cluster: releases and CPU, no Redis figures.
    single = processor(ArmRun("s", "extproc-rr", 0.5, (), (), 10.0, {"extproc": 0.1}, {"released": 20.0}))
    assert single is not None and single["releases_per_s"] == 2.0 and single["round_trips_per_release"] is None
    assert single["round_trip_p99_ms"] is None
    assert processor(ArmRun("s", "direct-fifo", 0.5, (), (), 10.0, {})) is None


# --- priority inside the engine: objectives, the batch class, classes against direct, work conservation ----------------


def batch(sent: float, e2e: float, *, tokens: int = 100, queue_wait: float | None = None, preempted: int = 0,
          resent: float | None = None) -> Result:
    return Result("job", "batch", sent, sent, 200, e2e, e2e, queue_wait, 10, tokens, tokens, stream=False,
                  preempted=preempted, resent=resent)


def test_attainment_counts_a_failed_request_as_missed() -> None:
    failed = Result("u", "interactive", 0, 0, 503, None, 1, None, 10, 10, 0, error="overloaded")
    got = attainment([result("u", 0, 0.5, 1), result("u", 0, 6.0, 7), failed], 5.0)
    assert got == {"objective_s": 5.0, "requests": 3, "met": 1, "share": pytest.approx(1 / 3)}
    assert attainment([result("u", 0, 0.5, 1)], None)["share"] is None
    assert attainment([], 5.0)["share"] is None


def test_slowdown_is_loaded_over_unloaded_per_percentile() -> None:
    unloaded = latency([result("u", 0, 0.1, 1), result("u", 0, 0.2, 1)])
    loaded = latency([result("u", 0, 0.3, 1), result("u", 0, 0.8, 1)])
    assert slowdown(loaded, unloaded) == {"p50": pytest.approx(3.0), "p99": pytest.approx(4.0)}
    assert slowdown(loaded, latency([])) == {"p50": None, "p99": None}
    assert slowdown(None, unloaded) == {"p50": None, "p99": None}


def test_a_preempted_answer_is_recognised_by_its_reason_or_its_error_code() -> None:
    assert preempted(Attempt(503, None, 0.1, None, 0, "", "preempted", 1.0))
    assert preempted(Attempt(503, None, 0.1, None, 0, '{"error": {"code": "preempted"}}'))
    assert not preempted(Attempt(503, None, 0.1, None, 0, "", "overloaded", 1.0))
    assert not preempted(Attempt(200, 0.1, 0.2, None, 5))


def test_a_retried_request_is_released_from_its_last_send() -> None:
    assert batch(0, 10, queue_wait=2.0).released_at == 2.0
    assert batch(0, 10, queue_wait=2.0, resent=5.0, preempted=1).released_at == 7.0
    assert batch(0, 10).released_at is None


def _scenario(**kwargs: object) -> Scenario:
    streams = (Stream("job", LogNormal(1, 0), LogNormal(1, 0), burst=1, priority="batch"),
               Stream("u", LogNormal(1, 0), LogNormal(1, 0), burst=1, priority="interactive"))
    return Scenario("s", "test", streams, focus="interactive", focus_priority="interactive", **kwargs)  # type: ignore[arg-type]


def test_batch_throughput_against_the_idle_capacity_and_preemptions() -> None:
    scenario = _scenario(measures=frozenset({BATCH, OBJECTIVES}))
    alone = PhaseRun((batch(0, 10, tokens=1000), batch(0, 10, tokens=1000)), (), 10.0)
    direct = ArmRun("s", "direct-fifo", 1.0, (batch(0, 10, tokens=1000), batch(0, 10, tokens=1000)), (), 10.0, {},
                    phases={BATCH_ALONE: alone}, slots=4)
    assert batch_capacity(scenario, direct) == Capacity(200.0, None)
    # 20 chats, each holding a slot for 2 s (first token to end) over the batch's 20 s on 4 slots: half the engine.
    chats = tuple(result("u", 0.9 * k, 0.1, 2.1, priority="interactive") for k in range(20))
    unloaded = PhaseRun(tuple(result("u", t, 0.1, 2.0, priority="interactive") for t in range(3)), (), 3.0)
    gated = ArmRun("s", "extproc-preempt", 1.0,
                   (batch(0, 20, tokens=1000, preempted=2), batch(0, 15, tokens=1000), *chats), (), 20.0, {},
                   processor={"preemptions": 3.0}, phases={UNLOADED: unloaded}, objectives={"interactive": 5.0},
                   slots=4)
    figures = batch_figures(scenario, gated, direct, batch_capacity(scenario, direct))
    assert figures["makespan_s"] == 20 and figures["makespan_ratio"] == 2.0
    assert figures["tokens_per_s"] == pytest.approx(100.0)
    assert figures["others_slot_share"] == pytest.approx(0.5)
    assert figures["idle_capacity_tokens_per_s"] == pytest.approx(100.0)
    assert figures["capacity_ratio"] == pytest.approx(1.0)
    assert figures["preemptions_per_request"] == 1.0 and figures["processor_preemptions_per_request"] == 1.5
    # Without the engine's inter-token counters, nothing is given per step.
    assert figures["makespan_steps_ratio"] is None and figures["capacity_steps_ratio"] is None
    # Without a batch-alone reference there is no idle capacity to compare with.
    assert batch_figures(scenario, gated, direct, None)["capacity_ratio"] is None
    summary = summarize(scenario, gated, direct, 20.0, batch_alone=Capacity(200.0))
    assert summary["focus_unloaded"]["ttft"]["p99"] == pytest.approx(0.1)
    assert summary["focus_objective"]["share"] == 1.0 and summary["slowdown"]["p99"] == pytest.approx(1.0)
    assert summary["objectives"] == {"interactive": {"objective_s": 5.0, "requests": 20, "met": 20, "share": 1.0}}


def test_class_figures_compare_each_class_with_direct() -> None:
    direct = [result("u", 0, 0.1, 1, priority="interactive"), result("b", 0, 1.0, 10, tokens=100, priority="batch")]
    gated = [result("u", 0, 0.2, 1, priority="interactive"), result("b", 0, 1.0, 20, tokens=100, priority="batch")]
    figures = class_figures(gated, direct)
    assert figures["interactive"]["ttft_ratio"] == {"p50": pytest.approx(2.0), "p99": pytest.approx(2.0)}
    assert figures["batch"]["tokens_ratio"] == pytest.approx(0.5)


def samples(*points: tuple[float, float]) -> tuple[EngineSample, ...]:
    return tuple(EngineSample(at, 0, running) for at, running in points)


def test_running_is_averaged_over_time_not_over_samples() -> None:
    engine = samples((0, 4), (1, 4), (1.1, 0), (4, 0))
    # 4 for 1.1 s, 0 for 2.9 s, in [0, 4].
    assert time_mean(engine, 0, 4) == pytest.approx(4 * 1.1 / 4)
    assert time_mean(engine, 0.5, 1.05) == pytest.approx(4.0)
    assert time_mean((), 0, 1) is None


def test_empty_slots_count_only_while_the_gateway_holds_requests() -> None:
    results = [batch(0, 5, queue_wait=0.0), batch(0, 6, queue_wait=2.0), batch(0, 8, queue_wait=5.5)]
    held = held_intervals(results)
    assert held == [(0, 5.5)]  # released at once, at 2 s and at 5.5 s: one held stretch
    engine = samples((0, 2), (1, 4), (5, 3), (6, 1), (8, 0))
    # Below 4 slots while held: [0, 1) with 2 empty, [5, 5.5) with 1 empty.
    assert empty_slots_while_held(engine, held, 4) == {"below_s": pytest.approx(1.5), "slot_s": pytest.approx(2.5)}
    assert first_full(engine, 4) == 1 and first_full(engine, 5) is None
    # A slot whose request finished in the last step while another waits to take it at the next is not empty.
    between_steps = (EngineSample(0.0, 1, 3), EngineSample(1.0, 0, 3), EngineSample(2.0, 0, 4))
    assert empty_slots_while_held(between_steps, [(0.0, 2.0)], 4) == {"below_s": 1.0, "slot_s": 1.0}


def test_the_k_th_completion_s_slot_is_refilled_by_the_release_after_the_first_slots() -> None:
    # Two slots: releases at 0, 0 fill them; completions at 5 and 6 are refilled at 5.1 and 5.9
    # (released before the client saw the second end: negative).
    gaps = refill_gaps([0, 0, 5.1, 5.9], [5, 6, 10, 11], 2)
    assert gaps == [pytest.approx(0.1), pytest.approx(-0.1)]
    assert refill_gaps([0], [5], 2) == []


def test_mean_step_time_from_the_engine_s_inter_token_counters() -> None:
    engine = (EngineSample(0, 0, 4, 1.0, 100), EngineSample(1, 0, 4, 2.3, 200), EngineSample(9, 0, 4, 9.9, 900))
    assert itl_between(engine, 0, 1) == pytest.approx(0.013)
    assert itl_between(engine, 0.5, 1) is None  # one sample is no interval
    assert itl_between((EngineSample(0, 0, 4), EngineSample(1, 0, 4)), 0, 1) is None  # no counters


def test_decision_log_lines_in_the_run_s_window_become_model_seconds() -> None:
    def line(ts: str, outcome: str = "released", logger: str = "extproc.decisions") -> str:
        return json.dumps({"ts": ts, "level": "debug", "logger": logger, "msg": "x", "tenant": "job",
                           "class": "batch", "model": "m", "wait_ms": 1.0, "outcome": outcome})

    start = datetime.datetime(2026, 12, 1, 12, 0, 0, tzinfo=datetime.UTC).timestamp()
    lines = [line("2026-12-01T11:59:59.000+00:00"),  # an earlier phase's
             line("2026-12-01T12:00:01.250+00:00"), "not json extproc.decisions",
             line("2026-12-01T12:00:02.000+00:00", "refused:preempted"),
             line("2026-12-01T12:00:02.500+00:00", logger="extproc.health"),
             line("2026-12-01T12:00:30.000+00:00")]  # after the run
    # wait_ms 1: 2 ms of the modelled GPU at time scale 0.5.
    assert decisions(lines, start, wall_s=10.0, time_scale=0.5) == [
        Decision(2.5, "job", "batch", "released", 0.002), Decision(4.0, "job", "batch", "refused:preempted", 0.002)]


def test_conservation_of_a_gated_run_against_direct() -> None:
    scenario = _scenario(measures=frozenset({CONSERVATION}))
    direct = ArmRun("s", "direct-fifo", 1.0, (batch(0, 10), batch(0, 10)), samples((0, 2), (10, 0)), 10.0, {},
                    slots=2)
    gated = ArmRun("s", "extproc-rr", 1.0, (batch(0, 10, queue_wait=0.0), batch(0, 11, queue_wait=1.0)),
                   samples((0, 1), (1, 2), (10, 1), (11, 0)), 11.0, {}, slots=2)
    figures = conservation(scenario, gated, direct)
    assert figures["makespan_ratio"] == pytest.approx(1.1)
    assert figures["running_mean"] == pytest.approx((1 + 2 * 9 + 1) / 11)
    assert figures["running_ratio"] == pytest.approx((20 / 11) / 2)
    # Direct left none of its 2 x 10 slot-s empty; the gated run 2 of its 2 x 11.
    assert figures["empty_slot_s"] == pytest.approx(2.0) and figures["empty_slot_s_over_direct"] == pytest.approx(2.0)
    assert figures["held_s"] == 1.0 and figures["empty_slot_s_while_held"] == pytest.approx(1.0)
    # All of it at the start: the engine first ran both slots at 1 s.
    assert figures["ramp_empty_slot_s"] == pytest.approx(1.0)
    assert figures["first_full_s"] == 1 and figures["completions_while_held"] == 0
    # Releases from the client's view (no decision log): at 0 and 1; the first completion (10) has none after.
    assert figures["releases_from"] == "client" and figures["refills"] == 0
    logged = replace(gated, decisions=(Decision(0, "job", "batch", "released"), Decision(1.0, "job", "batch", "released"),
                                       Decision(10.2, "job", "batch", "released")))
    figures = conservation(scenario, logged, direct)
    assert figures["releases_from"] == "decision log" and figures["refill_ms_mean"] == pytest.approx(200)
    # Without the engine's inter-token counters there is no makespan in steps.
    assert figures["makespan_steps_ratio"] is None


def test_objectives_are_the_processor_s_and_scaled_to_the_simulator_s_speed() -> None:
    doc = arm_config(ARMS[0], ["job"], scenario={"tenants": {"job": BATCH_ONLY_TENANT}})
    assert band_objectives(doc) == {"interactive": 5.0, "standard": 60.0}
    scaled = scale_objectives(doc, 0.25)
    assert band_objectives(scaled) == {"interactive": 1.25, "standard": 15.0}
    assert scale_objectives(doc, 1.0) == doc
    config = parse_config(scaled)
    assert config.tenant("job").bands == ("batch",)
    # A band's own objective (and its floor for a request's own) is scaled too.
    tight = Arm("t", "extproc", "t", top={"bands": {"interactive": {"ttft_objective_s": 2.0,
                                                                      "min_ttft_objective_s": 0.5}}})
    bands = parse_config(scale_objectives(arm_config(tight, ["a"]), 0.5)).bands
    assert (bands[0].ttft_objective_s, bands[0].min_ttft_objective_s) == (1.0, 0.25)


def test_batch_figures_per_engine_step_undo_a_slower_cpu() -> None:
    """The same work on an engine whose steps took twice as long (a busy CPU): the same per step."""
    scenario = _scenario(measures=frozenset({BATCH}))

    def engine(step: float, end: float) -> tuple[EngineSample, ...]:
        # One token per step: the counters add a step's time and one count per step.
        return tuple(EngineSample(t, 0, 4, t, t / step) for t in (0.0, end / 2, end))

    unloaded = PhaseRun((result("u", 0, 0.1, 1.0, priority="interactive"),), (), 1.0)
    direct = ArmRun("s", "direct-fifo", 1.0, (batch(0, 10, tokens=1000),), engine(0.01, 10), 10.0, {}, slots=4,
                    phases={UNLOADED: unloaded})
    slow = ArmRun("s", "extproc-rr", 1.0, (batch(0, 20, tokens=1000),), engine(0.02, 20), 20.0, {}, slots=4,
                  phases={UNLOADED: unloaded})
    figures = batch_figures(scenario, slow, direct, Capacity(100.0, 0.01))
    assert figures["others_slot_share"] == 0
    assert figures["makespan_ratio"] == pytest.approx(2.0) and figures["makespan_steps_ratio"] == pytest.approx(1.0)
    assert figures["itl_ms"] == pytest.approx(20.0)
    # Nobody else sent anything during the batch: the idle capacity is the batch alone's.
    assert figures["capacity_ratio"] == pytest.approx(0.5) and figures["capacity_steps_ratio"] == pytest.approx(1.0)


async def test_a_request_refused_for_its_queue_wait_is_sent_again_as_the_sdk_does() -> None:
    """503 queue_timeout: sent again after its Retry-After, at most the SDK's two retries, numbered as retries."""
    seen: list[str] = []
    refuse = {"always": False}

    async def answer(request: web.Request) -> web.Response:
        seen.append(request.headers[RETRY_HEADER])
        if refuse["always"] or len(seen) < 3:
            return web.json_response({"error": {"code": "queue_timeout"}}, status=503,
                                     headers={REASON_HEADER: "queue_timeout", "retry-after": "0"})
        return web.json_response({"usage": {"completion_tokens": 4}})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", answer)
    planned = Planned(0.0, "alice", "batch", 10, 4, stream=False)
    async with serving(app) as url:
        [result] = await replay([url], [planned], time_scale=0.01, api_keys={}, t0=time.monotonic(), engine=Engine())
        assert (result.status, result.tokens, seen) == (200, 4, ["0", "1", "2"])
        seen.clear()
        refuse["always"] = True
        [result] = await replay([url], [planned], time_scale=0.01, api_keys={}, t0=time.monotonic(), engine=Engine())
        assert (result.status, seen) == (503, ["0", "1", "2"])  # then it gives up, as the SDK does
