"""Budgets with ``cluster:``: two instances count in one Redis (one round trip per decision); Redis away, each its share.

Both read the cluster's counts back (the per-scope series, the status rows) and
export the cluster's usage, every instance's charges; Redis away, the rows say
they are stale and the export says where else to look, without hanging.
"""

from __future__ import annotations

import asyncio
import calendar
import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis

from extproc.adapters.budgets import cluster_standings, cluster_usage
from extproc.adapters.budgets.cluster_ledger import ClusterBudgets, ClusterTicket
from extproc.adapters.budgets.gate import BudgetGate, Pass
from extproc.adapters.config import parse_config
from extproc.adapters.request.admission import Admission
from extproc.cli import main
from extproc.core.budgets.book import Usage, day_of
from extproc.core.budgets.ledger import Standing
from extproc.core.budgets.limits import Plan
from extproc.core.values.outcomes import Refusal, Refused
from extproc.tools.power_user import chat
from extproc.tools.stack import start_stack
from tests.redisutil import RedisServer
from tests.stackutil import TENANT_KEYS, metric, poll, read_metrics, write_stack_config
from tests.waitutil import TIMEOUT_S, eventually

pytestmark = pytest.mark.integration

NOON = float(calendar.timegm((2026, 12, 3, 12, 0, 0)))
ASKS = Admission("m", "t", 1)


def gates(redis: aioredis.Redis, budgets: dict[str, object], now: list[float]) -> tuple[BudgetGate, BudgetGate]:
    config = parse_config({"models": [{"name": "m", "endpoints": ["http://127.0.0.1:1"]}], "budgets": budgets})
    assert config.budgets is not None
    made = []
    for _ in range(2):
        gate = BudgetGate(config.budgets, 2, clock=lambda: now[0])
        gate.share(ClusterBudgets(redis, "test", 0.5, lambda: 2))
        made.append(gate)
    return made[0], made[1]


async def admitted(gate: BudgetGate, tokens: float = 10.0) -> Pass | Refused:
    try:
        return (await gate.admit(ASKS, (tokens, tokens)))[1]
    except Refused as refused:
        return refused


async def test_two_instances_enforce_one_limit_and_a_cancel_gives_back_to_both(redis_server: RedisServer) -> None:
    client = aioredis.from_url(redis_server.url)
    now = [NOON]
    a, b = gates(client, {"tenants": {"default": {"requests_per_minute": 4, "tokens_per_day": 1000}}}, now)
    passes = [await admitted(gate) for gate in (a, b, a, b)]
    assert all(isinstance(p, Pass) and isinstance(p.ticket, ClusterTicket) for p in passes)
    refused = await admitted(a)
    assert isinstance(refused, Refused) and refused.refusal is Refusal.RATE_LIMIT_EXCEEDED
    assert refused.retry_in_s == pytest.approx(15.0)
    assert dict(refused.headers)["x-ratelimit-remaining-requests"] == "0"
    # The limit that refused, named as a single instance names it.
    assert refused.message.startswith("tenant 't' is over its requests per minute (4) (cluster-wide); room again in")
    first = passes[0]
    assert isinstance(first, Pass)
    b.end(first, None)  # never served: its request and its tokens come back, whichever instance admitted it
    assert b.shared is not None
    await _corrections(b.shared)
    assert isinstance(await admitted(b), Pass)
    # The day's budget is the cluster's too: 4 reservations of 20 stand, 922 more do not fit (a minute on: the rate
    # has room again).
    now[0] += 60
    over = await admitted(a, tokens=461.0)
    assert isinstance(over, Refused) and over.refusal is Refusal.INSUFFICIENT_QUOTA
    assert over.message.startswith("tenant 't' is over its tokens per day (1000) (cluster-wide)")
    await client.aclose()


async def _corrections(shared: ClusterBudgets) -> None:
    """Until every correction sent so far has had Redis's answer (or failed)."""
    await eventually(lambda: shared.corrections_in_flight == 0, what="the corrections answered")


async def test_with_redis_away_each_instance_enforces_its_share(redis_server: RedisServer) -> None:
    client = aioredis.from_url(redis_server.url, socket_timeout=0.5, socket_connect_timeout=0.5)
    now = [NOON]
    a, _ = gates(client, {"tenants": {"default": {"requests_per_minute": 4}}}, now)
    await redis_server.stop()
    assert [isinstance(await admitted(a), Pass) for _ in range(3)] == [True, True, False]  # 4 / 2 instances
    await client.aclose()


async def test_the_end_replaces_the_reservation_by_what_was_used_in_the_period_it_ends_in(
        redis_server: RedisServer) -> None:
    client = aioredis.from_url(redis_server.url)
    now = [NOON]
    a, b = gates(client, {"tenants": {"default": {"output_tokens_per_minute": 1000, "tokens_per_day": 1000}}}, now)
    passed = await admitted(a, tokens=400.0)  # reserves 800 of the day, 400 of the window
    assert isinstance(passed, Pass) and isinstance(passed.ticket, ClusterTicket) and a.shared is not None
    a.shared.correct(passed.ticket, tuple(100.0 if m.counts == "output" else 200.0 for m in passed.ticket.meters), now[0])
    await _corrections(a.shared)
    assert isinstance(await admitted(b, tokens=350.0), Pass)  # 200 used + 700 reserved <= 1000
    assert isinstance(await admitted(b, tokens=60.0), Refused)
    await client.aclose()


