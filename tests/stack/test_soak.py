"""``extproc-dev soak`` in a short run: every kind of traffic and change happens, and every request ends.

The hour it is made for runs by hand (docs/reports/reliability.md); here 20
seconds show that the parts work together: the samples come, the report and
its plot are written, and when the traffic stops nothing is left held or in
flight.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from extproc.tools.soak import run_soak, write_report

pytestmark = pytest.mark.integration


async def test_a_short_soak_runs_every_kind_of_traffic_and_leaves_nothing_held(tmp_path: Path) -> None:
    soak = await run_soak(0.33, tmp_path / "work", sample_s=2)
    verdict = write_report(soak, tmp_path / "out")
    outcomes = soak.outcomes
    assert outcomes["stream:200"] > 0 and outcomes["burst:200"] > 0, outcomes
    assert outcomes["cancel:left mid-stream"] > 0 and outcomes["cancel:left while queued"] > 0, outcomes
    assert outcomes["budget:429"] > 0, outcomes  # carol and dave over their budgets
    assert outcomes["batch:completed"] >= 1 and outcomes["engine restarts"] >= 1, outcomes
    assert outcomes["reloads applied"] >= 2, outcomes
    last = soak.samples[-1]
    assert (last.in_flight, last.queued) == (0, 0)  # every request ended once the traffic stopped
    assert all(s.rss_mb > 0 and s.fds > 0 and s.tasks > 0 for s in soak.samples)
    assert any(s.queue_wait_p99_ms is not None for s in soak.samples)
    written = json.loads((tmp_path / "out" / "soak.json").read_text())
    assert written["verdict"] == json.loads(json.dumps(verdict)) and len(written["samples"]) == len(soak.samples)
    assert (tmp_path / "out" / "soak.png").stat().st_size > 10_000
