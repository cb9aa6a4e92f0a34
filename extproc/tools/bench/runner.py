"""Run one scenario on one arm: a fresh stack, the seeded plan replayed open-loop, the engine watched.

Every run starts its own simulator (and Envoy and extproc when the arm has
them) and stops them afterwards, so each arm meets a fresh engine and a fresh
scheduler (no queue, no fairness counters carried over), and replays the very
same requests at the very same offsets. A cluster arm also gets its own
Redis, started before its processors and stopped after them.

A scenario's phases (references such as its focus group alone) are replayed
first, each on its own once the engine is idle again, on the same stack.

A scenario with a window (``Scenario.window``, a replayed trace's) cuts its run
there: every request not answered by then is abandoned, as a client that gives
up, and its result says so (``Result.cut``) with what its client had received.

Times in the results are *model seconds*: wall-clock time divided by the time
scale, so they read like a real GPU's. A fixed wall-clock cost (the ~1 ms of
the Envoy hop) is magnified by ``1 / time_scale`` in these units; the overhead
benchmark measures such costs at real speed. The TTFT objectives written into
the processor's config are scaled the same way (``arms.scale_objectives``), and
so is the client's wait before retrying a preempted request (``Retry-After``).

The processors run with their decision log on (``--log-level debug
--log-format json``): its lines give each release at the processor's own
clock (:func:`decisions`), to the millisecond.

A request the gateway preempts (503, reason ``preempted``) is sent again after
its ``Retry-After``, as the OpenAI SDK does (numbering its attempts in
``x-stainless-retry-count``, as the SDK does), at most ``MAX_ATTEMPTS`` times;
its result counts the preemptions and keeps the first send as its start. One
refused for its queue wait (503 ``queue_timeout``) is sent again the SDK's
default twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import functools
import json
import random
import string
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from extproc.adapters.config import load_config
from extproc.adapters.protocol.contract import QUEUE_WAIT_HEADER, REASON_HEADER
from extproc.adapters.protocol.dialects import MetricsError, parse_load
from extproc.core.values.outcomes import Refusal
from extproc.tools.bench.arms import MODEL, PRIORITIES, Arm, api_key, arm_config, band_objectives, scale_objectives, write_config
from extproc.tools.bench.load import Planned
from extproc.tools.bench.scenarios import Engine, Scenario
from extproc.tools.bench.vllm import VllmEngine
from extproc.tools.procs import cpu_seconds
from extproc.tools.redis_proc import RedisServer
from extproc.tools.stack import SOLE, Stack, start_stack

# How often the engine's queue is sampled (wall clock).
SAMPLE_INTERVAL_S = 0.05
_FILLER = "the quick brown fox jumps over the lazy dog; " * 2000
# A preempted request is sent again at most this many times in all.
MAX_ATTEMPTS = 20
# A request refused for its queue wait (503 queue_timeout) is sent again after its Retry-After at most this
# many times: the OpenAI SDKs' default max_retries, for a 503.
SDK_RETRIES = 2
# The OpenAI SDKs number every attempt in this header (0 first); the gateway never
# preempts a request that says it is a retry (identity.retry_headers).
RETRY_HEADER = "x-stainless-retry-count"
# Between phases: how long the engine may take to be idle again, and the pause after it
# (a few of the processor's scrapes, so it sees the idle engine too). Wall clock.
SETTLE_TIMEOUT_S = 60.0
SETTLE_PAUSE_S = 0.5
# The processors' decision log, one JSON line per request's outcome (adapters/logs.py).
SERVE_ARGS = ("--log-level", "debug", "--log-format", "json")
DECISIONS_LOGGER = "extproc.decisions"


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
    # A non-streamed request's first token arrives with its whole answer: its ttft is its e2e.
    stream: bool = True
    # Times the gateway preempted it (503 preempted) before the answer counted here.
    preempted: int = 0
    # When the answered attempt was sent (None: the first one was answered).
    resent: float | None = None
    # Not answered by the end of the run's window: abandoned there (its e2e ends at the cut; ttft and tokens are what
    # had arrived by then).
    cut: bool = False

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.ttft is not None and not self.cut

    @property
    def first_token_at(self) -> float | None:
        return None if self.ttft is None else self.sent + self.ttft

    @property
    def done_at(self) -> float:
        return self.sent + self.e2e

    @property
    def released_at(self) -> float | None:
        """When the gateway released the answered attempt (None: no queue-wait header, e.g. direct)."""
        if self.queue_wait is None:
            return None
        return (self.sent if self.resent is None else self.resent) + self.queue_wait


@dataclass(frozen=True)
class EngineSample:
    at: float  # model seconds from the run's start
    waiting: float
    running: float
    # The engine's inter-token latency counters (cumulative seconds and count; None: not exported).
    itl_sum: float | None = None
    itl_count: float | None = None


@dataclass(frozen=True)
class Decision:
    """One line of a processor's decision log: a request released, refused, abandoned or preempted (model seconds)."""

    at: float
    tenant: str
    band: str
    outcome: str  # "released", "refused:<reason>", "abandoned", "preempted"
    # How long it had been held in the queue by then (None: a preemption, whose line gives its time running).
    waited: float | None = None


