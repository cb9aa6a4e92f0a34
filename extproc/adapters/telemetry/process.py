"""One processor's telemetry: its registry, the series on it, and each model's recorder.

One registry per instance (not prometheus_client's global one), so that tests
can run several processors in one Python process. The refusals the ext_proc
adapter counts itself are created at zero for every label value known from
the config (models x reasons x tenants), as each model's recorder creates its
own, so a dashboard shows 0, not "no data", before the first event.
"""

from __future__ import annotations

import asyncio
import platform
import time
from collections.abc import Callable, Iterable
from importlib.metadata import PackageNotFoundError, version

from prometheus_client import CollectorRegistry, Gauge, PlatformCollector, ProcessCollector

from extproc.adapters.telemetry.deferral import Deferral
from extproc.adapters.telemetry.labels import NO_TENANT, UNKNOWN_MODEL, TenantLabels
from extproc.adapters.telemetry.model import ModelTelemetry
from extproc.adapters.telemetry.series import Series
from extproc.core.values.outcomes import Refusal

# Refusals the ext_proc adapter decides before a request reaches a model's queue: all the model label
# can be when the model is not served, and the refusals a known model gets before its tenant is known.
_UNKNOWN_MODEL_REASONS = (Refusal.MODEL_MISSING, Refusal.MODEL_NOT_FOUND, Refusal.INVALID_BODY, Refusal.BODY_TOO_LARGE)
_ADMISSION_REASONS = (Refusal.INVALID_MAX_TOKENS, Refusal.INVALID_TTFT_OBJECTIVE, Refusal.TENANT_MISSING,
                      Refusal.PRIORITY_NOT_ALLOWED, Refusal.NO_ENDPOINT, Refusal.SHUTTING_DOWN)
# Refusals of a request whose tenant is known: a queue cap, its queue timeout, the drain, shedding.
_QUEUE_REASONS = (Refusal.TENANT_QUEUE_FULL, Refusal.BAND_QUEUE_FULL, Refusal.MODEL_QUEUE_FULL,
                  Refusal.QUEUE_TIMEOUT, Refusal.SHUTTING_DOWN, Refusal.OVERLOADED)


def _package_version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


class Telemetry(Series):
    """The series on a registry of the processor's own, with the process's and the build's, and each model's recorder."""

    def __init__(self) -> None:
        super().__init__(CollectorRegistry())
        r = self.registry
        # CPU, memory, open files, start time (process_*) and the interpreter (python_info), on our registry.
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        Gauge(
            "extproc_build_info", "Always 1; the labels say which extproc and Python run.",
            ["version", "python"], registry=r,
        ).labels(_package_version("extproc-fair"), platform.python_version()).set(1)
        # Each model's recorder, by model name.
        self.models: dict[str, ModelTelemetry] = {}
        # Every recorder's events, written after the replies while the server runs (its start and close).
        self.deferral = Deferral()

    def for_model(self, model: str, priorities: Iterable[str], tenants: TenantLabels,
                  clock: Callable[[], float] = time.monotonic) -> ModelTelemetry:
        """A new recorder for ``model``, the one :meth:`report` answers for it from now on."""
        recorder = self.models[model] = ModelTelemetry(self, model, priorities, tenants, clock, self.deferral)
        return recorder

    def report(self, model: str) -> ModelTelemetry:
        """Where ``model``'s events go; a model no dispatcher serves reports as ``(unknown)``."""
        reporter = self.models.get(model) or self.models.get(UNKNOWN_MODEL)
        return reporter or self.for_model(UNKNOWN_MODEL, (), TenantLabels(()))

    def watch(self, loop: asyncio.AbstractEventLoop) -> None:
        """Count ``loop``'s tasks at each scrape (the page is encoded on another thread: the loop is named)."""
        self.asyncio_tasks.set_function(lambda: len(asyncio.all_tasks(loop)))

    def tls_reloaded(self, outcome: str) -> None:
        self.tls_reloads.labels(outcome=outcome).inc()

    def expect(self, models: Iterable[str], tenants: TenantLabels) -> None:
        """Create at zero the refusals the ext_proc adapter counts itself (see the module docstring)."""
        for reason in _UNKNOWN_MODEL_REASONS:
            self.rejected.labels(UNKNOWN_MODEL, reason.value, NO_TENANT)
        for model in models:
            for reason in _ADMISSION_REASONS:
                self.rejected.labels(model, reason.value, NO_TENANT)
            for tenant in tenants.values:
                for reason in _QUEUE_REASONS:
                    self.rejected.labels(model, reason.value, tenant)

