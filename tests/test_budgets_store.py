"""The usage book in SQLite: written behind, read back at start, so a restart in the middle of a day keeps its budget."""

from __future__ import annotations

import calendar
from pathlib import Path

import pytest

from extproc.adapters.budgets.store import StoreWriter, UsageStore
from extproc.adapters.config import parse_config
from extproc.adapters.server import ProcessorServer
from extproc.core.budgets.book import Book, Usage
from extproc.core.budgets.meters import DAY_S, day_start
from tests.test_budgets_processor import request
from tests.test_processor import Stream, settle

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
            "models": [{"name": "m", "endpoints": ["http://127.0.0.1:1"], "fallback_max_in_flight": 8}],
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
        assert server._store is not None
        server._store.load()
        statuses = await served(server, count)
        await server._store.flush()
        return statuses

    assert await run(2) == [200, 200]  # 600 of 1000 used
    assert await run(2) == [200, 429]  # 900 used: one more would pass 1000
