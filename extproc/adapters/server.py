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
import gc
import logging
import signal
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import aiohttp
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.adapters.config import Config, split_address
from extproc.adapters.engines.limits import cap_advice
from extproc.adapters.engines.probe import probe_session
from extproc.adapters.ext_proc.servicer import Processor
from extproc.adapters.grpc.health import Health
from extproc.adapters.grpc.tls import RELOAD_OUTCOMES, ServerTls
from extproc.adapters.grpc.transport import MAX_MESSAGE_BYTES, Method, TransportLimits
from extproc.adapters.reload import ConfigSource, Plan, Reloader, rebuilt_model, removed_model
from extproc.adapters.runtime import Dispatchers, ModelRuntime, build_runtimes
from extproc.adapters.telemetry import Telemetry
from extproc.adapters.transports import TRANSPORTS
from extproc.adapters.web.app import MetricsServer, build_app
from extproc.adapters.wiring import cluster_forms, tenant_labels
from extproc.core.values.outcomes import Refused

if TYPE_CHECKING:  # the optional features: each imported where its section is on (ProcessorServer.__init__)
    from extproc.adapters.batches.service import BatchService
    from extproc.adapters.budgets.service import BudgetService
    from extproc.adapters.budgets.usage import Per
    from extproc.adapters.cluster.link import ClusterConnection

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
        self._cluster: ClusterConnection | None = None
        if config.cluster is not None:
            from extproc.adapters.cluster.link import ClusterConnection

            self._cluster = ClusterConnection(config.cluster, self.telemetry, cluster_forms(config), config.listen.grpc)
        # Each model's runtime (runtime.py), by model name: a reload updates, adds, replaces or retires one.
        self._runtimes = build_runtimes(config, self.telemetry, self._cluster)
        # Runtimes a reload took out of service (model removed or rebuilt), each draining in its task.
        self._retired: set[ModelRuntime] = set()
        # What the status page, readiness and the tests read of the serving models: their dispatchers.
        self.dispatchers = Dispatchers(self._runtimes)
        self.processor = Processor(config, self._runtimes, self.telemetry)
        # Tenant budgets (budgets:, docs/budgets.md): the gate is the processor's; their store, series and export here.
        self.budgets: BudgetService | None = None
        if config.budgets is not None:
            from extproc.adapters.budgets.service import BudgetService

            self.budgets = BudgetService(config.budgets, lambda: self.processor.budgets, self.telemetry.registry)
        self._share_budgets(config)
        # Ready once every model's pool is known (its first lookup done): what the Endpoint Picker Protocol calls
        # synced. An empty pool is known: its requests are held for the cold start, never refused for it.
        self._synced: set[str] = set()
        self._health = Health(lambda: self._synced.issuperset(self.dispatchers))
        # Every held request is an open stream: the transport's limits (listen.*) are far above
        # them, and the builtin transport keeps each small (measured per held request in docs/reports/reliability.md).
        self._grpc = TRANSPORTS[config.listen.transport]({
            PROCESS_PATH: Method(pb.ProcessingRequest.FromString, self.processor.process),
            **self._health.methods(),
        }, TransportLimits(config.advanced.grpc,
                           max(MAX_MESSAGE_BYTES, config.endpoint_picker.max_body_bytes + BODY_MESSAGE_MARGIN)))
        # TLS on the gRPC port (listen.tls), its files reloaded while serving.
        tls = config.listen.tls
        self._tls = None if tls is None else ServerTls(tls, self.telemetry.tls_reloaded)
        for outcome in RELOAD_OUTCOMES if tls is not None else ():
            self.telemetry.tls_reloads.labels(outcome=outcome)  # at 0 from the start
        self._tasks: list[asyncio.Task[None]] = []
        # How long a retired dispatcher keeps releasing what it holds (serve's --drain-seconds).
        self.retire_drain_s = 30.0
        # Models a reload added or rebuilt: readiness does not wait for their first scrape.
        self._reloaded: set[str] = set()
        self._session: aiohttp.ClientSession | None = None
        self._probes: aiohttp.ClientSession | None = None  # the engines' /health looks (probe.probe_session)
        # OpenAI's Batch API and its runner (batches:, docs/batches.md).
        self._batches: BatchService | None = None
        if config.batches is not None:
            from extproc.adapters.batches.service import BatchService

            self._batches = BatchService(lambda: self.config, self.telemetry.registry, tenant_labels(config), self._cluster)
        self._batches_started = False
        # The metrics port (/metrics, /healthz, /readyz, the status page, /usage): adapters/web/app.py.
        host, port = split_address(config.listen.metrics)
        self._metrics_server = MetricsServer(
            build_app(self.telemetry.registry, self.dispatchers, lambda: self.processor.draining, self.telemetry,
                      lambda model: model not in self._reloaded, self.usage, self._budget_standings,
                      None if self._batches is None else self._batches.progress, self._refresh_budgets),
            host, port,
        )
        self._metrics_started = False

    def _budget_standings(self) -> list[dict[str, object]] | None:
        return None if self.budgets is None else self.budgets.standings()

    async def _refresh_budgets(self) -> None:
        if self.budgets is not None:
            await self.budgets.refresh()

    async def usage(self, since: str, per: Per) -> list[dict[str, Any]] | None:
        """The usage export (adapters/budgets/service.py) from ``since`` (YYYY-MM-DD); None without budgets."""
        return None if self.budgets is None else await self.budgets.usage(since, per)

    async def start(self) -> None:
        if self.budgets is not None:  # before the first request: a restart does not hand out a fresh budget
            self.budgets.load()
        # From the first request on, a request's metrics are written after its replies (telemetry/deferral.py).
        self.telemetry.deferral.start(asyncio.get_running_loop())
        self.telemetry.watch(asyncio.get_running_loop())
        host, port = split_address(self.config.listen.grpc)
        try:
            await self._grpc.start(host, port, self._tls)
        except OSError as exc:
            raise OSError(f"listen.grpc: cannot bind {self.config.listen.grpc} ({exc.strerror})") from exc
        self.processor.lag.start()
        # Metrics last: once /metrics answers, the gRPC port is serving (readiness probe).
        try:
            await self._metrics_server.start()
        except OSError as exc:
            raise OSError(f"listen.metrics: cannot bind {self.config.listen.metrics} ({exc.strerror})") from exc
        self._metrics_started = True
        if self._batches is not None:
            await self._batches.start()
            self._batches_started = True
        self._session = aiohttp.ClientSession()
        self._probes = probe_session()
        if self._tls is not None:
            self._tasks.append(asyncio.create_task(self._tls.watch()))
        if self.budgets is not None and self.budgets.store is not None:
            self._tasks.append(asyncio.create_task(self.budgets.store.run()))
        for model in self.config.models:
            self._scrape(self._runtimes[model.name])
            log.info("model %s (%s): %s", model.name, model.engine, cap_advice(model.engine, model.target_waiting))
        if self._cluster is not None:
            self._cluster.start()
        self._health.start()
        log.info("serving ext_proc on %s%s (transport %s), metrics on %s", self.config.listen.grpc,
                 "" if self._tls is None else " (TLS)", self.config.listen.transport, self.config.listen.metrics)

    def add_task(self, task: asyncio.Task[None]) -> None:
        """A task that lives as long as the server (cancelled by close)."""
        self._tasks.append(task)

    def _every_runtime(self) -> list[ModelRuntime]:
        """The models serving and those a reload retired that still drain."""
        return [*self._runtimes.values(), *self._retired]

    def queued(self) -> int:
        return sum(r.dispatcher.queued for r in self._every_runtime())

    def in_flight(self) -> int:
        return sum(r.dispatcher.in_flight for r in self._every_runtime())

    def _scrape(self, runtime: ModelRuntime) -> None:
        assert self._session is not None and self._probes is not None
        runtime.scrape(self._session, self._probes, self._synced.add)

    def accepts_reload(self) -> str | None:
        """Why a reload cannot be applied now, or None (adapters/reload.py asks first)."""
        return "the processor is draining (shutting down)" if self.processor.draining else None

    def apply(self, config: Config, plan: Plan) -> None:
        """Apply a checked reload (adapters/reload.py says what each step keeps); synchronous: between two requests.

        Each model's change is made to its one runtime; the runtimes dict is
        changed in place: the processor, the status page and readiness all
        read the same one.
        """
        labels = tenant_labels(config)
        self.telemetry.expect((m.name for m in config.models), labels)
        for name in plan.removed:
            self._retire(name, removed_model(name), gone=True)
        for model in (*plan.rebuilt, *plan.added):
            if model.name in self._runtimes:
                self._retire(model.name, rebuilt_model(model.name), gone=False)
            runtime = self._runtimes[model.name] = ModelRuntime(config, model, self.telemetry, self._cluster)
            self._reloaded.add(model.name)
            self._scrape(runtime)
        for model in plan.kept:
            runtime = self._runtimes[model.name]
            runtime.update(config, model, labels)
            if model.name in plan.rescraped:
                self._scrape(runtime)
        self.processor.reconfigure(config)
        self._share_budgets(config)
        self.config = config

    def _share_budgets(self, config: Config) -> None:
        """With a cluster, the budgets' counts are the cluster's, in Redis (adapters/budgets/service.py ``share``)."""
        if self.budgets is not None and self._cluster is not None and config.cluster is not None:
            self.budgets.share(self._cluster, config.cluster)

    def _retire(self, name: str, leftover: Callable[[], Refused], *, gone: bool) -> None:
        """Take ``name``'s runtime out of service; its dispatcher drains in a task (runtime.py ``retire``)."""
        runtime = self._runtimes.pop(name)
        self._retired.add(runtime)
        runtime.retire(self.retire_drain_s, leftover, gone).add_done_callback(lambda _: self._retired.discard(runtime))

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
        if self._batches is not None and self._batches_started:  # no more lines; those in flight run again next start
            self._batches_started = False
            await self._batches.stop()
        self._health.enter_graceful_shutdown()
        await self._wait(lambda: self.queued() == 0, start + min(drain_seconds, deadline_seconds), force)
        if self.queued():
            log.info("drain deadline: answering %d queued requests shutting_down", self.queued())
        for runtime in self._every_runtime():
            runtime.dispatcher.reject_all()
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
        tasks = [*self._tasks, *(task for runtime in self._every_runtime() for task in runtime.tasks())]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.budgets is not None:
            await self.budgets.close()
        if self._batches is not None and self._batches_started:  # before the cluster: its lines go back through Redis
            self._batches_started = False
            await self._batches.stop()
        if self._cluster is not None:
            await self._cluster.stop()
        for session in (self._session, self._probes):
            if session is not None:
                await session.close()
        if self._metrics_started:
            await self._metrics_server.stop()
        await self._grpc.stop(0)
        self.telemetry.deferral.stop()


