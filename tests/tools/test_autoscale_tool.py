"""``extproc-dev autoscale`` in small: a day of 24 s on the whole stack, engines started and stopped on the demand.

The full run (10 minutes, a peak of 4 engines) is the benchmark report's; this
one shows the loop closes: the simulated autoscaler, reading the processor's
demand series, starts engines from zero as the load rises and stops them all
once it is gone, and no request is lost on the way.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from extproc.tools.autoscale import Settings, arrivals, excess, simulate
from extproc.tools.autoscale_sim import simulate_in_time

# Engines of 8 sequences at 6 requests per second: at most 15 a second through the stack, light on 2 shared cores.
SMALL = Settings(minutes=0.4, quiet=0.5, peak=2.5, max_num_seqs=8, tokens=16, step_ms=80.0, engine_start_s=1.0,
                 sync_s=0.5, up_window_s=1.0, up_every_s=1.0, down_window_s=4.0, dns_refresh_s=0.2)


@pytest.mark.unit
def test_the_day_rises_to_its_peak_and_falls() -> None:
    load = [SMALL.load(t) for t in range(int(SMALL.day_s))]
    assert load[0] == SMALL.quiet and max(load) == pytest.approx(SMALL.peak, rel=0.01)
    times = [t for t, _, _ in arrivals(SMALL)]
    third = SMALL.day_s / 3
    middle = sum(third <= t < 2 * third for t in times)
    assert middle > 2 * sum(t < third for t in times)  # the peak's third gets the most
    assert SMALL.needed_engine_s() == sum(math.ceil(SMALL.load(s + 0.5)) for s in range(int(SMALL.day_s)))


@pytest.mark.unit
def test_the_engine_seconds_over_the_need_are_told_apart_second_by_second() -> None:
    day = Settings()  # quiet 0.25 -> 4 engines' capacity at noon -> quiet
    spans = {k: [s for s in range(int(day.day_s)) if day.needed_at(s) >= k] for k in range(1, 5)}
    exact = [(float(span[0]), span[-1] + 1.0) for span in spans.values()]
    assert excess(day, exact) == {"after_need": 0, "above_need": 0, "short": 0}
    (start, stop), rest = exact[1], exact[:1] + exact[2:]
    assert excess(day, [(start, stop + 30), *rest]) == {"after_need": 30, "above_need": 0, "short": 0}
    # Beyond the stop rule's 60 s the engine was not needed at all; a start 10 s late is short.
    assert excess(day, [(start + 10, stop + 80), *rest]) == {"after_need": 60, "above_need": 20, "short": 10}
    assert excess(day, [*exact, (290.0, 310.0)]) == {"after_need": 0, "above_need": 20, "short": 0}  # a 5th


@pytest.mark.unit
def test_the_day_in_simulated_time_follows_the_demand_and_repeats_exactly() -> None:
    run = simulate_in_time(SMALL)
    summary = run.summary()
    assert summary["requests"] > 100 and summary["lost"] == 0, summary
    assert summary["cold_start_requests"] > 0 and summary["most_engines"] >= 2 and run.scaled_to_zero
    assert summary["interactive_ttft_p99_s"] < summary["interactive_objective_s"]
    again = simulate_in_time(SMALL).summary()
    assert again == summary


@pytest.mark.integration
@pytest.mark.slow
async def test_engines_follow_the_demand_up_from_zero_and_back_to_zero_losing_nothing(tmp_path: Path) -> None:
    run = await simulate(SMALL, tmp_path)
    summary = run.summary()
    assert summary["requests"] > 100 and summary["lost"] == 0, summary
    assert summary["cold_start_requests"] > 0  # the first ones came before any engine
    assert summary["most_engines"] >= 2, run.timeline  # up with the peak...
    assert run.scaled_to_zero  # ...and back to zero
    assert summary["interactive_ttft_p99_s"] < summary["interactive_objective_s"]
