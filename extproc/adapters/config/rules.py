"""The rules between fields: what no single value's type can say, checked once the values are well-typed.

Each rule is a function of one struct (a section, or the whole file),
yielding ``(key, message)`` per problem, the key relative to the struct (an
empty key names the struct itself). :data:`RULES` is the table validate.py
runs them from, each once its struct's own fields have converted: so a
second run may find more, once the type errors are fixed.

The TLS files are loaded here too, so a wrong certificate is refused with its
key path before the server binds a port.
"""

from __future__ import annotations

import re

from extproc.adapters.config.batches import BatchSettings, batch_file_problems, batch_problems
from extproc.adapters.config.budgets import PriceSettings, budget_problems, price_problems
from extproc.adapters.config.instances import ClusterInstance, ClusterSettings, Shard
from extproc.adapters.config.resolve import DEFAULT_TENANT_KEY, tenants
from extproc.adapters.config.schema import (
    ConfigFile,
    CostSettings,
    EnvoySettings,
    JwtSettings,
    ModelConfig,
    TenantSettings,
    TlsSettings,
)
from extproc.adapters.config.tls import TlsFileError, load_context
from extproc.adapters.config.validate import Problems, Rules
from extproc.adapters.protocol.dialects import DIALECTS
from extproc.core import release
from extproc.core.policies import POLICIES

SHARD_NAME = r"[A-Za-z0-9_-]+"
# Cluster instance names follow the shard rule: safe in file names, metric labels and Redis keys.
INSTANCE_NAME = SHARD_NAME


def _tls_files(tls: TlsSettings) -> Problems:
    """The certificate, key and client CA load, and the key matches the certificate."""
    try:
        load_context(tls.cert_file, tls.key_file, tls.client_ca_file)
    except TlsFileError as exc:
        yield exc.key, exc.message


def _cost(cost: CostSettings) -> Problems:
    if cost.input_weight == 0 and cost.output_weight == 0:
        # Every request would cost nothing: vtc's counters would never move.
        yield "", "input_weight and output_weight cannot both be 0"


def _model(model: ModelConfig) -> Problems:
    """What the model's gate needs, what endpoint picking needs, a stream check's engine, and a cached token's price."""
    rule = release.RULES[model.gate]
    for required in rule.requires:
        if getattr(model, required) is None:
            yield required, f"is required with gate: {rule.name}"
    if model.endpoint_picking and not rule.per_endpoint:
        yield "endpoint_picking", f"does not work with gate: {rule.name} (no per-endpoint state)"
    if model.endpoint_picking and any(e.startswith("https:") for e in model.endpoints):
        yield "endpoint_picking", "needs http:// endpoints (the picked-endpoint cluster is plain HTTP)"
    if model.check_stream_start and DIALECTS[model.engine].stream_refusal is None:
        yield "check_stream_start", f"engine {model.engine} has no queue cap: it never refuses a stream inside a 200"
    if model.prefix is not None and model.prefix.cached_input_weight > model.cost.input_weight:
        yield "prefix.cached_input_weight", (f"must not exceed cost.input_weight ({model.cost.input_weight:g}): "
                                             "a cached prompt token costs the engine less, not more")


def _jwt(jwt: JwtSettings) -> Problems:
    if (jwt.jwks is None) == (jwt.jwks_uri is None):
        yield "", "needs exactly one of jwks (an inline JWKS) or jwks_uri (where Envoy fetches it)"


def _envoy(envoy: EnvoySettings) -> Problems:
    """One identity scheme; the processor's client certificate and key together."""
    if envoy.api_keys and envoy.jwt is not None:
        yield "jwt", "use either api_keys or jwt for identity, not both"
    if envoy.processor_client_cert_file is None and envoy.processor_client_key_file is not None:
        yield "processor_client_cert_file", "is required with processor_client_key_file"
    if envoy.processor_client_key_file is None and envoy.processor_client_cert_file is not None:
        yield "processor_client_key_file", "is required with processor_client_cert_file"


def _cluster(cluster: ClusterSettings) -> Problems:
    if cluster.heartbeat_s is not None and cluster.heartbeat_s >= cluster.lease_s / 2:
        # One late heartbeat must not let a live instance's lease lapse.
        yield "heartbeat_s", f"must be below lease_s / 2 ({cluster.lease_s / 2:g}), got {cluster.heartbeat_s:g}"
    for name in cluster.instances:
        if not re.fullmatch(INSTANCE_NAME, name):
            yield f"instances.{name}", "an instance name may only use A-Z, a-z, 0-9, _ and -"


