"""What one model's demand asks of its engines: the numbers an autoscaler scales the engines on.

Behind the gateway the engines' own queues stay at ``target_waiting`` however
many requests are held, so an autoscaler reading the engines' metrics sees no
demand. These numbers are the demand as the gateway holds it:

* per class, the requests **held** here and **in flight** at the engines;
* **engines needed**: the places the requests need, over what one endpoint
  holds at its learned limit (the release rule's per-endpoint limit: for the
  adaptive rule its batch plus ``target_waiting``; the mean over the ready
  endpoints; with none ready, the last mean seen, as a pool scaled to zero
  keeps its engines' size; else ``max_running + target_waiting`` where the
  operator said the batch size). The places are the flow's, by Little's law:
  the arrival rate times the time a released request stays in flight (the
  number the arrivals keep busy, however many happen to be in flight this
  instant, which swings with every arrival and end), plus, for each held
  request, the share of a place that starts it within its class's queue wait
  (before it would be refused): its time in flight over that wait. A backlog
  the engines there clear in time is no reason to start one (the classes'
  objectives are kept by their order, not by more engines), and a queue that
  keeps growing shows in the arrival rate already. At least one request's
  place while anything is held or in flight, however slow the flow. Before
  any request finished (no time in flight known), every request held or in
  flight counts as a place; with no size known at all, 1 while anything is
  held. 0 with nothing held or in flight;
* **time to drain**: how long the held requests take to leave at the release
  rate observed (``drain_time.py``): 0 with nothing held, inf while nothing
  was released lately (no engine);
* the pool as the Gateway API Inference Extension's pool metrics describe it:
  ready endpoints (up, their metrics usable), their mean running requests and
  KV-cache usage, and the mean queue per ready endpoint, the requests held here
  counted with the engines' own waiting (what those queues would hold without
  the gateway; with no endpoint ready, the whole queue).

Computed on request (a Prometheus scrape), from state the model keeps anyway
and the flow's two records (an arrival's time, a finished request's time in
flight: an append each on a request's path).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from extproc.core.bands import Band
from extproc.core.drain_time import RATE_WINDOW_S
from extproc.core.release.pool import Pool

# Finished requests whose times in flight are averaged.
SERVICE_SAMPLES = 64


@dataclass(frozen=True, slots=True)
class Demand:
    """One model's demand now (see the module docstring)."""

    # Per class, in the bands' order: requests held here, and released and not finished.
    held: tuple[int, ...]
    in_flight: tuple[int, ...]
    # Requests one endpoint holds at its limit (None: not known yet), and the engines the demand needs.
    per_engine: float | None
    engines: float
    drain_s: float
    # Endpoints up with usable metrics, and per ready endpoint: the mean queue (held here included), running, KV usage.
    ready: int
    mean_queue: float
    mean_running: float
    mean_kv_usage: float


class Flow:
    """The model's arrival rate (the last ``RATE_WINDOW_S``) and its requests' mean time in flight (the last
    ``SERVICE_SAMPLES`` finished, however long ago: a pool scaled to zero keeps its requests' length)."""

    def __init__(self) -> None:
        self._arrivals: deque[float] = deque()
        self._service: deque[float] = deque(maxlen=SERVICE_SAMPLES)

    def arrived(self, now: float) -> None:
        self._arrivals.append(now)
        self._trim(now)

    def finished(self, in_flight_s: float) -> None:
        self._service.append(in_flight_s)

    def arrival_rate(self, now: float) -> float:
        self._trim(now)
        return len(self._arrivals) / RATE_WINDOW_S

    def service_s(self) -> float | None:
        """The mean time in flight of the last finished requests; None before any finished."""
        return sum(self._service) / len(self._service) if self._service else None

    def _trim(self, now: float) -> None:
        while self._arrivals and self._arrivals[0] <= now - RATE_WINDOW_S:
            self._arrivals.popleft()


class DemandGauge:
    """Reads one model's demand; keeps its flow, and the size of its engines while none is ready (a pool scaled to
    zero)."""

    def __init__(self) -> None:
        self._per_engine: float | None = None
        self._flow = Flow()

    def arrived(self, now: float) -> None:
        """A request arrived (queued)."""
        self._flow.arrived(now)

    def finished(self, in_flight_s: float) -> None:
        """A released request finished, ``in_flight_s`` after its release."""
        self._flow.finished(in_flight_s)

    def read(self, pool: Pool, held: tuple[int, ...], in_flight: tuple[int, ...], release_rate: float,
             bands: tuple[Band, ...], model_wait_s: float, now: float) -> Demand:
        """The demand of ``held`` and ``in_flight`` requests per class (``bands``) on ``pool``, released at
        ``release_rate`` per s; a held request must start within its class's queue wait (the model's
        ``model_wait_s`` unless the class has its own)."""
        waits = tuple(band.queue_wait_s(model_wait_s) for band in bands)
        ready = pool.ready(now)
        limits = [limit for e in ready if (limit := pool.snapshot(e).limit) is not None]
        if limits:
            self._per_engine = sum(limits) / len(limits)
        per_engine = self._per_engine
        if per_engine is None and pool.settings.max_running is not None:
            per_engine = float(pool.settings.max_running + pool.settings.target_waiting)
        queued, total = sum(held), sum(held) + sum(in_flight)
        engines = 0.0 if not total else _places(self._flow, held, waits, total, now) / per_engine if per_engine else 1.0
        drain_s = 0.0 if not queued else queued / release_rate if release_rate > 0 else math.inf
        loads = [load for e in ready if (load := pool.last_good(e)) is not None]
        kv = [load.kv_usage for load in loads if load.kv_usage is not None]
        count = max(1, len(ready))
        return Demand(
            held=held, in_flight=in_flight, per_engine=per_engine, engines=engines, drain_s=drain_s,
            ready=len(ready),
            mean_queue=(queued + sum(load.waiting for load in loads)) / count,
            mean_running=sum(load.running for load in loads) / count,
            mean_kv_usage=sum(kv) / count,
        )


def _places(flow: Flow, held: tuple[int, ...], waits: tuple[float, ...], total: int, now: float) -> float:
    """The places (running or waiting in an engine) that ``total`` requests held and in flight need, ``held`` of them
    per class held here, each to start within its class's ``waits`` (see the module docstring)."""
    service_s = flow.service_s()
    if service_s is None:
        return float(total)
    backlog = sum(count * service_s / wait for count, wait in zip(held, waits, strict=True))
    return max(1.0, flow.arrival_rate(now) * service_s + backlog)
