"""What the real-vLLM fixtures (tests/conftest.py) and their tests share: the servers, how each is started, their names.

A module with tests on a real vLLM names every server they use in
``VLLM_SERVERS``: the session fixture ``vllm_fleet`` starts all the servers
the run's modules name at once, as the first test that needs one starts.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Awaitable, Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import pytest

from extproc.tools.procs import ManagedProcess, free_port
from extproc.tools.realvllm import ModelSize, SchedulingPolicy, VllmUnavailable, model_info_dir, start_vllm, vllm_python

# Names a file written by ``python -m tests.fleet FILE``: the servers already run, ``vllm_fleet`` uses them.
FLEET_ENV = "EXTPROC_VLLM_FLEET"

# Served model names; the gateway's configs name the same models.
FCFS_MODEL = "tiny"
PRIORITY_MODEL = "tiny-prio"


@dataclass(frozen=True)
class VllmServer:
    """One server: the name it serves its model as, and ``start_vllm``'s settings for it."""

    name: str
    size: ModelSize = "tiny"
    max_num_seqs: int = 4
    scheduling_policy: SchedulingPolicy = "fcfs"
    max_num_queued_reqs: int | None = None
    max_num_queued_tokens: int | None = None


# The pair the session fixture ``vllm`` hands out (a module whose tests use it names both).
FCFS = VllmServer(FCFS_MODEL)
PRIORITY = VllmServer(PRIORITY_MODEL, scheduling_policy="priority")


@dataclass(frozen=True)
class VllmFleet:
    """The session's running servers (``vllm_fleet``, tests/conftest.py): each one's base URL."""

    urls: Mapping[VllmServer, str]

    def url(self, server: VllmServer) -> str:
        if server not in self.urls:
            pytest.fail(f"no {server} was started: name it in the VLLM_SERVERS of the module that uses it")
        return self.urls[server]

    def save(self, path: Path) -> None:
        """Write the fleet for another process (``tests/fleet.py``), atomically: a reader sees all of it or nothing."""
        part = path.with_name(path.name + ".part")
        part.write_text(json.dumps([{"server": asdict(server), "url": url} for server, url in self.urls.items()]))
        part.replace(path)

    @classmethod
    def load(cls, path: Path) -> VllmFleet:
        """The fleet another process saved in ``path``."""
        return cls({VllmServer(**entry["server"]): entry["url"] for entry in json.loads(path.read_text())})


@dataclass(frozen=True)
class VllmServers:
    """Base URLs of the two servers: vLLM's default order, and ``--scheduling-policy priority``."""

    fcfs: str
    priority: str


def servers_of(modules: Iterable[object]) -> list[VllmServer]:
    """Every server the ``VLLM_SERVERS`` of ``modules`` name, each once, in their order."""
    return list(dict.fromkeys(server for module in modules for server in getattr(module, "VLLM_SERVERS", ())))


async def start_fleet(servers: list[VllmServer], workdir: Path) -> tuple[VllmFleet, list[ManagedProcess]]:
    """Start ``servers`` at once; if one fails, stop the others and raise its error.

    Start-up is mostly one core importing torch and vLLM for each server:
    on two cores, five servers started together are up sooner than started
    one by one. Where vLLM's model-info files are not there yet (a new
    machine), one server starts first and writes them: the others read them
    instead of each importing vLLM a second time to learn them (8 s of CPU
    a server).
    """
    ports = [free_port() for _ in servers]

    def start(server: VllmServer, port: int) -> Awaitable[ManagedProcess]:
        return start_vllm(server.name, port, workdir, size=server.size, max_num_seqs=server.max_num_seqs,
                          scheduling_policy=server.scheduling_policy, max_num_queued_reqs=server.max_num_queued_reqs,
                          max_num_queued_tokens=server.max_num_queued_tokens)

    infos = model_info_dir()
    pending = list(zip(servers, ports, strict=True))
    started: list[ManagedProcess | BaseException] = []
    if pending and not (infos.is_dir() and any(infos.iterdir())):
        started += await asyncio.gather(start(*pending.pop(0)), return_exceptions=True)
    started += await asyncio.gather(*(start(server, port) for server, port in pending), return_exceptions=True)
    running = [s for s in started if isinstance(s, ManagedProcess)]
    for outcome in started:
        if isinstance(outcome, BaseException):
            await stop_fleet(running)
            raise outcome
    return VllmFleet({server: f"http://127.0.0.1:{port}" for server, port in zip(servers, ports, strict=True)}), running


async def stop_fleet(running: list[ManagedProcess]) -> None:
    """Stop the servers together: each takes about 2 s to exit."""
    await asyncio.gather(*(server.stop() for server in running))


def require_vllm() -> None:
    """Skip the test when there is no vLLM here, saying why; with ``EXTPROC_VLLM=require`` (CI) fail instead.

    In CI vLLM was installed on purpose, and a skip would hide that it is gone.
    """
    try:
        vllm_python()
    except VllmUnavailable as exc:
        if os.environ.get("EXTPROC_VLLM") == "require":
            pytest.fail(f"EXTPROC_VLLM=require: {exc}")
        pytest.skip(str(exc))