@dataclass(frozen=True)
class PhaseRun:
    """One phase of a scenario replayed alone (its own start: ``sent`` and samples count from it)."""

    results: tuple[Result, ...]
    engine: tuple[EngineSample, ...]
    wall_s: float
    # Wall-clock time (time.time()) at its start: the decision log's clock.
    started_wall: float = 0.0


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
    # The processors' own counters over the run (its phases left out), summed over instances (see
    # processor_counters).
    processor: dict[str, float] = field(default_factory=dict)
    # The scenario's phases on this arm, by name, replayed before the run.
    phases: dict[str, PhaseRun] = field(default_factory=dict)
    # The TTFT objective of each class (model seconds) as this arm's processor resolved them
    # (direct: as the gateway would have): what objective attainment counts against.
    objectives: dict[str, float] = field(default_factory=dict)
    # The engine's batch size (its slots).
    slots: int = 0
    # The processors' decision log over the run (empty: no processor).
    decisions: tuple[Decision, ...] = ()
    # The engines' prefix-cache counters' growth over the run, summed over replicas (tokens: queries, hits);
    # empty when they export none.
    prefix_cache: dict[str, float] = field(default_factory=dict)
    # Prompt tokens each replica looked up in its prefix cache over the run (in endpoint order): how the arm spread
    # the work (a locality router may pile it on one); empty as prefix_cache.
    replica_queries: tuple[float, ...] = ()


def prompt_text(tokens: int, chars_per_token: int = 4) -> str:
    """A prompt the engine counts as about ``tokens`` tokens."""
    chars = chars_per_token * tokens
    repeats = -(-chars // len(_FILLER))
    return (_FILLER * repeats)[:chars]


@functools.lru_cache(maxsize=256)
def _shared_text(name: str, chars: int) -> str:
    """``chars`` characters of the text named ``name``: the same name gives the same text, and a longer cut of it
    starts with the shorter one; two names differ from their first character (the name leads)."""
    rng = random.Random(name)
    words: list[str] = [f"<{name}>"]
    size = len(words[0])
    while size < chars:
        word = "".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9)))
        words.append(word)
        size += len(word) + 1
    return " ".join(words)[:chars]


def planned_prompt(planned: Planned, number: int, chars_per_token: int) -> str:
    """A prompt of about ``planned.prompt_tokens`` tokens: its shared prefix's text, then text its own.

    Its own part leads with the request's number, so nothing past the prefix
    matches another request's prompt (the engine's prefix cache finds only
    what the plan shares). A prompt that is all shared text (a chat turn, whose
    whole prompt the next turn re-sends) has no part of its own.
    """
    prefix = _shared_text(planned.prefix, chars_per_token * planned.prefix_tokens) if planned.prefix else ""
    own_tokens = planned.prompt_tokens - planned.prefix_tokens
    if prefix and own_tokens <= 0:
        return prefix
    own = f" #{number} {planned.tenant}: " + prompt_text(max(1, own_tokens), chars_per_token)
    return prefix + own[:chars_per_token * max(1, own_tokens)]


