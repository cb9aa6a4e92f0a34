"""A burst of requests arriving at once, and what each client got back.

Used by tests/stack/test_fault_burst.py and, run as ``python -m extproc.tools.burst``,
for the figures in docs/reports/reliability.md: it starts the real stack (simulator,
processor, Envoy with the generated config) with a gate that holds every
request, fires ``--n`` requests at once, samples the processor's and Envoy's
RSS while they are held, and counts the answers. An answer is *bare* when it
is not the OpenAI-style JSON error with an ``x-extproc-reason`` header — e.g.
Envoy's own 504 when the processor's first reply missed the message timeout.
An answer is *missed* when its stream outran the message timeout all the
same: the routes answer it ``processor_unavailable`` (failure_mode_allow),
JSON but never scheduled, which is what the admission bucket is there to
prevent. Of the ``overloaded`` answers, Envoy's bucket gave as many as its
admin counter ``rate_limited`` says; the processor's own shedding
(ext_proc/shedding.py) the rest.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from extproc.adapters.envoy.filters import ADMISSION_STAT_PREFIX
from extproc.adapters.protocol.contract import REASON_HEADER
from extproc.core.values.outcomes import Refusal
from extproc.tools import gie_gateway
from extproc.tools.procs import cpu_seconds, free_port
from extproc.tools.stack import Stack, start_stack


@dataclass(frozen=True)
class Received:
    status: int
    reason: str  # the x-extproc-reason header, "" when absent
    json_error: bool  # the body is {"error": {...}}
    details: str = ""  # what went wrong on the client's side, if no HTTP answer came


@dataclass
class BurstReport:
    answers: list[Received] = field(default_factory=list)

    @property
    def bare(self) -> list[Received]:
        """Failures that say no reason (e.g. Envoy's 504 for a missed message timeout), or no answer at all."""
        return [a for a in self.answers if not (200 <= a.status < 300 or a.reason)]

    @property
    def not_json(self) -> list[Received]:
        """Failures whose body is not the OpenAI-style JSON error."""
        return [a for a in self.answers if not (200 <= a.status < 300 or a.json_error)]

    @property
    def missed(self) -> list[Received]:
        """Streams that outran the message timeout: answered by the routes, never scheduled."""
        return [a for a in self.answers if a.reason == Refusal.PROCESSOR_UNAVAILABLE.value]

    def counts(self) -> Counter[tuple[int, str]]:
        return Counter((a.status, a.reason or a.details) for a in self.answers)


async def _one(session: aiohttp.ClientSession, url: str, model: str, prompt: str, max_tokens: int) -> Received:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens}
    try:
        async with session.post(f"{url}/v1/chat/completions", json=body) as response:
            text = await response.read()
            try:
                parsed = json.loads(text)
            except ValueError:
                parsed = None
            json_error = isinstance(parsed, dict) and isinstance(parsed.get("error"), dict)
            return Received(response.status, response.headers.get(REASON_HEADER, ""), json_error)
    except (TimeoutError, aiohttp.ClientError) as exc:
        return Received(0, "", False, details=type(exc).__name__)


async def fire(
    url: str, model: str, n: int, *, while_held: Callable[[], Awaitable[None]] | None = None, wave: int | None = None,
    prompt: str = "hi", max_tokens: int = 4,
) -> BurstReport:
    """``n`` requests, each on its own connection: at once, or ``wave`` per second; ``while_held`` runs meanwhile."""
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=60)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        requests = []
        for start in range(0, n, wave or n):
            if start:
                await asyncio.sleep(1.0)
            requests += [asyncio.ensure_future(_one(session, url, model, prompt, max_tokens))
                         for _ in range(min(wave or n, n - start))]
        if while_held is not None:
            await while_held()
        return BurstReport(list(await asyncio.gather(*requests)))


async def bucket_shed(stack: Stack) -> int:
    """How many requests Envoy's admission bucket answered ``overloaded`` (its ``rate_limited`` counter)."""
    assert stack.envoy is not None
    url = f"{stack.envoy.admin_url}/stats?format=json&filter={ADMISSION_STAT}"
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        stats = (await response.json())["stats"]
    return sum(int(s.get("value", 0)) for s in stats if s.get("name") == ADMISSION_STAT)


