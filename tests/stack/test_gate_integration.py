"""The gate through real parts: every engine dialect, two replicas, broken metrics, bypass traffic.

Client → Envoy → extproc (gRPC) → simulators as subprocesses. Assertions are
on outcomes and on metrics, never on absolute timings.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from extproc.adapters.config import ENGINES
from extproc.tools.power_user import Outcome, chat
from extproc.tools.stack import start_stack
from tests.stackutil import TENANT_KEYS, metric, read_metrics, wait_for_metric, write_config

pytestmark = pytest.mark.integration

# 4 sequences per batch, 10x faster than real time.
FAST_SIM = ["--max-num-seqs", "4", "--step-ms", "20", "--time-scale", "0.1"]


async def flood(session: aiohttp.ClientSession, url: str, model: str, n: int, tenant: str = "alice", **kw: Any) -> list[Outcome]:
    return await asyncio.gather(
        *(chat(session, url, tenant, model, api_key=TENANT_KEYS.get(tenant), max_tokens=12, **kw) for _ in range(n))
    )


async def trickle_requests(session: aiohttp.ClientSession, url: str) -> None:
    """One short request after another, until cancelled."""
    while True:
        outcome = await chat(session, url, "bob", "m1", api_key=TENANT_KEYS["bob"], max_tokens=2)
        assert outcome.status == 200, outcome.error
        await asyncio.sleep(0.05)


async def test_every_engine_dialect_is_gated_end_to_end(tmp_path: Path) -> None:
    """One model per engine, each on a simulator speaking that engine's /metrics."""
    models = tuple(f"m-{engine}" for engine in ENGINES)
    config = write_config(tmp_path, models, per_model={f"m-{e}": {"engine": e} for e in ENGINES})
    # Five simulators on two cores: slower engine steps keep the machine responsive.
    sim = ["--max-num-seqs", "2", "--step-ms", "20", "--time-scale", "0.25"]
    async with await start_stack(config, tmp_path, sim_args=sim) as stack:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            results = await asyncio.gather(*(flood(session, stack.envoy_url, m, 8) for m in models))
        samples = await read_metrics(stack.metrics_url)
    for model, outcomes in zip(models, results, strict=True):
        assert [o.status for o in outcomes] == [200] * 8, (model, [o.error for o in outcomes if o.error])
        assert metric(samples, "extproc_released_total", model=model) == 8
        # The gate read this engine's metrics (not the fallback) and held part of the flood.
        assert metric(samples, "extproc_scrape_errors_total", model=model) == 0, model
        assert metric(samples, "extproc_gate_fallback", model=model) == 0, model
        assert metric(samples, "extproc_gate_limit", model=model) >= 3, model
        held = metric(samples, "extproc_queue_wait_seconds_sum", model=model)
        assert held > 0, model


async def test_two_replicas_with_endpoint_picking(tmp_path: Path) -> None:
    config = write_config(tmp_path, replicas=2, endpoint_picking=True)
    async with await start_stack(config, tmp_path, sim_args=FAST_SIM) as stack:
        sims = stack.config.models[0].endpoints

        async def served() -> list[float]:
            return [
                metric(await read_metrics(f"{url}/metrics"), "vllm:request_success_total") for url in sims
            ]

        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            # Light load: a prompt_cache_key's requests all go to one engine (its prefix cache).
            for key in ("doc-1", "doc-2", "doc-3", "doc-4"):
                before = await served()
                for _ in range(3):
                    outcome = await chat(session, stack.envoy_url, "bob", "m1", api_key=TENANT_KEYS["bob"],
                                         max_tokens=4, extra_body={"prompt_cache_key": key})
                    assert outcome.status == 200, outcome.error
                after = await served()
                assert sorted(a - b for a, b in zip(after, before, strict=True)) == [0, 3], key
            # A flood fills both engines.
            before = await served()
            outcomes = await flood(session, stack.envoy_url, "m1", 24)
            assert all(o.status == 200 for o in outcomes)
            after = await served()
        share = [a - b for a, b in zip(after, before, strict=True)]
        assert sum(share) == 24 and min(share) >= 6, share
        samples = await read_metrics(stack.metrics_url)
        for url in sims:
            assert metric(samples, "extproc_gate_limit", model="m1", endpoint=url) >= 3


