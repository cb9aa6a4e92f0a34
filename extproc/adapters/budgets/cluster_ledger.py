"""A cluster's budgets (``cluster:``): every instance counts in the same Redis keys, one round trip per decision.

With ``cluster:`` the windows and periods live in Redis (``budgets.lua``):
an admission is one ``EVALSHA`` that checks every meter of the request (each
limit of each scope it counts in) and reserves all of them or none, atomic,
so N instances enforce one limit, not N. The end is one more (the correction:
what was reserved replaced by what was used, and the request's charge added to
the cluster's usage book, ``cluster_usage.py``), sent without waiting for it.
The semantics are the core's (``core/budgets``): the same windows, periods,
reservation and actions; only where the counts live differs.

**Redis away** (an error, or slower than ``cluster.redis_timeout_ms``): the
instance decides on its own counts (the core's ledger), each limit divided by
the instances last seen live (at least ``cluster.instances``' count), as the
cluster shares an engine's capacity. A request decided so is corrected there
too, and its charge still sent to the cluster's usage book (:meth:`ClusterBudgets.record`).
Each instance keeps its own book (and store) either way.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from importlib.resources import files
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from extproc.core.budgets.book import Usage
from extproc.core.budgets.ledger import BUDGET_LIMITS, RATE_LIMITS, Over, RateView
from extproc.core.budgets.limits import BudgetLimits, Plan, Scope, TenantPlan
from extproc.core.budgets.meters import Calendar, next_month

log = logging.getLogger(__name__)

SCRIPT = files("extproc.adapters.budgets").joinpath("budgets.lua").read_text()
DAY_S = 86_400.0


@dataclass(frozen=True, slots=True)
class Meter:
    """One limit of one scope as Redis keeps it: window (w) or period (p), its limit, what it counts."""

    # The scope and the limit's name; a period's key adds its start.
    base: str
    kind: str
    limit: float
    # Which of a request's amounts it counts: requests, input, output, tokens, cost.
    counts: str
    # Whose limit, and which (a refusal names it).
    scope: Scope
    limit_name: str
    monthly: bool = False
    # A period's start and end (epoch seconds): its key, its Retry-After and its key's expiry; 0 for a window.
    start: float = 0.0
    end: float = 0.0

    @property
    def name(self) -> str:
        return self.base if self.kind == "w" else f"{self.base}:{self.start:.0f}"


@dataclass(slots=True)
class ClusterTicket:
    """A request's reservation in Redis: the meters and amounts, until corrected once."""

    meters: tuple[Meter, ...]
    amounts: tuple[float, ...]
    rated: bool
    open: bool = True


def _key(scope: Scope) -> str:
    return f"{scope.kind.value}:{scope.name}:{scope.model}"


COUNTS = {"requests_per_minute": "requests", "input_tokens_per_minute": "input", "output_tokens_per_minute": "output",
          "tokens_per_day": "tokens", "cost_per_day": "cost", "cost_per_month": "cost"}


def meters(plan: Plan, tenant: str, model: str, now: float, calendar: Calendar) -> tuple[Meter, ...]:
    """Every meter a request of ``tenant`` for ``model`` counts in, with the period keys of ``now``'s day and month."""
    day, month = calendar.starts(now)
    return tuple(meter for scope, limits in plan.scopes(tenant, model)
                 for _, meter in scope_meters(scope, limits, day, month))


def scope_meters(scope: Scope, limits: BudgetLimits, day: float, month: float) -> list[tuple[str, Meter]]:
    """Each limit of ``scope`` and its meter, the periods' those of the day and month starting at ``day``, ``month``."""
    found = []
    for name in RATE_LIMITS:
        limit = getattr(limits, name)
        if limit is not None:
            found.append((name, Meter(f"{_key(scope)}:{name}", "w", limit, COUNTS[name], scope, name)))
    for name in BUDGET_LIMITS:
        limit = getattr(limits, name)
        if limit is not None:
            monthly = name == "cost_per_month"
            start, end = (month, next_month(month)) if monthly else (day, day + DAY_S)
            found.append((name, Meter(f"{_key(scope)}:{name}", "p", limit, COUNTS[name], scope, name, monthly, start,
                                      end)))
    return found


def amounts(found: tuple[Meter, ...], usage: Usage, cost: float) -> tuple[float, ...]:
    each = {"requests": 1.0, "input": usage.input_tokens, "output": usage.output_tokens, "tokens": usage.tokens,
            "cost": cost}
    return tuple(each[m.counts] for m in found)


def view(found: tuple[Meter, ...], used: tuple[float, ...]) -> RateView:
    """The tightest request and token windows among ``found``, ``used`` as Redis answered (OpenAI's rate headers)."""
    requests = tokens = None
    for meter, spent in zip(found, used, strict=False):
        if meter.kind != "w":
            continue
        seen = (meter.limit, max(0.0, meter.limit - spent), max(0.0, spent) * 60 / meter.limit)
        if meter.counts == "requests":
            if requests is None or seen[1] / seen[0] < requests[1] / requests[0]:
                requests = seen
        elif tokens is None or seen[1] / seen[0] < tokens[1] / tokens[0]:
            tokens = seen
    return RateView(requests, tokens)


