"""The routes: per path prefix, the picked endpoint, one route per model, the unanswered, then a catch-all.

A released request carries the model header only the processor sets (a
client-sent one is removed first, filters.py); one route per model matches
it exactly and balances over the model's cluster. With endpoint picking, the
processor's destination header sends it to the ORIGINAL_DST cluster instead.
A request with neither was not answered by the processor: with
``processor_failure: closed`` it is refused ``processor_unavailable``; with
``open`` one route per model on the body's model (json_to_metadata's
metadata) sends it on unscheduled. With shards, the route matched on the
body's model (when ext_proc reads the route, before the processor set the
model header) names the instance that schedules it (``ExtProcPerRoute``).

Every route retries what never reached the engine (a refused or reset
connection: safe for a POST), with backoff, on another endpoint where there
is one, and copies the processor's queue-wait header onto the response.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from extproc.adapters.config import Config
from extproc.adapters.envoy.base import Json, duration, header_values, idle_timeout_s, typed
from extproc.adapters.envoy.clusters import PICKED_CLUSTER, cluster_names, picks_endpoints, shard_cluster_name
from extproc.adapters.envoy.filters import ECHOED_HEADERS, EXT_PROC_FILTER
from extproc.adapters.envoy.local_replies import direct_reply
from extproc.adapters.protocol.contract import DESTINATION_HEADER, METADATA_NAMESPACE, MODEL_HEADER
from extproc.adapters.protocol.dialects import DIALECTS
from extproc.core.values.outcomes import Refusal

# Retries of a request the engine never started: it could not be reached, or it
# refused the request as full (its own queue cap). Envoy's back-off is jittered:
# each wait is random up to base x 2^attempt, capped at the maximum, so five
# retries wait 0 to 3.75 s in all, 1.9 s on average. That outlasts a full
# engine's wait for its next finished request (a slot taken by a client that
# bypasses the gateway; with three retries, 0.9 s on average, a real vLLM on
# 2 cores still passed its "busy" 503 to a gateway client) and an engine that
# restarts within a second or two. A dead engine fails only what was in flight
# to it, after those seconds: its refused scrape or the router's 503 marks it
# down at once, and the processor holds the rest.
ENGINE_RETRIES = 5
ENGINE_RETRY_BASE_S = 0.25
ENGINE_RETRY_MAX_S = 1.0


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
    per_filter: Mapping[str, Json] = field(default_factory=dict)
    clusters: Mapping[str, str] = field(default_factory=dict)


def routes(config: Config, *, ext_proc: bool = True, scope: RouteScope = RouteScope()) -> list[Json]:
    """Per path prefix, in the order Envoy tries them (``ext_proc=False``: routes on the body's model only)."""
    table = _RouteTable(config, ext_proc, scope)
    return [route for index, prefix in enumerate(scope.prefixes) for route in table.for_prefix(index, prefix)]


class _RouteTable:
    """The routes of one document; each method is one kind of route."""

    def __init__(self, config: Config, ext_proc: bool, scope: RouteScope) -> None:
        self.config, self.ext_proc, self.scope = config, ext_proc, scope
        self.idle = duration(idle_timeout_s(config))
        self.clusters = {**cluster_names(config), **scope.clusters}
        self.closed = ext_proc and config.envoy.processor_failure == "closed"
        # Retried on every route: the picked-endpoint route is shared by the models of all engines.
        self.full_statuses = frozenset().union(*(DIALECTS[m.engine].full_statuses for m in config.models))

    def for_prefix(self, index: int, prefix: str) -> list[Json]:
        reply = self.reply()
        found = self.picked(index, prefix) + self.scheduled(index, prefix) + self.unscheduled(index, prefix)
        return found + self.unanswered(index, prefix, reply) + [self.catch_all(index, prefix, reply)]

    def picked(self, index: int, prefix: str) -> list[Json]:
        """To the endpoint the processor picked (only the processor sets the header; Envoy strips a client's)."""
        if not (self.ext_proc and picks_endpoints(self.config)):
            return []
        match = {"prefix": prefix, "headers": [{"name": DESTINATION_HEADER, "present_match": True}]}
        return [self.route(self.named(PICKED_CLUSTER, index), match, PICKED_CLUSTER)]

    def scheduled(self, index: int, prefix: str) -> list[Json]:
        """One route per model: on the model header (or, without a processor, the body's model)."""
        return [self.to_model(model.name, self.clusters[model.name], index, prefix, by_body=not self.ext_proc)
                for model in self.config.models]

    def unscheduled(self, index: int, prefix: str) -> list[Json]:
        """``processor_failure: open``: a request the processor never answered goes on, by the body's model.

        With shards these are also the routes a request first lands on: they pick its processor.
        """
        if not (self.ext_proc and self.config.envoy.processor_failure == "open"):
            return []
        return [self.to_model(model.name, f"{self.clusters[model.name]}_unscheduled", index, prefix, by_body=True)
                for model in self.config.models]

    def unanswered(self, index: int, prefix: str, reply: Json) -> list[Json]:
        """``closed`` with shards: per body model, the route that names its shard, then refuses it unanswered."""
        if not (self.closed and self.config.shards):
            return []
        return [
            _sharded(self.config, model.name, self.with_filters({
                **reply, "name": self.named(f"{self.clusters[model.name]}_{reply['name']}", index),
                "match": self.model_match(model.name, prefix, by_body=True),
            }))
            for model in self.config.models
        ]

    def catch_all(self, index: int, prefix: str, reply: Json) -> Json:
        """Where an LLM request first lands (no model header yet): it turns the filters on, then answers itself."""
        return self.with_filters({**reply, "name": self.named(reply["name"], index), "match": {"prefix": prefix}})

    def reply(self) -> Json:
        """The catch-all's answer (one per prefix: the routes that refuse share its parts)."""
        if self.closed:
            # Only the processor sets the model header, so a request without one was never
            # answered by it (crashed, restarting, silent past message_timeout): refuse it.
            return direct_reply(Refusal.PROCESSOR_UNAVAILABLE, "The scheduler is unavailable; retry shortly.")
        # Defence in depth: the processor normally rejects unknown models itself.
        return direct_reply(Refusal.MODEL_NOT_FOUND, "The requested model does not exist on this server.")

    def to_model(self, model: str, name: str, index: int, prefix: str, *, by_body: bool) -> Json:
        route = self.route(self.named(name, index), self.model_match(model, prefix, by_body=by_body), self.clusters[model])
        return _sharded(self.config, model, route)

    def named(self, name: str, index: int) -> str:
        return f"{self.scope.name_prefix}{name}" + (f"_{index}" if len(self.scope.prefixes) > 1 else "")

    def route(self, name: str, match: Json, cluster: str) -> Json:
        return self.with_filters({
            "name": name,
            "match": match,
            # No overall limit: a long generation is fine while bytes flow.
            "route": {"cluster": cluster, "timeout": "0s", "idle_timeout": self.idle,
                      "retry_policy": _retry_policy(self.full_statuses)},
            # Omitted when the processor did not set it (empty value).
            "response_headers_to_add": header_values([(header, f"%REQ({header})%") for header in self.echoed]),
        })

    @property
    def echoed(self) -> tuple[str, ...]:
        """The request headers the processor sets that the response carries: the queue wait, a budget's rate headers."""
        budgets = self.config.budgets
        if budgets is None or not budgets.rate_headers:
            return ECHOED_HEADERS
        from extproc.adapters.budgets.headers import RATE_HEADERS  # budgets are optional: imported where configured

        return ECHOED_HEADERS + RATE_HEADERS

    def with_filters(self, route: Json) -> Json:
        if self.scope.per_filter:
            route["typed_per_filter_config"] = copy.deepcopy(dict(self.scope.per_filter))
        return route

    def model_match(self, model: str, prefix: str, *, by_body: bool) -> Json:
        """The model header the processor sets or the body's model.

        The metadata match works because json_to_metadata runs before anything
        picks the route (checked with Envoy 1.40).
        """
        if not by_body:
            return {"prefix": prefix,
                    "headers": [{"name": MODEL_HEADER, "string_match": {"exact": model}}]}
        served = self.config.model(model)
        names = (model, *served.served_names) if served is not None else (model,)
        value = {"string_match": {"exact": model} if len(names) == 1 else {"safe_regex": {"regex": names_regex(names)}}}
        return {"prefix": prefix, "dynamic_metadata": [{"filter": METADATA_NAMESPACE, "path": [{"key": "model"}],
                                                        "value": value}]}


def names_regex(names: tuple[str, ...]) -> str:
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


def _retry_policy(full_statuses: frozenset[int]) -> Json:
    """Retry only what the engine never started; another endpoint first, where the cluster has one.

    That is a request that never reached it, or one it refused as full: the
    gateway's clients do not pay for the engine's own valve. The processor
    meanwhile reads the refusal (the engine's rejection counter) and releases
    less. ``previous_hosts`` skips endpoints already tried (the picked cluster
    has one host: after the attempts it goes there anyway). The body is
    buffered for the retry up to the listener's buffer limit.
    """
    full = {"retriable_status_codes": sorted(full_statuses)} if full_statuses else {}
    return {
        "retry_on": "connect-failure,refused-stream,reset-before-request" + (",retriable-status-codes" if full else ""),
        **full,
        "num_retries": ENGINE_RETRIES,
        "retry_back_off": {"base_interval": duration(ENGINE_RETRY_BASE_S), "max_interval": duration(ENGINE_RETRY_MAX_S)},
        "retry_host_predicate": [{
            "name": "envoy.retry_host_predicates.previous_hosts",
            "typed_config": typed("envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"),
        }],
        "host_selection_retry_max_attempts": 3,
    }


def _sharded(config: Config, model: str, route: Json) -> Json:
    """With shards, ``route`` sends ext_proc to the instance that owns ``model`` (ExtProcPerRoute).

    ext_proc reads the route when the request headers arrive, after
    json_to_metadata has read the body's model, so the route matched on that
    model decides which instance schedules the request.
    """
    shard = config.shard_of(model)
    if shard is None:
        return route
    route.setdefault("typed_per_filter_config", {})[EXT_PROC_FILTER] = typed(
        "envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute",
        overrides={"grpc_service": {"envoy_grpc": {"cluster_name": shard_cluster_name(shard)}}},
    )
    return route
