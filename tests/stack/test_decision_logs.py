"""The decision log: one line per request's outcome, as text or JSON.

The unit tests feed the core's events straight into a model's telemetry and
read the lines both formatters write. The integration test runs ``--log-format
json --log-level debug`` on the real stack: the lines come from ``extproc
serve`` as a child process, behind a real Envoy, so they show what an
operator's log pipeline receives.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from extproc.adapters.logs import TEXT_FORMAT, JsonFormatter
from extproc.adapters.telemetry import ModelTelemetry, Telemetry, TenantLabels
from extproc.adapters.telemetry.model import DECISIONS
from extproc.core.values.outcomes import Refusal
from extproc.core.values.report import RequestEvent, Step
from extproc.tools.power_user import chat
from extproc.tools.stack import start_stack
from tests.stackutil import TENANT_KEYS, write_config

# One request's steps each, as the core reports them after QUEUED.
OUTCOMES = (
    RequestEvent(Step.RELEASED, "interactive", "bob", waited_s=0.12, slack_s=4.88),  # its class's 5 s objective
    RequestEvent(Step.RELEASED, "batch", "alice", waited_s=2.5),  # no objective: no slack in its line
    RequestEvent(Step.REFUSED, "standard", "carol", waited_s=61.0, refusal=Refusal.QUEUE_TIMEOUT, slack_s=-1.0),
    RequestEvent(Step.PREEMPTED, "batch", "alice", waited_s=0.8, refusal=Refusal.PREEMPTED),  # 0.8 s after release
    RequestEvent(Step.RELEASED, "batch", "bob", waited_s=0.3, tag="batch_abc/7"),  # a batch line (its runner's tag)
)


@pytest.fixture
def decisions() -> Iterator[tuple[io.StringIO, io.StringIO]]:
    """The decision lines at DEBUG, as text and as JSON (the logger's level restored after)."""
    text, lines = io.StringIO(), io.StringIO()
    handlers = [logging.StreamHandler(text), logging.StreamHandler(lines)]
    handlers[0].setFormatter(logging.Formatter(TEXT_FORMAT))
    handlers[1].setFormatter(JsonFormatter())
    level = DECISIONS.level
    DECISIONS.setLevel(logging.DEBUG)
    for handler in handlers:
        DECISIONS.addHandler(handler)
    try:
        yield text, lines
    finally:
        for handler in handlers:
            DECISIONS.removeHandler(handler)
        DECISIONS.setLevel(level)


@pytest.mark.unit
def test_each_outcome_has_one_line_with_its_slack_and_a_preemption_its_own(
    decisions: tuple[io.StringIO, io.StringIO],
) -> None:
    text, lines = decisions
    report = ModelTelemetry(Telemetry(), "m1", ("interactive", "standard", "batch"), TenantLabels(()))
    for event in OUTCOMES:
        report(event)
    assert [line.split(": ", 1)[1] for line in text.getvalue().splitlines()] == [
        "released m1 tenant=bob class=interactive wait_ms=120.0 slack_ms=4880.0",
        "released m1 tenant=alice class=batch wait_ms=2500.0",
        "refused:queue_timeout m1 tenant=carol class=standard wait_ms=61000.0 slack_ms=-1000.0",
        # Its time is how long it had run since its release (the work thrown away), not a queue wait.
        "preempted m1 tenant=alice class=batch ran_ms=800.0",
        "released m1 tenant=bob class=batch wait_ms=300.0 batch_line=batch_abc/7",
    ]
    entries = [json.loads(line) for line in lines.getvalue().splitlines()]
    fields = [{k: v for k, v in e.items() if k not in ("ts", "level", "logger", "msg")} for e in entries]
    assert fields == [
        {"tenant": "bob", "class": "interactive", "model": "m1", "wait_ms": 120.0, "outcome": "released",
         "slack_ms": 4880.0},
        {"tenant": "alice", "class": "batch", "model": "m1", "wait_ms": 2500.0, "outcome": "released"},
        {"tenant": "carol", "class": "standard", "model": "m1", "wait_ms": 61000.0, "outcome": "refused:queue_timeout",
         "slack_ms": -1000.0},
        {"tenant": "alice", "class": "batch", "model": "m1", "ran_ms": 800.0, "outcome": "preempted"},
        {"tenant": "bob", "class": "batch", "model": "m1", "wait_ms": 300.0, "outcome": "released",
         "batch_line": "batch_abc/7"},
    ]
    # The JSON line's message is the text line's.
    assert [e["msg"] for e in entries] == [line.split(": ", 1)[1] for line in text.getvalue().splitlines()]
    assert {(e["level"], e["logger"]) for e in entries} == {("debug", "extproc.decisions")}


FAST_SIM = ["--max-num-seqs", "2", "--step-ms", "20", "--time-scale", "0.1"]


@pytest.mark.integration
async def test_each_request_through_envoy_gets_one_json_decision_line(tmp_path: Path) -> None:
    config = write_config(tmp_path, gate="static_concurrency", max_in_flight=2)
    serve_args = ["--log-format", "json", "--log-level", "debug"]
    sent = {"alice": 6, "bob": 2}
    async with await start_stack(config, tmp_path, sim_args=FAST_SIM, serve_args=serve_args) as stack:
        async with aiohttp.ClientSession() as session:
            outcomes = await asyncio.gather(*(
                chat(session, stack.envoy_url, tenant, "m1", api_key=TENANT_KEYS[tenant], max_tokens=5,
                     extra_headers={"x-priority": "batch" if tenant == "alice" else "interactive"})
                for tenant, count in sent.items() for _ in range(count)
            ))
    assert all(o.status == 200 for o in outcomes), outcomes
    lines = [json.loads(line) for line in (tmp_path / "extproc.log").read_text().splitlines()]
    decisions = [d for d in lines if d["logger"] == "extproc.decisions"]
    assert {t: sum(d["tenant"] == t for d in decisions) for t in sent} == sent
    assert {(d["tenant"], d["class"]) for d in decisions} == {("alice", "batch"), ("bob", "interactive")}
    assert all(d["outcome"] == "released" and d["model"] == "m1" and d["level"] == "debug" for d in decisions)
    # Two slots for eight requests: some waited in the queue, and their wait is in the line.
    assert max(float(d["wait_ms"]) for d in decisions) > 0
    # Batch has no objective by default: its lines carry no slack; interactive ones (5 s) do.
    assert not [d for d in decisions if d["class"] == "batch" and "slack_ms" in d]
    assert all("slack_ms" in d for d in decisions if d["class"] == "interactive")
    # Every line of the log is JSON (the loop above would have raised), the start-up line included.
    assert any(d["logger"] == "extproc.adapters.server" and d["msg"].startswith("serving") for d in lines)
