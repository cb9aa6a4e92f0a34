"""The budgets core (extproc/core/budgets): windows, periods, reservation and correction, in simulated time.

The properties check the accounting invariants whatever the sequence of
admissions, ends and cancellations: counts go back to what was used, a
cancelled request costs nothing, a limit is never passed by more than what is
in flight, a reload keeps every count, and a book restored after a restart
gives the same budgets. The examples pin down the semantics docs/budgets.md
states: bucket refill, exact calendar resets, Retry-After, clock jumps, the
2 % target at a token rate limit over five minutes.
"""

from __future__ import annotations

import calendar
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.core.budgets.book import Book, Usage
from extproc.core.budgets.ledger import Budgets, Over, Ticket
from extproc.core.budgets.limits import Action, BudgetLimits, Kind, Plan, Prices, Scope, TenantPlan
from extproc.core.budgets.meters import DAY_S, day_start, month_start, next_month
from tests.propertyutil import examples

pytestmark = pytest.mark.unit

# 2026-12-03 12:00:00 UTC.
NOON = float(calendar.timegm((2026, 12, 3, 12, 0, 0)))
PRICES = {"m": Prices(input=1.0, cached_input=0.1, output=2.0)}


def budgets(limits: BudgetLimits, action: Action = Action.REFUSE, **plan: object) -> Budgets:
    return Budgets(Plan(default=TenantPlan(action, limits), prices=PRICES, **plan))  # type: ignore[arg-type]


def test_calendar_periods_start_and_end_at_utc_midnight() -> None:
    assert day_start(NOON) == float(calendar.timegm((2026, 12, 3, 0, 0, 0)))
    assert month_start(NOON) == float(calendar.timegm((2026, 12, 1, 0, 0, 0)))
    assert next_month(month_start(NOON)) == float(calendar.timegm((2027, 1, 1, 0, 0, 0)))
    feb = float(calendar.timegm((2028, 2, 29, 23, 59, 59)))
    assert next_month(month_start(feb)) == float(calendar.timegm((2028, 3, 1, 0, 0, 0)))


def test_a_request_window_refills_continuously_and_says_when() -> None:
    b = budgets(BudgetLimits(requests_per_minute=60))
    for _ in range(60):
        assert b.admit("a", "m", Usage(10, 0, 10), NOON).over is None
    verdict = b.admit("a", "m", Usage(10, 0, 10), NOON)
    assert verdict.over is Over.RATE and verdict.refused
    assert verdict.retry_after_s == pytest.approx(1.0)
    assert "requests per minute (60)" in verdict.reason
    assert b.admit("a", "m", Usage(10, 0, 10), NOON + 0.99).over is Over.RATE
    assert b.admit("a", "m", Usage(10, 0, 10), NOON + 1.0).over is None
    view = b.view("a", "m", NOON + 1.0)
    assert view.requests is not None and view.tokens is None
    assert view.requests[:2] == (60, 0) and view.requests[2] == pytest.approx(60.0)


def test_a_refused_request_reserves_nothing_and_other_tenants_have_their_own_window() -> None:
    b = budgets(BudgetLimits(output_tokens_per_minute=1000))
    assert b.admit("a", "m", Usage(1, 0, 1000), NOON).over is None
    refused = b.admit("a", "m", Usage(1, 0, 500), NOON)
    assert refused.refused and refused.retry_after_s == pytest.approx(30.0)
    b.settle(refused.ticket, Usage(1, 0, 500), NOON)  # the adapter never does; a closed ticket is a no-op
    assert b.admit("b", "m", Usage(1, 0, 1000), NOON).over is None  # `default`: each tenant its own counters
    assert b.admit("a", "m", Usage(1, 0, 500), NOON + 30).over is None


def test_the_end_gives_back_what_was_reserved_and_not_used() -> None:
    b = budgets(BudgetLimits(output_tokens_per_minute=1000))
    first = b.admit("a", "m", Usage(100, 0, 800), NOON)
    assert b.admit("a", "m", Usage(100, 0, 800), NOON).over is Over.RATE
    b.settle(first.ticket, Usage(100, 0, 50), NOON)
    assert b.admit("a", "m", Usage(100, 0, 800), NOON).over is None


