"""The release side (load estimate, health, release rules, picking, band rules) and the metrics reader, without I/O."""

from __future__ import annotations

import pytest

from extproc.adapters.envoy.routes import ENGINE_RETRY_MAX_S
from extproc.adapters.protocol.dialects import MetricsError, parse_load
from extproc.core.bands import PEAK_S, Band, BandAllowance, Reservation
from extproc.core.release import RULES
from extproc.core.release.adaptive_limit import DECREASE, QUIET_S, REFUSAL_HOLD_S, ConcurrencyLimit, ItlWindow
from extproc.core.release.answer import Answer
from extproc.core.release.estimate import LoadEstimate
from extproc.core.release.health import EndpointHealth
from extproc.core.release.pool import Pool
from extproc.core.release.rule import ReleaseRule
from extproc.core.release.unconfirmed import UnconfirmedEnds
from extproc.core.values.engine_load import EngineLoad
from tests.helpers.gate import make_gate

pytestmark = pytest.mark.unit

# Every registered rule that reads the engines' metrics must keep the engine's queue short when they lag.
METRIC_RULES = sorted(name for name, rule in RULES.items() if rule.uses_metrics)

# The shape of a vLLM v1 /metrics page (HELP/TYPE lines, model_name + engine labels).
VLLM_TEXT = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="demo-llama"} 7.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="demo-llama"} 2.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="demo-llama"} 0.25
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="demo-llama"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="demo-llama"} 3.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="demo-llama"} 3.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="demo-llama"} 0.4
"""


def test_parse_vllm_exposition() -> None:
    assert parse_load("vllm", VLLM_TEXT, "demo-llama") == EngineLoad(waiting=2.0, running=7.0, kv_usage=0.25)


def test_other_models_samples_are_not_ours() -> None:
    with pytest.raises(MetricsError, match="demo-qwen"):
        parse_load("vllm", VLLM_TEXT, "demo-qwen")


@pytest.mark.parametrize(
    "text",
    [
        "",
        "<html>502 Bad Gateway</html>",
        "vllm:num_requests_waiting{model_name=\"demo-llama\"} not-a-number\n",
        VLLM_TEXT.replace("} 2.0", "} NaN"),
        VLLM_TEXT.replace("} 2.0", "} -1"),
    ],
)
def test_garbage_is_an_error_not_a_number(text: str) -> None:
    with pytest.raises(MetricsError):
        parse_load("vllm", text, "demo-llama")


@pytest.mark.parametrize("kind", sorted(RULES))
def test_the_pool_hands_out_none_of_its_pieces(kind: str) -> None:
    """Whoever holds the pool asks it questions: no public name of it is its load estimate, endpoint health, rule or
    unconfirmed ends, so none of them is reached into from outside (and each can change without its readers)."""
    pool = make_gate(kind=kind, max_in_flight=2, release_rate=1.0)
    pool.record_scrape("e1", EngineLoad(waiting=0, running=1), started_at=0.0)
    pieces = (LoadEstimate, EndpointHealth, ReleaseRule, UnconfirmedEnds)
    assert [name for name in dir(pool) if not name.startswith("_") and isinstance(getattr(pool, name), pieces)] == []
    assert any(isinstance(value, pieces) for value in vars(pool).values())  # it has them: the check above can fail


def band_allowance(gate: Pool, now: float, *, reserve: int = 0, idle_share: float | None = None,
                   firm: bool = True) -> int:
    """What a band below the first (with ``reserve``), or an idle-only band (``idle_share``), may release now;
    ``firm``: what it holds keeps its slot to the end once released (streams), else it can be taken back."""
    bands = (Band("first", 60.0), Band("lower", 60.0),
             Band("idle", 60.0, idle_only=True, idle_running_share=idle_share or 1.0))
    allowances = BandAllowance(bands, gate, reserved_waiting=reserve, held=lambda band: 0,
                              firm=lambda band: int(firm))
    allowances.arrived(0, now)  # the bands above arrive now: the lower band leaves the reserve,
    allowances.arrived(1, now)  # the idle-only band takes free slots only
    return allowances.allowance(1 if idle_share is None else 2, now)


def test_without_metrics_the_gate_falls_back_to_a_small_in_flight_ceiling() -> None:
    gate = make_gate(fallback=4)
    assert gate.degraded(0.0)
    for i in range(4):
        assert gate.allowance(0.0) == 4 - i
        gate.record_release(i, 0.0)
    assert gate.allowance(0.0) == 0  # never release everything...
    gate.record_finish(0, 1.0)
    assert gate.allowance(1.0) == 1  # ...never stop all traffic


def test_releases_count_until_they_finish_whatever_a_lagging_scrape_shows() -> None:
    gate = make_gate(target=3)
    gate.record_scrape("e1", EngineLoad(waiting=0, running=0), started_at=10.0)
    assert gate.allowance(10.0) == 3
    for i in range(3):
        gate.record_release(i, 10.01)
    assert gate.allowance(10.02) == 0  # overshoot impossible between scrapes
    # Scrapes that do not show them yet, however late: they are still counted.
    for i, t in enumerate((10.1, 10.3, 10.5)):  # (a live page: something else moves on it)
        gate.record_scrape("e1", EngineLoad(waiting=0, running=0, kv_usage=0.01 * i), started_at=t)
        assert gate.allowance(t) == 0
    # Seen at last (admitted to the batch, no queue): the limit grows by target.
    gate.record_scrape("e1", EngineLoad(waiting=0, running=3), started_at=10.6)
    assert gate.allowance(10.6) == 3
    gate.record_finish(0, 10.7)
    assert gate.allowance(10.7) == 4  # a finish is refilled at once


@pytest.mark.parametrize("kind", METRIC_RULES)
def test_a_lagging_page_never_lets_in_flight_exceed_the_limit(kind: str) -> None:
    """The overshoot real vLLM showed: the page lags 50-400 ms behind what was sent.

    An engine with a batch of 4 whose /metrics show each request 0.3 s after it
    is sent, scraped every 0.1 s; requests take 1 s. Whatever the scrapes say,
    the engine's true waiting queue stays at target.
    """
    gate = make_gate(target=3, kind=kind)
    lag, batch, length = 0.3, 4, 1.0
    sent: dict[int, float] = {}
    next_id, worst = 0, 0
    for step in range(100):
        now = step * 0.1
        for request, at in list(sent.items()):
            if now - at >= length + lag:  # finished (running since it became visible)
                gate.record_finish(request, now)
                del sent[request]
        visible = sum(1 for at in sent.values() if now - at >= lag)
        gate.record_scrape("e1", EngineLoad(waiting=max(0, visible - batch), running=min(visible, batch)), now)
        for _ in range(gate.allowance(now)):
            gate.record_release(next_id, now)
            sent[next_id] = now
            next_id += 1
        worst = max(worst, len(sent) - batch)
    assert next_id > 20  # it kept releasing
    assert worst <= 3  # the true waiting queue, not the lagging page's


def test_traffic_around_the_gateway_counts_once_the_page_shows_it() -> None:
    gate = make_gate(target=3)
    gate.record_scrape("e1", EngineLoad(waiting=0, running=0), started_at=0.0)
    gate.record_scrape("e1", EngineLoad(waiting=2, running=4), started_at=0.1)  # learned: batch 4
    assert gate.snapshot("e1").limit == 7 and gate.allowance(0.1) == 1
    for i in range(2):
        gate.record_release(i, 0.2)
    # The page holds our 2 and 5 that are not ours: all 7 count.
    gate.record_scrape("e1", EngineLoad(waiting=3, running=4), started_at=0.5)
    assert gate.allowance(0.5) == 0
    gate.record_finish(0, 0.6)
    gate.record_finish(1, 0.6)
    assert gate.allowance(0.6) == 2  # ours left; the 5 others still count


def test_finishes_after_a_snapshot_free_a_waiting_slot() -> None:
    gate = make_gate(target=3)
    gate.record_scrape("e1", EngineLoad(waiting=0, running=0), started_at=0.0)
    for i in range(3):
        gate.record_release(i, 1.0)
    gate.record_scrape("e1", EngineLoad(waiting=3, running=8), started_at=2.0)
    assert gate.allowance(2.0) == 0
    gate.record_finish(0, 2.1)  # its slot goes to the head of the engine's queue
    assert gate.allowance(2.1) == 1
    gate.record_scrape("e1", EngineLoad(waiting=2, running=8), started_at=2.2)
    assert gate.allowance(2.2) == 1  # the new snapshot agrees; not counted twice


def test_stale_metrics_mean_fallback() -> None:
    gate = make_gate(fallback=2)
    gate.record_scrape("e1", EngineLoad(waiting=0, running=0), started_at=0.0)
    assert not gate.degraded(0.5)
    assert gate.degraded(1.5)
    assert gate.allowance(1.5) == 2
    gate.record_scrape("e1", None, started_at=1.5)  # failing scrape
    assert gate.degraded(1.6)


def test_a_pool_is_healthy_only_when_every_endpoint_is() -> None:
    gate = make_gate(endpoints=("e1", "e2"), target=3, fallback=4)
    gate.record_scrape("e1", EngineLoad(waiting=1, running=0), started_at=0.0)
    assert gate.allowance(0.0) == 8  # fallback: 4 per endpoint
    gate.record_scrape("e2", EngineLoad(waiting=2, running=0), started_at=0.0)
    assert gate.scraped_load() == EngineLoad(waiting=3, running=0)
    assert gate.allowance(0.0) == 3  # target 3 per endpoint, 3 already waiting


# --- the adaptive controller -------------------------------------------------------


def test_itl_window_is_the_mean_of_recent_tokens_only() -> None:
    window = ItlWindow(window_s=1.0)
    window.add(0.0, total_s=100.0, count=1000)  # a long history at 100 ms a token...
    assert window.value() is None
    window.add(0.5, total_s=100.5, count=1050)
    assert window.value() == pytest.approx(0.01)  # ...does not count: 10 ms a token now
    window.add(1.5, total_s=101.5, count=1060)
    window.add(2.0, total_s=102.0, count=1070)
    assert window.value() == pytest.approx(1.5 / 20)  # the window slid past t=0.5
    window.add(2.5, total_s=0.2, count=10)  # engine restarted: counters reset
    assert window.value() is None
    window.add(3.0, total_s=0.4, count=20)
    assert window.value() == pytest.approx(0.02)


def test_the_limit_learns_capacity_from_the_engine_queue() -> None:
    limit = ConcurrencyLimit(3, target_waiting=3)
    limit.observe(EngineLoad(waiting=0, running=3), at=0.1)  # ran all we allowed: probe upward
    assert limit.limit == 6
    limit.observe(EngineLoad(waiting=0, running=6), at=0.2)
    assert limit.limit == 9
    limit.observe(EngineLoad(waiting=2, running=7), at=0.3)  # full at 7: capacity 7 + a queue of 3
    assert limit.limit == 10
    limit.observe(EngineLoad(waiting=0, running=2), at=0.4)  # demand fell: no evidence, no change
    assert limit.limit == 10
    limit.observe(EngineLoad(waiting=6, running=4), at=0.5)  # capacity fell (KV): follow at once
    assert limit.limit == 7


def test_a_burst_never_cuts_the_limit_below_what_the_engine_ran_at_once() -> None:
    """A page that catches a burst mid-step (16 slots, 3 running, 9 waiting) is not the engine's capacity."""
    limit = ConcurrencyLimit(3, target_waiting=3)
    for at, running in ((0.1, 3), (0.2, 6), (0.3, 9), (0.4, 12), (0.5, 15), (0.6, 16)):
        limit.observe(EngineLoad(waiting=0, running=running), at=at)
    limit.observe(EngineLoad(waiting=2, running=16), at=0.7)
    assert limit.limit == 19
    limit.observe(EngineLoad(waiting=9, running=3), at=0.8)
    assert limit.limit == 16  # at least the 16 it has run at once
    told = ConcurrencyLimit(3 + 16, target_waiting=3, floor=16)  # max_running: 16
    told.observe(EngineLoad(waiting=9, running=3), at=0.1)
    assert told.limit == 16