async def _sample_engine(url: str, model: str, t0: float, time_scale: float, stop: asyncio.Event) -> list[EngineSample]:
    samples: list[EngineSample] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1.0)) as session:
        while not stop.is_set():
            started = time.monotonic()
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, MetricsError):
                async with session.get(f"{url}/metrics") as response:
                    load = parse_load("vllm", await response.text(), model)
                samples.append(EngineSample((started - t0) / time_scale, load.waiting, load.running,
                                            load.itl_sum, load.itl_count))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), max(0.0, SAMPLE_INTERVAL_S - (time.monotonic() - started)))
    return samples


# Processor series the bench reads, summed over instances and labels (prometheus_client's sample names).
_COUNTERS = {
    "extproc_released_total": "released",
    "extproc_preemptions_total": "preemptions",
    "extproc_cluster_round_trip_seconds_sum": "round_trip_seconds_sum",
    "extproc_cluster_round_trip_seconds_count": "round_trip_count",
}
OBJECTIVE_COUNTER = "extproc_objective_requests_total"


def processor_counters(pages: Sequence[str]) -> dict[str, float]:
    """Release and Redis round-trip totals from the instances' ``/metrics`` pages, summed over instances.

    ``round_trips_ok`` counts only successful round trips (the hot-path cost);
    ``round_trip_le_<bound>`` are the round-trip histogram's cumulative
    buckets, so percentiles can be read off the whole cluster at once;
    ``objective_<class>_<met|missed>`` the requests of a class that met or
    missed its TTFT objective, as the processor judged them.
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
                elif sample.name == OBJECTIVE_COUNTER:
                    key = f"objective_{sample.labels.get('priority')}_{sample.labels.get('outcome')}"
                if key is not None:
                    totals[key] = totals.get(key, 0.0) + sample.value
    return totals


def decisions(lines: Sequence[str], started_wall: float, wall_s: float, time_scale: float) -> list[Decision]:
    """The decision-log lines among ``lines`` (JSON log lines) in the window of a run, its start at 0.

    ``started_wall``: the run's start on the wall clock (``time.time()``);
    lines from before it or after ``wall_s`` are other phases'.
    """
    found = []
    for line in lines:
        if DECISIONS_LOGGER not in line:
            continue
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if entry.get("logger") != DECISIONS_LOGGER:
            continue
        offset = datetime.datetime.fromisoformat(entry["ts"]).timestamp() - started_wall
        if 0 <= offset <= wall_s:
            wait_ms = entry.get("wait_ms")
            waited = None if wait_ms is None else wait_ms / 1000 / time_scale
            found.append(Decision(offset / time_scale, entry["tenant"], entry["class"], entry["outcome"], waited))
    return sorted(found, key=lambda d: d.at)


def _decision_log(stack: Stack, run: PhaseRun, time_scale: float) -> tuple[Decision, ...]:
    """The run's decisions, and those of the requests it abandoned at its end (a window's cut), logged just after."""
    lines: list[str] = []
    for name in stack.processors:
        log = stack.workdir / ("extproc.log" if name == SOLE else f"extproc-{name}.log")
        with contextlib.suppress(OSError):
            lines += log.read_text(encoding="utf-8", errors="replace").splitlines()
    return tuple(decisions(lines, run.started_wall, run.wall_s + SETTLE_PAUSE_S, time_scale))


async def _scrape_processors(stack: Stack) -> dict[str, float]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5.0)) as session:
        pages = []
        for url in stack.metrics_urls.values():
            async with session.get(url) as response:
                response.raise_for_status()
                pages.append(await response.text())
    return processor_counters(pages)


@dataclass
class Progress:
    """What the client has seen of an attempt so far (wall seconds from its send): what a cut request had received."""

    status: int = 0
    queue_wait_s: float | None = None
    ttft_s: float | None = None
    tokens: int = 0


@dataclass(frozen=True)
class Attempt:
    """One HTTP exchange as the client saw it (wall seconds from its own send)."""

    status: int
    ttft_s: float | None
    total_s: float
    queue_wait_s: float | None
    tokens: int
    error: str = ""
    reason: str | None = None  # the gateway's reason header on its own answers
    retry_after_s: float | None = None


async def send(
    session: aiohttp.ClientSession, url: str, body: Mapping[str, object], headers: Mapping[str, str],
    progress: Progress | None = None,
) -> Attempt:
    """One chat completion, streamed or whole as ``body`` says; never raises for HTTP or connection errors.

    A streamed answer's tokens are its content chunks (one token each, the
    simulator's and vLLM's default); a whole one's, its usage. ``progress``
    follows the answer as it arrives (for a request the window cuts).
    """
    start = time.monotonic()
    ttft: float | None = None
    tokens = 0
    seen = progress or Progress()
    try:
        async with session.post(url, json=body, headers=headers) as response:
            wait_ms = response.headers.get(QUEUE_WAIT_HEADER)
            queue_wait = int(wait_ms) / 1000 if wait_ms is not None else None
            seen.status, seen.queue_wait_s = response.status, queue_wait
            if response.status != 200:
                retry = response.headers.get("retry-after")
                return Attempt(response.status, None, time.monotonic() - start, queue_wait, 0,
                               (await response.text())[:200], response.headers.get(REASON_HEADER),
                               float(retry) if retry and retry.isdigit() else None)
            if not body.get("stream"):
                answer = await response.json()
                total = time.monotonic() - start
                return Attempt(200, total, total, queue_wait, int(answer.get("usage", {}).get("completion_tokens", 0)))
            async for raw in response.content:
                line = raw.strip()
                if line.startswith(b"data: {") and any(
                    c.get("delta", {}).get("content") for c in json.loads(line[6:]).get("choices", [])
                ):
                    tokens += 1
                    ttft = time.monotonic() - start if ttft is None else ttft
                    seen.ttft_s, seen.tokens = ttft, tokens
            return Attempt(200, ttft, time.monotonic() - start, queue_wait, tokens)
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        return Attempt(0, None, time.monotonic() - start, None, 0, repr(exc))


def refused_for(attempt: Attempt, refusal: Refusal) -> bool:
    """Whether ``attempt`` is the gateway's 503 for ``refusal`` (its reason header, else its error body)."""
    return attempt.status == 503 and (attempt.reason == refusal.value
                                      or f'"code": "{refusal.value}"' in attempt.error)