def test_a_request_larger_than_the_whole_window_needs_an_empty_one() -> None:
    b = budgets(BudgetLimits(output_tokens_per_minute=1000))
    assert b.admit("a", "m", Usage(1, 0, 32_768), NOON).over is None  # absurd max_tokens, clamped to the context
    verdict = b.admit("a", "m", Usage(1, 0, 32_768), NOON)
    assert verdict.over is Over.RATE and verdict.retry_after_s == pytest.approx(32.768 * 60)


def test_a_day_budget_resets_exactly_at_midnight_utc_and_retry_after_says_so() -> None:
    b = budgets(BudgetLimits(tokens_per_day=1000))
    ticket = b.admit("a", "m", Usage(400, 0, 500), NOON).ticket
    b.settle(ticket, Usage(400, 0, 500), NOON + 1)
    verdict = b.admit("a", "m", Usage(100, 0, 100), NOON + 2)
    midnight = day_start(NOON) + DAY_S
    assert verdict.over is Over.BUDGET and verdict.retry_after_s == pytest.approx(midnight - NOON - 2)
    assert b.admit("a", "m", Usage(100, 0, 100), midnight - 0.001).over is Over.BUDGET
    assert b.admit("a", "m", Usage(100, 0, 100), midnight).over is None


def test_money_is_priced_per_million_and_cached_input_is_cheaper() -> None:
    b = budgets(BudgetLimits(cost_per_month=0.0035))
    ticket = b.admit("a", "m", Usage(1000, 0, 500), NOON).ticket  # reserved: 1000 x 1 + 500 x 2 per million
    assert ticket.cost == pytest.approx(0.002)
    assert b.settle(ticket, Usage(1000, 800, 500), NOON) == pytest.approx((200 + 80 + 1000) / 1e6)
    assert b.admit("a", "m", Usage(1000, 0, 500), NOON).over is None  # 0.00128 + 0.002 reserved <= 0.0035
    assert b.admit("a", "m", Usage(100, 0, 100), NOON).over is Over.BUDGET


def test_a_budget_over_is_insufficient_quota_before_a_rate() -> None:
    b = budgets(BudgetLimits(requests_per_minute=1, tokens_per_day=10))
    b.settle(b.admit("a", "m", Usage(5, 0, 5), NOON).ticket, Usage(5, 0, 5), NOON)
    verdict = b.admit("a", "m", Usage(5, 0, 5), NOON)
    assert verdict.over is Over.BUDGET and "tokens per day" in verdict.reason


def test_cancel_gives_everything_back() -> None:
    b = budgets(BudgetLimits(requests_per_minute=1, output_tokens_per_minute=100, tokens_per_day=200, cost_per_day=1.0))
    before = list(b.standings(NOON))
    ticket = b.admit("a", "m", Usage(50, 0, 100), NOON).ticket
    assert list(b.standings(NOON)) != before
    b.cancel(ticket, NOON)
    b.cancel(ticket, NOON)  # once
    assert [s.used for s in b.standings(NOON)] == [0.0] * 4
    assert list(b.book.rows()) == []  # nothing booked


def test_downgrade_serves_over_the_limit_counted_in_the_budget_not_the_window() -> None:
    b = budgets(BudgetLimits(requests_per_minute=1, tokens_per_day=1_000_000), Action.DOWNGRADE)
    assert not b.admit("a", "m", Usage(1, 0, 1), NOON).downgraded
    verdict = b.admit("a", "m", Usage(1, 0, 1), NOON)
    assert verdict.downgraded and not verdict.refused and verdict.ticket.open
    b.settle(verdict.ticket, Usage(10, 0, 20), NOON)
    (_, row), = b.book.rows()
    assert (row.requests, row.over, row.tokens) == (1, 1, 30)
    standing = {s.limit: s for s in b.standings(NOON)}
    assert standing["requests_per_minute"].used == 1  # the downgraded one did not take from the window
    assert standing["tokens_per_day"].used == 32  # 30 used + the first one's 2 reserved


def test_groups_and_models_count_beside_the_tenant() -> None:
    plan = Plan(tenants={"a": TenantPlan(models={"m": BudgetLimits(requests_per_minute=5)}, groups=("g",)),
                         "b": TenantPlan(groups=("g",))},
                groups={"g": BudgetLimits(requests_per_minute=3)}, prices=PRICES)
    b = Budgets(plan)
    assert [a.scope for a in b.accounts("a", "m", NOON)] == [Scope(Kind.TENANT_MODEL, "a", "m"), Scope(Kind.GROUP, "g")]
    for tenant in ("a", "b", "a"):
        assert b.admit(tenant, "m", Usage(1, 0, 1), NOON).over is None
    verdict = b.admit("b", "other-model", Usage(1, 0, 1), NOON)
    assert verdict.over is Over.RATE and "group 'g'" in verdict.reason
    assert b.admit("c", "m", Usage(1, 0, 1), NOON).over is None  # no limits at all