def test_a_cut_limit_recovers_once_the_queue_drains_whether_or_not_the_gate_fills_it() -> None:
    limit = ConcurrencyLimit(3 + 16, target_waiting=3, floor=16)
    limit.observe(EngineLoad(waiting=9, running=3), at=0.1)
    assert limit.limit == 16
    # The engine drained; the gate sends little (a lower class held back): the limit returns all the same.
    limit.observe(EngineLoad(waiting=0, running=4), at=0.2, held=4)
    assert limit.limit == 19
    # Near a ceiling it returns by one a scrape, not at once; past one it is cut.
    slow = ConcurrencyLimit(3 + 16, target_waiting=3, floor=16, max_kv_usage=0.9)
    slow.observe(EngineLoad(waiting=9, running=3, kv_usage=0.6), at=0.1)
    slow.observe(EngineLoad(waiting=0, running=4, kv_usage=0.6), at=0.2, held=4)
    assert slow.limit == 17


def limit_after(gate: Pool, load: EngineLoad, at: float) -> float:
    """The limit of endpoint e1 once a scrape that started at ``at`` returned ``load``."""
    gate.record_scrape("e1", load, started_at=at)
    limit = gate.snapshot("e1").limit
    assert limit is not None
    return limit


def test_the_engine_refusing_at_its_own_queue_cap_cuts_the_limit_until_the_refusals_stop() -> None:
    """vLLM's admission_rejections_total rising: multiplicative decrease, no growth while it rises, and back at the
    line QUIET_S after it stops (a burst around the gateway is over), whatever the lagging pages show."""
    gate = make_gate(max_running=4, itl_window_s=1.0)
    assert limit_after(gate, EngineLoad(waiting=3, running=4, rejected=0), 0.0) == 7
    # Something around the gateway filled the engine to its cap of 8 and it refused two requests. Its pages lag
    # (vLLM's: 50-400 ms), and never show it holding as much as the line while the gate holds back.
    assert gate.record_scrape("e1", EngineLoad(waiting=2, running=4, rejected=2), started_at=0.1) == 2  # cut from 6
    assert gate.snapshot("e1").limit == pytest.approx(6 * DECREASE)
    # It refuses more (the gateway's retry of a request it refused): within the window, one cut; no growth meanwhile.
    assert limit_after(gate, EngineLoad(waiting=2, running=4, rejected=3), 0.5) == pytest.approx(6 * DECREASE)
    # The refusals are over: rule 2 would grow the limit to the line, but only once QUIET_S passed without one.
    assert limit_after(gate, EngineLoad(waiting=2, running=4, rejected=3), 0.5 + QUIET_S - 0.1) == pytest.approx(6 * DECREASE)
    assert limit_after(gate, EngineLoad(waiting=2, running=4, rejected=3), 0.5 + QUIET_S) == 7
    assert QUIET_S < REFUSAL_HOLD_S
    # A lower count is a restarted engine, not a refusal; neither is the first page seen.
    fresh = make_gate(max_running=4)
    assert fresh.record_scrape("e1", EngineLoad(waiting=3, running=4, rejected=50), started_at=0.0) == 0
    assert fresh.record_scrape("e1", EngineLoad(waiting=3, running=4, rejected=0), started_at=0.1) == 0
    assert fresh.snapshot("e1").limit == 7


