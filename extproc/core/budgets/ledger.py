"""Tenant budgets: reserve at admission, correct at the end, refuse or downgrade over a limit. One owner of the counts.

A request's way through :class:`Budgets`:

1. **Admission** (:meth:`Budgets.admit`): it counts in every scope its tenant
   has limits in (the tenant, the tenant on this model, its groups). If each
   has room for what it may use, that is *reserved*: one request, its input
   tokens (estimated from its size, as the cost model does) and its output
   tokens (its ``max_tokens``, clamped to the model's context; without one,
   what the cost model expects: the tenant's average, else
   ``cost.default_output_tokens``), priced. Else the verdict names what is
   over (a rate, or a budget), when it has room again, and the tenant's
   action (``limits.Action``).
2. **The end** (:meth:`Budgets.settle`): the reservation is replaced by what
   the request used, priced: the engine's own count where its response
   reported one (the adapter reads it: ``request/engine_usage.py``), else
   its output tokens as the cost model measured them at the end (the
   engine's decode rate times its occupancy, capped by ``max_tokens``:
   ``core/cost.py``), its prompt as estimated, its cached prompt tokens
   (prefix signatures); the difference is given back (or, rarely, taken).
   The usage book (``book.py``) gets one more request.
3. **No service** (:meth:`Budgets.cancel`): a request that never reached the
   engine (its client left while it was queued, it was refused in the queue)
   or that was preempted before its response began is charged nothing, and its
   reservation is given back. A preempted request's retry is a new request,
   charged for the work the engine then does: the work is charged once.

**Over a limit**, by the tenant's action: ``refuse`` reserves nothing (the
client hears 429 with ``Retry-After``); ``downgrade`` serves the request in
the lowest class, counted in the day and month budgets and the book but not
in the per-minute windows (it runs on capacity nobody else wanted, and must
not push the tenant's next minute further out); ``report`` serves it as if
within, counted everywhere.

**Overshoot bound.** With ``refuse``, a limit is exceeded by at most what is in
flight, because each request is admitted only with room for its whole
reservation:

* a per-minute window, by the in-flight requests' output beyond their
  reservation: zero for requests that give ``max_tokens``, at most the
  context length each for those that do not (their reservation is an
  average); and by their prompts beyond the estimate from their size, where
  the engine counts more tokens than that (at most the context length each);
  plus, once per window, one request larger than the whole window, admitted
  only into an empty one;
* a day or month budget, by the same, plus the requests in flight when the
  period turns: their reservations belong to the period that ended, and what
  they use is counted in the new one when they end.

A request is counted in the period in which it ends.

Pure: every time is wall-clock seconds passed in (calendar periods need it;
``meters.py`` says how a clock jump is taken).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import StrEnum

from extproc.core.budgets.book import Book, Usage
from extproc.core.budgets.limits import Action, BudgetLimits, Kind, Plan, Scope
from extproc.core.budgets.meters import Calendar, Period, Window

# The limits a verdict can name, in the order they are checked (the message names the first over).
RATE_LIMITS = ("requests_per_minute", "input_tokens_per_minute", "output_tokens_per_minute")
BUDGET_LIMITS = ("tokens_per_day", "cost_per_day", "cost_per_month")


class Over(StrEnum):
    """Which kind of limit a request is over: OpenAI's two 429 codes."""

    RATE = "rate"  # a per-minute window: rate_limit_exceeded, room again within a minute
    BUDGET = "budget"  # a day or month budget: insufficient_quota, room again at the period's end


class Account:
    """One scope's counters under its limits: a window per per-minute limit, a period per budget."""

    __slots__ = ("scope", "limits", "requests", "input", "output", "day_tokens", "day_cost", "month_cost")

    def __init__(self, scope: Scope, limits: BudgetLimits) -> None:
        self.scope = scope
        self.limits = limits
        self.requests: Window | None = None
        self.input: Window | None = None
        self.output: Window | None = None
        self.day_tokens: Period | None = None
        self.day_cost: Period | None = None
        self.month_cost: Period | None = None

    def windows(self) -> Iterator[tuple[str, Window]]:
        for name, window in zip(RATE_LIMITS, (self.requests, self.input, self.output), strict=True):
            if window is not None:
                yield name, window

    def periods(self) -> Iterator[tuple[str, Period]]:
        for name, period in zip(BUDGET_LIMITS, (self.day_tokens, self.day_cost, self.month_cost), strict=True):
            if period is not None:
                yield name, period


