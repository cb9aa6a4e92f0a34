"""Whether an endpoint's metrics can be trusted now, and what it may hold while they cannot.

An endpoint whose last scrape failed, or whose last good scrape is older than
``stale_after_s``, is *degraded*: the rules that read metrics then cap our
in-flight requests on it at ``max(fallback_max_in_flight, last good running
/ 2)`` — half of what the engine ran when we could last see it, never less
than the configured floor. Traffic keeps flowing, a broken scrape can never
open the flood gates, and the next good scrape restores the normal rule. An
endpoint is degraded until its first good scrape (start-up, a new DNS member).

A *frozen* page (a cache, a hung exporter) still answers, with the same
text: once work was sent to the endpoint longer ago than any usable page may
lag, and the page still did not move, its data is as old as its first
appearance, and goes stale like a failed scrape's.

An endpoint is *down* when its engine cannot be reached: a scrape's
connection was refused, a look at its port after a request to it ended was
refused (``unconfirmed.py``), or a request released to it failed (Envoy could
not connect or was reset before a response, or the engine itself answered 503).
Down is not degraded: nothing at all goes to a down endpoint (the gate would
otherwise keep releasing into it, each failure freeing the slot it took, and
empty the queue into errors). Held requests wait instead (up to their queue
timeout) or go to an endpoint that is up. The endpoint is up again on the
first sign of a live engine after it went down: a scrape that started later
and got any HTTP answer, a look at it that was answered, or a response from
it that is not a failure.

A failed release is read from the response's headers, which cost the
processor one more message; so only some releases are checked
(:meth:`EndpointHealth.check_release`): one in ``CHECK_EVERY``, and every
release to an endpoint within ``PROBATION_S`` of its coming back up (an
engine whose metrics answer while its API fails goes down again at its
first failure, instead of after a sample's worth). A crashed engine is seen
by its refused scrapes anyway.

Pure: the caller passes ``now`` (a monotonic clock).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from extproc.core.values.engine_load import EngineLoad

# One release in this many has its response headers checked (the first one included).
CHECK_EVERY = 8
# Every release to an endpoint is checked for this long after it came back up.
PROBATION_S = 5.0


@dataclass
class _Health:
    """What is known of one endpoint's metrics."""

    failing: bool = True  # the latest scrape failed (or there was none yet)
    last_good: EngineLoad | None = None
    good_at: float = float("-inf")  # when the last good scrape started
    # First release to this endpoint after its current page content appeared.
    release_after_content: float | None = None
    # When the endpoint was marked down (None: up), and when it last came back up.
    down_at: float | None = None
    up_at: float = float("-inf")


class _Degraded(NamedTuple):
    """A :meth:`EndpointHealth.degraded` answer, and what it holds for: the version, and ``now`` with every page that
    was stale still stale (past ``newest_stale``) and every fresh one still fresh (``oldest_fresh``)."""

    version: int
    newest_stale: float
    oldest_fresh: float
    endpoints: tuple[str, ...]


