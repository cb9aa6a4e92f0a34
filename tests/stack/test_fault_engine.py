"""Engine crash and restart through real parts: client → Envoy → extproc → simulator, kill -9 in the middle.

An engine that dies must not empty the queue: the requests held for it wait
(up to their queue timeout) and are served when it is back, or go to a
replica that is up. Only the requests the dead engine held may fail, behind
our generated Envoy bootstrap and behind the drop-in merged into an
operator's own Envoy. The assertions count outcomes; nothing here measures
speed.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp import web

from extproc.adapters.config import Config
from extproc.adapters.envoy import drop_in, merge
from extproc.adapters.envoy.routes import ENGINE_RETRIES
from extproc.tools.power_user import Outcome, chat
from extproc.tools.stack import Stack, start_sim, start_stack
from tests.helpers.drop_in import user_envoy
from tests.stackutil import TENANT_KEYS, metric, read_metrics, send_chat, wait_for_metric, write_config

pytestmark = pytest.mark.integration

# 4 sequences per batch at 20 ms a token: 30 tokens keep a request about 0.6 s, a flood of 40 several seconds.
SLOW_SIM = ["--max-num-seqs", "4", "--step-ms", "20", "--time-scale", "1"]
FLOOD = 40
TOKENS = 30
# One JSON line per request's outcome (the decision log), with its wall time.
DECISION_LOG = ["--log-level", "debug", "--log-format", "json"]


def _flood(session: aiohttp.ClientSession, stack: Stack) -> list[asyncio.Task[Outcome]]:
    tenants = ("alice", "bob", "carol", "dave")
    return [send_chat(session, stack, tenants[i % len(tenants)], TOKENS) for i in range(FLOOD)]


async def _kill(stack: Stack, index: int) -> None:
    sim = stack.sims[index]
    sim.process.kill()
    await sim.process.wait()


def _envoy(shape: str) -> Callable[[Config], dict[str, Any]] | None:
    """The Envoy in front: our generated bootstrap (None), or the drop-in merged into an operator's own Envoy."""
    if shape == "bootstrap":
        return None

    def merged(config: Config) -> dict[str, Any]:
        [model] = config.models
        user = user_envoy(api_port=1, engine=model.endpoints[0])
        listener = user["static_resources"]["listeners"][0]
        for where, address in ((listener, config.envoy.listen), (user["admin"], config.envoy.admin)):
            host, _, port = address.rpartition(":")
            where["address"]["socket_address"] = {"address": host, "port_value": int(port)}
        return merge(user, drop_in(config, existing_clusters={model.name: "my_engine"}))

    return merged


def _released_between(log: Path, start: float, end: float) -> int:
    """How many releases the processor's decision log (JSON lines) has from wall time ``start`` to ``end``."""
    released = 0
    for line in log.read_text().splitlines():
        if '"extproc.decisions"' not in line:
            continue
        entry = json.loads(line)
        if entry["outcome"] == "released" and start <= datetime.fromisoformat(entry["ts"]).timestamp() < end:
            released += 1
    return released


@pytest.mark.parametrize("shape", ["bootstrap", "drop_in"])
async def test_queued_requests_wait_for_a_crashed_engine_and_are_served_after_its_restart(tmp_path: Path, shape: str) -> None:
    """Only what the engine held when it died fails: every slot its cut requests freed waits for a sign of life.

    The processor's decision log tells which requests it released after the
    kill, before the restart: each went into the dead engine. Those are the
    requests queued at the crash that were lost.
    """
    async with await start_stack(write_config(tmp_path), tmp_path, sim_args=SLOW_SIM, envoy_bootstrap=_envoy(shape),
                                 serve_args=DECISION_LOG) as stack:
        model = stack.config.models[0]
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            flood = _flood(session, stack)
            await wait_for_metric(stack.metrics_url, "extproc_queue_depth", lambda v: v >= 30, model="m1")
            await asyncio.sleep(0.5)  # past the start's first scrapes: the engine runs as it would when it dies
            queued = metric(await read_metrics(stack.metrics_url), "extproc_queue_depth", model="m1")
            killed_at = time.time()  # the log's timestamps are milliseconds: no release that preceded it is counted
            await _kill(stack, 0)
            assert await wait_for_metric(stack.metrics_url, "extproc_endpoint_up", lambda v: v == 0, model="m1") == 0
            await asyncio.sleep(2.0)  # the engine is gone for a while; nothing queued may be answered meanwhile
            samples = await read_metrics(stack.metrics_url)
            assert metric(samples, "extproc_rejected_total", model="m1") == 0
            assert metric(samples, "extproc_in_flight", model="m1") == 0  # nothing left in the dead engine
            restarted_at = time.time()
            stack.sims[0] = await start_sim(model, model.endpoints[0], tmp_path, SLOW_SIM)
            outcomes = await asyncio.wait_for(asyncio.gather(*flood), 120)
        samples = await read_metrics(stack.metrics_url)
    served = sum(o.status == 200 for o in outcomes)
    lost = _released_between(tmp_path / "extproc.log", math.floor(killed_at * 1000 + 1) / 1000, restarted_at)
    assert queued >= 25, f"the queue at the crash: {queued:.0f}"
    print(f"engine restart ({shape}): queued at the crash {queued:.0f}, of them released into the dead engine {lost} "
          f"({(queued - lost) / queued:.0%} served after the restart); served {served}/{FLOOD}")
    assert queued - lost >= 0.95 * queued
    assert FLOOD - served <= FLOOD - queued + lost  # nothing else failed than what the engine held and what went into it
    assert metric(samples, "extproc_endpoint_up", model="m1") == 1
    assert metric(samples, "extproc_queue_depth", model="m1") == 0


