"""``extproc-dev autoscale --simulated``: the same day in simulated time, in seconds, exactly repeatable.

The stack run (``autoscale.py``) is the measurement; this one is for trying
a demand series or a rule quickly, on a machine whose load does not move the
numbers. What runs is the model's dispatcher as ``extproc serve`` builds it
from the same config (its bands, gate, cold-start wait, endpoint picking),
one simulated engine per pod (the simulator's pure ``Scheduler``, the stack
run's engine settings), the same arrivals and the same :class:`ScaleRule`,
on one heap of timed events (``simclock.py``). What connects them is what the stack does:

* the processor looks the pool's name up every ``dns_refresh_s`` and
  scrapes each member every ``scrape_interval_s`` (the config's);
* a released request reaches its engine ``LAG_S`` later, at the start of a
  step; its first token begins its response; its stream ends ``END_LAG_S``
  after its last token;
* an engine is in the name's addresses from its readiness on; stopped, it
  leaves them, gets SIGTERM 2 x ``dns_refresh_s`` later, finishes what it
  runs and exits (its engine-seconds end there).

Not modelled: Envoy, the network, the processor's own CPU (in the stack run
they add tens of milliseconds and, on a loaded machine, more).
"""

from __future__ import annotations

import asyncio
import itertools
import math
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from extproc.adapters.config import load_config
from extproc.adapters.wiring import build_pool
from extproc.core.dispatcher import Held, ModelDispatcher
from extproc.core.policies import POLICIES
from extproc.core.release.answer import Answer
from extproc.core.values.engine_load import EngineLoad
from extproc.tools.autoscale import MODEL, TENANTS, Engine, Result, Run, ScaleRule, Settings, arrivals, write_config
from extproc.tools.sim.engine import Scheduler, SimRequest, SimSettings
from extproc.tools.simclock import EventHeap

# From a release to the engine (Envoy and the API server), and from the last token to the stream's end.
LAG_S = 0.06
END_LAG_S = 0.002
PROMPT_TOKENS = 20


@dataclass
class _Pod:
    """One engine: its record in the run, its scheduler, what reached it and when its step ends."""

    record: Engine
    scheduler: Scheduler
    inbox: list[tuple[SimRequest, _Request]] = field(default_factory=list)
    step_end: float | None = None
    leaving: bool = False  # out of the name's addresses
    sigterm: bool = False


@dataclass
class _Request:
    at: float
    band: str
    cold: bool
    held: Held
    first_token_at: float | None = None
    done: bool = False


