"""Events written after the replies: a request's metrics leave its time to the gate.

A request released at once reports three or four events on its way through
(admitted, released, queued with the decision's latency, signed), each a few Prometheus
writes under a lock; made where they happen, they sit between the request's
arrival and its release reply, on the latency every request pays. While the
processor serves, its recorders hand each event here instead, and the batch
is written in a callback queued behind the work ready on the event loop: the
transport's write of the replies is queued first, so the reply leaves before
the metrics are written. Events are written in the order they came, all of
them, within a pass of the loop; a scrape sees a request's events all or
none. Outside a running server (tests, tools) nothing is deferred.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


class Deferral:
    """Holds events, with the recorder's writer of each, until :meth:`settle` writes them; at once while not started."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending: list[tuple[Callable[[Any], None], Any]] = []

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Defer from now on, each batch written in a callback of ``loop``."""
        self._loop = loop

    def stop(self) -> None:
        """Write what is held, and every event at once from now on."""
        self._loop = None
        self.settle()

    def __call__(self, write: Callable[[Any], None], event: Any) -> None:
        if self._loop is None:
            write(event)
            return
        if not self._pending:
            self._loop.call_soon(self.settle)
        self._pending.append((write, event))

    def settle(self) -> None:
        """Write every event held (before anything that recounts the series from the queue: a reload's relabel).

        A writer that fails is logged and the rest are still written: one bad
        event must not take the other requests' metrics of the pass with it.
        """
        pending, self._pending = self._pending, []
        for write, event in pending:
            try:
                write(event)
            except Exception:
                log.exception("a telemetry event could not be written: %r", event)