class EndpointHealth:
    """Health of every endpoint of one model pool (see the module docstring)."""

    def __init__(self, endpoints: Sequence[str], *, stale_after_s: float, fallback_max_in_flight: int) -> None:
        self.endpoints: tuple[str, ...] = ()
        self._stale_after_s = stale_after_s
        self._floor = fallback_max_in_flight
        self._health: dict[str, _Health] = {}
        self._releases = 0
        # Counts the events that may change who is degraded or down (time aside: :meth:`stable_until`), so that a
        # reader (``health_log.py``) can tell nothing changed without looking at every endpoint.
        self.version = 0
        # The endpoints that are up, kept as they change (``serving``): every release reads them.
        self.up: tuple[str, ...] = ()
        # The last answer of degraded(), kept while the version holds and while ``now`` stays between the staleness
        # times that bound it: every release asks, and it seldom changes.
        self._degraded = _Degraded(-1, -math.inf, math.inf, ())
        self.set_endpoints(endpoints)

    def set_endpoints(self, endpoints: Sequence[str]) -> None:
        """The pool's members changed; a newcomer starts degraded until scraped."""
        self.version += 1
        self.endpoints = tuple(endpoints)
        self._health = {e: self._health.get(e) or _Health() for e in self.endpoints}
        self._up_changed()

    def _up_changed(self) -> None:
        self.up = tuple(e for e, h in self._health.items() if h.down_at is None)

    def record_release(self, endpoint: str | None, now: float) -> None:
        """A release went to ``endpoint`` (None: not picked, anywhere in the pool)."""
        # Only a release that surely went to an endpoint can prove its page frozen.
        target = endpoint if endpoint is not None else self.endpoints[0] if len(self.endpoints) == 1 else None
        health = self._health.get(target) if target is not None else None
        if health is not None and health.release_after_content is None:
            health.release_after_content = now

    def record_scrape(self, endpoint: str, load: EngineLoad | None, started_at: float, *, reachable: bool = True) -> bool:
        """A scrape of ``endpoint`` returned ``load`` (None: failed); True if it is a usable reading.

        ``reachable=False``: the connection was refused, the engine is gone
        (down); any HTTP answer, even a broken page, shows a live engine.
        """
        health = self._health.get(endpoint)
        if health is None:  # removed from the pool while the scrape ran
            return False
        self.version += 1
        if not reachable:
            self.mark_down(endpoint, started_at)
        elif health.down_at is not None and started_at > health.down_at:
            self._mark_up(health, started_at)
        health.failing = load is None
        if load is None:
            return False
        sent = health.release_after_content
        if load == health.last_good and sent is not None and sent < started_at - self._stale_after_s:
            return False  # frozen: its data is as old as its first appearance and goes stale
        if load != health.last_good:
            health.release_after_content = None
        health.last_good, health.good_at = load, started_at
        return True

    def record_response(self, endpoint: str, ok: bool, now: float) -> None:
        """A released request to ``endpoint`` got its response headers: ``ok``, or a failure (down)."""
        health = self._health.get(endpoint)
        if health is None:
            return
        if not ok:
            self.mark_down(endpoint, now)
        elif health.down_at is not None and now > health.down_at:
            self._mark_up(health, now)

    def _mark_up(self, health: _Health, now: float) -> None:
        self.version += 1
        health.down_at, health.up_at = None, now
        self._up_changed()

    def check_release(self, endpoint: str | None, now: float) -> bool:
        """Whether to read the response headers of a release to ``endpoint`` (None: anywhere in the pool)."""
        self._releases += 1
        for target in (endpoint,) if endpoint is not None else self.endpoints:
            health = self._health.get(target)
            if health is not None and now - health.up_at < PROBATION_S:
                return True  # on probation
        return self._releases % CHECK_EVERY == 1

    def released(self, endpoint: str | None, now: float) -> bool:
        """A release went to ``endpoint``: recorded (:meth:`record_release`); whether to read its response headers for a
        failure (:meth:`check_release`). One call where every release made two."""
        checked = self.check_release(endpoint, now)
        self.record_release(endpoint, now)
        return checked

    def mark_down(self, endpoint: str, now: float) -> None:
        health = self._health.get(endpoint)
        if health is not None and health.down_at is None:
            self.version += 1
            health.down_at = now
            self._up_changed()

    def is_down(self, endpoint: str) -> bool:
        return self._health[endpoint].down_at is not None

    def down(self) -> list[str]:
        """Endpoints whose engine cannot be reached now: nothing is released to them."""
        return [e for e, h in self._health.items() if h.down_at is not None]

    def serving(self) -> tuple[str, ...]:
        """Endpoints that are up (their metrics may still be degraded): ``up``."""
        return self.up

    def healthy(self, endpoint: str, now: float) -> bool:
        health = self._health[endpoint]
        return health.down_at is None and not health.failing and now - health.good_at <= self._stale_after_s

    def degraded(self, now: float) -> tuple[str, ...]:
        """Endpoints whose metrics are unusable now (down ones included)."""
        known = self._degraded
        stale = self._stale_after_s
        # Subtraction is monotonic: the freshest stale page and the oldest fresh one decide for every endpoint.
        if known.version == self.version and now - known.newest_stale > stale and now - known.oldest_fresh <= stale:
            return known.endpoints
        newest_stale, oldest_fresh, unusable = -math.inf, math.inf, []
        for endpoint, health in self._health.items():
            if health.down_at is not None or health.failing:
                unusable.append(endpoint)
            elif now - health.good_at <= stale:  # healthy(), the same test
                oldest_fresh = min(oldest_fresh, health.good_at)
            else:
                unusable.append(endpoint)
                newest_stale = max(newest_stale, health.good_at)
        self._degraded = _Degraded(self.version, newest_stale, oldest_fresh, tuple(unusable))
        return self._degraded.endpoints

    def stable_until(self, now: float) -> float:
        """Until when :meth:`degraded` stays what it is at ``now`` unless an event comes: the first usable page's staleness."""
        return min((h.good_at + self._stale_after_s for e, h in self._health.items() if self.healthy(e, now)),
                   default=math.inf)

    def fallback_limit(self, endpoint: str) -> int:
        """In-flight cap on a degraded endpoint, derived from its last good state."""
        last = self._health[endpoint].last_good
        return max(self._floor, int((last.running if last is not None else 0.0) // 2))

    def good_at(self, endpoint: str) -> float:
        """When the endpoint's last usable scrape started (-inf: never)."""
        return self._health[endpoint].good_at

    def last_good(self, endpoint: str) -> EngineLoad | None:
        """The endpoint's last usable scrape (None: never scraped successfully)."""
        return self._health[endpoint].last_good
