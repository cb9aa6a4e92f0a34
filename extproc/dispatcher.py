"""Per-model glue between held requests, the fair queue and the gate.

Each held request is an ``asyncio.Future`` that the ext_proc stream awaits.
Dispatch — pop from the fair queue while the gate allows — runs only when
something changed: a request arrived, a response finished, or a scrape
reported. There is no polling loop; an idle model costs nothing.

Every request that enters ends exactly one way: released (future result),
rejected (future exception :class:`Rejected`), or abandoned (its client left:
the stream's task was cancelled and the entry is removed at once).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from extproc.config import ModelConfig
from extproc.gate import EngineLoad, Gate, GateMode
from extproc.scheduler import FairQueue
from extproc.telemetry import Telemetry

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Rejected(Exception):
    """The processor answers instead of the engine: HTTP status, reason code, message."""

    status: int
    reason: str
    message: str
    retry_after_s: int | None = None


@dataclass(eq=False)
class Held:
    """One request in the queue; identity-hashed so equal-looking requests stay distinct."""

    tenant: str
    band: int
    enqueued_at: float
    future: asyncio.Future[float] = field(repr=False)
    expiry: asyncio.TimerHandle | None = field(default=None, repr=False)
    released: bool = False
    ended: bool = False


class ModelDispatcher:
    def __init__(
        self,
        model: ModelConfig,
        priorities: tuple[str, ...],
        telemetry: Telemetry,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.model = model
        self._priorities = priorities
        self._telemetry = telemetry
        self._clock = clock
        self._queue: FairQueue[Held] = FairQueue(len(priorities))
        self.gate = Gate(
            model.endpoints,
            target_waiting=model.target_waiting,
            fallback_max_in_flight=model.fallback_max_in_flight,
            stale_after_s=model.stale_after_s,
        )
        self._mode: GateMode | None = None

    @property
    def queued(self) -> int:
        return len(self._queue)

    def submit(self, tenant: str, band: int) -> Held:
        """Queue a request and dispatch; the returned future may already be resolved."""
        loop = asyncio.get_running_loop()
        held = Held(tenant, band, self._clock(), loop.create_future())
        self._queue.push(band, tenant, held)
        held.expiry = loop.call_later(self.model.max_queue_wait_s, self._expire, held)
        self.dispatch()
        self._update_depth(band)
        return held

    def end(self, held: Held) -> None:
        """The request's stream is over, whatever happened; safe to call more than once.

        Queued: its client left, forget it now. Released: its response has
        finished (or failed, or its client left), which frees an engine slot.
        Rejected: nothing left to do.
        """
        if held.ended:
            return
        held.ended = True
        if held.released:
            self.gate.record_finish(held, self._clock())
            self._telemetry.in_flight.labels(self.model.name).set(self.gate.in_flight)
            self.dispatch()
        elif self._queue.remove(held.band, held.tenant, held):
            self._resolve(held)
            self._telemetry.abandoned.labels(self.model.name, self._priorities[held.band]).inc()
            self._update_depth(held.band)

    def record_scrape(self, endpoint: str, load: EngineLoad | None, started_at: float) -> None:
        self.gate.record_scrape(endpoint, load, started_at)
        if load is None:
            self._telemetry.scrape_errors.labels(self.model.name, endpoint).inc()
        else:
            self._telemetry.engine_waiting.labels(self.model.name, endpoint).set(load.waiting)
            self._telemetry.engine_running.labels(self.model.name, endpoint).set(load.running)
        self.dispatch()

    def reject_all(self, rejection: Rejected) -> None:
        """End every queued request with ``rejection`` (used when draining runs out of time)."""
        while len(self._queue):
            band, _, held = self._queue.pop()
            self._resolve(held, rejection)
            self._update_depth(band)

    def dispatch(self) -> None:
        now = self._clock()
        self._note_mode(now)
        allowance = self.gate.allowance(now)
        while allowance > 0 and len(self._queue):
            band, _, held = self._queue.pop()
            self._update_depth(band)
            if held.future.done():  # its stream was cancelled a moment ago; end() will not find it
                self._resolve(held)
                self._telemetry.abandoned.labels(self.model.name, self._priorities[band]).inc()
                continue
            held.released = True
            self.gate.record_release(held, now)
            self._resolve(held)
            priority = self._priorities[band]
            self._telemetry.released.labels(self.model.name, priority).inc()
            self._telemetry.queue_wait.labels(self.model.name, priority).observe(now - held.enqueued_at)
            allowance -= 1
        self._telemetry.in_flight.labels(self.model.name).set(self.gate.in_flight)

    def _expire(self, held: Held) -> None:
        if self._queue.remove(held.band, held.tenant, held):
            waited = self._clock() - held.enqueued_at
            self._telemetry.rejected.labels(self.model.name, "queue_timeout").inc()
            self._telemetry.queue_wait.labels(self.model.name, self._priorities[held.band]).observe(waited)
            self._resolve(
                held,
                Rejected(503, "queue_timeout", f"request waited {waited:.0f}s in the queue for model "
                         f"{self.model.name!r} without capacity", retry_after_s=10),
            )
            self._update_depth(held.band)

    def _resolve(self, held: Held, rejection: Rejected | None = None) -> None:
        if held.expiry is not None:
            held.expiry.cancel()
        if held.future.done():
            return
        if rejection is None:
            held.future.set_result(self._clock() - held.enqueued_at)
        else:
            held.future.set_exception(rejection)

    def _update_depth(self, band: int) -> None:
        self._telemetry.queue_depth.labels(self.model.name, self._priorities[band]).set(self._queue.band_len(band))

    def _note_mode(self, now: float) -> None:
        mode = self.gate.mode(now)
        if mode is not self._mode:
            fallback = mode is GateMode.FALLBACK
            self._telemetry.gate_fallback.labels(self.model.name).set(1 if fallback else 0)
            if fallback:
                log.warning("model %s: engine metrics unusable, releasing with fallback in-flight limit %d/endpoint",
                            self.model.name, self.model.fallback_max_in_flight)
            elif self._mode is not None:
                log.info("model %s: engine metrics usable again, gating on the engine queue", self.model.name)
            self._mode = mode
