"""What the real-vLLM fixtures (tests/conftest.py) and their tests share: the servers, how each is started, their names.

A module with tests on a real vLLM names every server they use in
``VLLM_SERVERS``: the session fixture ``vllm_fleet`` starts all the servers
the run's modules name at once, as the first test that needs one starts.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import pytest

from extproc.tools.realvllm import ModelSize, SchedulingPolicy, VllmUnavailable, vllm_python

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


@dataclass(frozen=True)
class VllmServers:
    """Base URLs of the two servers: vLLM's default order, and ``--scheduling-policy priority``."""

    fcfs: str
    priority: str


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
