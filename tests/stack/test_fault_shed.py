"""Shedding that respects classes, through real Envoy (generated config), the real processor and the simulator.

*Starved*: the processor is pinned to one core with busy processes that
compete for it, while Envoy, the simulator and the clients run on the other.
Interactive and batch requests then arrive, alternating, ever faster until
the processor sheds, and at that pace for a while after: sustained overload,
however fast the machine. Batch requests are queued from before and stay
queued throughout, so the rule is plain: no interactive request may be refused
``overloaded``, while batch arrivals are.

*One stall*: the processor is stopped (SIGSTOP) for less than Envoy's message
timeout while requests keep arriving, then continued: the loop answers at once
again, so nothing is shed.

Either way every request ends, as Envoy's access log tells: released, refused
with a reason, or dropped because its client left. Counts and relative
comparisons only: no timing assertion.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from extproc.adapters.protocol.contract import REASON_HEADER
from extproc.tools.procs import free_port
from extproc.tools.stack import Stack, start_stack
from tests.stackutil import poll, read_metrics

pytestmark = [pytest.mark.integration, pytest.mark.alone]

SIM = ["--max-num-seqs", "1"]
INTERACTIVE, BATCH = "interactive", "batch"
STARVED_CORE = 0
# Busy processes on the processor's core: it gets a fifth of it (measured: it then takes in about 1,000 a second).
HOGS = 4
QUEUED_BATCH = 20
# The rate's one release goes to the first batch request (nothing above it had asked: nothing is kept
# back for classes that are not there); the others are held.
HELD_BATCH = QUEUED_BATCH - 1
LEFT = "left"  # the client gave up on it (cancelled)


@dataclass(frozen=True)
class Answer:
    band: str
    status: int
    reason: str  # x-extproc-reason; "" when absent
    sent_at: float  # time.monotonic() when it was sent
    error: str = ""  # no HTTP answer: the client's exception, or LEFT

    @property
    def ended(self) -> bool:
        """Released, refused with a reason, or dropped because its client left: never a bare failure."""
        return 200 <= self.status < 300 or bool(self.reason) or self.error == LEFT

    @property
    def admitted(self) -> bool:
        """Decided and held by the processor: released, held until its queue timeout, or until its client left."""
        return 200 <= self.status < 300 or self.reason == "queue_timeout" or self.error == LEFT


def shed_config(tmp_path: Path, *, hold_s: float) -> Path:
    """Two classes on one model whose gate releases (almost) nothing: each admitted request is held ``hold_s``.

    Envoy's admission bucket is opened wide, so that the processor, not the
    bucket (which knows no class), meets the burst. Batch waits 60 s.
    """
    doc: dict[str, Any] = {
        "listen": {"grpc": f"127.0.0.1:{free_port()}", "metrics": f"127.0.0.1:{free_port()}"},
        "priorities": [INTERACTIVE, "standard", BATCH],
        "default_priority": "standard",
        "bands": {BATCH: {"max_queue_wait_s": 60}},
        "models": [{
            "name": "m1", "endpoints": [f"http://127.0.0.1:{free_port()}"], "gate": "static_rate",
            "release_rate": 0.001, "max_queue_wait_s": hold_s, "max_queued": 100_000,
            # Once the classes above have asked, the rate's release is kept from batch for them.
            "reserved_waiting": 1,
        }],
        "tenants": {"default": {"max_queued": 100_000}},
        "envoy": {"listen": f"127.0.0.1:{free_port()}", "admin": f"127.0.0.1:{free_port()}",
                  "admission_burst": 100_000, "admission_per_second": 100_000},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _pin(pid: int, cores: set[int]) -> None:
    """Every thread of ``pid`` onto ``cores`` (sched_setaffinity is per thread)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), cores)
        except (ProcessLookupError, PermissionError):
            pass


@contextmanager
def starved(stack: Stack, hogs: int) -> Iterator[None]:
    """The processor pinned to one core with ``hogs`` busy processes; Envoy, the simulator and this process on the other."""
    assert stack.processor is not None and stack.envoy is not None
    mine = os.sched_getaffinity(0)
    others = mine - {STARVED_CORE}
    if STARVED_CORE not in mine or not others:
        pytest.skip(f"needs two cores to starve one of them; this process may use {sorted(mine)}")
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(hogs)]
    try:
        for hog in busy:
            _pin(hog.pid, {STARVED_CORE})
        _pin(stack.processor.process.pid, {STARVED_CORE})
        for process in (stack.envoy.process, *(sim.process for sim in stack.sims)):
            _pin(process.pid, others)
        os.sched_setaffinity(0, others)
        yield
    finally:
        os.sched_setaffinity(0, mine)
        for hog in busy:
            hog.kill()
            hog.wait()


