"""What a reload plans and how it is told (adapters/reload.py): restart keys refused by path, models sorted, metrics.

The plan is pure (two configs in, a plan or the key paths that need a
restart out); the Reloader reads the real file, so a bad one is refused
with the same line and key path ``extproc check-config`` prints.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from extproc.adapters.config import Config, ConfigError, parse_config
from extproc.adapters.reload import ConfigSource, Plan, Reloader, plan, removed_model
from extproc.adapters.runtime import retire
from extproc.adapters.telemetry import ModelTelemetry, Telemetry, TenantLabels
from extproc.core.values.outcomes import Refusal, Refused
from extproc.core.values.report import RequestEvent, Step
from tests.helpers.reload_core import dispatcher
from tests.stackutil import metric
from tests.waitutil import eventually

pytestmark = pytest.mark.unit


def doc(**top: Any) -> dict[str, Any]:
    models = top.pop("models", [{"name": "m1", "endpoints": ["http://127.0.0.1:8001"]}])
    return {"models": models, "tenants": {"alice": {"weight": 1}}, **top}


def model(name: str, **settings: Any) -> dict[str, Any]:
    return {"name": name, "endpoints": ["http://127.0.0.1:8001"], **settings}


def planned(old: dict[str, Any], new: dict[str, Any]) -> Plan:
    return plan(parse_config(old), parse_config(new))


def refused(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    with pytest.raises(ConfigError) as err:
        planned(old, new)
    return list(err.value.errors)


def test_tenants_weights_and_limits_apply_in_place() -> None:
    steps = planned(doc(), doc(tenants={"alice": {"weight": 4}, "bob": {"weight": 2}},
                               models=[model("m1", target_waiting=5, max_queued=50, gate="waiting_target")]))
    assert [m.name for m in steps.kept] == ["m1"] and not (steps.added or steps.removed or steps.rebuilt)
    assert steps.tenants == (("bob",), ("alice",), ())
    assert steps.changed == (("m1", ("target_waiting", "gate", "max_queued")),)
    assert not steps.rescraped
    assert "tenants added bob" in steps.summary() and "m1 (target_waiting, gate, max_queued)" in steps.summary()


def test_models_added_removed_rebuilt_and_rescraped() -> None:
    old = doc(models=[model("m1"), model("m2"), model("m3")])
    new = doc(models=[model("m1", endpoints=["http://127.0.0.1:8002"]), model("m3", policy="vtc"), model("m4")])
    steps = planned(old, new)
    assert [m.name for m in steps.added] == ["m4"]
    assert steps.removed == ("m2",)
    assert [m.name for m in steps.rebuilt] == ["m3"]
    assert [m.name for m in steps.kept] == ["m1"] and steps.rescraped == {"m1"}


def test_a_models_advanced_settings_rebuild_or_rescrape_it_as_they_did_at_the_top() -> None:
    steps = planned(doc(), doc(models=[model("m1", advanced={"stale_after_s": 2.0})]))
    assert [m.name for m in steps.rebuilt] == ["m1"] and steps.changed == (("m1", ("advanced.stale_after_s",)),)
    steps = planned(doc(), doc(models=[model("m1", advanced={"scrape_interval_s": 0.5})]))
    assert [m.name for m in steps.kept] == ["m1"] and steps.rescraped == {"m1"}


def test_changed_classes_rebuild_every_model() -> None:
    steps = planned(doc(), doc(priorities=["interactive", "batch"]))
    assert [m.name for m in steps.rebuilt] == ["m1"] and not steps.kept


def test_changed_class_settings_apply_in_place() -> None:
    steps = planned(doc(), doc(bands={"batch": {"max_queued": 10}}))
    assert [m.name for m in steps.kept] == ["m1"] and not steps.rebuilt


@pytest.mark.parametrize(("change", "path"), [
    ({"listen": {"grpc": "127.0.0.1:1234"}}, "listen.grpc"),
    ({"listen": {"metrics": "127.0.0.1:1234"}}, "listen.metrics"),
    ({"endpoint_picker": {"max_body_bytes": 1024}}, "endpoint_picker.max_body_bytes"),
    ({"cluster": {"redis_url": "redis://127.0.0.1:6379"}}, "cluster"),
])
def test_what_needs_a_restart_is_refused_with_its_key_path(change: dict[str, Any], path: str) -> None:
    errors = refused(doc(), doc(**change))
    assert errors == [f"{path}: changing it needs a restart (the running config is kept)"]


def test_every_restart_key_is_named_at_once() -> None:
    errors = refused(doc(), doc(listen={"grpc": "127.0.0.1:1234", "metrics": "127.0.0.1:1235"}))
    assert [e.split(":")[0] for e in errors] == ["listen.grpc", "listen.metrics"]


def test_in_cluster_mode_models_can_only_change_in_place() -> None:
    cluster = {"redis_url": "redis://127.0.0.1:6379"}
    old = doc(cluster=cluster)
    assert planned(old, doc(cluster=cluster, tenants={"alice": {"weight": 3}})).kept
    errors = refused(old, doc(cluster=cluster, models=[model("m1"), model("m2")]))
    assert len(errors) == 1 and errors[0].startswith("models: the reload adds 'm2'; in cluster mode")


class Target:
    """What the Reloader drives: a config, applied or not."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.applied: list[Plan] = []
        self.draining = False

    def apply(self, config: Config, steps: Plan) -> None:
        self.config = config
        self.applied.append(steps)

    def accepts_reload(self) -> str | None:
        return "draining" if self.draining else None


