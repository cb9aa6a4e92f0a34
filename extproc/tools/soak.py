"""``extproc-dev soak``: mixed traffic for an hour through a real Envoy, the processor and simulators; is it flat?

A leak shows only with time: a task, a file descriptor or a few kilobytes left
behind per request, per cancelled stream, per reload. The soak runs what a
gateway lives through, all at once and for as long as asked (60 minutes by
default), and samples the processor every ``--sample-s``:

* **traffic**: streamed chats from two tenants on two models (one of them
  with ``check_stream_start``, so its streams pass the processor chunk by
  chunk), a power user's burst every minute that fills the queue, clients
  that leave mid-stream and while queued, a tenant over its per-minute budget
  (429s) and one past its day's budget, and a batch through the Batch API
  (the OpenAI SDK's workflow) every few minutes;
* **changes**: the config read again (SIGHUP) every two minutes, a tenant's
  weight toggled; one engine stopped and started again every 20 minutes (its
  requests fail, the gate marks it down and back up);
* **samples**: the processor's resident memory and open file descriptors
  (from ``/proc``), the tasks on its event loop (``extproc_asyncio_tasks``),
  and the release latency (its queue wait, p50 and p99 of the interval, from
  ``extproc_queue_wait_seconds``).

The report (``--out``): ``soak.json`` (every sample and count), ``soak.png``
(the four curves) and a verdict printed (:func:`verdict`): from minute 5 (a
sixth of a shorter run) on, memory and descriptors are *flat* when, in each
sixth of the rest, their level (the least: what the process comes back to
between bursts and batches) stays within 5 % of the first sixth's (the peaks
are reported). Short runs (``--minutes 0.3``) compress the schedule: each change
comes at least once.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import os
import random
import signal
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Coroutine
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from prometheus_client.parser import text_string_to_metric_families

from extproc.tools.procs import free_port
from extproc.tools.stack import Stack, start_sim, start_stack

# Tenants and their API keys; carol is over her per-minute budget, dave past his day's.
KEYS = {"key-alice": "alice", "key-bob": "bob", "key-carol": "carol", "key-dave": "dave"}
TENANT_KEYS = {tenant: key for key, tenant in KEYS.items()}
MODELS = ("m1", "m2")  # m2 reads its streams' first event (check_stream_start)
# A simulated engine that serves ~25 short streams a second: the steady traffic fits, the minute's burst queues.
SIM_ARGS = ("--max-num-seqs", "8", "--step-ms", "20", "--time-scale", "0.5")
MAX_TOKENS = 24
STREAMS_PER_S = 6.0  # alice and bob, both models
BURST = 40  # alice's, once a minute
CANCELS_PER_S = 1.0  # half mid-stream, half while queued (in a burst)
OVER_BUDGET_PER_S = 1.0  # carol (above 30/min) and dave (a day's budget spent at once)
BATCH_LINES = 60
# How often each change comes in a full run; a short run takes each at least once (_period).
RELOAD_S = 120.0
RESTART_S = 1200.0
BATCH_S = 300.0
BURST_S = 60.0
ENGINE_DOWN_S = 5.0
WARMUP_S = 300.0  # "from minute 5": what a long run is judged from
FLAT_SHARE = 0.05


@dataclass
class Sample:
    """The processor at one moment, and the release latency over the interval that ended then."""

    t_s: float
    rss_mb: float
    fds: int
    tasks: float
    queue_wait_p50_ms: float | None
    queue_wait_p99_ms: float | None
    in_flight: float
    queued: float


@dataclass
class Soak:
    """What ran, and what it did: the samples, and a count of every outcome by kind."""

    minutes: float
    samples: list[Sample] = field(default_factory=list)
    outcomes: Counter[str] = field(default_factory=Counter)
    events: list[tuple[float, str]] = field(default_factory=list)


def _period(full_s: float, duration_s: float, times: int = 1) -> float:
    """A change's period: ``full_s`` in a long run, short enough in a short one that it comes ``times`` times."""
    return min(full_s, duration_s / (times + 1))


