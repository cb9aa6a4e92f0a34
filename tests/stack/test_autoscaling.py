"""A pool that grows from zero and shrinks while loaded, through the whole stack: nothing is lost.

Real Envoy, ``extproc serve`` and simulators as child processes. The pool is
a host name whose addresses come from a file (``extproc/tools/hosts.py``,
standing in for a headless Service's DNS), re-read every ``dns_refresh_s``;
Envoy sends each request where the processor picked (``endpoint_picking``),
as it cannot resolve the file's names itself.

* Up from zero: requests held while the name has no address are all served
  once an engine appears, the first within a tenth of their hold of its readiness.
* Down and out: an engine leaving a loaded pool takes nothing new, finishes
  what it runs, and comes back; no request fails, and neither engine's own
  queue passes its target.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiohttp
import pytest

from extproc.adapters.config import load_config
from extproc.tools.hosts import command, write_hosts
from extproc.tools.power_user import Outcome, chat
from extproc.tools.procs import free_port
from extproc.tools.stack import start_sim, start_stack
from tests.stackutil import metric, read_metrics, wait_for_metric, write_stack_config
from tests.waitutil import eventually

pytestmark = pytest.mark.integration

NAME = "m1-engines.test"
TENANTS = {f"key-t{i}": f"t{i}" for i in range(1, 6)}
# 4 sequences per batch, 10x faster than real time.
FAST_SIM = ["--max-num-seqs", "4", "--step-ms", "20", "--time-scale", "0.1"]
TARGET_WAITING = 3


def pool_config(tmp_path: Path, **model: object) -> Path:
    return write_stack_config(tmp_path, {"m1": {
        "endpoints": [f"http://{NAME}:8000"], "endpoint_picking": True, "dns_refresh_s": 0.2, **model,
    }}, api_keys=TENANTS)


async def timed(session: aiohttp.ClientSession, url: str, key: str, max_tokens: int) -> tuple[Outcome, float]:
    """One chat, and the monotonic time its first token came (inf: none)."""
    started = time.monotonic()
    outcome = await chat(session, url, TENANTS[key], "m1", api_key=key, max_tokens=max_tokens)
    return outcome, started + outcome.ttft_s if outcome.ttft_s is not None else float("inf")


async def test_requests_held_with_no_engine_are_all_served_the_first_at_once_when_one_is_ready(
    tmp_path: Path,
) -> None:
    """No engine, 50 requests from 5 tenants, an engine 10 s later. The class's wait (3 s) is far shorter than
    that: the cold-start wait (60 s) keeps them."""
    hosts = tmp_path / "hosts.json"
    write_hosts(hosts, {})
    config_path = pool_config(tmp_path, max_queue_wait_s=3, cold_start_wait_s=60)
    model = load_config(config_path).models[0]
    engine = f"http://127.0.0.1:{free_port()}"
    async with await start_stack(config_path, tmp_path, engines=False, command=command(hosts)) as stack, \
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        sent = time.monotonic()
        requests = [asyncio.create_task(timed(session, stack.envoy_url, key, 8)) for key in TENANTS for _ in range(10)]
        # Held, and the demand says the model needs an engine.
        assert await wait_for_metric(stack.metrics_url, "extproc_demand_requests", lambda v: v == 50, model="m1",
                                     state="held") == 50
        page = await read_metrics(stack.metrics_url)
        assert metric(page, "extproc_engines_needed", model="m1") >= 1
        assert pool_series(page, "inference_pool_ready_pods") == 0
        await asyncio.sleep(max(0.0, sent + 10 - time.monotonic()))
        async with await start_sim(model, engine, tmp_path, FAST_SIM):
            write_hosts(hosts, {NAME: [engine]})  # ready (its /health answered): the name resolves to it
            ready = time.monotonic()
            results = await asyncio.gather(*requests)
        page = await read_metrics(stack.metrics_url)
    assert [o.status for o, _ in results] == [200] * 50, [o.error for o, _ in results if o.status != 200]
    first = min(at for _, at in results)
    # At once, against the hold they came through (10 s and more, while no engine was there): a tenth of it at most.
    assert first - ready < 0.1 * (ready - sent), (
        f"the first token came {first - ready:.2f} s after the engine was ready, {ready - sent:.2f} s after the requests")
    assert metric(page, "extproc_rejected_total", model="m1", reason="queue_timeout") == 0
    assert metric(page, "extproc_released_total", model="m1") == 50


async def sample_waiting(urls: list[str], stop: asyncio.Event) -> list[float]:
    """Each engine's own waiting queue, read from its /metrics until ``stop``: the highest seen of each."""
    peaks = [0.0] * len(urls)
    while not stop.is_set():
        for i, url in enumerate(urls):
            try:
                peaks[i] = max(peaks[i], metric(await read_metrics(f"{url}/metrics"), "vllm:num_requests_waiting"))
            except aiohttp.ClientError:
                pass
        await asyncio.sleep(0.02)
    return peaks


