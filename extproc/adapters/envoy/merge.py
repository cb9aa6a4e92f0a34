"""Merge a drop-in (``extproc envoy-config --drop-in``) into an operator's Envoy bootstrap.

The drop-in is built so that merging it is mechanical, and this module is
that mechanism (``extproc envoy-config --into EXISTING.yaml``):

* ``http_filters`` go before the listener's router, in order. Each carries
  ``disabled: true``: it runs only on routes that turn it on.
* ``routes`` go first in the chosen virtual host. They own only the LLM path
  prefixes and turn the filters on (``typed_per_filter_config``), so every
  other route on the listener runs exactly the filters it ran before.
* ``clusters`` are added, and ``listeners`` (the batch runner's, with ``batches:``).
* ``http_connection_manager``: a timeout is raised to ours only where the
  operator's would cut a held request (unset ``request_timeout`` is no
  limit; unset ``stream_idle_timeout`` is Envoy's 5 minutes); our
  ``local_reply_config`` mappers (scoped to the LLM paths) go before theirs.
* ``listener``: ``per_connection_buffer_limit_bytes`` is raised to ours.

What was merged before (our filters, routes and clusters, known by name) is
replaced, so running the merge again on its own output changes nothing.
Pure dict work: the CLI reads and writes the files.
"""

from __future__ import annotations

import copy
import importlib
import pkgutil
import re
from typing import Any

from google.protobuf.json_format import ParseError

from extproc.adapters.config import ConfigError

HCM_NAME = "envoy.filters.network.http_connection_manager"
ROUTER_TYPE = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
# Envoy's defaults for the HCM timeouts the merge may raise (0: no limit).
HCM_TIMEOUT_DEFAULTS_S = {"request_timeout": 0.0, "stream_idle_timeout": 300.0}
# Envoy's default per-connection buffer (1 MiB).
DEFAULT_BUFFER_LIMIT = 1024 * 1024


def _seconds(value: Any, where: str) -> float:
    """A Duration as YAML has it (``"150s"``, ``"0.5s"``, or the JSON ``{seconds, nanos}`` form)."""
    if isinstance(value, dict):
        return float(value.get("seconds", 0)) + float(value.get("nanos", 0)) / 1e9
    match = re.fullmatch(r"(\d+(?:\.\d+)?)s", str(value).strip())
    if match is None:
        raise ConfigError(f"{where}: {value!r} is not a duration like '300s'")
    return float(match.group(1))


def _one(items: list[dict[str, Any]], name: str | None, what: str, where: str) -> dict[str, Any]:
    """The item called ``name``, or the only one when no name is given."""
    if name is not None:
        found = [item for item in items if item.get("name") == name]
        if not found:
            names = ", ".join(repr(item.get("name")) for item in items) or "none"
            raise ConfigError(f"{where}: no {what} named {name!r} (there are: {names})")
        return found[0]
    if len(items) != 1:
        names = ", ".join(repr(item.get("name")) for item in items) or "none"
        raise ConfigError(f"{where}: {len(items)} {what}s ({names}); name one with --{what.replace(' ', '-')}")
    return items[0]


def _find_hcm(existing: dict[str, Any], listener_name: str | None,
              ours: frozenset[str] = frozenset()) -> tuple[dict[str, Any], dict[str, Any]]:
    """The listener and its HTTP connection manager's typed_config (never one of ``ours``, a previous merge's)."""
    static = existing.get("static_resources") or {}
    listeners = [item for item in static.get("listeners") or [] if isinstance(item, dict) and item.get("name") not in ours]
    listener = _one(listeners, listener_name, "listener", "static_resources.listeners")
    hcms = [
        f["typed_config"]
        for chain in listener.get("filter_chains") or []
        for f in chain.get("filters") or []
        if f.get("name") == HCM_NAME or str(f.get("typed_config", {}).get("@type", "")).endswith("HttpConnectionManager")
    ]
    if len(hcms) != 1:
        raise ConfigError(f"listener {listener.get('name')!r}: {len(hcms)} HTTP connection managers, need exactly one")
    return listener, hcms[0]


def _is_router(item: dict[str, Any]) -> bool:
    return item.get("name") == "envoy.filters.http.router" or item.get("typed_config", {}).get("@type") == ROUTER_TYPE


def _merge_filters(hcm: dict[str, Any], ours: list[dict[str, Any]]) -> None:
    names = {f["name"] for f in ours}
    theirs = [f for f in hcm.get("http_filters") or [] if f.get("name") not in names]
    routers = [i for i, f in enumerate(theirs) if _is_router(f)]
    if not routers:
        raise ConfigError("http_filters: no envoy.filters.http.router to insert the extproc filters before")
    at = routers[0]
    hcm["http_filters"] = theirs[:at] + copy.deepcopy(ours) + theirs[at:]


