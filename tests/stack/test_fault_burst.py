"""Bursts through real Envoy (generated config), the real processor and the simulator.

A gate that releases nothing holds every admitted request until its queue
timeout, so each request ends in exactly one answer the client can read: the
one released request's 200, or a JSON error with ``x-extproc-reason``
(queue_timeout, overloaded; processor_unavailable for a stream that outran
the message timeout). A *bare* answer (Envoy's own 504/503, or none) is what
these tests forbid; which of the ``overloaded`` answers Envoy's admission
bucket gave, its admin counter says. Counts and bounds only: no timing
assertions.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

from extproc.adapters.ext_proc.loop_lag import LoopLag
from extproc.core.values.outcomes import Refusal
from extproc.tools.burst import BurstReport, bucket_shed, burst_and_hold, holding_config
from extproc.tools.stack import start_stack
from tests.helpers.processor import LateLoop, Stream, headers_message, make_processor
from tests.waitutil import eventually

SIM = ["--max-num-seqs", "1"]


def _answered_once(report: BurstReport, n: int) -> None:
    """Each request got one answer the client can read: none bare, all the JSON error or a response."""
    assert len(report.answers) == n
    assert report.bare == [], report.counts()
    # Envoy's own overloaded answers (the admission bucket) are JSON too, through local_reply_config.
    assert report.not_json == [], report.counts()


@pytest.mark.integration
@pytest.mark.alone
async def test_a_burst_within_the_default_bucket_is_all_let_through_to_the_processor(tmp_path: Path) -> None:
    """2,000 at once, fewer than the default bucket holds (what the processor takes in within the message
    timeout): Envoy sheds none of it, whatever the machine's load; the processor holds it (or, starved,
    sheds some itself, by class)."""
    n = 2_000
    config = holding_config(tmp_path, hold_s=8, max_queued=n)
    async with await start_stack(config, tmp_path, sim_args=SIM) as stack:
        report, _ = await burst_and_hold(stack, n, settle_s=1.5)
        by_bucket = await bucket_shed(stack)
    _answered_once(report, n)
    assert by_bucket == 0, report.counts()
    assert report.counts()[(503, "queue_timeout")] > 0, report.counts()


@pytest.mark.integration
@pytest.mark.alone
async def test_a_burst_far_beyond_the_bucket_is_shed_by_envoy_as_json_overloaded(tmp_path: Path) -> None:
    """A bucket of 200 (100 a second) and 1,500 at once: Envoy sheds the excess itself, at once, as JSON;
    what it lets through is held, and no stream outruns the message timeout."""
    n = 1_500
    config = holding_config(tmp_path, hold_s=8, max_queued=n,
                            envoy={"admission_burst": 200, "admission_per_second": 100})
    async with await start_stack(config, tmp_path, sim_args=SIM) as stack:
        report, _ = await burst_and_hold(stack, n, settle_s=1.5)
        by_bucket = await bucket_shed(stack)
    _answered_once(report, n)
    assert report.missed == [], report.counts()
    counts = report.counts()
    # What was not held was shed on purpose, by the bucket, and said so.
    assert by_bucket >= n // 2 and counts[(503, "overloaded")] == by_bucket, (by_bucket, counts)
    assert counts[(503, "queue_timeout")] + counts[(200, "")] == n - by_bucket, counts
    assert counts[(503, "queue_timeout")] >= 200 - 1, counts  # the bucket's burst was taken in and held


@pytest.mark.integration
@pytest.mark.alone
@pytest.mark.slow
async def test_ten_thousand_at_once_each_answered_once_never_bare(tmp_path: Path) -> None:
    """Beyond what the processor takes in within the message timeout, Envoy's admission bucket sheds: no 504."""
    n = 10_000
    config = holding_config(tmp_path, hold_s=10, max_queued=n)
    async with await start_stack(config, tmp_path, sim_args=SIM) as stack:
        report, _ = await burst_and_hold(stack, n)
        by_bucket = await bucket_shed(stack)
    _answered_once(report, n)
    assert report.counts()[(503, "queue_timeout")] >= 1_000, report.counts()
    assert by_bucket > 0