def soak_config(workdir: Path) -> dict[str, Any]:
    """Two models on one simulator each, budgets, the batch API, on free ports."""
    return {
        "listen": {"grpc": f"127.0.0.1:{free_port()}", "metrics": f"127.0.0.1:{free_port()}"},
        "priorities": ["interactive", "standard", "batch"],
        "default_priority": "standard",
        "models": [{"name": name, "endpoints": [f"http://127.0.0.1:{free_port()}"], "max_running": 8,
                    "check_stream_start": name == "m2", "max_queue_wait_s": 20} for name in MODELS],
        "tenants": {"alice": {"weight": 1}, "bob": {"priorities": ["standard", "batch"]}},
        "budgets": {"store": str(workdir / "usage.sqlite"),
                    "tenants": {"carol": {"requests_per_minute": 30}, "dave": {"tokens_per_day": 100}}},
        "batches": {"directory": str(workdir / "batches"), "listen": f"127.0.0.1:{free_port()}",
                    "runner_listen": f"127.0.0.1:{free_port()}", "in_flight_per_batch": 8},
        "envoy": {"listen": f"127.0.0.1:{free_port()}", "admin": f"127.0.0.1:{free_port()}", "api_keys": KEYS},
    }


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _quantile(buckets: dict[float, float], q: float) -> float | None:
    """The ``q`` quantile of a histogram's cumulative bucket counts (linear within a bucket); None when empty."""
    bounds = sorted(buckets)
    total = buckets[bounds[-1]] if bounds else 0
    if total <= 0:
        return None
    rank, below, lower = q * total, 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if math.isinf(bound):
                return lower
            return lower + (bound - lower) * (rank - below) / max(count - below, 1e-9)
        below, lower = count, bound
    return lower