async def serve(config: Config, drain_seconds: float, deadline_seconds: float,
                source: tuple[ConfigSource, bytes] | None = None, watch_config: bool = False) -> None:
    """Run until SIGTERM/SIGINT, then drain; a second signal stops at once.

    SIGHUP reloads ``source`` (where ``config`` came from, and the content it was loaded from).
    """
    loop = asyncio.get_running_loop()
    if source is not None:  # until the reloader takes it: SIGHUP's default would end the process
        loop.add_signal_handler(signal.SIGHUP, log.warning, "SIGHUP while starting: ignored; send it again once serving")
    server = ProcessorServer(config)
    await server.start()
    # What start-up built (modules, protobuf descriptors, the config, the metrics: ~70,000 objects) lives as long
    # as the process. Frozen, the cyclic GC's full collections no longer walk it: each took ~50 ms of CPU, a stall
    # of every stream on the loop, every few thousand requests. Frozen objects are still freed by reference
    # counting; only a cycle among them (none is made per request) would stay.
    gc.collect()
    gc.freeze()
    stop, force = asyncio.Event(), asyncio.Event()
    if source is not None:
        _serve_reloads(server, source, drain_seconds, watch_config)

    def on_signal() -> None:
        (force if stop.is_set() else stop).set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    await stop.wait()
    await server.drain_and_stop(drain_seconds, deadline_seconds, force)


def _serve_reloads(server: ProcessorServer, source: tuple[ConfigSource, bytes], drain_seconds: float,
                   watch: bool) -> None:
    """SIGHUP (and with ``watch``, a change of the file) reloads the config (adapters/reload.py)."""
    server.retire_drain_s = drain_seconds
    reloader = Reloader(*source, server, server.telemetry)
    asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, reloader.reload, "SIGHUP")
    if watch:
        server.add_task(asyncio.create_task(reloader.watch()))
