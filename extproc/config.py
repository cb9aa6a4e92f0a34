"""The YAML configuration: typed, validated once at start-up.

Every setting is read here and nowhere else, so a mistake is refused before
the server binds a port, with the key path of the offending value
(``models[1].target_waiting: must be an integer >= 1, got 'three'``).
Unknown keys are errors too: a misspelt ``taget_waiting`` silently falling back
to its default is the kind of surprise an operator finds only under load.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import yaml

from extproc.core.policies import POLICIES
from extproc.cost import CostWeights

T = TypeVar("T")

# Metric dialects (extproc/engine_metrics.py) and gate variants (extproc/gate.py).
ENGINES = ("vllm", "sglang", "tgi", "llamacpp", "trtllm")
GATE_KINDS = ("adaptive", "waiting_target", "static_concurrency", "static_rate")
MISSING_TENANT = ("default", "reject")
# The per-tenant template in `tenants:`; its fields are every other tenant's defaults.
DEFAULT_TENANT_KEY = "default"


def split_address(text: str) -> tuple[str, int]:
    """A validated ``HOST:PORT`` (IPv6 in brackets allowed) -> (host, port)."""
    host, _, port = text.rpartition(":")
    return host.strip("[]"), int(port)


def is_ip_address(host: str) -> bool:
    """True for a literal IPv4/IPv6 address, False for a host name (which needs DNS)."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


class ConfigError(ValueError):
    """A configuration value is missing or wrong; the message names its key path."""


@dataclass(frozen=True)
class Listen:
    """Where the processor listens: gRPC for Envoy, HTTP for Prometheus."""

    grpc: str = "127.0.0.1:50051"
    metrics: str = "127.0.0.1:9464"


@dataclass(frozen=True)
class Identity:
    """Headers that carry who is asking, for what, and how urgently.

    The tenant header must be set by a trusted Envoy auth filter (api_key_auth,
    jwt_authn) that overwrites anything the client sent.
    """

    tenant_header: str = "x-tenant-id"
    priority_header: str = "x-priority"
    model_header: str = "x-model"
    default_tenant: str = "anonymous"
    # A request without the tenant header: served as `default_tenant`, or refused with 401.
    missing_tenant: str = "default"


@dataclass(frozen=True)
class Band:
    """One priority class: its limits and how it may use the engine."""

    name: str
    # None: the model's max_queue_wait_s.
    max_queue_wait_s: float | None = None
    # Requests of this band a model may hold; None: only the model's cap.
    max_queued: int | None = None
    # Released only while no higher band waits and the engine is idle.
    idle_only: bool = False
    # "Idle": the engine's waiting queue is empty and it runs fewer than this
    # share of the most requests it was ever seen running.
    idle_running_share: float = 1.0
    # Value written into the body's `priority` for engine_priority models (vLLM: lower runs first).
    engine_priority: int = 0


@dataclass(frozen=True)
class Tenant:
    """What a tenant is entitled to."""

    weight: float = 1.0
    # Classes it may use, highest first; None: all.
    priorities: tuple[str, ...] | None = None
    # Class when the request names none (or one that does not exist); None: the global default.
    default_priority: str | None = None
    # Requests of this tenant a model may hold; one more is answered 429.
    max_queued: int = 1_000


