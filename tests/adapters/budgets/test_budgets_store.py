"""The usage book in SQLite: written behind, read back at start, so a restart in the middle of a day keeps its budget."""

from __future__ import annotations

import calendar
import time
from pathlib import Path

import pytest
import yaml
from aiohttp.test_utils import TestClient, TestServer

from extproc.adapters.budgets.usage_store import StoreWriter, UsageStore
from extproc.adapters.config import load_config, parse_config
from extproc.adapters.server import ProcessorServer
from extproc.adapters.web.app import build_app
from extproc.cli import main
from extproc.core.budgets.book import Book, Usage
from extproc.core.budgets.meters import DAY_S, day_start
from tests.helpers.budgets_processor import request
from tests.helpers.processor import Stream, settle

pytestmark = pytest.mark.unit

NOON = float(calendar.timegm((2026, 12, 3, 12, 0, 0)))


async def test_rows_are_written_behind_whole_and_read_back_from_the_month(tmp_path: Path) -> None:
    book = Book()
    writer = StoreWriter(UsageStore(tmp_path / "deep" / "usage.sqlite"), lambda: book, 5.0, lambda: NOON)
    assert writer.load() == 0
    book.add("a", "m", day_start(NOON), Usage(10, 2, 20), 0.5)
    book.add("a", "m", day_start(NOON) - 40 * DAY_S, Usage(1, 0, 1), 0.1)  # last month... before it
    await writer.flush()
    book.add("a", "m", day_start(NOON), Usage(10, 2, 20), 0.5, over=True)
    await writer.flush()
    await writer.flush()  # nothing changed: nothing written
    stored = dict(writer.store.rows())
    assert stored[("a", "m", "2026-12-03")].values() == (2, 20, 4, 40, 1.0, 1)
    assert ("a", "m", "2026-10-24") in stored and [k for k, _ in book.rows()] == [("a", "m", "2026-12-03")]
    fresh = Book()
    assert StoreWriter(writer.store, lambda: fresh, 5.0, lambda: NOON).load() == 1  # this month's only
    assert [(k, r.values()) for k, r in fresh.rows()] == [(("a", "m", "2026-12-03"), (2, 20, 4, 40, 1.0, 1))]


async def test_a_restart_in_the_middle_of_a_day_budget_does_not_hand_out_a_fresh_one(tmp_path: Path) -> None:
    config = parse_config({
            "models": [{"name": "m", "endpoints": ["http://127.0.0.1:1"], "advanced": {"fallback_max_in_flight": 8}}],
        "budgets": {"store": str(tmp_path / "usage.sqlite"), "tenants": {"default": {"tokens_per_day": 1000}}},
    })

    async def served(server: ProcessorServer, count: int) -> list[int]:
        """Send ``count`` requests (100 prompt + 200 output tokens each); the statuses (200: released and ended)."""
        statuses = []
        for _ in range(count):
            stream = Stream(server.processor, request(max_tokens=200))
            answer = await stream.answers.get()
            assert not answer.HasField("override_message_timeout")  # never held
            if answer.HasField("immediate_response"):
                statuses.append(answer.immediate_response.status.code)
            else:
                stream.close()
                await settle()
                statuses.append(200)
        return statuses

    async def run(count: int) -> list[int]:
        """A processor's life: its store read at start, ``count`` requests, its store written at the end."""
        server = ProcessorServer(config)  # not started: no scrapes, the engine runs on its fallback limit
        assert server.budgets is not None and server.budgets.store is not None
        server.budgets.store.load()
        statuses = await served(server, count)
        await server.budgets.store.flush()
        return statuses

    assert await run(2) == [200, 200]  # 600 of 1000 used
    assert await run(2) == [200, 429]  # 900 used: one more would pass 1000


def budget_series(server: ProcessorServer) -> dict[tuple[str, str, str, str], float]:
    """(series, scope, name, limit) -> value of the per-scope budget series on the processor's page."""
    return {(s.name, s.labels["scope"], s.labels["name"], s.labels["limit"]): s.value
            for m in server.telemetry.registry.collect() for s in m.samples
            if s.name.startswith("extproc_budget_") and "scope" in s.labels}


