"""The upstream clusters: the processor (one per shard too), each model's engines, the picked endpoint, the JWKS.

Every cluster with listed hosts comes from one builder (:func:`upstream`):
STATIC for IP addresses, STRICT_DNS for names, TLS, HTTP/1 or HTTP/2, the
circuit breakers held requests need, health checks and outlier detection.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from extproc.adapters.config import Config, is_ip_address, split_address
from extproc.adapters.envoy.base import Json, duration, typed
from extproc.adapters.protocol.contract import DESTINATION_HEADER, EXT_PROC_SERVICE

EXTPROC_CLUSTER = "extproc"
# Endpoint picking (Gateway API Inference Extension): the ORIGINAL_DST cluster.
PICKED_CLUSTER = "picked_endpoint"
JWKS_CLUSTER = "jwks"
# Held requests each keep a stream to the processor and to the model open;
# Envoy's default circuit breakers (1024 requests) would refuse the rest.
CIRCUIT_BREAKER_LIMIT = 100_000
MODEL_CONNECT_TIMEOUT_S = 5.0
# Envoy asks the processor's gRPC health this often. A NOT_SERVING answer (a
# draining processor) takes it out of the extproc cluster's rotation at once
# (measured 0.9 s after SIGTERM); a check that fails or times out must fail
# twice, so one slow answer during a burst does not.
EXTPROC_HEALTH_INTERVAL_S = 1.0
EXTPROC_UNHEALTHY_THRESHOLD = 2
# A processor instance that refused a connection or reset its streams stays out this
# long, unless a passing health check brings it back first (processor_outlier_detection).
PROCESSOR_EJECTION_S = 10.0
_TLS_CONTEXT = "envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext"


@dataclass(frozen=True)
class Upstream:
    """A cluster of listed hosts; unset parts are Envoy's defaults."""

    name: str
    hosts: list[tuple[str, int]]
    connect_timeout_s: float
    lb_policy: str | None = None
    http2: bool | None = None  # None: Envoy's default protocol options
    # For clusters whose requests are held: no 1024-request cap.
    held: bool = False
    health_checks: list[Json] = field(default_factory=list)
    outlier_detection: Json | None = None
    # Names resolve to IPv4 first (Envoy's default tries IPv6 first).
    v4_preferred: bool = True
    tls: Json | None = None  # the transport socket


def upstream(spec: Upstream) -> Json:
    """The one cluster builder: STATIC when every host is an IP address, else STRICT_DNS."""
    static = all(is_ip_address(host) for host, _ in spec.hosts)
    cluster: Json = {"name": spec.name, "type": "STATIC" if static else "STRICT_DNS",
                     "connect_timeout": duration(spec.connect_timeout_s)}
    if spec.lb_policy is not None:
        cluster["lb_policy"] = spec.lb_policy
    if spec.http2 is not None:
        cluster["typed_extension_protocol_options"] = _protocol_options(spec.http2)
    if spec.held:
        cluster["circuit_breakers"] = _circuit_breakers()
    if spec.health_checks:
        cluster["health_checks"] = spec.health_checks
    if spec.outlier_detection is not None:
        cluster["outlier_detection"] = spec.outlier_detection
    endpoints = [{"endpoint": {"address": socket_address(host, port)}} for host, port in spec.hosts]
    cluster["load_assignment"] = {"cluster_name": spec.name, "endpoints": [{"lb_endpoints": endpoints}]}
    if not static and spec.v4_preferred:
        cluster["dns_lookup_family"] = "V4_PREFERRED"
    if spec.tls is not None:
        cluster["transport_socket"] = spec.tls
    return cluster


def socket_address(host: str, port: int) -> Json:
    return {"socket_address": {"address": host, "port_value": port}}


def _tls(sni: str | None, common: Json | None = None) -> Json:
    """An upstream TLS transport socket; SNI only for a host name."""
    context = typed(_TLS_CONTEXT, **({} if common is None else {"common_tls_context": common}))
    if sni is not None and not is_ip_address(sni):
        context["sni"] = sni
    return {"name": "envoy.transport_sockets.tls", "typed_config": context}


def _circuit_breakers() -> Json:
    """The gate bounds what the engines get; Envoy's defaults must not. ``max_retries`` too: Envoy's
    default of 3 retries at once would pass the engine's fourth simultaneous "full" answer to its client."""
    limit = CIRCUIT_BREAKER_LIMIT
    return {"thresholds": [{"priority": "DEFAULT", "max_connections": limit, "max_pending_requests": limit,
                            "max_requests": limit, "max_retries": limit}]}


