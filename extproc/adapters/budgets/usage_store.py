"""The usage book in SQLite: a single instance's day and month budgets survive a restart (``budgets.store``).

At start the rows of the current month are read back into the book
(``core/budgets/book.py``), so the limits' day and month counts start where
they were, not at zero: a restart does not hand out a fresh budget. While
serving, the rows that changed are written every ``store_interval_s`` in a
worker thread (write-behind: a request never waits for the disk), and once
more when the processor stops. A crash loses at most the last interval's
usage; requests in flight at a restart were reserved, not used, and are
not counted.

One table, one row per tenant, model and UTC day, the full values each time
(a rewrite is idempotent). The file is the export's source too
(``usage.py``), so finance reads every day the instance ever served.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
from collections.abc import Callable
from contextlib import closing
from pathlib import Path

from extproc.core.budgets.book import Book, Key, Row, day_name
from extproc.core.budgets.meters import month_start

log = logging.getLogger(__name__)

SCHEMA = """
CREATE TABLE IF NOT EXISTS usage (
    tenant TEXT NOT NULL, model TEXT NOT NULL, day TEXT NOT NULL,
    requests INTEGER NOT NULL, input_tokens REAL NOT NULL, cached_tokens REAL NOT NULL,
    output_tokens REAL NOT NULL, cost REAL NOT NULL, over INTEGER NOT NULL,
    PRIMARY KEY (tenant, model, day)
)
"""
COLUMNS = "tenant, model, day, requests, input_tokens, cached_tokens, output_tokens, cost, over"


class UsageStore:
    """The SQLite file: rows read and written whole. Each call opens its own connection (threads may call)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def _connect(self) -> sqlite3.Connection:
        connection = sqlite3.connect(self.path, timeout=10)
        connection.execute("PRAGMA journal_mode=WAL")
        connection.execute(SCHEMA)
        return connection

    def create(self) -> None:
        """The file and its table, now (so a wrong path fails at start, naming the key)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with closing(self._connect()) as connection:
            connection.commit()

    def write(self, rows: list[tuple[Key, Row]]) -> None:
        if not rows:
            return
        with closing(self._connect()) as connection, connection:
            connection.executemany(f"INSERT OR REPLACE INTO usage ({COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                                   [(*key, *row.values()) for key, row in rows])

    def rows(self, since: str = "") -> list[tuple[Key, Row]]:
        """Every row of a day from ``since`` (``YYYY-MM-DD``; empty: all), by tenant, model and day."""
        with closing(self._connect()) as connection:
            found = connection.execute(f"SELECT {COLUMNS} FROM usage WHERE day >= ? ORDER BY tenant, model, day",
                                       (since,)).fetchall()
        return [((tenant, model, day), Row(*values)) for tenant, model, day, *values in found]


class StoreWriter:
    """Writes a book's changed rows behind, every ``interval_s``; loads the current month at start."""

    def __init__(self, store: UsageStore, book: Callable[[], Book | None], interval_s: float,
                 clock: Callable[[], float]) -> None:
        self.store = store
        self._book = book
        self._interval_s = interval_s
        self._clock = clock

    def load(self) -> int:
        """The current month's rows into the book (before the first request); how many."""
        book = self._book()
        self.store.create()
        rows = self.store.rows(day_name(month_start(self._clock())))
        if book is not None:
            book.load(rows)
        return len(rows)

    async def flush(self) -> None:
        """Write what changed since the last flush; then forget rows before last month (the store has them)."""
        book = self._book()
        if book is None:
            return
        rows = book.take_dirty()
        try:
            await asyncio.to_thread(self.store.write, rows)
        except sqlite3.Error:
            book.undo_take(rows)
            raise
        book.drop_before(month_start(month_start(self._clock()) - 1))

    async def run(self) -> None:
        """Flush every interval until cancelled; a failed write is logged and its rows written at the next."""
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                await self.flush()
            except sqlite3.Error as exc:
                log.error("budgets.store: cannot write %s (%s); retrying in %gs", self.store.path, exc, self._interval_s)