def preempted(attempt: Attempt) -> bool:
    """The gateway ended the request before its answer began, for a higher class: send it again."""
    return refused_for(attempt, Refusal.PREEMPTED)


@dataclass
class Sending:
    """One request on its way: when its first attempt and its current one were sent, its preemptions, what arrived."""

    planned: Planned
    sent: float
    resent: float | None = None
    preempted: int = 0
    # Queue timeouts sent again (as the OpenAI SDK does: at most SDK_RETRIES times).
    timeouts: int = 0
    progress: Progress = field(default_factory=Progress)


async def replay(
    base_urls: Sequence[str],
    requests: Sequence[Planned],
    *,
    time_scale: float,
    api_keys: dict[str, str],
    t0: float,
    engine: Engine | VllmEngine,
    on_done: Callable[[], None] = lambda: None,
    unique_prompts: bool = False,
    window: float | None = None,
    priorities: Mapping[str, int] | None = None,
) -> list[Result]:
    """Send every planned request at ``t0 + at * time_scale`` (open loop) and wait for all answers.

    A request whose stream stops after a tenant (``Planned.stop_after``) is
    not sent once every request of that tenant has been answered (it counts as
    done for ``on_done``, and has no result). The requests go to ``base_urls``
    in turn (several: the engine replicas straight, as clients split evenly).
    ``unique_prompts``: each prompt is its shared prefix and text of its own
    (:func:`planned_prompt`), else the same filler text for all. ``window``
    (model seconds from ``t0``): at its end every request not yet answered is
    abandoned and its result marked ``cut``; a request planned after it is
    not sent (and has no result). ``priorities``: each class's body ``priority`` (clients of an engine's
    priority queue), else none is written.
    """
    numbers = {id(planned): number for number, planned in enumerate(requests)}
    connector = aiohttp.TCPConnector(limit=0)  # one connection per concurrent request, as separate clients
    scale = 1.0 / time_scale
    # Requests of each tenant not yet answered: a stream that stops after a tenant stops at 0.
    # (Only tenants this replay sends: a phase without them stops nothing.)
    stops = {r.stop_after for r in requests if r.stop_after is not None}
    left = {t: n for t in stops if (n := sum(r.tenant == t for r in requests))}
    cut_at = None if window is None else t0 + window * time_scale
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=900)) as session:

        def result(sending: Sending, attempt: Attempt | Progress, total_s: float, error: str, *, cut: bool = False
                   ) -> Result:
            planned = sending.planned
            since = (sending.resent or sending.sent) - sending.sent  # the answered attempt's start, from the first send
            return Result(
                tenant=planned.tenant,
                priority=planned.priority,
                planned=planned.at,
                sent=(sending.sent - t0) * scale,
                status=attempt.status,
                ttft=None if attempt.ttft_s is None else (since + attempt.ttft_s) * scale,
                e2e=(since + total_s) * scale,
                queue_wait=None if attempt.queue_wait_s is None else attempt.queue_wait_s * scale,
                prompt_tokens=planned.prompt_tokens,
                max_tokens=planned.max_tokens,
                tokens=attempt.tokens,
                error=error,
                stream=planned.stream,
                preempted=sending.preempted,
                resent=None if sending.resent is None else (sending.resent - t0) * scale,
                cut=cut,
            )

        async def one(sending: Sending) -> Result:
            planned = sending.planned
            headers = {"content-type": "application/json"}
            if planned.priority:
                headers["x-priority"] = planned.priority
            if key := api_keys.get(planned.tenant):
                headers["authorization"] = f"Bearer {key}"
            text = (planned_prompt(planned, numbers[id(planned)], engine.chars_per_token) if unique_prompts
                    else prompt_text(planned.prompt_tokens, engine.chars_per_token))
            body = {
                "model": MODEL, "max_tokens": planned.max_tokens, "stream": planned.stream,
                "messages": [{"role": "user", "content": text}],
                **engine.request_extras,
            }
            if priorities is not None and planned.priority is not None and planned.priority in priorities:
                body["priority"] = priorities[planned.priority]
            url = f"{base_urls[numbers[id(planned)] % len(base_urls)]}/v1/chat/completions"
            attempt = await send(session, url, body, {**headers, RETRY_HEADER: "0"}, sending.progress)
            attempts = 1
            while ((preempted(attempt) and attempts < MAX_ATTEMPTS)
                   or (refused_for(attempt, Refusal.QUEUE_TIMEOUT) and sending.timeouts < SDK_RETRIES)):
                if preempted(attempt):
                    sending.preempted += 1
                else:
                    sending.timeouts += 1
                # Retry-After is the gateway's wall-clock advice to a client of the modelled GPU: model seconds.
                await asyncio.sleep((attempt.retry_after_s or 1.0) * time_scale)
                sending.resent, sending.progress = time.monotonic(), Progress()
                attempt = await send(session, url, body, {**headers, RETRY_HEADER: str(attempts)}, sending.progress)
                attempts += 1
            sending.preempted += preempted(attempt)
            if planned.tenant in left:
                left[planned.tenant] -= 1
            on_done()
            return result(sending, attempt, attempt.total_s, attempt.error)

        def stopped(planned: Planned) -> bool:
            return planned.stop_after in left and left[planned.stop_after] == 0

        tasks: list[tuple[Sending, asyncio.Task[Result]]] = []
        for planned in requests:
            if cut_at is not None and t0 + planned.at * time_scale >= cut_at:
                on_done()  # planned after the window: never sent
                continue
            delay = t0 + planned.at * time_scale - time.monotonic()
            if delay > 0 and not stopped(planned):
                await asyncio.sleep(delay)
            if stopped(planned):
                on_done()
                continue
            sending = Sending(planned, time.monotonic())
            tasks.append((sending, asyncio.create_task(one(sending))))
        if cut_at is None or not tasks:
            return list(await asyncio.gather(*(task for _, task in tasks)))
        _, pending = await asyncio.wait([task for _, task in tasks], timeout=max(0.0, cut_at - time.monotonic()))
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        results = []
        for sending, task in tasks:
            if task in pending:
                on_done()
                results.append(result(sending, sending.progress, cut_at - (sending.resent or sending.sent),
                                      "not answered in the window", cut=True))
            else:
                results.append(task.result())
        return results