def test_the_quiet_after_a_refusal_outlasts_the_gateways_back_off_between_retries() -> None:
    """Envoy retries a request the engine refused as full: a retry refused again within the back-off is the same
    round of refusals, not a new one that would hold the limit for REFUSAL_HOLD_S."""
    assert QUIET_S >= ENGINE_RETRY_MAX_S


def test_refusals_that_come_again_once_the_limit_could_grow_cut_it_and_hold_it() -> None:
    """An engine capped at 6, below 4 running + target_waiting 3: the gate's own sends meet its cap. The limit grows
    back once the first refusals stop, meets the cap again, and is cut again at once (within the window) and held
    for REFUSAL_HOLD_S."""
    gate = make_gate(max_running=4, itl_window_s=5.0)
    assert limit_after(gate, EngineLoad(waiting=2, running=4, rejected=0), 0.0) == 7
    assert gate.record_scrape("e1", EngineLoad(waiting=2, running=4, rejected=1), started_at=0.1) == 1
    assert gate.snapshot("e1").limit == pytest.approx(6 * DECREASE)
    assert limit_after(gate, EngineLoad(waiting=2, running=4, rejected=1), 0.1 + QUIET_S) == 7
    again = 0.2 + QUIET_S
    assert again - 0.1 < 5.0  # within the window of the first cut
    assert gate.record_scrape("e1", EngineLoad(waiting=2, running=4, rejected=2), started_at=again) == 1
    assert gate.snapshot("e1").limit == pytest.approx(6 * DECREASE)
    for at in (again + 0.1, again + QUIET_S, again + REFUSAL_HOLD_S / 2, again + REFUSAL_HOLD_S - 0.1):
        assert limit_after(gate, EngineLoad(waiting=1, running=4, rejected=2), at) == pytest.approx(6 * DECREASE)
    assert limit_after(gate, EngineLoad(waiting=1, running=4, rejected=2), again + REFUSAL_HOLD_S) == 7
    # Refusals long after the last start afresh: back at the line once they stop.
    late = again + 3 * REFUSAL_HOLD_S
    assert gate.record_scrape("e1", EngineLoad(waiting=2, running=4, rejected=3), started_at=late) == 1
    assert limit_after(gate, EngineLoad(waiting=2, running=4, rejected=3), late + QUIET_S) == 7