async def _page(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    """From the processor's page: the queue wait's buckets (all models), the tasks, what it holds and runs."""
    async with session.get(url) as response:
        text = await response.text()
    buckets: dict[float, float] = {}
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "extproc_queue_wait_seconds_bucket":
                bound = float(s.labels["le"])
                buckets[bound] = buckets.get(bound, 0.0) + s.value
            elif s.name in ("extproc_asyncio_tasks", "extproc_in_flight", "extproc_queue_depth",
                            "extproc_config_reloads_total"):
                name = s.name + (f":{s.labels['outcome']}" if "outcome" in s.labels else "")
                found[name] = found.get(name, 0.0) + s.value
    return {"buckets": buckets, **found}


class Traffic:
    """The clients of one soak: each loop runs until ``stop`` is set, and counts its outcomes."""

    def __init__(self, stack: Stack, soak: Soak, stop: asyncio.Event) -> None:
        self.stack = stack
        self.soak = soak
        self.stop = stop
        self.started = time.monotonic()
        self.http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                          timeout=aiohttp.ClientTimeout(total=60))

    def count(self, kind: str) -> None:
        self.soak.outcomes[kind] += 1

    def note(self, event: str) -> None:
        self.soak.events.append((round(time.monotonic() - self.started, 1), event))

    async def chat(self, tenant: str, model: str, *, leave_after: int | None = None, timeout_s: float | None = None,
                   kind: str = "stream") -> None:
        """One streamed chat; after ``leave_after`` tokens, or ``timeout_s`` (queued, or streaming), the client leaves."""
        body = {"model": model, "messages": [{"role": "user", "content": f"hi from {tenant}"}],
                "max_tokens": MAX_TOKENS, "stream": True, "stream_options": {"include_usage": True}}
        headers = {"authorization": f"Bearer {TENANT_KEYS[tenant]}"}
        timeout = aiohttp.ClientTimeout(total=timeout_s) if timeout_s else None
        began = False  # the response's headers came: the request left the queue
        try:
            async with self.http.post(f"{self.stack.envoy_url}/v1/chat/completions", json=body, headers=headers,
                                      timeout=timeout) as response:
                began = True
                if response.status != 200:
                    await response.read()
                    self.count(f"{kind}:{response.status}")
                    return
                tokens, done = 0, False
                async for line in response.content:
                    if line.startswith(b'data: {"id"') and b'"content"' in line:
                        tokens += 1
                        if leave_after is not None and tokens >= leave_after:
                            self.count(f"{kind}:left mid-stream")
                            return
                    done = done or line.startswith(b"data: [DONE]")
                # Cut short: the engine stopped mid-stream (the restarts); without tokens too: before its first.
                self.count(f"{kind}:200" if done else f"{kind}:200 cut short" if tokens else f"{kind}:200 without tokens")
        except TimeoutError:
            self.count(f"{kind}:left mid-stream" if began else f"{kind}:left while queued")
        except aiohttp.ClientError as exc:
            self.count(f"{kind}:{type(exc).__name__}")

    async def every(self, period_s: float, action: Callable[[], Coroutine[Any, Any, None]], *, jitter: bool = True) -> None:
        """``action`` every ``period_s`` (Poisson arrivals if ``jitter``), each as its own task, until the stop."""
        running: set[asyncio.Task[None]] = set()
        try:
            while not self.stop.is_set():
                wait = random.expovariate(1 / period_s) if jitter else period_s
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.stop.wait(), wait)
                if self.stop.is_set():
                    break
                task = asyncio.create_task(action())
                running.add(task)
                task.add_done_callback(running.discard)
        finally:
            await asyncio.gather(*running, return_exceptions=True)

    async def steady(self) -> None:
        await self.every(1 / STREAMS_PER_S, lambda: self.chat(random.choice(("alice", "bob")), random.choice(MODELS)))

    async def cancels(self) -> None:
        async def leave() -> None:
            await self.chat("bob", random.choice(MODELS), leave_after=3, kind="cancel")
        await self.every(1 / CANCELS_PER_S, leave)

    async def over_budget(self) -> None:
        async def over() -> None:
            await self.chat(random.choice(("carol", "dave")), "m1", kind="budget")
        await self.every(1 / OVER_BUDGET_PER_S, over)

    async def bursts(self, period_s: float) -> None:
        async def burst() -> None:
            self.note("burst")
            # Alice's flood, and bob's clients that give up after 0.3 s in the queue it builds.
            await asyncio.gather(*(self.chat("alice", "m1", kind="burst") for _ in range(BURST)),
                                 *(self.chat("bob", "m1", timeout_s=0.3, kind="cancel") for _ in range(5)))
        await self.every(period_s, burst, jitter=False)

    async def batches(self, period_s: float) -> None:
        import openai  # a test extra, not in the image whose `extproc-dev sim` the compose demo runs

        client = openai.AsyncOpenAI(base_url=f"{self.stack.envoy_url}/v1", api_key=TENANT_KEYS["bob"], max_retries=3)

        async def batch() -> None:
            self.note("batch")
            lines = b"".join(json.dumps({
                "custom_id": f"l{i}", "method": "POST", "url": "/v1/chat/completions",
                "body": {"model": MODELS[i % 2], "messages": [{"role": "user", "content": f"line {i}"}],
                         "max_tokens": 8}}).encode() + b"\n" for i in range(BATCH_LINES))
            try:
                uploaded = await client.files.create(file=("soak.jsonl", lines), purpose="batch")
                created = await client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                                      completion_window="24h")
                while (found := await client.batches.retrieve(created.id)).status not in (
                        "completed", "failed", "expired", "cancelled"):
                    await asyncio.sleep(1)
                self.count(f"batch:{found.status}")
                if found.output_file_id is not None:
                    await client.files.delete(found.output_file_id)
                await client.files.delete(uploaded.id)
            except openai.OpenAIError as exc:
                self.count(f"batch:{type(exc).__name__}")

        async with client:
            await self.every(period_s, batch, jitter=False)

    async def reloads(self, config_path: Path, period_s: float) -> None:
        async def reload() -> None:
            doc = yaml.safe_load(config_path.read_text())
            alice = doc["tenants"]["alice"]
            alice["weight"] = 3 - alice["weight"]  # 1, 2, 1, ...
            config_path.write_text(yaml.safe_dump(doc))
            assert self.stack.processor is not None
            self.stack.processor.process.send_signal(signal.SIGHUP)
            self.note(f"reload (alice's weight {alice['weight']})")
        await self.every(period_s, reload, jitter=False)

    async def restarts(self, period_s: float, sim_args: tuple[str, ...]) -> None:
        model = self.stack.config.models[0]

        async def restart() -> None:
            self.note(f"engine {model.name} stopped")
            await self.stack.sims[0].stop()
            await asyncio.sleep(ENGINE_DOWN_S)
            self.stack.sims[0] = await start_sim(model, model.endpoints[0], self.stack.workdir, sim_args)
            self.note(f"engine {model.name} started")
            self.count("engine restarts")
        await self.every(period_s, restart, jitter=False)

    async def close(self) -> None:
        await self.http.close()


