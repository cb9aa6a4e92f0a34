"""The Grafana dashboard and the Prometheus alert rules in monitoring/, checked by a real Prometheus.

Grafana itself cannot run here, so the dashboard is checked where it can go
wrong: every panel's query, sent to a real Prometheus (Debian's
``prometheus``) that scrapes a live processor under load through real Envoy,
must return data; the TTFT objective and preemption panels must show events (a positive number), which a
second metrics port has, its processor's telemetry fed what the core reports (releases on time and late,
preemptions). Every alert's signal (its expression without the final
threshold: a quiet stack fires nothing) must too, the rules must load and
evaluate without error, ``promtool check rules`` must pass, and
``promtool test rules`` shows each alert firing on the series meant to fire it.

Without Prometheus installed these skip, saying so, unless
EXTPROC_PROMETHEUS=require (CI, which installs it), where that is a failure.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from prometheus_client import generate_latest

from extproc.adapters.config import load_config
from extproc.core.values.report import RequestEvent, Step
from extproc.tools.power_user import chat
from extproc.tools.procs import ManagedProcess, free_port
from extproc.tools.stack import start_stack
from tests.helpers.monitoring import query, tool
from tests.helpers.status_page import OBJECTIVE_EVENTS, Port
from tests.paths import ROOT
from tests.redisutil import RedisServer
from tests.stackutil import TENANT_KEYS, write_stack_config

MONITORING = ROOT / "monitoring"
RULES = MONITORING / "prometheus" / "alerts.yml"
DASHBOARD = json.loads((MONITORING / "grafana" / "dashboards" / "extproc.json").read_text())
# What Grafana puts in place of the dashboard's variables: every model, and a rate window that
# holds several of the test's 1 s scrapes.
VARIABLES = {"$model": ".+", "$__rate_interval": "30s"}
# An alert's expression is SIGNAL OP THRESHOLD (a convention the rules file states).
THRESHOLD = re.compile(r"^(?P<signal>.*\S)\s*(?:>=|<=|==|!=|>|<)\s*[-+0-9.e]+\s*$", re.DOTALL)
# Panels on TTFT objectives and preemption: they must show the fed processor's events, not only zeros.
EVENTFUL = re.compile(r"extproc_(objective_requests|release_slack|release_lateness|preemptions|preempted_occupancy)")
# A small, fast GPU (4 sequences, 10x real time): a steady flood keeps requests queued.
FAST_SIM = ["--max-num-seqs", "4", "--step-ms", "20", "--time-scale", "0.1"]


def panel_queries() -> Iterator[tuple[str, str]]:
    for panel in DASHBOARD["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for variable, value in VARIABLES.items():
                expr = expr.replace(variable, value)
            yield f"panel {panel['title']!r} {target['refId']}", expr


def alert_signals() -> Iterator[tuple[str, str]]:
    for group in yaml.safe_load(RULES.read_text())["groups"]:
        for rule in group["rules"]:
            match = THRESHOLD.match(rule["expr"].strip())
            assert match, f"{rule['alert']}: not SIGNAL OP THRESHOLD: {rule['expr']}"
            yield f"alert {rule['alert']}", match["signal"]


@pytest.mark.unit
def test_the_rules_are_valid_and_each_alert_fires_on_what_it_is_about() -> None:
    promtool = tool("promtool")
    for argv in ([promtool, "check", "rules", str(RULES)],
                 [promtool, "test", "rules", str(MONITORING / "prometheus" / "alerts_test.yml")]):
        result = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stdout + result.stderr
    alerts = {name for name, _ in alert_signals()}
    tested = set(re.findall(r"alertname: (\w+)", (MONITORING / "prometheus" / "alerts_test.yml").read_text()))
    assert {f"alert {name}" for name in tested} == alerts  # every alert has a firing test


@pytest.mark.unit
def test_the_processors_metrics_pass_promtool_check_metrics_with_every_kind_of_event_seen() -> None:
    """Prometheus's own lint of names, types, units and help on the page, objective and preemption series included."""
    promtool = tool("promtool")
    fed = Port()
    fed.report(*OBJECTIVE_EVENTS)
    page = generate_latest(fed.telemetry.registry)
    assert b'extproc_release_lateness_seconds_count{model="m",priority="interactive"} 1.0' in page
    result = subprocess.run([promtool, "check", "metrics"], input=page, capture_output=True, timeout=60)
    assert result.returncode == 0 and not result.stdout + result.stderr, result.stdout + result.stderr


