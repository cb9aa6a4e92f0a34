"""What the core asks of the event loop it does not keep: deadlines on its own clock, and futures to resolve.

The core keeps no event loop and looks for none. A queued request's longest
wait and a rate's next release are deadlines on the clock the core is given;
the adapter that owns the loop (``adapters/timers.py``) turns each into a
timer and promises the callback never runs before the core's clock reads the
deadline, whatever clock the loop's timers run on. The futures a held
request's stream awaits (``Held.future``, ``Held.preempted``) are made by the
same adapter, on its loop: the core only resolves them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol


class Timer(Protocol):
    def cancel(self) -> None:
        """The callback will not run (a no-op once it has)."""


class Timers(Protocol):
    def at(self, deadline: float, callback: Callable[[], None]) -> Timer:
        """Run ``callback`` once, when the core's clock reads ``deadline`` or later."""
        ...

    def future(self) -> asyncio.Future[Any]:
        """A new future on the adapter's loop, for a held request's stream to await and the core to resolve."""
        ...
