"""Envoy configuration generated from the extproc Config.

`bootstrap(config)` is a complete Envoy bootstrap (the demo runs it as is);
`drop_in(config)` is the subset an operator splices into an existing Envoy.
Both are plain dicts; `render()` turns one into YAML. Nothing here touches the
network or the file system, so the output is a pure function of the Config.

The request path through Envoy's HTTP filters:

1. identity: ``header_mutation`` removes client-sent tenant and model headers
   (a client may neither pick its tenant nor route around the processor) and
   the processor's queue-wait header;
   then ``api_key_auth`` (only with ``envoy.api_keys``) maps
   ``Authorization: Bearer <key>`` to the tenant header, 401 without a known
   key; or ``jwt_authn`` (only with ``envoy.jwt``) verifies a bearer JWT
   (issuer, audiences, signature against the JWKS inline or fetched from
   ``jwks_uri``), 401 without a valid one, and copies the tenant claim into
   the tenant header (``claim_to_headers``). With neither, every request has
   no tenant header.
2. ``json_to_metadata`` copies the body's ``model`` and ``max_tokens`` into
   dynamic metadata namespace ``extproc``. It buffers the body first, so the
   metadata exists when ext_proc sends the request headers. Only JSON bodies
   are parsed (``application/json``, also with ``charset=utf-8``, since the
   filter compares the whole header); anything else is answered 400 by the
   processor because it names no model.
3. ``ext_proc`` sends the request headers (with that metadata) to the
   processor, which holds the request while it is queued (extending Envoy's
   short per-message timeout with ``override_message_timeout``), then sets the
   model header and clears the route cache. ``response_trailer_mode: SEND``
   keeps the gRPC stream open until the response ends, so the processor learns
   of completion without per-chunk messages. (Seen with Envoy 1.40: an
   upstream without trailers yields no ``response_trailers`` message; the
   stream just ends, by half-close or by cancellation, when the response is
   done.) On the releases it checks, the processor turns on
   ``response_header_mode`` (``mode_override``) to see the response's status:
   the router's own 503 for an unreachable engine marks the endpoint down
   (``ext_proc/release_outcome.py``). An unreachable processor fails the
   request with 503.
4. ``router``: a request carrying ``x-gateway-destination-endpoint`` (set
   only by the processor, when the model picks endpoints; a client-sent one is
   removed in step 1) goes to the ORIGINAL_DST cluster ``picked_endpoint``,
   which connects to exactly that HOST:PORT (the Gateway API Inference
   Extension convention). Otherwise one route per model, matching the model
   header exactly, balances over the model's cluster. So the same bootstrap
   works with and without endpoint picking. Routes copy the processor's
   queue-wait request header onto the response, and retry a request that
   never reached the engine (connection refused or reset before a byte was
   sent: safe for a POST), with backoff, on another endpoint where there is
   one; any other request gets an OpenAI-style 404.
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import Any
from urllib.parse import urlsplit

import yaml

from extproc.adapters.config import Config, ConfigError, is_ip_address, load_config, split_address
from extproc.adapters.ext_proc.contract import (
    DESTINATION_HEADER,
    HOLD_MARGIN_S,
    METADATA_NAMESPACE,
    PROCESSING_MODE,
    QUEUE_WAIT_HEADER,
    hold_timeout_for,
)

EXTPROC_CLUSTER = "extproc"
# Endpoint picking (Gateway API Inference Extension): the ORIGINAL_DST cluster.
PICKED_CLUSTER = "picked_endpoint"
JWKS_CLUSTER = "jwks"
JWT_PROVIDER = "tenant"
JWKS_FETCH_TIMEOUT_S = 5.0
JWKS_CACHE_S = 600.0
# Request headers the processor sets that Envoy copies onto the response, so
# clients see them (ext_proc only reads the response headers).
ECHOED_HEADERS = (QUEUE_WAIT_HEADER,)

# Held requests each keep a stream to the processor and to the model open;
# Envoy's default circuit breakers (1024 requests) would refuse the rest.
CIRCUIT_BREAKER_LIMIT = 100_000
# Time on top of the hold for the client to upload its body.
UPLOAD_MARGIN_S = 60.0
# A stream may be silent this long (a non-streamed generation sends nothing
# until it is done); raised further if the queue wait needs more.
MIN_IDLE_TIMEOUT_S = 600.0
# JSON bodies are buffered by json_to_metadata before ext_proc runs; with
# Envoy's default 1 MiB per-connection buffer a longer prompt gets 413.
BUFFER_LIMIT_BYTES = 16 * 1024 * 1024
EXTPROC_CONNECT_TIMEOUT_S = 0.25
# json_to_metadata compares the whole Content-Type: list the spellings SDKs send.
JSON_CONTENT_TYPES = ("application/json", "application/json; charset=utf-8", "application/json;charset=utf-8")
MODEL_CONNECT_TIMEOUT_S = 5.0
# Retries of a request that never reached the engine: an engine restarting in
# well under a second is waited for; a dead one fails the request after about
# half a second, and the processor, seeing the router's 503, marks it down.
ENGINE_RETRIES = 2
ENGINE_RETRY_BASE_S = 0.1
ENGINE_RETRY_MAX_S = 0.5

HEADER = (
    "# Generated by extproc (extproc/adapters/envoy_config.py) from an extproc config file;\n"
    "# regenerate with `extproc envoy-config --config FILE` rather than editing by hand.\n"
)

_TYPE = "type.googleapis.com/"


# --- small helpers ------------------------------------------------------------


def _duration(seconds: float) -> str:
    """Envoy's Duration text: `150s`, `0.5s`."""
    text = f"{seconds:.3f}".rstrip("0").rstrip(".")
    return f"{text}s"


