"""Envoy configuration generated from the extproc Config.

`bootstrap(config)` is a complete Envoy bootstrap (the demo runs it as is);
`drop_in(config)` is what to add to an operator's existing Envoy: the same
filters, off except on its own routes, which own only the LLM paths, so the
other routes of a shared listener run as before (`envoy_merge.merge` adds it
to a bootstrap, `--into`). Both are plain dicts; `render()` turns one into
YAML. Nothing here touches the network or the file system, so the output is a
pure function of the Config.

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
2. ``json_to_metadata`` copies the body's ``model``, ``max_tokens`` and
   ``max_completion_tokens`` (each as the JSON value written, so the processor
   can refuse a string or a negative limit) into dynamic metadata namespace
   ``extproc``. It buffers the body first, so the
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
   done.) ``failure_mode_allow`` is on: when the processor cannot be
   reached, the request goes on without the model header that only the
   processor sets, and step 4 decides (``envoy.processor_failure``); a
   released response keeps streaming if the processor dies meanwhile. The
   ``extproc`` cluster health-checks the processor over gRPC, so a draining
   one (health NOT_SERVING) leaves the rotation when another serves, and
   ejects one at its first refused connection or reset stream (a killed one).
   On the releases it checks, the processor turns on ``response_header_mode``
   (``mode_override``) to see the response's status: the router's own 503
   for an unreachable engine marks the endpoint down
   (``ext_proc/release_outcome.py``).
4. ``router``: with endpoint picking (some model's ``endpoint_picking``), a
   request carrying ``x-gateway-destination-endpoint`` (set only by the
   processor; a client-sent one is removed in step 1) goes to the
   ORIGINAL_DST cluster ``picked_endpoint``, which connects to exactly that
   HOST:PORT (the Gateway API Inference Extension convention); without it
   neither that cluster nor its route exists. Otherwise one route per model,
   matching the model header exactly, balances over the model's cluster. Routes copy the processor's
   queue-wait request header onto the response, and retry a request that
   never reached the engine (connection refused or reset before a byte was
   sent: safe for a POST), with backoff, on another endpoint where there is
   one. A request with neither header was not answered by the processor: an
   OpenAI-style 503 ``processor_unavailable`` (``processor_failure:
   closed``), or one route per model on the body's model, unscheduled
   (``open``).

With ``shards:`` (per-model sharding, docs/cluster.md), each model's routes
carry an ``ExtProcPerRoute`` whose ``grpc_service`` is the owning instance's
cluster ``extproc_<shard>``; a route on the body's model (matched when
ext_proc reads the route, before the processor set the model header) is what
picks it. The default ``extproc`` cluster lists every instance and answers
requests naming no configured model.

With ``cluster.instances`` (active-active, docs/cluster.md), the ``extproc``
cluster lists every instance; Envoy's default round-robin spreads the streams.

With ``listen.tls``, every processor cluster speaks TLS to the processor
(:func:`_processor_tls`; docs/configuration.md, "TLS on the gRPC port").

Whatever Envoy answers itself (step 1's 401, the router's 503 when an
engine cannot be reached, 413, 408) becomes the processor's
OpenAI-style JSON error with a reason header, through the HTTP connection
manager's ``local_reply_config`` (:func:`local_reply_config`).
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import yaml
from google.protobuf.json_format import ParseError

from extproc.adapters.answers import ANSWERS, answer_headers, error_body, retry_after_s
from extproc.adapters.config import Config, ConfigError, is_ip_address, load_config, split_address
from extproc.adapters.envoy_merge import bootstrap_message, merge
from extproc.adapters.ext_proc.contract import (
    DESTINATION_HEADER,
    EXT_PROC_SERVICE,
    HOLD_MARGIN_S,
    METADATA_NAMESPACE,
    PROCESSING_MODE,
    QUEUE_WAIT_HEADER,
    REASON_HEADER,
    hold_timeout_for,
)
from extproc.core.outcomes import Refusal

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
# Envoy asks the processor's gRPC health this often. A NOT_SERVING answer (a
# draining processor) takes it out of the extproc cluster's rotation at once
# (measured 0.9 s after SIGTERM); a check that fails or times out must fail
# twice, so one slow answer during a burst does not.
EXTPROC_HEALTH_INTERVAL_S = 1.0
EXTPROC_UNHEALTHY_THRESHOLD = 2
# A processor instance that refused a connection or reset its streams stays out this
# long, unless a passing health check brings it back first (_processor_outlier_detection).
PROCESSOR_EJECTION_S = 10.0
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


def _sanitise_filter(config: Config, *, keep_tenant: bool = False) -> dict[str, Any]:
    """Drop headers only Envoy and the processor may set.

    The model header routes the request: a client-sent one must not survive
    into the processor or the router. The tenant header is stripped too
    (api_key_auth or jwt_authn, when configured, set it afterwards), unless
    ``keep_tenant``: a drop-in without either leaves identity to the
    operator's own auth filter, which runs earlier and sets it.
    """
    # The fairness-id headers name a tenant too: only a gateway's auth in front may set them.
    tenant = [] if keep_tenant else [config.identity.tenant_header, *config.identity.fairness_id_headers]
    remove = [config.identity.model_header, *tenant, DESTINATION_HEADER, *ECHOED_HEADERS]
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
                    # As written (PROTOBUF_VALUE): NUMBER would turn "nan" and "inf"
                    # into numbers and true into 1; the processor refuses those.
                    rule("max_tokens", "max_tokens", "PROTOBUF_VALUE"),
                    rule("max_completion_tokens", "max_completion_tokens", "PROTOBUF_VALUE"),
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
            # Always allowed: a released request whose processor dies must run on (its
            # stream only waits for the response's end). Whether a request the processor
            # never answered may reach the engine is decided by the routes: without the
            # model header it set, only processor_failure: open routes it (see routes()).
            "failure_mode_allow": True,
            "processing_mode": dict(PROCESSING_MODE),
            # Short, so a dead processor is noticed fast; the processor holds
            # a queued request with override_message_timeout up to the maximum.
            "message_timeout": _duration(config.envoy.message_timeout_ms / 1000),
            "max_message_timeout": _duration(hold_timeout_s(config)),
            "allow_mode_override": True,
            "metadata_options": {"forwarding_namespaces": {"untyped": [METADATA_NAMESPACE]}},
        },
    }


def _admission_filter(config: Config) -> dict[str, Any]:
    """A token bucket in front of the processor: a burst it cannot answer in time is shed here.

    The processor takes in new streams at a bounded rate (each costs it about
    0.4 ms of CPU); Envoy starts every stream's message timeout at once, so the
    tail of a large enough burst would get a bare 504. Envoy answers the excess
    itself, at once: 503, ``x-extproc-reason: overloaded``, ``Retry-After: 1``
    (the JSON error comes from :func:`local_reply_config`, which knows the
    filter's reply by its details, ``local_rate_limited``).
    Held requests hold no token: the bucket limits arrivals, not the queue.
    """
    envoy = config.envoy

    def always(key: str) -> dict[str, Any]:
        return {"default_value": {"numerator": 100, "denominator": "HUNDRED"}, "runtime_key": key}

    return {
        "name": "envoy.filters.http.local_ratelimit",
        "typed_config": {
            "@type": _TYPE + "envoy.extensions.filters.http.local_ratelimit.v3.LocalRateLimit",
            "stat_prefix": "extproc_admission",
            "status": {"code": "ServiceUnavailable"},
            "token_bucket": {
                "max_tokens": envoy.admission_burst,
                "tokens_per_fill": envoy.admission_per_second,
                "fill_interval": "1s",
            },
            "filter_enabled": always("extproc_admission.enabled"),
            "filter_enforced": always("extproc_admission.enforced"),
            # The reason, Retry-After and JSON body come from local_reply_config (by the details).
        },
    }


def _router_filter() -> dict[str, Any]:
    return {
        "name": "envoy.filters.http.router",
        "typed_config": {"@type": _TYPE + "envoy.extensions.filters.http.router.v3.Router"},
    }


def http_filters(config: Config, *, ext_proc: bool = True, own_identity: bool = False) -> list[dict[str, Any]]:
    """The HTTP filter chain, in order (``ext_proc=False``: the benchmark's Envoy-only baseline).

    ``own_identity``: without api_keys or jwt, a client-sent tenant header is
    kept, for the operator's auth filter before ours has set it (drop-in).
    """
    identity = [_api_key_auth_filter(config)] if config.envoy.api_keys else []
    if config.envoy.jwt is not None:
        identity.append(_jwt_authn_filter(config))
    processor = [_admission_filter(config), _ext_proc_filter(config)] if ext_proc else []
    return [
        _sanitise_filter(config, keep_tenant=own_identity and not identity),
        *identity,
        _json_to_metadata_filter(),
        *processor,
        _router_filter(),
    ]


# --- routes and clusters ----------------------------------------------------------


def _model_match(config: Config, model: str, ext_proc: bool, prefix: str = "/") -> dict[str, Any]:
    """Match the model header the processor sets or, without a processor, the body's model.

    The metadata match works because json_to_metadata runs before anything
    picks the route (checked with Envoy 1.40).
    """
    if ext_proc:
        return {"prefix": prefix, "headers": [{"name": config.identity.model_header, "string_match": {"exact": model}}]}
    path = [{"key": "model"}]
    served = config.model(model)
    names = (model, *served.served_names) if served is not None else (model,)
    value = {"string_match": {"exact": model} if len(names) == 1 else {"safe_regex": {"regex": _names_regex(names)}}}
    return {"prefix": prefix, "dynamic_metadata": [{"filter": METADATA_NAMESPACE, "path": path, "value": value}]}


def _names_regex(names: tuple[str, ...]) -> str:
    """An RE2 expression (matched whole, as Envoy does) for exact names and shell-style patterns."""
    def one(name: str) -> str:
        parts, i = [], 0
        while i < len(name):
            c = name[i]
            end = name.find("]", i + 2) if c == "[" else -1
            if c == "*":
                parts.append(".*")
            elif c == "?":
                parts.append(".")
            elif end > 0:  # a class: [abc], [!abc]
                inner = name[i + 1:end]
                parts.append("[" + ("^" + inner[1:] if inner.startswith("!") else inner).replace("\\", "\\\\") + "]")
                i = end
            else:
                parts.append(re.escape(c))
            i += 1
        return "".join(parts)
    return "|".join(f"(?:{one(n)})" for n in names)


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


@dataclass(frozen=True)
class RouteScope:
    """Where the generated routes live: the path prefixes they own and how they are named.

    The full bootstrap owns ``/``. A drop-in owns only the LLM prefixes (every
    other path on the operator's listener is theirs), names its routes with
    ``name_prefix`` so a merge can find them again, turns its filters on per
    route (``per_filter``) and routes models to ``clusters`` the operator
    already has.
    """

    prefixes: tuple[str, ...] = ("/",)
    name_prefix: str = ""
    per_filter: Mapping[str, Any] = field(default_factory=dict)
    clusters: Mapping[str, str] = field(default_factory=dict)


def routes(config: Config, *, ext_proc: bool = True, scope: RouteScope = RouteScope()) -> list[dict[str, Any]]:
    """Per path prefix: one route per model on the model header (or body model), then the prefix's catch-all."""
    idle = _duration(_idle_timeout_s(config))
    clusters = {**_cluster_names(config), **scope.clusters}
    many = len(scope.prefixes) > 1

    def named(name: str, index: int) -> str:
        return f"{scope.name_prefix}{name}" + (f"_{index}" if many else "")

    def route(route_name: str, match: dict[str, Any], cluster: str) -> dict[str, Any]:
        result: dict[str, Any] = {
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
        return _with_filters(result, scope)

    result: list[dict[str, Any]] = []
    for i, prefix in enumerate(scope.prefixes):
        if ext_proc and _picks_endpoints(config):
            # Only the processor sets the destination header (Envoy strips a client's).
            picked = {"prefix": prefix, "headers": [{"name": DESTINATION_HEADER, "present_match": True}]}
            result.append(route(named(PICKED_CLUSTER, i), picked, PICKED_CLUSTER))
        result += [
            _sharded(config, m.name, route(named(clusters[m.name], i), _model_match(config, m.name, ext_proc, prefix),
                                           clusters[m.name]))
            for m in config.models
        ]
        if ext_proc and config.envoy.processor_failure == "open":
            # A request the processor never answered carries no model header: route it
            # on the body's model, as the gateway without a processor would. With shards,
            # these are also the routes a request first lands on: they pick its processor.
            result += [
                _sharded(config, m.name, route(named(f"{clusters[m.name]}_unscheduled", i),
                                               _model_match(config, m.name, False, prefix), clusters[m.name]))
                for m in config.models
            ]
        if ext_proc and config.envoy.processor_failure == "closed":
            # Only the processor sets the model header, so a request without one was never
            # answered by it (crashed, restarting, silent past message_timeout): refuse it.
            reply = _json_reply(Refusal.PROCESSOR_UNAVAILABLE, "The scheduler is unavailable; retry shortly.")
            if config.shards:
                # A request first lands on its body model's route, which names the shard
                # that schedules it; unanswered by that shard, it is refused as below.
                result += [
                    _sharded(config, m.name, _with_filters({
                        **reply, "name": named(f"{clusters[m.name]}_{reply['name']}", i),
                        "match": _model_match(config, m.name, False, prefix),
                    }, scope))
                    for m in config.models
                ]
        else:
            # Defence in depth: the processor normally rejects unknown models itself.
            reply = _json_reply(Refusal.MODEL_NOT_FOUND, "The requested model does not exist on this server.")
        # An LLM request first lands here (no model header yet): this route turns the filters on.
        result.append(_with_filters({**reply, "name": named(reply["name"], i), "match": {"prefix": prefix}}, scope))
    return result


def shard_cluster_name(shard: str) -> str:
    """The gRPC cluster of one shard's processor instance."""
    return f"{EXTPROC_CLUSTER}_{shard}"


def _sharded(config: Config, model: str, route: dict[str, Any]) -> dict[str, Any]:
    """With shards, ``route`` sends ext_proc to the instance that owns ``model`` (ExtProcPerRoute).

    ext_proc reads the route when the request headers arrive, after
    json_to_metadata has read the body's model, so the route matched on that
    model decides which instance schedules the request.
    """
    shard = config.shard_of(model)
    if shard is None:
        return route
    route.setdefault("typed_per_filter_config", {})["envoy.filters.http.ext_proc"] = {
        "@type": _TYPE + "envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute",
        "overrides": {"grpc_service": {"envoy_grpc": {"cluster_name": shard_cluster_name(shard)}}},
    }
    return route


def _with_filters(route: dict[str, Any], scope: RouteScope) -> dict[str, Any]:
    if scope.per_filter:
        route["typed_per_filter_config"] = copy.deepcopy(dict(scope.per_filter))
    return route


def _json_reply(refusal: Refusal, message: str) -> dict[str, Any]:
    """A catch-all route answering Envoy's own OpenAI-style error, named by the reason."""
    headers = [("content-type", "application/json"), *answer_headers(refusal, retry_after_s(refusal))]
    body = json.dumps(error_body(refusal, message), separators=(",", ":"))
    return {
        "name": refusal.value,
        "match": {"prefix": "/"},
        "direct_response": {"status": ANSWERS[refusal].status, "body": {"inline_string": body}},
        "response_headers_to_add": [
            {"header": {"key": key, "value": value}, "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}
            for key, value in headers
        ],
    }


def _extproc_health_check() -> dict[str, Any]:
    """gRPC health checks on the processor, so Envoy stops opening streams to a draining one.

    With several processors behind the cluster (a DNS name, cluster instances), new requests
    move to the serving ones within about two intervals. A single processor
    stays in use while it drains (Envoy's panic mode routes to unhealthy hosts
    when too few are healthy), which is what we want: it answers new requests
    503 ``shutting_down`` itself. ``no_traffic_interval`` is Envoy's 60 s
    default otherwise, too slow to notice a drain on a quiet gateway.
    """
    interval = _duration(EXTPROC_HEALTH_INTERVAL_S)
    return {
        "timeout": interval,
        "interval": interval,
        "no_traffic_interval": interval,
        "unhealthy_threshold": EXTPROC_UNHEALTHY_THRESHOLD,
        "healthy_threshold": 1,
        "grpc_health_check": {"service_name": EXT_PROC_SERVICE},
    }


def extproc_cluster(config: Config) -> dict[str, Any]:
    """The processor's gRPC cluster (HTTP/2).

    With shards, every instance: the filter's default, for requests whose body
    names no configured model (any instance answers those ``model_not_found``).
    With ``cluster.instances`` (active-active), every instance too: Envoy's
    default round-robin spreads the streams, so one tenant's requests land on
    all of them. Otherwise the one processor at ``listen.grpc``.
    """
    return _processor_cluster(config, EXTPROC_CLUSTER, processor_addresses(config))


def processor_addresses(config: Config) -> list[str]:
    """Where Envoy reaches the processor instances: every shard, every cluster instance, or ``listen.grpc``."""
    instances = config.cluster.instances if config.cluster is not None else {}
    listed = config.shards or instances
    return [instance.grpc for instance in listed.values()] or [config.listen.grpc]


def shard_clusters(config: Config) -> list[dict[str, Any]]:
    """One gRPC cluster per shard's processor instance (none without shards)."""
    return [_processor_cluster(config, shard_cluster_name(name), [shard.grpc]) for name, shard in config.shards.items()]


def _processor_cluster(config: Config, name: str, addresses: list[str]) -> dict[str, Any]:
    hosts = [(_connectable(host), port) for host, port in map(split_address, addresses)]
    cluster: dict[str, Any] = {
        "name": name,
        "type": "STATIC" if all(is_ip_address(h) for h, _ in hosts) else "STRICT_DNS",
        # The message timeout's budget: a refused connection (processor down) fails at once
        # anyway, while under a burst Envoy itself handles the connect event late — a
        # shorter timeout turned a cold burst into thousands of 503s (docs/reliability.md).
        "connect_timeout": _duration(config.envoy.message_timeout_ms / 1000),
        "typed_extension_protocol_options": _protocol_options(http2=True),
        "circuit_breakers": _circuit_breakers(),
        "health_checks": [_extproc_health_check()],
        "outlier_detection": _processor_outlier_detection(),
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": _socket_address(h, p)}} for h, p in hosts]}],
        },
    }
    if config.listen.tls is not None:
        cluster["transport_socket"] = _processor_tls(config, {h for h, _ in hosts})
    return cluster


def _processor_tls(config: Config, hosts: set[str]) -> dict[str, Any]:
    """Envoy's TLS to the processor (``listen.tls``), ALPN h2 for gRPC.

    The processor's certificate is checked against ``envoy.processor_ca_file``
    (the chain only, not the name); without it any certificate is accepted, as
    Gateway API Inference Extension gateways do (an empty validation context):
    encrypted, not authenticated. With ``listen.tls.client_ca_file`` the
    processor asks for a certificate, so Envoy must have one. SNI is the
    processor's host name, when every instance of the cluster has the same one.
    """
    envoy = config.envoy
    assert config.listen.tls is not None
    ca = envoy.processor_ca_file
    common: dict[str, Any] = {
        "alpn_protocols": ["h2"],
        "validation_context": {} if ca is None else {"trusted_ca": {"filename": ca}},
    }
    if envoy.processor_client_cert_file is not None:
        common["tls_certificates"] = [{
            "certificate_chain": {"filename": envoy.processor_client_cert_file},
            "private_key": {"filename": envoy.processor_client_key_file},
        }]
    context: dict[str, Any] = {"@type": _TYPE + "envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
                               "common_tls_context": common}
    if len(hosts) == 1 and not is_ip_address(host := next(iter(hosts))):
        context["sni"] = host
    return {"name": "envoy.transport_sockets.tls", "typed_config": context}


def _processor_outlier_detection() -> dict[str, Any]:
    """Eject a processor instance at its first refused connection or reset stream.

    A killed instance (``kill -9``) resets every stream it held and refuses
    the next connection; each such stream is a request answered
    ``processor_unavailable`` (or sent on unscheduled), so the instance leaves
    the rotation at the first one rather than the health check's two failed
    intervals. A live instance ejected by a single slow connect under a burst
    comes back at its next passing health check (Envoy un-ejects on a
    successful active check), so the long ejection costs it about a second;
    a dead one stays out until it answers its health check again. Only local-origin
    failures count: the processor gives its own refusals inside a gRPC OK stream.
    With every instance ejected (a single processor), Envoy's panic routing
    still tries them, as without outlier detection.
    """
    return {
        "split_external_local_origin_errors": True,
        "consecutive_local_origin_failure": 1,
        "enforcing_consecutive_local_origin_failure": 100,
        "interval": _duration(1.0),
        "base_ejection_time": _duration(PROCESSOR_EJECTION_S),
        "max_ejection_percent": 100,
    }


def _model_cluster(config: Config, index: int, name: str) -> dict[str, Any]:
    model = config.models[index]
    parts = [urlsplit(url) for url in model.endpoints]
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
    if parts[0].scheme == "https":
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


def _picks_endpoints(config: Config) -> bool:
    """Whether any model picks endpoints: only then the ORIGINAL_DST cluster and route exist."""
    return any(model.endpoint_picking for model in config.models)


def clusters(config: Config, *, existing: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
    """The processor's cluster, the picked-endpoint one (with endpoint picking), one per model, jwks.

    ``existing`` maps a model to a cluster the operator's Envoy already has:
    no cluster is generated for it (the routes use that name).
    """
    names = _cluster_names(config)
    existing = existing or {}
    jwt = config.envoy.jwt
    jwks = [_jwks_cluster(jwt.jwks_uri)] if jwt is not None and jwt.jwks_uri is not None else []
    picked = [picked_cluster()] if _picks_endpoints(config) else []
    return [extproc_cluster(config), *shard_clusters(config), *picked] + [
        _model_cluster(config, i, names[m.name]) for i, m in enumerate(config.models) if m.name not in existing
    ] + jwks


def _hcm_settings(config: Config) -> dict[str, Any]:
    """Timeouts and Envoy's own answers for the HTTP connection manager."""
    return {
        "local_reply_config": local_reply_config(),
        # The request is "received" only once ext_proc releases it, so the
        # whole queue wait counts here.
        "request_timeout": _duration(hold_timeout_s(config) + UPLOAD_MARGIN_S),
        # While held, nothing moves on the stream.
        "stream_idle_timeout": _duration(_idle_timeout_s(config)),
    }


# --- Envoy's own answers ------------------------------------------------------------


@dataclass(frozen=True)
class LocalReply:
    """One kind of answer Envoy gives itself, rewritten to the processor's OpenAI-style JSON error.

    Status, error type and Retry-After are the reason's (``adapters/answers.py``).
    """

    reason: Refusal  # the error's ``code`` and the reason header
    match: dict[str, Any]  # an access-log filter (status, response flags or CEL on the details)
    message: str  # an Envoy format string


def _status_is(refusal: Refusal) -> dict[str, Any]:
    code = ANSWERS[refusal].status
    value = {"default_value": code, "runtime_key": f"extproc.local_reply.status_{code}"}
    return {"status_code_filter": {"comparison": {"op": "EQ", "value": value}}}


def _status_at_least(refusal: Refusal) -> dict[str, Any]:
    code = ANSWERS[refusal].status
    value = {"default_value": code, "runtime_key": f"extproc.local_reply.status_ge_{code}"}
    return {"status_code_filter": {"comparison": {"op": "GE", "value": value}}}


def _flags(*flags: str) -> dict[str, Any]:
    return {"response_flag_filter": {"flags": list(flags)}}


def _cel(expression: str) -> dict[str, Any]:
    return {
        "extension_filter": {
            "name": "envoy.access_loggers.extension_filters.cel",
            "typed_config": {
                "@type": _TYPE + "envoy.extensions.access_loggers.filters.cel.v3.ExpressionFilter",
                "expression": expression,
            },
        }
    }


# The processor's own answers carry the reason header and are JSON already:
# the first mapper matches them and leaves them as they are.
_PROCESSOR_ANSWER = _cel(f"'{REASON_HEADER}' in response.headers")
# Tried in order after that; the first that matches wins. ext_proc's failures
# (no response flag) are told apart by their details, the router's upstream
# failures by their response flags.
LOCAL_REPLIES = (
    LocalReply(Refusal.UNAUTHENTICATED, _status_is(Refusal.UNAUTHENTICATED), "%LOCAL_REPLY_BODY%"),
    LocalReply(Refusal.PERMISSION_DENIED, _status_is(Refusal.PERMISSION_DENIED), "%LOCAL_REPLY_BODY%"),
    # The admission bucket (local_ratelimit), circuit breakers (UO) or Envoy's overload manager (OM) shedding load.
    LocalReply(
        Refusal.OVERLOADED,
        # local_ratelimit sets no response flag its filter could match (checked on Envoy 1.40): its details.
        {"or_filter": {"filters": [_cel("response.code_details == 'local_rate_limited'"), _flags("UO", "OM")]}},
        "The gateway is overloaded; retry shortly.",
    ),
    LocalReply(Refusal.ENGINE_UNAVAILABLE, _flags("UF", "UH", "URX", "UR", "UC", "NC"),
               "The model server is unavailable; retry shortly."),
    LocalReply(Refusal.UPSTREAM_TIMEOUT, _flags("UT"), "The model server did not answer in time."),
    LocalReply(Refusal.REQUEST_TIMEOUT, _status_is(Refusal.REQUEST_TIMEOUT), "The request timed out at the gateway."),
    LocalReply(Refusal.REQUEST_TOO_LARGE, _status_is(Refusal.REQUEST_TOO_LARGE),
               "The request body is larger than the gateway accepts."),
    LocalReply(Refusal.MODEL_NOT_FOUND, _status_is(Refusal.MODEL_NOT_FOUND),
               "The requested model does not exist on this server."),
    # Anything else: Envoy's details name the cause (its body may be empty).
    LocalReply(Refusal.GATEWAY_ERROR, _status_at_least(Refusal.GATEWAY_ERROR),
               "The gateway could not complete the request (%RESPONSE_CODE_DETAILS%)."),
    LocalReply(Refusal.BAD_REQUEST, _status_at_least(Refusal.BAD_REQUEST),
               "The gateway refused the request (%RESPONSE_CODE_DETAILS%)."),
)


def _mapper(reply: LocalReply) -> dict[str, Any]:
    return {
        "filter": copy.deepcopy(reply.match),
        "body_format_override": {"json_format": error_body(reply.reason, reply.message)},
        "headers_to_add": [
            {"header": {"key": key, "value": value}, "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}
            for key, value in answer_headers(reply.reason, retry_after_s(reply.reason))
        ],
    }


def local_reply_config() -> dict[str, Any]:
    """HCM ``local_reply_config``: every answer Envoy gives itself as the OpenAI-style JSON error.

    Envoy's own replies (an auth filter's 401, an unreachable processor or
    engine, timeouts, a body too large) are plain text or empty; OpenAI
    clients expect the error object and operators the reason header.
    """
    # Copies: each document owns its dicts (protobuf's ParseDict reorders the keys of what it reads).
    return {"mappers": [{"filter": copy.deepcopy(_PROCESSOR_ANSWER)}, *(_mapper(reply) for reply in LOCAL_REPLIES)]}


# --- documents -----------------------------------------------------------------


def _refuse(config: Config) -> None:
    """What only Envoy's side needs (``Config.envoy_problems``), refused before anything is built."""
    problems = config.envoy_problems()
    if problems:
        raise ConfigError(*problems)


def bootstrap(config: Config, *, ext_proc: bool = True) -> dict[str, Any]:
    """A complete Envoy bootstrap for this config.

    ``ext_proc=False`` is the same gateway without the processor (no
    ext_proc filter; routes match the body's model in json_to_metadata's
    metadata): the benchmark's baseline for what Envoy alone costs.
    """
    _refuse(config)
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
        **_hcm_settings(config),
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


# The OpenAI paths a drop-in owns by default: what the processor schedules. Other
# paths (``/v1/models`` too) stay with the operator's routes.
LLM_PREFIXES = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
# A drop-in's filters and routes are named so, so a merge finds them again.
DROP_IN_FILTER_PREFIX = "extproc."
DROP_IN_ROUTE_PREFIX = "extproc-"
_FILTER_CONFIG = _TYPE + "envoy.config.route.v3.FilterConfig"


def _on_llm_paths(prefixes: tuple[str, ...], match: dict[str, Any]) -> dict[str, Any]:
    """``match`` (an access-log filter) only for requests on the LLM paths."""
    paths = " || ".join(f"request.url_path.startsWith({json.dumps(p)})" for p in prefixes)
    return {"and_filter": {"filters": [_cel(paths), match]}}


def drop_in(
    config: Config, *, prefixes: tuple[str, ...] = LLM_PREFIXES, existing_clusters: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """What to add to an existing Envoy, in the form :func:`envoy_merge.merge` merges mechanically.

    The filters are off (``disabled: true``) except on the routes generated
    here, which own only ``prefixes``: every other route on the listener runs
    what it ran before. ``existing_clusters`` maps a model to a cluster the
    operator's Envoy already has (no second cluster for the same engines).
    """
    _refuse(config)
    if config.shards:
        raise ConfigError("shards: the drop-in does not support per-model sharding yet; "
                          "use the complete bootstrap (`extproc envoy-config` without --drop-in/--into)")
    existing = dict(existing_clusters or {})
    unknown = sorted(set(existing) - {m.name for m in config.models})
    if unknown:
        raise ConfigError(*(f"--cluster {name}=…: no model {name!r} in the config" for name in unknown))
    filters = [
        {**item, "name": DROP_IN_FILTER_PREFIX + item["name"].rpartition(".")[2], "disabled": True}
        for item in http_filters(config, own_identity=True)
        if item["name"] != "envoy.filters.http.router"
    ]
    # Turned on per route: a FilterConfig without config runs the filter with its listener config.
    enable = {item["name"]: {"@type": _FILTER_CONFIG, "config": {}} for item in filters}
    scope = RouteScope(prefixes=prefixes, name_prefix=DROP_IN_ROUTE_PREFIX, per_filter=enable, clusters=existing)
    settings = _hcm_settings(config)
    mappers = settings["local_reply_config"]["mappers"]
    settings["local_reply_config"] = {
        "mappers": [{**m, "filter": _on_llm_paths(prefixes, m["filter"])} for m in mappers]
    }
    return {
        "listener": {"per_connection_buffer_limit_bytes": BUFFER_LIMIT_BYTES},
        "http_connection_manager": settings,
        "http_filters": filters,
        "routes": routes(config, scope=scope),
        "clusters": clusters(config, existing=existing),
    }


DROP_IN_HEADER = (
    "# Generated by `extproc envoy-config --drop-in` (extproc/adapters/envoy_config.py).\n"
    "# Merged mechanically by `extproc envoy-config --config FILE --into YOUR-ENVOY.yaml`; by hand:\n"
    "#   listener: raise per_connection_buffer_limit_bytes to this value;\n"
    "#   http_connection_manager: raise request_timeout / stream_idle_timeout where yours are lower\n"
    "#     (not where 0 = no limit); put these local_reply_config mappers before yours;\n"
    "#   http_filters: insert before your router, in this order (each is off except on the routes below;\n"
    "#     your own auth filter goes before them, see docs/drop-in.md);\n"
    "#   routes: insert first in your virtual host (they own only the LLM paths);\n"
    "#   clusters: add (name models[].endpoints' clusters you already have with --cluster MODEL=NAME).\n"
)


def render(doc: dict[str, Any], *, header: str = HEADER) -> str:
    """YAML text with a generated-by header; the same dict always gives the same text."""
    body = yaml.safe_dump(doc, sort_keys=False, default_flow_style=False, allow_unicode=True, width=100)
    return header + body


# --- CLI: `extproc envoy-config` --------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, metavar="FILE", help="extproc YAML configuration")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--drop-in",
        action="store_true",
        help="print the filters, routes and clusters to merge into an existing Envoy (see --into)",
    )
    mode.add_argument(
        "--into",
        metavar="ENVOY.yaml",
        help="print ENVOY.yaml (a static bootstrap) with the drop-in merged in and validated",
    )
    parser.add_argument(
        "--llm-prefix",
        action="append",
        metavar="PATH",
        help=f"a path prefix the drop-in schedules (repeatable; default: {' '.join(LLM_PREFIXES)})",
    )
    parser.add_argument(
        "--cluster",
        action="append",
        default=[],
        metavar="MODEL=CLUSTER",
        help="route MODEL to a cluster your Envoy already has instead of generating one (repeatable)",
    )
    parser.add_argument("--listener", metavar="NAME", help="with --into: the listener to merge into (if several)")
    parser.add_argument("--virtual-host", metavar="NAME", help="with --into: the virtual host for the routes (if several)")


def _existing_clusters(pairs: list[str]) -> dict[str, str]:
    result: dict[str, str] = {}
    for pair in pairs:
        model, sep, cluster = pair.partition("=")
        if not sep or not model or not cluster:
            raise ConfigError(f"--cluster {pair!r}: expected MODEL=CLUSTER")
        result[model] = cluster
    return result


def _document(args: argparse.Namespace, config: Config) -> tuple[dict[str, Any], str]:
    """The document the arguments ask for, with its header."""
    if not (args.drop_in or args.into):
        return bootstrap(config), HEADER
    prefixes = tuple(args.llm_prefix or LLM_PREFIXES)
    bad = [p for p in prefixes if not p.startswith("/")]
    if bad:
        raise ConfigError(*(f"--llm-prefix {p!r}: must start with /" for p in bad))
    piece = drop_in(config, prefixes=prefixes, existing_clusters=_existing_clusters(args.cluster))
    if args.drop_in:
        return piece, DROP_IN_HEADER
    try:
        with open(args.into, encoding="utf-8") as handle:
            existing = yaml.safe_load(handle)
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{args.into}: {exc}") from exc
    if not isinstance(existing, dict):
        raise ConfigError(f"{args.into}: not an Envoy bootstrap (a YAML mapping)")
    try:
        merged = merge(existing, piece, listener=args.listener, virtual_host=args.virtual_host)
        bootstrap_message(merged)
    except ConfigError as exc:
        raise ConfigError(*(f"{args.into}: {error}" for error in exc.errors)) from exc
    except ParseError as exc:
        raise ConfigError(f"{args.into}: the merged bootstrap is not valid Envoy config: {exc}") from exc
    header = f"# {args.into} with the extproc drop-in merged in by `extproc envoy-config --into`.\n"
    return merged, header


def main_envoy_config(args: argparse.Namespace) -> int:
    """`extproc envoy-config --config FILE [--drop-in | --into ENVOY.yaml]`: YAML on stdout; 2 on an error."""
    try:
        config = load_config(args.config)
        try:
            doc, header = _document(args, config)
        except ConfigError as exc:
            raise ConfigError(*(f"{args.config}: {error}" for error in exc.errors)) from exc
    except ConfigError as exc:
        for error in exc.errors:
            print(f"error: {error}", file=sys.stderr)
        return 2
    sys.stdout.write(render(doc, header=header))
    return 0
