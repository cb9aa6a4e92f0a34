"""A chat's time to first token while long batch lines fill every slot: the lines sent whole, or in chunks.

A measurement, not a test (docs/batches.md reports it):
``python -m tests.core.chunked_lines``. The core in front of the simulated
engine in simulated time (``tests/coresim.py``), exactly repeatable: 16 slots
of 20 ms steps with vLLM's prefix cache, a batch client that keeps 32 lines
in flight, each a 200-token prompt asking for 1,024 tokens (non-streamed, as
the batch runner sends them; a preempted request is sent again a second later
as a retry), and chats of 16 tokens at 4 a second from 20 s to 140 s. Sent
in chunks, each chunk is a request of its own whose prompt is the line's
prompt and the text so far (adapters/batches/continuation.py), queued again
like any line; the engine's prefix cache holds the prompt's blocks of the
chunk before (the simulator hashes prompts only, so the last chunk's text
is prefilled again: a little more than vLLM, which hashes it too, pays).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics

from extproc.tools.sim.engine import SimSettings
from tests.coresim import Arrival, CoreSim, Request, chat_arrivals

INTERACTIVE, BATCH = 0, 2
CHATS_FROM, CHATS_UNTIL = 20.0, 140.0
PROMPT, TOKENS, IN_FLIGHT = 200, 1024, 32


def chats(poisson: bool, seed: int) -> list[Arrival]:
    return chat_arrivals(CHATS_FROM, CHATS_UNTIL, poisson, seed)


def run(chunk: int, poisson: bool, seed: int, prefix_caching: bool = True) -> dict[str, float]:
    """The chats' TTFT p50 and p99, the batch's tokens a second (kept ones) while they came, preemptions, waste."""
    lines = itertools.count()
    sent: dict[int, tuple[int, int]] = {}  # id(arrival) -> (line, tokens written before it)
    kept, thrown, preempted = 0, 0, 0

    def request(line: int, written: int, at: float, retried: bool = False) -> Arrival:
        size = TOKENS - written if not chunk else min(chunk, TOKENS - written)
        arrival = Arrival(at, BATCH, "bob", PROMPT + written, size, stream=False, retried=retried,
                          units=tuple((line, i) for i in range(PROMPT + written)))
        sent[id(arrival)] = (line, written)
        return arrival

    def ended(sim: CoreSim, done: Request) -> None:
        nonlocal kept, thrown, preempted
        if done.arrival.band != BATCH:
            return
        line, written = sent.pop(id(done.arrival))
        if done.outcome == "preempted":
            preempted += 1
            thrown += done.sim.num_generated if done.sim is not None else 0
            sim.add([request(line, written, sim.now + 1.0, retried=True)])  # Retry-After: 1, as the runner
            return
        if CHATS_FROM <= sim.now < CHATS_UNTIL:
            kept += done.arrival.max_tokens
        written += done.arrival.max_tokens
        sim.add([request(line, written, sim.now) if written < TOKENS else request(next(lines), 0, sim.now)])

    engine = SimSettings("m", max_num_seqs=16, step_ms=20, prefix_caching=prefix_caching)
    sim = CoreSim(engine, max_running=16, max_preemptions_per_s=2.0, stream_begins_at_accept=True, ended=ended)
    sim.add([request(next(lines), 0, 0.0) for _ in range(IN_FLIGHT)])
    asked = chats(poisson, seed)
    sim.run(asked, until=CHATS_UNTIL + 120.0)  # every chat answered, however long it waited
    ttft = sorted(r.first_token_at - r.arrival.at for r in sim.of(INTERACTIVE) if r.first_token_at is not None)
    assert len(ttft) == len(asked)
    return {"p50": statistics.median(ttft), "p99": ttft[int(0.99 * len(ttft))],
            "tokens_per_s": kept / (CHATS_UNTIL - CHATS_FROM), "preempted": preempted, "thrown": thrown}


async def main() -> None:
    """The core's queue entries are futures of an event loop: the simulation runs inside one."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, nargs="+", default=[0, 512, 256, 128, 64])
    parser.add_argument("--no-prefix-caching", action="store_true")
    args = parser.parse_args()
    for poisson, seed in ((False, 1), (True, 1), (True, 2), (True, 3)):
        for chunk in args.chunks:
            found = run(chunk, poisson, seed, prefix_caching=not args.no_prefix_caching)
            print(f"{'poisson ' + str(seed) if poisson else 'periodic':9} chunk {chunk or 'whole':>5}: TTFT p50 "
                  f"{found['p50'] * 1000:5.0f} ms, p99 {found['p99'] * 1000:5.0f} ms; batch "
                  f"{found['tokens_per_s']:6.1f} tokens/s, {found['preempted']:3.0f} preempted "
                  f"({found['thrown']:6.0f} tokens thrown away)")


if __name__ == "__main__":
    asyncio.run(main())