async def test_two_instances_behind_envoy_enforce_one_limit(tmp_path: Path, redis_server: RedisServer) -> None:
    """Envoy spreads bob's requests over both instances; together they let through the cluster's limit, not twice it."""
    path = write_stack_config(tmp_path, {"m1": {}}, redis_url=redis_server.url, cluster_instances=2,
                              budgets={"tenants": {"bob": {"requests_per_minute": 6}}})
    async with await start_stack(path, tmp_path) as stack, aiohttp.ClientSession() as http:
        outcomes = [await chat(http, stack.envoy_url, "bob", "m1", api_key=TENANT_KEYS["bob"], max_tokens=3)
                    for _ in range(12)]
        statuses = Counter(o.status for o in outcomes)
        released = {name: metric(await read_metrics(url), "extproc_released_total", model="m1")
                    for name, url in stack.metrics_urls.items()}
    assert 6 <= statuses[200] <= 7 and statuses[200] + statuses[429] == 12, statuses  # 7: a second's refill
    assert min(released.values()) >= 1, released  # both instances admitted some: the count was shared


async def test_each_instance_reads_the_clusters_counts_and_marks_them_stale_with_redis_away(
        redis_server: RedisServer) -> None:
    client = aioredis.from_url(redis_server.url, socket_timeout=0.5, socket_connect_timeout=0.5)
    now = [NOON]
    a, b = gates(client, {"prices": {"m": {"input": 1.0, "output": 2.0}}, "groups": {"g": {"tokens_per_day": 10_000}},
                          "tenants": {"t": {"requests_per_minute": 60, "groups": ["g"],
                                            "models": {"m": {"cost_per_month": 5}}}}}, now)
    for gate in (a, b, a):
        assert isinstance(await admitted(gate), Pass)
    for gate in (a, b):
        await gate.refresh()
        rows, stale = gate.standings()
        assert not stale
        shown = {(r.scope.kind.value, r.scope.name, r.scope.model, r.limit): (r.value, r.used) for r in rows}
        assert shown == {("group", "g", "", "tokens_per_day"): (10_000, 60.0),  # 3 reservations of 20 tokens
                         ("tenant", "t", "", "requests_per_minute"): (60, 3.0),  # all three, whoever admitted them
                         ("tenant_model", "t", "m", "cost_per_month"): (5, pytest.approx(3 * 30e-6))}
        # This instance's own ledger counted none of them.
        assert {r.used for r in gate.budgets.standings(NOON)} == {0.0}
    now[0] += 30  # the window drains at 1 a second; a read is due again after a second
    await asyncio.sleep(1.0)
    await a.refresh()
    assert [(r.used, r.reset_s) for r in a.standings()[0] if r.limit == "requests_per_minute"] == [(0.0, 0.0)]
    await redis_server.stop()
    await asyncio.sleep(1.0)
    await asyncio.wait_for(a.refresh(), TIMEOUT_S)  # a hang bound: the read ends at the gate's Redis timeout (0.5 s)
    rows, stale = a.standings()
    assert stale and len(rows) == 3  # the last rows read, said to be stale
    assert {row["stale"] for row in a.named()} == {True}
    await client.aclose()


async def test_the_end_adds_each_charge_to_the_clusters_usage_book(redis_server: RedisServer) -> None:
    client = aioredis.from_url(redis_server.url)
    now = [NOON]
    a, b = gates(client, {"tenants": {"default": {"requests_per_minute": 60}}}, now)
    assert a.shared is not None and b.shared is not None
    passed = await admitted(a)
    assert isinstance(passed, Pass) and isinstance(passed.ticket, ClusterTicket)
    day = day_of("2026-12-03")
    a.shared.correct(passed.ticket, (1.0,), NOON, cluster_usage.charge("t", "m", day, Usage(100, 40, 7), 0.25, False))
    b.shared.record(cluster_usage.charge("t", "m", day, Usage(50, 0, 3), 0.5, True), NOON)  # decided on b's share
    b.shared.record(cluster_usage.charge("u", "m", day + 86_400, Usage(1, 0, 1), 0.0, False), NOON)
    await _corrections(a.shared)
    await _corrections(b.shared)
    rows = await cluster_usage.rows(client, b.shared.prefix, day_of("2026-12-01"), NOON, 1.0)
    assert [(key, row.values()) for key, row in rows] == [
        (("t", "m", "2026-12-03"), (2, 150.0, 40.0, 10.0, 0.75, 1)),
        (("u", "m", "2026-12-04"), (1, 1.0, 0.0, 1.0, 0.0, 0))]  # a clock ahead of today's: still exported
    assert await cluster_usage.rows(client, b.shared.prefix, day_of("2026-12-04"), NOON, 1.0) == rows[1:]
    await client.aclose()