async def _sample(stack: Stack, soak: Soak, session: aiohttp.ClientSession, started: float,
                  last: dict[float, float]) -> dict[float, float]:
    assert stack.processor is not None
    pid = stack.processor.process.pid
    page = await _page(session, f"{stack.metrics_url}")
    buckets: dict[float, float] = page["buckets"]
    interval = {bound: count - last.get(bound, 0.0) for bound, count in buckets.items()}
    p50, p99 = _quantile(interval, 0.5), _quantile(interval, 0.99)
    soak.samples.append(Sample(
        t_s=round(time.monotonic() - started, 1), rss_mb=round(_rss_mb(pid), 2), fds=_fds(pid),
        tasks=page.get("extproc_asyncio_tasks", 0.0),
        queue_wait_p50_ms=None if p50 is None else round(p50 * 1000, 2),
        queue_wait_p99_ms=None if p99 is None else round(p99 * 1000, 2),
        in_flight=page.get("extproc_in_flight", 0.0), queued=page.get("extproc_queue_depth", 0.0),
    ))
    soak.outcomes["reloads applied"] = int(page.get("extproc_config_reloads_total:applied", 0))
    return buckets


async def run_soak(minutes: float, workdir: Path, *, sample_s: float = 10.0,
                   on_sample: Callable[[Sample], None] | None = None) -> Soak:
    """Run the soak for ``minutes``; every sample and outcome. Ends with the traffic stopped and the processor idle."""
    duration = minutes * 60
    workdir.mkdir(parents=True, exist_ok=True)
    config_path = workdir / "soak.yaml"
    config_path.write_text(yaml.safe_dump(soak_config(workdir)))
    soak = Soak(minutes)
    async with await start_stack(config_path, workdir, sim_args=SIM_ARGS) as stack:
        stop = asyncio.Event()
        traffic = Traffic(stack, soak, stop)
        loops = [traffic.steady(), traffic.cancels(), traffic.over_budget(),
                 traffic.bursts(_period(BURST_S, duration)), traffic.batches(_period(BATCH_S, duration)),
                 traffic.reloads(config_path, _period(RELOAD_S, duration, 2)),
                 traffic.restarts(_period(RESTART_S, duration), SIM_ARGS)]
        running = [asyncio.create_task(loop) for loop in loops]
        started = time.monotonic()
        sample_every = min(sample_s, duration / 10)
        async with aiohttp.ClientSession() as session:
            last: dict[float, float] = {}
            try:
                while (elapsed := time.monotonic() - started) < duration:
                    await asyncio.sleep(min(sample_every, duration - elapsed))
                    last = await _sample(stack, soak, session, started, last)
                    if on_sample is not None:
                        on_sample(soak.samples[-1])
            finally:
                stop.set()
                await asyncio.gather(*running, return_exceptions=True)
                await traffic.close()
            # Every request ended: nothing held, nothing in flight, once the last answers are in.
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                last = await _sample(stack, soak, session, started, last)
                if not soak.samples[-1].in_flight and not soak.samples[-1].queued:
                    break
                await asyncio.sleep(0.5)
    return soak


def verdict(soak: Soak) -> dict[str, Any]:
    """Memory, descriptors and tasks from the warm-up on, in six windows: each window's level (its least: what the
    process comes back to between bursts and batches) and peak (its most), against the first window's. Flat: the
    level of memory and of descriptors stays within 5 % (a leak raises the floor). The peaks are reported, not
    judged: a batch's connections raise the descriptors for its minute, and a window may or may not hold one."""
    samples = soak.samples[:-1] or soak.samples  # the last one was taken after the traffic stopped
    end = samples[-1].t_s
    warm = min(WARMUP_S, end / 6)
    after = [s for s in samples if s.t_s >= warm] or samples[-1:]
    width = max((end - warm) / 6, 1e-9)
    windows = [w for i in range(6) if (w := [s for s in after if warm + i * width <= s.t_s < warm + (i + 1) * width])]
    windows = windows or [after]
    out: dict[str, Any] = {"from_s": warm, "window_s": round(width, 1)}
    for name in ("rss_mb", "fds", "tasks"):
        levels = [min(getattr(s, name) for s in w) for w in windows]
        peaks = [max(getattr(s, name) for s in w) for w in windows]
        out[name] = {"levels": levels, "peaks": peaks,
                     "level_growth": round(max(abs(v - levels[0]) for v in levels) / levels[0], 4) if levels[0] else 0.0,
                     "peak_growth": round(max(abs(v - peaks[0]) for v in peaks) / peaks[0], 4) if peaks[0] else 0.0}
    waits = [s.queue_wait_p99_ms for s in after if s.queue_wait_p99_ms is not None]
    out["queue_wait_p99_ms"] = {"median": statistics.median(waits), "max": max(waits)} if waits else None
    out["flat"] = all(out[name]["level_growth"] <= FLAT_SHARE for name in ("rss_mb", "fds"))
    return out