def _file(file: ConfigFile) -> Problems:
    """The rules between sections: shards and cluster, the classes every section names, the tenants' entitlements."""
    yield from _shard_problems(file)
    yield from batch_file_problems(file.batches, bool(file.shards), file.cluster)
    for key in ("processor_ca_file", "processor_client_cert_file", "processor_client_key_file"):
        if file.listen.tls is None and getattr(file.envoy, key) is not None:
            yield f"envoy.{key}", "needs listen.tls (the processor's gRPC port is plaintext without it)"
    if file.cluster is not None:
        yield from _address_problems("cluster.instances", file.cluster.instances)
    if file.cluster is not None and file.shards:
        yield "cluster", ("use either cluster: (active-active) or shards: (per-model sharding), not both "
                          "(docs/cluster.md)")
    for i, model in enumerate(file.models):
        if file.cluster is not None and POLICIES[model.policy].cluster is None:
            # The cluster's script runs a policy's cluster form, not its own pick (core/policies/base.py).
            forms = ", ".join(n for n, p in POLICIES.items() if p.cluster is not None)
            yield f"models[{i}].policy", (f"{model.policy} has no cluster form, so a cluster cannot run it: "
                                          f"use {forms} (docs/cluster.md)")
        if file.cluster is not None and model.gate == "static_rate":
            # A rate is not a count in flight: there is nothing to lease, so no share to keep.
            yield f"models[{i}].gate", ("static_rate cannot be shared by a cluster: use adaptive, waiting_target "
                                        "or static_concurrency (docs/cluster.md)")
    classes = file.priorities
    if len(set(classes)) != len(classes):
        yield "priorities", f"must not repeat a class, got {list(classes)}"
    if file.default_priority is not None and file.default_priority not in classes:
        yield "default_priority", f"must be one of priorities {list(classes)}, got {file.default_priority!r}"
    yield from _name_problems(file)
    if file.budgets is not None:
        yield from ((f"budgets.{key}", message) for key, message in budget_problems(file.budgets, (m.name for m in file.models)))
    for objective, band in file.identity.objectives.items():
        if band not in classes:
            yield f"identity.objectives.{objective}", f"must be one of priorities {list(classes)}, got {band!r}"
    for name in file.bands:
        if name not in classes:
            yield f"bands.{name}", f"unknown key (allowed: {', '.join(sorted(classes))})"
    wrong = [p for name, tenant in file.tenants.items() for p in _tenant_problems(tenant, f"tenants.{name}", classes)]
    yield from wrong
    if not wrong and (file.default_priority is None or file.default_priority in classes):
        yield from _entitlement_problems(file)


def _name_problems(file: ConfigFile) -> Problems:
    """A model name (or exact served name) belongs to one model: requests for it must find one gate."""
    owner: dict[str, int] = {}
    for i, model in enumerate(file.models):
        for key, name in [("name", model.name), *((f"served_names[{j}]", n) for j, n in enumerate(model.served_names))]:
            if name in owner and (owner[name] != i or key == "name"):
                yield f"models[{i}].{key}", f"duplicate model name {name!r} (models[{owner[name]}] serves it)"
            owner.setdefault(name, i)


def _shard_problems(file: ConfigFile) -> Problems:
    """With shards, every model has exactly one owner and no two instances share an address."""
    if not file.shards:
        return
    names = {m.name for m in file.models}
    owner: dict[str, str] = {}
    for shard, settings in file.shards.items():
        if not re.fullmatch(SHARD_NAME, shard):
            yield f"shards.{shard}", "a shard name may only use A-Z, a-z, 0-9, _ and - (it names an Envoy cluster)"
        for i, owned in enumerate(settings.models):
            if owned not in names:
                yield f"shards.{shard}.models[{i}]", f"no model {owned!r} in models"
            elif owned in owner:
                yield f"shards.{shard}.models[{i}]", f"model {owned!r} is already owned by shard {owner[owned]!r}"
            else:
                owner[owned] = shard
    yield from _address_problems("shards", file.shards)
    for i, model in enumerate(file.models):
        if model.name not in owner:
            yield f"models[{i}].name", f"{model.name!r} is in no shard (with shards, every model needs one)"


def _address_problems(section: str, instances: dict[str, Shard] | dict[str, ClusterInstance]) -> Problems:
    """No two instances (nor one instance's two listeners) on the same address."""
    seen: dict[str, str] = {}
    for name, settings in instances.items():
        for key in ("grpc", "metrics", "batches"):
            address = getattr(settings, key, None)
            if address is None:
                continue
            if address in seen:
                yield f"{section}.{name}.{key}", f"{address} is already used by {seen[address]}"
            seen[address] = f"{section}.{name}.{key}"


def _tenant_problems(tenant: TenantSettings, path: str, classes: tuple[str, ...]) -> Problems:
    """A tenant may only name the configured classes."""
    for i, name in enumerate(tenant.priorities or ()):
        if name not in classes:
            yield f"{path}.priorities[{i}]", f"must be one of priorities {list(classes)}, got {name!r}"
    if tenant.default_priority is not None and tenant.default_priority not in classes:
        yield f"{path}.default_priority", f"must be one of priorities {list(classes)}, got {tenant.default_priority!r}"


def _entitlement_problems(file: ConfigFile) -> Problems:
    """A tenant's default band, inherited or not, must be one it may use."""
    template, named = tenants(file)
    for name, tenant in ((DEFAULT_TENANT_KEY, template), *named.items()):
        if tenant.default_band not in tenant.bands:
            yield (f"tenants.{name}.default_priority",
                   f"{tenant.default_band!r} is not among the tenant's priorities {list(tenant.bands)}; "
                   "set default_priority")


RULES: Rules = {
    BatchSettings: batch_problems,
    TlsSettings: _tls_files,
    CostSettings: _cost,
    ModelConfig: _model,
    JwtSettings: _jwt,
    EnvoySettings: _envoy,
    ClusterSettings: _cluster,
    PriceSettings: price_problems,
    ConfigFile: _file,
}
