"""What each tenant used, per model and UTC day: the usage a finance export reads and a restart starts from.

One :class:`Row` per (tenant, model, day), updated when a request ends (what
it really used, priced), so the book is exact whatever the limits; the
limits' day and month counters (``ledger.py``) are its sums, kept as they go,
and rebuilt from it where they start: after a restart (the store loads the
book), or when a reload adds a budget. A row changed since the store last
took the book is *dirty*: the store writes those behind, never on the
request's path.

Pure: days are passed in as their start (epoch seconds).
"""

from __future__ import annotations

import calendar
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import astuple, dataclass

# More tokens than any request could hold: a count beyond it is a broken caller's, not a request's.
MOST_TOKENS = 1e12


def _count(value: float) -> float:
    """A token count in [0, MOST_TOKENS]; NaN (nothing known) as 0."""
    return min(max(value, 0.0), MOST_TOKENS) if value == value else 0.0


@dataclass(frozen=True, slots=True)
class Usage:
    """The tokens of one request: input (prompt), of which cached, and output.

    Each is a count in [0, MOST_TOKENS] whatever it is made from (NaN as 0),
    and cached tokens are at most the input: a hostile number can neither
    poison a counter nor give a budget back.
    """

    input_tokens: float = 0.0
    cached_tokens: float = 0.0
    output_tokens: float = 0.0

    def __post_init__(self) -> None:
        input_tokens = _count(self.input_tokens)
        object.__setattr__(self, "input_tokens", input_tokens)
        object.__setattr__(self, "cached_tokens", min(_count(self.cached_tokens), input_tokens))
        object.__setattr__(self, "output_tokens", _count(self.output_tokens))

    @property
    def tokens(self) -> float:
        return self.input_tokens + self.output_tokens


@dataclass(slots=True)
class Row:
    """One tenant's use of one model on one day: requests that ended, their tokens and cost."""

    requests: int = 0
    input_tokens: float = 0.0
    cached_tokens: float = 0.0
    output_tokens: float = 0.0
    cost: float = 0.0
    # Of the requests, those served over a limit (downgraded, or only reported).
    over: int = 0

    def add(self, usage: Usage, cost: float, over: bool) -> None:
        self.requests += 1
        self.input_tokens += usage.input_tokens
        self.cached_tokens += usage.cached_tokens
        self.output_tokens += usage.output_tokens
        self.cost += cost
        self.over += over

    @property
    def tokens(self) -> float:
        return self.input_tokens + self.output_tokens

    def values(self) -> tuple[int, float, float, float, float, int]:
        return astuple(self)


def day_name(start: float) -> str:
    """The UTC day starting at ``start``, as ``YYYY-MM-DD`` (the store's and the export's key)."""
    return time.strftime("%Y-%m-%d", time.gmtime(start))


def day_of(name: str) -> float:
    """The start of the UTC day ``YYYY-MM-DD``."""
    return float(calendar.timegm(time.strptime(name, "%Y-%m-%d")))


# A row's key: tenant, model, day (YYYY-MM-DD).
Key = tuple[str, str, str]


class Book:
    """Every row since the store last dropped old ones, by tenant; the dirty ones remembered for the store."""

    def __init__(self) -> None:
        self._tenants: dict[str, dict[tuple[str, str], Row]] = {}
        self._dirty: set[Key] = set()

    def add(self, tenant: str, model: str, day: float, usage: Usage, cost: float, *, over: bool = False) -> None:
        """One request that ended on ``day`` (its start): counted in its row."""
        key = (model, day_name(day))
        rows = self._tenants.setdefault(tenant, {})
        row = rows.get(key)
        if row is None:
            row = rows[key] = Row()
        row.add(usage, cost, over)
        self._dirty.add((tenant, *key))

    def load(self, rows: Iterable[tuple[Key, Row]]) -> None:
        """Rows as the store kept them (at start): they replace what the book holds under their keys, and are clean."""
        for (tenant, model, day), row in rows:
            self._tenants.setdefault(tenant, {})[(model, day)] = row

    def take_dirty(self) -> list[tuple[Key, Row]]:
        """The rows changed since the last call (copies: the store writes them while requests go on)."""
        dirty, self._dirty = self._dirty, set()
        return [(key, Row(*self._tenants[key[0]][key[1:]].values())) for key in sorted(dirty)]

    def undo_take(self, rows: list[tuple[Key, Row]]) -> None:
        """Rows :meth:`take_dirty` gave that could not be stored: dirty again (their current values are written next)."""
        self._dirty.update(key for key, _ in rows)

    def drop_before(self, day: float) -> None:
        """Forget rows of days before ``day`` (the store has them); clean ones only."""
        first = day_name(day)
        for tenant, rows in list(self._tenants.items()):
            for key in [k for k in rows if k[1] < first and (tenant, *k) not in self._dirty]:
                del rows[key]
            if not rows:
                del self._tenants[tenant]

    def rows(self, since: float = 0.0) -> Iterator[tuple[Key, Row]]:
        """Every row from the day ``since`` is in, by tenant, model, day."""
        first = day_name(since)
        for tenant in sorted(self._tenants):
            rows = self._tenants[tenant]
            for model, day in sorted(rows):
                if day >= first:
                    yield (tenant, model, day), rows[(model, day)]

    def total(self, tenants: str | Callable[[str], bool], model: str, since: float, until: float) -> tuple[float, float]:
        """Tokens and cost of one tenant (or those ``tenants`` accepts) on ``model`` (empty: all), days ``since`` to ``until``."""
        first, last = day_name(since), day_name(until)
        tokens = cost = 0.0
        if isinstance(tenants, str):
            selected = [self._tenants.get(tenants, {})]
        else:
            selected = [rows for tenant, rows in self._tenants.items() if tenants(tenant)]
        for rows in selected:
            for (on, day), row in rows.items():
                if first <= day <= last and (not model or on == model):
                    tokens += row.tokens
                    cost += row.cost
        return tokens, cost
