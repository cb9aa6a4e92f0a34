"""Active-active's plumbing through real processes: N instances behind one Envoy cluster, one killed and restarted.

What is checked is where Envoy sends the streams (counted on each
instance's own metrics), not how the instances share the engine: that is
the scheduling tests' part. Counts and bounds only, never speed.
"""

from __future__ import annotations

import signal
from collections import Counter
from pathlib import Path

import aiohttp
import pytest

from extproc.tools.power_user import Outcome, chat
from extproc.tools.stack import Stack, start_stack
from tests.redisutil import RedisServer
from tests.stackutil import TENANT_KEYS, metric, read_metrics, write_stack_config

pytestmark = pytest.mark.integration

# Envoy's worker threads in the tests (envoy_proc.start_envoy): each may open one
# stream to a dead instance before the cluster-wide ejection reaches it.
ENVOY_WORKERS = 2


async def released(stack: Stack, name: str) -> float:
    """Requests instance ``name`` released so far (a restarted instance counts from zero)."""
    return metric(await read_metrics(stack.metrics_urls[name]), "extproc_released_total", model="m1")


async def one_by_one(http: aiohttp.ClientSession, stack: Stack, n: int) -> list[Outcome]:
    """``n`` short chats, each sent once the previous one is answered."""
    return [await chat(http, stack.envoy_url, "alice", "m1", api_key=TENANT_KEYS["alice"], max_tokens=3)
            for _ in range(n)]


async def test_envoy_spreads_streams_over_instances_skips_a_killed_one_and_takes_it_back(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    path = write_stack_config(tmp_path, {"m1": {}}, redis_url=redis_server.url, cluster_instances=2)
    async with await start_stack(path, tmp_path) as stack, aiohttp.ClientSession() as http:
        assert list(stack.processors) == list(stack.metrics_urls) == ["a", "b"]
        assert stack.processor is stack.processors["a"]
        # Round-robin over streams: one tenant's requests land on both instances.
        assert Counter(o.status for o in await one_by_one(http, stack, 8)) == {200: 8}
        before = {name: await released(stack, name) for name in stack.processors}
        assert sum(before.values()) == 8 and min(before.values()) >= 1, before

        stack.processors["a"].process.send_signal(signal.SIGKILL)
        await stack.processors["a"].process.wait()
        # The first stream that finds it dead ejects it (outlier detection); without
        # that, every other request failed until the health check noticed (about 2 s).
        after_kill = Counter(o.status for o in await one_by_one(http, stack, 10))
        assert set(after_kill) <= {200, 503} and after_kill[503] <= ENVOY_WORKERS, after_kill
        assert await released(stack, "b") == before["b"] + after_kill[200]

        # Restarted on the same addresses, it is back in the rotation at its first passing health check.
        await stack.start_processor("a")
        served: Counter[int] = Counter()
        for _ in range(30):
            served.update(o.status for o in await one_by_one(http, stack, 2))
            if await released(stack, "a") >= 1:
                break
        assert served == {200: sum(served.values())}, served
        assert await released(stack, "a") >= 1
