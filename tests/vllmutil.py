"""What the real-vLLM fixture (tests/conftest.py) and its tests share: the servers and their model names."""

from __future__ import annotations

from dataclasses import dataclass

# Served model names; the gateway's configs name the same models.
FCFS_MODEL = "tiny"
PRIORITY_MODEL = "tiny-prio"


@dataclass(frozen=True)
class VllmServers:
    """Base URLs of the two servers: vLLM's default order, and ``--scheduling-policy priority``."""

    fcfs: str
    priority: str
