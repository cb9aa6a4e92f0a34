"""The open-loop load generator: seeded, independent streams, the distributions it claims."""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest

from extproc.tools.bench import vllm
from extproc.tools.bench.arms import ARMS
from extproc.tools.bench.load import LogNormal, Pareto, Stream, periodic_times, plan, poisson_times, subplan
from extproc.tools.bench.scenarios import (
    BATCH_ALONE,
    QUICK,
    SCENARIOS,
    UNLOADED,
    VLLM_LIKE,
    batch_flood,
    batch_only,
    full_set,
    quick_set,
)

pytestmark = pytest.mark.unit

CHAT = (LogNormal(400, 1.0, 16, 8000), LogNormal(128, 0.8, 8, 1024))


def test_same_seed_same_plan_other_seed_other_plan() -> None:
    streams = [Stream("a", *CHAT, rate=2.0, end=30), Stream("b", *CHAT, burst=5, start=1.0)]
    assert plan(streams, seed=7) == plan(streams, seed=7)
    assert plan(streams, seed=7) != plan(streams, seed=8)


def test_adding_a_stream_leaves_the_others_requests_unchanged() -> None:
    a = Stream("a", *CHAT, rate=2.0, end=30)
    b = Stream("b", *CHAT, rate=1.0, end=30)
    alone = [r for r in plan([a, b], seed=3) if r.tenant == "a"]
    more = [r for r in plan([a, b, Stream("c", *CHAT, rate=5.0, end=30)], seed=3) if r.tenant == "a"]
    assert alone == more


def test_plan_is_in_arrival_order_and_bursts_arrive_together() -> None:
    requests = plan([Stream("flood", *CHAT, burst=50, start=2.0), Stream("p", *CHAT, rate=3.0, end=10)], seed=1)
    times = [r.at for r in requests]
    assert times == sorted(times)
    flood = [r for r in requests if r.tenant == "flood"]
    assert len(flood) == 50 and {r.at for r in flood} == {2.0}


def test_poisson_arrivals_have_the_rate_and_stay_in_the_window() -> None:
    rng = np.random.default_rng(0)
    times = poisson_times(rng, rate=20.0, start=5.0, end=505.0)
    assert all(5.0 <= t < 505.0 for t in times)
    # 10,000 expected arrivals: the count is within 4 standard deviations (100).
    assert abs(len(times) - 10_000) < 400
    gaps = np.diff(times)
    # Exponential gaps: mean = standard deviation = 1/rate.
    assert statistics.fmean(gaps) == pytest.approx(0.05, rel=0.05)
    assert statistics.stdev(gaps) == pytest.approx(0.05, rel=0.05)


def test_poisson_with_no_rate_or_empty_window_sends_nothing() -> None:
    rng = np.random.default_rng(0)
    assert poisson_times(rng, 0.0, 0, 10) == []
    assert poisson_times(rng, 5.0, 10, 10) == []


def test_lognormal_lengths_have_the_median_a_heavy_tail_and_the_bounds() -> None:
    draws = LogNormal(median=128, sigma=0.8, lo=8, hi=1024).sample(np.random.default_rng(1), 20_000)
    assert statistics.median(draws) == pytest.approx(128, rel=0.05)
    p99 = sorted(draws)[int(0.99 * len(draws))]
    assert p99 > 4 * 128  # e^(2.33 * 0.8) ~ 6.4x the median
    assert min(draws) >= 8 and max(draws) <= 1024
    assert all(isinstance(d, int) for d in draws)


def test_pareto_lengths_are_power_law_above_the_scale() -> None:
    draws = Pareto(scale=1500, alpha=1.5, hi=100_000).sample(np.random.default_rng(2), 20_000)
    assert min(draws) >= 1500
    # P(X > 4 * scale) = 4^-1.5 = 1/8 for a Pareto with alpha 1.5.
    share = sum(d > 4 * 1500 for d in draws) / len(draws)
    assert share == pytest.approx(1 / 8, abs=0.01)


