"""Live configuration: the config file read again (SIGHUP, ``serve --watch-config``), checked, then applied.

A reload is all or nothing. The file is loaded and validated exactly as at
start-up (adapters/config: every mistake with its line and key path); then the new
config is compared with the one serving (:func:`plan`). A change that only a
restart can make (where the processor listens, TLS, the cluster, the largest
message the transport takes, any setting not listed as live below) rejects
the whole reload with its key path (``listen.grpc: changing it needs a
restart``), and the old config keeps serving. Otherwise it is applied in one
step on the event loop, between two requests (server.py ``apply``), each
model's change made to its one runtime (``runtime.py``):

* tenants, weights, entitlements, caps, the classes' settings, a model's
  limits and gate settings go to the live runtime and its dispatcher in place
  (``ModelRuntime.update``): nothing queued moves, the next charge
  reads the new weight, the next arrival the new cap;
* endpoints, the scrape interval, the engine's dialect: the model's scraper
  restarts on the new list (a member that leaves is forgotten, as when DNS drops it);
* a new model gets its runtime (dispatcher, scraper and the rest), and serves the next request;
* a removed model stops admitting (new requests get today's 404
  ``model_not_found``); what it holds keeps being released to its old
  endpoints for up to ``--drain-seconds``, then is answered 404
  ``model_not_found`` saying it was removed;
* a model whose queue itself must change (its ``policy``, ``endpoint_picking``,
  the health settings its pool is built with, preemption's rate, or the
  classes' names and order for every model) is rebuilt: new requests go to a
  new runtime, the old one drains the same way, its leftovers answered 503
  ``shutting_down`` (a retry lands in the new queue).

In cluster mode (a ``cluster:`` section) only in-place changes apply: every
instance must schedule the same models with the same policies, so adding,
removing or rebuilding a model is refused (restart the instances together).

After each applied reload the generated Envoy config is compared with the
one for the config the process started with (:func:`envoy_document`, as
``extproc envoy-config`` prints it): ``extproc_envoy_config_stale`` and the
log line tell the operator when Envoy must be rolled (a new model needs its
route and cluster there before Envoy can send it anything).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import msgspec

from extproc.adapters.config import Config, ConfigError, ModelConfig, parse_config_text
from extproc.adapters.envoy import bootstrap
from extproc.adapters.telemetry import Telemetry
from extproc.core.values.outcomes import Refusal, Refused

log = logging.getLogger(__name__)

# The Config fields a reload applies; any other that changes needs a restart (listen, cluster, and
# whatever is added later until it is made live here).
LIVE_FIELDS = frozenset({"identity", "band_names", "models", "envoy", "bands", "tenants", "default_tenant", "shards",
                         "endpoint_picker"})
# Inside a live section, what the running transport was built with.
RESTART_KEYS = frozenset({"endpoint_picker.max_body_bytes"})
# A model's settings its queue or pool is built with: changed, the model gets a new dispatcher.
REBUILD_KEYS = ("policy", "endpoint_picking", "advanced.stale_after_s", "advanced.fallback_max_in_flight",
                "max_preemptions_per_s")
# What the model's scraper reads: changed, it restarts on the same dispatcher.
SCRAPE_KEYS = ("endpoints", "advanced.scrape_interval_s", "dns_refresh_s", "engine", "advanced.stale_after_s")
# How often --watch-config reads the file.
WATCH_INTERVAL_S = 1.0
RELOAD_OUTCOMES = ("applied", "rejected")


@dataclass(frozen=True)
class Plan:
    """What a reload does to each model (by name), found by :func:`plan`."""

    added: tuple[ModelConfig, ...] = ()
    removed: tuple[str, ...] = ()
    # A new dispatcher; the old one drains.
    rebuilt: tuple[ModelConfig, ...] = ()
    # The same dispatcher, new settings (every kept model: cheap, and tenants or classes may have changed).
    kept: tuple[ModelConfig, ...] = ()
    # Kept models whose scraper restarts.
    rescraped: frozenset[str] = frozenset()
    # Each changed model and its changed keys, and the tenants added, changed, removed: for the log line.
    changed: tuple[tuple[str, tuple[str, ...]], ...] = ()
    tenants: tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]] = ((), (), ())

    def summary(self) -> str:
        """One line of what changed, for the operator."""
        parts = [f"{what} {', '.join(names)}" for what, names in (
            ("models added", [m.name for m in self.added]), ("models removed", list(self.removed)),
            ("models rebuilt (old queue drains)", [m.name for m in self.rebuilt]),
            ("models changed", [f"{n} ({', '.join(keys)})" for n, keys in self.changed]),
            ("tenants added", list(self.tenants[0])), ("tenants changed", list(self.tenants[1])),
            ("tenants removed", list(self.tenants[2])),
        ) if names]
        return "; ".join(parts) or "nothing the processor reads changed"


def _paths(key: str, old: Any, new: Any) -> Iterator[str]:
    """The key paths where ``old`` and ``new`` differ, down through sections (msgspec structs)."""
    if old == new:
        return
    if isinstance(old, msgspec.Struct) and type(old) is type(new):
        for name in old.__struct_fields__:
            yield from _paths(f"{key}.{name}", getattr(old, name), getattr(new, name))
        return
    yield key


def _restart_problems(old: Config, new: Config) -> Iterator[str]:
    for f in dataclasses.fields(Config):
        for path in _paths(f.name, getattr(old, f.name), getattr(new, f.name)):
            if f.name not in LIVE_FIELDS or path in RESTART_KEYS:
                yield f"{path}: changing it needs a restart (the running config is kept)"


def _model_changes(old: ModelConfig, new: ModelConfig) -> tuple[str, ...]:
    """The model's changed keys, down through its sections (``advanced.stale_after_s``, ``cost.input_weight``)."""
    return tuple(path for name in old.__struct_fields__ for path in _paths(name, getattr(old, name), getattr(new, name)))