def rss_bytes(pid: int) -> int:
    """Resident set size of process ``pid`` (Linux ``/proc``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise LookupError(f"no VmRSS for pid {pid}")


# Envoy's counter of the requests its admission bucket refused (filters.py's stat_prefix).
ADMISSION_STAT = f"{ADMISSION_STAT_PREFIX}.http_local_rate_limit.rate_limited"
# Limits no burst reaches: the bucket out of the way (--no-bucket), so the processor alone decides.
NO_BUCKET = {"admission_burst": 1_000_000, "admission_per_second": 1_000_000}

# An Endpoint Picker's gate: one request in flight, which outlasts the hold (GIE_MAX_TOKENS).
_PICKING_GATE = {"gate": "static_concurrency", "max_in_flight": 1, "endpoint_picking": True}
GIE_MAX_TOKENS = 2_000  # 40 s at the simulator's 20 ms a step: past the default 30 s hold


def holding_config(
    workdir: Path, *, hold_s: float, max_queued: int, envoy: dict[str, Any] | None = None, picking: bool = False,
) -> Path:
    """A one-model config whose gate releases nothing: every admitted request waits ``hold_s``, then 503.

    ``picking``: endpoint picking, for a GIE gateway's shape (tools/gie_gateway.py), whose gate lets one
    request through, that outlasts the hold if it asks for :data:`GIE_MAX_TOKENS`.
    """
    # One release per thousand seconds: the first request goes, the rest stay queued.
    gate = _PICKING_GATE if picking else {"gate": "static_rate", "release_rate": 0.001}
    doc: dict[str, Any] = {
        "listen": {"grpc": f"127.0.0.1:{free_port()}", "metrics": f"127.0.0.1:{free_port()}"},
        "models": [{
            "name": "m1", "endpoints": [f"http://127.0.0.1:{free_port()}"], **gate,
            "max_queue_wait_s": hold_s, "max_queued": max_queued,
        }],
        "tenants": {"default": {"max_queued": max_queued}},
        "envoy": {"listen": f"127.0.0.1:{free_port()}", "admin": f"127.0.0.1:{free_port()}", **(envoy or {})},
    }
    path = workdir / "config.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


async def queued(stack: Stack) -> float:
    """The processor's queue depth for m1, from its /metrics."""
    async with aiohttp.ClientSession() as session, session.get(stack.metrics_url) as response:
        text = await response.text()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("extproc_queue_depth{"))


@dataclass(frozen=True)
class HeldFigures:
    held: float  # requests queued when RSS was read
    processor_idle: int
    processor_held: int
    envoy_idle: int
    envoy_held: int
    # CPU seconds each used from the first request until the queue stopped growing.
    processor_cpu_s: float = 0.0
    envoy_cpu_s: float = 0.0

    @property
    def processor_per_held(self) -> float:
        return (self.processor_held - self.processor_idle) / max(self.held, 1)

    @property
    def envoy_per_held(self) -> float:
        return (self.envoy_held - self.envoy_idle) / max(self.held, 1)


async def burst_and_hold(
    stack: Stack, n: int, *, settle_s: float = 3.0, wave: int | None = None, prompt: str = "hi", max_tokens: int = 4,
) -> tuple[BurstReport, HeldFigures]:
    """Fire ``n`` (see :func:`fire`); once the queue stops growing, read both RSS; then wait for every answer."""
    assert stack.processor is not None and stack.envoy is not None
    processor, envoy = stack.processor.process.pid, stack.envoy.process.pid
    idle = rss_bytes(processor), rss_bytes(envoy)
    cpu = cpu_seconds(processor), cpu_seconds(envoy)
    figures: list[HeldFigures] = []

    async def measure() -> None:
        depth, since = -1.0, time.monotonic()
        while time.monotonic() - since < settle_s:  # the queue has not changed for settle_s
            await asyncio.sleep(0.5)
            now = await queued(stack)
            if now != depth:
                depth, since = now, time.monotonic()
        figures.append(HeldFigures(
            depth, idle[0], rss_bytes(processor), idle[1], rss_bytes(envoy),
            cpu_seconds(processor) - cpu[0], cpu_seconds(envoy) - cpu[1],
        ))

    report = await fire(stack.envoy_url, "m1", n, while_held=measure, wave=wave, prompt=prompt, max_tokens=max_tokens)
    return report, figures[0]


