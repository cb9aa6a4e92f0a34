"""Fixtures: the real vLLM servers (session: started once for every test that needs them) and a Redis per test.

A vLLM server takes about 22 s to start on two cores (two processes
importing torch and vLLM), so each configuration runs once per session and the
tests share it; every configuration the run needs starts at once (``vllm_fleet``),
or before the run (tests/fleet.py). Idle, they use 2 % of a core each.

Also registers the property tests' hypothesis profiles (tests/propertyutil.py):
here, before hypothesis' plugin loads the one ``--hypothesis-profile`` names.
"""

from __future__ import annotations

import gc
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from tests.propertyutil import register_profiles
from tests.redisutil import RedisServer, redis_server_binary
from tests.vllmutil import (
    FCFS,
    FLEET_ENV,
    PRIORITY,
    VllmFleet,
    VllmServers,
    require_vllm,
    servers_of,
    start_fleet,
    stop_fleet,
)

register_profiles()


def pytest_collection_finish() -> None:
    """What collection built (every imported module, every test item) goes to gc's permanent generation.

    None of it is garbage, and a full collection would walk all of it: each
    ``gc.collect()`` the garbage and shutdown tests make cost 0.15 s of CPU.
    """
    gc.freeze()


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def vllm_fleet(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[VllmFleet]:
    """Every server named in ``VLLM_SERVERS`` by a module of the run's tests on it, all started at once.

    Where ``EXTPROC_VLLM_FLEET`` names the file of servers already running
    (``python -m tests.fleet FILE``, which .ci/run starts while its first test
    run goes on), those are used instead, and left running. A skip that says
    why where there is no vLLM here (``require_vllm``).
    """
    require_vllm()
    modules = dict.fromkeys(getattr(item, "module", None) for item in request.session.items
                            if "vllm_fleet" in getattr(item, "fixturenames", ()))
    servers = servers_of(modules)
    if prestarted := os.environ.get(FLEET_ENV):
        fleet = VllmFleet.load(Path(prestarted))
        for server in servers:
            fleet.url(server)  # fails the test now if the file lacks one
        yield fleet
        return
    fleet, running = await start_fleet(servers, tmp_path_factory.mktemp("vllm"))
    try:
        yield fleet
    finally:
        await stop_fleet(running)


@pytest.fixture(scope="session")
def vllm(vllm_fleet: VllmFleet) -> VllmServers:
    """The pair most tests share (4 sequences each): vLLM's default order, and its priority scheduler."""
    return VllmServers(vllm_fleet.url(FCFS), vllm_fleet.url(PRIORITY))


@pytest_asyncio.fixture
async def redis_server(tmp_path: Path) -> AsyncIterator[RedisServer]:
    """A Redis of the test's own (empty, no persistence, a free port; ``.url`` for ``cluster.redis_url``).

    Skipped, with the reason, where Debian's redis-server is not installed
    (failed under ``EXTPROC_REDIS=require``). A test may stop, kill and start
    it again: it comes back on the same port.
    """
    server = RedisServer(tmp_path / "redis", binary=redis_server_binary())
    await server.start()
    try:
        yield server
    finally:
        await server.stop()