async def _one(session: aiohttp.ClientSession, url: str, band: str) -> Answer:
    body = {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    sent_at = time.monotonic()
    try:
        async with session.post(f"{url}/v1/chat/completions", json=body, headers={"x-priority": band}) as response:
            await response.read()
            return Answer(band, response.status, response.headers.get(REASON_HEADER, ""), sent_at)
    except (TimeoutError, aiohttp.ClientError) as exc:
        return Answer(band, 0, "", sent_at, type(exc).__name__)
    except asyncio.CancelledError:  # the client leaves: what it got is that it left
        return Answer(band, 0, "", sent_at, LEFT)


def client_session() -> aiohttp.ClientSession:
    """Each request on its own connection, as many at once as asked."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True),
                                 timeout=aiohttp.ClientTimeout(total=None, sock_connect=60))


@dataclass
class Arrivals:
    """Requests sent at a pace (per second) that may change as they go: alternating interactive and batch."""

    session: aiohttp.ClientSession
    url: str
    sent: list[asyncio.Task[Answer]] = field(default_factory=list)
    bands: list[str] = field(default_factory=list)  # each sent request's
    # Called with each answer as it comes.
    on_answer: list[Callable[[asyncio.Task[Answer]], None]] = field(default_factory=list)

    def one(self, band: str) -> None:
        task = asyncio.ensure_future(_one(self.session, self.url, band))
        for call in self.on_answer:
            task.add_done_callback(call)
        self.sent.append(task)
        self.bands.append(band)

    async def at(self, pace: Callable[[], float], until: Callable[[], bool]) -> None:
        """``pace()`` requests a second (asked every 10 ms) until ``until()``."""
        due = float(len(self.sent))
        while not until():
            due += 0.01 * pace()
            while len(self.sent) < due:
                self.one(INTERACTIVE if len(self.sent) % 2 else BATCH)
            await asyncio.sleep(0.01)

    async def answers(self, patience_s: float) -> list[Answer]:
        """Every answer, once every interactive request's has come (within ``patience_s``); the clients of the rest leave.

        A batch request is shed at once or held 60 s (``shed_config``), longer than any test waits: waiting for
        those would only wait out the patience.
        """
        interactive = [task for task, band in zip(self.sent, self.bands, strict=True) if band == INTERACTIVE]
        if interactive:
            await asyncio.wait(interactive, timeout=patience_s)
        for task in self.sent:
            task.cancel()
        return list(await asyncio.gather(*self.sent))


@dataclass
class Ramp:
    """A pace that quickens until the first ``overloaded`` answer, then stays there for ``hold_s``.

    However fast the machine, the starved processor then runs just past what
    it can take in: sustained overload, where shedding has to hold it.
    """

    start_per_s: float = 100
    step_per_s: float = 100  # added to the pace each second
    hold_s: float = 3.0
    longest_s: float = 30.0
    pace: float = 0.0
    shed_at: float | None = None
    _started: float = 0.0

    def answered(self, task: asyncio.Task[Answer]) -> None:
        if self.shed_at is None and task.result().reason == "overloaded":
            self.shed_at = time.monotonic()

    def now_pace(self) -> float:
        if self.shed_at is None:
            self.pace = self.start_per_s + self.step_per_s * (time.monotonic() - self._started)
        return self.pace

    def over(self) -> bool:
        now = time.monotonic()
        return now - self._started >= self.longest_s or (self.shed_at is not None and now - self.shed_at >= self.hold_s)

    async def run(self, arrivals: Arrivals) -> None:
        self._started = time.monotonic()
        arrivals.on_answer.append(self.answered)
        await arrivals.at(self.now_pace, self.over)


async def processor_holds(stack: Stack) -> float:
    """Requests the processor still holds: queued, and released whose response has not ended."""
    samples = await read_metrics(stack.metrics_url)
    return sum(v for (name, _), v in samples.items() if name in ("extproc_queue_depth", "extproc_in_flight"))


async def queued(stack: Stack, band: str) -> float:
    samples = await read_metrics(stack.metrics_url)
    return sum(v for (name, labels), v in samples.items() if name == "extproc_queue_depth" and ("priority", band) in labels)


async def queue_batch_first(stack: Stack, arrivals: Arrivals) -> float:
    """QUEUED_BATCH batch requests before anything else, HELD_BATCH of them held (60 s: through the whole test);
    their queue's depth."""
    for _ in range(QUEUED_BATCH):
        arrivals.one(BATCH)
    return await poll(lambda: queued(stack, BATCH), lambda depth: depth >= HELD_BATCH)


async def starved_ramp(tmp_path: Path, ramp: Ramp, *, hogs: int) -> tuple[list[Answer], float, float]:
    """Batch queued first, then the ramp under starvation: every answer of the ramp, the batch queue's depth
    before it, and what the processor still held once every client had its answer or left."""
    config = shed_config(tmp_path, hold_s=6)
    async with await start_stack(config, tmp_path, sim_args=SIM) as stack, client_session() as session:
        early = Arrivals(session, stack.envoy_url)
        depth = await queue_batch_first(stack, early)
        arrivals = Arrivals(session, stack.envoy_url)
        with starved(stack, hogs):
            await ramp.run(arrivals)
            # Interactive requests end within their 6 s hold; batch ones would be held 60 s: their clients leave.
            answers = await arrivals.answers(patience_s=10)
        await early.answers(patience_s=0)
        left_behind = await poll(lambda: processor_holds(stack), lambda held: held == 0)
    every_request_ended(answers, envoy_answers(stack), sent=QUEUED_BATCH + len(answers))
    return answers, depth, left_behind


def tally(answers: list[Answer]) -> Counter[tuple[str, str]]:
    return Counter((a.band, a.reason or a.error or str(a.status)) for a in answers)


# What Envoy's access log says a request got that is not a bare failure: served, one of the
# processor's refusals (``preempted``: the released batch request, on a slot lent to its idle-only class,
# taken back for the first interactive arrival), the routes' JSON processor_unavailable
# (failure_mode_allow), or its client left.
ENDED = {"via_upstream", "queue_timeout", "overloaded", "preempted", "direct_response", "downstream_remote_disconnect"}


def envoy_answers(stack: Stack) -> Counter[str]:
    """Each request's answer as Envoy logged it (``details``), once Envoy has stopped."""
    assert stack.envoy is not None
    return Counter(json.loads(line)["details"] for line in stack.envoy.log_path.read_text().splitlines()
                   if line.startswith("{"))


def every_request_ended(answers: list[Answer], logged: Counter[str], sent: int) -> None:
    """Every request sent got an answer that is no bare failure, as Envoy logged it.

    The client's own view agrees, except that under this load a client's
    socket sometimes drops an answer Envoy sent (aiohttp: ServerDisconnectedError):
    those must be covered by answers Envoy logged that the client did not read.
    """
    assert sum(logged.values()) == sent and set(logged) <= ENDED, logged
    lost = Counter(a.error for a in answers if not a.ended)
    assert set(lost) <= {"ServerDisconnectedError"}, lost
    read = sum(1 for a in answers if a.ended and a.error != LEFT)
    assert lost.total() <= sum(n for details, n in logged.items() if details != "downstream_remote_disconnect") - read


@pytest.mark.slow
async def test_a_starved_processor_sheds_batch_and_never_interactive_while_batch_is_queued(tmp_path: Path) -> None:
    answers, depth, left_behind = await starved_ramp(tmp_path, Ramp(), hogs=HOGS)
    counts = tally(answers)
    assert depth >= HELD_BATCH, "batch requests were queued through the whole ramp"
    assert counts[(BATCH, "overloaded")] > 0, f"the processor was never overloaded: starve it harder; {counts}"
    assert counts[(INTERACTIVE, "overloaded")] == 0, counts
    assert left_behind == 0, "every request that ended left the processor's queue and gate"
    # The interactive half was admitted, the batch half shed: far more of one than the other.
    admitted = Counter(a.band for a in answers if a.admitted)
    assert admitted[INTERACTIVE] >= admitted[BATCH] + counts[(BATCH, "overloaded")] // 2, counts


async def one_stall(tmp_path: Path, stall_s: float) -> tuple[list[Answer], list[Answer], float, float]:
    """Batch queued first, then 40 requests a second for 3 s, the processor stopped for ``stall_s`` of them.

    Returns every answer of the arrivals, those sent while it was stopped, the batch queue's depth before,
    and what the processor still held once every client had its answer or left.
    """
    config = shed_config(tmp_path, hold_s=4)
    async with await start_stack(config, tmp_path, sim_args=SIM) as stack, client_session() as session:
        assert stack.processor is not None and stack.config.envoy.message_timeout_ms == 2000
        arrivals = Arrivals(session, stack.envoy_url)
        depth = await queue_batch_first(stack, arrivals)
        start = time.monotonic()
        pace = asyncio.ensure_future(arrivals.at(lambda: 40, lambda: time.monotonic() - start > 3.0))
        await asyncio.sleep(0.5)
        stopped = time.monotonic()
        stack.processor.process.send_signal(signal.SIGSTOP)
        try:
            await asyncio.sleep(stall_s)
        finally:
            stack.processor.process.send_signal(signal.SIGCONT)
        continued = time.monotonic()
        await pace
        everything = await arrivals.answers(patience_s=10)
        left_behind = await poll(lambda: processor_holds(stack), lambda held: held == 0)
    every_request_ended(everything, envoy_answers(stack), sent=len(everything))
    answers = everything[QUEUED_BATCH:]
    return answers, [a for a in answers if stopped <= a.sent_at < continued], depth, left_behind


async def test_a_single_stall_within_the_message_timeout_sheds_nothing(tmp_path: Path) -> None:
    """Stopped for 1.3 s of Envoy's 2 s message timeout (above the 1 s that shed everything before): nothing is shed."""
    answers, during, depth, left_behind = await one_stall(tmp_path, 1.3)
    counts = tally(answers)
    assert depth >= HELD_BATCH
    assert len(during) >= 10, "requests arrived while the processor was stopped"
    assert all(a.admitted for a in during), counts
    assert not any(a.reason == "overloaded" for a in answers), counts
    assert left_behind == 0
