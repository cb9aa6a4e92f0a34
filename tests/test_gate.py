"""The release gate and the metrics reader, without I/O."""

from __future__ import annotations

import pytest

from extproc.engine_metrics import MetricsError, parse_load
from extproc.gate import VISIBILITY_GRACE_S, EngineLoad, Gate, GateMode

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
    assert parse_load("vllm", VLLM_TEXT, "demo-llama") == EngineLoad(waiting=2.0, running=7.0)


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


def make_gate(endpoints: tuple[str, ...] = ("e1",), target: int = 3, fallback: int = 4) -> Gate:
    return Gate(endpoints, target_waiting=target, fallback_max_in_flight=fallback, stale_after_s=1.0)


def test_without_metrics_the_gate_falls_back_to_a_small_in_flight_ceiling() -> None:
    gate = make_gate(fallback=4)
    assert gate.mode(0.0) is GateMode.FALLBACK
    for i in range(4):
        assert gate.allowance(0.0) == 4 - i
        gate.record_release(i, 0.0)
    assert gate.allowance(0.0) == 0  # never release everything...
    gate.record_finish(0, 1.0)
    assert gate.allowance(1.0) == 1  # ...never stop all traffic


def test_releases_count_as_waiting_until_a_scrape_can_see_them() -> None:
    gate = make_gate(target=3)
    gate.record_scrape("e1", EngineLoad(waiting=0, running=10), started_at=10.0)
    assert gate.allowance(10.0) == 3
    for i in range(3):
        gate.record_release(i, 10.01)
    assert gate.allowance(10.02) == 0  # overshoot impossible between scrapes
    # A scrape started right after the releases may not contain them yet: still counted.
    gate.record_scrape("e1", EngineLoad(waiting=0, running=10), started_at=10.02)
    assert gate.allowance(10.03) == 0
    # A later scrape sees them (they were admitted to the batch): room again.
    gate.record_scrape("e1", EngineLoad(waiting=0, running=13), started_at=10.01 + VISIBILITY_GRACE_S + 0.01)
    assert gate.allowance(10.1) == 3


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
    assert gate.mode(0.5) is GateMode.METRICS
    assert gate.mode(1.5) is GateMode.FALLBACK
    assert gate.allowance(1.5) == 2
    gate.record_scrape("e1", None, started_at=1.5)  # failing scrape
    assert gate.mode(1.6) is GateMode.FALLBACK


def test_a_pool_is_healthy_only_when_every_endpoint_is() -> None:
    gate = make_gate(endpoints=("e1", "e2"), target=3, fallback=4)
    gate.record_scrape("e1", EngineLoad(waiting=1, running=0), started_at=0.0)
    assert gate.allowance(0.0) == 8  # fallback: 4 per endpoint
    gate.record_scrape("e2", EngineLoad(waiting=2, running=0), started_at=0.0)
    assert gate.engine_load() == EngineLoad(waiting=3, running=0)
    assert gate.allowance(0.0) == 3  # target 3 per endpoint, 3 already waiting


# --- bands: reserve and idle-only ---------------------------------------------------------


def test_lower_bands_leave_the_reserve_to_the_first() -> None:
    gate = make_gate(target=3, fallback=4)
    gate.record_scrape("e1", EngineLoad(waiting=2, running=8), started_at=0.0)
    assert gate.allowance(0.0) == 1
    assert gate.allowance(0.0, reserve=1) == 0
    assert gate.allowance(5.0, reserve=1) == 3  # stale: fallback ceiling less the reserve


def test_an_idle_only_band_fills_free_slots_and_stops_at_a_queue() -> None:
    gate = make_gate(target=3)
    gate.record_scrape("e1", EngineLoad(waiting=0, running=2), started_at=0.0)
    assert gate.idle_allowance(0.0, share=1.0, reserve=0, max_running=8) == 6
    assert gate.idle_allowance(0.0, share=0.5, reserve=0, max_running=8) == 2
    for i in range(6):
        gate.record_release(i, 0.01, into_free_slot=True)
    # Sized to free slots: not counted as waiting, so the bands above keep their allowance.
    assert gate.allowance(0.02) == 3
    assert gate.idle_allowance(0.02, share=1.0, reserve=0, max_running=8) == 0
    gate.record_scrape("e1", EngineLoad(waiting=1, running=7), started_at=0.2)
    assert gate.idle_allowance(0.2, share=1.0, reserve=0, max_running=8) == 0  # not idle: a queue
    gate.record_finish(0, 0.3)  # the waiting one takes the freed slot: 7 of 8 in use
    assert gate.idle_allowance(0.3, share=1.0, reserve=0, max_running=8) == 1


def test_an_idle_only_band_probes_for_the_engine_size() -> None:
    gate = make_gate(target=3)
    now, released = 0.0, 0
    sizes = []
    capacity = 6  # the engine runs at most 6; more wait
    for _ in range(6):
        running = min(released, capacity)
        gate.record_scrape("e1", EngineLoad(waiting=released - running, running=running), started_at=now)
        grant = gate.idle_allowance(now, share=1.0, reserve=0, max_running=None)
        sizes.append(grant)
        for _ in range(grant):
            gate.record_release(released, now, into_free_slot=True)
            released += 1
        now += 0.1
    # Doubling until the engine first queues (1, 1, 2, 4 -> 8 > 6), then it waits for the queue to clear.
    assert sizes == [1, 1, 2, 4, 0, 0]


def test_an_idle_only_band_keeps_a_slot_for_the_others_without_metrics() -> None:
    gate = make_gate(target=3, fallback=3)
    assert gate.idle_allowance(0.0, share=1.0, reserve=0, max_running=None) == 2
    gate.record_release("a", 0.0)
    assert gate.idle_allowance(0.0, share=1.0, reserve=2, max_running=None) == 0