def _merge_routes(hcm: dict[str, Any], ours: list[dict[str, Any]], virtual_host: str | None) -> None:
    if "route_config" not in hcm:
        raise ConfigError("the HTTP connection manager has no inline route_config (RDS is not merged; add the routes there)")
    hosts = hcm["route_config"].get("virtual_hosts") or []
    host = _one(hosts, virtual_host, "virtual host", "route_config.virtual_hosts")
    names = {r["name"] for r in ours}
    theirs = [r for r in host.get("routes") or [] if r.get("name") not in names]
    host["routes"] = copy.deepcopy(ours) + theirs


def _merge_hcm_settings(hcm: dict[str, Any], ours: dict[str, Any]) -> None:
    for key, default in HCM_TIMEOUT_DEFAULTS_S.items():
        if key not in ours:
            continue
        current = _seconds(hcm[key], key) if key in hcm else default
        if current != 0.0 and current < _seconds(ours[key], key):
            hcm[key] = ours[key]
    mappers = ours["local_reply_config"]["mappers"]
    reply = hcm.setdefault("local_reply_config", {})
    theirs = [m for m in reply.get("mappers") or [] if m not in mappers]
    reply["mappers"] = copy.deepcopy(mappers) + theirs


def _merge_clusters(existing: dict[str, Any], ours: list[dict[str, Any]]) -> None:
    static = existing.setdefault("static_resources", {})
    names = {c["name"] for c in ours}
    theirs = [c for c in static.get("clusters") or [] if c.get("name") not in names]
    static["clusters"] = theirs + copy.deepcopy(ours)


def _merge_listeners(existing: dict[str, Any], ours: list[dict[str, Any]]) -> None:
    """Our own listeners (the batch runner's), added whole; a previous merge's replaced by name."""
    if not ours:
        return
    static = existing.setdefault("static_resources", {})
    names = {listener["name"] for listener in ours}
    theirs = [listener for listener in static.get("listeners") or [] if listener.get("name") not in names]
    static["listeners"] = theirs + copy.deepcopy(ours)


def merge(
    existing: dict[str, Any],
    drop_in: dict[str, Any],
    *,
    listener: str | None = None,
    virtual_host: str | None = None,
) -> dict[str, Any]:
    """``existing`` with ``drop_in`` merged in (a new dict; neither argument changes)."""
    merged = copy.deepcopy(existing)
    found, hcm = _find_hcm(merged, listener, frozenset(item["name"] for item in drop_in.get("listeners", [])))
    limit = drop_in["listener"]["per_connection_buffer_limit_bytes"]
    found["per_connection_buffer_limit_bytes"] = max(found.get("per_connection_buffer_limit_bytes", DEFAULT_BUFFER_LIMIT), limit)
    _merge_filters(hcm, drop_in["http_filters"])
    _merge_routes(hcm, drop_in["routes"], virtual_host)
    _merge_hcm_settings(hcm, drop_in["http_connection_manager"])
    _merge_clusters(merged, drop_in["clusters"])
    _merge_listeners(merged, drop_in.get("listeners", []))
    return merged


def _typed_configs(node: Any) -> set[str]:
    """The ``@type`` names of every typed extension in a document."""
    if isinstance(node, dict):
        found = {str(node["@type"]).rpartition("/")[2]} if "@type" in node else set()
        return found.union(*(_typed_configs(value) for value in node.values()))
    if isinstance(node, list):
        return set().union(*(_typed_configs(value) for value in node))
    return set()


def bootstrap_message(doc: dict[str, Any]) -> Any:
    """``doc`` parsed into Envoy's Bootstrap message (xds-protos); raises ``ParseError`` on anything Envoy's API lacks.

    Every field name, enum value and typed extension must exist in Envoy's
    API (about 2 ms). What only Envoy knows (cluster references, its own
    constraints) needs ``envoy --mode validate``.
    """
    from envoy.config.bootstrap.v3.bootstrap_pb2 import Bootstrap
    from google.protobuf.json_format import ParseDict

    for name in _typed_configs(doc):
        # An extension's messages register when its package's modules are imported.
        try:
            package = importlib.import_module(name.rpartition(".")[0])
        except ImportError:
            continue  # ParseDict names the unknown type
        for module in pkgutil.iter_modules(package.__path__):
            if module.name.endswith("_pb2"):
                importlib.import_module(f"{package.__name__}.{module.name}")
    return ParseDict(doc, Bootstrap())


def merge_checked(
    existing: dict[str, Any], drop_in: dict[str, Any], *, listener: str | None = None, virtual_host: str | None = None
) -> dict[str, Any]:
    """:func:`merge`, then the result parsed as a Bootstrap: a ConfigError for either's mistakes."""
    merged = merge(existing, drop_in, listener=listener, virtual_host=virtual_host)
    try:
        bootstrap_message(merged)
    except ParseError as exc:
        raise ConfigError(f"the merged bootstrap is not valid Envoy config: {exc}") from exc
    return merged
