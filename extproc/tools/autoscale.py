"""``extproc-dev autoscale``: a simulated autoscaler that follows the guide's query, under a day of load in minutes.

The whole stack runs (Envoy, ``extproc serve``, simulated engines); only the
autoscaler and Kubernetes are stand-ins. The pool is a host name whose
addresses come from a file (``hosts.py``), as a headless Service's DNS;
engines are simulator processes this tool starts and stops.

**The autoscaler** is the issue's: engines = the demand series, one engine
started per 15 s of need, stopped after 60 s of none; which is what
Kubernetes' HPA does with the guide's manifests (deploy/autoscaling: KEDA's
ScaledObject, or the HPA). Every ``sync_s`` it reads
``sum(extproc_engines_needed{model})`` (threshold 1, AverageValue: that many
engines, rounded up, unchanged within the HPA's 10 % tolerance) and

* from zero, starts one engine at the first demand (KEDA's activation);
* up: one engine more once more have been needed for all of the last
  ``up_window_s`` (scaleUp: a 15 s stabilisation window, the lowest count in
  it), at most one per ``up_every_s`` (1 pod per 15 s);
* down: to the most engines needed in the last ``down_window_s`` (scaleDown:
  a 60 s window), every surplus engine at once; the last one only once
  nothing was held or in flight for that long (KEDA's ``minReplicaCount: 0``).

**An engine's life**, as a pod's: started (its engine-seconds count from
here), ready after ``engine_start_s`` (the model's load; the readiness probe),
then in the name's addresses. Stopped: out of the addresses first, then its
preStop (2 x ``dns_refresh_s``), then SIGTERM: it refuses what still comes
and finishes what it runs (the simulator's, as vLLM's, ``--shutdown-timeout``),
then the process ends (its engine-seconds with it).

**The load** is a day compressed into ``minutes``: open-loop Poisson
arrivals whose rate rises from ``quiet`` to ``peak`` engines' capacity and
back (``quiet + (peak - quiet) * sin^2(pi t / T)``), from five tenants, a
quarter interactive, the rest standard (the idle-only batch class takes only
capacity nobody else needs, and keeps a reserve of it free while a class
above works: a load of it needs more engines than its rate at full batch, and
an operator may well not scale for it, docs/guides/autoscaling.md). One engine's capacity is
the simulator's: ``max_num_seqs`` requests of ``tokens`` decode steps of
``step_ms + step_ms_per_seq * max_num_seqs`` each.

**What it measures** against the issue's target: requests lost (any answer
but 200), the interactive TTFT p99 against the class's objective outside the
cold starts (requests that arrived while no engine was ready), and the
engine-seconds used against what the load needed: each second, the engines
its rate needed at full batch, rounded up.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from extproc.adapters.config import ModelConfig, load_config
from extproc.tools.hosts import command, write_hosts
from extproc.tools.power_user import chat
from extproc.tools.procs import ManagedProcess, free_port
from extproc.tools.stack import Stack, start_sim, start_stack

MODEL = "m1"
NAME = "m1-engines.test"
TENANTS = {f"key-t{i}": f"t{i}" for i in range(1, 6)}
# An engine's drain on SIGTERM (vLLM's --shutdown-timeout, the guide's 300 s).
DRAIN_S = 300.0
# The HPA's tolerance: no change while the demand is within 10 % of the engines there.
TOLERANCE = 0.1
# The classes' shares of the requests.
CLASSES = (("interactive", 0.25), ("standard", 0.75))


@dataclass(frozen=True)
class Settings:
    """One run (``extproc-dev autoscale --help`` says each)."""

    minutes: float = 10.0
    quiet: float = 0.25
    peak: float = 4.0
    max_num_seqs: int = 16
    target_waiting: int = 1
    tokens: int = 48
    step_ms: float = 50.0
    step_ms_per_seq: float = 0.5
    engine_start_s: float = 5.0
    sync_s: float = 5.0
    up_window_s: float = 15.0
    up_every_s: float = 15.0
    down_window_s: float = 60.0
    max_engines: int = 8
    dns_refresh_s: float = 1.0
    seed: int = 1

    @property
    def day_s(self) -> float:
        return self.minutes * 60

    @property
    def request_s(self) -> float:
        """How long one request runs in a full batch."""
        return self.tokens * (self.step_ms + self.step_ms_per_seq * self.max_num_seqs) / 1000

    @property
    def engine_rps(self) -> float:
        """Requests per second one engine serves at full batch."""
        return self.max_num_seqs / self.request_s

    def load(self, t: float) -> float:
        """The offered load at ``t`` seconds into the day, in engines' capacity."""
        if not 0 <= t < self.day_s:
            return 0.0
        return self.quiet + (self.peak - self.quiet) * math.sin(math.pi * t / self.day_s) ** 2

    def needed_engine_s(self) -> float:
        """What the load needed: each second, the engines its rate needed at full batch, rounded up."""
        return float(sum(self.needed_at(s) for s in range(int(self.day_s))))

    def needed_at(self, second: int) -> int:
        """The engines the load needed in ``second`` (its middle): its rate at full batch, rounded up."""
        return math.ceil(self.load(second + 0.5) - 1e-9)

    def sim_args(self) -> list[str]:
        return ["--max-num-seqs", str(self.max_num_seqs), "--step-ms", str(self.step_ms),
                "--step-ms-per-seq", str(self.step_ms_per_seq), "--default-max-tokens", str(self.tokens),
                "--shutdown-timeout", str(DRAIN_S)]


