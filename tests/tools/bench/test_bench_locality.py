"""The prefix-locality figures on hand-made runs: hit rate, the VTC artifact's service difference, the report."""

from __future__ import annotations

from pathlib import Path

import pytest

from extproc.tools.bench.arms import ARMS
from extproc.tools.bench.metrics import W_OUT, prefix_hits, service_difference, summarize
from extproc.tools.bench.report import plot_locality, scenario_markdown
from extproc.tools.bench.runner import ArmRun, Result
from extproc.tools.bench.scenarios import SCENARIOS

pytestmark = pytest.mark.unit


def result(tenant: str, sent: float, ttft: float, e2e: float, tokens: int = 10, prompt: int = 0) -> Result:
    return Result(tenant, None, sent, sent, 200, ttft, e2e, None, prompt, tokens, tokens)


# One window, [0, 10] (the tick at 5): a's answer (60 service units: W_OUT 2 x 30 tokens) streams within it: 6/s,
# as much as it asked. b's first answer (20 units) streams over [5, 15]: half in the window, 1/s; its second
# (100 units) only after it. b asked for 12/s.
ONE_WINDOW = [
    result("a", 0, 0, 10, tokens=30),
    result("b", 0, 5, 15, tokens=10),
    result("b", 1, 19, 29, tokens=50),
]


def test_service_difference_is_a_tenant_s_shortfall_from_the_best_served_capped_by_its_demand() -> None:
    assert W_OUT == 2
    # b is 5/s short of a, and asked for 11/s more than it got: 5.
    assert service_difference(ONE_WINDOW, weight=lambda t: 1.0, window=10.0, ticks=[5.0]) == {
        "mean": pytest.approx(5.0), "max": pytest.approx(5.0), "ticks": 1}
    # Without its second request b asked for only 2/s: short of a by 5, but of its own demand by 1 only.
    assert service_difference(ONE_WINDOW[:2], weight=lambda t: 1.0, window=10.0, ticks=[5.0])["max"] == \
        pytest.approx(1.0)
    # A weight divides rates: b at 0.5 is served 2/s of a's 6: 4 short.
    assert service_difference(ONE_WINDOW, weight=lambda t: 0.5 if t == "b" else 1.0, window=10.0,
                              ticks=[5.0])["max"] == pytest.approx(4.0)
    # A later window where nobody is served nor asks: 0; the mean is over both ticks.
    both = service_difference(ONE_WINDOW, weight=lambda t: 1.0, window=10.0, ticks=[5.0, 50.0])
    assert both == {"mean": pytest.approx(2.5), "max": pytest.approx(5.0), "ticks": 2}


def test_service_difference_needs_two_tenants() -> None:
    alone = [result("a", 0, 30, 31), result("a", 5, 0.1, 40)]
    assert service_difference(alone, weight=lambda t: 1.0) == {"mean": None, "max": None, "ticks": 0}


def run(arm: str, results: list[Result], prefix_cache: dict[str, float], replicas: tuple[float, ...] = ()) -> ArmRun:
    return ArmRun("prefix-share-2", arm, 1.0, tuple(results), (), 1.0, {}, prefix_cache=prefix_cache,
                  replica_queries=replicas)


def test_hit_rate_is_hit_over_queried_tokens_and_absent_without_counters() -> None:
    assert prefix_hits(run("x", [], {"queries": 8000.0, "hits": 2000.0}, (6000.0, 2000.0))) == {
        "hit_rate": 0.25, "queried_tokens": 8000.0, "hit_tokens": 2000.0, "replica_shares": [0.75, 0.25]}
    assert prefix_hits(run("x", [], {}))["hit_rate"] is None  # the engine exports no prefix-cache counters
    assert prefix_hits(run("x", [], {"queries": 0.0, "hits": 0.0}))["hit_rate"] is None  # nothing was looked up


def test_two_replicas_compare_with_envoy_alone_and_the_report_shows_the_locality_figures(tmp_path: Path) -> None:
    scenario = SCENARIOS["prefix-share-2"]
    assert scenario.replicas == 2 and scenario.baseline == "envoy"
    # Every gateway arm hashes prefixes in blocks of 128 tokens (2,048 covered); two replicas: the processor picks.
    assert scenario.model == {"prefix": {"block_tokens": 128}, "endpoint_picking": True}
    assert SCENARIOS["prefix-share"].baseline == "direct-fifo"
    envoy = run("envoy", ONE_WINDOW, {"queries": 1000.0, "hits": 100.0}, (500.0, 500.0))
    local = run("extproc-locality", ONE_WINDOW[:2], {"queries": 1000.0, "hits": 600.0}, (900.0, 100.0))
    summary = {r.arm: summarize(scenario, r, envoy, 29.0) for r in (envoy, local)}
    assert summary["envoy"]["throughput"]["requests_ratio"] == 1.0
    # 2 requests in 15 s against 3 in 30 s.
    assert summary["extproc-locality"]["throughput"]["requests_ratio"] == pytest.approx((2 / 15) / (3 / 30))
    assert summary["extproc-locality"]["locality"]["hit_rate"] == pytest.approx(0.6)
    arms = [a for a in ARMS if a.name in summary]
    text = "\n".join(scenario_markdown(scenario, arms, summary))
    assert "FIFO baseline (envoy)" in text and "0.600" in text and "0.90 / 0.10" in text and "prefix-share-2-locality.png" in text
    plot_locality(scenario, arms, summary, tmp_path / "locality.png")
    assert (tmp_path / "locality.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_scenario_on_its_own_real_vllm_is_described_as_such() -> None:
    from extproc.tools.bench.report import scenario_markdown

    engine = {"size": "prefill", "max_num_seqs": 4, "kv_cache_tokens": None, "chars_per_token": 2}
    lines = scenario_markdown(SCENARIOS["prefix-share"], [], {}, engine)
    assert "On its own real vLLM: the prefill model, 4 sequences, the default tokens of KV." in lines
