"""How far behind the event loop runs, and for how long: the processor's measure of its own overload.

Envoy times the processor's first reply on each stream (``message_timeout``,
2 s by default) from the moment it sends the request headers. In a burst the
streams wait their turn in the socket's and the event loop's queues, where no
per-stream age is visible to Python; what is visible is how late a short
timer fires, since it waits in the same queue. A probe every
:data:`PROBE_S` records that delay, and since when every probe has been late
by ``late_s`` or more: one late probe is a stall, over once it is measured; a
run of them is a loop that has not caught up since.

While the loop is on time nothing changes. A late stream is acknowledged
first and decided after (the servicer); a run of late probes as long as
``shedding.py`` calls sustained has the lowest class present shed.
"""

from __future__ import annotations

import asyncio

PROBE_S = 0.02
# A probe this late counts as late by default (the servicer passes its ACK_LAG_S, the same).
LATE_S = 0.05


class LoopLag:
    """How late the loop runs a timer, in seconds (0 before the probe starts), and for how long it has run late."""

    def __init__(self, late_s: float = LATE_S) -> None:
        self._late_s = late_s
        self._measured = 0.0
        self._due: float | None = None
        # When the first probe of the current run of late ones fired; None: the last probe was on time.
        self._late_since: float | None = None
        self._task: asyncio.Task[None] | None = None

    def seconds(self, now: float) -> float:
        """The last probe's lateness, or more if the pending probe is already overdue at ``now`` (loop time)."""
        overdue = 0.0 if self._due is None else now - self._due
        return max(self._measured, overdue)

    def late_for(self, now: float) -> float:
        """For how long every probe has been late at ``now``: 0 while the last was on time.

        Counted from the moment the first late probe of the run fired, not
        from when it was due: the stall it measured is over by then, so one
        stall of any length, after which the loop is on time again, counts 0.
        """
        return 0.0 if self._late_since is None else now - self._late_since

    def record(self, fired_at: float, late_s: float) -> None:
        """One probe fired at ``fired_at``, ``late_s`` after it was due."""
        self._measured = late_s
        if late_s < self._late_s:
            self._late_since = None
        elif self._late_since is None:
            self._late_since = fired_at

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
            now = loop.time()
            self.record(now, max(0.0, now - self._due))
