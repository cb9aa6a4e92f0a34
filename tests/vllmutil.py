"""What the real-vLLM fixture (tests/conftest.py) and its tests share: the servers and their model names."""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest

from extproc.tools.realvllm import VllmUnavailable, vllm_python

# Served model names; the gateway's configs name the same models.
FCFS_MODEL = "tiny"
PRIORITY_MODEL = "tiny-prio"


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