def arrivals(settings: Settings) -> Iterator[tuple[float, str, str]]:
    """(time, API key, class) of each request, open loop: Poisson with the day's rate (thinning), seeded."""
    rng = random.Random(settings.seed)
    top = settings.peak * settings.engine_rps
    t = 0.0
    keys = list(TENANTS)
    names, weights = [name for name, _ in CLASSES], [share for _, share in CLASSES]
    while True:
        t += rng.expovariate(top)
        if t >= settings.day_s:
            return
        if rng.random() < settings.load(t) * settings.engine_rps / top:
            yield t, rng.choice(keys), rng.choices(names, weights)[0]


@dataclass
class Engine:
    """One engine as the autoscaler sees it (a pod): when it was started and stopped, whether it is ready."""

    url: str
    started: float
    ready: bool = False
    stopped: float | None = None
    process: ManagedProcess | None = None


@dataclass
class Result:
    """One request: when it arrived, its class, its answer and its time to the first token."""

    at: float
    band: str
    status: int
    ttft_s: float | None
    cold: bool
    error: str = ""


@dataclass
class Run:
    """What one run did: the requests, the engines, the autoscaler's timeline."""

    settings: Settings
    results: list[Result] = field(default_factory=list)
    engines: list[Engine] = field(default_factory=list)
    timeline: list[dict[str, float]] = field(default_factory=list)
    objective_s: float = 0.0
    # Whether the autoscaler had let every engine go once the day's requests were answered.
    scaled_to_zero: bool = False

    def summary(self) -> dict[str, Any]:
        lost = [r for r in self.results if r.status != 200]
        warm = sorted(r.ttft_s for r in self.results if r.band == "interactive" and not r.cold and r.ttft_s is not None)
        day = self.settings.day_s
        stopped = [(e.started, e.stopped if e.stopped is not None else math.inf) for e in self.engines]
        used = sum(max(0.0, min(end, day) - start) for start, end in stopped)
        needed = self.settings.needed_engine_s()
        return {
            "requests": len(self.results),
            "lost": len(lost),
            "lost_reasons": sorted({r.error or str(r.status) for r in lost}),
            "cold_start_requests": sum(r.cold for r in self.results),
            "interactive_ttft_p99_s": _quantile(warm, 0.99),
            "interactive_ttft_p50_s": _quantile(warm, 0.5),
            "interactive_objective_s": self.objective_s,
            "engine_seconds_used": round(used, 1),
            "engine_seconds_used_with_the_tail": round(sum(end - start for start, end in stopped), 1),
            "engine_seconds_needed": needed,
            "engine_seconds_over_needed": round(used / needed - 1, 4) if needed else math.nan,
            "engine_seconds_apart": excess(self.settings, stopped),
            "engines_started": len(self.engines),
            "scaled_to_zero": self.scaled_to_zero,
            "most_engines": max((int(p["engines"]) for p in self.timeline), default=0),
            "engine_rps": round(self.settings.engine_rps, 3),
        }


