"""What the program reads: the file's structs resolved into :class:`Config` and the core's types.

The defaults that depend on other settings are filled in here, once: a band's
on its place among the priorities, a tenant's on the ``default`` entry, a
locality model's ``prefix:`` section. A band and a tenant resolve straight
into the core's own types (:class:`~extproc.core.bands.Band`,
:class:`~extproc.core.entitlement.Tenant`), field by field by name.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import urlsplit

import msgspec

from extproc.adapters.config.advanced import AdvancedSettings
from extproc.adapters.config.batches import BatchSettings
from extproc.adapters.config.budgets import BudgetSettings
from extproc.adapters.config.instances import ClusterSettings, Shard
from extproc.adapters.config.schema import (
    BandSettings,
    ConfigFile,
    EndpointPickerSettings,
    EnvoySettings,
    Identity,
    Listen,
    ModelConfig,
    PrefixSettings,
    TenantSettings,
)
from extproc.core.bands import Band
from extproc.core.entitlement import Tenant

# The per-tenant template in `tenants:`; its fields are every other tenant's defaults.
DEFAULT_TENANT_KEY = "default"


class ConfigError(ValueError):
    """Configuration values are missing or wrong; each line names a key path."""

    def __init__(self, *errors: str) -> None:
        super().__init__("\n".join(errors))
        self.errors = errors


@dataclass(frozen=True)
class Config:
    """The configuration as the program uses it: each band's settings resolved, each tenant's inherited.

    The file's own shape (:class:`ConfigFile`) keeps what was written, so
    errors can name its keys; this view is what everything else reads, so no
    reader repeats the defaults or the inheritance.
    """

    listen: Listen
    identity: Identity
    # The bands' names, highest first.
    band_names: tuple[str, ...]
    models: tuple[ModelConfig, ...]
    envoy: EnvoySettings
    # One per band, in the order of `band_names`.
    bands: tuple[Band, ...]
    # Explicitly configured tenants; every other tenant gets `default_tenant`.
    tenants: dict[str, Tenant]
    default_tenant: Tenant
    # Per-model sharding (empty: one processor owns every model).
    shards: dict[str, Shard] = field(default_factory=dict)
    # Active-active (None: this instance alone schedules its models).
    cluster: ClusterSettings | None = None
    endpoint_picker: EndpointPickerSettings = field(default_factory=EndpointPickerSettings)
    advanced: AdvancedSettings = field(default_factory=AdvancedSettings)
    # Tenant budgets (None: none; adapters/budgets/plan.py resolves them into the core's plan).
    budgets: BudgetSettings | None = None
    # OpenAI's Batch API (None: not served).
    batches: BatchSettings | None = None

    def model(self, name: str) -> ModelConfig | None:
        return next((m for m in self.models if m.name == name), None)

    def tenant(self, name: str) -> Tenant:
        return self.tenants.get(name, self.default_tenant)

    def longest_queue_wait_s(self, model: ModelConfig) -> float:
        """The longest any request may stay queued for ``model``, whatever its band: a class's wait, or the cold start's."""
        return max(model.cold_start_wait(), *(band.queue_wait_s(model.max_queue_wait_s) for band in self.bands))

    def envoy_problems(self) -> list[str]:
        """What only the generated Envoy config needs, each with its key path (envoy-config refuses, check-config reports).

        ``serve`` does not refuse these: behind a gateway that writes its own
        Envoy config (docs/epp.md) the processor may ask any client for a
        certificate, and it reads every endpoint whatever its scheme.
        """
        problems = []
        tls = self.listen.tls
        if tls is not None and tls.client_ca_file is not None and self.envoy.processor_client_cert_file is None:
            problems.append("envoy.processor_client_cert_file: is required with listen.tls.client_ca_file "
                            "(the processor asks Envoy for a certificate)")
        problems += [f"models[{i}].endpoints: mixes http and https; use one scheme per model"
                     for i, model in enumerate(self.models) if len({urlsplit(e).scheme for e in model.endpoints}) > 1]
        return problems

    def shard_of(self, model: str) -> str | None:
        """The shard that owns ``model`` (None without shards)."""
        return next((name for name, shard in self.shards.items() if model in shard.models), None)

    def for_shard(self, name: str | None) -> Config:
        """What one instance serves: with shards, ``name``'s models on ``name``'s addresses.

        Without shards, ``name`` must be None; with shards it is required, so
        an instance can neither serve every model by accident nor a shard
        that does not exist.
        """
        if not self.shards:
            if name is not None:
                raise ConfigError(f"--shard {name}: the config has no shards: section")
            return self
        choices = ", ".join(self.shards)
        if name is None:
            raise ConfigError(f"shards: the config is sharded; run each instance with --shard NAME (one of: {choices})")
        shard = self.shards.get(name)
        if shard is None:
            raise ConfigError(f"--shard {name}: no such shard in shards: (one of: {choices})")
        models = tuple(m for m in self.models if m.name in shard.models)
        return replace(self, listen=msgspec.structs.replace(self.listen, grpc=shard.grpc, metrics=shard.metrics),
                       models=models)

    def for_instance(self, name: str | None) -> Config:
        """What one active-active instance serves: the same models, on ``name``'s addresses.

        With ``cluster.instances`` listed, ``name`` picks the instance's
        ``listen``; without ``name`` the file's own ``listen`` is used, so N
        files identical except ``listen`` work as well. A name the file does
        not list is refused rather than ignored: the instance would
        otherwise listen where another one does.
        """
        instances = self.cluster.instances if self.cluster is not None else {}
        if name is None:
            return self
        if not instances:
            raise ConfigError(f"--instance {name}: the config has no cluster.instances: section")
        instance = instances.get(name)
        if instance is None:
            raise ConfigError(f"--instance {name}: no such instance in cluster.instances "
                              f"(one of: {', '.join(instances)})")
        batches = self.batches
        if batches is not None and instance.batches is not None:
            batches = msgspec.structs.replace(batches, listen=instance.batches)
        return replace(self, listen=msgspec.structs.replace(self.listen, grpc=instance.grpc, metrics=instance.metrics),
                       batches=batches)


def default_priority(file: ConfigFile) -> str:
    """The class of a request that names none: ``default_priority``, else ``standard`` if it is a class, else the lowest."""
    if file.default_priority is not None:
        return file.default_priority
    return "standard" if "standard" in file.priorities else file.priorities[-1]


def _written(section: msgspec.Struct) -> dict[str, Any]:
    """The fields of ``section`` that are set, by name (None: unset)."""
    return {key: value for key, value in msgspec.structs.asdict(section).items() if value is not None}


def _bands(file: ConfigFile) -> tuple[Band, ...]:
    """Each band's settings as written, over the defaults that depend on its place.

    The lowest of several bands is idle-only, with no minimum share (it may
    wait as long as the bands above keep the engine busy); every band below the
    first is preemptible (what of it has not begun can be taken back for a
    band above, core/preemption.py); a band's engine priority is its position
    (vLLM runs lower numbers first). The
    first of several bands has a TTFT objective of 5 s (people give up after
    about that long without progress), the middle ones 60 s (they expect a
    wait), the lowest none.
    """
    count = len(file.priorities)

    def defaults(index: int) -> dict[str, Any]:
        lowest = count > 1 and index == count - 1
        objective = None if count == 1 or lowest else (5.0 if index == 0 else 60.0)
        return {"idle_only": lowest, "preemptible": index > 0, "engine_priority": index, "ttft_objective_s": objective,
                **({"min_share": 0.0} if lowest else {})}

    return tuple(
        Band(**{"name": name, **defaults(index), **_written(file.bands.get(name, BandSettings()))})
        for index, name in enumerate(file.priorities)
    )


def _tenant(written: TenantSettings, base: Tenant, bands: tuple[str, ...]) -> Tenant:
    """``written`` over ``base``, field by field; the bands it may use are kept highest first, whatever the order written."""
    fields = _written(written)
    allowed = fields.pop("priorities", None)
    default = fields.pop("default_priority", None)
    return replace(
        base, **fields,
        bands=base.bands if allowed is None else tuple(b for b in bands if b in allowed),
        default_band=base.default_band if default is None else default,
    )


def tenants(file: ConfigFile) -> tuple[Tenant, dict[str, Tenant]]:
    """The `default` template (inherited field by field) and the named tenants."""
    every = Tenant(bands=file.priorities, default_band=default_priority(file))
    template = _tenant(file.tenants.get(DEFAULT_TENANT_KEY, TenantSettings()), every, file.priorities)
    named = {name: _tenant(written, template, file.priorities)
             for name, written in file.tenants.items() if name != DEFAULT_TENANT_KEY}
    return template, named


def _with_prefix(model: ModelConfig) -> ModelConfig:
    """``policy: locality`` orders by prefix signatures: without a ``prefix:`` section it gets the defaults."""
    if model.prefix is None and model.policy == "locality":
        return msgspec.structs.replace(model, prefix=PrefixSettings())
    return model


def resolve(file: ConfigFile) -> Config:
    """``file`` as the program reads it."""
    default_tenant, named = tenants(file)
    return Config(
        listen=file.listen,
        identity=file.identity,
        band_names=file.priorities,
        models=tuple(_with_prefix(m) for m in file.models),
        envoy=file.envoy,
        bands=_bands(file),
        tenants=named,
        default_tenant=default_tenant,
        shards=dict(file.shards),
        cluster=file.cluster,
        endpoint_picker=file.endpoint_picker,
        advanced=file.advanced,
        budgets=file.budgets,
        batches=file.batches,
    )