def _connectable(host: str) -> str:
    """A wildcard bind address is reached through loopback."""
    return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)


def _socket_address(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def model_cluster_name(model: str) -> str:
    """Cluster name for a model: `model_` + the name with only [A-Za-z0-9_-]."""
    return "model_" + re.sub(r"[^A-Za-z0-9_-]", "_", model)


def _cluster_names(config: Config) -> dict[str, str]:
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


def _max_queue_wait(config: Config) -> float:
    """The longest any request may stay queued, over every model and priority class."""
    return max(config.longest_queue_wait_s(m) for m in config.models)


def hold_timeout_s(config: Config) -> float:
    """The longest the processor may hold a message (ext_proc max_message_timeout)."""
    return hold_timeout_for(_max_queue_wait(config))


def _idle_timeout_s(config: Config) -> float:
    return max(MIN_IDLE_TIMEOUT_S, hold_timeout_s(config) + HOLD_MARGIN_S)


def _circuit_breakers() -> dict[str, Any]:
    return {
        "thresholds": [
            {
                "priority": "DEFAULT",
                "max_connections": CIRCUIT_BREAKER_LIMIT,
                "max_pending_requests": CIRCUIT_BREAKER_LIMIT,
                "max_requests": CIRCUIT_BREAKER_LIMIT,
            }
        ]
    }


def _protocol_options(http2: bool) -> dict[str, Any]:
    explicit: dict[str, Any] = {"http2_protocol_options": {}} if http2 else {"http_protocol_options": {}}
    return {
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": _TYPE + "envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": explicit,
        }
    }


# --- HTTP filters -------------------------------------------------------------


def _sanitise_filter(config: Config) -> dict[str, Any]:
    """Drop headers only Envoy and the processor may set.

    The model header routes the request: a client-sent one must not survive
    into the processor or the router. The tenant header is stripped too
    (api_key_auth, when configured, sets it afterwards).
    """
    remove = [config.identity.model_header, config.identity.tenant_header, DESTINATION_HEADER, *ECHOED_HEADERS]
    return {
        "name": "envoy.filters.http.header_mutation",
        "typed_config": {
            "@type": _TYPE + "envoy.extensions.filters.http.header_mutation.v3.HeaderMutation",
            "mutations": {"request_mutations": [{"remove": name} for name in remove]},
        },
    }