async def test_two_instances_show_the_clusters_counts_and_usage(tmp_path: Path, redis_server: RedisServer,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """Requests through Envoy to both instances: each one's series, status rows and /usage are the cluster's."""
    limits = {"requests_per_minute": 12, "tokens_per_day": 1_000_000}
    path = write_stack_config(tmp_path, {"m1": {}}, redis_url=redis_server.url, cluster_instances=2,
                              budgets={"tenants": {"bob": limits}})
    async with await start_stack(path, tmp_path) as stack, aiohttp.ClientSession() as http:
        sent = time.monotonic()
        outcomes = [await chat(http, stack.envoy_url, "bob", "m1", api_key=TENANT_KEYS["bob"], max_tokens=3)
                    for _ in range(8)]
        assert [o.status for o in outcomes] == [200] * 8
        released = {name: metric(await read_metrics(url), "extproc_released_total", model="m1")
                    for name, url in stack.metrics_urls.items()}
        assert min(released.values()) >= 1 and sum(released.values()) == 8, released  # both served some
        bases = {name: url.removesuffix("/metrics") for name, url in stack.metrics_urls.items()}

        async def usage(base: str) -> list[dict[str, Any]]:
            async with http.get(f"{base}/usage", params={"per": "month"}) as answer:
                assert answer.status == 200
                return list(await answer.json())

        # The ends' corrections are sent without waiting: the rows are complete once all 8 are in.
        first = await poll(lambda: usage(bases["a"]), lambda rows: sum(r["requests"] for r in rows) == 8)
        assert [(r["tenant"], r["model"], r["requests"]) for r in first] == [("bob", "m1", 8)]
        tokens = first[0]["input_tokens"] + first[0]["output_tokens"]
        for name, base in bases.items():
            assert await usage(base) == first, name  # the same rows from either instance
            samples = await read_metrics(stack.metrics_urls[name])
            assert metric(samples, "extproc_budget_stale") == 0
            assert _bobs(samples, "tokens_per_day") == pytest.approx(tokens, abs=1)  # the export rounds
            drained = (time.monotonic() - sent) * 12 / 60  # the window drains at 12 a minute
            used = _bobs(samples, "requests_per_minute")
            assert 8 - drained - 0.01 <= used <= 8, (name, used)  # all 8, not this instance's share of them
            async with http.get(f"{base}/status.json") as answer:
                rows = {r["limit"]: r for r in (await answer.json())["budgets"]}
            assert rows["tokens_per_day"]["used"] == pytest.approx(tokens, abs=1) and not rows["tokens_per_day"]["stale"]
        # `extproc usage` reads the same rows from Redis, without a processor.
        capsys.readouterr()
        assert await asyncio.to_thread(main, ["usage", "--config", str(path), "--per", "month", "--format", "json"]) == 0
        exported = json.loads(capsys.readouterr().out)
        assert exported == first

        await redis_server.stop()
        for name, base in bases.items():
            async def status(base: str = base) -> list[dict[str, object]]:
                async with http.get(f"{base}/status.json") as answer:
                    return list((await answer.json())["budgets"])

            rows_after = await poll(status, lambda rows: all(r["stale"] for r in rows))  # its timeout: a hang bound
            assert rows_after and all(r["stale"] for r in rows_after), name
            samples = await read_metrics(stack.metrics_urls[name])
            assert metric(samples, "extproc_budget_stale") == 1
            assert metric(samples, "extproc_budget_limit") == 0  # left out, not shown from this instance's counts
            async with asyncio.timeout(TIMEOUT_S), http.get(f"{base}/usage") as answer:  # a hang bound
                assert answer.status == 500 and "Redis" in (await answer.json())["error"]["message"]


def _bobs(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], limit: str) -> float:
    """``extproc_budget_used`` of tenant bob's ``limit`` (its ``name`` label is not one ``metric`` can filter on)."""
    wanted = {"scope": "tenant", "name": "bob", "model": "", "limit": limit}
    return next(value for (series, labels), value in samples.items()
                if series == "extproc_budget_used" and dict(labels) == wanted)


async def test_the_clusters_counts_are_read_at_most_once_a_second_however_many_ask(
        monkeypatch: pytest.MonkeyPatch) -> None:
    reads: list[float] = []

    async def read(shared: ClusterBudgets, plan: Plan, now: float) -> list[Standing]:
        reads.append(now)
        await asyncio.sleep(0.05)  # a round trip: those asking meanwhile wait for its rows
        return []

    monkeypatch.setattr(cluster_standings, "read", read)
    a, _ = gates(aioredis.Redis(), {"tenants": {"t": {"requests_per_minute": 6}}}, [NOON])
    await asyncio.gather(*(a.refresh() for _ in range(5)))
    assert len(reads) == 1 and a.standings() == ([], False)
    await asyncio.sleep(1.0)
    await a.refresh()
    assert len(reads) == 2