def test_a_reload_keeps_every_count_and_a_new_budget_starts_from_the_book() -> None:
    b = budgets(BudgetLimits(requests_per_minute=2))
    b.settle(b.admit("a", "m", Usage(100, 0, 100), NOON).ticket, Usage(100, 0, 100), NOON)
    b.reconfigure(Plan(default=TenantPlan(limits=BudgetLimits(requests_per_minute=3, tokens_per_day=250)), prices=PRICES),
                  NOON)
    standing = {s.limit: s.used for s in b.standings(NOON)}
    assert standing == {"requests_per_minute": 1, "tokens_per_day": 200}
    assert b.admit("a", "m", Usage(25, 0, 25), NOON).over is None
    assert b.admit("a", "m", Usage(1, 0, 1), NOON).over is Over.BUDGET


def test_a_restart_in_the_middle_of_a_day_budget_starts_from_the_stored_book() -> None:
    b = budgets(BudgetLimits(tokens_per_day=1000, cost_per_month=1.0))
    b.settle(b.admit("a", "m", Usage(300, 0, 300), NOON).ticket, Usage(300, 0, 300), NOON)
    b.book.add("a", "m", day_start(NOON) - DAY_S, Usage(100, 0, 0), 100 / 1e6)  # yesterday
    stored = b.book.take_dirty()
    again = budgets(BudgetLimits(tokens_per_day=1000, cost_per_month=1.0))
    again.book.load(stored)
    assert {s.limit: s.used for s in again.standings(NOON)} == {}  # accounts are made on first use
    again.accounts("a", "m", NOON)
    used = {s.limit: s.used for s in again.standings(NOON)}
    assert used == {"tokens_per_day": 600, "cost_per_month": pytest.approx((300 + 600 + 100) / 1e6)}
    assert again.admit("a", "m", Usage(200, 0, 201), NOON).over is Over.BUDGET


def test_a_clock_set_back_neither_refills_a_window_nor_resets_a_day() -> None:
    b = budgets(BudgetLimits(requests_per_minute=1, tokens_per_day=10))
    b.settle(b.admit("a", "m", Usage(5, 0, 5), NOON).ticket, Usage(5, 0, 5), NOON)
    back = NOON - DAY_S  # an hour's NTP step is rarer; a day back crosses midnight
    assert b.admit("a", "m", Usage(1, 0, 1), back).over is Over.BUDGET
    assert b.admit("a", "m", Usage(1, 0, 1), back + 59).over is Over.BUDGET
    forward = NOON + 10 * DAY_S
    assert b.admit("a", "m", Usage(1, 0, 1), forward).over is None  # a jump forward: a new day, a full window


def test_a_tenant_at_its_token_rate_gets_within_two_percent_of_it_over_five_minutes() -> None:
    """A closed-loop client sends as fast as it is let in; each request uses what it reserved, or less."""
    limit = 20_000.0
    b = budgets(BudgetLimits(output_tokens_per_minute=limit))
    now, served, step = NOON, 0.0, 0.05
    running: list[tuple[float, Ticket, float]] = []
    # It has been at its limit before the five minutes start: the bucket is full.
    b.admit("a", "m", Usage(1, 0, limit), now)
    end = now + 300
    while now < end:
        for ends_at, ticket, used in [r for r in running if r[0] <= now]:
            b.settle(ticket, Usage(50, 0, used), ends_at)
            running.remove((ends_at, ticket, used))
        verdict = b.admit("a", "m", Usage(50, 0, 500), now)
        if verdict.over is None:
            used = 500 if len(running) % 3 else 350  # some stop before max_tokens: their rest comes back
            running.append((now + 2.0, verdict.ticket, used))
            served += used
        else:
            now += step
    expected = limit * 5
    assert abs(served - expected) / expected < 0.02, served  # measured: -0.15 %


TENANTS = st.sampled_from(["a", "b", "c"])
STEPS = st.lists(st.tuples(st.sampled_from(["admit", "settle", "cancel", "wait"]), TENANTS,
                           st.floats(0, 3000), st.floats(0, 3000), st.floats(0, 1.0)), max_size=60)