@dataclass(slots=True)
class Ticket:
    """One admitted request's reservation, until it is settled or cancelled (once)."""

    tenant: str
    model: str
    accounts: tuple[Account, ...]
    reserved: Usage
    cost: float
    # Whether it took from the per-minute windows (not when downgraded).
    rated: bool
    # It was over a limit and served all the same (downgraded or reported).
    over: bool
    # The day and month its reservation is in.
    day: float
    month: float
    open: bool = True


@dataclass(frozen=True, slots=True)
class Verdict:
    """What :meth:`Budgets.admit` decided. ``over`` None: within every limit."""

    ticket: Ticket
    action: Action
    over: Over | None = None
    # Seconds until every limit it is over has room for it again.
    retry_after_s: float = 0.0
    # The first limit it is over, in words, for the client's message.
    reason: str = ""

    @property
    def refused(self) -> bool:
        return self.over is not None and self.action is Action.REFUSE

    @property
    def downgraded(self) -> bool:
        return self.over is not None and self.action is Action.DOWNGRADE


@dataclass(frozen=True, slots=True)
class RateView:
    """The tightest per-minute windows of a tenant on a model, as OpenAI's ``x-ratelimit-*`` headers say them.

    ``tokens`` is the tighter of the input and output windows (by what remains
    of each). None: no such limit.
    """

    requests: tuple[float, float, float] | None = None  # limit, remaining, seconds until empty
    tokens: tuple[float, float, float] | None = None


@dataclass(frozen=True, slots=True)
class Standing:
    """One scope's limit as it stands now: the status page's and the metrics' row."""

    scope: Scope
    limit: str
    value: float
    used: float
    remaining: float
    # When it has all of its room again (a window empty, a period over), in seconds.
    reset_s: float

    @classmethod
    def of_window(cls, scope: Scope, limit: str, window: Window, now: float) -> Standing:
        """A rate limit's row: its window drained to ``now`` (``used`` is now's, beyond the limit too)."""
        remaining = window.remaining(now)
        return cls(scope, limit, window.limit, window.used, remaining, window.reset_s(now))

    @classmethod
    def of_period(cls, scope: Scope, limit: str, value: float, counted: float, end: float, now: float) -> Standing:
        """A budget's row: what its period ending at ``end`` counts (used and reserved) against ``value``."""
        return cls(scope, limit, value, counted, max(0.0, value - counted), end - now)


