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

from extproc.adapters.config import parse_config
from extproc.tools.procs import free_port
from extproc.tools.stack import Gateway

MODEL = "bench-model"
# The classes every arm's config names, highest first.
PRIORITIES = ("interactive", "standard", "batch")
# The project's default: a few requests wait in the engine so it never runs dry.
# Everything else is left at its default too, in wall-clock time, including the
# 100 ms scrape interval: at time scale 0.25 the gate reacts 4x slower relative
# to the engine than in production, a handicap for the gateway, not a help.
# (Scraping faster would not fix that: rendering the simulator's /metrics page
# costs ~2 ms of its CPU, and at 40 scrapes/s it slowed the simulated GPU by 4%.)
TARGET_WAITING = 3
# An interactive objective a few times the unloaded TTFT (the benchmark's engines: 0.1 s or less),
# under which a full engine puts every arrival at risk: preemption at its most eager.
TIGHT_OBJECTIVE_S = 0.25
TIGHT_OBJECTIVE = {"bands": {"interactive": {"ttft_objective_s": TIGHT_OBJECTIVE_S}}}


@dataclass(frozen=True)
class Arm:
    name: str
    gateway: Gateway
    description: str
    model: Mapping[str, Any] = field(default_factory=dict)
    top: Mapping[str, Any] = field(default_factory=dict)
    # The engine's waiting-queue order (vLLM's --scheduling-policy; the simulator's too).
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    # Straight to the engine: each request's class written as the body's `priority` (its place in the bench's
    # priorities, lower first), as a client of vLLM's priority scheduling writes it.
    body_priority: bool = False
    # More of the simulator's options (`extproc-dev sim`).
    sim_args: tuple[str, ...] = ()
    # Processor instances: more than one forms a cluster sharing a Redis (the runner starts it).
    instances: int = 1


DIRECT = Arm("direct-fifo", "direct", "clients straight to the engine: its FIFO queue decides")
DIRECT_PRIORITY = Arm("direct-priority", "direct",
                      "clients straight to an engine that orders its waiting queue by the body's priority (vLLM's "
                      "--scheduling-policy priority), each class's place written there: no tenants, no preemption",
                      scheduling_policy="priority", body_priority=True)