def test_refusals_of_traffic_around_the_gateway_are_not_held_as_the_gates_own_doing() -> None:
    """A burst's second part finds the engine holding more than the limit (the requests of the first part it took
    in): a new round of refusals, cut and over QUIET_S later, not the gate's sends meeting the cap."""
    gate = make_gate(max_running=4, itl_window_s=5.0)
    assert limit_after(gate, EngineLoad(waiting=3, running=4, rejected=0), 0.0) == 7
    assert gate.record_scrape("e1", EngineLoad(waiting=4, running=4, rejected=3), started_at=0.1) == 3
    assert limit_after(gate, EngineLoad(waiting=4, running=4, rejected=3), 0.1 + QUIET_S) == 7
    second = 0.2 + QUIET_S
    assert gate.record_scrape("e1", EngineLoad(waiting=4, running=4, rejected=6), started_at=second) == 3
    assert gate.snapshot("e1").limit == pytest.approx(7 * DECREASE)
    assert limit_after(gate, EngineLoad(waiting=4, running=4, rejected=6), second + QUIET_S) == 7
    # Nor is a release answered "full" while the gate held clearly less than its limit (5 of 7: the engine was full
    # of traffic around the gateway its pages did not show yet).
    third = second + 2 * QUIET_S
    for request in range(5):
        gate.record_release(request, third - 0.3)
    assert limit_after(gate, EngineLoad(waiting=1, running=4, rejected=6), third - 0.2) == 7
    gate.record_response(None, Answer.FULL, third)
    assert gate.snapshot("e1").limit == pytest.approx(5 * DECREASE)  # from what it held: ours, in a pool of one
    assert limit_after(gate, EngineLoad(waiting=1, running=4, rejected=6), third + QUIET_S) == 7


