"""What a tenant may use: its limits, per scope, and what happens over them (the plan, as the config resolved it).

A limit applies to a *scope*: one tenant (all its models), one tenant on one
model, or a group of tenants that share it. A request is counted in every
scope it falls in, and admitted only when each has room (``ledger.py``).

The money budgets are priced from each model's :class:`Prices` (per million
tokens, as providers quote them); a model without prices costs nothing, so
only its token limits bind.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from enum import StrEnum

PER_MILLION = 1_000_000.0


class Action(StrEnum):
    """What happens to a request over one of its tenant's limits (the operator's choice, per tenant)."""

    REFUSE = "refuse"  # 429, OpenAI's error (rate_limit_exceeded or insufficient_quota), Retry-After
    DOWNGRADE = "downgrade"  # served in the lowest class, on otherwise idle capacity; counted, not limited
    REPORT = "report"  # served as usual; only counted as over in the metrics


@dataclass(frozen=True, slots=True)
class BudgetLimits:
    """One scope's limits; None: no such limit. Rates are per minute, budgets per calendar day or month (UTC)."""

    requests_per_minute: float | None = None
    input_tokens_per_minute: float | None = None
    output_tokens_per_minute: float | None = None
    # Input and output tokens together, per calendar day.
    tokens_per_day: float | None = None
    # Money, from the models' prices, per calendar day and per calendar month.
    cost_per_day: float | None = None
    cost_per_month: float | None = None

    @property
    def empty(self) -> bool:
        return all(getattr(self, name) is None for name in self.__slots__)


NO_LIMITS = BudgetLimits()


@dataclass(frozen=True, slots=True)
class Prices:
    """One model's prices per million tokens: uncached input, cached input (prefix cache), output."""

    input: float = 0.0
    cached_input: float = 0.0
    output: float = 0.0

    def cost(self, input_tokens: float, cached_tokens: float, output_tokens: float) -> float:
        """The money ``input_tokens`` (of which ``cached_tokens`` cached) and ``output_tokens`` cost."""
        return ((input_tokens - cached_tokens) * self.input + cached_tokens * self.cached_input
                + output_tokens * self.output) / PER_MILLION


FREE = Prices()


class Kind(StrEnum):
    """A scope's kind: the first word of its key in metrics, exports and the store."""

    TENANT = "tenant"
    TENANT_MODEL = "tenant_model"
    GROUP = "group"


@dataclass(frozen=True, slots=True)
class Scope:
    """Who shares one set of counters: a tenant, a tenant on a model, or a group (``name``: tenant or group)."""

    kind: Kind
    name: str
    model: str = ""


@dataclass(frozen=True)
class TenantPlan:
    """One tenant's limits: on all its models, per model, and its action over any of them (its groups' included)."""

    action: Action = Action.REFUSE
    limits: BudgetLimits = NO_LIMITS
    models: Mapping[str, BudgetLimits] = field(default_factory=dict)
    groups: tuple[str, ...] = ()


@dataclass(frozen=True)
class Plan:
    """Every tenant's limits: the named ones, ``default`` for every other tenant (each its own counters), the groups."""

    tenants: Mapping[str, TenantPlan] = field(default_factory=dict)
    default: TenantPlan = field(default_factory=TenantPlan)
    groups: Mapping[str, BudgetLimits] = field(default_factory=dict)
    prices: Mapping[str, Prices] = field(default_factory=dict)

    def tenant(self, name: str) -> TenantPlan:
        return self.tenants.get(name, self.default)

    def scopes(self, tenant: str, model: str) -> list[tuple[Scope, BudgetLimits]]:
        """The scopes a request of ``tenant`` for ``model`` counts in, each with its limits (scopes without any left out)."""
        plan = self.tenant(tenant)
        found = [(Scope(Kind.TENANT, tenant), plan.limits),
                 (Scope(Kind.TENANT_MODEL, tenant, model), plan.models.get(model, NO_LIMITS)),
                 *((Scope(Kind.GROUP, group), self.groups.get(group, NO_LIMITS)) for group in plan.groups)]
        return [(scope, limits) for scope, limits in found if not limits.empty]

    def named(self) -> Iterator[tuple[Scope, BudgetLimits]]:
        """Each named scope and its limits: the tenants named under ``budgets.tenants``, their models, the groups."""
        for tenant, entry in self.tenants.items():
            yield Scope(Kind.TENANT, tenant), entry.limits
            for model, limits in entry.models.items():
                yield Scope(Kind.TENANT_MODEL, tenant, model), limits
        for group, limits in self.groups.items():
            yield Scope(Kind.GROUP, group), limits

    def limits(self, scope: Scope) -> BudgetLimits:
        """``scope``'s limits under this plan (none: NO_LIMITS)."""
        if scope.kind is Kind.GROUP:
            return self.groups.get(scope.name, NO_LIMITS)
        plan = self.tenant(scope.name)
        return plan.limits if scope.kind is Kind.TENANT else plan.models.get(scope.model, NO_LIMITS)

    def price(self, model: str) -> Prices:
        return self.prices.get(model, FREE)
