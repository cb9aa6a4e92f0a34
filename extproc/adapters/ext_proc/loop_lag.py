"""How far behind the event loop runs: the processor's measure of its own overload.

Envoy times the processor's first reply on each stream (``message_timeout``,
2 s by default) from the moment it sends the request headers. In a burst the
streams wait their turn in gRPC's and the event loop's queues, where no
per-stream age is visible to Python; what is visible is how late a short
timer fires, since it waits in the same queue. A probe every
:data:`PROBE_S` records that delay. While it is small, nothing changes; when
it grows the servicer acknowledges first and decides after, and past the shed
bound it answers ``overloaded`` at once (a JSON 503 with ``Retry-After``)
rather than let Envoy answer a bare 504 a moment later.
"""

from __future__ import annotations

import asyncio

PROBE_S = 0.02


class LoopLag:
    """How late the loop runs a timer, in seconds: 0 before the probe starts."""

    def __init__(self) -> None:
        self._measured = 0.0
        self._due: float | None = None
        self._task: asyncio.Task[None] | None = None

    def seconds(self, now: float) -> float:
        """The last probe's lateness, or more if the pending probe is already overdue at ``now`` (loop time)."""
        overdue = 0.0 if self._due is None else now - self._due
        return max(self._measured, overdue)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._probe())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _probe(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._due = loop.time() + PROBE_S
            await asyncio.sleep(PROBE_S)
            self._measured = max(0.0, loop.time() - self._due)