def test_a_page_older_than_a_refusal_does_not_undo_its_cut() -> None:
    """A release answered "full" between a scrape's start and its arrival: that page tells nothing of what came after
    the refusal, and cannot grow the limit back."""
    limit = ConcurrencyLimit(4 + 3, target_waiting=3, floor=4)
    limit.refused(at=5.0, held=7)
    limit.observe(EngineLoad(waiting=3, running=4), at=4.95)
    assert limit.limit == pytest.approx(7 * DECREASE)
    limit.observe(EngineLoad(waiting=3, running=4), at=5.0 + QUIET_S)
    assert limit.limit == 7


def test_a_refusal_never_cuts_the_limit_below_what_the_engine_was_seen_running() -> None:
    """The second cut of a round of refusals (the window passed), from a page that shows the engine holding its batch
    only: ×0.8 of 4 would leave the batch a slot short; the engine ran 4 within its cap, so 4 it is."""
    limit = ConcurrencyLimit(4 + 3, target_waiting=3, itl_window_s=1.0)
    limit.observe(EngineLoad(waiting=3, running=4), at=0.0)
    limit.refused(at=0.1, held=8)
    assert limit.limit == pytest.approx(7 * DECREASE)
    limit.refused(at=1.2, held=4)
    assert limit.limit == 4


def test_a_refusal_never_reads_a_lagging_page_as_an_empty_engine() -> None:
    limit = ConcurrencyLimit(4 + 3, target_waiting=3, floor=4)
    limit.refused(at=0.0, held=0)  # a release answered "full" by an engine the last page showed empty
    assert limit.limit == pytest.approx(4 * DECREASE)


def test_an_itl_ceiling_cuts_the_limit_once_per_window_and_only_if_it_is_to_blame() -> None:
    limit = ConcurrencyLimit(20, target_waiting=3, max_itl_s=0.05, itl_window_s=1.0)
    limit.observe(EngineLoad(0, 17, itl_sum=0.0, itl_count=0), at=0.0)
    limit.observe(EngineLoad(0, 20, itl_sum=8.0, itl_count=100), at=0.5)  # 80 ms a token
    assert limit.pressure == pytest.approx(1.6)
    assert limit.limit == pytest.approx(16)  # x0.8
    limit.observe(EngineLoad(0, 20, itl_sum=16.0, itl_count=200), at=0.7)
    assert limit.limit == pytest.approx(16)  # still running 20 > 16: the old batch, not the limit
    limit.observe(EngineLoad(0, 16, itl_sum=24.0, itl_count=300), at=1.0)
    assert limit.limit == pytest.approx(16)  # within the cooldown
    limit.observe(EngineLoad(0, 16, itl_sum=32.0, itl_count=400), at=1.6)
    assert limit.limit == pytest.approx(12.8)
    # Near the ceiling the probe slows to +1; far below it, +target.
    limit.observe(EngineLoad(0, 13, itl_sum=36.0, itl_count=500), at=2.0)  # 40 ms: 80 % of the ceiling
    assert limit.limit == pytest.approx(14)
    limit.observe(EngineLoad(0, 14, itl_sum=36.5, itl_count=1000), at=2.4)  # 7.5 ms
    assert limit.limit == pytest.approx(17)


def test_a_kv_ceiling_cuts_the_limit() -> None:
    limit = ConcurrencyLimit(10, target_waiting=3, max_kv_usage=0.8)
    limit.observe(EngineLoad(0, 10, kv_usage=0.95), at=0.0)
    assert limit.limit == pytest.approx(8)
    limit.observe(EngineLoad(0, 8, kv_usage=0.75), at=3.0)  # 94 % of the ceiling: hold
    assert limit.limit == pytest.approx(8)