def _tenant_changes(old: Config, new: Config) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    added = tuple(sorted(set(new.tenants) - set(old.tenants)))
    removed = tuple(sorted(set(old.tenants) - set(new.tenants)))
    changed = tuple(sorted(n for n in set(old.tenants) & set(new.tenants) if old.tenants[n] != new.tenants[n]))
    if old.default_tenant != new.default_tenant:
        changed = ("default", *changed)
    return added, changed, removed


def plan(old: Config, new: Config) -> Plan:
    """What applying ``new`` over ``old`` does; raises ConfigError (each line a key path) if it needs a restart."""
    problems = list(_restart_problems(old, new))
    before = {m.name: m for m in old.models}
    after = {m.name: m for m in new.models}
    classes_changed = old.band_names != new.band_names
    added = tuple(m for name, m in after.items() if name not in before)
    removed = tuple(name for name in before if name not in after)
    rebuilt, kept, changed = [], [], []
    rescraped = set()
    for name, model in after.items():
        if name not in before:
            continue
        keys = _model_changes(before[name], model)
        if keys:
            changed.append((name, keys))
        if classes_changed or any(k in REBUILD_KEYS for k in keys):
            rebuilt.append(model)
            continue
        kept.append(model)
        if any(k in SCRAPE_KEYS for k in keys):
            rescraped.add(name)
    if old.cluster is not None and (added or removed or rebuilt):
        what = [*(f"adds {m.name!r}" for m in added), *(f"removes {n!r}" for n in removed),
                *(f"rebuilds {m.name!r}" for m in rebuilt)]
        problems.append(f"models: the reload {', '.join(what)}; in cluster mode every instance must schedule the same "
                        "models and classes, so restart the instances together (the running config is kept)")
    if problems:
        raise ConfigError(*problems)
    return Plan(added, removed, tuple(rebuilt), tuple(kept), frozenset(rescraped), tuple(changed),
                _tenant_changes(old, new))


def removed_model(name: str) -> Callable[[], Refused]:
    """The answer of a request still queued for a removed model once its drain is over (404, as an unknown model)."""
    return lambda: Refused(Refusal.MODEL_NOT_FOUND, f"the model {name!r} was removed from the configuration while "
                           "this request was queued")


def rebuilt_model(name: str) -> Callable[[], Refused]:
    """The answer of a request still queued in a rebuilt model's old queue once its drain is over (503: retry)."""
    return lambda: Refused(Refusal.SHUTTING_DOWN, f"the queue of model {name!r} was rebuilt by a configuration "
                           "reload while this request waited; retry shortly")