def _protocol_options(http2: bool) -> Json:
    explicit: Json = {"http2_protocol_options": {}} if http2 else {"http_protocol_options": {}}
    options = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
    return {options: typed(options, explicit_http_config=explicit)}


# --- the processor ---------------------------------------------------------------------------


def _connectable(host: str) -> str:
    """A wildcard bind address is reached through loopback."""
    return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)


def processor_addresses(config: Config) -> list[str]:
    """Where Envoy reaches the processor instances: every shard, every cluster instance, or ``listen.grpc``."""
    instances = config.cluster.instances if config.cluster is not None else {}
    listed = config.shards or instances
    return [instance.grpc for instance in listed.values()] or [config.listen.grpc]


def shard_cluster_name(shard: str) -> str:
    """The gRPC cluster of one shard's processor instance."""
    return f"{EXTPROC_CLUSTER}_{shard}"


def processor_clusters(config: Config) -> list[Json]:
    """The processor's gRPC cluster, then one per shard (none without shards).

    ``extproc``: with shards, every instance, the filter's default for
    requests whose body names no configured model (any instance answers those
    ``model_not_found``); with ``cluster.instances`` (active-active), every
    instance too: Envoy's default round-robin spreads the streams, so one
    tenant's requests land on all of them. Otherwise the one processor at
    ``listen.grpc``.
    """
    shards = [(shard_cluster_name(name), [shard.grpc]) for name, shard in config.shards.items()]
    return [_processor_cluster(config, name, addresses)
            for name, addresses in [(EXTPROC_CLUSTER, processor_addresses(config)), *shards]]


def _processor_cluster(config: Config, name: str, addresses: list[str]) -> Json:
    hosts = [(_connectable(host), port) for host, port in map(split_address, addresses)]
    names = {host for host, _ in hosts}
    return upstream(Upstream(
        name, hosts,
        # The message timeout's budget: a refused connection (processor down) fails at once
        # anyway, while under a burst Envoy itself handles the connect event late — a
        # shorter timeout turns a cold burst into thousands of bare 503s.
        connect_timeout_s=config.envoy.message_timeout_ms / 1000,
        http2=True, held=True, health_checks=[_processor_health_check()],
        outlier_detection=_outlier_detection(failures=1, ejection_s=PROCESSOR_EJECTION_S),
        v4_preferred=False,
        tls=None if config.listen.tls is None else _processor_tls(config, names),
    ))


def _processor_tls(config: Config, hosts: set[str]) -> Json:
    """Envoy's TLS to the processor (``listen.tls``), ALPN h2 for gRPC.

    The processor's certificate is checked against ``envoy.processor_ca_file``
    (the chain only, not the name); without it any certificate is accepted, as
    Gateway API Inference Extension gateways do (an empty validation context):
    encrypted, not authenticated. With ``listen.tls.client_ca_file`` the
    processor asks for a certificate, so Envoy must have one
    (``Config.envoy_problems``). SNI is the processor's host name, when every
    instance of the cluster has the same one.
    """
    envoy = config.envoy
    ca = envoy.processor_ca_file
    common: Json = {"alpn_protocols": ["h2"], "validation_context": {} if ca is None else {"trusted_ca": {"filename": ca}}}
    if envoy.processor_client_cert_file is not None:
        common["tls_certificates"] = [{
            "certificate_chain": {"filename": envoy.processor_client_cert_file},
            "private_key": {"filename": envoy.processor_client_key_file},
        }]
    return _tls(next(iter(hosts)) if len(hosts) == 1 else None, common)


def _processor_health_check() -> Json:
    """gRPC health checks on the processor, so Envoy stops opening streams to a draining one.

    With several processors behind the cluster (a DNS name, cluster instances), new requests
    move to the serving ones within about two intervals. A single processor
    stays in use while it drains (Envoy's panic mode routes to unhealthy hosts
    when too few are healthy), which is what we want: it answers new requests
    503 ``shutting_down`` itself. ``no_traffic_interval`` is Envoy's 60 s
    default otherwise, too slow to notice a drain on a quiet gateway.
    """
    interval = duration(EXTPROC_HEALTH_INTERVAL_S)
    return {
        "timeout": interval,
        "interval": interval,
        "no_traffic_interval": interval,
        "unhealthy_threshold": EXTPROC_UNHEALTHY_THRESHOLD,
        "healthy_threshold": 1,
        "grpc_health_check": {"service_name": EXT_PROC_SERVICE},
    }


