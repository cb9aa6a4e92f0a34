"""Tenant budgets at the edge: the admission check, the rate headers, the store, the usage export, the metrics.

* ``gate.py``    each request's check at admission and its settlement at the end (the core's ``Budgets``);
* ``headers.py`` OpenAI's ``x-ratelimit-*`` headers from a tenant's tightest windows;
* ``store.py``   the usage book in SQLite, written behind (day and month budgets survive a restart);
* ``usage.py``   the usage rows as finance reads them: CSV or JSON, by tenant, model and day.

docs/budgets.md says what holds for the operator and the client.
"""