def envoy_document(config: Config) -> Any:
    """What ``extproc envoy-config`` prints for ``config`` (its bootstrap), or the error it prints instead."""
    try:
        return bootstrap(config)
    except ConfigError as exc:
        return exc.errors


@dataclass(frozen=True)
class ConfigSource:
    """Where ``serve`` read its config, and how it resolved it for this instance (``--shard``, ``--instance``)."""

    path: Path
    shard: str | None = None
    instance: str | None = None

    def read(self) -> bytes:
        try:
            return self.path.read_bytes()
        except OSError as exc:
            raise ConfigError(f"{self.path}: cannot read: {exc.strerror}") from exc

    def load(self, text: bytes) -> tuple[Config, Config]:
        """(this instance's config, the whole file's), from the file's ``text``; ConfigError as at start-up."""
        whole = parse_config_text(self.path, text.decode("utf-8", "replace"))
        return whole.for_shard(self.shard).for_instance(self.instance), whole


def digest(text: bytes) -> str:
    """The config's hash as the info metric carries it."""
    return hashlib.sha256(text).hexdigest()[:12]


class Target(Protocol):
    """What a reload applies to (server.py's ProcessorServer)."""

    config: Config

    def apply(self, config: Config, plan: Plan) -> None: ...

    def accepts_reload(self) -> str | None:
        """Why a reload cannot be applied now (draining), or None."""


class Reloader:
    """Reloads ``source`` into ``target`` on request: checked, applied or rejected, logged and counted."""

    def __init__(self, source: ConfigSource, text: bytes, target: Target, telemetry: Telemetry) -> None:
        """``text``: the file's content the process started with (``target.config`` was loaded from it)."""
        self._source = source
        self._target = target
        self._telemetry = telemetry
        # The file's content last read (the watch reloads only when it changes) and the one serving.
        self._read = self._serving = digest(text)
        _, whole = source.load(text)
        # Envoy runs what envoy-config printed for the file the process started with (as far as it can know).
        self._started_envoy = envoy_document(whole)
        for outcome in RELOAD_OUTCOMES:
            telemetry.config_reloads.labels(outcome=outcome)  # at 0 from the start
        telemetry.config_info.labels(sha256=self._serving).set(1)
        telemetry.config_applied.set(time.time())
        telemetry.envoy_config_stale.set(0)

    def reload(self, why: str, text: bytes | None = None) -> bool:
        """Read, check and apply the file; False (the old config kept, the reason logged) when it is rejected.

        ``text``: the file's content when the caller has just read it (the watch), so it is not read twice.
        """
        started = time.perf_counter()
        try:
            text = self._source.read() if text is None else text
            self._read = digest(text)
            config, whole = self._source.load(text)
            refusal = self._target.accepts_reload()
            if refusal is not None:
                raise ConfigError(refusal)
            steps = plan(self._target.config, config)
            self._target.apply(config, steps)
        except ConfigError as exc:
            self._telemetry.config_reloads.labels(outcome="rejected").inc()
            log.error("config reload (%s) rejected, the running config is kept: %s", why, "; ".join(exc.errors))
            return False
        took_ms = (time.perf_counter() - started) * 1000
        telemetry = self._telemetry
        telemetry.config_reloads.labels(outcome="applied").inc()
        telemetry.config_info.remove(self._serving)
        self._serving = self._read
        telemetry.config_info.labels(sha256=self._serving).set(1)
        telemetry.config_applied.set(time.time())
        stale = envoy_document(whole) != self._started_envoy
        telemetry.envoy_config_stale.set(1 if stale else 0)
        log.info("config reload (%s) applied in %.1f ms (sha256 %s): %s", why, took_ms, self._serving, steps.summary())
        if stale:
            log.warning("config reload: `extproc envoy-config` now prints another Envoy config than the one for the "
                        "config this process started with; roll Envoy to it (extproc_envoy_config_stale 1)")
        return True

    async def watch(self, interval_s: float = WATCH_INTERVAL_S) -> None:
        """Reload whenever the file's content changes (its hash: a touch alone does nothing), until cancelled."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                text = self._source.read()
            except ConfigError:
                continue  # mid-replace, or gone for a moment: the next look decides
            if digest(text) != self._read:
                self.reload("file changed", text)
