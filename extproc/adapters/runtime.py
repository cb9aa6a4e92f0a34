"""One configured model at the edge: everything the adapters keep for it, in one object.

A model that ``extproc serve`` schedules has, beside its dispatcher (built
by ``wiring.py``): its telemetry child, its scraper task
(``engines/discovery.py``), its prompt signer (a model with ``prefix:``
signatures), the reply that holds our Envoy while one of its requests waits,
the statuses and the stream refusal by which its engine says it is full,
its classes' engine priorities and, once a reload takes it out of service,
its retirement. :class:`ModelRuntime` holds all of it. Readers get a narrow
view: the stream handling reads ``ext_proc/attach/served.py``'s ``ServedModel``,
the status page and readiness a read-only mapping of dispatchers
(:class:`Dispatchers`).

A reload (``reload.py`` plans it, ``server.py`` applies it) changes each
model in one place: a kept model's runtime takes the new settings in place
(:meth:`ModelRuntime.update`, its scraper restarted where what it reads
changed); a rebuilt or removed model's runtime retires (:func:`retire`) and
a rebuilt one is replaced by a new runtime.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import aiohttp
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.adapters.config import Config, ModelConfig
from extproc.adapters.engines.discovery import watch_pool
from extproc.adapters.ext_proc.attach.replies import duration
from extproc.adapters.protocol.contract import hold_timeout_for
from extproc.adapters.protocol.dialects import DIALECTS
from extproc.adapters.request.prompt_prefix import Signer
from extproc.adapters.telemetry import ModelTelemetry, Telemetry, TenantLabels
from extproc.adapters.wiring import build_dispatcher, live_settings, tenant_labels
from extproc.core.dispatcher import ModelDispatcher
from extproc.core.values.outcomes import Refused

if TYPE_CHECKING:  # built by server.py only with a cluster: section
    from extproc.adapters.cluster.link import ClusterConnection

log = logging.getLogger(__name__)

# How often a retired dispatcher's queue is looked at while it drains.
RETIRE_POLL_S = 0.05


class ModelRuntime:
    """One configured model's parts at the edge; a reload updates it in place or retires it."""

    def __init__(self, config: Config, model: ModelConfig, telemetry: Telemetry,
                 cluster: ClusterConnection | None = None) -> None:
        self.name = model.name
        self.dispatcher = build_dispatcher(config, model, telemetry, cluster=cluster)
        # The telemetry child building the dispatcher made: where the adapters' events of the model go.
        self.report: ModelTelemetry = telemetry.models[model.name]
        self._scraper: asyncio.Task[None] | None = None
        # Scrapers a reload restarted: close() waits for them to close their sessions (those that ended go).
        self._stopped: list[asyncio.Task[None]] = []
        self._retirement: asyncio.Task[None] | None = None
        self._derive(config, model)

    def _derive(self, config: Config, model: ModelConfig) -> None:
        """What the runtime keeps prebuilt from ``model``'s settings (at its start, and at each reload that keeps it)."""
        self.model = model
        self.signer = None if model.prefix is None else Signer(model)
        # Prebuilt: one is sent to every request of the model that has to wait.
        self.hold_reply = pb.ProcessingResponse(
            override_message_timeout=duration(hold_timeout_for(config.longest_queue_wait_s(model))))
        dialect = DIALECTS[model.engine]
        self.full_statuses = dialect.full_statuses
        self.stream_refusal: Callable[[Mapping[str, Any]], bool] | None = (
            dialect.stream_refusal if model.may_check_stream_start() else None)
        self.checks_start_if_capped = model.check_stream_start is None
        self._priorities = tuple(band.engine_priority for band in config.bands)

    def engine_priority(self, band: int) -> int | None:
        """The body ``priority`` to write for a request of ``band``: its class's, negated for engines that run higher
        values first; None where none is written (``ModelDispatcher.priority_first``)."""
        first = self.dispatcher.priority_first
        if first is None:
            return None
        value = self._priorities[band]
        return value if first == "lower" else -value

    def update(self, config: Config, model: ModelConfig, labels: TenantLabels) -> None:
        """A reload kept the model: its dispatcher takes the settings it takes in place, its series the new tenants."""
        self.report.relabel(labels, self.dispatcher.queued_by_tenant())
        self.dispatcher.reconfigure(live_settings(config, model))
        self._derive(config, model)

    def scrape(self, session: aiohttp.ClientSession, probes: aiohttp.ClientSession,
               synced: Callable[[str], None]) -> None:
        """Start the model's scraper; a running one (a reload changed what it reads) is stopped for it.

        ``synced`` is told the model's name once its pool is known (readiness).
        """
        if self._scraper is not None:
            self._scraper.cancel()
            self._stopped = [*(t for t in self._stopped if not t.done()), self._scraper]
        name = self.name
        self._scraper = asyncio.create_task(
            watch_pool(session, probes, self.model, self.dispatcher, lambda: synced(name)))

    def retire(self, drain_s: float, leftover: Callable[[], Refused], gone: bool) -> asyncio.Task[None]:
        """Take the model out of service: its dispatcher drains in the returned task (:func:`retire`)."""
        assert self._scraper is not None and self._retirement is None
        self._retirement = asyncio.create_task(retire(self.dispatcher, self._scraper, drain_s, leftover, gone))
        return self._retirement

    def tasks(self) -> list[asyncio.Task[None]]:
        """Every task of the model's that a shutdown cancels and waits for."""
        return [t for t in (self._scraper, *self._stopped, self._retirement) if t is not None]