# The gate comparison's static baselines are tuned by hand to the bench engine
# (scenarios.Engine: 16 sequences) at the default time scale (0.25): the best
# a static setting can do when someone measured the engine for it.
STATIC_CONCURRENCY = 16 + TARGET_WAITING
STATIC_RATE = 8.0  # released requests per wall-clock second: ~2 per model second, the gate-mix capacity
ARMS: tuple[Arm, ...] = (
    DIRECT,
    DIRECT_PRIORITY,
    Arm("envoy", "envoy", "through Envoy without ext_proc (routing on the body's model): Envoy's own cost"),
    Arm("extproc-rr", "extproc", "Envoy + extproc, round-robin per tenant, adaptive gate (the defaults)"),
    Arm("extproc-vtc", "extproc", "Envoy + extproc, cost-weighted fair queueing (vtc), adaptive gate",
        model={"policy": "vtc"}),
    Arm("extproc-no-preempt", "extproc", "as extproc-rr with preemption off (max_preemptions_per_s: 0)",
        model={"max_preemptions_per_s": 0}),
    Arm("extproc-preempt", "extproc",
        "as extproc-rr, preempting batch requests for interactive ones (max_preemptions_per_s: 2, the default)",
        model={"max_preemptions_per_s": 2}),
    Arm("extproc-preempt-tight", "extproc",
        f"as extproc-preempt, with interactive's objective at {TIGHT_OBJECTIVE_S:g} s instead of 5 s",
        model={"max_preemptions_per_s": 2}, top=TIGHT_OBJECTIVE),
    Arm("extproc-engine-priority", "extproc",
        "as extproc-rr on an engine with a priority queue (--scheduling-policy priority) that says so (vLLM's "
        "/server_info, --dev-mode): the gateway learns it and writes each class's priority into the body "
        "(engine_priority: auto, the default)", scheduling_policy="priority", sim_args=("--dev-mode",)),
    Arm("extproc-locality", "extproc",
        "Envoy + extproc, locality-aware fair queueing (policy: locality: the longest expected prefix-cache hit "
        "first within a deficit quantum of vtc's share)", model={"policy": "locality"}),
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
# The priority comparison: straight to the engine (its FIFO queue, its priority queue) and the gateway in front of each.
PRIORITY_QUEUE_ARMS = ("direct-fifo", "direct-priority", "extproc-rr", "extproc-engine-priority")
# Which arms a scenario runs unless it names its own: the fairness comparison.
FAIRNESS_ARMS = ("direct-fifo", "envoy", "extproc-rr", "extproc-vtc")
# Preemption of the batch class: straight to the engine, the gateway without it and with it.
PREEMPTION_ARMS = ("direct-fifo", "extproc-no-preempt", "extproc-preempt", "extproc-preempt-tight")
# A batch-only load (work conservation): the engine alone, Envoy alone (its own cost) and the gateway.
CONSERVATION_ARMS = ("direct-fifo", "envoy", "extproc-rr")
# One instance against two sharing Redis, on the same fairness scenarios:
# `--arms cluster` (direct FIFO runs anyway, as the baseline).
CLUSTER_ARMS = ("extproc-rr", "cluster-rr", "extproc-vtc", "cluster-vtc")
# Prefix locality: the two fair policies against the locality-aware one (direct FIFO, or Envoy's own
# balancing across replicas, as the baseline).
LOCALITY_ARMS = ("direct-fifo", "envoy", "extproc-rr", "extproc-vtc", "extproc-locality")
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


def arm_config(
    arm: Arm, tenants: Iterable[str], redis_url: str | None = None, scenario: Mapping[str, Any] | None = None,
    *, replicas: int = 1, model_settings: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The extproc config document for one run of ``arm``, on free loopback ports.

    A cluster arm (``instances > 1``) needs ``redis_url``; its instances are
    named a, b, ... and Envoy's generated config lists them all. ``scenario``
    is the scenario's own top-level config (its tenants' entitlements), merged
    before the arm's; ``model_settings`` its settings for the model (merged
    before the arm's), on ``replicas`` endpoints.
    """
    model = {"name": MODEL, "endpoints": [f"http://127.0.0.1:{free_port()}" for _ in range(replicas)],
             "target_waiting": TARGET_WAITING, **(model_settings or {})}
    doc = {
        "listen": {"grpc": f"127.0.0.1:{free_port()}", "metrics": f"127.0.0.1:{free_port()}"},
        "priorities": list(PRIORITIES),
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
    return _merge(_merge(doc, scenario or {}), arm.top)


def band_objectives(doc: Mapping[str, Any]) -> dict[str, float]:
    """Each band's TTFT objective (s) as the processor resolves ``doc``: written or defaulted; bands without none."""
    return {band.name: band.ttft_objective_s for band in parse_config(dict(doc)).bands
            if band.ttft_objective_s is not None}


def scale_objectives(doc: Mapping[str, Any], time_scale: float) -> dict[str, Any]:
    """``doc`` with every band's TTFT objective (and floor) multiplied by ``time_scale``.

    The benchmark's objectives are model seconds, like every duration of a
    scenario; the processor keeps them on its wall clock, so a simulator run
    faster than real time (0.25) needs them 4x shorter to mean the same.
    """
    if time_scale == 1:
        return dict(doc)
    bands: dict[str, Any] = {}
    for band in parse_config(dict(doc)).bands:
        scaled = {key: value * time_scale for key in ("ttft_objective_s", "min_ttft_objective_s")
                  if (value := getattr(band, key)) is not None}
        if scaled:
            bands[band.name] = scaled
    return _merge(dict(doc), {"bands": bands})


def write_config(path: Path, doc: Mapping[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(dict(doc), sort_keys=False), encoding="utf-8")
    return path
