"""A request as the edge knows it, whoever reads it: its fields, who asks and how urgently, what it used.

* ``request_fields.py`` what the scheduler reads of a request: from our metadata (fast path) or from its body;
* ``admission.py``      who asks, for which model, how urgently: tenant, class (entitlement), served names;
* ``prompt_prefix.py``  a request's prefix signature from its prompt's leading text (models with ``prefix:``);
* ``engine_usage.py``   the usage the engine reports at its response's end, read as the body passes.

The servicer and its attachments (``ext_proc/``) read requests into these
values; the budgets (``budgets/``) and the Batch API (``batches/``) take them
without importing the servicer.
"""
