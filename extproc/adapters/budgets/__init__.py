"""Tenant budgets at the edge: the admission check, the rate headers, the store, the usage export, the metrics.

* ``gate.py``    each request's check at admission and its settlement at the end (the core's ``Budgets``);
* ``plan.py``    the ``budgets:`` section resolved into the core's plan;
* ``service.py`` what ``extproc serve`` runs beside the gate: the store, the series, the usage export;
* ``headers.py`` OpenAI's ``x-ratelimit-*`` headers from a tenant's tightest windows;
* ``usage_store.py``   the usage book in SQLite, written behind (day and month budgets survive a restart);
* ``usage.py``   the usage rows as finance reads them: CSV or JSON, by tenant, model and day;
* ``cluster_ledger.py``  with ``cluster:``, the counts in Redis: one round trip per decision (``budgets.lua``);
* ``cluster_standings.py`` the cluster's limits read back from Redis, for the metrics and the status page;
* ``cluster_usage.py`` the cluster's usage book in Redis: added to at each end, read by the export.

Loaded only where a config has a ``budgets:`` section (server.py builds the
service, the servicer the gate). docs/budgets.md says what holds for the
operator and the client.
"""
