"""``extproc serve``: the gRPC server, the scrapers and the metrics endpoint in one process.

Shutdown (SIGTERM or SIGINT) drains instead of dropping, in this order:

1. gRPC health turns NOT_SERVING, so Envoy's health check (and a Kubernetes
   gRPC readiness probe) stop sending new streams here where another
   processor can take them; new requests that still arrive get 503
   ``shutting_down`` with ``Retry-After``.
2. Queued requests keep being released as the engine frees room, for up to
   ``drain_seconds``; whatever is still queued then is answered 503
   ``shutting_down``.
3. The gRPC listener stays up while any released response runs, so that
   arrivals keep getting ``shutting_down`` and the exit is clean. The process
   exits when the last one ends, or at the hard deadline, ``deadline_seconds``
   after the signal. Responses still streaming then are not cut: the ext_proc
   filter runs with ``failure_mode_allow`` (adapters/envoy/filters.py), so they go on
   through Envoy without the processor, and a restarted processor sees them as
   the engine's load.

A second SIGTERM or SIGINT exits at once. Every request arriving while the
listener is up gets the processor's JSON answer; after the exit Envoy's own
JSON 503 ``processor_unavailable`` (adapters/envoy/routes.py).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Callable

import aiohttp
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.adapters.cluster.link import ClusterConnection
from extproc.adapters.config import Config, split_address
from extproc.adapters.engines.discovery import watch_pool
from extproc.adapters.ext_proc.grpcio_server import GrpcioServer
from extproc.adapters.ext_proc.h2grpc import GrpcServer, Method
from extproc.adapters.ext_proc.health import Health
from extproc.adapters.ext_proc.servicer import Processor
from extproc.adapters.ext_proc.tls import RELOAD_OUTCOMES, ServerTls
from extproc.adapters.telemetry import Telemetry
from extproc.adapters.web.app import MetricsServer, build_app
from extproc.adapters.wiring import build_dispatchers, cluster_forms

log = logging.getLogger(__name__)

PROCESS_PATH = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
# Once nothing is queued or in flight: how long the last streams (refusals being
# sent) get to finish before the gRPC server stops.
FINAL_GRACE_S = 1.0
# A buffered body comes as one message with Envoy's headers and metadata around it.
BODY_MESSAGE_MARGIN = 64 * 1024
# How often the drain looks at the queues; it runs once per process lifetime.
DRAIN_POLL_S = 0.05


class ProcessorServer:
    """Everything ``serve`` runs, startable and stoppable from tests and the demo."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.telemetry = Telemetry()
        # Active-active (a `cluster:` section): releases are decided with the other instances (docs/cluster.md).
        self._cluster = (None if config.cluster is None else ClusterConnection(
            config.cluster, self.telemetry, cluster_forms(config), config.listen.grpc))
        self.dispatchers = build_dispatchers(config, self.telemetry, self._cluster)
        self.processor = Processor(config, self.dispatchers, self.telemetry)
        # Ready once every model's pool has a member: what the Endpoint Picker Protocol calls synced.
        self._health = Health(lambda: all(d.pool.endpoints for d in self.dispatchers.values()))
        # Every held request is an open stream: the transport never limits them, and
        # keeps each small (h2grpc.py; measured per held request in docs/reliability.md),
        # unless the operator chose grpc.aio (listen.transport: grpcio), the reference.
        transport = GrpcioServer if config.listen.transport == "grpcio" else GrpcServer
        self._grpc = transport({
            PROCESS_PATH: Method(pb.ProcessingRequest.FromString, self.processor.process),
            **self._health.methods(),
        }, max_message_bytes=config.endpoint_picker.max_body_bytes + BODY_MESSAGE_MARGIN)
        # TLS on the gRPC port (listen.tls), its files reloaded while serving.
        tls = config.listen.tls
        self._tls = None if tls is None else ServerTls(tls, self.telemetry.tls_reloaded)
        for outcome in RELOAD_OUTCOMES if tls is not None else ():
            self.telemetry.tls_reloads.labels(outcome=outcome)  # at 0 from the start
        self._tasks: list[asyncio.Task[None]] = []
        self._session: aiohttp.ClientSession | None = None
        # The metrics port (/metrics, /healthz, /readyz, the status page): adapters/web/app.py.
        host, port = split_address(config.listen.metrics)
        self._metrics_server = MetricsServer(
            build_app(self.telemetry.registry, self.dispatchers, lambda: self.processor.draining, self.telemetry),
            host, port,
        )
        self._metrics_started = False

    async def start(self) -> None:
        host, port = split_address(self.config.listen.grpc)
        try:
            if isinstance(self._grpc, GrpcioServer):  # grpcio reads the files itself, asking ServerTls of reloads
                await self._grpc.start(host, port, self._tls)
            else:
                await self._grpc.start(host, port, None if self._tls is None else self._tls.listener)
        except OSError as exc:
            raise OSError(f"listen.grpc: cannot bind {self.config.listen.grpc} ({exc.strerror})") from exc
        self.processor.lag.start()
        # Metrics last: once /metrics answers, the gRPC port is serving (readiness probe).
        try:
            await self._metrics_server.start()
        except OSError as exc:
            raise OSError(f"listen.metrics: cannot bind {self.config.listen.metrics} ({exc.strerror})") from exc
        self._metrics_started = True
        self._session = aiohttp.ClientSession()
        if self._tls is not None:
            self._tasks.append(asyncio.create_task(self._tls.watch()))
        for model in self.config.models:
            self._tasks.append(asyncio.create_task(watch_pool(self._session, model, self.dispatchers[model.name])))
        if self._cluster is not None:
            self._cluster.start()
        self._health.start()
        log.info("serving ext_proc on %s%s (transport %s), metrics on %s", self.config.listen.grpc,
                 "" if self._tls is None else " (TLS)", self.config.listen.transport, self.config.listen.metrics)

    def queued(self) -> int:
        return sum(d.queued for d in self.dispatchers.values())

    def in_flight(self) -> int:
        return sum(d.in_flight for d in self.dispatchers.values())

    async def drain_and_stop(
        self, drain_seconds: float, deadline_seconds: float, force: asyncio.Event | None = None
    ) -> None:
        """Drain as the module docstring says; ``force`` (a second signal) cuts it short at any point."""
        force = force or asyncio.Event()
        start = time.monotonic()
        log.info("draining: %d queued, %d in flight; queue for up to %gs, responses for up to %gs",
                 self.queued(), self.in_flight(), drain_seconds, deadline_seconds)
        self.processor.draining = True
        self.telemetry.draining.set(1)
        self._health.enter_graceful_shutdown()
        await self._wait(lambda: self.queued() == 0, start + min(drain_seconds, deadline_seconds), force)
        if self.queued():
            log.info("drain deadline: answering %d queued requests shutting_down", self.queued())
        for dispatcher in self.dispatchers.values():
            dispatcher.reject_all()
        await self._wait(lambda: self.in_flight() == 0, start + deadline_seconds, force)
        if self.in_flight():
            log.warning("%s: exiting with %d responses still streaming (they go on without the processor)",
                        "second signal" if force.is_set() else "hard deadline", self.in_flight())
        else:
            log.info("every response ended, %.1fs after the signal", time.monotonic() - start)
        await self._grpc.stop(0 if force.is_set() or self.in_flight() else FINAL_GRACE_S)
        await self.close()

    @staticmethod
    async def _wait(done: Callable[[], bool], deadline: float, force: asyncio.Event) -> None:
        while not done() and not force.is_set() and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)

    async def close(self) -> None:
        await self.processor.lag.stop()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._cluster is not None:
            await self._cluster.stop()
        if self._session is not None:
            await self._session.close()
        if self._metrics_started:
            await self._metrics_server.stop()
        await self._grpc.stop(0)


async def serve(config: Config, drain_seconds: float, deadline_seconds: float) -> None:
    """Run until SIGTERM/SIGINT, then drain; a second signal stops at once."""
    server = ProcessorServer(config)
    await server.start()
    stop, force = asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        (force if stop.is_set() else stop).set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    await stop.wait()
    await server.drain_and_stop(drain_seconds, deadline_seconds, force)
