"""One model's runtime at the edge: a reload updates it in place, readers see it live, the budgets' gate around the
submit settles a request once."""

from __future__ import annotations

import calendar
from typing import Any

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.adapters.budgets.gate import BudgetGate
from extproc.adapters.config import Config, parse_config
from extproc.adapters.ext_proc.attach.own_envoy import OwnEnvoy
from extproc.adapters.protocol.contract import HOLD_MARGIN_S
from extproc.adapters.request.admission import Admission
from extproc.adapters.runtime import Dispatchers, ModelRuntime, build_runtimes
from extproc.adapters.telemetry import Telemetry
from extproc.adapters.wiring import tenant_labels

pytestmark = pytest.mark.unit

NOON = float(calendar.timegm((2026, 12, 3, 12, 0, 0)))


def config(**model: Any) -> Config:
    return parse_config({"models": [{"name": "m", "endpoints": ["http://127.0.0.1:1"], **model}]})


def test_a_reload_that_keeps_the_model_updates_its_one_runtime_in_place() -> None:
    before = config(max_queue_wait_s=10)
    runtime = build_runtimes(before, Telemetry())["m"]
    dispatcher, report = runtime.dispatcher, runtime.report
    assert runtime.signer is None
    assert runtime.hold_reply.override_message_timeout.seconds == 10 + HOLD_MARGIN_S
    after = config(max_queue_wait_s=20, prefix={"block_tokens": 16})
    runtime.update(after, after.models[0], tenant_labels(after))
    assert (runtime.dispatcher, runtime.report) == (dispatcher, report)  # what it holds stays where it is
    assert runtime.model is after.models[0]
    assert runtime.signer is not None  # the new settings' parts, rebuilt
    assert runtime.hold_reply.override_message_timeout.seconds == 20 + HOLD_MARGIN_S


def test_the_dispatchers_view_reads_the_runtimes_as_a_reload_changes_them() -> None:
    cfg = config()
    telemetry = Telemetry()
    runtimes = build_runtimes(cfg, telemetry)
    view = Dispatchers(runtimes)
    assert list(view) == ["m"] and view["m"] is runtimes["m"].dispatcher
    runtimes["m"] = ModelRuntime(cfg, cfg.models[0], telemetry)  # rebuilt
    assert view["m"] is runtimes["m"].dispatcher
    del runtimes["m"]  # removed
    assert "m" not in view and len(view) == 0


def test_the_engine_priority_is_the_class_s_as_the_engines_order_it() -> None:
    on = config(engine_priority=True)
    runtime = build_runtimes(on, Telemetry())["m"]
    assert [runtime.engine_priority(b) for b in range(len(on.bands))] == [b.engine_priority for b in on.bands]
    off = config(engine_priority=False)
    assert build_runtimes(off, Telemetry())["m"].engine_priority(0) is None


async def test_the_gate_settles_a_request_once_however_often_its_end_is_told() -> None:
    cfg = parse_config({"models": [{"name": "m", "endpoints": ["http://127.0.0.1:1"]}],
                        "budgets": {"tenants": {"default": {"requests_per_minute": 10}}}})
    assert cfg.budgets is not None
    runtime = build_runtimes(cfg, Telemetry())["m"]
    gate = BudgetGate(cfg.budgets, len(cfg.bands) - 1, clock=lambda: NOON)
    first = pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=":path", raw_value=b"/v1/chat/completions")])))
    stream = OwnEnvoy(cfg).open(first, None)

    def used() -> float:
        return sum(s.used for s in gate.budgets.standings(NOON) if s.limit == "requests_per_minute")

    assert await gate.enter(Admission("m", "t", 1), stream, runtime.dispatcher, 480) == Admission("m", "t", 1)
    assert stream.ticket is not None and used() == 1  # reserved before the submit
    gate.leave(stream, None)  # refused before it was queued: nothing charged
    gate.leave(stream, None)
    assert stream.ticket is None and used() == 0
