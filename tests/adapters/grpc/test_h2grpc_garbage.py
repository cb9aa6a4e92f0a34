"""A stream leaves no reference cycle behind in the builtin transport: its objects are freed when it ends.

At saturation every request that left a cycle cost the cyclic GC about as much
as a tenth of the processor's CPU. Envoy ends each ext_proc stream with
END_STREAM and RST_STREAM together, which cancels the stream's task; the
task keeps its CancelledError, whose traceback holds the task's frames. These
tests run such streams (and plain ones) with the collector off and
``gc.DEBUG_SAVEALL`` on, and assert that a collection finds none of the
transport's objects: all of them went with their last reference.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Iterator
from types import FrameType

import pytest

from tests.h2raw import message
from tests.helpers.h2grpc import Handlers
from tests.helpers.h2grpc_abuse import ECHO, HI, HOLD, _connected

pytestmark = pytest.mark.unit


@pytest.fixture
def saved_garbage() -> Iterator[list[object]]:
    """What the collector would free, kept in ``gc.garbage`` instead: the objects that were in cycles."""
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    gc.garbage.clear()
    try:
        yield gc.garbage
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


def _ours(garbage: list[object]) -> list[str]:
    """The transport's objects among ``garbage``: its calls, its tasks, frames of its code."""
    found = []
    for obj in garbage:
        if type(obj).__module__.startswith("extproc."):
            found.append(type(obj).__qualname__)
        elif isinstance(obj, FrameType) and "/extproc/" in obj.f_code.co_filename:
            found.append(f"frame {obj.f_code.co_name}")
        elif isinstance(obj, asyncio.Task) and "Connection._run" in repr(obj.get_coro()):
            found.append("task of Connection._run")
    return found


async def test_streams_ended_by_the_client_or_reset_as_envoy_ends_them_leave_no_cycle(
        saved_garbage: list[object]) -> None:
    handlers = Handlers()
    async with _connected(handlers) as (_, client):
        for _ in range(20):
            stream = client.request(HOLD)
            client.send(stream, HI)
            await client.until(lambda s=stream: any(getattr(e, "data", b"") for e in client.of(s)))  # type: ignore[misc]
            client.h2.end_stream(stream)  # Envoy's end of an ext_proc stream: both at once
            client.h2.reset_stream(stream)
            client.flush()
            echo = client.request(ECHO)
            client.send(echo, message(b"\x0a\x02hi"), end=True)
            await client.until(lambda s=echo: client.ended(s))  # type: ignore[misc]
        await client.until(lambda: handlers.ended == 20)
        await asyncio.sleep(0.01)  # the cancelled tasks' last steps
        gc.collect()
        assert _ours(saved_garbage) == []


async def test_streams_reset_before_their_handler_ran_leave_no_cycle(saved_garbage: list[object]) -> None:
    """Opened and reset in one write (rapid reset's shape): the task is cancelled before it first ran."""
    handlers = Handlers()
    async with _connected(handlers) as (_, client):
        for _ in range(20):
            client.h2.reset_stream(client.request(HOLD))
        client.flush()
        echo = client.request(ECHO)
        client.send(echo, message(b"\x0a\x02hi"), end=True)
        await client.until(lambda: client.ended(echo))
        await asyncio.sleep(0.01)  # the cancelled tasks' last steps
        gc.collect()
        assert _ours(saved_garbage) == []