LIMITS = BudgetLimits(requests_per_minute=20, input_tokens_per_minute=5000, output_tokens_per_minute=8000,
                tokens_per_day=40_000, cost_per_day=0.05, cost_per_month=0.5)


@settings(max_examples=examples(200), deadline=None)
@given(STEPS, st.sampled_from(list(Action)))
def test_counts_are_what_was_used_once_every_request_ended(steps: list[tuple[str, str, float, float, float]],
                                                           action: Action) -> None:
    """Whatever admits, ends and cancels happen: the budgets end at what was used, nothing reserved; the book agrees."""
    b = Budgets(Plan(default=TenantPlan(action, LIMITS), prices=PRICES))
    now, open_, used = NOON, [], {"a": 0.0, "b": 0.0, "c": 0.0}
    for kind, tenant, tokens_in, tokens_out, share in steps:
        if kind == "admit":
            verdict = b.admit(tenant, "m", Usage(tokens_in, 0, tokens_out), now)
            if not verdict.refused:
                open_.append((tenant, verdict.ticket))
        elif kind in ("settle", "cancel") and open_:
            owner, ticket = open_.pop(int(share * (len(open_) - 1)))
            if kind == "settle":
                real = Usage(ticket.reserved.input_tokens, 0, ticket.reserved.output_tokens * share)
                b.settle(ticket, real, now)
                used[owner] += real.tokens
            else:
                b.cancel(ticket, now)
        else:
            now += share * 100
    for _, ticket in open_:
        b.cancel(ticket, now)
    day = {s.scope.name: s for s in b.standings(now) if s.limit == "tokens_per_day"}
    for tenant, standing in day.items():
        booked = sum(row.tokens for (t, _, _), row in b.book.rows() if t == tenant)
        assert standing.used == pytest.approx(used[tenant], abs=1e-6) == pytest.approx(booked, abs=1e-6)


@settings(max_examples=examples(200), deadline=None)
@given(st.lists(st.tuples(TENANTS, st.floats(1, 20_000), st.floats(0, 1)), max_size=80))
def test_with_refuse_a_budget_is_never_passed_when_requests_use_at_most_their_reservation(
        requests: list[tuple[str, float, float]]) -> None:
    """Concurrent requests, all in flight at once, then ending: the day's count never passes the limit."""
    b = budgets(BudgetLimits(tokens_per_day=50_000, output_tokens_per_minute=30_000))
    tickets = []
    for tenant, tokens, _ in requests:
        verdict = b.admit(tenant, "m", Usage(tokens / 4, 0, tokens), NOON)
        if not verdict.refused:
            tickets.append(verdict.ticket)
        for s in b.standings(NOON):
            assert s.used <= s.value + 1e-6
    for ticket, (_, _, share) in zip(tickets, requests, strict=False):
        b.settle(ticket, Usage(ticket.reserved.input_tokens, 0, ticket.reserved.output_tokens * share), NOON)
        for s in b.standings(NOON):
            assert s.used <= s.value + 1e-6


@settings(max_examples=examples(100), deadline=None)
@given(st.lists(st.floats(allow_nan=True, allow_infinity=True), min_size=6, max_size=6))
def test_hostile_counts_never_poison_a_budget(values: list[float]) -> None:
    b = budgets(LIMITS)
    verdict = b.admit("a", "m", Usage(*values[:3]), NOON)
    if not verdict.refused:
        b.settle(verdict.ticket, Usage(*values[3:]), NOON)
    for s in b.standings(NOON):
        assert math.isfinite(s.used) and s.used >= 0
    assert all(math.isfinite(v) for _, row in b.book.rows() for v in row.values())


def test_the_book_keeps_its_dirty_rows_until_taken_and_drops_only_clean_old_ones() -> None:
    book = Book()
    book.add("a", "m", day_start(NOON) - DAY_S, Usage(1, 0, 2), 0.5)
    book.add("a", "m", day_start(NOON), Usage(1, 0, 2), 0.5)
    book.drop_before(day_start(NOON))
    assert len(list(book.rows())) == 2  # not yet stored
    assert [key for key, _ in book.take_dirty()] == [("a", "m", "2026-12-02"), ("a", "m", "2026-12-03")]
    book.drop_before(day_start(NOON))
    assert [key for key, _ in book.rows()] == [("a", "m", "2026-12-03")]