@dataclass(frozen=True)
class ModelConfig:
    """One model pool: the endpoints that serve it and how hard to fill them."""

    name: str
    endpoints: tuple[str, ...]
    engine: str = "vllm"
    target_waiting: int = 3
    scrape_interval_s: float = 0.1
    # Metrics older than this are not trusted (the engine may have moved on).
    stale_after_s: float = 1.0
    # In-flight ceiling per endpoint while the engine's metrics cannot be read.
    fallback_max_in_flight: int = 4
    # A request still queued after this long is answered 503 instead of held
    # (a band's own max_queue_wait_s overrides it).
    max_queue_wait_s: float = 120.0
    # How releases are decided (docs/gate.md): adaptive | waiting_target |
    # static_concurrency | static_rate.
    gate: str = "adaptive"
    # Optional ceilings for the adaptive gate.
    max_inter_token_latency_ms: float | None = None
    max_kv_usage: float | None = None
    # Inter-token latency is averaged over this much recent time.
    itl_window_s: float = 2.0
    # Per endpoint: hard cap on what the engine may hold (adaptive), or on our
    # in-flight requests (static_concurrency, where it is required).
    max_in_flight: int | None = None
    # Requests per second for the whole pool (static_rate, required there).
    release_rate: float | None = None
    # Pick the endpoint of each release and tell Envoy (x-gateway-destination-endpoint).
    endpoint_picking: bool = False
    # Endpoints given by host name are resolved this often; each address is an endpoint.
    dns_refresh_s: float = 10.0
    # Which tenant goes next inside a band: request round-robin or virtual token counters.
    policy: str = "round_robin"
    # Requests this model may hold in all; one more is answered 503.
    max_queued: int = 10_000
    # Part of target_waiting that bands below the first may not fill, so the
    # first band finds room in the engine's queue without waiting for a slot
    # to free (costs some throughput when completions come in bursts).
    reserved_waiting: int = 0
    # Write the band's numeric priority into the body's `priority` (vLLM
    # --scheduling-policy priority); only such models have their body sent to us.
    engine_priority: bool = False
    # The engine's batch size (vLLM --max-num-seqs), if known; else learned from its metrics.
    max_running: int | None = None
    cost: CostWeights = field(default_factory=CostWeights)


@dataclass(frozen=True)
class JwtSettings:
    """Envoy's jwt_authn: a verified token's claim names the tenant."""

    issuer: str
    audiences: tuple[str, ...] = ()
    # Exactly one: a JWKS document inline (JSON text), or the URL Envoy fetches it from.
    jwks: str | None = None
    jwks_uri: str | None = None
    tenant_claim: str = "sub"


@dataclass(frozen=True)
class EnvoySettings:
    """What `extproc envoy-config` needs to print a complete bootstrap."""

    listen: str = "127.0.0.1:10000"
    admin: str = "127.0.0.1:9901"
    # API key -> tenant, for Envoy's api_key_auth filter (demo-grade identity).
    api_keys: dict[str, str] = field(default_factory=dict)
    # Envoy's per-message timeout: short enough that a hung processor is noticed within
    # seconds (a crashed one is noticed at once: its connection resets), long enough
    # that a busy event loop under a burst does not turn into 504s.
    message_timeout_ms: int = 2000
    # Production-grade identity: a bearer JWT verified by Envoy (exclusive with api_keys).
    jwt: JwtSettings | None = None


@dataclass(frozen=True)
class Config:
    listen: Listen
    identity: Identity
    priorities: tuple[str, ...]
    default_priority: str
    models: tuple[ModelConfig, ...]
    envoy: EnvoySettings
    # One per priority class, in the order of `priorities`.
    bands: tuple[Band, ...] = ()
    # Explicitly configured tenants; every other tenant gets `default_tenant`.
    tenants: dict[str, Tenant] = field(default_factory=dict)
    default_tenant: Tenant = field(default_factory=Tenant)

    def model(self, name: str) -> ModelConfig | None:
        return next((m for m in self.models if m.name == name), None)

    def tenant(self, name: str) -> Tenant:
        return self.tenants.get(name, self.default_tenant)

    def queue_wait_s(self, model: ModelConfig, band: int) -> float:
        """How long a request of ``band`` may stay queued for ``model``."""
        own = self.bands[band].max_queue_wait_s if self.bands else None
        return model.max_queue_wait_s if own is None else own

    def longest_queue_wait_s(self, model: ModelConfig) -> float:
        return max(self.queue_wait_s(model, b) for b in range(len(self.priorities)))


# --- validation helpers ------------------------------------------------------


def _fail(path: str, message: str) -> ConfigError:
    return ConfigError(f"{path}: {message}")


