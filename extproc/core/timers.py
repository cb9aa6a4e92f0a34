"""When the core wants to be called back: deadlines on its own clock, armed by the adapter.

The core keeps no event loop. A queued request's longest wait and a rate's
next release are deadlines on the clock the core is given; the adapter that
owns the loop (``adapters/timers.py``) turns each into a timer and promises
the callback never runs before the core's clock reads the deadline, whatever
clock the loop's timers run on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol


class Timer(Protocol):
    def cancel(self) -> None:
        """The callback will not run (a no-op once it has)."""


class Timers(Protocol):
    def at(self, deadline: float, callback: Callable[[], None]) -> Timer:
        """Run ``callback`` once, when the core's clock reads ``deadline`` or later."""
        ...
