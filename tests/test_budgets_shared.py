"""Budgets with ``cluster:``: two instances count in one Redis (one round trip per decision); Redis away, each its share."""

from __future__ import annotations

import calendar
from collections import Counter
from pathlib import Path

import aiohttp
import pytest
import redis.asyncio as aioredis

from extproc.adapters.budgets.gate import BudgetGate, Pass
from extproc.adapters.budgets.shared import SharedBudgets, SharedTicket
from extproc.adapters.config import parse_config
from extproc.adapters.ext_proc.admission import Admission
from extproc.core.outcomes import Refusal, Refused
from extproc.tools.power_user import chat
from extproc.tools.stack import start_stack
from tests.redisutil import RedisServer
from tests.stackutil import TENANT_KEYS, metric, read_metrics, write_stack_config

pytestmark = pytest.mark.integration

NOON = float(calendar.timegm((2026, 12, 3, 12, 0, 0)))
ASKS = Admission("m", "t", 1)


def gates(redis: aioredis.Redis, budgets: dict[str, object], now: list[float]) -> tuple[BudgetGate, BudgetGate]:
    config = parse_config({"models": [{"name": "m", "endpoints": ["http://127.0.0.1:1"]}], "budgets": budgets})
    assert config.budgets is not None
    made = []
    for _ in range(2):
        gate = BudgetGate(config.budgets, 2, clock=lambda: now[0])
        gate.shared = SharedBudgets(redis, "test", 0.5, lambda: 2)
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
    assert all(isinstance(p, Pass) and isinstance(p.ticket, SharedTicket) for p in passes)
    refused = await admitted(a)
    assert isinstance(refused, Refused) and refused.refusal is Refusal.RATE_LIMIT_EXCEEDED
    assert refused.retry_in_s == pytest.approx(15.0)
    assert dict(refused.headers)["x-ratelimit-remaining-requests"] == "0"
    first = passes[0]
    assert isinstance(first, Pass)
    b.end(first, None)  # never served: its request and its tokens come back, whichever instance admitted it
    assert b.shared is not None
    await _corrections(b.shared)
    assert isinstance(await admitted(b), Pass)
    # The day's budget is the cluster's too: 5 reservations of 20 stand, 900 more do not fit.
    over = await admitted(a, tokens=451.0)
    assert isinstance(over, Refused)
    await client.aclose()


async def _corrections(shared: SharedBudgets) -> None:
    for task in list(shared._corrections):
        await task


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
    assert isinstance(passed, Pass) and isinstance(passed.ticket, SharedTicket) and a.shared is not None
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