def _mapping(value: Any, path: str, allowed: set[str]) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _fail(path, f"must be a mapping, got {type(value).__name__}")
    unknown = sorted(set(value) - allowed)
    if unknown:
        raise _fail(f"{path}.{unknown[0]}" if path else unknown[0], f"unknown key (allowed: {', '.join(sorted(allowed))})")
    return value


def _get(data: dict[str, Any], key: str, path: str, check: Callable[[Any, str], T], default: Any = ...) -> T:
    full = f"{path}.{key}" if path else key
    if key not in data:
        if default is ...:
            raise _fail(full, "is required")
        return default
    return check(data[key], full)


def _string(value: Any, path: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise _fail(path, f"must be a non-empty string, got {value!r}")
    return value


def _header(value: Any, path: str) -> str:
    name = _string(value, path)
    if name != name.lower() or any(c.isspace() for c in name):
        raise _fail(path, f"must be a lower-case header name without spaces, got {value!r}")
    return name


def _address(value: Any, path: str) -> str:
    text = _string(value, path)
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise _fail(path, f"must be HOST:PORT, got {value!r}")
    return text


def _int_at_least(minimum: int) -> Callable[[Any, str], int]:
    def check(value: Any, path: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise _fail(path, f"must be an integer >= {minimum}, got {value!r}")
        return value

    return check


def _positive_float(value: Any, path: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise _fail(path, f"must be a number > 0, got {value!r}")
    return float(value)


def _non_negative_float(value: Any, path: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise _fail(path, f"must be a number >= 0, got {value!r}")
    return float(value)


def _fraction(value: Any, path: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise _fail(path, f"must be a number in (0, 1], got {value!r}")
    return float(value)


def _int(value: Any, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(path, f"must be an integer, got {value!r}")
    return value


def _bool(value: Any, path: str) -> bool:
    if not isinstance(value, bool):
        raise _fail(path, f"must be true or false, got {value!r}")
    return value


def _choice(options: tuple[str, ...]) -> Callable[[Any, str], str]:
    def check(value: Any, path: str) -> str:
        if value not in options:
            raise _fail(path, f"must be one of {', '.join(options)}, got {value!r}")
        return value

    return check


def _endpoint(value: Any, path: str) -> str:
    text = _string(value, path)
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.port is None:
        raise _fail(path, f"must be an http(s)://HOST:PORT URL, got {value!r}")
    return text.rstrip("/")


def _endpoint_url(value: Any, path: str) -> str:
    """An http(s) URL whose port may be implied by its scheme."""
    text = _string(value, path)
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise _fail(path, f"must be an http(s) URL, got {value!r}")
    return text


def _list(value: Any, path: str) -> list[Any]:
    if not isinstance(value, list) or not value:
        raise _fail(path, f"must be a non-empty list, got {value!r}")
    return value


# --- sections ----------------------------------------------------------------


def _listen(raw: Any) -> Listen:
    data = _mapping(raw, "listen", {"grpc", "metrics"})
    return Listen(
        grpc=_get(data, "grpc", "listen", _address, Listen.grpc),
        metrics=_get(data, "metrics", "listen", _address, Listen.metrics),
    )


def _identity(raw: Any) -> Identity:
    keys = {"tenant_header", "priority_header", "model_header", "default_tenant", "missing_tenant"}
    data = _mapping(raw, "identity", keys)
    return Identity(
        missing_tenant=_get(data, "missing_tenant", "identity", _choice(MISSING_TENANT), Identity.missing_tenant),
        tenant_header=_get(data, "tenant_header", "identity", _header, Identity.tenant_header),
        priority_header=_get(data, "priority_header", "identity", _header, Identity.priority_header),
        model_header=_get(data, "model_header", "identity", _header, Identity.model_header),
        default_tenant=_get(data, "default_tenant", "identity", _string, Identity.default_tenant),
    )


def _model(raw: Any, path: str) -> ModelConfig:
    keys = {
        "name", "engine", "endpoints", "target_waiting", "scrape_interval_s",
        "stale_after_s", "fallback_max_in_flight", "max_queue_wait_s", "gate",
        "max_inter_token_latency_ms", "max_kv_usage", "itl_window_s", "max_in_flight",
        "release_rate", "endpoint_picking", "dns_refresh_s",
        "policy", "max_queued", "reserved_waiting", "engine_priority", "max_running", "cost",
    }
    data = _mapping(raw, path, keys)
    engine = _get(data, "engine", path, _string, ModelConfig.engine)
    if engine not in ENGINES:
        raise _fail(f"{path}.engine", f"must be one of {', '.join(ENGINES)}, got {engine!r}")
    gate = _get(data, "gate", path, _string, ModelConfig.gate)
    if gate not in GATE_KINDS:
        raise _fail(f"{path}.gate", f"must be one of {', '.join(GATE_KINDS)}, got {gate!r}")
    for required, kind in (("max_in_flight", "static_concurrency"), ("release_rate", "static_rate")):
        if gate == kind and required not in data:
            raise _fail(f"{path}.{required}", f"is required with gate: {kind}")
    picking = _get(data, "endpoint_picking", path, _bool, False)
    if picking and gate == "static_rate":
        raise _fail(f"{path}.endpoint_picking", "does not work with gate: static_rate (no per-endpoint state)")
    endpoints = _get(data, "endpoints", path, _list)
    if picking and any(str(e).startswith("https:") for e in endpoints):
        raise _fail(f"{path}.endpoint_picking", "needs http:// endpoints (the picked-endpoint cluster is plain HTTP)")
    optional = {"max_inter_token_latency_ms": _positive_float, "max_kv_usage": _fraction,
                "max_in_flight": _int_at_least(1), "release_rate": _positive_float}
    extra = {key: check(data[key], f"{path}.{key}") for key, check in optional.items() if key in data}
    return ModelConfig(
        gate=gate,
        endpoint_picking=picking,
        itl_window_s=_get(data, "itl_window_s", path, _positive_float, ModelConfig.itl_window_s),
        dns_refresh_s=_get(data, "dns_refresh_s", path, _positive_float, ModelConfig.dns_refresh_s),
        **extra,
        name=_get(data, "name", path, _string),
        engine=engine,
        endpoints=tuple(_endpoint(e, f"{path}.endpoints[{i}]") for i, e in enumerate(endpoints)),
        target_waiting=_get(data, "target_waiting", path, _int_at_least(1), ModelConfig.target_waiting),
        scrape_interval_s=_get(data, "scrape_interval_s", path, _positive_float, ModelConfig.scrape_interval_s),
        stale_after_s=_get(data, "stale_after_s", path, _positive_float, ModelConfig.stale_after_s),
        fallback_max_in_flight=_get(
            data, "fallback_max_in_flight", path, _int_at_least(1), ModelConfig.fallback_max_in_flight
        ),
        max_queue_wait_s=_get(data, "max_queue_wait_s", path, _positive_float, ModelConfig.max_queue_wait_s),
        policy=_get(data, "policy", path, _choice(tuple(POLICIES)), ModelConfig.policy),
        max_queued=_get(data, "max_queued", path, _int_at_least(1), ModelConfig.max_queued),
        reserved_waiting=_get(data, "reserved_waiting", path, _int_at_least(0), ModelConfig.reserved_waiting),
        engine_priority=_get(data, "engine_priority", path, _bool, ModelConfig.engine_priority),
        max_running=_get(data, "max_running", path, _int_at_least(1), None),
        cost=_cost(data.get("cost"), f"{path}.cost"),
    )


def _cost(raw: Any, path: str) -> CostWeights:
    data = _mapping(
        raw, path, {"input_weight", "output_weight", "bytes_per_token", "body_overhead_bytes", "default_output_tokens"}
    )
    return CostWeights(
        input_weight=_get(data, "input_weight", path, _non_negative_float, CostWeights.input_weight),
        output_weight=_get(data, "output_weight", path, _non_negative_float, CostWeights.output_weight),
        bytes_per_token=_get(data, "bytes_per_token", path, _positive_float, CostWeights.bytes_per_token),
        body_overhead_bytes=_get(data, "body_overhead_bytes", path, _int_at_least(0), CostWeights.body_overhead_bytes),
        default_output_tokens=_get(
            data, "default_output_tokens", path, _int_at_least(1), CostWeights.default_output_tokens
        ),
    )


def _bands(raw: Any, priorities: tuple[str, ...]) -> tuple[Band, ...]:
    """Band settings by class name; the lowest of several classes is idle-only unless told otherwise."""
    data = _mapping(raw, "bands", set(priorities))
    keys = {"max_queue_wait_s", "max_queued", "idle_only", "idle_running_share", "engine_priority"}
    bands = []
    for index, name in enumerate(priorities):
        path = f"bands.{name}"
        band = _mapping(data.get(name), path, keys)
        lowest = index == len(priorities) - 1 and len(priorities) > 1
        bands.append(
            Band(
                name=name,
                max_queue_wait_s=_get(band, "max_queue_wait_s", path, _positive_float, None),
                max_queued=_get(band, "max_queued", path, _int_at_least(1), None),
                idle_only=_get(band, "idle_only", path, _bool, lowest),
                idle_running_share=_get(band, "idle_running_share", path, _fraction, Band.idle_running_share),
                engine_priority=_get(band, "engine_priority", path, _int, index),
            )
        )
    return tuple(bands)


def _tenant(raw: Any, path: str, base: Tenant, priorities: tuple[str, ...]) -> Tenant:
    data = _mapping(raw, path, {"weight", "priorities", "default_priority", "max_queued"})
    allowed = base.priorities
    if "priorities" in data:
        names = [_string(p, f"{path}.priorities[{i}]") for i, p in enumerate(_list(data["priorities"], f"{path}.priorities"))]
        for i, name in enumerate(names):
            if name not in priorities:
                raise _fail(f"{path}.priorities[{i}]", f"must be one of priorities {list(priorities)}, got {name!r}")
        allowed = tuple(p for p in priorities if p in names)  # highest first, whatever the order written
    default = _get(data, "default_priority", path, _string, base.default_priority)
    if default is not None and default not in priorities:
        raise _fail(f"{path}.default_priority", f"must be one of priorities {list(priorities)}, got {default!r}")
    return Tenant(
        weight=_get(data, "weight", path, _positive_float, base.weight),
        priorities=allowed,
        default_priority=default,
        max_queued=_get(data, "max_queued", path, _int_at_least(1), base.max_queued),
    )


def _check_entitlement(tenant: Tenant, path: str, default_priority: str) -> None:
    """A tenant's default class must be one it may use."""
    default = tenant.default_priority or default_priority
    if tenant.priorities is not None and default not in tenant.priorities:
        raise _fail(
            f"{path}.default_priority",
            f"{default!r} is not among the tenant's priorities {list(tenant.priorities)}; set default_priority",
        )


def _tenants(raw: Any, priorities: tuple[str, ...], default_priority: str) -> tuple[Tenant, dict[str, Tenant]]:
    """The `default` template (inherited field by field) and the named tenants."""
    if raw is not None and not isinstance(raw, dict):
        raise _fail("tenants", f"must be a mapping of tenant name to settings, got {type(raw).__name__}")
    data = raw or {}
    template = _tenant(data.get(DEFAULT_TENANT_KEY), f"tenants.{DEFAULT_TENANT_KEY}", Tenant(), priorities)
    _check_entitlement(template, f"tenants.{DEFAULT_TENANT_KEY}", default_priority)
    named = {}
    for name, value in data.items():
        if name == DEFAULT_TENANT_KEY:
            continue
        path = f"tenants.{_string(name, 'tenants')}"
        named[name] = _tenant(value, path, template, priorities)
        _check_entitlement(named[name], path, default_priority)
    return template, named


def _api_keys(value: Any, path: str) -> dict[str, str]:
    data = _mapping(value, path, set(value) if isinstance(value, dict) else set())
    return {_string(k, path): _string(v, f"{path}.{k}") for k, v in data.items()}


def _jwt(raw: Any, path: str) -> JwtSettings:
    data = _mapping(raw, path, {"issuer", "audiences", "jwks", "jwks_uri", "tenant_claim"})
    jwks = data.get("jwks")
    if isinstance(jwks, dict):  # a JWKS written as YAML
        jwks = json.dumps(jwks, sort_keys=True)
    if ("jwks" in data) == ("jwks_uri" in data):
        raise _fail(path, "needs exactly one of jwks (an inline JWKS) or jwks_uri (where Envoy fetches it)")
    if jwks is not None:
        try:
            keys = json.loads(_string(jwks, f"{path}.jwks")).get("keys")
        except (ValueError, AttributeError):
            keys = None
        if not isinstance(keys, list) or not keys:
            raise _fail(f"{path}.jwks", 'must be a JWKS: a JSON object with a non-empty "keys" list')
    audiences = _get(data, "audiences", path, _list, [])
    return JwtSettings(
        issuer=_get(data, "issuer", path, _string),
        audiences=tuple(_string(a, f"{path}.audiences[{i}]") for i, a in enumerate(audiences)),
        jwks=jwks,
        jwks_uri=_get(data, "jwks_uri", path, _endpoint_url, None),
        tenant_claim=_get(data, "tenant_claim", path, _string, JwtSettings.tenant_claim),
    )


def _envoy(raw: Any) -> EnvoySettings:
    data = _mapping(raw, "envoy", {"listen", "admin", "api_keys", "message_timeout_ms", "jwt"})
    if data.get("api_keys") and data.get("jwt"):
        raise _fail("envoy.jwt", "use either api_keys or jwt for identity, not both")
    return EnvoySettings(
        jwt=_jwt(data["jwt"], "envoy.jwt") if data.get("jwt") is not None else None,
        listen=_get(data, "listen", "envoy", _address, EnvoySettings.listen),
        admin=_get(data, "admin", "envoy", _address, EnvoySettings.admin),
        api_keys=_get(data, "api_keys", "envoy", _api_keys, {}),
        message_timeout_ms=_get(
            data, "message_timeout_ms", "envoy", _int_at_least(1), EnvoySettings.message_timeout_ms
        ),
    )


def parse_config(raw: Any) -> Config:
    """Validate an already-loaded YAML document."""
    top = _mapping(
        raw, "", {"listen", "identity", "priorities", "default_priority", "models", "envoy", "bands", "tenants"}
    )
    priorities = tuple(
        _string(p, f"priorities[{i}]")
        for i, p in enumerate(_get(top, "priorities", "", _list, ["interactive", "standard", "batch"]))
    )
    if len(set(priorities)) != len(priorities):
        raise _fail("priorities", f"must not repeat a class, got {list(priorities)}")
    default_priority = _get(top, "default_priority", "", _string, "standard" if "standard" in priorities else priorities[-1])
    if default_priority not in priorities:
        raise _fail("default_priority", f"must be one of priorities {list(priorities)}, got {default_priority!r}")
    models = tuple(_model(m, f"models[{i}]") for i, m in enumerate(_get(top, "models", "", _list)))
    names = [m.name for m in models]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise _fail(f"models[{i}].name", f"duplicate model name {name!r}")
    default_tenant, tenants = _tenants(top.get("tenants"), priorities, default_priority)
    return Config(
        listen=_listen(top.get("listen")),
        identity=_identity(top.get("identity")),
        priorities=priorities,
        default_priority=default_priority,
        models=models,
        envoy=_envoy(top.get("envoy")),
        bands=_bands(top.get("bands"), priorities),
        tenants=tenants,
        default_tenant=default_tenant,
    )


def load_config(path: str | Path) -> Config:
    """Read and validate a YAML file; every failure is a ConfigError naming the file."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from exc
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    try:
        return parse_config(raw)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from exc