def test_named_scenarios_are_well_formed() -> None:
    scenarios = full_set()
    assert [s.name for s in scenarios] == [
        "power-user", "steady-mix", "priority-mix", "noisy-neighbour", "join-leave", "gate-mix",
        "batch-flood", "steady-classes", "batch-only", "prefix-share", "prefix-share-2", "prefix-burst",
    ]
    known_arms = {a.name for a in ARMS}
    for scenario in [*scenarios, *quick_set(), *QUICK.values()]:
        requests = scenario.requests()
        assert requests, scenario.name
        assert any(scenario.in_focus(r.tenant, r.priority) for r in requests), scenario.name
        assert "direct-fifo" in scenario.arms and set(scenario.arms) <= known_arms, scenario.name
        # Every request fits the simulated engine's context (prompt + output <= KV cache), and on
        # the 4-slot GPU four of them at once (its KV holds 4 x 512 tokens, the tiny model's context).
        engine = scenario.engine
        fits = 65536 if engine is None else engine.kv_cache_tokens // engine.max_num_seqs
        assert max(r.prompt_tokens + r.max_tokens for r in requests) <= fits, scenario.name
        for phase in scenario.phases:
            assert scenario.phase_requests(phase), (scenario.name, phase.name)
    power = scenarios[0].requests()
    assert sum(r.tenant == "alice" for r in power) == 200
    assert sorted(r.tenant for r in power if r.tenant != "alice") == ["bob", "carol"]
    noisy = scenarios[3]
    rates = {s.tenant: s.rate for s in noisy.streams}
    assert rates["noisy"] == pytest.approx(10 * rates["quiet1"])
    assert math.isclose(scenarios[2].reference_before or 0, 15.0)


def test_real_vllm_scenarios_run_known_arms_and_fit_the_tiny_model() -> None:
    known = {a.name for a in vllm.ARMS}
    assert set(vllm.SCENARIOS) == {"power-user", "priority-mix", "batch-flood", "steady-classes", "batch-only",
                                   "prefix-share", "prefix-share-2"}
    for scenario in vllm.SCENARIOS.values():
        assert "direct-fifo" in scenario.arms and set(scenario.arms) <= known, scenario.name
        # Prompt + answer within the context (the tiny model's 512 tokens, the prefill one's 4,096), with room
        # for the chat template.
        context = 4096 if scenario.vllm_engine is vllm.PREFILL else 512
        assert max(r.prompt_tokens + r.max_tokens for r in scenario.requests()) <= context - 32, scenario.name
    # The new scenarios are the very ones the simulator runs on its vLLM-like GPU.
    assert vllm.SCENARIOS["batch-flood"] == SCENARIOS["batch-flood"]
    assert vllm.SCENARIOS["batch-only"] == SCENARIOS["batch-only"]


def test_periodic_arrivals_are_evenly_spaced_in_the_window() -> None:
    assert periodic_times(0.4, 1.0, 3.0) == pytest.approx([1.0, 1.4, 1.8, 2.2, 2.6])
    # The end is left out even where floating point lands on it.
    assert len(periodic_times(0.4, 0.0, 12.0)) == 30
    assert periodic_times(0.0, 0, 10) == [] and periodic_times(1.0, 5, 5) == []


def test_a_stream_carries_its_answer_mode_and_its_stop_into_every_request() -> None:
    requests = plan([Stream("job", *CHAT, burst=3, stream=False, priority="batch"),
                     Stream("chat", *CHAT, every=0.5, end=2.0, stop_after="job")], seed=1)
    job = [r for r in requests if r.tenant == "job"]
    chats = [r for r in requests if r.tenant == "chat"]
    assert len(job) == 3 and all(not r.stream and r.stop_after is None for r in job)
    assert [r.at for r in chats] == [0.0, 0.5, 1.0, 1.5]
    assert all(r.stream and r.stop_after == "job" for r in chats)


def test_subplan_is_the_same_requests_alone_moved_to_zero_and_cut_to_its_duration() -> None:
    requests = plan([Stream("job", *CHAT, burst=4), Stream("chat", *CHAT, every=0.5, start=1.0, end=5.0)], seed=2)
    chats = [r for r in requests if r.tenant == "chat"]
    alone = subplan(requests, frozenset({"chat"}), duration=1.0)
    assert [r.at for r in alone] == [0.0, 0.5]
    assert [(r.prompt_tokens, r.max_tokens) for r in alone] == [(r.prompt_tokens, r.max_tokens) for r in chats[:2]]
    assert len(subplan(requests, frozenset({"chat"}))) == len(chats)
    assert subplan(requests, frozenset({"nobody"})) == []


