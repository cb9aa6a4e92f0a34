"""The benchmark report's targets table: the hop's cost beside the scheduling targets, and only what the run measured."""

from __future__ import annotations

from typing import Any

import pytest

from extproc.tools.bench.arms import ARMS, DIRECT
from extproc.tools.bench.held import HeldResult
from extproc.tools.bench.overhead import HeyRun, PathResult, summarize_overhead
from extproc.tools.bench.report import markdown, targets

pytestmark = pytest.mark.unit

META: dict[str, Any] = {
    "started": "2026-12-03T07:00:00", "wall_s": 150.0, "time_scale": 0.25, "engine": {"kind": "sim"},
    "machine": {"cpu": "AMD EPYC", "cores": 2, "loadavg_before": [0.4, 0.2, 0.1], "loadavg_after": [1.9, 0.9, 0.4]},
}


def _runs(rate: float, latency_s: float) -> tuple[HeyRun, ...]:
    return tuple(HeyRun(sent=int(rate), ok=int(rate), seconds=1.0, latencies_s=(latency_s,) * 3) for _ in range(2))


def _path(name: str, fixed_s: float, max_rate: float, cpu: dict[str, tuple[float, float]]) -> PathResult:
    return PathResult(name, _runs(300, fixed_s), _runs(max_rate, 0.02),
                      {p: fixed for p, (fixed, _) in cpu.items()}, {p: at_max for p, (_, at_max) in cpu.items()})


def _overhead(extproc_cpu_max: float = 582.0, kb: float = 6.5) -> dict[str, Any]:
    """The shape of the baseline run: 1,212 req/s against Envoy alone's 4,142, +1.5 ms at p50 (the hop's floor +0.4),
    6.5 KB per held."""
    paths = [
        _path("upstream", 0.0007, 6860, {}),
        _path("envoy", 0.0012, 4142, {"envoy": (673, 232)}),
        _path("envoy+null", 0.0016, 3200, {"envoy": (800, 350), "null": (245, 65)}),
        _path("envoy+extproc", 0.0027, 1212, {"envoy": (1024, 464), "extproc": (1338, extproc_cpu_max)}),
    ]
    held = HeldResult("builtin", 2000, 1999, rss_idle=70 * 2**20, rss_held=70 * 2**20 + round(kb * 1024 * 1999), cpu_s=0.8)
    return summarize_overhead(paths, [held])


def test_the_hop_s_figures_at_saturation_are_read_against_envoy_alone() -> None:
    summary = _overhead()
    assert summary["extproc_rate_vs_envoy"] == pytest.approx(1212 / 4142)
    assert summary["extproc_cpu_us_per_request_max"] == 582.0
    assert summary["extproc_cpu_us_per_request"] == 1338.0  # at the fixed rate
    assert summary["extproc_added_ms"]["p50"] == pytest.approx(1.5)


def test_overhead_only_lists_the_hop_s_four_targets_and_nothing_else() -> None:
    rows = targets({}, [], _overhead())
    assert [(r["arm"], round(r["value"], 2), r["met"]) for r in rows] == [
        ("envoy+extproc", 582.0, False),  # CPU per request at saturation <= 250 µs
        ("envoy+extproc", 0.29, False),  # rate >= 0.45 of Envoy alone's
        ("envoy+extproc", 1.1, False),  # added p50 <= the floor's (0.4 ms) + 0.2 ms
        ("builtin", 6.5, False),  # memory per held request <= 5 KB
    ]
    text = markdown(META, [], [], {}, _overhead())
    table = text.split("## Targets", 1)[1].split("##", 1)[0]
    assert "| processor CPU per request at saturation <= 250 µs | envoy+extproc | 582 µs (at 1,212 req/s; 1,338 µs " \
           "at 300 req/s) | **no** |" in table
    assert "| held-and-released rate >= 0.45 of Envoy alone's (max rate, same run) | envoy+extproc | 0.29 (1,212 vs " \
           "4,142 req/s) | **no** |" in table
    assert "| processor memory per held request <= 5 KB | builtin | 6.5 KB (1999 held) | **no** |" in table
    assert "–" not in table and table.count("\n| ") == 5  # the header and the four targets
    assert "Arms:" not in text and "simulator" not in text  # no scenario ran: no arms, no engine
    assert "after [1.9, 0.9, 0.4]" in text
    assert "(0.29 of Envoy alone's 4,142), using **582 µs** of processor CPU per request there and 1,338 µs at " \
           "300 req/s" in text


def test_a_hop_within_its_targets_meets_them() -> None:
    assert [r["met"] for r in targets({}, [], _overhead(extproc_cpu_max=240.0, kb=4.9))] == [True, False, False, True]


def test_a_run_without_the_overhead_benchmark_lists_no_hop_target() -> None:
    arm = next(a for a in ARMS if a.name == "extproc-rr")
    summaries = {"power-user": {
        DIRECT.name: {"focus": {"ttft": {"p50": 60.0}}},
        arm.name: {"focus": {"ttft": {"p50": 1.0}}, "throughput": {"horizon_tokens_ratio": 1.0},
                   "engine": {"waiting_max": 3}, "fairness": {"mean": 0.95}},
    }}
    rows = targets(summaries, [DIRECT, arm], None)
    assert [r["target"].split(" ")[0] for r in rows] == ["power-user", "throughput", "engine", "Jain"]
    assert all(r["arm"] == arm.name and r["value"] is not None for r in rows)


def test_a_target_whose_scenario_did_not_run_is_left_out() -> None:
    arm = next(a for a in ARMS if a.name == "extproc-rr")
    summaries = {"batch-only": {arm.name: {"engine": {"waiting_max": 3}}}}
    names = {r["target"] for r in targets(summaries, [DIRECT, arm], None)}
    assert not any("power-user" in n or "throughput (output tokens" in n for n in names)  # not measured here
    assert any(n.startswith("engine waiting max") for n in names)