async def _main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(args.workdir or tmp)
        envoy = NO_BUCKET if args.no_bucket else {
            key: value for key, value in (("admission_burst", args.admission_burst),
                                          ("admission_per_second", args.admission_per_second)) if value}
        config = holding_config(workdir, hold_s=args.hold_s, max_queued=max(args.n, 10_000), envoy=envoy,
                                picking=args.gie is not None)
        # Envoy's default circuit breaker would cut the EPP's streams at 1024 (tools/gie_gateway.py).
        shape = None if args.gie is None else functools.partial(
            gie_gateway.strict, model="m1", body=args.gie, epp_max_requests=max(args.n, 1024))
        async with await start_stack(config, workdir, sim_args=["--max-num-seqs", "1"], envoy_bootstrap=shape) as stack:
            assert stack.processor is not None
            print(f"processor pid {stack.processor.process.pid}, logs in {workdir}", flush=True)
            if args.before_s:
                await asyncio.sleep(args.before_s)
            report, held = await burst_and_hold(
                stack, args.n, wave=args.wave, prompt="hi" if args.body_bytes is None else "x" * args.body_bytes,
                max_tokens=4 if args.gie is None else GIE_MAX_TOKENS,
            )
            by_bucket = await bucket_shed(stack)
        admission = stack.config.envoy.admission(stack.config.listen.transport)
        print(f"bucket: {admission.tokens} at once, then {admission.per_second}/s")
        print(f"n={args.n} held={held.held:.0f} shed-by-bucket={by_bucket} "
              f"shed-by-processor={report.counts()[(503, Refusal.OVERLOADED.value)] - by_bucket} "
              f"missed={len(report.missed)} bare={len(report.bare)} not-json={len(report.not_json)} "
              f"answers={sorted(report.counts().items())}")
        print(f"processor RSS idle {held.processor_idle / 2**20:.0f} MiB, held {held.processor_held / 2**20:.0f} MiB, "
              f"{held.processor_per_held / 1024:.1f} KiB per held request")
        print(f"envoy RSS idle {held.envoy_idle / 2**20:.0f} MiB, held {held.envoy_held / 2**20:.0f} MiB, "
              f"{held.envoy_per_held / 1024:.1f} KiB per held request")
        print(f"CPU until the queue settled: processor {held.processor_cpu_s:.1f} s, envoy {held.envoy_cpu_s:.1f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--n", type=int, default=10_000, help="requests fired at once")
    parser.add_argument("--hold-s", type=float, default=30.0, help="how long each admitted request is held (then 503)")
    parser.add_argument("--admission-burst", type=int, help="envoy.admission_burst (default: the config's)")
    parser.add_argument("--admission-per-second", type=int, help="envoy.admission_per_second (default: the config's)")
    parser.add_argument("--no-bucket", action="store_true", help="admission limits no burst reaches (the processor alone)")
    parser.add_argument("--wave", type=int, help="send this many per second instead of all at once")
    parser.add_argument("--workdir", help="keep configs and logs here (default: a temporary directory)")
    parser.add_argument("--before-s", type=float, default=0.0, help="wait this long before firing (to attach a profiler)")
    parser.add_argument("--gie", choices=list(gie_gateway.BODY_MODES),
                        help="Envoy in Envoy AI Gateway's shape with this body mode (the processor reads the body)")
    parser.add_argument("--body-bytes", type=int, help="the prompt's size in bytes (default: the two of 'hi')")
    asyncio.run(_main(parser.parse_args()))


if __name__ == "__main__":
    main()
