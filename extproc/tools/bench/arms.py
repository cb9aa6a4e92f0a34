"""Benchmark arms: the ways requests reach the engine, as data.

An arm is a name, a gateway (straight to the simulator, Envoy alone, or
Envoy + extproc) and, for extproc, overrides merged into the generated config:
``model`` into every ``models[]`` entry (``{"policy": "vtc"}``,
``{"gate": {...}}``), ``top`` into the document's top level. A new policy or
gate variant is one more :class:`Arm` in :data:`ARMS`; an arm with
``instances > 1`` runs that many processors as one active-active cluster
sharing a Redis the runner starts for the run. The config it writes is
validated by ``extproc serve`` itself, so an arm the code does not support
fails at start with the config error's key path.
"""

from __future__ import annotations

import string
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from extproc.tools.procs import free_port
from extproc.tools.stack import Gateway

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
    # The engine's waiting-queue order (vLLM's --scheduling-policy; the simulator's too).
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    # Processor instances: more than one forms a cluster sharing a Redis (the runner starts it).
    instances: int = 1


DIRECT = Arm("direct-fifo", "direct", "clients straight to the engine: its FIFO queue decides")
# The gate comparison's static baselines are tuned by hand to the bench engine
# (scenarios.Engine: 16 sequences) at the default time scale (0.25): the best
# a static setting can do when someone measured the engine for it.
STATIC_CONCURRENCY = 16 + TARGET_WAITING
STATIC_RATE = 8.0  # released requests per wall-clock second: ~2 per model second, the gate-mix capacity
ARMS: tuple[Arm, ...] = (
    DIRECT,
    Arm("envoy", "envoy", "through Envoy without ext_proc (routing on the body's model): Envoy's own cost"),
    Arm("extproc-rr", "extproc", "Envoy + extproc, round-robin per tenant, adaptive gate (the defaults)"),
    Arm("extproc-vtc", "extproc", "Envoy + extproc, cost-weighted fair queueing (vtc), adaptive gate",
        model={"policy": "vtc"}),
    Arm("cluster-rr", "extproc", "2 extproc instances sharing Redis (active-active), round-robin, adaptive gate",
        instances=2),
    Arm("cluster-vtc", "extproc", "2 extproc instances sharing Redis (active-active), vtc, adaptive gate",
        model={"policy": "vtc"}, instances=2),
    Arm("gate-waiting", "extproc", "round-robin; gate: waiting_target (release while engine waiting < target)",
        model={"gate": "waiting_target"}),
    Arm("gate-static-concurrency", "extproc",
        f"round-robin; gate: static_concurrency, {STATIC_CONCURRENCY} in flight (hand-tuned: batch + target)",
        model={"gate": "static_concurrency", "max_in_flight": STATIC_CONCURRENCY}),
    Arm("gate-static-rate", "extproc",
        f"round-robin; gate: static_rate, {STATIC_RATE:g} req/s (hand-tuned to the gate-mix capacity)",
        model={"gate": "static_rate", "release_rate": STATIC_RATE}),
)
# Which arms a scenario runs unless it names its own: the fairness comparison.
FAIRNESS_ARMS = ("direct-fifo", "envoy", "extproc-rr", "extproc-vtc")
# One instance against two sharing Redis, on the same fairness scenarios:
# `--arms cluster` (direct FIFO runs anyway, as the baseline).
CLUSTER_ARMS = ("extproc-rr", "cluster-rr", "extproc-vtc", "cluster-vtc")
# The gate comparison (gate-mix): the release rules against each other, same policy.
GATE_ARMS = ("direct-fifo", "gate-static-concurrency", "gate-static-rate", "gate-waiting", "extproc-rr")


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


def arm_config(arm: Arm, tenants: Iterable[str], redis_url: str | None = None) -> dict[str, Any]:
    """The extproc config document for one run of ``arm``, on free loopback ports.

    A cluster arm (``instances > 1``) needs ``redis_url``; its instances are
    named a, b, ... and Envoy's generated config lists them all.
    """
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
    if arm.instances > 1:
        if redis_url is None:
            raise ValueError(f"arm {arm.name} runs {arm.instances} instances: it needs a redis_url")
        doc["cluster"] = {
            "redis_url": redis_url,
            "instances": {
                string.ascii_lowercase[i]: {"grpc": f"127.0.0.1:{free_port()}", "metrics": f"127.0.0.1:{free_port()}"}
                for i in range(arm.instances)
            },
        }
    return _merge(doc, arm.top)


def write_arm_config(path: Path, arm: Arm, tenants: Iterable[str], redis_url: str | None = None) -> Path:
    path.write_text(yaml.safe_dump(arm_config(arm, tenants, redis_url), sort_keys=False), encoding="utf-8")
    return path
