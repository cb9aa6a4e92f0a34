"""The two kinds of counter a limit keeps: a window per minute (a token bucket) and a calendar period (UTC).

**Per-minute limits are token buckets** of one minute's allowance, refilled
continuously at the limit / 60 per second (kept as what is *used*, draining at
that rate: the same thing, and a changed limit keeps what was used). Chosen
over a sliding window because

* a bucket is two numbers per limit whatever the traffic; a true sliding
  window keeps every event of the last minute (one tenant at 10,000 requests a
  minute: 10,000 entries), and the two-counter approximation is not exact;
* a correction at the end of a request (its real output against what was
  reserved) is one addition to a bucket, however long ago it was admitted; a
  sliding window would have to put it back at the admission's instant;
* "when is there room again" is exact: what is missing / the rate. That is
  ``Retry-After``, and ``x-ratelimit-reset-*`` is the time until it is empty.

In steady state a tenant at its limit gets exactly the limit; after an idle
minute it may burst one minute's allowance at once (as OpenAI's limits
behave). A request is admitted when the bucket has room for all of it; one
larger than a whole minute's allowance (an absurd ``max_tokens`` under a small
limit) only into an empty bucket, so it cannot pass more often than the limit
allows.

**Day and month budgets are calendar periods in UTC**: the day from 00:00 UTC,
the month from 00:00 UTC on its first day. They reset exactly then, and
``Retry-After`` for a budget is the time to that instant.

**Clock jumps.** Time is wall-clock seconds (the periods are calendar ones).
A clock that goes back does not refill a bucket (the time since the last
look counts as none, and the look moves to the new time), and a period never
goes back: counts are not reset by a clock set back across midnight. A clock
that jumps forward refills at most a minute's allowance and starts the
periods it crossed, as real time passing would.

Pure: times are passed in.
"""

from __future__ import annotations

import calendar
import time
from dataclasses import dataclass, field

DAY_S = 86_400.0
MINUTE_S = 60.0
# Rounding in the refill must not make a request that fits exactly wait.
EPSILON = 1e-9


def day_start(now: float) -> float:
    """The start (epoch seconds) of the UTC day ``now`` is in."""
    return now - now % DAY_S


def month_start(now: float) -> float:
    """The start (epoch seconds) of the UTC month ``now`` is in."""
    moment = time.gmtime(now)
    return float(calendar.timegm((moment.tm_year, moment.tm_mon, 1, 0, 0, 0)))


class Calendar:
    """The day and month ``now`` is in, computed once per day (every admission asks); never back, as a period."""

    __slots__ = ("_day", "_month", "_until")

    def __init__(self) -> None:
        self._day = self._month = 0.0
        self._until = -1.0

    def starts(self, now: float) -> tuple[float, float]:
        """(day start, month start) of ``now``."""
        if now >= self._until:
            self._day, self._month, self._until = day_start(now), month_start(now), day_start(now) + DAY_S
        return self._day, self._month


def next_month(start: float) -> float:
    """The start of the month after the one starting at ``start``."""
    return month_start(start + 32 * DAY_S)


@dataclass(slots=True)
class Window:
    """A per-minute limit as a token bucket: ``used`` drains at ``limit`` per minute; room is ``limit - used``."""

    limit: float
    used: float = 0.0
    at: float = 0.0

    def _drain(self, now: float) -> None:
        elapsed = now - self.at
        if elapsed > 0:
            self.used = max(0.0, self.used - elapsed * self.limit / MINUTE_S)
        self.at = now  # a clock set back counts as no time passed

    def wait(self, amount: float, now: float) -> float:
        """Seconds until ``amount`` fits (0: it fits now); more than a whole minute's allowance needs an empty bucket."""
        self._drain(now)
        need = min(amount, self.limit)
        over = self.used + need - self.limit
        return over * MINUTE_S / self.limit if over > EPSILON else 0.0

    def add(self, amount: float, now: float) -> None:
        """Take ``amount`` (negative: give back, as a correction does)."""
        self._drain(now)
        self.used = max(0.0, self.used + amount)

    def remaining(self, now: float) -> float:
        self._drain(now)
        return max(0.0, self.limit - self.used)

    def reset_s(self, now: float) -> float:
        """Seconds until it is empty again (OpenAI's ``x-ratelimit-reset-*``)."""
        self._drain(now)
        return self.used * MINUTE_S / self.limit


@dataclass(slots=True)
class Period:
    """A budget per calendar period: what requests that ended in it used, and what those in flight reserved.

    ``monthly``: the period is the UTC month, else the UTC day.
    """

    monthly: bool
    start: float
    used: float = 0.0
    reserved: float = 0.0
    # When this period ends, and the next one's budget is there (``Retry-After`` for a budget).
    end: float = field(init=False)

    def __post_init__(self) -> None:
        self.end = self._end()

    def _end(self) -> float:
        return next_month(self.start) if self.monthly else self.start + DAY_S

    def roll(self, now: float) -> None:
        """A new period from ``now`` on, if it is later than this one: nothing used, nothing reserved in it yet."""
        if now < self.end:  # this period, or a clock set back: a count is never reset by going back
            return
        self.start = month_start(now) if self.monthly else day_start(now)
        self.end = self._end()
        self.used = self.reserved = 0.0

    def counted(self) -> float:
        return self.used + self.reserved
