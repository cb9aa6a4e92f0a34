"""Envoy bootstraps in the shapes real Gateway API Inference Extension (GIE) gateways generate.

Our processor attached as a conformant Endpoint Picker (EPP) by ext_proc
alone: no ``json_to_metadata``, no auth filter, nothing of our own generator
(``adapters/envoy/``); the processor reads the body itself. The tests
(``tests/stack/test_gie_gateway.py``) and the overhead benchmark's ``gie-*`` arms run
these through a real Envoy.

``strict(config, model, body=...)`` is what Envoy AI Gateway writes for an
InferencePool (envoyproxy/ai-gateway @ c217da8a539570ba3f6014a60c2687c29a945f1f,
internal/extensionserver/):

* inferencepool.go: the EPP's ext_proc filter
  ``envoy.filters.http.ext_proc/endpointpicker/<pool>_<ns>_ext_proc``, before
  the router, calling ``envoy.clusters.endpointpicker_<pool>_<ns>_ext_proc``
  (authority ``<svc>.<ns>.svc:<port>``); request and response headers and
  trailers SEND, both bodies ``FULL_DUPLEX_STREAMED`` (annotation
  ``duplex``, the default) or ``BUFFERED`` (``buffered``);
  ``allow_mode_override`` false, ``message_timeout`` 300 s,
  ``failure_mode_allow`` false. The EPP cluster: STRICT_DNS, LEAST_REQUEST,
  TLS that accepts any certificate (an empty validation context; ``tls=True``
  here, plaintext until our gRPC listener serves TLS), explicit HTTP/2,
  ``connect_timeout`` 10 s. No circuit breakers: Envoy's default of 1024
  requests per cluster limits the EPP streams, so at most 1024 requests can be
  held at once through this shape (measured: of 2,000 sent, 1,024 held or
  served, 976 answered 500 at once); ``epp_max_requests`` raises it, as an
  operator would (Envoy Gateway's circuit breaker settings).
* post_cluster_modify.go: the pool's cluster is ORIGINAL_DST, CLUSTER_PROVIDED,
  ``original_dst_lb_config`` on the header ``x-gateway-destination-endpoint``,
  ``connect_timeout`` 10 s.
* post_route_modify.go: the pool's route keeps its host (``auto_host_rewrite`` false).
* post_translate_modify.go: the filters go before the router; routes to other
  backends turn the EPP filter off per route (there are none here).

Envoy 1.40's ORIGINAL_DST parses the whole header value as one address
(original_dst_cluster.cc, ``requestOverrideHost``): a list ``ip:port,ip:port``
is invalid (``original_dst_host_invalid``) and the request fails 503. So in
this shape the EPP must name exactly one endpoint; fallbacks need ``fail_open``'s
cluster, which walks the list.

``with_batches(doc, config)`` adds to either shape the routes of the batch
API's manifests (deploy/gie/batches/): the API to the EPP pods, and the
batch runner's way in (docs/batches.md, "Behind an Endpoint Picker gateway").

``fail_open(config, model, body=...)`` is the shape GIE's conformance test
EppUnAvailableFailOpen asks for (kubernetes-sigs/gateway-api-inference-extension
@ 84436a96b9e6ce2b59ddacd3d04c31b4fbd442de,
conformance/tests/epp_unavailable_fail_open.go): ``failure_mode_allow`` true,
and a pool cluster that routes without the EPP: the pool's endpoints listed
(STATIC) under Envoy's ``override_host`` load-balancing policy, which takes
the endpoints from the header, then from dynamic metadata ``envoy.lb`` /
``x-gateway-destination-endpoint``, each attempt the next one of the list
(a retry walks the fallbacks), and round robin when there are none.
Measured on Envoy 1.40: the header and the metadata lists are concatenated, so
a single endpoint named by both is tried twice before round robin; and once
the list is used up, round robin may pick an endpoint outside a subset hint.

``failure_mode_allow`` alone does not fail open in ``duplex`` mode: Envoy 1.40
fails open only if the EPP stream fails before the first body chunk is sent
to it (envoyproxy/envoy#41276), and against a stopped EPP the chunks are
queued before the connection is refused, so the request gets 500
(``ext_proc_error_gRPC_error_14``). So here the EPP cluster is health-checked
over gRPC, without panic routing: an EPP known down (a failed check, or a
draining one answering NOT_SERVING) fails the stream at once, before any
chunk, and the request passes. A refused connection ejects it as well
(outlier detection), so of the duplex requests sent after its death only
those in flight to it, and at most the first new one, get 500.

``buffered`` buffers the response body too (AI Gateway sets both bodies to
the same mode): a streamed completion reaches the client in one piece at its
end, so time to first token is the whole generation.

What both add for the protocol (docs/proposals/004-endpoint-picker-protocol
in the GIE repository, same commit), beyond what AI Gateway writes:

* ext_proc ``metadata_options``: forwards ``envoy.lb.subset_hint`` (the
  subset hint) and ``envoy.lb`` (the served endpoint) to the EPP, and accepts
  the EPP's ``envoy.lb`` dynamic metadata (the picked endpoints, which
  ``override_host`` reads; Envoy drops an ext_proc server's dynamic metadata
  in namespaces not listed as receiving).
* The subset hint, set per request for the tests: a Lua filter before the EPP
  turns the header :data:`SUBSET_HINT_HEADER` (``ip:port`` separated by
  commas, empty for an empty list) into ``envoy.lb.subset_hint`` /
  ``x-gateway-destination-endpoint-subset``, a list, and removes the header.
* The served endpoint: the route adds the upstream's address to the response
  as :data:`SERVED_KEY`, and ``header_to_metadata`` (after the EPP in the
  chain, so before it on the response path) copies it into ``envoy.lb`` /
  :data:`SERVED_KEY`, which the EPP receives with the response headers. The
  header stays on the response, like the conformance suite's
  ``x-conformance-test-served-endpoint``; :data:`PICKED_HEADER` echoes what
  the EPP named, so a test sees both.
* A retry policy on the pool's route (``connect-failure,refused-stream,reset``).
"""

