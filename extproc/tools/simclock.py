"""Simulated time: one heap of timed events, and the core's timers (``core/timers.py``) on it.

The simulations that run the scheduling core without sockets, a clock or
sleeps (``autoscale_sim.py``; ``tests/coresim.py``'s, which the work-conserving,
lent-slot and trace tests run) keep their time here, so a simulated day takes
seconds and every run is exactly repeatable. Events due at the same time run
in the order they were scheduled: a sequence number breaks the tie, never the
callbacks. The dispatcher's deadlines (:meth:`EventHeap.at`) are events like
any other, and a cancelled one does nothing when its time comes.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable
from typing import Any


class SimTimer:
    """A deadline on the heap (``core/timers.py``'s Timer): once cancelled, its callback does not run."""

    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class EventHeap:
    """Timed events in simulated time; :attr:`now` is the time of the event that runs (or ran last)."""

    def __init__(self) -> None:
        self.now = 0.0
        # (at, seq, run): plain tuples, compared in C; ``seq`` is unique, so ``run`` is never compared.
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()

    def call_at(self, at: float, run: Callable[[], None]) -> None:
        """Run ``run`` when the simulated time reaches ``at``, after what was scheduled for then before it."""
        heapq.heappush(self._heap, (at, next(self._seq), run))

    def next_at(self) -> float | None:
        """When the next event is due; None once none is left."""
        return self._heap[0][0] if self._heap else None

    def run_next(self) -> None:
        """The next event: the time moves to it, and it runs."""
        self.now, _, run = heapq.heappop(self._heap)
        run()

    # --- Timers (core/timers.py): the dispatcher's deadlines on the same heap -------------------------

    def at(self, deadline: float, callback: Callable[[], None]) -> SimTimer:
        timer = SimTimer()
        self.call_at(deadline, lambda: None if timer.cancelled else callback())
        return timer

    def future(self) -> asyncio.Future[Any]:
        return asyncio.get_running_loop().create_future()