class DaySim(EventHeap):
    """The day on one event heap (see the module docstring); its timers are the dispatcher's."""

    def __init__(self, settings: Settings, workdir: Path) -> None:
        super().__init__()
        config = load_config(write_config(workdir, settings))
        model = config.models[0]
        self.settings = settings
        self.run = Run(settings, objective_s=config.bands[0].ttft_objective_s or math.nan)
        self._scrape_s = model.advanced.scrape_interval_s
        self._bands = config.band_names
        self.dispatcher = ModelDispatcher(
            MODEL, build_pool(model), config.bands, lambda event: None, lambda: self.now,
            policy=POLICIES[model.policy], timers=self, tenant=config.tenant, cost=model.cost_weights(),
            max_queued=model.max_queued, max_queue_wait_s=model.max_queue_wait_s,
            reserved_waiting=model.waiting_kept(), max_preemptions_per_s=model.max_preemptions_per_s,
            cold_start_wait_s=model.cold_start_wait(),
        )
        self._rule = ScaleRule(settings)
        self._pods: dict[str, _Pod] = {}
        self._ports = itertools.count(1)
        self._queued: list[_Request] = []
        self._released: dict[int, _Request] = {}
        self._to_come = 0

    # --- the run ----------------------------------------------------------------------------------------

    def simulate(self) -> Run:
        for at, key, band in arrivals(self.settings):
            self.call_at(at, lambda a=at, k=key, b=band: self._arrive(a, k, b))  # type: ignore[misc]
            self._to_come += 1
        self.call_at(0.0, self._lookup)
        self.call_at(self.settings.sync_s, self._sync)
        deadline = math.inf
        while (due := self.next_at()) is not None and due <= deadline:
            self.run_next()
            self._notice()
            if deadline == math.inf and not self._to_come and not self._queued and not self._released:
                # The day is over: the autoscaler lets the engines go as it would, down to zero.
                deadline = self.now + self.settings.down_window_s + 2 * self.settings.sync_s
        self.run.scaled_to_zero = not self._live()
        for pod in self._pods.values():
            if pod.record.stopped is None:
                pod.record.stopped = self.now
        return self.run

    def _live(self) -> list[_Pod]:
        """The engines started and not leaving: the Deployment's replicas."""
        return [p for p in self._pods.values() if p.record.stopped is None and not p.leaving]

    def _arrive(self, at: float, key: str, band: str) -> None:
        self._to_come -= 1
        cold = not any(p.record.ready for p in self._live())
        held = self.dispatcher.submit(TENANTS[key], self._bands.index(band), max_tokens=self.settings.tokens,
                                      content_length=4 * PROMPT_TOKENS)
        self._queued.append(_Request(at, band, cold, held))

    def _notice(self) -> None:
        """Releases and refusals the last event caused: what the ext_proc streams would do."""
        still = []
        for request in self._queued:
            future = request.held.future
            if not future.done():
                still.append(request)
            elif future.cancelled() or future.exception() is not None:
                self._answer(request, 503, "refused")
            else:
                self._release(request)
        self._queued = still

    def _release(self, request: _Request) -> None:
        pod = self._pods.get(request.held.endpoint or "")
        if pod is None or pod.sigterm:
            self.dispatcher.end(request.held)
            self._answer(request, 503, "no engine")
            return
        sim = SimRequest(prompt_tokens=PROMPT_TOKENS, max_tokens=self.settings.tokens, arrival=self.now)
        self._released[id(sim)] = request
        self.call_at(self.now + LAG_S, lambda: self._reach(pod, sim, request))

    def _reach(self, pod: _Pod, sim: SimRequest, request: _Request) -> None:
        pod.inbox.append((sim, request))
        if pod.step_end is None:
            self._step(pod)

    def _step(self, pod: _Pod) -> None:
        for sim, _ in pod.inbox:
            pod.scheduler.add(sim)
        pod.inbox.clear()
        if not pod.scheduler.has_work:
            pod.step_end = None
            if pod.sigterm and pod.record.stopped is None:
                pod.record.stopped = self.now  # drained: the process exits
            return
        step = pod.scheduler.schedule(self.now)
        pod.step_end = self.now + step.duration
        self.call_at(pod.step_end, lambda: self._complete(pod))

    def _complete(self, pod: _Pod) -> None:
        for token in pod.scheduler.complete(self.now):
            request = self._released[id(token.request)]
            if token.index == 0:
                request.first_token_at = self.now
                self.dispatcher.record_response(request.held, Answer.SERVED)
            if token.request.finished:
                self.call_at(self.now + END_LAG_S, lambda s=token.request, r=request: self._end(s, r))  # type: ignore[misc]
        pod.step_end = None
        self._step(pod)

    def _end(self, sim: SimRequest, request: _Request) -> None:
        del self._released[id(sim)]
        self.dispatcher.end(request.held)
        self._answer(request, 200, "", request.first_token_at)

    def _answer(self, request: _Request, status: int, error: str, first_token_at: float | None = None) -> None:
        ttft = None if first_token_at is None else first_token_at - request.at
        self.run.results.append(Result(round(request.at, 3), request.band, status, ttft, request.cold, error))

    # --- the processor's lookups and scrapes, the autoscaler ---------------------------------------------

    def _lookup(self) -> None:
        members = tuple(url for url, p in self._pods.items()
                        if p.record.ready and p.record.stopped is None and not p.leaving)
        if set(members) != set(self.dispatcher.endpoints):
            self.dispatcher.set_endpoints(members)
        self.call_at(self.now + self.settings.dns_refresh_s, self._lookup)

    def _scrape(self, url: str) -> None:
        pod = self._pods[url]
        if pod.record.stopped is not None:
            return
        if url in self.dispatcher.endpoints:
            s = pod.scheduler
            self.dispatcher.record_scrape(url, EngineLoad(waiting=s.shown_waiting, running=s.shown_running,
                                                          kv_usage=s.kv_usage), self.now)
        self.call_at(self.now + self._scrape_s, lambda: self._scrape(url))

    def _sync(self) -> None:
        value = self.dispatcher.demand().engines
        live = self._live()
        desired, target = self._rule.decide(self.now, value, len(live))
        if target > len(live):
            self._start()
        for pod in live[target:]:  # the newest go
            pod.leaving = True
            self.call_at(self.now + 2 * self.settings.dns_refresh_s, lambda p=pod: self._sigterm(p))  # type: ignore[misc]
        demand = self.dispatcher.demand()
        self.run.timeline.append({
            "t": round(self.now, 1), "demand": round(value, 3), "desired": desired, "engines": len(self._live()),
            "ready": sum(p.record.ready for p in self._live()), "held": sum(demand.held),
            "in_flight": sum(demand.in_flight), **({} if demand.per_engine is None else {"capacity": demand.per_engine}),
        })
        self.call_at(self.now + self.settings.sync_s, self._sync)

    def _start(self) -> None:
        s = self.settings
        url = f"http://engine-{next(self._ports)}:8000"
        sim = SimSettings(model=MODEL, max_num_seqs=s.max_num_seqs, step_ms=s.step_ms, step_ms_per_seq=s.step_ms_per_seq,
                          default_max_tokens=s.tokens)
        pod = _Pod(Engine(url, self.now), Scheduler(sim))
        self._pods[url] = pod
        self.run.engines.append(pod.record)

        def ready() -> None:
            pod.record.ready = True
            self._scrape(url)

        self.call_at(self.now + s.engine_start_s, ready)

    def _sigterm(self, pod: _Pod) -> None:
        pod.sigterm = True
        if pod.step_end is None and not pod.inbox:
            pod.record.stopped = self.now


def simulate_in_time(settings: Settings) -> Run:
    """One day in simulated time (the module docstring)."""

    async def day() -> Run:  # the dispatcher's futures need a loop; nothing awaits
        with tempfile.TemporaryDirectory(prefix="extproc-autoscale-sim-") as workdir:
            return DaySim(settings, Path(workdir)).simulate()

    return asyncio.run(day())
