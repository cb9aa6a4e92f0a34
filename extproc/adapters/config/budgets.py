"""The ``budgets:`` section: tenant limits and prices as written, checked, and resolved into the core's plan.

Beside ``tenants:`` (who may use which class, at what weight) rather than in
it: a budget is about how much, it has its own groups and the models' prices,
and an operator reads one section to see every limit. It reads as
``tenants:`` does: a tenant's entry inherits every field it does not set from
the ``default`` entry, and each tenant has its own counters::

    budgets:
      store: /var/lib/extproc/usage.sqlite    # day and month budgets survive a restart
      prices:                                 # per million tokens
        llama-70b: {input: 0.60, cached_input: 0.06, output: 2.40}
      groups:
        evaluation: {cost_per_month: 300}
      tenants:
        default: {requests_per_minute: 600, output_tokens_per_minute: 200000}
        team-x:
          action: downgrade
          models:
            llama-70b: {output_tokens_per_minute: 50000}

The structs are checked by validate.py as every section is; the rules here
run from rules.py's table. adapters/budgets/plan.py resolves the section into
the core's :class:`~extproc.core.budgets.limits.Plan` where budgets are on
(docs/budgets.md), so a config without them loads nothing of the budgets.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

import msgspec

from extproc.adapters.config.validate import Problems
from extproc.adapters.config.values import NonEmpty, NonNegative, Positive

# The entry every other tenant inherits from (as in `tenants:`).
DEFAULT_KEY = "default"


class _Entry(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A mapping in the section: typed fields, unknown keys refused (as schema.py's sections)."""


class LimitSettings(_Entry, frozen=True):
    """One scope's limits as written, named as :class:`~extproc.core.budgets.limits.BudgetLimits`' fields; unset:
    none, or inherited."""

    requests_per_minute: Positive | None = None
    input_tokens_per_minute: Positive | None = None
    output_tokens_per_minute: Positive | None = None
    tokens_per_day: Positive | None = None
    cost_per_day: NonNegative | None = None
    cost_per_month: NonNegative | None = None

class TenantBudget(LimitSettings, frozen=True):
    """A tenant's limits on all its models, per model, its groups and its action over any of them."""

    # refuse: 429 with Retry-After; downgrade: served in the lowest class (idle capacity); report: only counted.
    action: Literal["refuse", "downgrade", "report"] | None = None
    # The groups (budgets.groups) whose shared limits it also counts in.
    groups: tuple[NonEmpty, ...] | None = None
    # Limits of this tenant on one model (by its configured name), beside those on all its models.
    models: dict[str, LimitSettings] = msgspec.field(default_factory=dict)


class PriceSettings(_Entry, frozen=True):
    """A model's prices per million tokens; a cached prompt token (the engine's prefix cache) costs ``cached_input``."""

    input: NonNegative = 0.0
    cached_input: NonNegative | None = None  # unset: the input price
    output: NonNegative = 0.0

class BudgetSettings(_Entry, frozen=True):
    """Tenant budgets: limits per tenant (``default`` for every other), per tenant and model, per group; prices."""

    tenants: dict[str, TenantBudget] = msgspec.field(default_factory=dict)
    groups: dict[str, LimitSettings] = msgspec.field(default_factory=dict)
    # By model name (as in models[].name).
    prices: dict[str, PriceSettings] = msgspec.field(default_factory=dict)
    # An SQLite file that keeps the usage book (a single instance's day and month budgets across restarts);
    # unset: in memory only.
    store: NonEmpty | None = None
    # How often the store is written (write-behind: never on a request's path).
    store_interval_s: Positive = 5.0
    # OpenAI's x-ratelimit-* headers on released requests' responses (refusals always carry them).
    rate_headers: bool = True
    # A stream whose client asked for its usage (stream_options.include_usage) is read chunk by chunk for it, at
    # some processor CPU per chunk; false: such a stream is charged the cost model's estimate, as any other stream.
    stream_usage: bool = True


def price_problems(price: PriceSettings) -> Problems:
    if price.cached_input is not None and price.cached_input > price.input:
        yield "cached_input", f"must not exceed input ({price.input:g}): a cached prompt token costs less, not more"


def budget_problems(budgets: BudgetSettings, models: Iterable[str]) -> Problems:
    """Names the section uses exist (groups, models), and a money budget has prices to count in. Keys below ``budgets``."""
    known = set(models)
    for name in budgets.prices:
        if name not in known:
            yield f"prices.{name}", f"no model {name!r} in models (one of: {', '.join(sorted(known))})"
    costs = []
    for tenant, entry in budgets.tenants.items():
        for i, group in enumerate(entry.groups or ()):
            if group not in budgets.groups:
                yield f"tenants.{tenant}.groups[{i}]", f"no group {group!r} in budgets.groups"
        for model, limits in entry.models.items():
            if model not in known:
                yield f"tenants.{tenant}.models.{model}", f"no model {model!r} in models"
            costs += [f"tenants.{tenant}.models.{model}"] if _costs(limits) else []
        costs += [f"tenants.{tenant}"] if _costs(entry) else []
    costs += [f"groups.{name}" for name, limits in budgets.groups.items() if _costs(limits)]
    if costs and not any(p.input or p.output or p.cached_input for p in budgets.prices.values()):
        yield costs[0], "a money budget needs prices (budgets.prices): without them every request costs 0"


def _costs(limits: LimitSettings) -> bool:
    return limits.cost_per_day is not None or limits.cost_per_month is not None
