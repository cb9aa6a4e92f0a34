"""The effective configuration, one line per key with where its value came from (``check-config --explain``).

An operator writes a dozen keys; the rest take a default, follow from other
settings, or are read from the engine once the processor runs. Each leaf of
the file's shape is listed with its value and one of four sources:

* ``set``      written in the file;
* ``default``  the schema's default;
* ``derived``  computed from other settings, the rule named (:data:`DERIVED`);
* ``engine``   unset, so read from the engine at run time (:data:`FROM_ENGINE`);
  its value is null here, as check-config never reaches an engine.

The walk follows the schema (schema.py), the resolved values come from
:class:`~.resolve.Config`, so what is printed is what the program reads.
Secrets are not printed: API keys and a Redis URL's password are redacted.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import msgspec

from extproc.adapters.config.resolve import DEFAULT_TENANT_KEY, Config, default_priority
from extproc.adapters.config.rules import RULES
from extproc.adapters.config.schema import BandSettings, ConfigFile, TenantSettings
from extproc.adapters.config.validate import convert

SOURCES = ("set", "default", "derived", "engine")

# Key paths (a list item as ``[]``, a mapping's entry as ``*``) whose unset value follows from other
# settings: the rule in words (the reference prints it as the default), and the value it gives (from the
# config, the file and the key's own path: a model's key names its model).
Rule = Callable[[Config, Any, str], Any]
DERIVED: dict[str, tuple[str, Rule]] = {
    "default_priority": ("`standard` if it is a class, else the lowest class",
                         lambda config, file, key: default_priority(file)),
    "cluster.heartbeat_s": ("`cluster.lease_s` / 4",
                            lambda config, file, key: config.cluster and config.cluster.heartbeat_interval_s),
    "envoy.admission_per_second": ("2/3 of the processor's intake on `listen.transport` (builtin: 1,500/s, grpcio: 750/s)",
                                   lambda config, file, key: config.envoy.admission(config.listen.transport).per_second),
    "envoy.admission_burst": ("the intake (`admission_per_second` x 3/2) x `message_timeout_ms`",
                              lambda config, file, key: config.envoy.admission(config.listen.transport).tokens),
    "models[].cold_start_wait_s": ("the model's `max_queue_wait_s`",
                                   lambda config, file, key: config.models[_index(key)].cold_start_wait()),
    "models[].reserved_waiting": ("`target_waiting` - 1",
                                  lambda config, file, key: config.models[_index(key)].waiting_kept()),
}
# Per model, a prefix section that `policy: locality` implies; per class, what depends on its place.
SECTIONS_DERIVED = {"models[].prefix": "`policy: locality` (the defaults)"}
BAND_PLACE = "the class's place: the lowest of several"
BAND_DERIVED = {
    "idle_only": f"{BAND_PLACE} is idle-only",
    "preemptible": "the class's place: every class below the first",
    "engine_priority": "the class's index (0, 1, 2, ...)",
    "ttft_objective_s": "the class's place: 5 for the first of several, 60 for the middle ones, none for the lowest",
    "min_share": f"{BAND_PLACE} has 0; else the class's share of recent arrivals at run time (at most 0.5)",
    "max_queue_wait_s": "the model's `max_queue_wait_s`",
}
TENANT_DERIVED = {
    "priorities": "every class",
    "default_priority": "the top-level `default_priority`",
}
# Unset, these are read from the engine at run time (adapters/engines/limits.py, the scraper).
FROM_ENGINE = {
    "models[].max_context_tokens": "its max_model_len (vLLM /v1/models; SGLang context_length, TGI max_total_tokens, "
                                   "llama.cpp n_ctx), 32768 until it says",
    "models[].max_running": "what it says (SGLang, llama.cpp), else learned from its metrics",
}


@dataclass(frozen=True)
class Line:
    """One leaf: its key path, its effective value (JSON), its source and, for derived or engine, from what."""

    key: str
    value: Any
    source: str
    note: str = ""

    def text(self) -> str:
        where = f"{self.source}: {self.note}" if self.note else self.source
        return f"{self.key} = {json.dumps(self.value, sort_keys=True)}  ({where})"


def explain(raw: Any, config: Config) -> list[Line]:
    """Every leaf of the valid document ``raw`` (whose resolved form is ``config``), in the schema's order."""
    file = convert(raw, ConfigFile, RULES)
    return list(_section(file, raw, "", "", config, file))


def _index(path: str) -> int:
    """``models[2].cold_start_wait_s`` -> 2: the list item a key is under."""
    return int(path[path.index("[") + 1:path.index("]")])


