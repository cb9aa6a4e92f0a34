"""The batch API's Envoy pieces (docs/batches.md): its routes, its cluster and the runner's listener.

* ``/v1/files`` and ``/v1/batches`` go to the processor's batch API
  (``batches.listen``) after the auth filter, ext_proc off on those routes:
  the API reads the tenant header auth set, as admission does.
* The runner's listener (``batches.runner_listen``) has the same chain
  without the auth filters, and its header_mutation keeps the tenant header,
  so each line arrives as its batch's tenant; with ``batches.runner_key``
  every one of its routes also requires the key's header (removed before the
  engine), and a request without it finds no route (404).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping

from extproc.adapters.config import Config, split_address
from extproc.adapters.envoy.base import Json, duration, typed
from extproc.adapters.envoy.clusters import Upstream, upstream
from extproc.adapters.envoy.filters import EXT_PROC_FILTER
from extproc.adapters.envoy.local_replies import direct_reply
from extproc.core.values.outcomes import Refusal

BATCH_API_CLUSTER = "extproc_batch_api"
API_PREFIXES = ("/v1/files", "/v1/batches")
# An upload of the largest file (200 MB) through a slow link.
API_TIMEOUT_S = 600.0
API_CONNECT_TIMEOUT_S = 5.0
# A call to an instance that is down goes to another (a cluster's instances all serve the API).
API_RETRIES = 2
# The header the runner listener's routes require with batches.runner_key (adapters/batches/local_runner.py sends it).
RUNNER_KEY_HEADER = "x-extproc-batch-key"


def api_routes(config: Config, *, name_prefix: str = "", per_filter: Mapping[str, Json] | None = None) -> list[Json]:
    """The API's routes, first on the listener (empty without ``batches:``).

    ``per_filter``: the routes' filter configs; by default ext_proc off (the
    complete bootstrap's filters run on every route). A drop-in's filters are
    off except where a route turns them on: it passes its identity filters.
    """
    if config.batches is None:
        return []
    filters = _ext_proc_off() if per_filter is None else dict(per_filter)
    route: Json = {"cluster": BATCH_API_CLUSTER, "timeout": duration(API_TIMEOUT_S)}
    if len(_api_addresses(config)) > 1:  # a cluster's instance that is down: the call goes to another one
        route["retry_policy"] = {"retry_on": "connect-failure,reset-before-request", "num_retries": API_RETRIES}
    return [{"name": f"{name_prefix}batch_api_{prefix.rsplit('/', 1)[1]}", "match": {"prefix": prefix},
             "route": copy.deepcopy(route), "typed_per_filter_config": copy.deepcopy(filters)}  # no YAML anchors
            for prefix in API_PREFIXES]


def _api_addresses(config: Config) -> list[str]:
    """``batches.listen``, or every cluster instance's ``batches`` (any of them serves any call)."""
    assert config.batches is not None
    instances = config.cluster.instances if config.cluster is not None else {}
    return [i.batches for i in instances.values() if i.batches is not None] or [config.batches.listen]


def api_clusters(config: Config) -> list[Json]:
    if config.batches is None:
        return []
    reach = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}
    hosts = [(reach.get(host, host), port) for host, port in map(split_address, _api_addresses(config))]
    return [upstream(Upstream(BATCH_API_CLUSTER, hosts, API_CONNECT_TIMEOUT_S))]


def runner_routes(config: Config, routes: list[Json]) -> list[Json]:
    """A copy of ``routes`` (the LLM routes), each requiring the runner key where one is set."""
    routes = copy.deepcopy(routes)  # the ingress listener has the same: no object shared (nor YAML anchors)
    key = config.batches.runner_key if config.batches is not None else None
    if key is None:
        return routes
    def required() -> Json:
        return {"name": RUNNER_KEY_HEADER, "string_match": {"exact": key}}

    keyed = [{**route, "match": {**route["match"], "headers": [*route["match"].get("headers", []), required()]},
              **({"request_headers_to_remove": [RUNNER_KEY_HEADER]} if "route" in route else {})}
             for route in routes]
    # Without the key: refused here, before ext_proc could queue it.
    refused = {**direct_reply(Refusal.UNAUTHENTICATED, "The batch runner's key is missing or wrong."),
               "name": "batch_runner_key_missing", "match": {"prefix": "/"}, "typed_per_filter_config": _ext_proc_off()}
    return [*keyed, refused]


def _ext_proc_off() -> Json:
    return {EXT_PROC_FILTER: typed("envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute", disabled=True)}
