"""The round trips between each model's dispatcher and the cluster's Redis (``core/cluster.py``).

One :class:`ClusterConnection` per process: one Redis client, one
subscription (the wake-ups other instances send when they grant us a slot),
and a :class:`ModelLink` per model. A link runs one round trip at a time: the
dispatcher's ask goes to ``schedule.lua`` (one ``EVALSHA``: publish our count
and backlog, claim slots granted to us, decide the free slots), and the grant
comes back to the dispatcher. Events arriving meanwhile (``wanted``) make one
more round trip right after, so a burst of them costs one, not one each. With
nothing to do, the link still asks every ``heartbeat_s``: that renews this
instance's lease (``lease_s``; a dead instance's slots lapse with it), takes
slots whose wake-up was lost, and rejoins after an outage.

A round trip that fails or takes longer than ``redis_timeout_ms`` puts the
model's dispatcher on its own share (degraded, ``extproc_cluster_degraded``)
until one succeeds again.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from importlib.resources import files
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from extproc.adapters.config import ClusterSettings
from extproc.adapters.telemetry import Telemetry
from extproc.core.cluster import Ask, ClusterSeat, Grant
from extproc.core.dispatcher import ModelDispatcher

log = logging.getLogger(__name__)

SCRIPT = files("extproc.adapters.cluster").joinpath("schedule.lua").read_text()
# How long arrivals of tenants already queued here are gathered into one round trip.
BATCH_S = 0.02


def ask_args(instance: str, lease_ms: int, wake_prefix: str, model: str, ask: Ask) -> list[str | int | float]:
    """The script's ARGV for one ask (the layout documented at the top of schedule.lua)."""
    args: list[str | int | float] = [instance, lease_ms, ask.in_flight, wake_prefix, model, len(ask.caps), *ask.caps]
    args.append(len(ask.backlog))
    for entry in ask.backlog:
        args += [entry.band, entry.tenant, entry.count, repr(entry.service), int(entry.fresh)]
    args.append(len(ask.corrections))
    for band, tenant, delta in ask.corrections:
        args += [band, tenant, repr(delta)]
    return args


def grant_of(reply: list[Any]) -> Grant:
    """The script's reply: others in flight, live instances, then (band, tenant) per release."""
    others, instances, *flat = reply
    releases = tuple((int(flat[k]), _text(flat[k + 1])) for k in range(0, len(flat), 2))
    return Grant(releases, int(others), int(instances))


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class ModelLink:
    """One model's seat in the cluster: its round trips (see the module docstring)."""

    def __init__(self, connection: ClusterConnection, dispatcher: ModelDispatcher) -> None:
        self._connection = connection
        self._dispatcher = dispatcher
        self._model = dispatcher.name
        self._key = f"{connection.settings.key_prefix}:{dispatcher.name}"
        self._wanted = asyncio.Event()
        self._wanted.set()  # join at once
        self._soon: asyncio.TimerHandle | None = None
        telemetry = connection.telemetry
        self._degraded = telemetry.cluster_degraded.labels(self._model)
        self._instances = telemetry.cluster_instances.labels(self._model)
        self._ok = telemetry.cluster_round_trips.labels(self._model, "ok")
        self._failed = telemetry.cluster_round_trips.labels(self._model, "failed")
        self._seconds = telemetry.cluster_round_trip.labels(self._model)
        self._degraded.set(1)
        self._warned = False  # one warning per outage, not one per heartbeat
        self.seat = ClusterSeat(self, expected_instances=max(1, len(connection.settings.instances)))
        dispatcher.join(self.seat)

    def wanted(self, urgent: bool) -> None:
        if urgent:
            self._wanted.set()
        elif self._soon is None:
            # One more request of a tenant queued here: the others must see the count soon (a count
            # that runs out in Redis would look like an idle tenant), but a burst needs one trip, not one each.
            self._soon = asyncio.get_running_loop().call_later(BATCH_S, self._batch_due)

    def _batch_due(self) -> None:
        self._soon = None
        self._wanted.set()

    async def run(self) -> None:
        settings = self._connection.settings
        while True:
            try:
                await asyncio.wait_for(self._wanted.wait(), settings.heartbeat_s)
            except TimeoutError:
                pass  # the heartbeat: renew the lease, take lost grants, publish the backlog
            self._wanted.clear()
            if self._soon is not None:  # this trip publishes the arrivals it was waiting to gather
                self._soon.cancel()
                self._soon = None
            await self.round_trip()
            if self.seat.degraded:
                await asyncio.sleep(settings.heartbeat_s)  # Redis is away: try again at the heartbeat's pace

    async def round_trip(self) -> None:
        connection = self._connection
        ask = self._dispatcher.cluster_ask()
        args = ask_args(connection.instance, connection.lease_ms, connection.wake_prefix, self._model, ask)
        started = time.perf_counter()
        try:
            reply = await asyncio.wait_for(connection.script(keys=[self._key], args=args), connection.timeout_s)
        except (RedisError, OSError, TimeoutError) as exc:
            self._failed.inc()
            if not self._warned:
                self._warned = True
                log.warning("cluster: Redis unreachable for model %s (%s); releasing on this instance's share "
                            "until it answers", self._model, exc or type(exc).__name__)
            self._degraded.set(1)
            self._dispatcher.cluster_lost(ask)
            return
        self._seconds.observe(time.perf_counter() - started)
        self._ok.inc()
        grant = grant_of(reply)
        if self.seat.degraded:
            self._warned = False
            log.info("cluster: model %s joined (%d instances live)", self._model, grant.instances)
        self._degraded.set(0)
        self._instances.set(grant.instances)
        self._dispatcher.cluster_granted(grant)

    async def leave(self) -> None:
        """Drop this instance's count, backlog and untaken grants at once (a clean stop; a crash waits for the lease)."""
        c = self._connection
        await c.client.hdel(f"{self._key}:inst", c.instance)
        await c.client.hdel(f"{self._key}:q", c.instance)
        await c.client.delete(f"{self._key}:p:{c.instance}")


class ClusterConnection:
    """The process's side of the cluster: the Redis client, the wake-up subscription, a link per model."""

    def __init__(self, settings: ClusterSettings, telemetry: Telemetry, dispatchers: dict[str, ModelDispatcher],
                 name: str) -> None:
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
        self.links = {model: ModelLink(self, d) for model, d in dispatchers.items()}
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._tasks = [asyncio.create_task(link.run()) for link in self.links.values()]
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
                            link.wanted(True)
            except (RedisError, OSError):
                await asyncio.sleep(self.settings.heartbeat_s)
            finally:
                await pubsub.aclose()  # type: ignore[no-untyped-call]  # redis-py leaves it unannotated

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        try:
            await asyncio.wait_for(asyncio.gather(*(link.leave() for link in self.links.values())), self.timeout_s)
        except (RedisError, OSError, TimeoutError):
            pass  # Redis away: the lease lapses instead
        await self.client.aclose()
        await self._subscriber.aclose()
