"""Run one scenario on one arm: a fresh stack, the seeded plan replayed open-loop, the engine watched.

Every run starts its own simulator (and Envoy and extproc when the arm has
them) and stops them afterwards, so each arm meets a fresh engine and a fresh
scheduler (no queue, no fairness counters carried over), and replays the very
same requests at the very same offsets. A cluster arm also gets its own
Redis, started before its processors and stopped after them.

Times in the results are *model seconds*: wall-clock time divided by the time
scale, so they read like a real GPU's. A fixed wall-clock cost (the ~1 ms of
the Envoy hop) is magnified by ``1 / time_scale`` in these units; the overhead
benchmark measures such costs at real speed.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from extproc.adapters.config import load_config
from extproc.adapters.engines.dialects import MetricsError, parse_load
from extproc.tools.bench.arms import MODEL, Arm, api_key, write_arm_config
from extproc.tools.bench.load import Planned
from extproc.tools.bench.scenarios import Engine, Scenario
from extproc.tools.bench.vllm import VllmEngine
from extproc.tools.power_user import chat
from extproc.tools.procs import cpu_seconds
from extproc.tools.redis_proc import RedisServer
from extproc.tools.stack import Stack, start_stack

# How often the engine's queue is sampled (wall clock).
SAMPLE_INTERVAL_S = 0.05
_FILLER = "the quick brown fox jumps over the lazy dog; " * 2000


@dataclass(frozen=True)
class Result:
    """One request as its client saw it (model seconds; ``sent`` from the run's start)."""

    tenant: str
    priority: str | None
    planned: float
    sent: float
    status: int
    ttft: float | None  # None: no token arrived
    e2e: float
    queue_wait: float | None  # None: no gateway queue-wait header
    prompt_tokens: int
    max_tokens: int
    tokens: int
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.ttft is not None

    @property
    def first_token_at(self) -> float | None:
        return None if self.ttft is None else self.sent + self.ttft

    @property
    def done_at(self) -> float:
        return self.sent + self.e2e


@dataclass(frozen=True)
class EngineSample:
    at: float  # model seconds from the run's start
    waiting: float
    running: float


@dataclass(frozen=True)
class ArmRun:
    scenario: str
    arm: str
    time_scale: float
    results: tuple[Result, ...]
    engine: tuple[EngineSample, ...]
    wall_s: float
    # CPU seconds used during the run, per component ("engine", "envoy", "extproc", "client");
    # "extproc" is the sum over every processor instance.
    cpu_s: dict[str, float]
    # The processors' own counters at the end of the run, summed over instances (see processor_counters).
    processor: dict[str, float] = field(default_factory=dict)


def prompt_text(tokens: int, chars_per_token: int = 4) -> str:
    """A prompt the engine counts as about ``tokens`` tokens."""
    chars = chars_per_token * tokens
    repeats = -(-chars // len(_FILLER))
    return (_FILLER * repeats)[:chars]


async def _sample_engine(url: str, model: str, t0: float, time_scale: float, stop: asyncio.Event) -> list[EngineSample]:
    samples: list[EngineSample] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1.0)) as session:
        while not stop.is_set():
            started = time.monotonic()
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, MetricsError):
                async with session.get(f"{url}/metrics") as response:
                    load = parse_load("vllm", await response.text(), model)
                samples.append(EngineSample((started - t0) / time_scale, load.waiting, load.running))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), max(0.0, SAMPLE_INTERVAL_S - (time.monotonic() - started)))
    return samples


# Processor series the bench reads, summed over instances and labels (prometheus_client's sample names).
_COUNTERS = {
    "extproc_released_total": "released",
    "extproc_cluster_round_trip_seconds_sum": "round_trip_seconds_sum",
    "extproc_cluster_round_trip_seconds_count": "round_trip_count",
}


def processor_counters(pages: Sequence[str]) -> dict[str, float]:
    """Release and Redis round-trip totals from the instances' ``/metrics`` pages, summed over instances.

    ``round_trips_ok`` counts only successful round trips (the hot-path cost);
    ``round_trip_le_<bound>`` are the round-trip histogram's cumulative
    buckets, so percentiles can be read off the whole cluster at once.
    """
    totals: dict[str, float] = {}
    for text in pages:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                key = _COUNTERS.get(sample.name)
                if sample.name == "extproc_cluster_round_trips_total" and sample.labels.get("outcome") == "ok":
                    key = "round_trips_ok"
                elif sample.name == "extproc_cluster_round_trip_seconds_bucket":
                    key = f"round_trip_le_{sample.labels['le']}"
                if key is not None:
                    totals[key] = totals.get(key, 0.0) + sample.value
    return totals


async def _scrape_processors(stack: Stack) -> dict[str, float]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5.0)) as session:
        pages = []
        for url in stack.metrics_urls.values():
            async with session.get(url) as response:
                response.raise_for_status()
                pages.append(await response.text())
    return processor_counters(pages)