from __future__ import annotations

import copy
from typing import Any, Literal

from extproc.adapters.config import Config, split_address
from extproc.adapters.envoy.batches import API_PREFIXES, API_TIMEOUT_S, RUNNER_KEY_HEADER
from extproc.adapters.protocol.contract import DESTINATION_HEADER, EXT_PROC_SERVICE
from extproc.adapters.protocol.epp_protocol import DESTINATION_NAMESPACE as LB_NAMESPACE
from extproc.adapters.protocol.epp_protocol import SERVED_KEY, SUBSET_KEY, SUBSET_NAMESPACE

BodyMode = Literal["duplex", "buffered"]
# AI Gateway's annotation values (aigateway.envoyproxy.io/processing-body-mode) and the body mode each sets.
BODY_MODES: dict[BodyMode, str] = {"duplex": "FULL_DUPLEX_STREAMED", "buffered": "BUFFERED"}
# The InferencePool's name and namespace, and its EPP Service, in AI Gateway's naming.
POOL = "pool"
NAMESPACE = "default"
EPP_SERVICE = "epp"
EPP_FILTER = f"envoy.filters.http.ext_proc/endpointpicker/{POOL}_{NAMESPACE}_ext_proc"
EPP_CLUSTER = f"envoy.clusters.endpointpicker_{POOL}_{NAMESPACE}_ext_proc"
POOL_CLUSTER = f"inferencepool/{NAMESPACE}/{POOL}"
# Test hooks: the request header the subset hint is taken from, the response header naming the EPP's pick.
SUBSET_HINT_HEADER = "x-test-epp-subset"
PICKED_HEADER = "x-test-epp-picked"
CONNECT_TIMEOUT = "10s"
EPP_MESSAGE_TIMEOUT = "300s"
# Retries of what never reached an engine: each attempt takes the next endpoint of the
# EPP's list (fail_open's cluster), so this many more endpoints are tried.
POOL_RETRIES = 2
# fail_open's gRPC health check of the EPP (service envoy.service.ext_proc.v3.ExternalProcessor).
EPP_HEALTH_INTERVAL_S = 1.0
# A held request's stream is silent; a non-streamed generation sends nothing until done.
STREAM_IDLE_TIMEOUT = "600s"
# The body is buffered (BUFFERED mode) up to this; Envoy's default of 1 MiB would cut long prompts.
BUFFER_LIMIT_BYTES = 16 * 1024 * 1024

_TYPE = "type.googleapis.com/"

