"""OpenAI's rate-limit headers, from a tenant's tightest per-minute windows (``core/budgets/ledger.py`` RateView).

The names and formats are OpenAI's, which clients and their SDKs already
read: ``x-ratelimit-limit-requests`` / ``-tokens`` (the limit per minute),
``-remaining-`` (what is left now, whole), ``-reset-`` (until the window is
empty again, as a Go duration: ``1s``, ``6m0s``, ``20ms``). Where a tenant has
both input and output token limits, the tokens headers describe the
tighter.
"""

from __future__ import annotations

import math

from extproc.core.budgets.ledger import RateView

RATE_HEADERS = tuple(f"x-ratelimit-{what}-{unit}" for unit in ("requests", "tokens")
                     for what in ("limit", "remaining", "reset"))
# On an insufficient_quota answer: retrying within the period does not help (the OpenAI SDKs read it).
NO_RETRY = ("x-should-retry", "false")


def duration(seconds: float) -> str:
    """``seconds`` as OpenAI writes a reset: Go's duration text (``20ms``, ``1.5s``, ``6m0s``, ``1h2m0s``)."""
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    text = f"{round(secs, 3):g}s"
    if hours >= 1:
        return f"{int(hours)}h{int(minutes)}m{text}"
    return f"{int(minutes)}m{text}" if minutes >= 1 else text


def rate_headers(view: RateView) -> tuple[tuple[str, str], ...]:
    """The headers for ``view``: requests and tokens, each where the tenant has such a limit."""
    found: list[tuple[str, str]] = []
    for unit, window in (("requests", view.requests), ("tokens", view.tokens)):
        if window is not None:
            limit, remaining, reset_s = window
            found += [(f"x-ratelimit-limit-{unit}", f"{limit:.0f}"),
                      (f"x-ratelimit-remaining-{unit}", str(math.floor(remaining))),
                      (f"x-ratelimit-reset-{unit}", duration(reset_s))]
    return tuple(found)
