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
    # Prefix-cache affinity key (endpoint picking) and the endpoint picked on release.
    affinity: str = ""
    endpoint: str | None = None


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
        itl_ms = model.max_inter_token_latency_ms
        self.gate = Gate(
            model.endpoints,
            target_waiting=model.target_waiting,
            fallback_max_in_flight=model.fallback_max_in_flight,
            stale_after_s=model.stale_after_s,
            kind=model.gate,
            max_in_flight=model.max_in_flight,
            release_rate=model.release_rate,
            max_itl_s=None if itl_ms is None else itl_ms / 1000,
            max_kv_usage=model.max_kv_usage,
            itl_window_s=model.itl_window_s,
            pick_endpoints=model.endpoint_picking,
        )
        self._mode: GateMode | None = None
        self._degraded: set[str] = set()
        # static_rate: a wake-up when the next release becomes due (no other event will come).
        self._wakeup: asyncio.TimerHandle | None = None

    @property
    def queued(self) -> int:
        return len(self._queue)

    def submit(self, tenant: str, band: int, affinity: str = "") -> Held:
        """Queue a request and dispatch; the returned future may already be resolved.

        ``affinity`` groups requests that share a prompt prefix (endpoint picking
        keeps them on one engine); empty means the tenant.
        """
        loop = asyncio.get_running_loop()
        held = Held(tenant, band, self._clock(), loop.create_future(), affinity=affinity or tenant)
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
        name = self.model.name
        if load is None:
            self._telemetry.scrape_errors.labels(name, endpoint).inc()
        else:
            self._telemetry.engine_waiting.labels(name, endpoint).set(load.waiting)
            self._telemetry.engine_running.labels(name, endpoint).set(load.running)
            if load.kv_usage is not None:
                self._telemetry.engine_kv_usage.labels(name, endpoint).set(load.kv_usage)
            itl = self.gate.itl(endpoint)
            if itl is not None:
                self._telemetry.engine_itl.labels(name, endpoint).set(itl)
            self._telemetry.gate_limit.labels(name, endpoint).set(self.gate.limit(endpoint))
        self.dispatch()

    def set_endpoints(self, endpoints: tuple[str, ...]) -> None:
        """The pool's membership changed (DNS); forget the telemetry of endpoints that left."""
        for gone in set(self.gate.endpoints) - set(endpoints):
            for gauge in self._telemetry.per_endpoint_gauges():
                try:
                    gauge.remove(self.model.name, gone)
                except KeyError:
                    pass
        self.gate.set_endpoints(endpoints)
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
            if self.model.endpoint_picking:
                held.endpoint = self.gate.pick(held.affinity, now)
            self.gate.record_release(held, now, held.endpoint)
            self._resolve(held)
            priority = self._priorities[band]
            self._telemetry.released.labels(self.model.name, priority).inc()
            self._telemetry.queue_wait.labels(self.model.name, priority).observe(now - held.enqueued_at)
            allowance -= 1
        self._telemetry.in_flight.labels(self.model.name).set(self.gate.in_flight)
        self._schedule_wakeup(now)

    def _schedule_wakeup(self, now: float) -> None:
        due = self.gate.next_change_in(now)
        if due is None or not len(self._queue) or self._wakeup is not None:
            return

        def wake() -> None:
            self._wakeup = None
            self.dispatch()

        self._wakeup = asyncio.get_running_loop().call_later(due, wake)

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
        degraded = set(self.gate.degraded(now))
        for endpoint in degraded - self._degraded:
            self._telemetry.endpoint_degraded.labels(self.model.name, endpoint).set(1)
            if self.gate.last_good(endpoint) is None:
                continue  # not scraped yet (start-up, a new DNS member): the scraper reports failures
            log.warning("model %s: metrics of %s unusable (failing or stale), capping it at %d in flight",
                        self.model.name, endpoint, self.gate.fallback_limit(endpoint))
        for endpoint in self._degraded - degraded:
            self._telemetry.endpoint_degraded.labels(self.model.name, endpoint).set(0)
            log.info("model %s: metrics of %s usable again", self.model.name, endpoint)
        self._degraded = degraded
        mode = self.gate.mode(now)
        if mode is not self._mode:
            fallback = mode is GateMode.FALLBACK
            self._telemetry.gate_fallback.labels(self.model.name).set(1 if fallback else 0)
            if fallback and self._mode is not None:
                log.warning("model %s: gating on the fallback in-flight limits", self.model.name)
            elif self._mode is not None:
                log.info("model %s: engine metrics usable again, gating on the engine queue", self.model.name)
            self._mode = mode