def test_adaptive_learns_capacity_the_waiting_rule_never_sees() -> None:
    adaptive, waiting = make_gate(), make_gate(kind="waiting_target")
    for gate in (adaptive, waiting):
        gate.record_scrape("e1", EngineLoad(waiting=0, running=10), started_at=0.0)
        gate.record_scrape("e1", EngineLoad(waiting=0, running=10), started_at=0.1)
        for i in range(gate.allowance(0.1)):
            gate.record_release(i, 0.1)
        gate.record_scrape("e1", EngineLoad(waiting=0, running=10 + gate.in_flight), started_at=0.2)
        assert gate.allowance(0.2) == 3
        for i in range(100, 103):
            gate.record_release(i, 0.2)
        gate.record_finish(0, 0.3)
        assert gate.allowance(0.3) == 1  # a slot freed: refilled at once
    # The engine ran all 15 without a queue: the adaptive limit grows past what it saw...
    for gate in (adaptive, waiting):
        gate.record_scrape("e1", EngineLoad(waiting=0, running=15), started_at=0.4)
    assert adaptive.allowance(0.4) == 3 and adaptive.snapshot("e1").limit == 18
    assert waiting.allowance(0.4) == 3  # ...the waiting rule only ever target beyond it
    for gate in (adaptive, waiting):
        for i in range(200, 203):
            gate.record_release(i, 0.4)
        gate.record_scrape("e1", EngineLoad(waiting=0, running=18), started_at=0.5)
    assert adaptive.snapshot("e1").limit == 21 and adaptive.allowance(0.5) == 3
    assert waiting.allowance(0.5) == 3


def test_bypass_traffic_in_the_engine_queue_stops_releases_at_the_next_scrape() -> None:
    gate = make_gate()
    gate.record_scrape("e1", EngineLoad(waiting=0, running=8), started_at=0.0)
    assert gate.allowance(0.0) > 0
    gate.record_scrape("e1", EngineLoad(waiting=12, running=8), started_at=0.1)  # someone went around us
    assert gate.allowance(0.1) == 0


@pytest.mark.parametrize("kind", ["static_concurrency", "static_rate"])
def test_static_variants_ignore_metrics(kind: str) -> None:
    gate = make_gate(kind=kind, max_in_flight=2, release_rate=10.0)
    gate.record_scrape("e1", EngineLoad(waiting=50, running=50), started_at=0.0)
    assert not gate.degraded(0.0)
    assert gate.allowance(0.0) == (2 if kind == "static_concurrency" else 1)
    gate.record_release("a", 0.0)
    if kind == "static_rate":
        assert gate.allowance(0.0) == 0
        assert gate.next_change_in(0.0) == pytest.approx(0.1)
        assert gate.allowance(0.1) == 1
    else:
        assert gate.allowance(0.0) == 1
        assert gate.next_change_in(0.0) is None


def test_a_degraded_endpoint_keeps_half_of_what_it_last_ran() -> None:
    gate = make_gate(fallback=4)
    gate.record_scrape("e1", EngineLoad(waiting=3, running=40), started_at=0.0)
    gate.record_scrape("e1", None, started_at=0.1)  # failing from now on
    assert gate.degraded(0.1) == ("e1",)
    assert gate.fallback_limit("e1") == 20
    assert gate.allowance(0.1) == 20
    gate.record_scrape("e1", EngineLoad(waiting=0, running=20), started_at=0.5)  # recovers by itself
    assert gate.degraded(0.5) == ()


def test_a_frozen_page_goes_stale_although_it_still_answers() -> None:
    gate = make_gate(fallback=4)
    frozen = EngineLoad(waiting=0, running=2, itl_sum=1.0, itl_count=10)
    gate.record_scrape("e1", frozen, started_at=0.0)
    gate.record_scrape("e1", frozen, started_at=0.5)  # idle engine: an unchanged page is fine
    assert not gate.degraded(1.4)
    gate.record_release("a", 1.4)
    for t in (1.5, 2.0, 2.3):
        gate.record_scrape("e1", frozen, started_at=t)  # a page may lag up to stale_after_s (1 s)
    assert not gate.degraded(2.3)
    for t in (2.5, 3.0, 3.5):
        gate.record_scrape("e1", frozen, started_at=t)  # work was sent long ago, yet nothing moves
    assert gate.degraded(3.5)
    gate.record_scrape("e1", EngineLoad(waiting=0, running=3, itl_sum=1.1, itl_count=11), started_at=3.6)
    assert not gate.degraded(3.6)


