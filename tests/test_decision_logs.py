"""``--log-format json --log-level debug`` on the real stack: one decision line per request through Envoy.

The lines come from ``extproc serve`` as a child process, behind a real
Envoy, so they show what an operator's log pipeline receives.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import pytest

from extproc.tools.power_user import chat
from extproc.tools.stack import start_stack
from tests.stackutil import TENANT_KEYS, write_config

pytestmark = pytest.mark.integration

FAST_SIM = ["--max-num-seqs", "2", "--step-ms", "20", "--time-scale", "0.1"]


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
    # Every line of the log is JSON (the loop above would have raised), the start-up line included.
    assert any(d["logger"] == "extproc.adapters.server" and d["msg"].startswith("serving") for d in lines)