def build_runtimes(config: Config, telemetry: Telemetry,
                   cluster: ClusterConnection | None = None) -> dict[str, ModelRuntime]:
    """One runtime per configured model, by model name."""
    telemetry.expect((model.name for model in config.models), tenant_labels(config))
    return {model.name: ModelRuntime(config, model, telemetry, cluster) for model in config.models}


class Dispatchers(Mapping[str, ModelDispatcher]):
    """The serving models' dispatchers by name, read live through their runtimes (status page, readiness)."""

    __slots__ = ("_runtimes",)

    def __init__(self, runtimes: Mapping[str, ModelRuntime]) -> None:
        self._runtimes = runtimes

    def __getitem__(self, name: str) -> ModelDispatcher:
        return self._runtimes[name].dispatcher

    def __iter__(self) -> Iterator[str]:
        return iter(self._runtimes)

    def __len__(self) -> int:
        return len(self._runtimes)


async def retire(dispatcher: ModelDispatcher, scraper: asyncio.Task[None], drain_s: float,
                 leftover: Callable[[], Refused], gone: bool) -> None:
    """Drain a dispatcher no request reaches any more: release what it holds for up to ``drain_s``, answer the rest.

    Its scraper runs while it holds requests (the release rule needs the
    engine's numbers), then stops. The task ends when its released requests
    have ended on their own streams, so a shutdown meanwhile counts them as
    in flight. ``gone``: the model left the config, so its endpoints' gauges go too.
    """
    deadline = time.monotonic() + drain_s
    try:
        while dispatcher.queued and time.monotonic() < deadline:
            await asyncio.sleep(RETIRE_POLL_S)
        if dispatcher.queued:
            log.info("model %s: %d requests still queued after %gs of draining: answered %s", dispatcher.name,
                     dispatcher.queued, drain_s, leftover().refusal.value)
            dispatcher.reject_all(leftover)
    finally:
        if not scraper.cancelling():  # a shutdown may have cancelled it already
            scraper.cancel()
        # wait, not gather: a shutdown cancelling this task must not cancel the scraper's own cleanup
        # a second time; the server's close() waits for it (ModelRuntime.tasks).
        await asyncio.wait([scraper])
    while dispatcher.in_flight:
        await asyncio.sleep(RETIRE_POLL_S)
    if gone:
        dispatcher.set_endpoints(())