@pytest.mark.integration
@pytest.mark.alone
@pytest.mark.slow
async def test_ten_thousand_held_each_answered_once_within_the_memory_bound(tmp_path: Path) -> None:
    """At most 10 KB per held request, 10,000 held under 200 MB (the measured figures: docs/reports/reliability.md)."""
    n = 10_000
    # Held until the figures are read, not much longer (the test waits out the hold): the 13 waves take 12 s
    # and the queue is read once it has not grown for 3 s (measured: all held 13.5 s in, read at 16.5 s).
    config = holding_config(tmp_path, hold_s=24, max_queued=n)
    async with await start_stack(config, tmp_path, sim_args=SIM) as stack:
        # 800 a second: within the admission bucket's refill, so every one is held.
        report, held = await burst_and_hold(stack, n, wave=800)
    assert len(report.answers) == n
    assert report.bare == [], report.counts()
    assert held.held >= 0.9 * n
    assert held.processor_per_held <= 10 * 1024, held
    assert held.processor_held < 200 * 2**20, held


@pytest.mark.unit
async def test_the_lag_probe_sees_a_blocked_loop_before_its_own_timer_fires() -> None:
    """The shed decision cannot wait for the late probe to run: an overdue probe already counts."""
    lag = _Counted()
    lag.start()
    loop = asyncio.get_running_loop()
    # A probe has fired on time, so the next one is pending.
    await eventually(lambda: lag.fired > 0 and lag.seconds(loop.time()) < 0.2, what="a probe on time")
    time.sleep(0.3)  # the loop is blocked: the probe is overdue
    assert lag.seconds(loop.time()) >= 0.25
    await lag.stop()


class _Counted(LoopLag):
    """Counts the probes that fired: the test waits for one, not for a time it hopes is long enough."""

    def __init__(self) -> None:
        super().__init__()
        self.fired = 0

    def record(self, fired_at: float, late_s: float) -> None:
        self.fired += 1
        super().record(fired_at, late_s)


@pytest.mark.unit
async def test_late_for_long_a_new_stream_is_shed_as_json_overloaded_and_never_queued() -> None:
    processor, dispatcher = make_processor()
    processor.lag = LateLoop(10.0, late_for_s=10.0)
    answer = (await Stream(processor, headers_message()).answers.get()).immediate_response
    headers = {h.header.key: h.header.raw_value.decode() for h in answer.headers.set_headers}
    assert answer.status.code == 503 and headers["x-extproc-reason"] == Refusal.OVERLOADED.value
    assert headers["retry-after"] == "1" and json.loads(answer.body)["error"]["code"] == "overloaded"
    assert dispatcher.queued == 0 and dispatcher.in_flight == 0


@pytest.mark.unit
async def test_far_behind_once_a_new_stream_is_acknowledged_and_decided_not_shed() -> None:
    """One stall, however long, is over once measured: the acknowledgement costs no more than a refusal."""
    processor, dispatcher = make_processor()
    processor.lag = LateLoop(10.0)
    stream = Stream(processor, headers_message())
    assert (await stream.answers.get()).HasField("override_message_timeout")
    assert (await stream.answers.get()).HasField("request_headers")  # released (fallback limit 1)
    stream.task.cancel()
    await asyncio.sleep(0)


@pytest.mark.unit
async def test_somewhat_behind_a_stream_is_acknowledged_before_it_is_decided() -> None:
    processor, dispatcher = make_processor()
    processor.lag = LateLoop(0.2)
    first = Stream(processor, headers_message())
    assert (await first.answers.get()).HasField("override_message_timeout")  # before admission
    assert (await first.answers.get()).HasField("request_headers")  # then released (fallback limit 1)
    second = Stream(processor, headers_message())
    assert (await second.answers.get()).HasField("override_message_timeout")
    await asyncio.sleep(0)
    assert dispatcher.queued == 1 and second.answers.empty()  # held, and acknowledged only once
    for stream in (first, second):
        stream.task.cancel()
    await asyncio.sleep(0)
