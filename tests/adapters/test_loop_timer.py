"""A cancelled loop timer lets go of its callback, so what it was armed for is freed at once.

The queue-wait timer's callback holds its held request, which holds the timer:
a cycle per request, left to the cyclic GC, unless cancelling breaks it.
"""

from __future__ import annotations

import gc
import time
import weakref

import pytest

from extproc.adapters.timers import LoopTimer, LoopTimers

pytestmark = pytest.mark.unit


class _Armed:
    timer: LoopTimer | None = None


def _arm() -> weakref.ref[_Armed]:
    armed = _Armed()
    armed.timer = LoopTimers().at(time.monotonic() + 60, lambda: print(armed))  # armed -> timer -> lambda -> armed
    armed.timer.cancel()
    return weakref.ref(armed)


async def test_a_cancelled_timer_and_what_its_callback_holds_are_freed_without_the_cyclic_gc() -> None:
    gc.disable()
    try:
        assert _arm()() is None
    finally:
        gc.enable()