def test_batch_flood_is_the_issue_s_reproduction() -> None:
    scenario = batch_flood()
    requests = scenario.requests()
    job = [r for r in requests if r.tenant == "batchjob"]
    assert len(job) == 48 and {r.at for r in job} == {0.0}
    assert all(r.max_tokens == 200 and not r.stream and r.priority == "batch" for r in job)
    chats = [r for r in requests if r.tenant == "chat"]
    assert chats[0].at == 1.0 and chats[1].at == pytest.approx(1.4)
    assert all(r.stream and r.priority == "interactive" and r.stop_after == "batchjob" for r in chats)
    # The unloaded reference is the first 12 s of those very chats, on every arm; the batch alone runs direct only.
    [unloaded] = [p for p in scenario.phases if p.name == UNLOADED]
    reference = scenario.phase_requests(unloaded)
    assert len(reference) == 30
    assert [r.max_tokens for r in reference] == [r.max_tokens for r in chats[:30]]
    assert [p.name for p in scenario.phases_of("extproc-preempt")] == [UNLOADED]
    assert [p.name for p in scenario.phases_of("direct-fifo")] == [UNLOADED, BATCH_ALONE]
    assert scenario.planned_requests("direct-fifo") == len(requests) + 30 + 48
    assert scenario.engine == VLLM_LIKE and scenario.time_scale == 1.0
    # batchjob may use the batch class only.
    assert scenario.gateway["tenants"]["batchjob"]["priorities"] == ["batch"]
    assert [r.tenant for r in batch_only().requests()] == ["batchjob"] * 48


def test_every_scenario_is_named_in_the_bench_help() -> None:
    import argparse

    from extproc.tools.bench.cli import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    help_text = " ".join(parser.format_help().split()).replace("- ", "-")
    for name in [*SCENARIOS, *vllm.SCENARIOS]:
        assert name in help_text, name


def test_shared_prefixes_are_planned_deterministically_and_a_chat_turn_carries_its_history() -> None:
    from extproc.tools.bench.runner import planned_prompt

    requests = plan([Stream("rag", *CHAT, rate=2.0, end=20.0, documents=3, document_tokens=500),
                     Stream("talk", *CHAT, rate=1.0, end=20.0, chats=2)], seed=4)
    rag = [r for r in requests if r.tenant == "rag"]
    assert {r.prefix for r in rag} == {"rag-doc0", "rag-doc1", "rag-doc2"}
    assert all(r.prefix_tokens == 500 and r.prompt_tokens > 500 for r in rag)
    assert requests == plan([Stream("rag", *CHAT, rate=2.0, end=20.0, documents=3, document_tokens=500),
                             Stream("talk", *CHAT, rate=1.0, end=20.0, chats=2)], seed=4)
    talk = [r for r in requests if r.tenant == "talk"]
    first, second = (next(r for r in talk if r.prefix == f"talk-chat{c}") for c in (0, 1))
    assert first.prefix_tokens == first.prompt_tokens  # a turn is all its chat's text
    turns = [r for r in talk if r.prefix == "talk-chat0"]
    assert len(turns) >= 5
    for earlier, later in zip(turns, turns[1:], strict=False):  # each turn re-sends the one before it, and its answer
        assert later.prefix_tokens == later.prompt_tokens > earlier.prompt_tokens + earlier.max_tokens
        text_earlier, text_later = planned_prompt(earlier, 5, 4), planned_prompt(later, 6, 4)
        assert text_later.startswith(text_earlier)
    assert not planned_prompt(turns[1], 7, 4).startswith(planned_prompt(second, 8, 4)[:16])  # chats differ in their first block
    # The prompt texts: one document's share its text, a longer history extends a shorter one, the rest differs.
    a, b = [r for r in rag if r.prefix == "rag-doc0"][:2]
    text_a, text_b = planned_prompt(a, 1, 4), planned_prompt(b, 2, 4)
    assert text_a[:2000] == text_b[:2000] and text_a[2000:2010] != text_b[2000:2010]
    other = next(r for r in rag if r.prefix == "rag-doc1")
    assert planned_prompt(other, 3, 4)[0:10] != text_a[0:10]
    assert abs(len(text_a) - 4 * a.prompt_tokens) <= 4
