"""Tenant label values, bounded: the tenants the config names, and one value for everyone else.

A tenant named under ``tenants:`` in the config (and ``identity.default_tenant``)
is its own label value, every other tenant id shares the one value ``other``.
A tenant id is whatever the auth layer put in a header, unbounded; a label
value per id would grow Prometheus without limit. Refusals decided before the
tenant is known (bad body, unknown model, a missing tenant or a class it may
not use) carry ``tenant="(none)"``; the processor's own shedding
(``overloaded``) comes after admission, so it carries the tenant, and its
class in ``extproc_shed``.
"""

from __future__ import annotations

from collections.abc import Iterable

OTHER_TENANT = "other"
NO_TENANT = "(none)"
UNKNOWN_MODEL = "(unknown)"


class TenantLabels:
    """The bounded set of tenant label values: the configured names, and ``other`` for everyone else."""

    def __init__(self, names: Iterable[str]) -> None:
        self._names = frozenset(names)
        self.values = (*sorted(self._names), OTHER_TENANT)

    def __call__(self, tenant: str) -> str:
        return tenant if tenant in self._names else OTHER_TENANT