def write(path: Path, document: dict[str, Any]) -> None:
    path.write_text(yaml.safe_dump(document))


def samples(telemetry: Telemetry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in telemetry.registry.collect() for s in family.samples}


@dataclass(frozen=True)
class CountedSource(ConfigSource):
    """A source that counts its reads: a test waits for the watch to have looked, not for time to pass."""

    reads: list[None] = field(default_factory=list)

    def read(self) -> bytes:
        self.reads.append(None)
        return super().read()

    async def looked(self, times: int) -> None:
        """Until the file has been read ``times`` more times (the watch's looks)."""
        start = len(self.reads)
        await eventually(lambda: len(self.reads) >= start + times, what=f"{times} looks at {self.path}")


def reloading(tmp_path: Path, telemetry: Telemetry) -> tuple[Path, Target, Reloader]:
    """A config file (``doc()``), the Target loaded from it and the Reloader that reloads it into the Target."""
    path, target, reloader, _ = counted_reloading(tmp_path, telemetry)
    return path, target, reloader


def counted_reloading(tmp_path: Path, telemetry: Telemetry) -> tuple[Path, Target, Reloader, CountedSource]:
    """:func:`reloading`, and its source, which counts the reads."""
    path = tmp_path / "config.yaml"
    write(path, doc())
    source = CountedSource(path)
    text = path.read_bytes()
    target = Target(source.load(text)[0])
    return path, target, Reloader(source, text, target, telemetry), source


