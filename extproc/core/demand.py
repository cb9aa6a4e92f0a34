"""What one model's demand asks of its engines: the numbers an autoscaler scales the engines on.

Behind the gateway the engines' own queues stay at ``target_waiting`` however
many requests are held, so an autoscaler reading the engines' metrics sees no
demand. These numbers are the demand as the gateway holds it:

* per class, the requests **held** here and **in flight** at the engines;
* **engines needed**: held and in flight together, over what one endpoint
  holds at its learned limit (the release rule's per-endpoint limit: for the
  adaptive rule its batch plus ``target_waiting``). The mean over the ready
  endpoints; with none ready, the last mean seen (a pool scaled to zero keeps
  its engines' size), else ``max_running + target_waiting`` where the operator
  said the batch size; and with nothing known at all, 1 while anything is
  held. 0 with nothing held or in flight;
* **time to drain**: how long the held requests take to leave at the release
  rate observed (``drain_time.py``): 0 with nothing held, inf while nothing
  was released lately (no engine);
* the pool as the Gateway API Inference Extension's pool metrics describe it:
  ready endpoints (up, their metrics usable), their mean running requests and
  KV-cache usage, and the mean queue per ready endpoint, the requests held here
  counted with the engines' own waiting (what those queues would hold without
  the gateway; with no endpoint ready, the whole queue).

Computed on request (a Prometheus scrape), from state the model keeps anyway:
nothing on a request's path.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from extproc.core.release.pool import Pool


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


class DemandGauge:
    """Reads one model's demand; remembers the size of its engines while none is ready (a pool scaled to zero)."""

    def __init__(self) -> None:
        self._per_engine: float | None = None

    def read(self, pool: Pool, held: tuple[int, ...], in_flight: tuple[int, ...], release_rate: float,
             now: float) -> Demand:
        """The demand of ``held`` and ``in_flight`` requests per class on ``pool``, released at ``release_rate`` per s."""
        ready = pool.ready(now)
        limits = [limit for e in ready if (limit := pool.snapshot(e).limit) is not None]
        if limits:
            self._per_engine = sum(limits) / len(limits)
        per_engine = self._per_engine
        if per_engine is None and pool.settings.max_running is not None:
            per_engine = float(pool.settings.max_running + pool.settings.target_waiting)
        queued, total = sum(held), sum(held) + sum(in_flight)
        engines = 0.0 if not total else total / per_engine if per_engine else 1.0
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
