"""The prefix-locality figures (#21) on hand-made runs: hit rate, the VTC service difference, the report."""

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


# a is served 30 output tokens in each 10 s window; b 10 in the first and 40 in the second; both wait for a first
# token through both windows (their last requests answer at 20.5). c is served much, but never waits through one.
TWO_WINDOWS = [
    result("a", 0, 0, 20, tokens=60),
    result("a", 0, 20.5, 21),
    result("b", 0, 0, 10, tokens=10),
    result("b", 0, 10, 20, tokens=40),
    result("b", 0, 20.5, 21),
    result("c", 0, 0.1, 20, tokens=500),
]


def test_service_difference_is_the_largest_gap_between_backlogged_tenants_per_window() -> None:
    # Window 1: a 60, b 20 (W_OUT 2 per output token): 40. Window 2: a 60, b 80: 20.
    assert W_OUT == 2
    even = service_difference(TWO_WINDOWS, weight=lambda t: 1.0, window=10.0)
    assert even == {"mean": pytest.approx(30.0), "max": pytest.approx(40.0), "windows": 2}
    # A weight divides what a tenant received: b at 0.5 counts 40 then 160 (gaps 20 and 100).
    weighted = service_difference(TWO_WINDOWS, weight=lambda t: 0.5 if t == "b" else 1.0, window=10.0)
    assert weighted == {"mean": pytest.approx(60.0), "max": pytest.approx(100.0), "windows": 2}


def test_service_difference_without_two_backlogged_tenants_has_no_windows() -> None:
    alone = [result("a", 0, 30, 31), result("b", 0, 0.1, 40)]
    assert service_difference(alone, weight=lambda t: 1.0, window=10.0) == {"mean": None, "max": None, "windows": 0}


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
    # Every gateway arm hashes prefixes in the engine's blocks; two replicas: the processor picks the endpoint.
    assert scenario.model == {"prefix": {"block_tokens": scenario.engine.block_size if scenario.engine else 0},
                              "endpoint_picking": True}
    assert SCENARIOS["prefix-share"].baseline == "direct-fifo"
    envoy = run("envoy", TWO_WINDOWS, {"queries": 1000.0, "hits": 100.0}, (500.0, 500.0))
    local = run("extproc-locality", TWO_WINDOWS[:3] + TWO_WINDOWS[5:], {"queries": 1000.0, "hits": 600.0}, (900.0, 100.0))
    summary = {r.arm: summarize(scenario, r, envoy, 21.0) for r in (envoy, local)}
    assert summary["envoy"]["throughput"]["requests_ratio"] == 1.0
    assert summary["extproc-locality"]["throughput"]["requests_ratio"] == pytest.approx(4 / 6, rel=0.1)
    assert summary["extproc-locality"]["locality"]["hit_rate"] == pytest.approx(0.6)
    arms = [a for a in ARMS if a.name in summary]
    text = "\n".join(scenario_markdown(scenario, arms, summary))
    assert "FIFO baseline (envoy)" in text and "0.600" in text and "0.90 / 0.10" in text and "prefix-share-2-locality.png" in text
    plot_locality(scenario, arms, summary, tmp_path / "locality.png")
    assert (tmp_path / "locality.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
