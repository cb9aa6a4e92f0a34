"""A cluster's limits as they stand, read from Redis for the metrics and the status page (never on a request's path).

With ``cluster:`` every limit's count is in Redis (``cluster_ledger.py``); this
instance's ledger holds none of them (only its share while Redis is away).
:class:`ClusterStandings` reads each limit of each named scope (a tenant named
under ``budgets.tenants``, its models, a group) in one pipelined round trip,
an ``HMGET`` per limit: bounded by the config, whatever the traffic. It reads
when ``/metrics`` or the status page is read, at most once per
:data:`READ_INTERVAL_S` however many scrapers and pages ask. The rows are the
core's :class:`~extproc.core.budgets.ledger.Standing`, computed as the core
computes them: a window drained to now (``meters.Window``), a period's use
plus what those in flight reserved.

**Redis away**: the read fails within ``cluster.redis_timeout_ms``; the last
rows read are kept and marked stale (the status page says so, the metrics
leave the per-scope series out), so this instance's own counts are never shown
as the cluster's.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable

from redis.exceptions import RedisError

from extproc.adapters.budgets.cluster_ledger import ClusterBudgets, scope_meters
from extproc.core.budgets.ledger import Standing
from extproc.core.budgets.limits import Plan
from extproc.core.budgets.meters import Window

log = logging.getLogger(__name__)

# At most one read per second: the status page polls, Prometheus scrapes, several of each.
READ_INTERVAL_S = 1.0


async def read(shared: ClusterBudgets, plan: Plan, now: float) -> list[Standing]:
    """Every limit of every named scope as Redis holds it ``now``; raises RedisError, OSError or TimeoutError."""
    day, month = shared.calendar.starts(now)
    found = [(scope, name, meter) for scope, limits in plan.named() for name, meter in scope_meters(scope, limits, day, month)]
    if not found:
        return []
    async with asyncio.timeout(shared.timeout_s):
        async with shared.client.pipeline(transaction=False) as pipe:
            for _, _, meter in found:
                pipe.hmget(f"{shared.prefix}:{meter.kind}:{meter.name}", "used", "at" if meter.kind == "w" else "reserved")
            replies = await pipe.execute()
    rows = []
    for (scope, name, meter), (used, other) in zip(found, replies, strict=True):
        if meter.kind == "w":
            rows.append(Standing.of_window(scope, name, Window(meter.limit, _number(used), _number(other, now)), now))
        else:
            rows.append(Standing.of_period(scope, name, meter.limit, _number(used) + _number(other), meter.end, now))
    rows.sort(key=lambda s: (s.scope.kind, s.scope.name, s.scope.model))
    return rows


def _number(value: bytes | None, default: float = 0.0) -> float:
    """A count as Redis keeps it (a missing key: ``default``); a value that is no number counts as ``default``."""
    try:
        number = float(value) if value is not None else default
    except ValueError:
        return default
    return number if math.isfinite(number) else default


class ClusterStandings:
    """The last rows read from Redis, whether the last read failed (``stale``), read again when asked and due."""

    def __init__(self, shared: ClusterBudgets, clock: Callable[[], float]) -> None:
        self._shared = shared
        self._clock = clock
        self.rows: list[Standing] = []
        self.stale = True  # nothing read yet
        self._tried = -math.inf  # monotonic time of the last read
        self._reading = asyncio.Lock()  # one read at a time: those who ask meanwhile get its rows

    async def refresh(self, plan: Plan) -> None:
        """Read the rows again, unless a read began less than :data:`READ_INTERVAL_S` ago (or is under way: its rows)."""
        async with self._reading:
            started = time.monotonic()
            if started - self._tried < READ_INTERVAL_S:
                return
            self._tried = started
            try:
                self.rows = await read(self._shared, plan, self._clock())
            except (RedisError, OSError, TimeoutError) as exc:
                if not self.stale:
                    log.warning("budgets: cannot read the cluster's limits from Redis (%s); shown as stale",
                                str(exc) or "timeout")
                self.stale = True
            else:
                self.stale = False
