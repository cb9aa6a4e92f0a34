"""A cluster link's loop ends when cancelled, even as what it awaits completes (adapters/cluster/link.py).

On Python 3.11, ``asyncio.wait_for`` returns the result of an awaitable that
completed as its task was cancelled: the cancel is lost, the link's loop
goes on, and ``ClusterConnection.stop`` (a shutdown) waits for it forever.
Each test makes that coincidence happen in one loop callback, with no Redis
and no timing: Redis's reply (or a doorbell ring) arrives and the link is
cancelled at once. A link that goes on makes another round trip, which the
fake script refuses.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest

from extproc.adapters.cluster.link import ClusterConnection
from extproc.adapters.config import parse_config
from extproc.adapters.telemetry import Telemetry
from extproc.adapters.wiring import build_dispatcher, cluster_forms
from extproc.core.cluster import ClusterSeat

pytestmark = pytest.mark.unit

GRANT = b'{"others_in_flight": 0, "instances": 1}'
# Only a bound on waiting for the link (which takes microseconds), never a measurement.
PATIENCE_S = 60.0


class Script:
    """Stands in for schedule.lua: answers ``answers`` round trips, refuses any more (the link should have ended)."""

    def __init__(self) -> None:
        self.answers = 0
        self.trips = 0
        self.link: asyncio.Task[None] | None = None  # cancelled as a reply arrives, when set

    async def __call__(self, keys: list[str], args: list[bytes]) -> bytes:
        self.trips += 1
        if self.trips > self.answers:
            raise RuntimeError("a round trip after the link was cancelled")
        reply: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

        def arrives() -> None:
            reply.set_result(GRANT)  # Redis answers ...
            if self.link is not None:
                self.link.cancel()  # ... as the shutdown cancels the link

        asyncio.get_running_loop().call_soon(arrives)
        return await reply


@asynccontextmanager
async def cluster(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[tuple[ClusterConnection, ClusterSeat, Script]]:
    """A connection whose Redis is never reached (its script is a fake), and model m's seat, made by its dispatcher."""
    config = parse_config({
        "cluster": {"redis_url": "redis://127.0.0.1:1"},
        "models": [{"name": "m", "endpoints": ["http://127.0.0.1:1"]}],
    })
    assert config.cluster is not None
    telemetry = Telemetry()
    connection = ClusterConnection(config.cluster, telemetry, cluster_forms(config), "test")
    build_dispatcher(config, config.models[0], telemetry, cluster=connection)
    script = Script()
    monkeypatch.setattr(connection, "script", script)
    try:
        yield connection, connection.seats["m"], script
    finally:
        script.link, script.answers = None, script.trips + len(connection.links)  # the stop's leave: answered
        await connection.stop()  # closes both of its Redis clients


async def ended(task: asyncio.Task[Any]) -> None:
    await asyncio.wait((task,), timeout=PATIENCE_S)
    assert task.done(), "the link's loop went on"


async def test_a_round_trip_answered_as_the_link_is_cancelled_ends_the_link(monkeypatch: pytest.MonkeyPatch) -> None:
    async with cluster(monkeypatch) as (connection, seat, script):
        script.answers = 1
        script.link = link = asyncio.create_task(connection.links["m"].run(seat))  # the doorbell starts rung: a trip
        await ended(link)
        assert link.cancelled(), link
        assert script.trips == 1


async def test_a_ring_as_the_link_is_cancelled_ends_the_link(monkeypatch: pytest.MonkeyPatch) -> None:
    async with cluster(monkeypatch) as (connection, seat, script):
        model_link = connection.links["m"]
        model_link.doorbell.answered()  # not rung: the link waits for its doorbell (or the heartbeat, seconds away)
        link = asyncio.create_task(model_link.run(seat))
        await asyncio.sleep(0)  # the link's first step: into its wait

        def rings() -> None:
            model_link.doorbell.wanted(True)  # a request arrives ...
            link.cancel()  # ... as the shutdown cancels the link

        asyncio.get_running_loop().call_soon(rings)
        await ended(link)
        assert link.cancelled(), link
        assert script.trips == 0
