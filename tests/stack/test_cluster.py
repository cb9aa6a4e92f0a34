"""Active-active through real parts: Envoy spreads streams over 2-3 `extproc serve` instances sharing a real Redis.

Client -> Envoy -> instances (gRPC, round-robin over streams) -> simulator,
with Debian's redis-server started by the test. Each scenario is one an
operator would try: a flood with newcomers, heavy against light tenants under
``vtc``, one instance killed mid-flood, Redis stopped and restarted under
load. Timing assertions compare measurements of the same run, with margins.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis

from extproc.tools.power_user import Outcome, PowerUser
from extproc.tools.redis_proc import RedisServer
from extproc.tools.stack import Stack, start_stack
from tests.helpers.integration import FAST_SIM, gated_then_direct, sample_engine
from tests.helpers.policies_integration import HEAVY_PROMPT, LIGHT_PROMPT, send, service_while_both_backlogged, session, weighted
from tests.stackutil import metric, poll, read_metrics, write_stack_config

pytestmark = [pytest.mark.integration, pytest.mark.alone]

TARGET = 3


async def cluster_metric(stack: Stack, name: str, **labels: str) -> float:
    """A series summed over every live instance."""
    total = 0.0
    for url in stack.metrics_urls.values():
        try:
            total += metric(await read_metrics(url), name, **labels)
        except OSError:
            continue  # a killed instance
    return total


async def wait_cluster(
    stack: Stack, name: str, done: Callable[[float], bool], timeout_s: float = 20, **labels: str
) -> float:
    """Poll a series summed over the instances until ``done``; fails with the last value at the timeout."""
    value = await poll(lambda: cluster_metric(stack, name, **labels), done, timeout_s)
    assert done(value), f"{name} {labels}: last {value}"
    return value


async def wait_redis_in_flight(redis: RedisServer, done: Callable[[float], bool], timeout_s: float = 10) -> float:
    """Poll the cluster's requests in flight as Redis counts them (every live member's published count)."""
    client = aioredis.from_url(redis.url)

    async def read() -> float:
        return sum(int(c.split()[1]) for c in await client.hvals("extproc:m1:inst"))

    try:
        value = await poll(read, done, timeout_s)
    finally:
        await client.aclose()
    assert done(value), f"Redis counts {value} in flight"
    return value


def cluster_config(tmp_path: Path, redis: RedisServer, instances: int = 2, **model: Any) -> Path:
    return write_stack_config(
        tmp_path, {"m1": {"target_waiting": TARGET, **model}}, redis_url=redis.url, cluster_instances=instances,
    )


@pytest.fixture
async def pair(tmp_path: Path, redis_server: RedisServer) -> AsyncIterator[Stack]:
    async with await start_stack(cluster_config(tmp_path, redis_server), tmp_path, sim_args=FAST_SIM) as stack:
        yield stack


async def test_two_instances_keep_the_newcomer_fast_and_the_engine_queue_at_target(pair: Stack) -> None:
    scenario = PowerUser(model="m1", flood=60, max_tokens=40, newcomer_delay_s=0.3)
    gated, engine, direct = await gated_then_direct(pair, scenario)
    waiting = [w for _, w in engine]

    assert all(o.status == 200 and o.ttft_s is not None for o in gated + direct), [o for o in gated if o.error]
    for newcomer in ("bob", "carol"):
        [mine] = [o for o in gated if o.tenant == newcomer]
        [fifo] = [o for o in direct if o.tenant == newcomer]
        assert mine.ttft_s is not None and fifo.ttft_s is not None
        assert mine.ttft_s * 2.5 < fifo.ttft_s, (mine, fifo)  # FIFO: behind the whole flood (4-10x here)
    # Both instances together keep the engine's queue as one does: target + 2 at most.
    assert max(waiting) <= TARGET + 2, waiting
    assert max(r for r, _ in engine) >= 1, engine  # the sampler really watched the run: it saw the engine serve it
    # Envoy spread the streams: both instances released, and together exactly every request.
    released = {name: metric(await read_metrics(url), "extproc_released_total", model="m1")
                for name, url in pair.metrics_urls.items()}
    assert sum(released.values()) == 62 and all(n > 0 for n in released.values()), released
    assert await cluster_metric(pair, "extproc_cluster_degraded", model="m1") == 0
    async with aiohttp.ClientSession() as http:
        status_url = pair.metrics_urls["b"].removesuffix("/metrics") + "/status.json"
        async with http.get(status_url) as response:
            [model] = (await response.json())["models"]
    assert model["cluster"] == {"instances": 2, "degraded": False}
    assert await cluster_metric(pair, "extproc_in_flight", model="m1") == 0


async def test_vtc_shares_weighted_tokens_across_instances(tmp_path: Path, redis_server: RedisServer) -> None:
    config = cluster_config(tmp_path, redis_server, policy="vtc")
    sim = ["--step-ms", "20", "--time-scale", "0.1", "--max-num-seqs", "4"]
    async with await start_stack(config, tmp_path, sim_args=sim) as stack, session() as http:
        # Carol fills the engine (4 running + 3 waiting) so the floods queue up completely first.
        blockers = [asyncio.create_task(send(http, stack, "carol", "m1", 10_000)) for _ in range(7)]
        await wait_cluster(stack, "extproc_in_flight", lambda v: v == 7, model="m1")
        plan = [("alice", HEAVY_PROMPT, 50)] * 6 + [("bob", LIGHT_PROMPT, 10)] * 80
        flood = asyncio.gather(*(send(http, stack, t, "m1", n, prompt=p) for t, p, n in plan))
        await wait_cluster(stack, "extproc_queue_depth", lambda v: v == 86, model="m1")
        for task in blockers:
            task.cancel()
        await asyncio.gather(*blockers, return_exceptions=True)
        results = await flood
    runs = [(t, sent, o, weighted(p, n)) for (t, p, n), (sent, o) in zip(plan, results, strict=True)]
    share = service_while_both_backlogged(runs)
    # A heavy request costs 20x a light one; the cluster-wide counters give both about the same tokens.
    assert 0.5 < share["alice"] / share["bob"] < 2, share


async def test_killing_one_instance_fails_only_its_held_requests_each_with_an_answer(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    config = cluster_config(tmp_path, redis_server, instances=3)
    sim = ["--max-num-seqs", "4", "--step-ms", "20", "--time-scale", "0.3"]
    async with await start_stack(config, tmp_path, sim_args=sim) as stack, session() as http:
        flood = [asyncio.create_task(send(http, stack, "alice", "m1", 60)) for _ in range(45)]
        await wait_cluster(stack, "extproc_queue_depth", lambda v: v >= 30, model="m1")
        victim = stack.processors["a"]
        held_there = metric(await read_metrics(stack.metrics_urls["a"]), "extproc_queue_depth", model="m1")
        victim.process.send_signal(signal.SIGKILL)
        outcomes: list[Outcome] = [o for _, o in await asyncio.wait_for(asyncio.gather(*flood), 60)]
        # Every request got an answer; only those the dead instance held failed, each with JSON.
        failed = [o for o in outcomes if o.status != 200]
        assert all(o.status == 503 and "processor_unavailable" in o.error for o in failed), failed
        assert len(failed) <= held_there + 4, (len(failed), held_there)  # + its released ones cut off, at most
        assert len(outcomes) - len(failed) >= 45 - held_there - 4
        # The live instances take new streams at once, and the dead one's slots came back (lease).
        after = await asyncio.gather(*(send(http, stack, "bob", "m1", 20) for _ in range(12)))
        assert all(o.status == 200 for _, o in after), [o for _, o in after if o.status != 200]
        assert await wait_cluster(stack, "extproc_cluster_instances", lambda v: v == 4, model="m1") == 4  # 2 x 2 live
        # Restarted, it rejoins with no manual step: 3 instances see 3 live, and it serves again.
        await stack.start_processor("a")
        assert await wait_cluster(stack, "extproc_cluster_instances", lambda v: v == 9, model="m1") == 9
        for _ in range(40):  # Envoy takes it back once its health check passes (it was ejected)
            again = await asyncio.gather(*(send(http, stack, "bob", "m1", 5) for _ in range(6)))
            assert all(o.status == 200 for _, o in again), [o for _, o in again if o.status != 200]
            if metric(await read_metrics(stack.metrics_urls["a"]), "extproc_released_total", model="m1") > 0:
                break
            await asyncio.sleep(0.5)
        else:
            raise AssertionError("the restarted instance never released a request")
        # Nothing is left counted in Redis once everything ended (the dead member's count lapsed).
        assert await wait_redis_in_flight(redis_server, lambda v: v == 0) == 0


async def test_redis_outage_degrades_to_local_shares_and_rejoins(tmp_path: Path, redis_server: RedisServer) -> None:
    config = cluster_config(tmp_path, redis_server)
    sim = ["--max-num-seqs", "4", "--step-ms", "20", "--time-scale", "0.2"]
    async with await start_stack(config, tmp_path, sim_args=sim) as stack, session() as http:
        stop = asyncio.Event()
        sampler = asyncio.create_task(sample_engine(stack.sim_url("m1"), stop))
        flood = [asyncio.create_task(send(http, stack, t, "m1", 40)) for t in ("alice", "bob") for _ in range(40)]
        await wait_cluster(stack, "extproc_queue_depth", lambda v: v >= 40, model="m1")
        await redis_server.stop()
        assert await wait_cluster(stack, "extproc_cluster_degraded", lambda v: v == 2, model="m1") == 2
        released = await cluster_metric(stack, "extproc_released_total", model="m1")
        await wait_cluster(stack, "extproc_released_total", lambda v: v >= released + 8, model="m1")  # serving on shares
        await redis_server.start()
        assert await wait_cluster(stack, "extproc_cluster_degraded", lambda v: v == 0, model="m1") == 0
        outcomes = [o for _, o in await asyncio.wait_for(asyncio.gather(*flood), 90)]
        stop.set()
        waiting = [w for _, w in await sampler]
        # Nothing lost, nothing counted twice: every instance and Redis agree that nothing is in flight.
        assert await wait_cluster(stack, "extproc_in_flight", lambda v: v == 0, model="m1") == 0
        assert await wait_redis_in_flight(redis_server, lambda v: v == 0) == 0
    assert all(o.status == 200 for o in outcomes), [o for o in outcomes if o.status != 200]
    # The engine's queue stayed bounded throughout, outage included.
    assert max(waiting) <= TARGET + 2, waiting