def test_picking_keeps_a_key_on_its_endpoint_within_bounded_load() -> None:
    gate = make_gate(endpoints=("e1", "e2"), pick=True)
    for e in ("e1", "e2"):
        gate.record_scrape(e, EngineLoad(waiting=2, running=10), started_at=0.0)  # capacity 10: limit 13
        gate.record_scrape(e, EngineLoad(waiting=0, running=2), started_at=0.1)  # 8 batch slots free
    favourite = gate.ranked("alice", 0.1)[0]
    assert gate.ranked("alice", 0.1)[0] == favourite
    other = "e2" if favourite == "e1" else "e1"
    picks = []
    for i in range(gate.allowance(0.1)):
        endpoint, *fallbacks = gate.ranked("alice", 0.1)
        assert fallbacks == [e for e in ("e1", "e2") if e != endpoint]
        picks.append(endpoint)
        gate.record_release(i, 0.1, endpoint)
    # alice stays on her engine (its prefix cache is warm there) until it has `target` more
    # requests than the other; then the load is kept within that bound.
    assert picks[:4] == [favourite] * 4 and picks[4] == other and len(picks) == 22
    for n in range(len(picks)):
        assert 0 <= picks[:n].count(favourite) - picks[:n].count(other) <= 4
    assert picks.count(favourite) == picks.count(other) == 11
    assert gate.allowance(0.1) == 0
    gate.record_finish(picks.index(other), 0.2)
    assert gate.endpoint_room(other, 0.2) == 1 and gate.endpoint_room(favourite, 0.2) == 0


def test_endpoints_can_join_and_leave_the_pool() -> None:
    gate = make_gate(endpoints=("e1",), fallback=4)
    gate.record_scrape("e1", EngineLoad(waiting=0, running=0), started_at=0.0)
    gate.set_endpoints(("e1", "e2"))
    assert gate.degraded(0.0) == ("e2",)  # a newcomer is capped until scraped
    assert gate.allowance(0.0) == 8
    gate.record_scrape("e2", EngineLoad(waiting=0, running=0), started_at=0.0)
    gate.set_endpoints(("e2",))
    gate.record_scrape("e1", EngineLoad(waiting=0, running=0), started_at=0.1)  # late scrape of a leaver
    assert not gate.degraded(0.1) and gate.allowance(0.1) == 3
# --- bands: reserve and idle-only ---------------------------------------------------------


def test_lower_bands_leave_the_reserve_to_the_first() -> None:
    gate = make_gate(target=3, fallback=4)
    gate.record_scrape("e1", EngineLoad(waiting=2, running=8), started_at=0.0)
    assert gate.allowance(0.0) == 1
    assert band_allowance(gate, 0.0, reserve=1) == 0
    assert band_allowance(gate, 5.0, reserve=1) == 3  # stale: fallback ceiling less the reserve


@pytest.mark.parametrize("kind", ["adaptive", "waiting_target"])
def test_an_idle_only_band_fills_free_slots_and_stops_at_a_queue(kind: str) -> None:
    gate = make_gate(target=3, kind=kind, max_running=8)
    # The engine was seen full once (8 running, a queue): the adaptive limit is 8 + 3.
    gate.record_scrape("e1", EngineLoad(waiting=2, running=8), started_at=-1.0)
    gate.record_scrape("e1", EngineLoad(waiting=0, running=2), started_at=0.0)
    # 6 free, of which 3 (35 % of 8, to the nearest slot) are kept for the bands above, which have work now, from
    # streams; work that can be taken back takes all 6.
    assert band_allowance(gate, 0.0, reserve=0, idle_share=1.0) == 3
    assert band_allowance(gate, 0.0, reserve=0, idle_share=1.0, firm=False) == 6
    assert band_allowance(gate, 0.0, reserve=0, idle_share=0.5) == 2
    for i in range(3):
        gate.record_release(i, 0.01, into_free_slot=True)
    # Sized to free slots: not counted as waiting, so the bands above keep their allowance (the limit of 11 less
    # the 5 held; the target of 3 waiting, none waiting).
    assert gate.allowance(0.02) == (6 if kind == "adaptive" else 3)
    assert band_allowance(gate, 0.02, reserve=0, idle_share=1.0) == 0
    gate.record_scrape("e1", EngineLoad(waiting=1, running=5), started_at=0.2)
    assert band_allowance(gate, 0.2, reserve=0, idle_share=1.0) == 0  # not idle: a queue
    gate.record_finish(0, 0.3)  # the waiting one takes the freed slot: 5 of 8 in use, the reserve left free
    assert band_allowance(gate, 0.3, reserve=0, idle_share=1.0) == 0
    gate.record_finish(1, 0.4)
    assert band_allowance(gate, 0.4, reserve=0, idle_share=1.0) == 1