def excess(settings: Settings, engines: list[tuple[float, float]]) -> dict[str, float]:
    """Where the engine-seconds used part from those needed, second by second over the day.

    In each second, the k-th engine running (started, ready or not, and not
    yet exited) is **over** what was needed if fewer than k were needed then:
    ``after_need`` if k were needed within the stop rule's window before
    (``down_window_s``, the 60 s the rule keeps an engine after its need ended),
    ``above_need`` otherwise (an engine the load did not need at all then: a
    start too early, a stop late beyond the rule's window, one above the peak).
    The k-th engine needed and not running is **short**: a start later than the
    need. used - needed = after_need + above_need - short.
    """
    after = above = short = 0.0
    window = int(settings.down_window_s)
    for second in range(int(settings.day_s)):
        running = sum(start <= second + 0.5 < end for start, end in engines)
        need = settings.needed_at(second)
        recent = max(settings.needed_at(s) for s in range(max(0, second - window), second + 1))
        short += max(0, need - running)
        after += max(0, min(running, recent) - need)
        above += max(0, running - max(recent, need))
    return {"after_need": after, "above_need": above, "short": short}


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    return values[min(len(values) - 1, math.ceil(q * len(values)) - 1)]


def write_config(workdir: Path, settings: Settings) -> Path:
    """The processor's config: the guide's keys (deploy/autoscaling/extproc-config.yaml), scaled to the simulation."""
    doc = {
        "listen": {"grpc": f"127.0.0.1:{free_port()}", "metrics": f"127.0.0.1:{free_port()}"},
        "priorities": ["interactive", "standard", "batch"],
        "default_priority": "standard",
        "models": [{
            "name": MODEL, "endpoints": [f"http://{NAME}:8000"], "endpoint_picking": True,
            "dns_refresh_s": settings.dns_refresh_s, "max_running": settings.max_num_seqs,
            "target_waiting": settings.target_waiting,
            # Batch work waits out a peak's scale-up; the cold start covers KEDA's reaction and the engine's start.
            "max_queue_wait_s": 300, "cold_start_wait_s": 300,
        }],
        "envoy": {"listen": f"127.0.0.1:{free_port()}", "admin": f"127.0.0.1:{free_port()}", "api_keys": TENANTS},
    }
    path = workdir / "config.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


