"""The round trips between each model's dispatcher and the cluster's Redis (``core/cluster.py``).

One :class:`ClusterConnection` per process: one Redis client, one
subscription (the wake-ups other instances send when they grant us a slot),
and a :class:`ModelLink` per model. A link drives its model's
:class:`~extproc.core.cluster.ClusterSeat` (the dispatcher's release
strategy) and never sees the dispatcher; the seat tells the link when to ask
through its :class:`Doorbell`. A link runs one round trip at a time: the
seat's ask goes to ``schedule.lua`` (one ``EVALSHA``: publish our count
and backlog, claim slots granted to us, decide the free slots; the JSON of
``wire.py``), and the grant comes back to the seat. Events arriving meanwhile (``wanted``) make one
more round trip right after, so a burst of them costs one, not one each. With
nothing to do, the link still asks every heartbeat (``cluster.heartbeat_s``): that renews this
instance's lease (``lease_s``; a dead instance's slots lapse with it), takes
slots whose wake-up was lost, and rejoins after an outage.

A round trip that fails or takes longer than ``redis_timeout_ms`` puts the
model's dispatcher on its own share (degraded, ``extproc_cluster_degraded``)
until one succeeds again.

Every time limit here is ``asyncio.timeout``, never ``asyncio.wait_for``: on
Python 3.11, wait_for returns the result of an awaitable that completes as
its task is cancelled, and the lost cancel keeps a link's loop running, so a
shutdown waits for it forever (the scraper's same fix, engines/scraper.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from importlib.resources import files

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from extproc.adapters.cluster.wire import Trip, decode_grant, encode_trip
from extproc.adapters.config import ClusterSettings
from extproc.adapters.telemetry import ClusterTrip, Telemetry
from extproc.core.cluster import Ask, ClusterOutlet, ClusterSeat
from extproc.core.timers import Timers

log = logging.getLogger(__name__)

SCRIPT = files("extproc.adapters.cluster").joinpath("schedule.lua").read_text()
# How long arrivals of tenants already queued here are gathered into one round trip.
BATCH_S = 0.02


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class Doorbell:
    """How a seat asks its link for a round trip (:class:`~extproc.core.cluster.ClusterLink`)."""

    def __init__(self) -> None:
        self.rung = asyncio.Event()
        self.rung.set()  # join at once
        self._soon: asyncio.TimerHandle | None = None

    def wanted(self, urgent: bool) -> None:
        if urgent:
            self.rung.set()
        elif self._soon is None:
            # One more request of a tenant queued here: the others must see the count soon (a count
            # that runs out in Redis would look like an idle tenant), but a burst needs one trip, not one each.
            self._soon = asyncio.get_running_loop().call_later(BATCH_S, self._batch_due)

    def _batch_due(self) -> None:
        self._soon = None
        self.rung.set()

    def answered(self) -> None:
        """A trip starts now: it publishes what was rung so far, including the arrivals being gathered."""
        self.rung.clear()
        if self._soon is not None:
            self._soon.cancel()
            self._soon = None


class ModelLink:
    """One model's round trips to the cluster (see the module docstring)."""

    def __init__(self, connection: ClusterConnection, model: str, form: str) -> None:
        self._connection = connection
        self._model = model
        self._form = form
        self._prefix = f"{connection.settings.key_prefix}:{model}"
        self.doorbell = Doorbell()
        self._telemetry = connection.telemetry
        # Degraded until the first trip succeeds; the counters at zero from the start.
        connection.telemetry.cluster_degraded.labels(model).set(1)
        for outcome in ("ok", "failed"):
            connection.telemetry.cluster_round_trips.labels(model, outcome)
        self._warned = False  # one warning per outage, not one per heartbeat

    def _trip(self, ask: Ask | None) -> bytes:
        c = self._connection
        return encode_trip(Trip(c.instance, c.lease_ms, c.wake_prefix, self._model, self._form, ask))

    async def run(self, seat: ClusterSeat) -> None:
        settings = self._connection.settings
        while True:
            try:
                async with asyncio.timeout(settings.heartbeat_interval_s):
                    await self.doorbell.rung.wait()
            except TimeoutError:
                pass  # the heartbeat: renew the lease, take lost grants, publish the backlog
            self.doorbell.answered()
            await self.round_trip(seat)
            if seat.degraded:
                await asyncio.sleep(settings.heartbeat_interval_s)  # Redis is away: try again at the heartbeat's pace

    async def round_trip(self, seat: ClusterSeat) -> None:
        connection = self._connection
        ask = seat.ask()
        started = time.perf_counter()
        try:
            async with asyncio.timeout(connection.timeout_s):
                reply = await connection.script(keys=[self._prefix], args=[self._trip(ask)])
        except (RedisError, OSError, TimeoutError) as exc:
            self._telemetry.report(self._model)(ClusterTrip(None))
            if not self._warned:
                self._warned = True
                log.warning("cluster: Redis unreachable for model %s (%s); releasing on this instance's share "
                            "until it answers", self._model, exc or type(exc).__name__)
            seat.lost(ask)
            return
        seconds = time.perf_counter() - started
        grant = decode_grant(reply)
        if seat.degraded:
            self._warned = False
            log.info("cluster: model %s joined (%d instances live)", self._model, grant.instances)
        self._telemetry.report(self._model)(ClusterTrip(seconds, grant.instances))
        seat.granted(grant)

    async def leave(self) -> None:
        """Drop this instance's count, backlog and untaken grants at once (a clean stop; a crash waits for the lease)."""
        await self._connection.script(keys=[self._prefix], args=[self._trip(None)])


