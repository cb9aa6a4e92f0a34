"""The benchmark's production-trace scenario in simulated time: the same plan on the same engine model, four ways.

``extproc-dev bench --trace`` replays a window of the Azure LLM inference trace
2023 in real time through Envoy and the processor; here the same requests (the
bench's own plan, ``tools/bench/trace.py``) run against the simulator's
scheduler on one clock with the core (``tests/coresim.py``), so a replay takes
a second, every run is exactly repeatable, and many windows can be compared:

* ``direct``: straight to the engine, in arrival order or by its priority queue
  (the class's place as the request's priority);
* ``gateway``: through the dispatcher, in front of an engine in arrival order
  or with its priority queue (the gateway then writes the class into each
  request, as ``engine_priority`` does), a preempted request sent again a second
  later as a retry, as the OpenAI SDK does.

The figures are the bench's: per class TTFT p50 / p99 and the worst-served
tenant's p99 in the window (a request without a first token by the window's end
counted as later than any), requests answered, output tokens, and the engine's
free slots while the gateway held anything.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from extproc.tools.bench.load import plan
from extproc.tools.bench.scenarios import Engine
from extproc.tools.bench.trace import Source, trace_replay
from extproc.tools.sim.engine import SimSettings
from tests.coresim import Arrival, CoreSim, DirectSim, Request

CLASSES = ("interactive", "standard", "batch")
SAMPLE_S = 0.1


@dataclass(frozen=True)
class Replay:
    """A trace window's requests as arrivals, the window they are measured in, and the engine they run on."""

    arrivals: tuple[Arrival, ...]
    window: float
    engine: Engine

    def settings(self, policy: str) -> SimSettings:
        e = self.engine
        return SimSettings(model="m", max_num_seqs=e.max_num_seqs, kv_cache_tokens=e.kv_cache_tokens, step_ms=e.step_ms,
                           step_ms_per_seq=e.step_ms_per_seq, prefill_ms_per_token=e.prefill_ms_per_token,
                           scheduling_policy=policy)


def replay(files: Sequence[Source], *, start: str | None = None, seed: int = 23) -> Replay:
    """The bench's trace scenario (``--trace``; its window from ``start``), as arrivals."""
    engine = Engine()
    scenario = trace_replay(files, engine=engine, start=start, seed=seed)
    planned = sorted([*scenario.planned, *plan(scenario.streams, scenario.seed)], key=lambda r: r.at)
    arrivals = tuple(Arrival(r.at, CLASSES.index(r.priority or "standard"), r.tenant, r.prompt_tokens, r.max_tokens,
                             stream=r.stream) for r in planned)
    return Replay(arrivals, float(scenario.window or 0.0), engine)


@dataclass
class Served:
    """One planned request's first token and end, whatever attempt brought them."""

    arrival: Arrival
    first: float | None = None
    done: float | None = None
    tokens: list[float] = field(default_factory=list)
    preempted: int = 0


@dataclass(frozen=True)
class ClassFigures:
    p50: float
    p99: float
    worst_tenant: float
    answered: int


@dataclass(frozen=True)
class Figures:
    classes: tuple[ClassFigures, ...]
    tokens: int
    # The engine's free slot-seconds while the gateway held anything, over its slot-seconds in the window.
    idle_while_held: float
    preempted: int


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(1, math.ceil(q / 100 * len(ordered))) - 1] if ordered else math.nan


def figures(served: Sequence[Served], window: float, idle_while_held: float = 0.0) -> Figures:
    classes = []
    for band in range(len(CLASSES)):
        mine = [s for s in served if s.arrival.band == band]
        ttft = [s.first - s.arrival.at if s.first is not None and s.first <= window else math.inf for s in mine]
        tenants: dict[str, list[float]] = defaultdict(list)
        for s, t in zip(mine, ttft, strict=True):
            tenants[s.arrival.tenant].append(t)
        classes.append(ClassFigures(percentile(ttft, 50), percentile(ttft, 99),
                                    max((percentile(v, 99) for v in tenants.values()), default=math.nan),
                                    sum(s.done is not None and s.done <= window for s in mine)))
    tokens = sum(t <= window for s in served for t in s.tokens)
    return Figures(tuple(classes), tokens, idle_while_held, sum(s.preempted for s in served))


def direct(run: Replay, policy: str) -> Figures:
    """Straight to the engine, in arrival order (``fcfs``) or by its priority queue (``priority``)."""
    sim = DirectSim(run.settings(policy))
    sim.run(run.arrivals, run.window)
    served = {id(a): Served(a) for a in run.arrivals}
    for arrival, request in sim.requests:
        s = served[id(arrival)]
        s.first, s.done = request.first_token_at, request.last_token_at if request.finished else None
        if request.first_token_at is not None and request.last_token_at is not None:
            step = (request.last_token_at - request.first_token_at) / max(1, request.num_generated - 1)
            s.tokens = [request.first_token_at + i * step for i in range(request.num_generated)]
    return figures(list(served.values()), run.window)


def gateway(run: Replay, *, engine_priority: bool, **settings: float) -> Figures:
    """Through the dispatcher, in front of an engine in arrival order or with its priority queue."""
    served: dict[int, Served] = {id(a): Served(a) for a in run.arrivals}
    first_of: dict[int, int] = {id(a): id(a) for a in run.arrivals}

    def ended(sim: CoreSim, request: Request) -> None:
        if request.outcome != "preempted":
            return
        a = request.arrival
        again = Arrival(sim.now + 1.0, a.band, a.tenant, a.prompt_tokens, a.max_tokens, a.stream, retried=True)
        first_of[id(again)] = first_of[id(a)]
        served[first_of[id(a)]].preempted += 1
        sim.add([again])

    sim = CoreSim(run.settings("priority" if engine_priority else "fcfs"), engine_priority=engine_priority,
                  stream_begins_at_accept=True, ended=ended, **settings)  # type: ignore[arg-type]
    idle = [0.0]

    def sample() -> None:
        if sim.held and sim.now <= run.window:
            idle[0] += max(0, sim.scheduler.max_num_seqs - len(sim.scheduler.running)) * SAMPLE_S
        sim.at(sim.now + SAMPLE_S, sample)

    sim.at(0.0, sample)
    sim.run(run.arrivals, run.window)
    for request in sim.requests:
        s, sim_request = served[first_of[id(request.arrival)]], request.sim
        if sim_request is None or sim_request.first_token_at is None or request.outcome == "preempted":
            continue
        s.first = sim_request.first_token_at if s.first is None else min(s.first, sim_request.first_token_at)
        if sim_request.finished:
            s.done = sim_request.last_token_at
        if sim_request.last_token_at is not None:
            step = (sim_request.last_token_at - sim_request.first_token_at) / max(1, sim_request.num_generated - 1)
            s.tokens = [sim_request.first_token_at + i * step for i in range(sim_request.num_generated)]
    slots = run.engine.max_num_seqs
    return figures(list(served.values()), run.window, idle[0] / (slots * run.window))