class ScaleRule:
    """The HPA's decisions with the guide's behaviour (the module docstring), on one value of the query at a time."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._desired: deque[tuple[float, int]] = deque()  # (time, desired) over the longer window
        self._last_up = -math.inf

    def decide(self, now: float, value: float, current: int) -> tuple[int, int]:
        """What the HPA wants at ``now`` with ``current`` engines and the query at ``value``, and the engines it
        runs: ``current + 1`` (start one), fewer (stop the surplus), or ``current``."""
        s = self._settings
        within = current and abs(value / current - 1) <= TOLERANCE
        desired = current if within else min(s.max_engines, math.ceil(value - 1e-9))
        self._desired.append((now, desired))
        while self._desired and self._desired[0][0] < now - max(s.up_window_s, s.down_window_s):
            self._desired.popleft()
        lowest = min(d for t, d in self._desired if t >= now - s.up_window_s)  # needed all along the window
        highest = max(d for t, d in self._desired if t >= now - s.down_window_s)
        if (current == 0 and desired > 0) or (lowest > current and now - self._last_up >= s.up_every_s):
            self._last_up = now
            return desired, current + 1
        if highest < current and now >= s.down_window_s:
            return desired, highest
        return desired, current


class Autoscaler:
    """The HPA with the guide's behaviour, on the processor's demand series, starting and stopping engines."""

    def __init__(self, run: Run, stack: Stack, model: ModelConfig, hosts: Path, workdir: Path) -> None:
        self._run = run
        self._settings = run.settings
        self._stack = stack
        self._model = model
        self._hosts = hosts
        self._workdir = workdir
        self._start = time.monotonic()
        self._rule = ScaleRule(run.settings)
        self._tasks: set[asyncio.Task[None]] = set()
        self._leaving: set[str] = set()  # out of the addresses, draining

    def now(self) -> float:
        return time.monotonic() - self._start

    @property
    def live(self) -> list[Engine]:
        """The engines started and not leaving: the Deployment's replicas."""
        return [e for e in self._run.engines if e.stopped is None and e.url not in self._leaving]

    def ready(self) -> int:
        return sum(e.ready for e in self.live)

    async def demand(self, session: aiohttp.ClientSession) -> dict[str, float]:
        """``sum(extproc_engines_needed{model})``, read from the processor's page as Prometheus would; with what it
        is made of (the requests held and in flight, one engine's capacity) for the timeline."""
        async with session.get(self._stack.metrics_url) as response:
            text = await response.text()
        values = {"demand": 0.0, "held": 0.0, "in_flight": 0.0}
        for line in text.splitlines():
            name, _, value = line.rpartition(" ")
            if name == f'extproc_engines_needed{{model="{MODEL}"}}':
                values["demand"] += float(value)
            elif name == f'extproc_engine_capacity_requests{{model="{MODEL}"}}' and not math.isnan(float(value)):
                values["capacity"] = float(value)
            elif name.startswith(f'extproc_demand_requests{{model="{MODEL}"'):
                values["held" if 'state="held"' in name else "in_flight"] += float(value)
        return values

    async def run(self, stop: asyncio.Event) -> None:
        async with aiohttp.ClientSession() as session:
            while not stop.is_set():
                read = await self.demand(session)
                await self.sync(read.pop("demand"), read)
                try:
                    await asyncio.wait_for(stop.wait(), self._settings.sync_s)
                except TimeoutError:
                    pass
        await asyncio.gather(*self._tasks)

    async def sync(self, value: float, parts: dict[str, float] | None = None) -> None:
        """One decision on ``value``, the query's answer (the HPA's algorithm, its 10 % tolerance included); ``parts``
        (what the processor's page said beside it) goes to the timeline."""
        now = self.now()
        current = len(self.live)
        desired, target = self._rule.decide(now, value, current)
        if target > current:
            self._spawn(self._start_engine())
        elif target < current:
            for engine in self.live[target:]:  # the newest go
                self._leaving.add(engine.url)
                self._spawn(self._stop_engine(engine))
            self._write_hosts()
        self._run.timeline.append({"t": round(now, 1), "demand": round(value, 3), "desired": desired,
                                   "engines": len(self.live), "ready": self.ready(),
                                   **{name: round(v, 3) for name, v in (parts or {}).items()}})

    def _spawn(self, job: Any) -> None:
        task = asyncio.create_task(job)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _start_engine(self) -> None:
        engine = Engine(f"http://127.0.0.1:{free_port()}", self.now())
        self._run.engines.append(engine)
        engine.process = await start_sim(self._model, engine.url, self._workdir, self._settings.sim_args())
        await asyncio.sleep(max(0.0, engine.started + self._settings.engine_start_s - self.now()))
        engine.ready = True
        self._write_hosts()

    async def _stop_engine(self, engine: Engine) -> None:
        """``engine`` left the addresses (:meth:`sync`): its preStop, then its drain and exit."""
        await asyncio.sleep(2 * self._settings.dns_refresh_s)  # preStop: the processor has seen it go
        assert engine.process is not None
        await engine.process.stop(timeout=DRAIN_S + 10)  # SIGTERM: it drains (--shutdown-timeout), then exits
        engine.stopped = self.now()

    def _write_hosts(self) -> None:
        write_hosts(self._hosts, {NAME: [e.url for e in self.live if e.ready]})

    async def close(self) -> None:
        await asyncio.gather(*self._tasks)
        end = self.now()
        for engine in self._run.engines:
            if engine.process is not None:
                await engine.process.stop()
            if engine.stopped is None:
                engine.stopped = end


