"""The budgets' Prometheus series, read from the gate when Prometheus scrapes (nothing on a request's path).

* ``extproc_budget_limit``, ``extproc_budget_used``, ``extproc_budget_remaining``
  ``{scope, name, model, limit}``: each limit of each *named* scope (a tenant
  named under ``budgets.tenants``, its models, a group) as it stands; a tenant
  that only inherits ``default`` has counters of its own, which no label can
  bound, so they are not series (the usage export has them all);
* ``extproc_budget_reset_seconds``: until the window is empty or the period over;
  with ``cluster:`` these are the cluster's counts as read from Redis
  (``cluster_standings.py``), left out while Redis does not answer;
* ``extproc_budget_stale``: 1 while they are left out so (the cluster's counts
  unknown), 0 else;
* ``extproc_budget_over_total{tenant, over, action}``: requests over a limit;
* ``extproc_budget_usage_*_total{tenant, model}``: requests, tokens and cost
  booked, the tenant bounded as every tenant label is (``telemetry/labels.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from extproc.adapters.budgets.gate import BudgetGate
from extproc.adapters.telemetry.labels import TenantLabels

SCOPE_LABELS = ("scope", "name", "model", "limit")


class BudgetCollector(Collector):
    """Collects the processor's budgets at scrape time; ``gate`` is asked each time (a reload may add or remove it)."""

    def __init__(self, gate: Callable[[], BudgetGate | None]) -> None:
        self._gate = gate

    def collect(self) -> Iterator[Metric]:
        gate = self._gate()
        if gate is None:
            return
        named = gate.budgets.plan.tenants
        families = {key: GaugeMetricFamily(f"extproc_budget_{key}", text, labels=SCOPE_LABELS) for key, text in (
            ("limit", "A budget's limit: per minute for a rate, per day or month for a budget (money in the prices' unit)."),
            ("used", "What a budget's scope used of its limit: in its window now, or in its period (with reservations)."),
            ("remaining", "What is left of a budget's limit now."),
            ("reset_seconds", "Seconds until a budget's window is empty again or its period ends."))}
        rows, stale = gate.standings()
        for standing in () if stale else rows:
            scope = standing.scope
            values = [scope.kind.value, scope.name, scope.model, standing.limit]
            for key, value in (("limit", standing.value), ("used", standing.used), ("remaining", standing.remaining),
                               ("reset_seconds", standing.reset_s)):
                families[key].add_metric(values, value)
        yield from families.values()
        yield GaugeMetricFamily("extproc_budget_stale", "1 while the per-scope budget series are unknown and left out "
                                "(with a cluster: Redis did not answer the last read), 0 else.", value=float(stale))
        labels = TenantLabels(named)
        over = CounterMetricFamily("extproc_budget_over", "Requests over a budget's limit, by the kind of limit "
                                   "(rate, budget) and the tenant's action (refuse, downgrade, report).",
                                   labels=("tenant", "over", "action"))
        summed: dict[tuple[str, str, str], float] = {}
        for (tenant, kind, action), times in gate.over.items():
            who = (labels(tenant), kind, action)
            summed[who] = summed.get(who, 0.0) + times
        for who, total in sorted(summed.items()):
            over.add_metric(list(who), total)
        yield over
        yield from _usage(gate, labels)


def _usage(gate: BudgetGate, labels: TenantLabels) -> Iterator[Metric]:
    """What each tenant used since the processor started, per model (the gate's running totals)."""
    families = [CounterMetricFamily(f"extproc_budget_usage_{key}", text, labels=("tenant", "model")) for key, text in (
        ("requests", "Requests served and charged to a tenant's budgets."),
        ("input_tokens", "Prompt tokens charged to a tenant's budgets (estimated from the request's size)."),
        ("cached_tokens", "Of the prompt tokens, those charged as cached (prefix signatures)."),
        ("output_tokens", "Output tokens charged to a tenant's budgets (measured at the end: docs/budgets.md)."),
        ("cost", "Money charged to a tenant's budgets, in the unit of budgets.prices."))]
    summed: dict[tuple[str, str], list[float]] = {}
    for (tenant, model), totals in gate.usage.items():
        row = summed.setdefault((labels(tenant), model), [0.0] * 5)
        for i, value in enumerate(totals):
            row[i] += value
    for key, totals in sorted(summed.items()):
        for family, value in zip(families, totals, strict=True):
            family.add_metric(list(key), value)
    yield from families
