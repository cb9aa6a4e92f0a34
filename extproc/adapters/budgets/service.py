"""What ``extproc serve`` runs for tenant budgets beside the gate: the store, the series, the usage export.

The gate (``gate.py``) decides each request inside the ext_proc servicer; this
is the rest of the section's life in the process: the usage book read from
SQLite at start and written behind (``usage_store.py``), the budgets' series on the
metrics registry (``metrics.py``), their standings and the usage export for
the metrics port, and with ``cluster:`` the counts shared in Redis
(``cluster_ledger.py``). server.py builds it only when the config has a ``budgets:``
section, so a processor without one loads none of this package.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry
from redis.exceptions import RedisError

from extproc.adapters.budgets import cluster_usage
from extproc.adapters.budgets.cluster_ledger import ClusterBudgets
from extproc.adapters.budgets.metrics import BudgetCollector
from extproc.adapters.budgets.usage import Per, Unavailable, records
from extproc.adapters.budgets.usage_store import StoreWriter, UsageStore
from extproc.adapters.config import ClusterSettings
from extproc.adapters.config.budgets import BudgetSettings
from extproc.core.budgets.book import Book, day_of

if TYPE_CHECKING:
    from extproc.adapters.budgets.gate import BudgetGate
    from extproc.adapters.cluster.link import ClusterConnection

log = logging.getLogger(__name__)

# The cluster's usage export: a read of up to a year's day rows in one pipeline, off the request path.
USAGE_TIMEOUT_S = 10.0


class BudgetService:
    """The budgets' parts of one processor; ``gate`` is the servicer's gate, asked each time it is needed."""

    def __init__(self, settings: BudgetSettings, gate: Callable[[], BudgetGate | None],
                 registry: CollectorRegistry) -> None:
        self._gate = gate
        # The usage book in SQLite (budgets.store), read at start and written behind.
        self.store = None if settings.store is None else StoreWriter(
            UsageStore(settings.store), self._book, settings.store_interval_s, time.time)
        registry.register(BudgetCollector(gate))

    def _book(self) -> Book | None:
        gate = self._gate()
        return None if gate is None else gate.budgets.book

    def load(self) -> None:
        """Before the first request: the month's usage from the store, so a restart does not hand out a fresh budget."""
        if self.store is None:
            return
        try:
            loaded = self.store.load()
        except (OSError, sqlite3.Error) as exc:
            raise OSError(f"budgets.store: cannot open {self.store.store.path} ({exc})") from exc
        log.info("budgets: %d usage rows of this month read from %s", loaded, self.store.store.path)

    async def close(self) -> None:
        """At exit: the usage of the last interval, and of every request that ended since, written to the store."""
        if self.store is None:
            return
        try:
            await self.store.flush()
        except sqlite3.Error as exc:
            log.error("budgets.store: cannot write %s at exit (%s)", self.store.store.path, exc)

    def share(self, cluster: ClusterConnection, settings: ClusterSettings) -> None:
        """With a cluster, the budgets' counts are the cluster's, in Redis (cluster_ledger.py); once."""
        gate = self._gate()
        if gate is None or gate.shared is not None:
            return
        expected = max(1, len(settings.instances))
        gate.share(ClusterBudgets(
            cluster.client, settings.key_prefix, settings.redis_timeout_ms / 1000,
            lambda: max([expected, *(seat.instances for seat in cluster.seats.values())])))

    def standings(self) -> list[dict[str, object]] | None:
        """The named tenants' and groups' limits as they stand (the status page's)."""
        gate = self._gate()
        return None if gate is None else gate.named()

    async def refresh(self) -> None:
        """Before /metrics and the status page: with a cluster, the limits' counts read from Redis (when due)."""
        gate = self._gate()
        if gate is not None:
            await gate.refresh()

    async def usage(self, since: str, per: Per) -> list[dict[str, Any]] | None:
        """The usage export (usage.py) from ``since`` (YYYY-MM-DD).

        With a cluster, the cluster's rows in Redis (cluster_usage.py; raises Unavailable
        when Redis does not answer). Else, with a store, what changed is written first and the file is read
        (every day it holds); else the processor's memory (the days since it started).
        """
        gate = self._gate()
        if gate is None:
            return None
        book = gate.budgets.book
        if gate.shared is not None:
            shared = gate.shared
            try:
                found = await cluster_usage.rows(shared.client, shared.prefix, day_of(since), time.time(),
                                                USAGE_TIMEOUT_S)
            except (RedisError, OSError, TimeoutError) as exc:
                raise Unavailable(f"the cluster's usage is in Redis, which did not answer ({str(exc) or 'timeout'}); "
                                  "each instance's own is in its budgets.store") from exc
            return records(found, per)
        if self.store is None:
            return records(book.rows(day_of(since)), per)
        await self.store.flush()
        return records(await asyncio.to_thread(self.store.store.rows, since), per)
