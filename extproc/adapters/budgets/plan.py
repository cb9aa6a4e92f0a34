"""The ``budgets:`` section (config/budgets.py) resolved into the core's plan: each tenant's entry over ``default``'s.

Here rather than beside the section's structs, so that reading a config loads
nothing of the budgets (core/budgets/ included) until the gate is built.
"""

from __future__ import annotations

from dataclasses import fields, replace

from extproc.adapters.config.budgets import DEFAULT_KEY, BudgetSettings, LimitSettings, PriceSettings, TenantBudget
from extproc.core.budgets.limits import Action, BudgetLimits, Plan, Prices, TenantPlan


def _written(settings: LimitSettings) -> dict[str, float]:
    """The limits ``settings`` sets, by :class:`BudgetLimits`' field names (which its fields are named as)."""
    return {f.name: getattr(settings, f.name) for f in fields(BudgetLimits) if getattr(settings, f.name) is not None}


def _limits(written: LimitSettings | None, base: BudgetLimits) -> BudgetLimits:
    return base if written is None else replace(base, **_written(written))


def _tenant(written: TenantBudget, base: TenantPlan) -> TenantPlan:
    """``written`` over ``base`` field by field; per model, over ``base``'s limits for that model."""
    models = {**base.models, **{name: _limits(limits, base.models.get(name, BudgetLimits()))
                                for name, limits in written.models.items()}}
    return TenantPlan(
        action=base.action if written.action is None else Action(written.action),
        limits=_limits(written, base.limits),
        models=models,
        groups=base.groups if written.groups is None else written.groups,
    )


def _prices(price: PriceSettings) -> Prices:
    return Prices(price.input, price.input if price.cached_input is None else price.cached_input, price.output)


def plan(budgets: BudgetSettings) -> Plan:
    """The section as the core reads it: each tenant's entry over ``default``'s."""
    default = _tenant(budgets.tenants.get(DEFAULT_KEY, TenantBudget()), TenantPlan())
    return Plan(
        tenants={name: _tenant(entry, default) for name, entry in budgets.tenants.items() if name != DEFAULT_KEY},
        default=default,
        groups={name: _limits(limits, BudgetLimits()) for name, limits in budgets.groups.items()},
        prices={name: _prices(price) for name, price in budgets.prices.items()},
    )