def plot(soak: Soak, path: Path) -> None:
    """Memory, descriptors, tasks and the release latency against minutes: the warm-up shaded, and for memory and
    descriptors the band the verdict allows (5 % around the first window's level)."""
    from extproc.tools.plots import pyplot

    judged = verdict(soak)
    warm = judged["from_s"] / 60
    minutes = [s.t_s / 60 for s in soak.samples]
    fig, axes = pyplot().subplots(4, 1, figsize=(8.0, 9.0), sharex=True)
    panels = (("resident memory (MB)", "rss_mb"), ("open file descriptors", "fds"), ("asyncio tasks", "tasks"))
    for ax, (label, name) in zip(axes, panels, strict=False):
        ax.plot(minutes, [getattr(s, name) for s in soak.samples], marker=".", linewidth=1)
        ax.set_ylabel(label)
        if name != "tasks":
            level = judged[name]["levels"][0]
            ax.axhspan(level * (1 - FLAT_SHARE), level * (1 + FLAT_SHARE), xmin=0, xmax=1, color="green", alpha=0.1,
                       label="first level ± 5 %")
            ax.legend(loc="lower right")
        else:
            ax.set_ylim(bottom=0)
    waits = axes[3]
    for q in ("p50", "p99"):
        values = [getattr(s, f"queue_wait_{q}_ms") for s in soak.samples]
        waits.plot(minutes, [math.nan if v is None else v for v in values], marker=".", linewidth=1, label=q)
    waits.set_ylabel("release latency (ms)")
    waits.set_yscale("symlog", linthresh=1)
    waits.legend(loc="upper right")
    waits.set_xlabel("minutes")
    for ax in axes:
        ax.axvspan(0, warm, color="grey", alpha=0.15)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)


def write_report(soak: Soak, out: Path) -> dict[str, Any]:
    """``soak.json`` and ``soak.png`` in ``out``; the verdict."""
    out.mkdir(parents=True, exist_ok=True)
    judged = verdict(soak)
    (out / "soak.json").write_text(json.dumps({
        "minutes": soak.minutes, "verdict": judged, "outcomes": dict(sorted(soak.outcomes.items())),
        "events": soak.events, "samples": [asdict(s) for s in soak.samples],
    }, indent=1), encoding="utf-8")
    plot(soak, out / "soak.png")
    return judged


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--minutes", type=float, default=60.0, help="how long (default %(default)s; 0.3 for a smoke run)")
    parser.add_argument("--sample-s", type=float, default=10.0, help="seconds between samples (default %(default)s)")
    parser.add_argument("--out", default="soak-out", help="where soak.json and soak.png go (default %(default)s)")
    parser.add_argument("--workdir", help="logs and configs (default: a new temporary folder)")


def run(args: argparse.Namespace) -> int:
    import uvloop

    logging.getLogger("httpx").setLevel(logging.WARNING)  # the OpenAI SDK's line per request
    if args.minutes <= 0 or args.sample_s <= 0:
        raise SystemExit("error: --minutes and --sample-s must be > 0")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="extproc-soak-"))

    def show(sample: Sample) -> None:
        print(f"{sample.t_s / 60:6.1f} min  rss {sample.rss_mb:7.1f} MB  fds {sample.fds:4d}  tasks {sample.tasks:5.0f}"
              f"  release p99 {sample.queue_wait_p99_ms if sample.queue_wait_p99_ms is not None else '-'} ms", flush=True)

    soak = uvloop.run(run_soak(args.minutes, workdir, sample_s=args.sample_s, on_sample=show))
    judged = write_report(soak, Path(args.out))
    print(json.dumps({"verdict": judged, "outcomes": dict(sorted(soak.outcomes.items()))}, indent=1))
    print(f"wrote {args.out}/soak.json and soak.png; logs in {workdir}")
    return 0
