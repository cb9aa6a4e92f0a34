"""Shutdown leaves asyncio nothing to complain of: ``extproc serve`` behind a real Envoy, on either transport.

A user saw ``Task exception was never retrieved … StopAsyncIteration`` (from
builtin/call.py) in the processor's log at its shutdown after a load run. Its
cause: a preemptible (batch) request, released and waiting for its response
headers, reads its stream in a task of its own (servicer.py ``_until_preempted``);
when the stream was cancelled (the client gone: Envoy half-closes and resets
the ext_proc stream at once; or the server stopping) that task was left
behind, to wait on the dead stream until destroyed pending, or to end with
StopAsyncIteration that nobody retrieved. Here the processor runs as a child
process through what provokes it, and its log must hold none of asyncio's
complaints (tests/adapters/test_shutdown_asyncio_unit.py does the same in-process,
through every shutdown path, with a loop exception handler).
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import aiohttp
import pytest

from extproc.tools.stack import Stack, start_stack
from tests.stackutil import TENANT_KEYS, send_chat, wait_for_metric, write_stack_config

pytestmark = pytest.mark.integration

# Two sequences at a time, real-time steps: a 400-token answer takes about 8 s, and a
# non-streamed one sends its response headers only then (so a batch request stays preemptible).
SLOW_SIM = ["--max-num-seqs", "2", "--step-ms", "20", "--time-scale", "1"]
LONG_ANSWER = 400
# What asyncio's loop reports of a task, future or coroutine nobody took care of.
ASYNCIO_COMPLAINTS = (
    "exception was never retrieved",  # Task … / Future …
    "Task was destroyed but it is pending",
    "was never awaited",
    "Exception in callback",
    "unhandled exception during",  # asyncio.run() shutdown
    "StopAsyncIteration",
)


def complaints(log: str) -> list[str]:
    return [line for line in log.splitlines() if any(c in line for c in ASYNCIO_COMPLAINTS)]


def batch(session: aiohttp.ClientSession, stack: Stack) -> asyncio.Task[int]:
    """A non-streamed batch completion through Envoy (preemptible until its response headers come), as a task."""
    async def post() -> int:
        async with session.post(
            f"{stack.envoy_url}/v1/chat/completions",
            json={"model": "m1", "messages": [{"role": "user", "content": "summarise"}], "max_tokens": LONG_ANSWER},
            headers={"authorization": f"Bearer {TENANT_KEYS['bob']}", "x-priority": "batch"},
        ) as response:
            await response.read()
            return response.status
    return asyncio.create_task(post())


@pytest.mark.parametrize(("transport", "signals"), [
    ("builtin", [signal.SIGTERM]),  # the queue answered at the drain deadline, the releases cut at the hard deadline
    ("grpcio", [signal.SIGTERM]),
    ("builtin", [signal.SIGINT, signal.SIGINT]),  # the second signal cuts the drain short
])
async def test_a_shutdown_with_held_released_and_abandoned_streams_leaves_asyncio_nothing_to_report(
    tmp_path: Path, transport: str, signals: list[signal.Signals]
) -> None:
    # Batch preemptible but not idle-only: its released requests hold their own slots (an idle-only band's are
    # lent, and the chats below would take them back at once), so they wait for their headers through the shutdown.
    config = write_stack_config(tmp_path, {"m1": {"gate": "static_concurrency", "max_in_flight": 2}},
                                listen={"transport": transport}, bands={"batch": {"idle_only": False}})
    drain = ["--drain-seconds", "0.2", "--deadline-seconds", "1"] if len(signals) == 1 else \
        ["--drain-seconds", "600", "--deadline-seconds", "600"]
    async with (
        await start_stack(config, tmp_path, sim_args=SLOW_SIM, serve_args=drain) as stack,
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session,
    ):
        assert stack.processor is not None
        process = stack.processor.process
        url = stack.metrics_url
        released = [batch(session, stack) for _ in range(2)]
        assert await wait_for_metric(url, "extproc_in_flight", lambda v: v == 2, model="m1") == 2
        # A client that goes away while its batch request waits for its response headers.
        released[0].cancel()
        assert await wait_for_metric(url, "extproc_in_flight", lambda v: v == 1, model="m1") == 1
        released.append(batch(session, stack))
        assert await wait_for_metric(url, "extproc_in_flight", lambda v: v == 2, model="m1") == 2
        held = [send_chat(session, stack, tenant, 4) for tenant in ("alice", "carol", "dave")]
        assert await wait_for_metric(url, "extproc_queue_depth", lambda v: v == 3, model="m1") == 3

        process.send_signal(signals[0])
        if len(signals) > 1:
            assert await wait_for_metric(url, "extproc_draining", lambda v: v == 1) == 1
            process.send_signal(signals[1])
        exit_code = await asyncio.wait_for(process.wait(), 60)
        answers = await asyncio.gather(*held)
        for task in released:
            task.cancel()
        await asyncio.gather(*released, return_exceptions=True)
    assert exit_code == 0
    assert [a.status for a in answers] == [503] * 3, answers
    log = stack.processor.log_path.read_text()
    cut = "second signal" if len(signals) > 1 else "hard deadline"
    assert f"{cut}: exiting with 2 responses still streaming" in log, log
    assert complaints(log) == [], log