class ClusterConnection:
    """The process's side of the cluster: the Redis client, the wake-up subscription, a link per model."""

    def __init__(self, settings: ClusterSettings, telemetry: Telemetry, forms: dict[str, str], name: str) -> None:
        """``forms``: each model's policy's cluster form, by model name."""
        self.settings = settings
        self.telemetry = telemetry
        # Unique per process start: a restarted instance is a new member, the old one's lease lapses.
        self.instance = f"{name}-{uuid.uuid4().hex[:8]}"
        self.lease_ms = round(settings.lease_s * 1000)
        self.timeout_s = settings.redis_timeout_ms / 1000
        self.wake_prefix = f"{settings.key_prefix}:wake:"
        # No retries: redis-py's default (10, with backoff) took 3.9 s to fail against a stopped Redis;
        # the next heartbeat is the retry, and the instance serves on its share meanwhile.
        self.client = aioredis.from_url(
            settings.redis_url, socket_timeout=self.timeout_s, socket_connect_timeout=self.timeout_s,
            retry=Retry(NoBackoff(), 0),
        )
        # Wake-ups block on their connection indefinitely: no socket timeout there.
        self._subscriber = aioredis.from_url(settings.redis_url, socket_connect_timeout=self.timeout_s)
        self.script = self.client.register_script(SCRIPT)
        self.links = {model: ModelLink(self, model, form) for model, form in forms.items()}
        # Each model's seat, made by its dispatcher through ModelLink.seat.
        self.seats: dict[str, ClusterSeat] = {}
        self._tasks: list[asyncio.Task[None]] = []

    def seat(self, model: str, outlet: ClusterOutlet, timers: Timers) -> ClusterSeat:
        """``model``'s release strategy: a seat that rings its link's doorbell (the dispatcher's strategy factory)."""
        expected = max(1, len(self.settings.instances))
        seat = self.seats[model] = ClusterSeat(outlet, timers, self.links[model].doorbell, expected_instances=expected)
        return seat

    def start(self) -> None:
        self._tasks = [asyncio.create_task(link.run(self.seats[model])) for model, link in self.links.items()]
        self._tasks.append(asyncio.create_task(self._listen()))
        log.info("cluster: instance %s on %s", self.instance, self.settings.redis_url)

    async def _listen(self) -> None:
        """Wake a model's link when another instance granted us a slot of it (heartbeats cover lost ones)."""
        channel = self.wake_prefix + self.instance
        while True:
            pubsub = self._subscriber.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(channel)
                while True:
                    message = await pubsub.get_message(timeout=None)
                    if message is not None:
                        link = self.links.get(_text(message["data"]))
                        if link is not None:
                            link.doorbell.wanted(True)
            except (RedisError, OSError):
                await asyncio.sleep(self.settings.heartbeat_interval_s)
            finally:
                await pubsub.aclose()

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        try:
            async with asyncio.timeout(self.timeout_s):
                await asyncio.gather(*(link.leave() for link in self.links.values()))
        except (RedisError, OSError, TimeoutError):
            pass  # Redis away: the lease lapses instead
        await self.client.aclose()
        await self._subscriber.aclose()
