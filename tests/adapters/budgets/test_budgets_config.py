"""The ``budgets:`` section: mistakes with their key paths, inheritance from ``default``, the plan the core reads."""

from __future__ import annotations

import pytest

from extproc.adapters.budgets.plan import plan
from extproc.adapters.config import ConfigError, parse_config
from extproc.core.budgets.limits import Action, BudgetLimits, Kind, Prices, Scope

pytestmark = pytest.mark.unit

MODELS = [{"name": "m", "endpoints": ["http://127.0.0.1:1"]}, {"name": "n", "endpoints": ["http://127.0.0.1:2"]}]


def errors(budgets: object) -> tuple[str, ...]:
    with pytest.raises(ConfigError) as error:
        parse_config({"models": MODELS, "budgets": budgets})
    return error.value.errors


def test_without_a_budgets_section_there_are_none() -> None:
    assert parse_config({"models": MODELS}).budgets is None


def test_every_mistake_names_its_key_path() -> None:
    found = errors({
        "tenants": {"default": {"requests_per_minute": 0, "action": "block"},
                    "x": {"groups": ["nope"], "models": {"zz": {"tokens_per_day": 5}, "m": {"toknes_per_day": 1}}}},
        "prices": {"m": {"input": 1, "cached_input": 2}, "q": {"output": 1}},
        "store_interval_s": -1,
    })
    assert found == (
        "budgets.tenants.default.requests_per_minute: must be a number > 0, got 0",
        "budgets.tenants.default.action: must be one of refuse, downgrade, report, got 'block'",
        "budgets.tenants.x.models.m.toknes_per_day: unknown key (allowed: cost_per_day, cost_per_month, "
        "input_tokens_per_minute, output_tokens_per_minute, requests_per_minute, tokens_per_day)",
        "budgets.prices.m.cached_input: must not exceed input (1): a cached prompt token costs less, not more",
        "budgets.store_interval_s: must be a number > 0, got -1",
    )
    found = errors({"tenants": {"x": {"groups": ["nope"], "models": {"zz": {"tokens_per_day": 5}}, "cost_per_day": 3}},
                    "prices": {"q": {}}})
    assert found == (
        "budgets.prices.q: no model 'q' in models (one of: m, n)",
        "budgets.tenants.x.groups[0]: no group 'nope' in budgets.groups",
        "budgets.tenants.x.models.zz: no model 'zz' in models",
        "budgets.tenants.x: a money budget needs prices (budgets.prices): without them every request costs 0",
    )


def test_a_tenant_inherits_from_default_field_by_field_and_per_model() -> None:
    config = parse_config({"models": MODELS, "budgets": {
        "prices": {"m": {"input": 0.5, "output": 1.5}},
        "groups": {"eval": {"cost_per_month": 300}},
        "tenants": {
            "default": {"requests_per_minute": 600, "output_tokens_per_minute": 1000,
                        "models": {"m": {"tokens_per_day": 10_000}}},
            "x": {"action": "downgrade", "output_tokens_per_minute": 50, "groups": ["eval"],
                  "models": {"m": {"requests_per_minute": 5}, "n": {"cost_per_day": 1}}},
        },
    }})
    assert config.budgets is not None
    resolved = plan(config.budgets)
    x = resolved.tenant("x")
    assert x.action is Action.DOWNGRADE and x.groups == ("eval",)
    assert x.limits == BudgetLimits(requests_per_minute=600, output_tokens_per_minute=50)
    assert x.models == {"m": BudgetLimits(requests_per_minute=5, tokens_per_day=10_000), "n": BudgetLimits(cost_per_day=1)}
    assert resolved.tenant("anyone") is resolved.default and resolved.default.action is Action.REFUSE
    assert resolved.price("m") == Prices(0.5, 0.5, 1.5) and resolved.price("n") == Prices()
    assert [s for s, _ in resolved.scopes("x", "m")] == [
        Scope(Kind.TENANT, "x"), Scope(Kind.TENANT_MODEL, "x", "m"), Scope(Kind.GROUP, "eval")]
