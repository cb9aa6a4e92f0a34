"""The YAML configuration: typed, validated once at start-up.

Every setting is read here and nowhere else, so a mistake is refused before
the server binds a port, with the key path of the offending value
(``models[1].target_waiting: must be an integer >= 1, got 'three'``).
Unknown keys are errors too: a misspelt ``taget_waiting`` silently falling back
to its default is the kind of surprise an operator finds only under load.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, TypeVar
from urllib.parse import urlsplit

import yaml

T = TypeVar("T")

# Metric dialects (extproc/engine_metrics.py) and gate variants (extproc/gate.py).
ENGINES = ("vllm", "sglang", "tgi", "llamacpp", "trtllm")
GATE_KINDS = ("adaptive", "waiting_target", "static_concurrency", "static_rate")


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
    # A request still queued after this long is answered 503 instead of held.
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


@dataclass(frozen=True)
class EnvoySettings:
    """What `extproc envoy-config` needs to print a complete bootstrap."""

    listen: str = "127.0.0.1:10000"
    admin: str = "127.0.0.1:9901"
    # API key -> tenant, for Envoy's api_key_auth filter (demo-grade identity).
    api_keys: dict[str, str] = field(default_factory=dict)
    # Envoy's per-message timeout: short, so a dead processor is noticed fast.
    message_timeout_ms: int = 500


@dataclass(frozen=True)
class Config:
    listen: Listen
    identity: Identity
    priorities: tuple[str, ...]
    default_priority: str
    models: tuple[ModelConfig, ...]
    envoy: EnvoySettings

    def model(self, name: str) -> ModelConfig | None:
        return next((m for m in self.models if m.name == name), None)


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


def _fraction(value: Any, path: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise _fail(path, f"must be a number in (0, 1], got {value!r}")
    return float(value)


def _bool(value: Any, path: str) -> bool:
    if not isinstance(value, bool):
        raise _fail(path, f"must be true or false, got {value!r}")
    return value


def _endpoint(value: Any, path: str) -> str:
    text = _string(value, path)
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.port is None:
        raise _fail(path, f"must be an http(s)://HOST:PORT URL, got {value!r}")
    return text.rstrip("/")


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
    keys = {"tenant_header", "priority_header", "model_header", "default_tenant"}
    data = _mapping(raw, "identity", keys)
    return Identity(
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
    )


def _api_keys(value: Any, path: str) -> dict[str, str]:
    data = _mapping(value, path, set(value) if isinstance(value, dict) else set())
    return {_string(k, path): _string(v, f"{path}.{k}") for k, v in data.items()}


def _envoy(raw: Any) -> EnvoySettings:
    data = _mapping(raw, "envoy", {"listen", "admin", "api_keys", "message_timeout_ms"})
    return EnvoySettings(
        listen=_get(data, "listen", "envoy", _address, EnvoySettings.listen),
        admin=_get(data, "admin", "envoy", _address, EnvoySettings.admin),
        api_keys=_get(data, "api_keys", "envoy", _api_keys, {}),
        message_timeout_ms=_get(
            data, "message_timeout_ms", "envoy", _int_at_least(1), EnvoySettings.message_timeout_ms
        ),
    )


def parse_config(raw: Any) -> Config:
    """Validate an already-loaded YAML document."""
    top = _mapping(raw, "", {"listen", "identity", "priorities", "default_priority", "models", "envoy"})
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
    return Config(
        listen=_listen(top.get("listen")),
        identity=_identity(top.get("identity")),
        priorities=priorities,
        default_priority=default_priority,
        models=models,
        envoy=_envoy(top.get("envoy")),
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