# Lua, before the EPP: the test's subset hint header into the protocol's metadata, a list; an
# empty one as "" (the empty string form), since Envoy turns an empty Lua table into a Struct.
_SUBSET_HINT_LUA = f"""
function envoy_on_request(request_handle)
  local hint = request_handle:headers():get("{SUBSET_HINT_HEADER}")
  if hint == nil then
    return
  end
  request_handle:headers():remove("{SUBSET_HINT_HEADER}")
  local endpoints = {{}}
  for endpoint in string.gmatch(hint, "[^,%s]+") do
    endpoints[#endpoints + 1] = endpoint
  end
  if #endpoints == 0 then
    endpoints = ""
  end
  request_handle:streamInfo():dynamicMetadata():set("{SUBSET_NAMESPACE}", "{SUBSET_KEY}", endpoints)
end
"""


def _address(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def _lb_endpoints(addresses: list[tuple[str, int]]) -> list[dict[str, Any]]:
    return [{"endpoint": {"address": _address(host, port)}} for host, port in addresses]


def pool_endpoints(config: Config, model: str) -> list[str]:
    """The model's endpoints as the EPP names them: ``ip:port``."""
    found = config.model(model)
    if found is None:
        raise ValueError(f"no model {model!r} in the config")
    return [endpoint.removeprefix("http://") for endpoint in found.endpoints]


def _epp_filter(config: Config, body: BodyMode, *, fail_open: bool) -> dict[str, Any]:
    mode = BODY_MODES[body]
    _, port = split_address(config.listen.grpc)
    return {
        "name": EPP_FILTER,
        "typed_config": {
            "@type": _TYPE + "envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {
                "envoy_grpc": {"cluster_name": EPP_CLUSTER, "authority": f"{EPP_SERVICE}.{NAMESPACE}.svc:{port}"}
            },
            "processing_mode": {
                "request_header_mode": "SEND",
                "request_body_mode": mode,
                "request_trailer_mode": "SEND",
                "response_header_mode": "SEND",
                "response_body_mode": mode,
                "response_trailer_mode": "SEND",
            },
            "allow_mode_override": False,
            "message_timeout": EPP_MESSAGE_TIMEOUT,
            "failure_mode_allow": fail_open,
            "metadata_options": {
                "forwarding_namespaces": {"untyped": [SUBSET_NAMESPACE, LB_NAMESPACE]},
                "receiving_namespaces": {"untyped": [LB_NAMESPACE]},
            },
        },
    }


def _subset_hint_filter() -> dict[str, Any]:
    return {
        "name": "envoy.filters.http.lua",
        "typed_config": {
            "@type": _TYPE + "envoy.extensions.filters.http.lua.v3.Lua",
            "default_source_code": {"inline_string": _SUBSET_HINT_LUA},
        },
    }


def _served_to_metadata_filter() -> dict[str, Any]:
    """The response's served-endpoint header into ``envoy.lb`` metadata, before the EPP sees the response."""
    return {
        "name": "envoy.filters.http.header_to_metadata",
        "typed_config": {
            "@type": _TYPE + "envoy.extensions.filters.http.header_to_metadata.v3.Config",
            "response_rules": [{
                "header": SERVED_KEY,
                "on_header_present": {"metadata_namespace": LB_NAMESPACE, "key": SERVED_KEY, "type": "STRING"},
                "remove": False,
            }],
        },
    }