def _outlier_detection(*, failures: int, ejection_s: float) -> Json:
    """Eject a host after ``failures`` consecutive connection failures (local origin only).

    Engines (2 failures, 1 s): without it, least-request balancing favours a
    dead endpoint (it holds nothing) and a retry's ``previous_hosts`` re-picks
    often come back to it. The processor (1 failure, PROCESSOR_EJECTION_S): a
    killed instance resets every stream it held and refuses the next
    connection; each such stream is a request answered ``processor_unavailable``
    (or sent on unscheduled), so it leaves the rotation at the first one rather
    than after the health check's two failed intervals. A live instance
    ejected by one slow connect under a burst comes back at its next passing
    health check (Envoy un-ejects on a successful active check); the processor
    gives its own refusals inside a gRPC OK stream, so they never count. With
    every host ejected, Envoy's panic routing tries them all again.
    """
    return {
        "split_external_local_origin_errors": True,
        "consecutive_local_origin_failure": failures,
        "enforcing_consecutive_local_origin_failure": 100,
        "interval": duration(1.0),
        "base_ejection_time": duration(ejection_s),
        "max_ejection_percent": 100,
    }


# --- the engines --------------------------------------------------------------------------------


def model_cluster_name(model: str) -> str:
    """Cluster name for a model: `model_` + the name with only [A-Za-z0-9_-]."""
    return "model_" + re.sub(r"[^A-Za-z0-9_-]", "_", model)


def cluster_names(config: Config) -> dict[str, str]:
    """Model name -> unique cluster name (sanitising may make two names collide)."""
    names: dict[str, str] = {}
    used: set[str] = set()
    for model in config.models:
        base = name = model_cluster_name(model.name)
        n = 2
        while name in used:
            name = f"{base}_{n}"
            n += 1
        used.add(name)
        names[model.name] = name
    return names


def _model_cluster(endpoints: tuple[str, ...], name: str) -> Json:
    """One scheme per model (``Config.envoy_problems``); SNI is the first endpoint's name."""
    parts = [urlsplit(url) for url in endpoints]
    hosts = [(p.hostname or "", p.port or 0) for p in parts]
    tls = _tls(hosts[0][0]) if parts[0].scheme == "https" else None
    return upstream(Upstream(name, hosts, MODEL_CONNECT_TIMEOUT_S, lb_policy="LEAST_REQUEST", http2=False, held=True,
                             outlier_detection=_outlier_detection(failures=2, ejection_s=1.0), tls=tls))


def picks_endpoints(config: Config) -> bool:
    """Whether any model picks endpoints: only then the ORIGINAL_DST cluster and route exist."""
    return any(model.endpoint_picking for model in config.models)


def _picked_cluster() -> Json:
    """ORIGINAL_DST: connect to the HOST:PORT in the processor's destination header."""
    return {
        "name": PICKED_CLUSTER,
        "type": "ORIGINAL_DST",
        "lb_policy": "CLUSTER_PROVIDED",
        "connect_timeout": duration(MODEL_CONNECT_TIMEOUT_S),
        "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION_HEADER},
        "typed_extension_protocol_options": _protocol_options(http2=False),
        "circuit_breakers": _circuit_breakers(),
    }


def _jwks_cluster(uri: str) -> Json:
    """Where Envoy fetches the JWKS from (remote_jwks)."""
    parts = urlsplit(uri)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    tls = _tls(host) if parts.scheme == "https" else None
    return upstream(Upstream(JWKS_CLUSTER, [(host, port)], MODEL_CONNECT_TIMEOUT_S, tls=tls))


def clusters(config: Config, *, existing: Mapping[str, str] | None = None) -> list[Json]:
    """The processor's clusters, the picked-endpoint one (with endpoint picking), one per model, jwks.

    ``existing`` maps a model to a cluster the operator's Envoy already has:
    no cluster is generated for it (the routes use that name).
    """
    names = cluster_names(config)
    existing = existing or {}
    jwt = config.envoy.jwt
    jwks = [_jwks_cluster(jwt.jwks_uri)] if jwt is not None and jwt.jwks_uri is not None else []
    picked = [_picked_cluster()] if picks_endpoints(config) else []
    models = [_model_cluster(m.endpoints, names[m.name]) for m in config.models if m.name not in existing]
    return [*processor_clusters(config), *picked, *models, *jwks]