@dataclass
class Budgets:
    """Every tenant's accounts under one plan, and the usage book; the one owner of both."""

    plan: Plan
    book: Book = field(default_factory=Book)
    _accounts: dict[Scope, Account] = field(default_factory=dict)
    _routes: dict[tuple[str, str], tuple[Account, ...]] = field(default_factory=dict)
    _calendar: Calendar = field(default_factory=Calendar)

    def reconfigure(self, plan: Plan, now: float) -> None:
        """New limits from now on (a reload): every count is kept, a new budget starts from the book's sums."""
        self.plan = plan
        self._routes.clear()
        for scope, account in list(self._accounts.items()):
            limits = plan.limits(scope)
            if limits.empty:
                del self._accounts[scope]
            else:
                self._limit(account, limits, now)

    def accounts(self, tenant: str, model: str, now: float) -> tuple[Account, ...]:
        """The accounts a request of ``tenant`` for ``model`` counts in (made on first use)."""
        route = self._routes.get((tenant, model))
        if route is None:
            found = []
            for scope, limits in self.plan.scopes(tenant, model):
                account = self._accounts.get(scope)
                if account is None:
                    account = self._accounts[scope] = Account(scope, limits)
                    self._limit(account, limits, now)
                found.append(account)
            route = self._routes[(tenant, model)] = tuple(found)
        return route

    def _limit(self, account: Account, limits: BudgetLimits, now: float) -> None:
        """``account`` under ``limits``: windows keep what they used, a new budget is the book's sum for its period."""
        account.limits = limits
        account.requests = _window(account.requests, limits.requests_per_minute, now)
        account.input = _window(account.input, limits.input_tokens_per_minute, now)
        account.output = _window(account.output, limits.output_tokens_per_minute, now)
        account.day_tokens = self._period(account, account.day_tokens, limits.tokens_per_day, False, True, now)
        account.day_cost = self._period(account, account.day_cost, limits.cost_per_day, False, False, now)
        account.month_cost = self._period(account, account.month_cost, limits.cost_per_month, True, False, now)

    def _period(self, account: Account, period: Period | None, limit: float | None, monthly: bool, tokens: bool,
                now: float) -> Period | None:
        if limit is None:
            return None
        if period is not None:
            return period
        day, month = self._calendar.starts(now)
        start = month if monthly else day
        scope = account.scope
        plan = self.plan
        members = scope.name if scope.kind is not Kind.GROUP else (lambda t: scope.name in plan.tenant(t).groups)
        used_tokens, used_cost = self.book.total(members, scope.model, start, now)
        return Period(monthly, start, used_tokens if tokens else used_cost)

    def admit(self, tenant: str, model: str, expected: Usage, now: float) -> Verdict:
        """Whether a request of ``tenant`` for ``model`` that may use ``expected`` fits its limits; reserves it if served."""
        plan = self.plan
        accounts = self.accounts(tenant, model, now)
        cost = plan.price(model).cost(expected.input_tokens, 0.0, expected.output_tokens)
        ticket = Ticket(tenant, model, accounts, expected, cost, True, False, *self._calendar.starts(now))
        action = plan.tenant(tenant).action
        if not accounts:
            return Verdict(ticket, action)
        over, wait, reason = _check(accounts, expected, cost, now)
        if over is None:
            _reserve(ticket, now)
            return Verdict(ticket, action)
        if action is Action.REFUSE:
            ticket.open = False
        else:
            ticket.over = True
            ticket.rated = action is Action.REPORT
            _reserve(ticket, now)
        return Verdict(ticket, action, over, wait, reason)

    def settle(self, ticket: Ticket, used: Usage, now: float) -> float:
        """The request ended having used ``used``: its reservation replaced by that, booked; returns its cost."""
        cost = self.plan.price(ticket.model).cost(used.input_tokens, used.cached_tokens, used.output_tokens)
        if not ticket.open:
            return cost
        ticket.open = False
        reserved = ticket.reserved
        for account in ticket.accounts:
            if ticket.rated:
                _take(account.input, used.input_tokens - reserved.input_tokens, now)
                _take(account.output, used.output_tokens - reserved.output_tokens, now)
            _settle(account.day_tokens, ticket.day, reserved.tokens, used.tokens, now)
            _settle(account.day_cost, ticket.day, ticket.cost, cost, now)
            _settle(account.month_cost, ticket.month, ticket.cost, cost, now)
        self.book.add(ticket.tenant, ticket.model, self._calendar.starts(now)[0], used, cost, over=ticket.over)
        return cost

    def cancel(self, ticket: Ticket, now: float) -> None:
        """The request was not served (its client left while queued, refused in the queue, preempted): charged nothing."""
        if not ticket.open:
            return
        ticket.open = False
        reserved = ticket.reserved
        for account in ticket.accounts:
            if ticket.rated:
                _take(account.requests, -1.0, now)
                _take(account.input, -reserved.input_tokens, now)
                _take(account.output, -reserved.output_tokens, now)
            _settle(account.day_tokens, ticket.day, reserved.tokens, 0.0, now)
            _settle(account.day_cost, ticket.day, ticket.cost, 0.0, now)
            _settle(account.month_cost, ticket.month, ticket.cost, 0.0, now)

    def view(self, tenant: str, model: str, now: float) -> RateView:
        """The tightest request and token windows of ``tenant`` on ``model`` now (OpenAI's rate headers)."""
        requests = tokens = None
        for account in self.accounts(tenant, model, now):
            for name, window in account.windows():
                seen = (window.limit, window.remaining(now), window.reset_s(now))
                if name == "requests_per_minute":
                    if requests is None or seen[1] / seen[0] < requests[1] / requests[0]:
                        requests = seen
                elif tokens is None or seen[1] / seen[0] < tokens[1] / tokens[0]:
                    tokens = seen
        return RateView(requests, tokens)

    def standings(self, now: float) -> Iterator[Standing]:
        """Every limit of every account made so far, and of every named scope (made now if no request made it: its
        periods count what the book holds, a restart's usage read back), as it stands ``now``."""
        for scope, limits in self.plan.named():
            if scope not in self._accounts and not limits.empty:
                self._limit(account := Account(scope, limits), limits, now)
                self._accounts[scope] = account
        for scope in sorted(self._accounts, key=lambda s: (s.kind, s.name, s.model)):
            account = self._accounts[scope]
            for name, window in account.windows():
                yield Standing.of_window(scope, name, window, now)
            for name, period in account.periods():
                period.roll(now)
                yield Standing.of_period(scope, name, getattr(account.limits, name), period.counted(), period.end, now)

    def calendar_day(self, now: float) -> float:
        """The start of the day ``now`` is in, as this ledger counts days (never back: ``meters.Calendar``)."""
        return self._calendar.starts(now)[0]