async def test_broken_metrics_degrade_to_a_cap_and_recover(tmp_path: Path) -> None:
    config = write_config(tmp_path, advanced={"stale_after_s": 0.5, "fallback_max_in_flight": 2})
    async with await start_stack(config, tmp_path, sim_args=FAST_SIM) as stack:
        sim = stack.sim_url("m1")
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            for mode in ("garbage", "error", "slow", "frozen", "nan"):
                async with session.put(f"{sim}/sim/metrics-fault", json={"mode": mode}) as response:
                    assert response.status == 200
                # Traffic keeps flowing while the metrics are broken (a frozen page is only
                # noticed because it does not move although requests were sent after it froze).
                for _ in range(2):
                    outcomes = await flood(session, stack.envoy_url, "m1", 6)
                    assert all(o.status == 200 for o in outcomes), (mode, outcomes)
                # A trickle of requests meanwhile (a frozen page is noticed once requests sent
                # after it froze leave no trace on it).
                trickle = asyncio.create_task(trickle_requests(session, stack.envoy_url))
                degraded = await wait_for_metric(stack.metrics_url, "extproc_endpoint_degraded", lambda v: v == 1)
                trickle.cancel()
                assert degraded == 1, mode
                assert metric(await read_metrics(stack.metrics_url), "extproc_gate_fallback", model="m1") == 1
                async with session.put(f"{sim}/sim/metrics-fault", json={"mode": "ok"}) as response:
                    assert response.status == 200
                assert await wait_for_metric(stack.metrics_url, "extproc_endpoint_degraded", lambda v: v == 0) == 0, mode
    log = (tmp_path / "extproc.log").read_text()
    assert log.count("unusable (failing or stale)") >= 5 and log.count("usable again") >= 5


async def test_traffic_around_the_gateway_stops_releases(tmp_path: Path) -> None:
    async with await start_stack(write_config(tmp_path), tmp_path, sim_args=FAST_SIM) as stack:
        sim = stack.sim_url("m1")
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            # 40 long requests straight to the engine: 4 run, 36 wait in its FIFO.
            bypass = asyncio.gather(
                *(chat(session, sim, "other", "m1", api_key=None, max_tokens=150) for _ in range(40))
            )
            engine_waiting = await wait_for_metric(f"{sim}/metrics", "vllm:num_requests_waiting", lambda v: v >= 30)
            assert engine_waiting >= 30
            # The gate has seen that queue (a scrape since) before bob's requests arrive.
            assert await wait_for_metric(stack.metrics_url, "extproc_engine_waiting", lambda v: v >= 30, model="m1") >= 30
            mine = asyncio.gather(*(chat(session, stack.envoy_url, "bob", "m1", api_key=TENANT_KEYS["bob"],
                                         max_tokens=4) for _ in range(5)))
            assert await wait_for_metric(stack.metrics_url, "extproc_queue_depth", lambda v: v == 5, model="m1") == 5
            # Held, not released, while the engine's own queue is that long.
            samples = await read_metrics(stack.metrics_url)
            assert metric(samples, "extproc_in_flight", model="m1") == 0
            assert metric(samples, "extproc_engine_waiting", model="m1") >= 10
            outcomes = await mine
            await bypass
    assert all(o.status == 200 for o in outcomes)


async def test_a_lagging_engine_page_does_not_overfill_the_engine(tmp_path: Path) -> None:
    """The simulator shows a request in /metrics 60-400 ms after it arrives, as real vLLM does.

    Requests as long as on vLLM CPU here (~0.3 s): the lag is a large part of
    each one, so a gate that trusts the page to show what it sent overfills
    the engine. Sampled from the engine's own /metrics, in every flood.
    """
    sim = ["--max-num-seqs", "4", "--step-ms", "20", "--time-scale", "0.5"]
    async with await start_stack(write_config(tmp_path), tmp_path, sim_args=sim) as stack:
        url = stack.sim_url("m1")
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            peaks = []
            for _ in range(3):
                stop = asyncio.Event()

                async def sample(stop: asyncio.Event = stop) -> float:
                    peak = 0.0
                    while not stop.is_set():
                        peak = max(peak, metric(await read_metrics(f"{url}/metrics"), "vllm:num_requests_waiting"))
                        await asyncio.sleep(0.02)
                    return peak

                sampler = asyncio.create_task(sample())
                outcomes = await asyncio.gather(
                    *(chat(session, stack.envoy_url, "alice", "m1", api_key=TENANT_KEYS["alice"], max_tokens=32)
                      for _ in range(30))
                )
                stop.set()
                peaks.append(await sampler)
                assert [o.status for o in outcomes] == [200] * 30
    assert max(peaks) <= 3 + 2, peaks
