"""Slots freed by ended requests, held until the engine is seen alive after the end.

When an engine process dies, every request it was serving ends at once: Envoy
resets their streams within a millisecond of the kill, long before the next
scrape (100 ms) sees the port refuse. Each end frees a slot, and refilling it
at once sends a held request into the dead engine, where Envoy's retries run
out and the client gets a 503: a crash cost twice what was inside it.

The processor cannot tell those ends from normal ones: Envoy ends every
ext_proc stream the same way, finished response or cut one (it sends no
trailers for an HTTP/1 engine), and reading every response's headers costs a
message per request. So an end is *unconfirmed* until the engine shows life
after it: a look at its port (the adapter's, ``adapters/engines/probe.py``:
a TCP connect, sent at once, and again while newer ends wait), a good
scrape, or a checked response from it — each counts only if it started
after the end. Until then the freed slot stays taken: the pool's room is
reduced by the unconfirmed ends. The engine still runs whatever it holds
and whatever waits in it, so a confirmation a fraction of a millisecond
later costs no throughput; arrivals that find room go at once. A look the
engine refuses marks it down (``health.py``) and nothing more goes to it.

Only an end while requests are queued is held (the dispatcher's choice):
with nothing queued, nothing would be refilled into a dead engine, and the
look would cost for nothing.

Without endpoint picking an end cannot be attributed to one endpoint of a
pool of several: it is confirmed once every endpoint that is up has shown
life after it.

Pure: the caller passes the times.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence


class UnconfirmedEnds:
    """The unconfirmed ends of one pool: per endpoint (endpoint picking), or the pool's as a whole."""

    def __init__(self, endpoints: Sequence[str], *, per_endpoint: bool) -> None:
        self._per_endpoint = per_endpoint
        self._ends: dict[str | None, deque[float]] = {}
        # When each endpoint last showed life (the start of that probe or scrape).
        self._alive_at: dict[str, float] = {}
        self.set_endpoints(endpoints)

    def set_endpoints(self, endpoints: Sequence[str]) -> None:
        self._endpoints = tuple(endpoints)
        self._alive_at = {e: self._alive_at.get(e, float("-inf")) for e in self._endpoints}
        self._ends = {k: v for k, v in self._ends.items() if k is None or k in self._alive_at}

    def _key(self, endpoint: str | None) -> str | None:
        if not self._per_endpoint:
            return None
        return endpoint if endpoint is not None else self._endpoints[0] if len(self._endpoints) == 1 else None

    def ended(self, endpoint: str | None, now: float) -> tuple[str, ...]:
        """A released request to ``endpoint`` (None: unknown) ended at ``now``; the endpoints to probe."""
        key = self._key(endpoint)
        if key is None and self._per_endpoint:
            return ()  # picked nowhere (every endpoint down at its release): nothing to hold
        self._ends.setdefault(key, deque()).append(now)
        return self._endpoints if key is None else (key,)

    def alive(self, endpoint: str, started_at: float, up: Sequence[str]) -> bool:
        """``endpoint`` showed life at ``started_at`` (``up``: the endpoints not down); True if slots came free."""
        if endpoint not in self._alive_at:
            return False
        self._alive_at[endpoint] = max(self._alive_at[endpoint], started_at)
        freed = self._confirm(endpoint, started_at)
        return self._confirm_pool(up) or freed

    def gone(self, endpoint: str, up: Sequence[str]) -> bool:
        """``endpoint`` is down: what it held is lost anyway; True if slots came free."""
        freed = bool(self._ends.pop(endpoint, None))
        return self._confirm_pool(up) or freed

    def _confirm(self, key: str | None, before: float) -> bool:
        ends = self._ends.get(key)
        freed = False
        while ends and ends[0] < before:
            ends.popleft()
            freed = True
        return freed

    def _confirm_pool(self, up: Sequence[str]) -> bool:
        """Confirm the pool's ends older than the latest life shown by every endpoint that is up."""
        if self._per_endpoint or None not in self._ends:
            return False
        if not up:
            return bool(self._ends.pop(None))
        return self._confirm(None, min(self._alive_at[e] for e in up if e in self._alive_at))

    def count(self, endpoint: str | None = None) -> int:
        """Unconfirmed ends on ``endpoint`` (endpoint picking), or in the pool (None)."""
        if endpoint is None:
            return sum(map(len, self._ends.values()))
        return len(self._ends.get(endpoint, ()))

    def waits_on(self, endpoint: str) -> bool:
        """Whether a sign of life from ``endpoint`` now would confirm an end (so a probe of it is worth sending)."""
        if self._per_endpoint:
            return bool(self._ends.get(endpoint))
        ends = self._ends.get(None)
        return ends is not None and bool(ends) and endpoint in self._alive_at and ends[-1] >= self._alive_at[endpoint]