def test_an_idle_only_band_keeps_free_what_the_bands_above_were_seen_to_need() -> None:
    """The free slots kept for the bands above: 35 % of the capacity, or enough to go back to their recent peak and
    one more, whichever is more; at least one, at most half the capacity."""
    reservation = Reservation(3)
    assert reservation.slots(2, 16) == 6  # 35 % of 16, to the nearest slot
    assert reservation.slots(2, 4) == 1
    assert reservation.slots(2, 1) == 1  # at least one, however small the engine
    assert reservation.slots(2, 16, share=0.1) == 2 and reservation.slots(2, 16, share=0.0) == 1  # the band's setting
    for _ in range(6):
        reservation.released(0, 0.0)
    assert reservation.slots(2, 16) == 6  # they hold 6: room for their peak and one more is 1
    for _ in range(3):
        reservation.finished(0, 0.1)
    assert reservation.slots(2, 16) == 6  # 3 held, back to 6 and one more: 4
    for _ in range(3):
        reservation.finished(0, 0.1)
    assert reservation.slots(2, 16) == 7  # none held: back to the peak of 6, and one
    assert reservation.slots(2, 10) == 5  # at most half the engine
    assert reservation.slots(1, 16) == 7  # for the middle band too: its band above
    reservation.released(1, 0.2)
    assert reservation.slots(1, 16) == 7 and reservation.above(2) == 1 and reservation.above(1) == 0
    reservation.finished(1, 0.2 + 3 * PEAK_S)  # decayed as requests come and go, not by time alone
    assert reservation.slots(2, 16) == 6  # the peak decays back to the share


def test_an_idle_only_band_probes_for_the_engine_size() -> None:
    gate = make_gate(target=3)
    now, released = 0.0, 0
    sizes = []
    capacity = 6  # the engine runs at most 6; more wait
    for _ in range(6):
        running = min(released, capacity)
        gate.record_scrape("e1", EngineLoad(waiting=released - running, running=running), started_at=now)
        grant = band_allowance(gate, now, reserve=0, idle_share=1.0)
        sizes.append(grant)
        for _ in range(grant):
            gate.record_release(released, now, into_free_slot=True)
            released += 1
        now += 0.1
    # Doubling, by at most target (3) a scrape, until the engine first queues (1, 1, 2, 3 -> 7 > 6);
    # then it waits for the queue to clear.
    assert sizes == [1, 1, 2, 3, 0, 0]


def test_an_idle_only_band_keeps_a_slot_for_the_others_without_metrics() -> None:
    gate = make_gate(target=3, fallback=3)
    assert band_allowance(gate, 0.0, reserve=0, idle_share=1.0) == 2
    gate.record_release("a", 0.0)
    assert band_allowance(gate, 0.0, reserve=2, idle_share=1.0) == 0


def test_a_known_batch_size_starts_the_adaptive_limit_there() -> None:
    learned, told = make_gate(), make_gate(max_running=64)
    for gate in (learned, told):
        gate.record_scrape("e1", EngineLoad(waiting=0, running=0), started_at=0.0)
    assert learned.allowance(0.0) == 3
    assert told.allowance(0.0) == 67


def test_only_rules_with_per_endpoint_state_pick_endpoints() -> None:
    for name, rule in RULES.items():
        if rule.per_endpoint:
            make_gate(("e1", "e2"), kind=name, pick=True, max_in_flight=2)
        else:
            with pytest.raises(ValueError, match="does not pick endpoints"):
                make_gate(("e1", "e2"), kind=name, pick=True, release_rate=1.0)


def test_with_endpoint_picking_the_pool_estimate_adds_up_per_endpoint() -> None:
    """Ours are counted per endpoint, so each endpoint's foreign part is its own scrape less its own ours."""
    estimate = LoadEstimate(("e1", "e2"), stale_after_s=1.0, per_endpoint=True)
    for i, endpoint in enumerate(("e1", "e1", "e2", "e2")):
        estimate.record_release(i, 0.0, endpoint, into_free_slot=False)
    estimate.record_scrape("e1", EngineLoad(waiting=0, running=2), started_at=0.5)
    estimate.record_scrape("e2", EngineLoad(waiting=0, running=3), started_at=0.5)  # one not ours
    assert estimate.now("e1").held == 2 and estimate.now("e2").held == 3
    assert estimate.now().held == 5  # not 4 ours + (5 - the larger endpoint's 2)