async def run_arm(
    scenario: Scenario,
    arm: Arm,
    *,
    engine: Engine | VllmEngine,
    time_scale: float,
    workdir: Path,
    on_done: Callable[[], None] = lambda: None,
) -> ArmRun:
    """Start the arm's engine and stack, replay the scenario (its phases first) through it, stop everything."""
    workdir.mkdir(parents=True, exist_ok=True)
    redis = RedisServer(workdir) if arm.instances > 1 else None
    if redis is not None:
        await redis.start()
    try:
        doc = arm_config(arm, scenario.tenants, redis.url if redis else None, scenario.gateway,
                         replicas=scenario.replicas, model_settings=scenario.model)
        config = write_config(workdir / "config.yaml", scale_objectives(doc, time_scale))
        async with await _start(arm, config, engine, time_scale, workdir) as stack:
            run = await _measure(scenario, arm, stack, engine, time_scale, on_done)
        return replace(run, objectives=band_objectives(doc), slots=engine.max_num_seqs)
    finally:
        if redis is not None:
            await redis.stop()


async def _start(arm: Arm, config: Path, engine: Engine | VllmEngine, time_scale: float, workdir: Path) -> Stack:
    if isinstance(engine, VllmEngine):
        # vLLM first: it takes tens of seconds to start, and the processor should find it up.
        servers = []
        try:
            for endpoint in load_config(config).models[0].endpoints:
                servers.append(await engine.start(MODEL, endpoint, workdir, arm.scheduling_policy))
            stack = await start_stack(config, workdir, serve_args=SERVE_ARGS, gateway=arm.gateway, engines=False)
        except BaseException:
            for server in servers:
                await server.stop()
            raise
        stack.sims.extend(servers)
        return stack
    sim_args = [*engine.sim_args(time_scale), "--scheduling-policy", arm.scheduling_policy, *arm.sim_args]
    return await start_stack(config, workdir, sim_args=sim_args, serve_args=SERVE_ARGS, gateway=arm.gateway)