def _api_key_auth_filter(config: Config) -> dict[str, Any]:
    return {
        "name": "envoy.filters.http.api_key_auth",
        "typed_config": {
            "@type": _TYPE + "envoy.extensions.filters.http.api_key_auth.v3.ApiKeyAuth",
            "credentials": [{"key": key, "client": client} for key, client in config.envoy.api_keys.items()],
            # The filter strips a leading "Bearer " from a header source; an
            # unknown or missing key is answered 401.
            "key_sources": [{"header": "authorization"}],
            # The tenant header is set (replaced) with the key's client; the
            # tenant's key is not passed on to the model servers.
            "forwarding": {"header": config.identity.tenant_header, "hide_credentials": True},
        },
    }


def _jwt_authn_filter(config: Config) -> dict[str, Any]:
    jwt = config.envoy.jwt
    assert jwt is not None
    provider: dict[str, Any] = {
        "issuer": jwt.issuer,
        # The token is not passed on to the model servers.
        "forward": False,
        # Written after header_mutation removed any client-sent tenant header.
        "claim_to_headers": [{"header_name": config.identity.tenant_header, "claim_name": jwt.tenant_claim}],
    }
    if jwt.audiences:
        provider["audiences"] = list(jwt.audiences)
    if jwt.jwks is not None:
        provider["local_jwks"] = {"inline_string": jwt.jwks}
    else:
        provider["remote_jwks"] = {
            "http_uri": {"uri": jwt.jwks_uri, "cluster": JWKS_CLUSTER, "timeout": _duration(JWKS_FETCH_TIMEOUT_S)},
            "cache_duration": _duration(JWKS_CACHE_S),
            # Fetched at start-up and refreshed in the background, not on a request's path.
            "async_fetch": {},
        }
    return {
        "name": "envoy.filters.http.jwt_authn",
        "typed_config": {
            "@type": _TYPE + "envoy.extensions.filters.http.jwt_authn.v3.JwtAuthentication",
            "providers": {JWT_PROVIDER: provider},
            # Every request needs a valid token (Authorization: Bearer <jwt>); else 401.
            "rules": [{"match": {"prefix": "/"}, "requires": {"provider_name": JWT_PROVIDER}}],
        },
    }


def _jwks_cluster(uri: str) -> dict[str, Any]:
    """Where Envoy fetches the JWKS from (remote_jwks)."""
    parts = urlsplit(uri)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    cluster: dict[str, Any] = {
        "name": JWKS_CLUSTER,
        "type": "STATIC" if is_ip_address(host) else "STRICT_DNS",
        "connect_timeout": _duration(MODEL_CONNECT_TIMEOUT_S),
        "load_assignment": {
            "cluster_name": JWKS_CLUSTER,
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": _socket_address(host, port)}}]}],
        },
    }
    if cluster["type"] == "STRICT_DNS":
        cluster["dns_lookup_family"] = "V4_PREFERRED"
    if parts.scheme == "https":
        tls: dict[str, Any] = {"@type": _TYPE + "envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext"}
        if not is_ip_address(host):
            tls["sni"] = host
        cluster["transport_socket"] = {"name": "envoy.transport_sockets.tls", "typed_config": tls}
    return cluster


def _json_to_metadata_filter() -> dict[str, Any]:
    def rule(body_key: str, metadata_key: str, value_type: str) -> dict[str, Any]:
        return {
            "selectors": [{"key": body_key}],
            "on_present": {"metadata_namespace": METADATA_NAMESPACE, "key": metadata_key, "type": value_type},
        }

    return {
        "name": "envoy.filters.http.json_to_metadata",
        "typed_config": {
            "@type": _TYPE + "envoy.extensions.filters.http.json_to_metadata.v3.JsonToMetadata",
            "request_rules": {
                "allow_content_types": list(JSON_CONTENT_TYPES),
                "rules": [
                    rule("model", "model", "STRING"),
                    rule("max_tokens", "max_tokens", "NUMBER"),
                    # OpenAI's newer name wins when both are present (as in vLLM).
                    rule("max_completion_tokens", "max_tokens", "NUMBER"),
                    # Prefix-cache affinity for endpoint picking (OpenAI's field).
                    rule("prompt_cache_key", "prompt_cache_key", "STRING"),
                ]
            },
        },
    }