async def replay(
    base_url: str,
    requests: Sequence[Planned],
    *,
    time_scale: float,
    api_keys: dict[str, str],
    t0: float,
    engine: Engine | VllmEngine,
    on_done: Callable[[], None] = lambda: None,
) -> list[Result]:
    """Send every planned request at ``t0 + at * time_scale`` (open loop) and wait for all answers."""
    connector = aiohttp.TCPConnector(limit=0)  # one connection per concurrent request, as separate clients
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=900)) as session:

        async def one(planned: Planned) -> Result:
            sent = time.monotonic()
            headers = {"x-priority": planned.priority} if planned.priority else None
            outcome = await chat(
                session, base_url, planned.tenant, MODEL, api_key=api_keys.get(planned.tenant),
                max_tokens=planned.max_tokens, extra_headers=headers, extra_body=engine.request_extras,
                prompt=prompt_text(planned.prompt_tokens, engine.chars_per_token),
            )
            on_done()
            scale = 1.0 / time_scale
            return Result(
                tenant=planned.tenant,
                priority=planned.priority,
                planned=planned.at,
                sent=(sent - t0) * scale,
                status=outcome.status,
                ttft=None if outcome.ttft_s is None else outcome.ttft_s * scale,
                e2e=outcome.total_s * scale,
                queue_wait=None if outcome.queue_wait_s is None else outcome.queue_wait_s * scale,
                prompt_tokens=planned.prompt_tokens,
                max_tokens=planned.max_tokens,
                tokens=outcome.tokens,
                error=outcome.error,
            )

        tasks: list[asyncio.Task[Result]] = []
        for planned in requests:
            delay = t0 + planned.at * time_scale - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(planned)))
        return list(await asyncio.gather(*tasks))


async def run_arm(
    scenario: Scenario,
    arm: Arm,
    *,
    engine: Engine | VllmEngine,
    time_scale: float,
    workdir: Path,
    on_done: Callable[[], None] = lambda: None,
) -> ArmRun:
    """Start the arm's engine and stack, replay the scenario through it, stop everything."""
    workdir.mkdir(parents=True, exist_ok=True)
    redis = RedisServer(workdir) if arm.instances > 1 else None
    if redis is not None:
        await redis.start()
    try:
        config = write_arm_config(workdir / "config.yaml", arm, scenario.tenants, redis.url if redis else None)
        async with await _start(arm, config, engine, time_scale, workdir) as stack:
            return await _measure(scenario, arm, stack, engine, time_scale, on_done)
    finally:
        if redis is not None:
            await redis.stop()


async def _start(arm: Arm, config: Path, engine: Engine | VllmEngine, time_scale: float, workdir: Path) -> Stack:
    if isinstance(engine, VllmEngine):
        # vLLM first: it takes tens of seconds to start, and the processor should find it up.
        endpoint = load_config(config).models[0].endpoints[0]
        vllm = await engine.start(MODEL, endpoint, workdir, arm.scheduling_policy)
        try:
            stack = await start_stack(config, workdir, gateway=arm.gateway, engines=False)
        except BaseException:
            await vllm.stop()
            raise
        stack.sims.append(vllm)
        return stack
    sim_args = [*engine.sim_args(time_scale), "--scheduling-policy", arm.scheduling_policy]
    return await start_stack(config, workdir, sim_args=sim_args, gateway=arm.gateway)


async def _measure(
    scenario: Scenario, arm: Arm, stack: Stack, engine: Engine | VllmEngine, time_scale: float,
    on_done: Callable[[], None],
) -> ArmRun:
    direct = arm.gateway == "direct"
    base_url = stack.sim_url(MODEL) if direct else stack.envoy_url
    keys = {} if direct else {t: api_key(t) for t in scenario.tenants}
    pids = {"engine": [stack.sims[0].process.pid]}
    if stack.envoy is not None:
        pids["envoy"] = [stack.envoy.process.pid]
    if stack.processors:
        pids["extproc"] = [p.process.pid for p in stack.processors.values()]
    cpu_before = {name: _cpu(group) for name, group in pids.items()}
    client_before = time.process_time()
    t0 = time.monotonic()
    stop = asyncio.Event()
    sampler = asyncio.create_task(_sample_engine(stack.sim_url(MODEL), MODEL, t0, time_scale, stop))
    try:
        results = await replay(
            base_url, scenario.requests(), time_scale=time_scale, api_keys=keys, t0=t0, engine=engine,
            on_done=on_done,
        )
    finally:
        stop.set()
        samples = await sampler
    wall = time.monotonic() - t0
    cpu = {name: _cpu(group) - cpu_before[name] for name, group in pids.items()}
    cpu["client"] = time.process_time() - client_before
    counters = await _scrape_processors(stack) if stack.processors else {}
    return ArmRun(scenario.name, arm.name, time_scale, tuple(results), tuple(samples), wall, cpu, counters)


def _cpu(pids: Sequence[int]) -> float:
    return sum(cpu_seconds(pid) for pid in pids)