async def _watched(
    stack: Stack, base_urls: Sequence[str], requests: Sequence[Planned], keys: dict[str, str],
    engine: Engine | VllmEngine, time_scale: float, on_done: Callable[[], None], *, unique_prompts: bool = False,
    window: float | None = None, priorities: Mapping[str, int] | None = None,
) -> PhaseRun:
    """Replay ``requests`` from now, sampling the (first) engine until the last answer (or the window's cut)."""
    started_wall = time.time()
    t0 = time.monotonic()
    stop = asyncio.Event()
    sampler = asyncio.create_task(_sample_engine(stack.sim_url(MODEL), MODEL, t0, time_scale, stop))
    try:
        results = await replay(
            base_urls, requests, time_scale=time_scale, api_keys=keys, t0=t0, engine=engine, on_done=on_done,
            unique_prompts=unique_prompts, window=window, priorities=priorities,
        )
    finally:
        stop.set()
        samples = await sampler
    return PhaseRun(tuple(results), tuple(samples), time.monotonic() - t0, started_wall)


async def _settle(url: str) -> None:
    """Wait until the engine runs and queues nothing (at most SETTLE_TIMEOUT_S), then SETTLE_PAUSE_S more."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1.0)) as session:
        while time.monotonic() < deadline:
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, MetricsError):
                async with session.get(f"{url}/metrics") as response:
                    load = parse_load("vllm", await response.text(), MODEL)
                if load.running == 0 and load.waiting == 0:
                    break
            await asyncio.sleep(SAMPLE_INTERVAL_S)
    await asyncio.sleep(SETTLE_PAUSE_S)


async def _measure(
    scenario: Scenario, arm: Arm, stack: Stack, engine: Engine | VllmEngine, time_scale: float,
    on_done: Callable[[], None],
) -> ArmRun:
    direct = arm.gateway == "direct"
    endpoints = _endpoints(stack)
    base_urls = endpoints if direct else [stack.envoy_url]
    keys = {} if direct else {t: api_key(t) for t in scenario.tenants}
    unique = scenario.unique_prompts
    priorities = {name: index for index, name in enumerate(PRIORITIES)} if arm.body_priority else None
    phases = {}
    for phase in scenario.phases_of(arm.name):
        phases[phase.name] = await _watched(
            stack, base_urls, scenario.phase_requests(phase), keys, engine, time_scale, on_done, unique_prompts=unique,
            priorities=priorities)
        await _settle(stack.sim_url(MODEL))
    counters_before = await _scrape_processors(stack) if stack.processors and phases else {}
    pids = {"engine": [sim.process.pid for sim in stack.sims]}
    if stack.envoy is not None:
        pids["envoy"] = [stack.envoy.process.pid]
    if stack.processors:
        pids["extproc"] = [p.process.pid for p in stack.processors.values()]
    cpu_before = {name: _cpu(group) for name, group in pids.items()}
    client_before = time.process_time()
    prefix_before = await _prefix_counters(endpoints)
    run = await _watched(stack, base_urls, scenario.requests(), keys, engine, time_scale, on_done, unique_prompts=unique,
                         window=scenario.window, priorities=priorities)
    if any(r.cut for r in run.results):
        # The requests it abandoned reach the processors' counters and decision log a moment later.
        await asyncio.sleep(SETTLE_PAUSE_S)
    prefix_after = await _prefix_counters(endpoints)
    grown = [(after[0] - before[0], after[1] - before[1])
             for before, after in zip(prefix_before, prefix_after, strict=True)]
    prefix_cache = {"queries": sum(q for q, _ in grown), "hits": sum(h for _, h in grown)} if grown else {}
    cpu = {name: _cpu(group) - cpu_before[name] for name, group in pids.items()}
    cpu["client"] = time.process_time() - client_before
    counters = await _scrape_processors(stack) if stack.processors else {}
    # Counters over the run alone: what the phases before it added is taken off.
    counters = {key: value - counters_before.get(key, 0.0) for key, value in counters.items()}
    return ArmRun(scenario.name, arm.name, time_scale, run.results, run.engine, run.wall_s, cpu, counters, phases,
                  decisions=_decision_log(stack, run, time_scale), prefix_cache=prefix_cache,
                  replica_queries=tuple(q for q, _ in grown))


def _endpoints(stack: Stack) -> list[str]:
    found = stack.config.model(MODEL)
    assert found is not None
    return list(found.endpoints)


async def _prefix_counters(endpoints: Sequence[str]) -> list[tuple[float, float]]:
    """Each engine's prefix-cache counters (prompt tokens queried, found), in the order of ``endpoints``.

    Empty when an engine does not export them (prefix caching off on the simulator).
    """
    counters = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5.0)) as session:
        for endpoint in endpoints:
            async with session.get(f"{endpoint}/metrics") as response:
                load = parse_load("vllm", await response.text(), MODEL)
            if load.prefix_queries is None or load.prefix_hits is None:
                return []
            counters.append((load.prefix_queries, load.prefix_hits))
    return counters


def _cpu(pids: Sequence[int]) -> float:
    return sum(cpu_seconds(pid) for pid in pids)
