"""What one cluster round trip costs Redis, by instances and tenants queued (docs/cluster.md).

``python -m extproc.tools.bench.script_cost``: starts Debian's redis-server,
then plays N instances taking turns, each with T tenants queued (5 requests
each) and one slot freeing per trip, and reports each configuration's round
trip (client side, p50/p99) and Redis's own CPU per call (``INFO cpu``).
The script scans every queued tenant on every trip, so its cost grows with
the tenants queued cluster-wide; this shows how fast.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import redis.asyncio as aioredis

from extproc.adapters.cluster.link import SCRIPT
from extproc.adapters.cluster.wire import Trip, decode_grant, encode_trip
from extproc.core.cluster import Ask, Backlog
from extproc.tools.redis_proc import RedisServer

SHAPES = ((1, 1), (2, 1), (2, 10), (3, 10), (2, 100), (3, 100), (2, 1000))


async def measure(client: aioredis.Redis, instances: int, tenants: int, calls: int) -> tuple[float, float, float]:
    """(p50 s, p99 s, Redis CPU s) per round trip."""
    await client.flushall()
    script = client.register_script(SCRIPT)
    backlogs = {i: tuple(Backlog(0, f"t{k}", 5, 1.0) for k in range(tenants)) for i in range(instances)}
    in_flight = dict.fromkeys(range(instances), 0)
    before = await client.info("cpu")
    times = []
    for n in range(calls):
        i = n % instances
        ask = Ask(in_flight[i], (in_flight[i] + 1,), backlogs[i], ())
        started = time.perf_counter()
        trip = encode_trip(Trip(f"i{i}", 2000, "bench:wake:", "m", "counter", ask))
        reply = await script(keys=["bench:m"], args=[trip])
        times.append(time.perf_counter() - started)
        in_flight[i] = max(0, in_flight[i] + len(decode_grant(reply).releases) - 1)  # one of its own ends
    after = await client.info("cpu")
    cpu = sum(after[k] - before[k] for k in ("used_cpu_sys", "used_cpu_user")) / calls
    times.sort()
    return times[len(times) // 2], times[int(len(times) * 0.99)], cpu


async def main(calls: int) -> None:
    with tempfile.TemporaryDirectory() as workdir:
        async with RedisServer(Path(workdir)) as redis:
            client = aioredis.from_url(redis.url)
            print("| instances | tenants queued per instance | round trip p50 | p99 | Redis CPU per trip |")
            print("|---|---|---|---|---|")
            for instances, tenants in SHAPES:
                p50, p99, cpu = await measure(client, instances, tenants, calls if tenants < 1000 else calls // 5)
                print(f"| {instances} | {tenants:,} | {p50 * 1e3:.2f} ms | {p99 * 1e3:.2f} ms | {cpu * 1e3:.2f} ms |")
            await client.aclose()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000, help="round trips per configuration")
    asyncio.run(main(parser.parse_args().calls))
