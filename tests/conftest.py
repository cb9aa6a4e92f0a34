"""Fixtures: the real vLLM servers (session: started once for every test that needs them) and a Redis per test.

A vLLM server takes about 22 s to start on two cores (two processes
importing torch and vLLM), so each configuration runs once per session and the
tests share it. Both start concurrently: about 30 s for the two. Idle, they
use 2 % of a core.

Also registers the property tests' hypothesis profiles (tests/propertyutil.py):
here, before hypothesis' plugin loads the one ``--hypothesis-profile`` names.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from extproc.tools.procs import ManagedProcess, free_port
from extproc.tools.realvllm import start_vllm
from tests.propertyutil import register_profiles
from tests.redisutil import RedisServer, redis_server_binary
from tests.vllmutil import FCFS_MODEL, PRIORITY_MODEL, VllmServers, require_vllm

register_profiles()


def pytest_collection_finish() -> None:
    """What collection built (every imported module, every test item) goes to gc's permanent generation.

    None of it is garbage, and a full collection would walk all of it: each
    ``gc.collect()`` the garbage and shutdown tests make cost 0.15 s of CPU.
    """
    gc.freeze()


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def vllm(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[VllmServers]:
    """Both servers (4 sequences each), or a skip that says why there is no vLLM here (``require_vllm``)."""
    require_vllm()
    workdir = tmp_path_factory.mktemp("vllm")
    ports = free_port(), free_port()
    started = await asyncio.gather(
        start_vllm(FCFS_MODEL, ports[0], workdir),
        start_vllm(PRIORITY_MODEL, ports[1], workdir, scheduling_policy="priority"),
        return_exceptions=True,
    )
    servers = [s for s in started if isinstance(s, ManagedProcess)]
    try:
        for outcome in started:
            if isinstance(outcome, BaseException):
                raise outcome
        yield VllmServers(*(f"http://127.0.0.1:{port}" for port in ports))
    finally:
        for server in servers:
            await server.stop()


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
