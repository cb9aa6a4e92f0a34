"""Waiting for something to happen, up to a deadline, instead of sleeping a fixed time before asserting it.

A fixed sleep is slow where the thing is quick (the test always waits it out)
and flaky where the machine is loaded (the thing may take longer). ``eventually``
looks often, returns as soon as the condition holds and fails, naming what it
waited for, only once the deadline has passed. A condition that must *not*
happen is waited for the same way through evidence that it had its chance: a
count of the looks, scrapes or probes that would have made it happen.

The deadline is a guard against a hang, not a claim about speed: it is
generous (``TIMEOUT_S``), as a condition that holds returns at once however
long the guard, and a machine busy with other work must not fail a test.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable

LOOK_S = 0.01
TIMEOUT_S = 30.0


async def eventually(condition: Callable[[], bool | Awaitable[bool]], timeout_s: float = TIMEOUT_S, what: str = "") -> None:
    """Until ``condition()`` (a bool, or an awaitable of one) is true; AssertionError after ``timeout_s``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        held = condition()
        if inspect.isawaitable(held):
            held = await held
        if held:
            return
        if loop.time() >= deadline:
            raise AssertionError(f"not within {timeout_s} s: {what or getattr(condition, '__name__', 'the condition')}")
        await asyncio.sleep(LOOK_S)
