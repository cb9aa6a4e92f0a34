"""CI smoke run of ``extproc-dev bench --quick``: results are produced and sane (no performance claims)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ARMS = ("direct-fifo", "envoy", "extproc-rr", "extproc-vtc")


def quick_bench(tmp_path: Path, *args: str, timeout: float = 120) -> Path:
    """Run ``extproc-dev bench --quick ARGS`` into ``tmp_path/out`` (work folder ``tmp_path/work``); returns out."""
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-m", "extproc.tools", "bench", "--quick", *args, "--out", str(out),
         "--workdir", str(tmp_path / "work")],
        capture_output=True, text=True, timeout=timeout,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return out


def test_quick_bench_writes_sane_results(tmp_path: Path) -> None:
    """The default arms and the cluster arm (two processors and a Redis), in one run."""
    out = quick_bench(tmp_path, "--arms", ",".join((*ARMS, "cluster-rr")), timeout=180)
    results = json.loads((out / "results.json").read_text())
    scenario = results["scenarios"]["power-user"]
    assert tuple(scenario) == (*ARMS, "cluster-rr")
    for arm, summary in scenario.items():
        # Every request of every arm was answered in full, through the real Envoy and processor.
        assert summary["requests"] == summary["ok"] == 42, (arm, summary["errors"])
        rates = summary["throughput"]
        assert rates["tokens_per_s"] > 0 and rates["requests_per_s"] > 0
        for ratio in ("requests_ratio", "tokens_ratio", "horizon_tokens_ratio"):
            assert math.isfinite(rates[ratio]) and rates[ratio] > 0, (arm, ratio)
        assert summary["focus"]["ttft"]["p50"] > 0
        assert summary["engine"]["samples"] > 0
    assert scenario["direct-fifo"]["throughput"]["tokens_ratio"] == 1.0
    # Only the gateway with the processor reports a queue wait, and the engine's idle slots while it held requests.
    assert scenario["extproc-rr"]["focus"]["queue_wait"] is not None
    assert scenario["direct-fifo"]["focus"]["queue_wait"] is None
    assert scenario["direct-fifo"]["idle_while_held"] is None
    idle = scenario["extproc-rr"]["idle_while_held"]
    assert idle["held_s"] > 0 and 0 <= idle["slot_s"] and 0 <= idle["share"] < 1
    assert {row["arm"] for row in results["targets"]} >= {"extproc-rr"}

    summary_md = (out / "summary.md").read_text()
    assert "### power-user" in summary_md and all(arm in summary_md for arm in ARMS)
    assert "idle slot-s while held (% of the run)" in summary_md
    for kind in ("ttft", "waiting", "service"):
        png = out / f"power-user-{kind}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert png.stat().st_size < 150_000
    # Raw per-request data and every process's log stay in the work folder.
    raw = json.loads((tmp_path / "work" / "power-user" / "extproc-rr" / "raw.json").read_text())
    assert len(raw["requests"]) == 42
    # The cluster arm: every request was released once, by one instance or the other; each release cost Redis
    # round trips, and both instances and the Redis left their logs in the run's folder.
    figures = scenario["cluster-rr"]["processor"]
    assert figures["released"] == 42
    assert figures["round_trips_per_release"] > 0 and figures["round_trip_mean_ms"] > 0
    assert scenario["direct-fifo"]["processor"] is None
    assert "Redis round trips/release" in summary_md
    logs = {p.name for p in (tmp_path / "work" / "power-user" / "cluster-rr").iterdir()}
    assert any(name.startswith("redis-") for name in logs), logs


def test_quick_bench_runs_a_tiny_version_of_each_priority_scenario(tmp_path: Path) -> None:
    """batch-flood, steady-classes and batch-only, tiny: every figure they add is there and sane."""
    out = quick_bench(tmp_path, "--scenarios", "batch-flood,steady-classes,batch-only", timeout=180)
    results = json.loads((out / "results.json").read_text())
    scenarios = results["scenarios"]
    assert list(scenarios) == ["batch-flood", "steady-classes", "batch-only"]
    for name, arms in scenarios.items():
        for arm, summary in arms.items():
            assert summary["requests"] == summary["ok"] > 0, (name, arm, summary["errors"])

    flood = scenarios["batch-flood"]
    assert tuple(flood) == ("direct-fifo", "extproc-preempt")
    for arm, summary in flood.items():
        # The chats' unloaded reference ran on the same stack first; the flood's chats stopped with the batch.
        assert summary["focus_unloaded"]["ok"] > 0 and summary["focus_loaded"]["ok"] > 0, arm
        assert summary["slowdown"]["p99"] > 0 and 0 <= summary["focus_objective"]["share"] <= 1, arm
        figures = summary["batch"]
        assert figures["ok"] == figures["requests"] == 8 and figures["tokens"] == 8 * 48, arm
        assert figures["alone_tokens_per_s"] > 0 and math.isfinite(figures["capacity_ratio"]), arm
        assert figures["preemptions_per_request"] >= 0, arm
        assert summary["engine"]["samples"] > 0
    raw = json.loads((tmp_path / "work" / "batch-flood" / "direct-fifo" / "raw.json").read_text())
    assert set(raw["phases"]) == {"unloaded", "batch-alone"}

    classes = scenarios["steady-classes"]["extproc-preempt"]["classes"]
    assert set(classes) == {"interactive", "standard", "batch"}
    assert all(math.isfinite(c["ttft_ratio"]["p99"]) and c["tokens_ratio"] > 0 for c in classes.values())

    conserved = scenarios["batch-only"]
    assert tuple(conserved) == ("direct-fifo", "extproc-rr")
    gated = conserved["extproc-rr"]["conservation"]
    assert gated["makespan_ratio"] > 0 and gated["running_ratio"] > 0 and gated["held_s"] >= 0
    assert conserved["direct-fifo"]["conservation"]["held_s"] == 0

    targets = {row["target"] for row in results["targets"]}
    assert any("idle capacity" in t for t in targets) and any("batch-only makespan" in t for t in targets)
    summary_md = (out / "summary.md").read_text()
    for heading in ("### batch-flood", "### steady-classes", "### batch-only", "vs idle capacity",
                    "Each class against straight to the engine", "Work conservation"):
        assert heading in summary_md, heading


def test_quick_bench_runs_the_prefix_share_comparison_on_two_replicas(tmp_path: Path) -> None:
    """prefix-share-2, tiny, on two simulators with prefix caching: the locality figures are there and sane."""
    out = quick_bench(tmp_path, "--scenarios", "prefix-share-2", "--arms", "direct-fifo,envoy,extproc-locality",
                      timeout=180)
    arms = json.loads((out / "results.json").read_text())["scenarios"]["prefix-share-2"]
    assert tuple(arms) == ("direct-fifo", "envoy", "extproc-locality")
    for arm, summary in arms.items():
        assert summary["requests"] == summary["ok"] > 0, (arm, summary["errors"])
        locality = summary["locality"]
        # Both replicas' counters moved: the documents and chat histories were found again, the flood never.
        assert locality["queried_tokens"] > 0 and 0 < locality["hit_rate"] < 1, (arm, locality)
        difference = locality["service_difference"]
        assert difference["ticks"] == 19 and 0 <= difference["mean"] <= difference["max"], (arm, difference)
        assert set(summary["tenants"]) == {"rag", "chat", "flood"}
        # Every arm sent prompts to both replicas (direct: clients split; Envoy balancing; the processor picking).
        shares = locality["replica_shares"]
        assert len(shares) == 2 and min(shares) > 0 and sum(shares) == pytest.approx(1.0), (arm, shares)
    assert arms["envoy"]["throughput"]["requests_ratio"] == 1.0  # the baseline across replicas: Envoy alone
    summary_md = (out / "summary.md").read_text()
    assert "### prefix-share-2" in summary_md and "FIFO baseline (envoy)" in summary_md
    assert (out / "prefix-share-2-locality.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_quick_bench_replays_a_tiny_production_trace(tmp_path: Path) -> None:
    """--quick --trace: two seconds of the bundled Azure trace, a small flood, a window; every figure is there."""
    out = quick_bench(tmp_path, "--trace", timeout=120)
    results = json.loads((out / "results.json").read_text())
    arms = results["scenarios"]["trace"]
    assert tuple(arms) == ("direct-fifo", "direct-priority", "extproc-engine-priority")
    replay = results["replays"]["trace"]
    assert replay["utilisation"] == 0.87 and replay["offered_utilisation"] == pytest.approx(0.87)
    assert replay["time_factor"] > 0 and [f["kind"] for f in replay["files"]] == ["conv", "code"]
    assert replay["flood"]["tenant"] == "batchjob" and replay["window_s"] > replay["span_s"]
    for arm, summary in arms.items():
        trace = summary["trace"]
        assert set(trace["classes"]) == {"interactive", "standard", "batch"}, arm
        for cls, figures in trace["classes"].items():
            assert figures["requests"] == figures["answered"] + figures["not_answered"] > 0, (arm, cls)
            assert figures["not_answered"] == figures["cut_waiting"] + figures["cut_streaming"] + figures["failed"]
            assert figures["failed"] == 0, (arm, cls, summary["errors"])
            assert figures["tokens"] >= 0, (arm, cls)  # a class the window cut whole has none
        assert trace["tokens"] > 0 and math.isfinite(trace["tokens_vs_direct"]), arm
        assert trace["focus_reference"]["quiet_p99"] > 0
    assert arms["direct-fifo"]["idle_while_held"] is None
    idle = arms["extproc-engine-priority"]["idle_while_held"]
    assert idle["over_s"] == pytest.approx(replay["window_s"]) and 0 <= idle["share"] < 1
    # The processor's objective counters were read.
    assert arms["extproc-engine-priority"]["trace"]["classes"]["interactive"]["processor_met"] is not None
    # Each class's worst-served tenant, for the comparison with the engine's priority queue.
    assert all(c["worst_tenant"]["tenant"] for c in arms["direct-priority"]["trace"]["classes"].values())
    offered = arms["direct-fifo"]["trace"]["offered"]
    assert offered["expected"] == pytest.approx(0.87) and 0 < offered["measured"] <= 1
    raw = json.loads((tmp_path / "work" / "trace" / "direct-fifo" / "raw.json").read_text())
    assert set(raw["phases"]) == {"unloaded", "trace-alone"}
    summary_md = (out / "summary.md").read_text()
    for text in ("### trace", "Replayed: Azure LLM inference trace 2023", "idle slot-s while held (% of the window)",
                 "missed objective (client / processor)", "TTFT p99 vs quiet engine", "Offered load",
                 "Against straight to the engine's priority queue", "slots in use vs FIFO"):
        assert text in summary_md, text
    assert (out / "trace-ttft.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
