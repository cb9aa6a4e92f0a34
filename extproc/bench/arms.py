"""Benchmark arms: the ways requests reach the engine, as data.

An arm is a name, a gateway (straight to the simulator, Envoy alone, or
Envoy + extproc) and, for extproc, overrides merged into the generated config:
``model`` into every ``models[]`` entry (``{"policy": "vtc"}``,
``{"gate": {...}}``), ``top`` into the document's top level. A new policy or
gate variant is one more :class:`Arm` in :data:`ARMS`; the config it writes is
validated by ``extproc serve`` itself, so an arm the code does not support
fails at start with the config error's key path.
"""

from __future__ import annotations

import socket
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from extproc.stack import Gateway

MODEL = "bench-model"
# The project's default: a few requests wait in the engine so it never runs dry.
# Everything else is left at its default too, in wall-clock time, including the
# 100 ms scrape interval: at time scale 0.25 the gate reacts 4x slower relative
# to the engine than in production, a handicap for the gateway, not a help.
# (Scraping faster would not fix that: rendering the simulator's /metrics page
# costs ~2 ms of its CPU, and at 40 scrapes/s it slowed the simulated GPU by 4%.)
TARGET_WAITING = 3


@dataclass(frozen=True)
class Arm:
    name: str
    gateway: Gateway
    description: str
    model: Mapping[str, Any] = field(default_factory=dict)
    top: Mapping[str, Any] = field(default_factory=dict)


DIRECT = Arm("direct-fifo", "direct", "clients straight to the engine: its FIFO queue decides")
ARMS: tuple[Arm, ...] = (
    DIRECT,
    Arm("envoy", "envoy", "through Envoy without ext_proc (routing on the body's model): Envoy's own cost"),
    Arm("extproc-rr", "extproc", "Envoy + extproc, round-robin per tenant, gate on the engine's waiting queue"),
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def api_key(tenant: str) -> str:
    return f"key-{tenant}"


def _merge(base: dict[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``overrides`` merged in, recursively for nested mappings."""
    merged = dict(base)
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def arm_config(arm: Arm, tenants: Iterable[str]) -> dict[str, Any]:
    """The extproc config document for one run of ``arm``, on free loopback ports."""
    model = {"name": MODEL, "endpoints": [f"http://127.0.0.1:{free_port()}"], "target_waiting": TARGET_WAITING}
    doc = {
        "listen": {"grpc": f"127.0.0.1:{free_port()}", "metrics": f"127.0.0.1:{free_port()}"},
        "priorities": ["interactive", "standard", "batch"],
        "default_priority": "standard",
        "models": [_merge(model, arm.model)],
        "envoy": {
            "listen": f"127.0.0.1:{free_port()}",
            "admin": f"127.0.0.1:{free_port()}",
            "api_keys": {api_key(t): t for t in tenants},
        },
    }
    return _merge(doc, arm.top)


def write_arm_config(path: Path, arm: Arm, tenants: Iterable[str]) -> Path:
    path.write_text(yaml.safe_dump(arm_config(arm, tenants), sort_keys=False), encoding="utf-8")
    return path
