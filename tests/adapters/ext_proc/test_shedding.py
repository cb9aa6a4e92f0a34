"""Shedding under sustained overload, the lowest class present first: the decision, the lag's history, the servicer."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from hypothesis import given
from hypothesis import strategies as st

from extproc.adapters.config import parse_config
from extproc.adapters.ext_proc.loop_lag import LoopLag
from extproc.adapters.ext_proc.servicer import ACK_LAG_S, Processor
from extproc.adapters.ext_proc.shedding import ARRIVING_SHARE, SUSTAINED_SHARE, Shedding
from extproc.adapters.runtime import build_runtimes
from extproc.adapters.telemetry import Telemetry
from extproc.adapters.telemetry.model import DECISIONS
from tests.helpers.processor import LateLoop, Stream, headers_message

pytestmark = pytest.mark.unit

INTERACTIVE, STANDARD, BATCH = range(3)
TIMEOUT_S = 2.0
LATE_S = 0.05  # the probes' threshold in the LoopLag tests


def shedding(queued: dict[int, int] | None = None) -> Shedding:
    held = queued if queued is not None else {}
    return Shedding(3, TIMEOUT_S, lambda band: held.get(band, 0))


# The lag's history: one stall counts nothing once it is over; a run of late probes counts from its first.

def test_one_late_probe_then_one_on_time_is_no_run() -> None:
    lag = LoopLag(late_s=LATE_S)
    lag.record(10.0, 1.5)  # a stall of 1.5 s, measured as it ends
    assert lag.late_for(10.0) == 0.0  # the stall is over: the loop answers now
    lag.record(10.03, 0.01)
    assert lag.late_for(12.0) == 0.0


def test_a_run_of_late_probes_counts_from_the_first_one_firing() -> None:
    lag = LoopLag(late_s=LATE_S)
    for fired_at in (1.0, 1.3, 1.6, 1.9):
        lag.record(fired_at, 0.28)
    assert lag.late_for(2.0) == pytest.approx(1.0)
    lag.record(2.05, LATE_S / 2)  # caught up
    assert lag.late_for(2.1) == 0.0


def test_a_stall_after_a_run_continues_it_and_the_first_on_time_probe_ends_it() -> None:
    lag = LoopLag(late_s=LATE_S)
    lag.record(1.0, 0.2)
    lag.record(2.5, 1.3)
    assert lag.late_for(2.5) == pytest.approx(1.5)
    lag.record(2.55, 0.0)
    assert lag.late_for(2.55) == 0.0


async def test_the_probe_sees_a_stall_end_and_a_loop_that_stays_busy_as_a_run() -> None:
    lag = LoopLag(late_s=LATE_S)
    lag.start()
    loop = asyncio.get_running_loop()
    try:
        await asyncio.sleep(0.05)
        time.sleep(0.4)  # one stall
        await asyncio.sleep(0)
        assert lag.seconds(loop.time()) >= 0.3
        for _ in range(100):  # the loop is idle again: the next probes are on time (a loaded machine may need a few)
            await asyncio.sleep(0.05)
            if lag.late_for(loop.time()) == 0.0:
                break
        assert lag.late_for(loop.time()) == 0.0

        async def busy(until: float) -> None:  # no idle moment: each turn of the loop takes 80 ms
            while loop.time() < until:
                time.sleep(0.08)
                await asyncio.sleep(0)

        await busy(loop.time() + 0.6)
        assert lag.late_for(loop.time()) > 0.0
    finally:
        await lag.stop()


# The decision: when, and whom.

def test_overload_is_every_probe_late_for_half_the_message_timeout() -> None:
    shed = shedding()
    assert shed.sustained_s == SUSTAINED_SHARE * TIMEOUT_S == 1.0
    assert not shed.overloaded(0.99) and shed.overloaded(1.0)


def test_the_processor_counts_a_probe_late_from_the_lag_it_acknowledges_at() -> None:
    processor, _ = make()
    assert processor.lag.late_for(0.0) == 0.0
    processor.lag.record(1.0, ACK_LAG_S * 0.9)
    assert processor.lag.late_for(2.0) == 0.0
    for fired_at in (2.0, 2.2, 2.4, 2.6, 2.8, 3.0):
        processor.lag.record(fired_at, ACK_LAG_S)
    assert processor.shedding.overloaded(processor.lag.late_for(3.0))


def test_not_overloaded_nothing_is_shed_whatever_the_class() -> None:
    shed = shedding()
    assert not any(shed.arrived(band, 5.0, overloaded=False) for band in (BATCH, STANDARD, INTERACTIVE))


def test_the_lowest_class_arriving_goes_first_and_keeps_the_higher_ones_from_being_shed() -> None:
    shed = shedding()
    assert shed.arrived(BATCH, 5.0, overloaded=True)
    # batch is being shed: neither standard nor interactive is
    assert not shed.arrived(STANDARD, 5.1, overloaded=True)
    assert not shed.arrived(INTERACTIVE, 5.2, overloaded=True)
    assert shed.arrived(BATCH, 5.3, overloaded=True)
    # batch stopped arriving (and none is queued): standard is now the lowest present
    later = 5.3 + ARRIVING_SHARE * TIMEOUT_S + 0.01
    assert shed.arrived(STANDARD, later, overloaded=True)
    assert not shed.arrived(INTERACTIVE, later, overloaded=True)
    # an interactive request is shed only when it is the only class left
    alone = later + ARRIVING_SHARE * TIMEOUT_S + 0.01
    assert shed.arrived(INTERACTIVE, alone, overloaded=True)


def test_a_queued_lower_class_protects_every_higher_one_even_without_arrivals() -> None:
    queued = {BATCH: 3}
    shed = shedding(queued)
    assert not shed.arrived(INTERACTIVE, 100.0, overloaded=True)
    assert not shed.arrived(STANDARD, 100.0, overloaded=True)
    queued[BATCH] = 0
    queued[STANDARD] = 1
    assert not shed.arrived(INTERACTIVE, 100.0, overloaded=True)
    assert shed.arrived(STANDARD, 100.0, overloaded=True)


@given(
    band=st.integers(0, 2),
    queued=st.lists(st.integers(0, 2), min_size=3, max_size=3),
    ago=st.lists(st.one_of(st.none(), st.floats(0, 10)), min_size=3, max_size=3),
)
def test_an_arrival_is_shed_exactly_when_overloaded_and_no_lower_class_is_present(
    band: int, queued: list[int], ago: list[float | None]
) -> None:
    now = 100.0
    shed = shedding(dict(enumerate(queued)))
    for other, seconds in enumerate(ago):
        if seconds is not None:
            shed.arrived(other, now - seconds, overloaded=False)
    arriving = [seconds is not None and seconds <= ARRIVING_SHARE * TIMEOUT_S for seconds in ago]
    lower_present = any(queued[b] > 0 or arriving[b] for b in range(band + 1, 3))
    assert shed.arrived(band, now, overloaded=True) == (not lower_present)
    assert not shed.arrived(band, now, overloaded=False)


# The servicer: a class is decided before any reply under sustained overload, and counted.

def make(doc: dict[str, Any] | None = None) -> tuple[Processor, Telemetry]:
    config = parse_config(doc or {
        "models": [{"name": "m", "endpoints": ["http://127.0.0.1:1"], "gate": "static_rate", "release_rate": 0.001}],
    })
    telemetry = Telemetry()
    processor = Processor(config, build_runtimes(config, telemetry), telemetry)
    return processor, telemetry


def rejected(telemetry: Telemetry, reason: str, tenant: str) -> float:
    value = telemetry.registry.get_sample_value(
        "extproc_rejected_total", {"model": "m", "reason": reason, "tenant": tenant})
    return value or 0.0


async def test_overloaded_batch_is_shed_and_interactive_acknowledged_and_admitted_while_batch_is_queued() -> None:
    # While interactive requests arrive, one release is kept back for them (reserved_waiting): batch is held,
    # interactive goes.
    config = parse_config({"models": [{"name": "m", "endpoints": ["http://127.0.0.1:1"], "gate": "static_rate",
                                       "release_rate": 0.001, "reserved_waiting": 1}]})
    telemetry = Telemetry()
    runtimes = build_runtimes(config, telemetry)
    processor, dispatcher = Processor(config, runtimes, telemetry), runtimes["m"].dispatcher
    # A chat arrived a moment ago, while the pool had no engine, and its client left: it took no release.
    dispatcher.set_endpoints(())
    dispatcher.end(dispatcher.submit("t", 0))
    dispatcher.set_endpoints(("http://127.0.0.1:1",))
    queued = Stream(processor, headers_message(priority="batch"))
    assert (await queued.answers.get()).HasField("override_message_timeout")
    assert dispatcher.queued_in(2) == 1

    processor.lag = LateLoop(1.2, late_for_s=5.0)
    shed = Stream(processor, headers_message(priority="batch"))
    answer = await shed.answers.get()
    assert answer.immediate_response.status.code == 503, answer  # one reply: no acknowledgement before it
    assert json.loads(answer.immediate_response.body)["error"]["code"] == "overloaded"
    interactive = Stream(processor, headers_message(priority="interactive"))
    assert (await interactive.answers.get()).HasField("override_message_timeout")  # decided, then acknowledged
    assert (await interactive.answers.get()).HasField("request_headers")  # released: the rate's first
    assert dispatcher.queued_in(2) == 1
    # the shed request was counted with its tenant (bounded: "other"), as a refusal at the queue's door
    assert rejected(telemetry, "overloaded", "other") == 1
    shed_total = {band: telemetry.registry.get_sample_value("extproc_shed_total", {"model": "m", "priority": band})
                  for band in ("interactive", "standard", "batch")}
    assert shed_total == {"interactive": 0, "standard": 0, "batch": 1}  # every class's series, from zero
    for stream in (queued, shed, interactive):
        stream.task.cancel()
    await asyncio.sleep(0)
    assert dispatcher.queued == 0


async def test_a_shed_request_names_its_class_in_the_decision_log(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger=DECISIONS.name):
        processor, _ = make()  # the decision log is read once, as the dispatchers are built
        processor.lag = LateLoop(1.2, late_for_s=5.0)
        stream = Stream(processor, headers_message(priority="batch"))
        assert (await stream.answers.get()).HasField("immediate_response")
    [line] = [r for r in caplog.records if r.name == DECISIONS.name]
    assert (line.__dict__["class"], line.__dict__["outcome"]) == ("batch", "refused:overloaded")


async def test_a_downgraded_request_is_shed_by_the_class_it_is_granted() -> None:
    processor, _ = make({
        "models": [{"name": "m", "endpoints": ["http://127.0.0.1:1"], "gate": "static_rate", "release_rate": 0.001}],
        "tenants": {"alice": {"priorities": ["batch"], "default_priority": "batch"}},
    })
    processor.lag = LateLoop(1.2, late_for_s=5.0)
    processor.shedding.arrived(1, asyncio.get_running_loop().time(), overloaded=False)  # standard is arriving too
    stream = Stream(processor, headers_message(tenant="alice", priority="interactive"))  # granted batch
    assert (await stream.answers.get()).immediate_response.status.code == 503


def _epp_first(priority: str | None) -> pb.ProcessingRequest:
    headers = [(":method", "POST"), (":path", "/v1/chat/completions"), ("x-tenant-id", "t")]
    return pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(
            headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers])),
        protocol_config=pb.ProtocolConfiguration(request_body_mode=2),  # BUFFERED
    )


async def test_attached_by_ext_proc_alone_the_body_priority_is_read_before_the_class_is_decided() -> None:
    processor, _ = make()
    processor.lag = LateLoop(1.2, late_for_s=5.0)
    processor.shedding.arrived(2, asyncio.get_running_loop().time(), overloaded=False)  # batch is arriving
    for priority, shed in (("interactive", False), ("batch", True)):
        stream = Stream(processor, _epp_first(priority))
        assert (await stream.answers.get()).HasField("request_headers")  # the gateway's go-ahead for the body
        body = json.dumps({"model": "m", "priority": priority}).encode()
        stream.send(pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)))
        if shed:
            answer = (await stream.answers.get()).immediate_response
            assert answer.status.code == 429  # endpoint_picker.shed_status
        else:  # released (the rate's first): the Endpoint Picker's answer to the body message
            assert (await stream.answers.get()).HasField("request_body")
        stream.task.cancel()
    await asyncio.sleep(0)