async def simulate(settings: Settings, workdir: Path) -> Run:
    """One run of the day (see the module docstring); every process stopped at the end."""
    hosts = workdir / "hosts.json"
    write_hosts(hosts, {})
    config_path = write_config(workdir, settings)
    config = load_config(config_path)
    run = Run(settings, objective_s=config.bands[0].ttft_objective_s or math.nan)
    async with await start_stack(config_path, workdir, engines=False, command=command(hosts)) as stack:
        scaler = Autoscaler(run, stack, config.models[0], hosts, workdir)
        stop = asyncio.Event()
        scaling = asyncio.create_task(scaler.run(stop))
        try:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                             timeout=aiohttp.ClientTimeout(total=900)) as session:
                await _send(session, stack.envoy_url, settings, scaler, run)
            # The day is over: the autoscaler lets the engines go as it would, down to zero.
            deadline = scaler.now() + settings.down_window_s + 2 * settings.sync_s
            while scaler.live and scaler.now() < deadline:
                await asyncio.sleep(settings.sync_s)
            run.scaled_to_zero = not scaler.live
        finally:
            stop.set()
            await scaling
            await scaler.close()
    return run


async def _send(session: aiohttp.ClientSession, url: str, settings: Settings, scaler: Autoscaler, run: Run) -> None:
    """Every arrival of the day at its time; returns once each has its answer."""
    requests = []
    for at, key, band in arrivals(settings):
        await asyncio.sleep(max(0.0, at - scaler.now()))
        cold = scaler.ready() == 0
        requests.append(asyncio.create_task(_one(session, url, key, band, cold, scaler.now(), run)))
    await asyncio.gather(*requests)


async def _one(session: aiohttp.ClientSession, url: str, key: str, band: str, cold: bool, at: float, run: Run) -> None:
    outcome = await chat(session, url, TENANTS[key], MODEL, api_key=key, max_tokens=run.settings.tokens,
                         extra_headers={"x-priority": band})
    run.results.append(Result(round(at, 3), band, outcome.status, outcome.ttft_s, cold, outcome.error))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = Settings()
    for name, text in (
        ("minutes", "the day's length in minutes"), ("quiet", "the load at night, in engines' capacity"),
        ("peak", "the load at noon, in engines' capacity"), ("max_num_seqs", "each engine's batch"),
        ("target_waiting", "the processor's target_waiting"), ("tokens", "output tokens per request"),
        ("step_ms", "the simulated engine's decode step"),
        ("step_ms_per_seq", "the step's extra time per running sequence"),
        ("engine_start_s", "from an engine's start to its readiness"),
        ("sync_s", "how often the autoscaler reads the demand (the HPA's sync period)"),
        ("up_window_s", "more needed this long: one more"), ("up_every_s", "at most one engine more this often"),
        ("down_window_s", "fewer needed this long: the surplus stops"), ("max_engines", "the most engines"),
        ("dns_refresh_s", "the processor's dns_refresh_s"), ("seed", "the arrivals' seed"),
    ):
        default = getattr(defaults, name)
        parser.add_argument("--" + name.replace("_", "-"), type=type(default), default=default,
                            help=f"{text} (default: %(default)s)")
    parser.add_argument("--simulated", action="store_true",
                        help="run the day in simulated time (seconds, no processes; autoscale_sim.py) instead of on the stack")
    parser.add_argument("--out", help="write summary.json and timeline.json here (default: print only)")
    parser.add_argument("--workdir", help="keep the logs here (default: a temporary folder, removed at exit)")


def run_autoscale(args: argparse.Namespace, in_simulated_time: Callable[[Settings], Run]) -> int:
    """The command: the day on the stack, or with ``--simulated`` through ``in_simulated_time`` (autoscale_sim.py,
    which builds on this module)."""
    settings = Settings(**{name: getattr(args, name) for name in Settings.__dataclass_fields__})
    if args.simulated:
        run = in_simulated_time(settings)
    else:
        with tempfile.TemporaryDirectory(prefix="extproc-autoscale-") as temporary:
            workdir = Path(args.workdir or temporary)
            workdir.mkdir(parents=True, exist_ok=True)
            run = asyncio.run(simulate(settings, workdir))
    summary = run.summary()
    print(json.dumps({"settings": asdict(settings), **summary}, indent=2))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.json").write_text(json.dumps({"settings": asdict(settings), **summary}, indent=2) + "\n")
        (out / "timeline.json").write_text(json.dumps(run.timeline) + "\n")
        (out / "engines.json").write_text(json.dumps(
            [{"started": round(e.started, 1), "stopped": e.stopped and round(e.stopped, 1)} for e in run.engines]) + "\n")
    return 0 if summary["lost"] == 0 else 1