async def served(url: str) -> float:
    return metric(await read_metrics(f"{url}/metrics"), "vllm:request_success_total")


async def held_by(url: str) -> float:
    page = await read_metrics(f"{url}/metrics")
    return metric(page, "vllm:num_requests_running") + metric(page, "vllm:num_requests_waiting")


async def test_an_engine_leaving_a_loaded_pool_and_coming_back_loses_nothing_and_keeps_the_queues_at_target(
    tmp_path: Path,
) -> None:
    hosts = tmp_path / "hosts.json"
    engines = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    write_hosts(hosts, {NAME: engines})
    config_path = pool_config(tmp_path, target_waiting=TARGET_WAITING)
    model = load_config(config_path).models[0]
    async with await start_stack(config_path, tmp_path, engines=False, command=command(hosts)) as stack, \
            await start_sim(model, engines[0], tmp_path, FAST_SIM), await start_sim(model, engines[1], tmp_path, FAST_SIM), \
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        stop = asyncio.Event()
        outcomes: list[Outcome] = []

        async def tenant(key: str) -> None:  # four at a time each: 20 wanted, the two engines hold 14 at most
            async def one() -> None:
                while not stop.is_set():
                    outcomes.append(await chat(session, stack.envoy_url, TENANTS[key], "m1", api_key=key,
                                               max_tokens=40))
            await asyncio.gather(*(one() for _ in range(4)))

        sampler = asyncio.create_task(sample_waiting(engines, stop))
        load = [asyncio.create_task(tenant(key)) for key in TENANTS]
        metrics = stack.metrics_url
        assert await wait_for_metric(metrics, "extproc_demand_requests", lambda v: v > 0, model="m1", state="held") > 0
        await eventually(lambda: served_more(engines[1], 0), what="the second engine serving")
        limit_before = metric(await read_metrics(metrics), "extproc_gate_limit", model="m1", endpoint=engines[0])

        write_hosts(hosts, {NAME: engines[:1]})  # the second leaves the pool (its address gone from DNS)
        await eventually(lambda: ready_pods_are(metrics, 1), what="the pool down to one")
        # What it ran finishes; nothing new goes to it.
        await eventually(lambda: held_by_is(engines[1], 0), timeout_s=20, what="the leaver drained")
        count = await served(engines[1])
        limit_after = metric(await read_metrics(metrics), "extproc_gate_limit", model="m1", endpoint=engines[0])
        done = len(outcomes)
        await eventually(lambda: len(outcomes) >= done + 40, timeout_s=20, what="40 more served by the one left")
        assert await served(engines[1]) == count

        write_hosts(hosts, {NAME: engines})  # back
        await eventually(lambda: served_more(engines[1], count), timeout_s=20, what="the returner serving")
        stop.set()
        await asyncio.gather(*load)
        peaks = await sampler
    assert outcomes and [o for o in outcomes if o.status != 200] == []
    assert max(peaks) <= TARGET_WAITING + 2, peaks
    # The one that stayed kept what its gate had learned (a new endpoint starts at target_waiting).
    assert limit_after >= 0.8 * limit_before > TARGET_WAITING, (limit_before, limit_after)


def pool_series(page: dict[tuple[str, tuple[tuple[str, str], ...]], float], series: str) -> float:
    """A pool series of GIE's names (labelled ``name``, the model's) on a processor's page."""
    return sum(v for (n, labels), v in page.items() if n == series and dict(labels).get("name") == "m1")


async def ready_pods_are(metrics: str, value: float) -> bool:
    return pool_series(await read_metrics(metrics), "inference_pool_ready_pods") == value


async def held_by_is(url: str, value: float) -> bool:
    return await held_by(url) == value


async def served_more(url: str, than: float) -> bool:
    return await served(url) > than