def test_a_bad_file_keeps_the_old_config_and_says_where(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    telemetry = Telemetry()
    path, target, reloader = reloading(tmp_path, telemetry)
    started = target.config
    write(path, doc(models=[model("m1", target_waiting="three")]))
    with caplog.at_level(logging.ERROR, "extproc.adapters.reload"):
        assert not reloader.reload("SIGHUP")
    assert target.config is started and not target.applied
    assert "models[0].target_waiting: must be an integer >= 1" in caplog.text
    assert f"{path}:" in caplog.text  # with the file and line, as check-config prints
    seen = samples(telemetry)
    assert metric(seen, "extproc_config_reloads_total", outcome="rejected") == 1
    assert metric(seen, "extproc_config_reloads_total", outcome="applied") == 0


def test_an_applied_reload_is_counted_hashed_and_tells_whether_envoy_must_change(tmp_path: Path) -> None:
    telemetry = Telemetry()
    path, target, reloader = reloading(tmp_path, telemetry)
    first = {labels for (name, labels), _ in samples(telemetry).items() if name == "extproc_config_info"}
    write(path, doc(tenants={"alice": {"weight": 5}}))  # the processor's business only
    assert reloader.reload("SIGHUP")
    seen = samples(telemetry)
    assert metric(seen, "extproc_config_reloads_total", outcome="applied") == 1
    assert metric(seen, "extproc_envoy_config_stale") == 0
    infos = {labels for (name, labels), _ in seen.items() if name == "extproc_config_info"}
    assert len(infos) == 1 and infos != first
    write(path, doc(models=[model("m1"), model("m2", endpoints=["http://127.0.0.1:8002"])]))  # a route, a cluster
    assert reloader.reload("SIGHUP")
    assert metric(samples(telemetry), "extproc_envoy_config_stale") == 1
    assert target.config.model("m2") is not None and len(target.applied) == 2


def test_no_reload_while_draining(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    _, target, reloader = reloading(tmp_path, Telemetry())
    target.draining = True
    with caplog.at_level(logging.ERROR, "extproc.adapters.reload"):
        assert not reloader.reload("SIGHUP")
    assert "draining" in caplog.text


def test_relabelled_queue_depths_follow_what_is_queued() -> None:
    telemetry = Telemetry()
    report = ModelTelemetry(telemetry, "m1", ("standard",), TenantLabels({"alice"}))
    for tenant in ("alice", "carol", "carol"):
        report(RequestEvent(Step.QUEUED, "standard", tenant))

    def depth(tenant: str) -> float:
        return metric(samples(telemetry), "extproc_queue_depth", tenant=tenant)

    assert (depth("alice"), depth("carol"), depth("other")) == (1, 0, 2)
    report.relabel(TenantLabels({"carol"}), {("standard", "alice"): 1, ("standard", "carol"): 2})
    assert (depth("alice"), depth("carol"), depth("other")) == (0, 2, 1)
    report(RequestEvent(Step.RELEASED, "standard", "carol", 0.1))
    report(RequestEvent(Step.RELEASED, "standard", "alice", 0.1))
    assert (depth("alice"), depth("carol"), depth("other")) == (0, 1, 0)


async def test_the_watch_reloads_when_the_content_changes_not_when_the_file_is_touched(tmp_path: Path) -> None:
    telemetry = Telemetry()
    path, target, reloader, source = counted_reloading(tmp_path, telemetry)

    def rejected() -> float:
        return metric(samples(telemetry), "extproc_config_reloads_total", outcome="rejected")

    watch = asyncio.create_task(reloader.watch(interval_s=0.01))
    try:
        path.write_bytes(path.read_bytes())  # rewritten, same content
        await source.looked(3)
        assert not target.applied
        write(path, doc(tenants={"alice": {"weight": 2}}))
        await eventually(lambda: len(target.applied) == 1, what="the changed file applied")
        write(path, doc(models=[model("m1", target_waiting=0)]))  # bad: rejected once, not again and again
        await eventually(lambda: rejected() == 1, what="the bad file rejected")
        await source.looked(3)
    finally:
        watch.cancel()
    assert len(target.applied) == 1
    assert rejected() == 1


async def test_a_retired_dispatcher_drains_answers_the_rest_and_forgets_its_endpoints() -> None:
    d = dispatcher("round_robin", {}, 1)
    running, waiting = d.submit("alice", 1), d.submit("bob", 1)
    async def scraping() -> None:
        await asyncio.Event().wait()

    scraper = asyncio.create_task(scraping())
    retiring = asyncio.create_task(retire(d, scraper, 0.05, removed_model("m"), gone=True))
    with pytest.raises(Refused) as refused:
        await waiting.future  # not released within the drain: answered
    assert refused.value.refusal is Refusal.MODEL_NOT_FOUND and "'m' was removed" in refused.value.message
    await eventually(scraper.cancelled, 1.0, "the scraper stopped")
    assert not retiring.done()  # the one in flight still runs
    d.end(running)
    await asyncio.wait_for(retiring, 1)
    assert d.endpoints == ()