def share(plan: Plan, instances: int) -> Plan:
    """``plan`` with every limit divided by ``instances``: one instance's share while Redis is away."""
    if instances <= 1:
        return plan

    def part(limits: BudgetLimits) -> BudgetLimits:
        return replace(limits, **{f.name: getattr(limits, f.name) / instances
                                  for f in fields(BudgetLimits) if getattr(limits, f.name) is not None})

    def tenant(entry: TenantPlan) -> TenantPlan:
        return replace(entry, limits=part(entry.limits), models={m: part(lim) for m, lim in entry.models.items()})

    return replace(plan, tenants={n: tenant(t) for n, t in plan.tenants.items()}, default=tenant(plan.default),
                   groups={n: part(g) for n, g in plan.groups.items()})


@dataclass(frozen=True, slots=True)
class SharedVerdict:
    """Redis's answer: ``over`` None with ``used`` (per meter, after the reservation), or over with ``wait`` (and
    ``used`` before) and the meter the refusal names (``at``, an index)."""

    over: Over | None
    wait: float = 0.0
    used: tuple[float, ...] = ()
    at: int = 0


class ClusterBudgets:
    """The Redis side: one script call per decision and per correction; raises on Redis trouble (the gate falls back)."""

    def __init__(self, client: aioredis.Redis, key_prefix: str, timeout_s: float, instances: Callable[[], int]) -> None:
        self.client = client
        self._script = client.register_script(SCRIPT)
        self.prefix = f"{key_prefix}:budget"
        self.timeout_s = timeout_s
        self.instances = instances
        self.calendar = Calendar()
        self._corrections: set[asyncio.Task[None]] = set()
        self._lost = False  # the last correction did not reach Redis (warned once until one does)

    @property
    def corrections_in_flight(self) -> int:
        """Corrections sent to Redis and not answered yet: a Redis that falls behind shows here first."""
        return len(self._corrections)

    async def _call(self, payload: dict[str, Any]) -> Any:
        async with asyncio.timeout(self.timeout_s):
            reply = await self._script(keys=[self.prefix], args=[json.dumps(payload)])
        return json.loads(reply)

    async def admit(self, found: tuple[Meter, ...], reserve: tuple[float, ...], now: float, *,
                    check: bool = True) -> SharedVerdict:
        """Check and reserve ``reserve`` on every meter, or none; ``check=False``: reserve whatever the limits.

        Raises RedisError, OSError or TimeoutError when Redis does not answer in time.
        """
        answer = await self._call({"op": "admit" if check else "take", "now": now, "meters": [
            [m.name, m.kind, m.limit, amount, max(0.0, m.end - now)] for m, amount in zip(found, reserve, strict=True)]})
        used = tuple(answer["used"] or ())  # cjson writes an empty list as an object
        if answer["ok"]:
            return SharedVerdict(None, used=used)
        return SharedVerdict(Over(answer["over"]), answer["wait"], used, answer["at"] - 1)

    def correct(self, ticket: ClusterTicket, used: tuple[float, ...] | None, now: float,
                charged: dict[str, Any] | None = None) -> None:
        """Replace ``ticket``'s reservation by ``used`` (None: nothing, the request was not served), in a task.

        ``charged``: the request's charge for the cluster's usage book (``cluster_usage.charge``), in the same call.
        """
        if not ticket.open:
            return
        ticket.open = False
        rows: list[list[Any]] = []
        day, month = self.calendar.starts(now)
        for meter, reserved, spent in zip(ticket.meters, ticket.amounts, used or (0.0,) * len(ticket.meters), strict=True):
            if meter.kind == "w":
                if ticket.rated and spent != reserved:
                    rows.append([meter.name, "w", meter.limit, spent - reserved, 0.0, 0.0])
                continue
            rows.append([meter.name, "p", meter.limit, 0.0, -reserved, max(0.0, meter.end - now)])
            if spent:  # counted in the period it ends in
                start = month if meter.monthly else day
                end = next_month(start) if meter.monthly else start + DAY_S
                rows.append([f"{meter.base}:{start:.0f}", "p", meter.limit, spent, 0.0, max(0.0, end - now)])
        if rows or charged is not None:
            self._send({"op": "correct", "now": now, "meters": rows, **({} if charged is None else {"usage": charged})})

    def record(self, charged: dict[str, Any], now: float) -> None:
        """Add a charge to the cluster's usage book alone (a request decided on this instance's share), in a task."""
        self._send({"op": "correct", "now": now, "meters": [], "usage": charged})

    def _send(self, payload: dict[str, Any]) -> None:
        task = asyncio.get_running_loop().create_task(self._correct(payload))
        self._corrections.add(task)
        task.add_done_callback(self._corrections.discard)

    async def _correct(self, payload: dict[str, Any]) -> None:
        try:
            await self._call(payload)
        except (RedisError, OSError, TimeoutError) as exc:
            # Windows drain by themselves; a period keeps the reservation until it ends: counted high, never low.
            # The charge is in this instance's book only (cluster_usage.py). Said once per outage: every end fails.
            if not self._lost:
                self._lost = True
                log.warning("budgets: a correction did not reach Redis (%s); its reservation stands, its usage "
                            "is in this instance's book only", exc)
        else:
            self._lost = False