@pytest.mark.parametrize("picking", [False, True], ids=["balanced", "picked"])
async def test_a_crashed_replica_leaves_its_queue_to_the_other(tmp_path: Path, picking: bool) -> None:
    config = write_config(tmp_path, replicas=2, endpoint_picking=picking)
    async with await start_stack(config, tmp_path, sim_args=SLOW_SIM) as stack:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            flood = _flood(session, stack)
            await wait_for_metric(stack.metrics_url, "extproc_queue_depth", lambda v: v >= 25, model="m1")
            in_flight = metric(await read_metrics(stack.metrics_url), "extproc_in_flight", model="m1")
            await _kill(stack, 0)
            outcomes = await asyncio.wait_for(asyncio.gather(*flood), 120)
        samples = await read_metrics(stack.metrics_url)
    failed = [o for o in outcomes if o.status != 200]
    print(f"replica crash ({'picked' if picking else 'balanced'}): in flight {in_flight:.0f}, "
          f"served {FLOOD - len(failed)}/{FLOOD}")
    # Only what the dead replica held may fail, and what took its freed slots before a scrape saw it
    # gone (on a loaded machine scrapes come late: as many again). Before the down state: all queued.
    assert len(failed) <= 2 * (in_flight + 1), failed
    dead = stack.config.models[0].endpoints[0]
    assert metric(samples, "extproc_endpoint_up", model="m1", endpoint=dead) == 0
    assert metric(samples, "extproc_queue_depth", model="m1") == 0


BUSY = "The engine is currently busy and cannot accept new requests. Please try again later or on a different instance."
IDLE_PAGE = 'vllm:num_requests_running{model_name="m1"} 0\nvllm:num_requests_waiting{model_name="m1"} 0\n'


@pytest.mark.parametrize("failure", ["reset", "full", "full_once"])
async def test_a_release_the_engine_never_started_is_seen_through_envoy(tmp_path: Path, failure: str) -> None:
    """An engine whose metrics answer but whose API resets the connection, or refuses as full.

    Envoy answers the reset itself (503, no upstream time): down. The engine's
    own 503 with vLLM's queue-cap message is "full": Envoy retries it (the
    engine never started the request), so a refusal that clears is never
    seen by the client; one that outlasts the retries reaches the client,
    cuts the limit and leaves the endpoint up. Either way the processor reads
    it from the response headers ext_proc shows it, not from a scrape.
    """
    attempts = 0

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=IDLE_PAGE)

    async def completions(request: web.Request) -> web.StreamResponse:
        nonlocal attempts
        attempts += 1
        if failure == "reset":
            assert request.transport is not None
            request.transport.abort()
            return web.Response()
        if failure == "full" or attempts == 1:
            return web.json_response({"error": {"message": BUSY, "type": "Service Unavailable", "code": 503}}, status=503)
        return web.json_response({"choices": [{"message": {"content": "ok"}}]})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/v1/chat/completions", completions)
    # One scrape, at start: an engine whose metrics answer is up again at the first scrape that starts after
    # its failure, and this test reads what the response headers alone did (a loaded machine reads late).
    config = write_config(tmp_path, advanced={"scrape_interval_s": 60, "stale_after_s": 120})
    endpoint = yaml.safe_load(config.read_text())["models"][0]["endpoints"][0]
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", int(endpoint.rsplit(":", 1)[1])).start()
    try:
        async with await start_stack(config, tmp_path, engines=False) as stack:
            async with aiohttp.ClientSession() as session:
                outcome = await chat(session, stack.envoy_url, "alice", "m1", api_key=TENANT_KEYS["alice"], max_tokens=5)
            samples = await read_metrics(stack.metrics_url)
    finally:
        await runner.cleanup()
    failures = metric(samples, "extproc_release_failures_total", model="m1", endpoint=endpoint)
    refused = metric(samples, "extproc_release_refused_full_total", model="m1", endpoint=endpoint)
    up = metric(samples, "extproc_endpoint_up", model="m1", endpoint=endpoint)
    if failure == "reset":
        assert (outcome.status, failures, refused, up) == (503, 1, 0, 0)
    elif failure == "full":
        assert (outcome.status, failures, refused, up) == (503, 0, 1, 1)
        assert attempts == 1 + ENGINE_RETRIES  # refused every time: retried, then the refusal passed on
    else:
        assert (outcome.status, failures, refused, up) == (200, 0, 0, 1)
        assert attempts == 2