def _route() -> dict[str, Any]:
    def response_header(key: str, value: str) -> dict[str, Any]:
        return {"header": {"key": key, "value": value}, "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}

    return {
        "name": f"{POOL}-route",
        "match": {"prefix": "/"},
        "route": {
            "cluster": POOL_CLUSTER,
            "auto_host_rewrite": False,
            # Generations stream for as long as they take.
            "timeout": "0s",
            "retry_policy": {"retry_on": "connect-failure,refused-stream,reset", "num_retries": POOL_RETRIES},
        },
        "response_headers_to_add": [
            response_header(SERVED_KEY, "%UPSTREAM_REMOTE_ADDRESS%"),
            response_header(PICKED_HEADER, f"%REQ({DESTINATION_HEADER})%"),
        ],
    }


def _epp_cluster(config: Config, *, tls: bool, health_checked: bool, max_requests: int | None) -> dict[str, Any]:
    host, port = split_address(config.listen.grpc)
    cluster: dict[str, Any] = {
        "name": EPP_CLUSTER,
        "type": "STRICT_DNS",
        "lb_policy": "LEAST_REQUEST",
        "connect_timeout": CONNECT_TIMEOUT,
        "load_assignment": {
            "cluster_name": EPP_CLUSTER,
            "endpoints": [{"lb_endpoints": [
                {"endpoint": {"address": _address(host, port)}, "health_status": "HEALTHY"}
            ]}],
        },
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": _TYPE + "envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        },
    }
    if max_requests is not None:  # each held request is one open EPP stream
        cluster["circuit_breakers"] = {"thresholds": [{"max_requests": max_requests}]}
    if health_checked:  # fail_open: an EPP known down is skipped before any body chunk goes to it
        interval = f"{EPP_HEALTH_INTERVAL_S:g}s"
        cluster["health_checks"] = [{
            "timeout": interval, "interval": interval, "no_traffic_interval": interval,
            "unhealthy_threshold": 1, "healthy_threshold": 1,
            "grpc_health_check": {"service_name": EXT_PROC_SERVICE},
        }]
        # Its first refused connection ejects it too, until a check passes again.
        cluster["outlier_detection"] = {
            "split_external_local_origin_errors": True,
            "consecutive_local_origin_failure": 1,
            "enforcing_consecutive_local_origin_failure": 100,
            "max_ejection_percent": 100,
            "base_ejection_time": "10s",
        }
        # No panic routing to an unhealthy EPP: "no healthy upstream" is what fails open.
        cluster["common_lb_config"] = {"healthy_panic_threshold": {"value": 0}}
    if tls:  # AI Gateway's: TLS, any certificate accepted
        cluster["transport_socket"] = {
            "name": "envoy.transport_sockets.tls",
            "typed_config": {
                "@type": _TYPE + "envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
                "common_tls_context": {"validation_context": {}},
            },
        }
    return cluster


def _original_dst_pool_cluster() -> dict[str, Any]:
    return {
        "name": POOL_CLUSTER,
        "type": "ORIGINAL_DST",
        "lb_policy": "CLUSTER_PROVIDED",
        "connect_timeout": CONNECT_TIMEOUT,
        "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION_HEADER},
    }


def _override_host_pool_cluster(endpoints: list[str]) -> dict[str, Any]:
    """The pool's endpoints, each request to the ones the EPP named (in order), else round robin."""
    addresses = [split_address(endpoint) for endpoint in endpoints]
    round_robin = {
        "name": "envoy.load_balancing_policies.round_robin",
        "typed_config": {"@type": _TYPE + "envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin"},
    }
    override_host = {
        "@type": _TYPE + "envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost",
        "override_host_sources": [
            {"header": DESTINATION_HEADER},
            {"metadata": {"key": LB_NAMESPACE, "path": [{"key": DESTINATION_HEADER}]}},
        ],
        "fallback_policy": {"policies": [{"typed_extension_config": round_robin}]},
    }
    return {
        "name": POOL_CLUSTER,
        "type": "STATIC",
        "connect_timeout": CONNECT_TIMEOUT,
        "load_assignment": {"cluster_name": POOL_CLUSTER, "endpoints": [{"lb_endpoints": _lb_endpoints(addresses)}]},
        "load_balancing_policy": {"policies": [{"typed_extension_config": {
            "name": "envoy.load_balancing_policies.override_host", "typed_config": override_host,
        }}]},
    }


