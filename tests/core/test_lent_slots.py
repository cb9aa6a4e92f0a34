"""A chat beside idle-only work that fills the engine: its time to first token through the gateway, against the same
chats beside the same batch straight to the engine's own priority queue (vLLM's ``--scheduling-policy priority``).

The core in front of the simulated engine in simulated time (``tests/coresim.py``),
with preemption at its default rate: 16 slots of 20 ms steps, a batch client
that keeps 32 lines of about 64 tokens in flight (non-streamed, as the batch
runner sends them; a preempted line is sent again a second later as a retry),
and chats of 16 tokens at 4 a second. Straight to the engine, a chat waits in
its queue, ahead of the batch, for the next line to finish. Through the
gateway the batch fills every slot (nothing is kept free for the chats), and a
chat that needs a slot ends a line that has run for less than half the chat's
expected wait (core/preemption.py): a chat starts sooner than the engine's own
queue starts it, and the batch loses little. Every run is exactly repeatable;
docs/batches.md reports the figures.
"""

from __future__ import annotations

import random
import statistics

import pytest

from extproc.tools.sim.engine import SimSettings
from tests.coresim import Arrival, CoreSim, DirectSim, Request, chat_arrivals

pytestmark = pytest.mark.unit

INTERACTIVE, BATCH = 0, 2
CHATS_FROM, CHATS_UNTIL = 20.0, 50.0
ENGINE = SimSettings("m", max_num_seqs=16, step_ms=20, scheduling_policy="priority")


def p99(values: list[float]) -> float:
    return sorted(values)[int(0.99 * len(values))]


def chats(poisson: bool, seed: int) -> list[Arrival]:
    return chat_arrivals(CHATS_FROM, CHATS_UNTIL, poisson, seed)


def line(lines: random.Random, at: float, retried: bool = False) -> Arrival:
    return Arrival(at, BATCH, "bob", 10, lines.randint(56, 72), stream=False, retried=retried)


def lines_per_s(done: list[float]) -> float:
    return sum(CHATS_FROM <= t < CHATS_UNTIL for t in done) / (CHATS_UNTIL - CHATS_FROM)


def through_the_gateway(poisson: bool, seed: int) -> tuple[list[float], float, int]:
    """The chats' TTFTs, the batch lines completed a second while they came, and the preemptions."""
    lines, done, preempted = random.Random(seed), [], 0

    def ended(sim: CoreSim, request: Request) -> None:
        nonlocal preempted
        if request.arrival.band != BATCH:
            return
        if request.outcome == "preempted":
            preempted += 1
            sim.add([line(lines, sim.now + 1.0, retried=True)])  # Retry-After: 1, as the batch runner
        else:
            done.append(sim.now)
            sim.add([line(lines, sim.now)])

    sim = CoreSim(ENGINE, max_running=16, max_preemptions_per_s=2.0, stream_begins_at_accept=True, ended=ended)
    sim.add([line(lines, 0.0) for _ in range(32)])
    asked = chats(poisson, seed)
    sim.run(asked, until=CHATS_UNTIL + 5.0)
    ttft = [r.first_token_at - r.arrival.at for r in sim.of(INTERACTIVE) if r.first_token_at is not None]
    assert len(ttft) == len(asked)
    return ttft, lines_per_s(done), preempted


def straight_to_the_engine(poisson: bool, seed: int) -> tuple[list[float], float]:
    """The same, each request's class its priority in the engine's queue: the chats first, no preemption."""
    lines, done = random.Random(seed), []

    def finished(sim: DirectSim, arrival: Arrival) -> None:
        if arrival.band == BATCH:
            done.append(sim.now)
            sim.add([line(lines, sim.now)])

    sim = DirectSim(ENGINE)
    sim.finished = finished
    sim.add([line(lines, 0.0) for _ in range(32)])
    sim.run(chats(poisson, seed), until=CHATS_UNTIL + 5.0)
    ttft = [r.first_token_at - a.at for a, r in sim.of(INTERACTIVE) if r.first_token_at is not None]
    return ttft, lines_per_s(done)


@pytest.mark.parametrize(("poisson", "seed"), [(False, 1), (True, 1), (True, 2)])
async def test_a_chat_beside_a_full_batch_starts_sooner_than_the_engine_s_priority_queue_starts_it(
    poisson: bool, seed: int
) -> None:
    reference, reference_lines = straight_to_the_engine(poisson, seed)
    beside, lines, preempted = through_the_gateway(poisson, seed)
    print(f"{'poisson' if poisson else 'periodic'} {seed}: TTFT p50 {statistics.median(reference) * 1000:.0f} -> "
          f"{statistics.median(beside) * 1000:.0f} ms, p99 {p99(reference) * 1000:.0f} -> {p99(beside) * 1000:.0f} ms "
          f"({p99(beside) / p99(reference):.2f}x); batch {reference_lines:.2f} -> {lines:.2f} lines/s "
          f"({lines / reference_lines:.2f}x), {preempted} preempted")
    assert p99(beside) < 0.95 * p99(reference)
    # What the chats gain costs the batch little: a line is ended only while it has run for less than half the
    # chat's expected wait, and each at most once.
    assert lines > 0.9 * reference_lines
    assert preempted <= len(beside)


def behind_batch(*, stream: bool, max_running: int | None, flood_at: float) -> list[float]:
    """40 long batch-class requests (an over-budget tenant's, downgraded: docs/budgets.md) beside a chat every 0.1 s
    on an engine of 8: for each chat that waited in the engine while batch work was admitted ahead of it, how long."""
    arrivals = [Arrival(flood_at, BATCH, "alice", 200, 256, stream=stream) for _ in range(40)]
    arrivals += [Arrival(0.5 + 0.1 * i, INTERACTIVE, "bob", 50, 16) for i in range(200)]
    sim = CoreSim(SimSettings("m", max_num_seqs=8, step_ms=20), max_running=max_running, max_preemptions_per_s=2.0,
                  stream_begins_at_accept=True)
    sim.run(sorted(arrivals, key=lambda a: a.at), until=90.0)
    admitted = [r.sim.scheduled_at for r in sim.of(BATCH) if r.sim is not None and r.sim.scheduled_at is not None]
    waits = []
    for chat in sim.of(INTERACTIVE):
        assert chat.sim is not None and chat.sim.scheduled_at is not None and chat.released_at is not None
        reached = chat.released_at + sim.lag_s
        if any(reached < at < chat.sim.scheduled_at for at in admitted):
            waits.append(chat.sim.scheduled_at - reached)
    return waits


@pytest.mark.parametrize("flood_at", [0.0, 1.0, 5.0])
@pytest.mark.parametrize(("stream", "max_running"), [(False, None), (False, 8), (True, 8)])
async def test_no_chat_waits_inside_the_engine_behind_batch_work_beyond_the_next_step(
    flood_at: float, stream: bool, max_running: int | None
) -> None:
    """A request of the classes above never waits inside the engine while batch work is admitted ahead of it for
    more than one engine step beyond the one it arrived in (8 sequences: 24 ms a step, up to 34 ms with a prompt's
    prefill in it): batch goes into free slots only while they have work, a batch request that took the last one
    as a chat arrived is taken back, and streams, which cannot be, never queue in the engine. Without
    ``max_running`` streams do until the gate has learned the engine's size (docs/budgets.md), so that case runs
    with it."""
    waits = behind_batch(stream=stream, max_running=max_running, flood_at=flood_at)
    assert max(waits, default=0.0) <= 2 * 0.034, waits  # the step it arrived in, and one more