def _ext_proc_filter(config: Config) -> dict[str, Any]:
    return {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": _TYPE + "envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": EXTPROC_CLUSTER}},
            # A processor that cannot be reached fails the request: 503.
            "failure_mode_allow": False,
            "status_on_error": {"code": "ServiceUnavailable"},
            "processing_mode": dict(PROCESSING_MODE),
            # Short, so a dead processor is noticed fast; the processor holds
            # a queued request with override_message_timeout up to the maximum.
            "message_timeout": _duration(config.envoy.message_timeout_ms / 1000),
            "max_message_timeout": _duration(hold_timeout_s(config)),
            "allow_mode_override": True,
            "metadata_options": {"forwarding_namespaces": {"untyped": [METADATA_NAMESPACE]}},
        },
    }


def _router_filter() -> dict[str, Any]:
    return {
        "name": "envoy.filters.http.router",
        "typed_config": {"@type": _TYPE + "envoy.extensions.filters.http.router.v3.Router"},
    }


def http_filters(config: Config, *, ext_proc: bool = True) -> list[dict[str, Any]]:
    """The HTTP filter chain, in order (``ext_proc=False``: the benchmark's Envoy-only baseline)."""
    identity = [_api_key_auth_filter(config)] if config.envoy.api_keys else []
    if config.envoy.jwt is not None:
        identity.append(_jwt_authn_filter(config))
    processor = [_ext_proc_filter(config)] if ext_proc else []
    return [
        _sanitise_filter(config),
        *identity,
        _json_to_metadata_filter(),
        *processor,
        _router_filter(),
    ]


# --- routes and clusters ----------------------------------------------------------


def _model_match(config: Config, model: str, ext_proc: bool) -> dict[str, Any]:
    """Match the model header the processor sets or, without a processor, the body's model.

    The metadata match works because json_to_metadata runs before anything
    picks the route (checked with Envoy 1.40).
    """
    if ext_proc:
        return {"prefix": "/", "headers": [{"name": config.identity.model_header, "string_match": {"exact": model}}]}
    path = [{"key": "model"}]
    value = {"string_match": {"exact": model}}
    return {"prefix": "/", "dynamic_metadata": [{"filter": METADATA_NAMESPACE, "path": path, "value": value}]}


def _retry_policy() -> dict[str, Any]:
    """Retry only what never reached the engine; another endpoint first, where the cluster has one.

    ``previous_hosts`` skips endpoints already tried (the picked cluster has
    one host: after the attempts it goes there anyway).
    """
    return {
        "retry_on": "connect-failure,refused-stream,reset-before-request",
        "num_retries": ENGINE_RETRIES,
        "retry_back_off": {"base_interval": _duration(ENGINE_RETRY_BASE_S), "max_interval": _duration(ENGINE_RETRY_MAX_S)},
        "retry_host_predicate": [{
            "name": "envoy.retry_host_predicates.previous_hosts",
            "typed_config": {"@type": _TYPE + "envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"},
        }],
        "host_selection_retry_max_attempts": 3,
    }


def routes(config: Config, *, ext_proc: bool = True) -> list[dict[str, Any]]:
    """One route per model on the model header (or body model), then the 404 catch-all."""
    idle = _duration(_idle_timeout_s(config))
    clusters = _cluster_names(config)

    def route(route_name: str, match: dict[str, Any], cluster: str) -> dict[str, Any]:
        return {
            "name": route_name,
            "match": match,
            # No overall limit: a long generation is fine while bytes flow.
            "route": {"cluster": cluster, "timeout": "0s", "idle_timeout": idle, "retry_policy": _retry_policy()},
            # Omitted when the processor did not set it (empty value).
            "response_headers_to_add": [
                {
                    "header": {"key": name, "value": f"%REQ({name})%"},
                    "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
                }
                for name in ECHOED_HEADERS
            ],
        }

    # Only the processor sets the destination header (Envoy strips a client's).
    picked = {"prefix": "/", "headers": [{"name": DESTINATION_HEADER, "present_match": True}]}
    result = [route(PICKED_CLUSTER, picked, PICKED_CLUSTER)] if ext_proc else []
    result += [
        route(clusters[model.name], _model_match(config, model.name, ext_proc), clusters[model.name])
        for model in config.models
    ]
    # Defence in depth: the processor normally rejects unknown models itself.
    result.append(
        {
            "name": "model_not_found",
            "match": {"prefix": "/"},
            "direct_response": {
                "status": 404,
                "body": {
                    "inline_string": (
                        '{"error":{"message":"The requested model does not exist on this server.",'
                        '"type":"invalid_request_error","code":"model_not_found"}}'
                    )
                },
            },
            "response_headers_to_add": [
                {
                    "header": {"key": "content-type", "value": "application/json"},
                    "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
                }
            ],
        }
    )
    return result