def _window(window: Window | None, limit: float | None, now: float) -> Window | None:
    if limit is None:
        return None
    if window is None:
        return Window(limit, 0.0, now)
    window.limit = limit
    return window


def _check(accounts: tuple[Account, ...], expected: Usage, cost: float, now: float) -> tuple[Over | None, float, str]:
    """The kind of limit ``expected`` is over in ``accounts`` (a budget before a rate), when all have room, the first."""
    over: Over | None = None
    wait = 0.0
    reason = ""
    amounts = (1.0, expected.input_tokens, expected.output_tokens)
    budgets = (expected.tokens, cost, cost)
    for account in accounts:
        for name, window, amount in zip(RATE_LIMITS, (account.requests, account.input, account.output), amounts,
                                        strict=True):
            if window is None:
                continue
            seconds = window.wait(amount, now)
            if seconds > 0:
                wait = max(wait, seconds)
                over = over or Over.RATE
                reason = reason or _reason(account, name)
        for name, period, amount in zip(BUDGET_LIMITS, (account.day_tokens, account.day_cost, account.month_cost),
                                        budgets, strict=True):
            if period is None:
                continue
            period.roll(now)
            if period.counted() + amount > getattr(account.limits, name):
                wait = max(wait, period.end - now)
                if over is not Over.BUDGET:
                    reason = _reason(account, name)
                over = Over.BUDGET
    return over, wait, reason


def _reason(account: Account, name: str) -> str:
    return over_reason(account.scope, name, getattr(account.limits, name))


def over_reason(scope: Scope, limit: str, value: float) -> str:
    """The refusal's words for ``scope`` over its ``limit`` of ``value`` (with a cluster, the same words)."""
    who = {Kind.TENANT: f"tenant {scope.name!r}", Kind.TENANT_MODEL: f"tenant {scope.name!r} on model {scope.model!r}",
           Kind.GROUP: f"group {scope.name!r}"}[scope.kind]
    return f"{who} is over its {limit.replace('_', ' ')} ({value:g})"


def _reserve(ticket: Ticket, now: float) -> None:
    expected = ticket.reserved
    for account in ticket.accounts:
        if ticket.rated:
            _take(account.requests, 1.0, now)
            _take(account.input, expected.input_tokens, now)
            _take(account.output, expected.output_tokens, now)
        for period, amount in ((account.day_tokens, expected.tokens), (account.day_cost, ticket.cost),
                               (account.month_cost, ticket.cost)):
            if period is not None:
                period.roll(now)
                period.reserved += amount


def _take(window: Window | None, amount: float, now: float) -> None:
    if window is not None and amount:
        window.add(amount, now)


def _settle(period: Period | None, start: float, reserved: float, used: float, now: float) -> None:
    """``reserved`` (made in the period from ``start``) replaced by ``used``, counted in the period ``now`` is in."""
    if period is None:
        return
    period.roll(now)
    if period.start == start:
        period.reserved = max(0.0, period.reserved - reserved)
    period.used += used