@pytest.mark.unit
def test_the_dashboard_reads_only_metrics_the_processor_has_and_the_compose_profile_serves_it() -> None:
    exprs = [expr for _, expr in panel_queries()]
    assert len(exprs) >= 20
    names = set(re.findall(r"\b(extproc_\w+?)(?:_bucket|_total)?\b", " ".join(exprs)))
    reference = (ROOT / "docs" / "reference" / "metrics.md").read_text()
    assert all(f"`{name}" in reference for name in names), names - {n for n in names if f"`{n}" in reference}
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
    for service in ("prometheus", "grafana"):
        assert compose[service]["profiles"] == ["monitoring"]
        for volume in compose[service]["volumes"]:
            assert (ROOT / volume.split(":")[0]).exists(), volume
    # Prometheus scrapes the processor's metrics port inside the compose network.
    config = load_config(ROOT / "extproc" / "data" / "compose.yaml")
    scrape = yaml.safe_load((MONITORING / "prometheus" / "prometheus.yml").read_text())
    [target] = scrape["scrape_configs"][0]["static_configs"][0]["targets"]
    assert target == f"extproc:{config.listen.metrics.rpartition(':')[2]}"
    assert scrape["scrape_configs"][0]["job_name"] == "extproc"  # the alerts and CPU panels ask for it


async def flood(envoy_url: str, stop: asyncio.Event) -> int:
    """Tenants named under tenants: (alice) and by their API keys only (carol, dave), more at once than the engine
    runs, until ``stop``."""
    sent = 0
    async with aiohttp.ClientSession() as session:
        while not stop.is_set():
            await asyncio.gather(*(
                chat(session, envoy_url, tenant, "m1", api_key=TENANT_KEYS[tenant], max_tokens=20)
                for tenant in ("alice", "alice", "alice", "carol", "dave", "alice")
            ))
            sent += 6
    return sent


def has_data(result: list[dict[str, Any]], positive: bool = False) -> bool:
    """At least one series with a number (a quantile over no observations is NaN: no data to plot); > 0 if ``positive``."""
    return any(not math.isnan(v) and (v > 0 or not positive) for v in (float(s["value"][1]) for s in result))


async def feed_objectives(port: Port, stop: asyncio.Event) -> None:
    """What the core reports as it schedules by deadline, until ``stop``: interactive releases on time and late,
    a batch request preempted. No refusals: the rejection alert must stay quiet."""
    while not stop.is_set():
        port.report(
            RequestEvent(Step.RELEASED, "interactive", "alice", waited_s=0.5, slack_s=4.5),
            RequestEvent(Step.RELEASED, "interactive", "bob", waited_s=0.5, slack_s=3.0),
            RequestEvent(Step.RELEASED, "interactive", "carol", waited_s=5.4, slack_s=-0.4),
            RequestEvent(Step.PREEMPTED, "batch", "dave", waited_s=0.6),
        )
        await asyncio.sleep(0.2)


@pytest.mark.integration
async def test_every_panel_and_alert_signal_returns_data_from_a_live_processor(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """Two instances of an active-active cluster, so the cluster's panels and alert have data too, and a metrics
    port whose telemetry is fed objective and preemption events (``fed``), so their panels have some."""
    prometheus_bin = tool("prometheus")
    config = write_stack_config(tmp_path, {"m1": {}}, tenants={"alice": {}}, redis_url=redis_server.url,
                                cluster_instances=2)
    async with await start_stack(config, tmp_path, sim_args=FAST_SIM) as stack, Port() as fed:
        targets = [url.removeprefix("http://").removesuffix("/metrics") for url in stack.metrics_urls.values()]
        targets.append(fed.url.removeprefix("http://"))
        port = free_port()
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(RULES)],
            "scrape_configs": [{"job_name": "extproc", "static_configs": [{"targets": targets}]}],
        }))
        prometheus = f"http://127.0.0.1:{port}"
        argv = [prometheus_bin, f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}"]
        stop = asyncio.Event()
        async with await ManagedProcess.start("prometheus", argv, tmp_path / "prometheus.log", ready_url=f"{prometheus}/-/ready"):
            load = asyncio.create_task(flood(stack.envoy_url, stop))
            events = asyncio.create_task(feed_objectives(fed, stop))
            missing: list[str] = []
            async with aiohttp.ClientSession() as session:
                # Until every query has data (a rate needs two scrapes, a quantile observations in
                # its window), for at most 60 s on a busy machine.
                for _ in range(60):
                    await asyncio.sleep(1)
                    missing = [f"{what}: {expr}" for what, expr in [*panel_queries(), *alert_signals()]
                               if not has_data(await query(session, prometheus, expr), bool(EVENTFUL.search(expr)))]
                    if not missing:
                        break
                async with session.get(f"{prometheus}/api/v1/rules") as response:
                    rules = [r for g in (await response.json())["data"]["groups"] for r in g["rules"]]
            stop.set()
            sent = await load
            await events
    assert not missing, "\n".join(missing)
    assert sent > 0
    assert {r["name"] for r in rules} == {name.removeprefix("alert ") for name, _ in alert_signals()}
    assert all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError")) for r in rules]
    # Under a flood on a healthy engine, nothing is wrong: no alert is even pending.
    assert [r["name"] for r in rules if r["state"] != "inactive"] == []
