"""A broken metrics page is not a dead engine: client → Envoy → extproc → simulator, /metrics reset while it serves.

A reset ``/metrics`` connection used to be taken for a dead engine: nothing
was released until the page healed. Now the engine's ``/health`` is probed
first; while it answers, the endpoint serves on its fallback cap. A killed
engine, whose port refuses, is still down at once and loses nothing queued.
Throughput is compared with the same load on healthy metrics, with a margin;
nothing here measures speed absolutely.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest

from extproc.tools.power_user import chat
from extproc.tools.stack import Stack, start_sim, start_stack
from tests.stackutil import TENANT_KEYS, metric, read_metrics, send_chat, wait_for_metric, write_config

pytestmark = pytest.mark.integration

# 4 sequences per batch at 20 ms a token: 10 tokens keep a request about 0.25 s.
SLOW_SIM = ["--max-num-seqs", "4", "--step-ms", "20", "--time-scale", "1"]
TENANTS = ("alice", "bob", "carol", "dave")
WINDOW_S = 6.0


async def _served_in(session: aiohttp.ClientSession, stack: Stack, seconds: float) -> int:
    """How many requests 8 clients, each sending the next when the last is answered, get served in ``seconds``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds

    async def client(tenant: str) -> int:
        served = 0
        while loop.time() < deadline:
            outcome = await chat(session, stack.envoy_url, tenant, "m1", api_key=TENANT_KEYS[tenant], max_tokens=10)
            served += outcome.status == 200
        return served

    return sum(await asyncio.gather(*(client(t) for t in TENANTS * 2)))


async def _metrics_fault(session: aiohttp.ClientSession, stack: Stack, mode: str) -> None:
    async with session.put(f"{stack.sim_url('m1')}/sim/metrics-fault", json={"mode": mode}) as response:
        assert response.status == 200


async def test_an_engine_whose_metrics_reset_keeps_serving_and_a_killed_one_is_still_down(tmp_path: Path) -> None:
    async with await start_stack(write_config(tmp_path), tmp_path, sim_args=SLOW_SIM) as stack:
        model = stack.config.models[0]
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            healthy = await _served_in(session, stack, WINDOW_S)
            await _metrics_fault(session, stack, "reset")
            await wait_for_metric(stack.metrics_url, "extproc_scrape_errors_total", lambda v: v >= 1, model="m1")
            broken = await _served_in(session, stack, WINDOW_S)
            during = await read_metrics(stack.metrics_url)
            print(f"metrics reset: {broken} served in {WINDOW_S:.0f} s, {healthy} with healthy metrics")
            # Really dead, its metrics still broken: down at once, and the queue waits for it.
            flood = [send_chat(session, stack, TENANTS[i % 4], 30) for i in range(20)]
            await wait_for_metric(stack.metrics_url, "extproc_queue_depth", lambda v: v >= 10, model="m1")
            in_flight = metric(await read_metrics(stack.metrics_url), "extproc_in_flight", model="m1")
            stack.sims[0].process.kill()
            await stack.sims[0].process.wait()
            assert await wait_for_metric(stack.metrics_url, "extproc_endpoint_up", lambda v: v == 0, model="m1") == 0
            await asyncio.sleep(1.0)
            samples = await read_metrics(stack.metrics_url)
            assert metric(samples, "extproc_in_flight", model="m1") == 0  # nothing sent into it
            assert metric(samples, "extproc_rejected_total", model="m1") == 0
            stack.sims[0] = await start_sim(model, model.endpoints[0], tmp_path, SLOW_SIM)
            outcomes = await asyncio.wait_for(asyncio.gather(*flood), 120)
    failed = [o for o in outcomes if o.status != 200]
    print(f"then killed with {in_flight:.0f} in flight: {len(failed)} of 20 failed")
    assert broken >= 0.5 * healthy, (broken, healthy)
    # Served on the fallback cap, never taken for down.
    assert metric(during, "extproc_endpoint_up", model="m1") == 1
    assert metric(during, "extproc_gate_fallback", model="m1") == 1
    assert metric(during, "extproc_endpoint_degraded", model="m1") == 1
    assert len(failed) <= in_flight, failed