def _pattern(path: str) -> str:
    """``models[2].cost.input_weight`` -> ``models[].cost.input_weight`` (the form DERIVED is keyed by)."""
    out, depth = [], 0
    for char in path:
        depth += char == "["
        if not depth:
            out.append(char)
        depth -= char == "]"
        if char == "]":
            out.append("[]")
    return "".join(out)


def _key(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _section(value: msgspec.Struct, raw: Any, path: str, derived: str, config: Config, file: ConfigFile) -> Iterator[Line]:
    """The leaves under a section; ``derived`` is set when the whole section follows from another setting."""
    written = raw if isinstance(raw, dict) else {}
    for name in value.__struct_fields__:
        key = _key(path, name)
        if (path, name) == ("", "bands"):
            yield from _bands(written.get(name) or {}, config)
        elif (path, name) == ("", "tenants"):
            yield from _tenants(written.get(name) or {}, config)
        elif name == "models" and not path:
            for i, model in enumerate(config.models):
                yield from _section(model, (written.get(name) or [])[i], f"models[{i}]", "", config, file)
        else:
            yield from _field(getattr(value, name), written.get(name), name in written, key, derived, config, file)


def _field(value: Any, raw: Any, is_set: bool, key: str, derived: str, config: Config, file: ConfigFile) -> Iterator[Line]:
    if isinstance(value, msgspec.Struct):
        section_rule = "" if is_set else derived or SECTIONS_DERIVED.get(_pattern(key), "")
        yield from _section(value, raw, key, section_rule, config, file)
    elif isinstance(value, dict) and value and all(isinstance(v, msgspec.Struct) for v in value.values()):
        for name, entry in value.items():
            yield from _section(entry, (raw or {}).get(name), _key(key, name), derived, config, file)
    elif is_set:
        yield Line(key, _shown(key, value), "set")
    elif derived:
        yield Line(key, _shown(key, value), "derived", derived)
    elif _pattern(key) in DERIVED:
        note, rule = DERIVED[_pattern(key)]
        yield Line(key, rule(config, file, key), "derived", note)
    elif _pattern(key) in FROM_ENGINE and value is None:
        yield Line(key, None, "engine", FROM_ENGINE[_pattern(key)])
    else:
        yield Line(key, _shown(key, value), "default")


def _bands(written: dict[str, Any], config: Config) -> Iterator[Line]:
    """Every class, written or not, with its resolved settings (resolve.py fills in those that depend on its place)."""
    for band in config.bands:
        entry = written.get(band.name) or {}
        for name in BandSettings.__struct_fields__:
            value, key = getattr(band, name), f"bands.{band.name}.{name}"
            if name in entry:
                yield Line(key, value, "set")
            elif name in BAND_DERIVED:
                yield Line(key, value, "derived", BAND_DERIVED[name])
            else:
                yield Line(key, value, "default")


# A tenant's keys as the file names them -> the core's Tenant attribute.
_TENANT_ATTRS = {"priorities": "bands", "default_priority": "default_band"}


def _tenants(written: dict[str, Any], config: Config) -> Iterator[Line]:
    """The `default` entry, then each named tenant: unset keys inherit from `default`, which derives its own."""
    template = written.get(DEFAULT_TENANT_KEY) or {}
    names = [DEFAULT_TENANT_KEY, *(name for name in written if name != DEFAULT_TENANT_KEY)]
    for tenant in names:
        entry, resolved = written.get(tenant) or {}, config.tenant(tenant)  # `default`: the template itself
        for name in TenantSettings.__struct_fields__:
            value, key = getattr(resolved, _TENANT_ATTRS.get(name, name)), f"tenants.{tenant}.{name}"
            value = list(value) if isinstance(value, tuple) else value
            if name in entry:
                yield Line(key, value, "set")
            elif tenant != DEFAULT_TENANT_KEY and name in template:
                yield Line(key, value, "derived", f"`tenants.{DEFAULT_TENANT_KEY}.{name}`")
            elif name in TENANT_DERIVED:
                yield Line(key, value, "derived", TENANT_DERIVED[name])
            else:
                yield Line(key, value, "default")


def _shown(key: str, value: Any) -> Any:
    """``value`` as JSON, with the secrets redacted: API keys (the tenants shown), a Redis URL's password."""
    if key == "envoy.api_keys":
        return {f"<key {i}>": tenant for i, tenant in enumerate(value.values(), start=1)}
    if key == "cluster.redis_url" and urlsplit(value).password:
        parts = urlsplit(value)
        return parts._replace(netloc=parts.netloc.replace(f":{parts.password}@", ":<redacted>@")).geturl()
    return msgspec.to_builtins(value)
