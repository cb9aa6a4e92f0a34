"""The core's deadlines (``core/timers.py``) as event-loop timers, and its futures on the same loop.

The loop's timers do not run on the core's clock: libuv (uvloop) times them
from the loop's cached time, which can lag ``time.monotonic``, so a timer may
fire early by the core's clock. A timer that fires early re-arms itself for
the time that remains, so a request is refused only once it has waited its
limit (tests/core/test_queue_timeout.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any


class LoopTimers:
    """:class:`~extproc.core.timers.Timers` on the running asyncio loop, by the core's clock."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock

    def at(self, deadline: float, callback: Callable[[], None]) -> LoopTimer:
        return LoopTimer(self._clock, deadline, callback)

    def future(self) -> asyncio.Future[Any]:
        return asyncio.get_running_loop().create_future()


class LoopTimer:
    __slots__ = ("_callback", "_clock", "_deadline", "_handle")

    def __init__(self, clock: Callable[[], float], deadline: float, callback: Callable[[], None]) -> None:
        self._clock = clock
        self._deadline = deadline
        self._callback = callback
        self._handle = asyncio.get_running_loop().call_later(max(0.0, deadline - clock()), self._fire)

    def _fire(self) -> None:
        remaining = self._deadline - self._clock()
        if remaining > 0:
            self._handle = asyncio.get_running_loop().call_later(remaining, self._fire)
        else:
            self._callback()

    def cancel(self) -> None:
        self._handle.cancel()
        # The callback holds what it was armed for (a held request), which holds this timer: dropped, the two
        # are freed at once instead of waiting for the cyclic GC (tests/adapters/test_loop_timer.py).
        self._callback = _nothing


def _nothing() -> None:
    """A cancelled timer's callback: a cancelled uvloop handle never runs it, this only replaces the real one."""