def _bootstrap(config: Config, filters: list[dict[str, Any]], clusters: list[dict[str, Any]]) -> dict[str, Any]:
    listen_host, listen_port = split_address(config.envoy.listen)
    admin_host, admin_port = split_address(config.envoy.admin)
    access_log = {
        "name": "envoy.access_loggers.stdout",
        "typed_config": {
            "@type": _TYPE + "envoy.extensions.access_loggers.stream.v3.StdoutAccessLog",
            "log_format": {"json_format": {
                "path": "%REQ(:PATH)%", "status": "%RESPONSE_CODE%", "flags": "%RESPONSE_FLAGS%",
                "details": "%RESPONSE_CODE_DETAILS%", "picked": f"%REQ({DESTINATION_HEADER})%",
                "upstream": "%UPSTREAM_HOST%", "attempts": "%UPSTREAM_REQUEST_ATTEMPT_COUNT%",
                "duration_ms": "%DURATION%",
            }},
        },
    }
    hcm = {
        "@type": _TYPE + "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "gateway",
        "codec_type": "AUTO",
        "stream_idle_timeout": STREAM_IDLE_TIMEOUT,
        "access_log": [access_log],
        "route_config": {"name": POOL, "virtual_hosts": [{"name": POOL, "domains": ["*"], "routes": [_route()]}]},
        "http_filters": [
            *filters,
            {"name": "envoy.filters.http.router",
             "typed_config": {"@type": _TYPE + "envoy.extensions.filters.http.router.v3.Router"}},
        ],
    }
    return {
        "admin": {"address": _address(admin_host, admin_port)},
        "static_resources": {
            "listeners": [{
                "name": "gateway",
                "address": _address(listen_host, listen_port),
                "per_connection_buffer_limit_bytes": BUFFER_LIMIT_BYTES,
                "filter_chains": [{"filters": [
                    {"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}
                ]}],
            }],
            "clusters": clusters,
        },
    }


def _filters(config: Config, body: BodyMode, *, fail_open: bool) -> list[dict[str, Any]]:
    return [_subset_hint_filter(), _epp_filter(config, body, fail_open=fail_open), _served_to_metadata_filter()]


def strict(
    config: Config, model: str, *, body: BodyMode = "duplex", tls: bool = False, epp_max_requests: int | None = None,
) -> dict[str, Any]:
    """AI Gateway's InferencePool shape: EPP failures fail the request, ORIGINAL_DST to the one endpoint named.

    ``config`` gives the listen and admin addresses (``envoy``), the
    processor's gRPC address (``listen.grpc``) and the pool (``model``'s
    endpoints, which ORIGINAL_DST does not list).
    """
    pool_endpoints(config, model)  # the model must exist
    clusters = [_epp_cluster(config, tls=tls, health_checked=False, max_requests=epp_max_requests),
                _original_dst_pool_cluster()]
    return _bootstrap(config, _filters(config, body, fail_open=False), clusters)


def fail_open(
    config: Config, model: str, *, body: BodyMode = "duplex", tls: bool = False, epp_max_requests: int | None = None,
) -> dict[str, Any]:
    """The EPP's failure lets the request through; the pool's cluster lists its endpoints (see module docstring)."""
    clusters = [_epp_cluster(config, tls=tls, health_checked=True, max_requests=epp_max_requests),
                _override_host_pool_cluster(pool_endpoints(config, model))]
    return _bootstrap(config, _filters(config, body, fail_open=True), clusters)


BATCH_API_CLUSTER = "httproute/default/extproc-batches"


def with_batches(doc: dict[str, Any], config: Config) -> dict[str, Any]:
    """``doc`` (a shape above) with the two routes of deploy/gie/batches/'s HTTPRoutes, as a gateway translates them.

    * ``/v1/files`` and ``/v1/batches`` to the EPP pods' batch API
      (``batches.listen``, a Service of its own), the EPP filter off on them
      (as AI Gateway turns it off on routes to other backends); the tenant
      header is whatever the gateway's auth set (none here: the client's).
    * The runner's lines: a route that matches only with
      ``x-extproc-batch-key: <batches.runner_key>`` (a header match wins over
      the plain pool route), to the pool through the EPP as any request, the
      key removed. The runner names the batch's tenant and class itself; on a
      real gateway the auth applies to the users' routes, not to this one.
    """
    settings = config.batches
    if settings is None or settings.runner_key is None:
        raise ValueError("with_batches needs batches: with a runner_key")
    hcm = doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    routes: list[dict[str, Any]] = hcm["route_config"]["virtual_hosts"][0]["routes"]
    pool = routes[-1]
    off = {EPP_FILTER: {"@type": _TYPE + "envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute", "disabled": True}}
    api = [{"name": f"extproc-batches{prefix.replace('/', '-')}", "match": {"prefix": prefix},
            "route": {"cluster": BATCH_API_CLUSTER, "timeout": f"{API_TIMEOUT_S:g}s"},
            "typed_per_filter_config": copy.deepcopy(off)} for prefix in API_PREFIXES]
    runner = {**copy.deepcopy(pool), "name": "extproc-batch-runner",
              "match": {"prefix": "/v1/", "headers": [{"name": RUNNER_KEY_HEADER,
                                                    "string_match": {"exact": settings.runner_key}}]},
              "request_headers_to_remove": [RUNNER_KEY_HEADER]}
    routes[:0] = [*api, runner]
    host, port = split_address(settings.listen)
    doc["static_resources"]["clusters"].append({
        "name": BATCH_API_CLUSTER, "type": "STATIC", "connect_timeout": CONNECT_TIMEOUT,
        "load_assignment": {"cluster_name": BATCH_API_CLUSTER,
                            "endpoints": [{"lb_endpoints": _lb_endpoints([(host, port)])}]},
    })
    return doc
