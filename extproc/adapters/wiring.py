"""Each model's dispatcher, built from the config: where settings become the core's plain values.

The core (dispatcher, release rules, policies, cost) never reads the config:
this module looks up the model's fairness policy and release rule by name and
hands over numbers, and the bands and tenants the config resolved into the
core's own types.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from extproc.adapters.config import Config, ModelConfig
from extproc.adapters.telemetry import Telemetry, TenantLabels
from extproc.adapters.timers import LoopTimers
from extproc.core.dispatcher import LiveSettings, ModelDispatcher
from extproc.core.policies import POLICIES
from extproc.core.release import RULES, RuleSettings
from extproc.core.release.pool import Pool

if TYPE_CHECKING:  # built by server.py only with a cluster: section
    from extproc.adapters.cluster.link import ClusterConnection


def rule_settings(model: ModelConfig) -> RuleSettings:
    """What ``model``'s release rule reads of its settings."""
    itl_ms = model.max_inter_token_latency_ms
    return RuleSettings(
        target_waiting=model.target_waiting,
        max_in_flight=model.max_in_flight,
        release_rate=model.release_rate,
        max_itl_s=None if itl_ms is None else itl_ms / 1000,
        max_kv_usage=model.max_kv_usage,
        itl_window_s=model.advanced.itl_window_s,
        max_running=model.max_running,
    )


def build_pool(model: ModelConfig) -> Pool:
    """The release side of ``model``'s pool: its rule by the config's ``gate:`` name, on the shared estimate."""
    return Pool(
        model.endpoints, RULES[model.gate], rule_settings(model),
        stale_after_s=model.advanced.stale_after_s,
        fallback_max_in_flight=model.advanced.fallback_max_in_flight,
        pick_endpoints=model.endpoint_picking,
    )


def tenant_labels(config: Config) -> TenantLabels:
    """Tenant label values: every tenant the config names, and the default tenant; all others are ``other``.

    A tenant is named under ``tenants:`` or as an API key's tenant (``envoy.api_keys``): an operator
    who listed a tenant's key expects its series by name, as the compose demo's do. Both are the
    operator's finite lists, so the label stays bounded; a JWT claim's values are not listed anywhere
    and stay ``other`` unless named under ``tenants:``.
    """
    return TenantLabels({*config.tenants, *config.envoy.api_keys.values(), config.identity.default_tenant})


def live_settings(config: Config, model: ModelConfig) -> LiveSettings:
    """What a reload hands ``model``'s live dispatcher (adapters/reload.py): the settings it takes in place."""
    return LiveSettings(
        bands=config.bands, tenant=config.tenant, cost=model.cost_weights(), max_queued=model.max_queued,
        max_queue_wait_s=model.max_queue_wait_s, reserved_waiting=model.waiting_kept(),
        rule=RULES[model.gate], rule_settings=rule_settings(model), engine_priority=engine_priority(model),
        cold_start_wait_s=model.cold_start_wait(),
    )


def engine_priority(model: ModelConfig) -> bool | None:
    """``engine_priority`` as the core takes it: on, off, or None for as the engines say (``auto``)."""
    return None if model.engine_priority == "auto" else model.engine_priority


def build_dispatcher(
    config: Config, model: ModelConfig, telemetry: Telemetry, clock: Callable[[], float] = time.monotonic,
    cluster: ClusterConnection | None = None,
) -> ModelDispatcher:
    """``model``'s dispatcher; with ``cluster``, its releases are decided by the cluster (a seat as its strategy)."""
    timers = LoopTimers(clock)
    report = telemetry.for_model(model.name, config.band_names, tenant_labels(config))
    dispatcher = ModelDispatcher(
        model.name, build_pool(model), config.bands, report, clock,
        policy=POLICIES[model.policy],
        timers=timers,
        tenant=config.tenant,
        cost=model.cost_weights(),
        max_queued=model.max_queued,
        max_queue_wait_s=model.max_queue_wait_s,
        reserved_waiting=model.waiting_kept(),
        max_preemptions_per_s=model.max_preemptions_per_s,
        engine_priority=engine_priority(model),
        cold_start_wait_s=model.cold_start_wait(),
        strategy=None if cluster is None else (lambda outlet: cluster.seat(model.name, outlet, timers)),
    )
    report.count_in_flight(lambda: dispatcher.in_flight)
    report.read_demand(dispatcher.demand)
    return dispatcher


def cluster_forms(config: Config) -> dict[str, str]:
    """Each model's policy's cluster form, by model name (the config refuses a policy without one)."""
    return {model.name: str(form) for model in config.models if (form := POLICIES[model.policy].cluster) is not None}
