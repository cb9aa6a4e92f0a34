"""The batch service in ``extproc serve``: the store, the runner and the API on ``batches.listen``.

``start`` binds the API and resumes the active batches; ``stop`` stops the
runner where it is (a line in flight is sent again by the next start) and
the API.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from aiohttp import web
from prometheus_client import CollectorRegistry

from extproc.adapters.batches.api import Api
from extproc.adapters.batches.metrics import BatchMetrics
from extproc.adapters.batches.runner import Runner
from extproc.adapters.batches.shapes import Json
from extproc.adapters.batches.store import Store
from extproc.adapters.config import Config, split_address
from extproc.adapters.telemetry.labels import TenantLabels

# Batches the status page lists at most (the oldest active first).
PROGRESS_LISTED = 50


class BatchService:
    def __init__(self, current: Callable[[], Config], registry: CollectorRegistry, tenants: TenantLabels) -> None:
        """``current``: the config now (reloads change identity and entitlements; ``batches:`` needs a restart)."""
        settings = current().batches
        assert settings is not None
        self.listen = settings.listen
        self.store = Store(settings.directory)
        self.metrics = BatchMetrics(registry, tenants)
        self.runner = Runner(current, self.store, self.metrics)
        self._stopped = False
        self._site_runner = web.AppRunner(Api(current, self.store, self.runner).app(), access_log=None,
                                          handle_signals=False)

    async def start(self) -> None:
        """Bind the API (OSError naming ``batches.listen`` if it cannot), then resume the active batches."""
        host, port = split_address(self.listen)
        await self._site_runner.setup()
        try:
            await web.TCPSite(self._site_runner, host or None, port, reuse_address=True).start()
        except OSError as exc:
            await self._site_runner.cleanup()
            raise OSError(f"batches.listen: cannot bind {self.listen} ({exc.strerror})") from exc
        self.runner.start()

    def progress(self) -> list[Json]:
        """The batches in progress, for the status page: each one's counts and its lines per second since it began."""
        return [] if self._stopped else self.store.progress(time.time(), PROGRESS_LISTED)

    async def stop(self) -> None:
        self._stopped = True
        await self.runner.stop()
        await self._site_runner.cleanup()
        self.store.close()
