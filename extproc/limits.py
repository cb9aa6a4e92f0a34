"""Honest answers when a request cannot be queued or waited too long.

Every limit ends the request at once with an OpenAI-style JSON error, a
``Retry-After`` header and the reason in ``x-extproc-reason`` (the table is
in docs/policies.md):

=====================  ======  ===========================================
reason                 status  why this status
=====================  ======  ===========================================
``tenant_queue_full``  429     the tenant's own backlog is at its cap: it
                               sends faster than its share; slow down
``band_queue_full``    503     the priority class is full for everyone
``model_queue_full``   503     the model is overloaded for everyone
``queue_timeout``      503     no capacity freed up within the class's
                               max_queue_wait_s: a server-side condition
=====================  ======  ===========================================

``Retry-After`` is how long the queue that overflowed (or the timed-out
request's class) would take to drain at the model's recent release rate,
between ``MIN_RETRY_AFTER_S`` and ``MAX_RETRY_AFTER_S`` seconds — the maximum
when nothing was released recently.

Pure: times are passed in.
"""

from __future__ import annotations

import math
from collections import deque

MIN_RETRY_AFTER_S = 1
MAX_RETRY_AFTER_S = 60
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

    def retry_after_s(self, backlog: int, now: float) -> int:
        rate = self.per_second(now)
        if rate <= 0:
            return MAX_RETRY_AFTER_S
        return min(MAX_RETRY_AFTER_S, max(MIN_RETRY_AFTER_S, math.ceil(backlog / rate)))

    def _trim(self, now: float) -> None:
        while self._times and self._times[0] <= now - RATE_WINDOW_S:
            self._times.popleft()
