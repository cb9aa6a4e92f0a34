"""The model's recent release rate: how long a backlog would take to drain.

A refusal for a full queue or a timeout carries that drain time, so the
client can be told when to come back (``Retry-After``, chosen in the ext_proc
adapter).

Pure: times are passed in.
"""

from __future__ import annotations

from collections import deque

# Releases counted for the rate.
RATE_WINDOW_S = 10.0


class ReleaseRate:
    """Releases per second over the last ``RATE_WINDOW_S``."""

    def __init__(self) -> None:
        self._times: deque[float] = deque()

    def record(self, now: float) -> None:
        self._times.append(now)
        self._trim(now)

    def per_second(self, now: float) -> float:
        self._trim(now)
        return len(self._times) / RATE_WINDOW_S

    def drain_s(self, backlog: int, now: float) -> float:
        """Seconds ``backlog`` requests take at the recent rate; inf when nothing was released lately."""
        rate = self.per_second(now)
        return backlog / rate if rate > 0 else float("inf")

    def _trim(self, now: float) -> None:
        while self._times and self._times[0] <= now - RATE_WINDOW_S:
            self._times.popleft()
