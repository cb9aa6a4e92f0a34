"""A pool given by host name follows what the name resolves to (adapters/engines/discovery.py), over real HTTP.

The name's answers come from a file (``extproc/tools/hosts.py``, the fake of
DNS the stack tests and the simulated autoscaler run the processor with); the
engines are small aiohttp apps on loopback, scraped for real; the dispatcher
and its telemetry are the processor's own.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from extproc.adapters.config import parse_config
from extproc.adapters.engines import discovery
from extproc.adapters.engines.probe import probe_session
from extproc.adapters.runtime import build_runtimes
from extproc.adapters.telemetry import Telemetry
from extproc.core.dispatcher import ModelDispatcher
from extproc.tools.hosts import resolver, write_hosts
from tests.httputil import serving
from tests.waitutil import eventually

pytestmark = pytest.mark.integration

NAME = "engines.test"
Resolve = Callable[[str], Coroutine[None, None, list[str]]]
PAGE = 'vllm:num_requests_running{model_name="m"} 0\nvllm:num_requests_waiting{model_name="m"} 0\n'


async def _page(_: web.Request) -> web.StreamResponse:
    return web.Response(text=PAGE)


@asynccontextmanager
async def engines(n: int) -> AsyncIterator[list[str]]:
    async with AsyncExitStack() as stack:
        urls = []
        for _ in range(n):
            app = web.Application()
            app.router.add_get("/metrics", _page)
            urls.append(await stack.enter_async_context(serving(app)))
        yield sorted(urls)


@asynccontextmanager
async def watched(resolve: Resolve, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[tuple[ModelDispatcher, list[int]]]:
    """The model's pool watched, its name answered by ``resolve``; the dispatcher, and how often ``synced`` was called."""
    monkeypatch.setattr(discovery, "resolve", resolve)
    config = parse_config({"models": [{"name": "m", "endpoints": [f"http://{NAME}:8000"], "dns_refresh_s": 0.05}]})
    dispatcher = build_runtimes(config, Telemetry())["m"].dispatcher
    synced: list[int] = []
    async with aiohttp.ClientSession() as session, probe_session() as probes:
        task = asyncio.create_task(discovery.watch_pool(session, probes, config.models[0], dispatcher,
                                                        lambda: synced.append(1)))
        try:
            yield dispatcher, synced
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def test_the_pool_grows_and_shrinks_with_the_names_addresses_and_is_empty_without_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hosts = tmp_path / "hosts.json"
    async with engines(2) as (one, two):
        write_hosts(hosts, {NAME: [one]})
        async with watched(resolver(hosts), monkeypatch) as (dispatcher, synced):
            await eventually(lambda: dispatcher.endpoints == (one,) and dispatcher.demand().ready == 1, what="one")
            assert synced == [1]  # the first lookup done: the processor is ready to serve
            write_hosts(hosts, {NAME: [one, two]})
            await eventually(lambda: dispatcher.demand().ready == 2, what="both scraped")
            write_hosts(hosts, {NAME: [two]})
            await eventually(lambda: dispatcher.endpoints == (two,), what="one left")
            # No address (a deployment scaled to zero): an empty pool, not the last addresses kept.
            write_hosts(hosts, {})
            await eventually(lambda: dispatcher.endpoints == (), what="empty")
            status = dispatcher.status(top=5)
            assert status.endpoints == () and status.known  # ready: it holds requests until an engine is up
            assert not dispatcher.serves() and dispatcher.demand().ready == 0
            write_hosts(hosts, {NAME: [one]})
            await eventually(lambda: dispatcher.demand().ready == 1, what="back")
            assert synced == [1]


async def test_a_lookup_that_fails_keeps_the_last_addresses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hosts = tmp_path / "hosts.json"
    async with engines(1) as (one,):
        write_hosts(hosts, {NAME: [one]})
        async with watched(resolver(hosts), monkeypatch) as (dispatcher, _):
            await eventually(lambda: dispatcher.demand().ready == 1, what="scraped")
            looked = [0]

            async def unreachable_dns(endpoint: str) -> list[str]:
                looked[0] += 1
                raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")

            monkeypatch.setattr(discovery, "resolve", unreachable_dns)
            await eventually(lambda: looked[0] >= 3, what="three failed lookups")
            assert dispatcher.endpoints == (one,) and dispatcher.serves()


async def test_a_name_that_never_resolved_is_one_member_reported_down_without_a_lookup(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first lookup failed (not NXDOMAIN): the name itself stands in, down, and the scraper never looks it up."""

    async def unreachable_dns(endpoint: str) -> list[str]:
        raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")

    async with watched(unreachable_dns, monkeypatch) as (dispatcher, synced):
        await eventually(lambda: dispatcher.status(top=5).endpoints[0].down, what="the name down")
        assert dispatcher.endpoints == (f"http://{NAME}:8000",) and synced == [1]
