"""The usage export: what each tenant used, per model and day (or month), as finance reads it: CSV or JSON.

One row per tenant, model and period: requests served, input tokens (of
which cached), output tokens, cost (from ``budgets.prices``, in the prices'
currency), and how many of the requests were served over a limit
(downgraded or only reported). With ``cluster:``, the cluster's rows in
Redis (``cluster_usage.py``: every instance's charges); else read from the
store where there is one (every day the instance served), else from the
processor's memory (since it started). Served at ``GET /usage`` on the
metrics port and by ``extproc usage`` (which reads Redis, or the store file,
without a running processor).
"""

from __future__ import annotations

import csv
import io
import json
import re
from collections.abc import Iterable
from typing import Any, Literal

from extproc.core.budgets.book import Key, Row

COLUMNS = ("tenant", "model", "period", "requests", "input_tokens", "cached_tokens", "output_tokens", "cost",
           "over_limit_requests")
Per = Literal["day", "month"]
SINCE = re.compile(r"\d{4}-\d{2}(-\d{2})?")


class Unavailable(Exception):
    """The export's source does not answer (a cluster's Redis): the message says which, and where else to look."""


def since_day(text: str) -> str:
    """``YYYY-MM-DD`` or ``YYYY-MM`` (its first day) as the first day to export; ValueError otherwise."""
    if not SINCE.fullmatch(text):
        raise ValueError(f"--since must be YYYY-MM-DD or YYYY-MM, got {text!r}")
    return text if len(text) == 10 else f"{text}-01"


def records(rows: Iterable[tuple[Key, Row]], per: Per = "day") -> list[dict[str, Any]]:
    """The rows as export records, summed per month with ``per="month"``, by tenant, model, period."""
    summed: dict[tuple[str, str, str], Row] = {}
    for (tenant, model, day), row in rows:
        key = (tenant, model, day[:7] if per == "month" else day)
        total = summed.setdefault(key, Row())
        total.requests += row.requests
        total.input_tokens += row.input_tokens
        total.cached_tokens += row.cached_tokens
        total.output_tokens += row.output_tokens
        total.cost += row.cost
        total.over += row.over
    return [dict(zip(COLUMNS, (*key, row.requests, round(row.input_tokens), round(row.cached_tokens),
                               round(row.output_tokens), round(row.cost, 6), row.over), strict=True))
            for key, row in sorted(summed.items())]


def render(found: list[dict[str, Any]], form: Literal["csv", "json"]) -> str:
    if form == "json":
        return json.dumps(found, indent=1) + "\n"
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(found)
    return out.getvalue()
