"""Tenant budgets: rate and token limits per minute, token and money budgets per day or month, per tenant.

* ``limits.py`` what a tenant may use, per scope (tenant, tenant on a model, group), and its action over it;
* ``meters.py`` the counters: a token bucket per per-minute limit, a UTC calendar period per budget;
* ``ledger.py`` admission (reserve), the end (correct), no service (cancel): :class:`Budgets`;
* ``book.py`` what each tenant used per model and day: the export's rows, the counts a restart starts from.

Fairness decides who goes next; budgets decide how much a tenant may use. A
tenant over its budget can be refused, or downgraded to the lowest class
where it only uses idle capacity (docs/budgets.md).
"""