def extproc_cluster(config: Config) -> dict[str, Any]:
    """The processor's gRPC cluster (HTTP/2)."""
    host, port = split_address(config.listen.grpc)
    host = _connectable(host)
    return {
        "name": EXTPROC_CLUSTER,
        "type": "STATIC" if is_ip_address(host) else "STRICT_DNS",
        "connect_timeout": _duration(EXTPROC_CONNECT_TIMEOUT_S),
        "typed_extension_protocol_options": _protocol_options(http2=True),
        "circuit_breakers": _circuit_breakers(),
        "load_assignment": {
            "cluster_name": EXTPROC_CLUSTER,
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": _socket_address(host, port)}}]}],
        },
    }


def _model_cluster(config: Config, index: int, name: str) -> dict[str, Any]:
    model = config.models[index]
    parts = [urlsplit(url) for url in model.endpoints]
    schemes = {p.scheme for p in parts}
    if len(schemes) > 1:
        raise ConfigError(f"models[{index}].endpoints: mixes http and https; use one scheme per model")
    hosts = [(p.hostname or "", p.port or 0) for p in parts]
    cluster: dict[str, Any] = {
        "name": name,
        "type": "STATIC" if all(is_ip_address(h) for h, _ in hosts) else "STRICT_DNS",
        "connect_timeout": _duration(MODEL_CONNECT_TIMEOUT_S),
        "lb_policy": "LEAST_REQUEST",
        "typed_extension_protocol_options": _protocol_options(http2=False),
        "circuit_breakers": _circuit_breakers(),
        "outlier_detection": _outlier_detection(),
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [
                {"lb_endpoints": [{"endpoint": {"address": _socket_address(h, p)}} for h, p in hosts]}
            ],
        },
    }
    if cluster["type"] == "STRICT_DNS":
        cluster["dns_lookup_family"] = "V4_PREFERRED"
    if schemes == {"https"}:
        tls: dict[str, Any] = {"@type": _TYPE + "envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext"}
        if not is_ip_address(hosts[0][0]):
            tls["sni"] = hosts[0][0]
        cluster["transport_socket"] = {"name": "envoy.transport_sockets.tls", "typed_config": tls}
    return cluster


def _outlier_detection() -> dict[str, Any]:
    """Eject an endpoint Envoy cannot connect to, so a retry lands on a live replica.

    Without it, least-request balancing favours the dead endpoint (it holds
    nothing) and a retry's ``previous_hosts`` re-picks often come back to it.
    Only connection failures count (local origin); all endpoints ejected
    means Envoy's panic routing tries them all again.
    """
    return {
        "split_external_local_origin_errors": True,
        "consecutive_local_origin_failure": 2,
        "enforcing_consecutive_local_origin_failure": 100,
        "interval": _duration(1.0),
        "base_ejection_time": _duration(1.0),
        "max_ejection_percent": 100,
    }


def picked_cluster() -> dict[str, Any]:
    """ORIGINAL_DST: connect to the HOST:PORT in the processor's destination header."""
    return {
        "name": PICKED_CLUSTER,
        "type": "ORIGINAL_DST",
        "lb_policy": "CLUSTER_PROVIDED",
        "connect_timeout": _duration(MODEL_CONNECT_TIMEOUT_S),
        "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION_HEADER},
        "typed_extension_protocol_options": _protocol_options(http2=False),
        "circuit_breakers": _circuit_breakers(),
    }


def clusters(config: Config) -> list[dict[str, Any]]:
    names = _cluster_names(config)
    jwt = config.envoy.jwt
    jwks = [_jwks_cluster(jwt.jwks_uri)] if jwt is not None and jwt.jwks_uri is not None else []
    return [extproc_cluster(config), picked_cluster()] + [
        _model_cluster(config, i, names[m.name]) for i, m in enumerate(config.models)
    ] + jwks