async def test_after_a_restart_every_named_tenant_and_group_has_its_series_before_its_first_request(
        tmp_path: Path) -> None:
    config = parse_config({
        "models": [{"name": "m", "endpoints": ["http://127.0.0.1:1"], "advanced": {"fallback_max_in_flight": 8}}],
        "budgets": {"store": str(tmp_path / "usage.sqlite"), "groups": {"team": {"tokens_per_day": 10_000}},
                    "tenants": {"a": {"tokens_per_day": 1000, "groups": ["team"]}, "b": {"requests_per_minute": 6},
                                "default": {"tokens_per_day": 500}}},
    })
    first = ProcessorServer(config)
    assert first.budgets is not None and first.budgets.store is not None
    first.budgets.store.load()
    stream = Stream(first.processor, request(tenant="a", max_tokens=200))  # 100 prompt + 200 output tokens
    assert (await stream.answers.get()).HasField("request_headers")
    stream.close()
    await settle()
    await first.budgets.store.flush()
    await first.close()

    restarted = ProcessorServer(config)  # no request yet
    assert restarted.budgets is not None and restarted.budgets.store is not None
    restarted.budgets.store.load()
    series = budget_series(restarted)
    assert series[("extproc_budget_used", "tenant", "a", "tokens_per_day")] == 300  # the store's usage
    assert series[("extproc_budget_remaining", "tenant", "a", "tokens_per_day")] == 700
    assert series[("extproc_budget_used", "group", "team", "tokens_per_day")] == 300
    assert series[("extproc_budget_remaining", "tenant", "b", "requests_per_minute")] == 6
    assert {name for _, _, name, _ in series} == {"a", "b", "team"}  # the default's tenants are not named
    await restarted.close()


async def test_usage_is_exported_by_the_metrics_port_and_the_command_and_budgets_are_series(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = tmp_path / "usage.sqlite"
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({
        "models": [{"name": "m", "endpoints": ["http://127.0.0.1:1"], "advanced": {"fallback_max_in_flight": 8}}],
        "budgets": {"store": str(store), "prices": {"m": {"input": 1.0, "output": 2.0}},
                    "tenants": {"default": {"tokens_per_day": 100_000}, "t": {"requests_per_minute": 5}}},
    }))
    server = ProcessorServer(load_config(path))
    assert server.budgets is not None and server.budgets.store is not None
    server.budgets.store.load()
    for tenant in ("t", "t", "u"):
        stream = Stream(server.processor, request(tenant=tenant, max_tokens=200))
        assert (await stream.answers.get()).HasField("request_headers")
        stream.close()
        await settle()
    today = time.strftime("%Y-%m", time.gmtime())
    found = await server.usage(f"{today}-01", "month")
    assert found == [
        {"tenant": "t", "model": "m", "period": today, "requests": 2, "input_tokens": 200, "cached_tokens": 0,
         "output_tokens": 400, "cost": 0.001, "over_limit_requests": 0},
        {"tenant": "u", "model": "m", "period": today, "requests": 1, "input_tokens": 100, "cached_tokens": 0,
         "output_tokens": 200, "cost": 0.0005, "over_limit_requests": 0},
    ]
    assert main(["usage", "--config", str(path), "--since", today, "--per", "month", "--format", "csv"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "tenant,model,period,requests,input_tokens,cached_tokens,output_tokens,cost,over_limit_requests"
    assert lines[1].startswith("t,m,") and lines[1].endswith(",2,200,0,400,0.001,0") and len(lines) == 3
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for m in server.telemetry.registry.collect() for s in m.samples if s.name.startswith("extproc_budget")}
    assert samples[("extproc_budget_remaining", (("limit", "requests_per_minute"), ("model", ""),
                                                 ("name", "t"), ("scope", "tenant")))] == pytest.approx(3, abs=0.5)
    assert not any(dict(labels).get("name") == "u" for _, labels in samples)  # unnamed: no per-scope series
    assert samples[("extproc_budget_usage_output_tokens_total", (("model", "m"), ("tenant", "other")))] == 200
    assert samples[("extproc_budget_usage_cost_total", (("model", "m"), ("tenant", "t")))] == pytest.approx(0.001)
    assert server.budgets is not None
    app = build_app(server.telemetry.registry, server.dispatchers, lambda: False, usage=server.usage,
                    budgets=server.budgets.standings)
    async with TestClient(TestServer(app)) as client:
        answer = await client.get("/usage", params={"since": today, "format": "csv", "per": "month"})
        assert answer.status == 200 and answer.content_type == "text/csv"
        assert (await answer.text()).splitlines()[1:] == lines[1:]
        assert (await client.get("/usage", params={"since": "last week"})).status == 400
        assert (await (await client.get("/usage")).json())[0]["requests"] == 2
        shown = (await (await client.get("/status.json")).json())["budgets"]  # the status page's table
        assert [(r["scope"], r["name"], r["limit"], r["value"]) for r in shown] == [
            ("tenant", "t", "requests_per_minute", 5), ("tenant", "t", "tokens_per_day", 100_000)]
    await server.close()


def test_the_usage_command_says_what_is_missing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"models": [{"name": "m", "endpoints": ["http://127.0.0.1:1"]}]}))
    assert main(["usage", "--config", str(path)]) == 1
    assert "budgets.store is not set" in capsys.readouterr().err
    path.write_text(yaml.safe_dump({"models": [{"name": "m", "endpoints": ["http://127.0.0.1:1"]}],
                                    "budgets": {"store": str(tmp_path / "none.sqlite")}}))
    assert main(["usage", "--config", str(path), "--since", "yesterday"]) == 1
    assert "--since must be YYYY-MM-DD or YYYY-MM" in capsys.readouterr().err
