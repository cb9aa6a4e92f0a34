"""A cluster's usage book in Redis: what every instance charged, per tenant, model and UTC day, for the export.

Each instance keeps its own book (``core/budgets/book.py``, and its store);
with ``cluster:`` each request's charge is also added to the day's hash in
Redis, ``<key_prefix>:budget:usage:<YYYY-MM-DD>``, in the same script call
that sends the request's correction at its end (``budgets.lua``, ``correct``:
no round trip more, and not waited for). A field per tenant, model and column,
added with ``HINCRBYFLOAT``, so instances never overwrite each other; the hash
expires :data:`KEEP_DAYS` after its day.

The export (``/usage``, ``extproc usage``) reads the days asked for in one
pipelined round trip, one ``HGETALL`` per day: a command per day rather than
one script, so a long export never holds Redis up while admissions wait for it.

A charge whose write is lost (Redis away, or slower than
``cluster.redis_timeout_ms``) is missing from these rows and only in the book
of the instance that served it: the cluster's rows are at most the sum of the
instances' books, equal when no write was lost (writes are never retried, so
never counted twice).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import redis.asyncio as aioredis

from extproc.core.budgets.book import Key, Row, Usage, day_name
from extproc.core.budgets.meters import DAY_S

# How long the cluster's day rows are kept: over a year, so a year's usage can be compared.
KEEP_DAYS = 400
COLUMNS = ("requests", "input_tokens", "cached_tokens", "output_tokens", "cost", "over")


def charge(tenant: str, model: str, day: float, used: Usage, cost: float, over: bool) -> dict[str, Any]:
    """One request's charge as the script adds it (``budgets.lua``: ``usage``), in the day ``day`` starts."""
    values = (1.0, used.input_tokens, used.cached_tokens, used.output_tokens, cost, float(over))
    return {"day": day_name(day), "ttl": round(KEEP_DAYS * DAY_S),
            "add": [[_field(tenant, model, column), value] for column, value in zip(COLUMNS, values, strict=True)
                    if value]}


def _field(tenant: str, model: str, column: str) -> str:
    return json.dumps([tenant, model, column], separators=(",", ":"))


async def rows(client: aioredis.Redis, prefix: str, since: float, today: float,
               timeout_s: float) -> list[tuple[Key, Row]]:
    """Every row of a day from ``since`` (at most :data:`KEEP_DAYS` back) to ``today`` and the next (a clock ahead).

    Raises RedisError, OSError or TimeoutError when Redis does not answer in time.
    """
    first = max(since, today - KEEP_DAYS * DAY_S)
    days = [day_name(first + i * DAY_S) for i in range(int((today - first) // DAY_S) + 2)]
    async with asyncio.timeout(timeout_s):
        async with client.pipeline(transaction=False) as pipe:
            for day in days:
                pipe.hgetall(f"{prefix}:usage:{day}")
            replies = await pipe.execute()
    found: dict[Key, Row] = {}
    for day, reply in zip(days, replies, strict=True):
        for field, value in reply.items():
            tenant, model, column = json.loads(field)
            row = found.setdefault((tenant, model, day), Row())
            amount = float(value)
            setattr(row, column, round(amount) if column in ("requests", "over") else amount)
    return sorted(found.items())