def _hcm_timeouts(config: Config) -> dict[str, str]:
    return {
        # The request is "received" only once ext_proc releases it, so the
        # whole queue wait counts here.
        "request_timeout": _duration(hold_timeout_s(config) + UPLOAD_MARGIN_S),
        # While held, nothing moves on the stream.
        "stream_idle_timeout": _duration(_idle_timeout_s(config)),
    }


# --- documents -----------------------------------------------------------------


def bootstrap(config: Config, *, ext_proc: bool = True) -> dict[str, Any]:
    """A complete Envoy bootstrap for this config.

    ``ext_proc=False`` is the same gateway without the processor (no
    ext_proc filter; routes match the body's model in json_to_metadata's
    metadata): the benchmark's baseline for what Envoy alone costs.
    """
    listen_host, listen_port = split_address(config.envoy.listen)
    admin_host, admin_port = split_address(config.envoy.admin)
    ident = config.identity
    access_log_format = {
        "start_time": "%START_TIME%",
        "method": "%REQ(:METHOD)%",
        "path": "%REQ(X-ENVOY-ORIGINAL-PATH?:PATH)%",
        "status": "%RESPONSE_CODE%",
        "flags": "%RESPONSE_FLAGS%",
        "details": "%RESPONSE_CODE_DETAILS%",
        "duration_ms": "%DURATION%",
        "tenant": f"%REQ({ident.tenant_header})%",
        "model": f"%REQ({ident.model_header})%",
        "upstream": "%UPSTREAM_HOST%",
    }
    hcm = {
        "@type": _TYPE + "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "ingress",
        "codec_type": "AUTO",
        **_hcm_timeouts(config),
        "access_log": [
            {
                "name": "envoy.access_loggers.stdout",
                "typed_config": {
                    "@type": _TYPE + "envoy.extensions.access_loggers.stream.v3.StdoutAccessLog",
                    "log_format": {"json_format": access_log_format},
                },
            }
        ],
        "route_config": {
            "name": "models",
            "virtual_hosts": [{"name": "models", "domains": ["*"], "routes": routes(config, ext_proc=ext_proc)}],
        },
        "http_filters": http_filters(config, ext_proc=ext_proc),
    }
    return {
        "admin": {"address": _socket_address(admin_host, admin_port)},
        "static_resources": {
            "listeners": [
                {
                    "name": "ingress",
                    "address": _socket_address(listen_host, listen_port),
                    "per_connection_buffer_limit_bytes": BUFFER_LIMIT_BYTES,
                    "filter_chains": [
                        {
                            "filters": [
                                {"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}
                            ]
                        }
                    ],
                }
            ],
            "clusters": clusters(config),
        },
    }


def drop_in(config: Config) -> dict[str, Any]:
    """What to add to an existing Envoy.

    Timeouts for its HTTP connection manager, the HTTP filters in order (the
    router last), the clusters (`extproc`, then one per model: keep or replace
    the model ones) and the routes for its virtual host.
    """
    return {
        "http_connection_manager": _hcm_timeouts(config),
        "http_filters": http_filters(config),
        "clusters": clusters(config),
        "routes": routes(config),
    }


def render(doc: dict[str, Any]) -> str:
    """YAML text with a generated-by header; the same dict always gives the same text."""
    body = yaml.safe_dump(doc, sort_keys=False, default_flow_style=False, allow_unicode=True, width=100)
    return HEADER + body


# --- CLI: `extproc envoy-config` --------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, metavar="FILE", help="extproc YAML configuration")
    parser.add_argument(
        "--drop-in",
        action="store_true",
        help="print only the filters, cluster and routes to add to an existing Envoy",
    )


def main_envoy_config(args: argparse.Namespace) -> int:
    """`extproc envoy-config --config FILE [--drop-in]`: YAML on stdout; 2 on a config error."""
    try:
        config = load_config(args.config)
        try:
            doc = drop_in(config) if args.drop_in else bootstrap(config)
        except ConfigError as exc:
            raise ConfigError(*(f"{args.config}: {error}" for error in exc.errors)) from exc
    except ConfigError as exc:
        for error in exc.errors:
            print(f"error: {error}", file=sys.stderr)
        return 2
    sys.stdout.write(render(doc))
    return 0
