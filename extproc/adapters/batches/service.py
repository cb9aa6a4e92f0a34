"""The batch service in ``extproc serve``: the books, the runner and the API on ``batches.listen``.

One instance (no ``cluster:``): the SQLite store under ``batches.directory``
and a runner for the batches it keeps. A cluster: state and leases in the
cluster's Redis (``cluster_store.py``); every instance serves the API and runs a
share of every batch's lines (``cluster_runner.py``). Either way the files' contents
are in the file store (``files.py``): ``batches.directory/files`` (a
cluster's: a directory every instance mounts) or, with ``batches.files.s3``,
an S3 bucket (``s3.py``).

``start`` binds the API and resumes the active batches; ``stop`` stops the
runner where it is (a line in flight is sent again: by the next start, or
another instance) and the API.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import redis.asyncio as aioredis
from aiohttp import web
from prometheus_client import CollectorRegistry
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from extproc.adapters.batches.api import Api
from extproc.adapters.batches.books import Books, LocalBooks
from extproc.adapters.batches.cluster_runner import ClusterRunner
from extproc.adapters.batches.cluster_store import ClusterBooks, ClusterState
from extproc.adapters.batches.files import DirectoryFiles, FileStore
from extproc.adapters.batches.local_runner import LocalRunner
from extproc.adapters.batches.local_store import LocalStore
from extproc.adapters.batches.metrics import BatchMetrics
from extproc.adapters.batches.shapes import PROGRESS_LISTED, Json
from extproc.adapters.config import Config, split_address
from extproc.adapters.config.batches import BatchSettings
from extproc.adapters.telemetry.labels import TenantLabels

if TYPE_CHECKING:  # built by server.py only with a cluster: section
    from extproc.adapters.cluster.link import ClusterConnection

# The least a cluster's batch state waits for Redis: an API call or a line's record is not a release
# decision, which must not wait (cluster.redis_timeout_ms, 250 ms by default); a busy Redis or machine
# should not answer the API 503.
MIN_REDIS_TIMEOUT_S = 1.0


class BatchService:
    def __init__(self, current: Callable[[], Config], registry: CollectorRegistry, tenants: TenantLabels,
                 cluster: ClusterConnection | None = None, clock: Callable[[], float] = time.time) -> None:
        """``current``: the config now (reloads change identity and entitlements; ``batches:`` needs a restart).

        ``cluster``: the process's connection to the cluster's Redis (``cluster:``): its settings, and its
        instance name for the runner's leases. ``clock``: the wall clock of the batches' times and windows.
        """
        settings = current().batches
        assert settings is not None
        self.listen = settings.listen
        self.metrics = BatchMetrics(registry, tenants)
        self._clock = clock
        self._store: LocalStore | None = None
        self._client: aioredis.Redis | None = None
        self._runner: LocalRunner | ClusterRunner
        self._files = file_store(settings)
        books: Books
        if cluster is None:
            assert settings.directory is not None  # config/batches.py: required without cluster:
            self._store = LocalStore(settings.directory, self._files)
            self._runner = LocalRunner(current, self._store, self.metrics, clock)
            books = LocalBooks(self._store, self._runner)
        else:
            shared = cluster.settings
            # A client of its own: the batches wait longer for Redis than a release decision may.
            timeout_s = max(shared.redis_timeout_ms / 1000, MIN_REDIS_TIMEOUT_S)
            self._client = aioredis.from_url(shared.redis_url, socket_timeout=timeout_s,
                                             socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0))
            state = ClusterState(self._client, shared.key_prefix, timeout_s, self._files)
            self._runner = ClusterRunner(current, state, self.metrics, cluster.instance, shared.lease_s,
                                        shared.heartbeat_interval_s, clock)
            books = ClusterBooks(state)
        self._stopped = False
        self._site_runner = web.AppRunner(Api(current, books, self._files, clock).app(), access_log=None, handle_signals=False)

    async def start(self) -> None:
        """Bind the API (OSError naming ``batches.listen`` if it cannot), then resume the active batches."""
        host, port = split_address(self.listen)
        await self._site_runner.setup()
        try:
            await web.TCPSite(self._site_runner, host or None, port, reuse_address=True).start()
        except OSError as exc:
            await self._site_runner.cleanup()
            raise OSError(f"batches.listen: cannot bind {self.listen} ({exc.strerror})") from exc
        self._runner.start()

    def progress(self) -> list[Json]:
        """The batches in progress, for the status page: each one's counts and its lines per second since it began."""
        if self._stopped:
            return []
        if self._store is None:
            assert isinstance(self._runner, ClusterRunner)
            return self._runner.progress()
        return self._store.progress(self._clock(), PROGRESS_LISTED)

    async def stop(self) -> None:
        self._stopped = True
        await self._runner.stop()
        await self._site_runner.cleanup()
        if self._store is not None:
            self._store.close()
        if self._client is not None:
            await self._client.aclose()
        self._files.close()


def file_store(settings: BatchSettings) -> FileStore:
    """The store ``batches:`` names: S3 with ``files.s3``, else ``directory/files``."""
    if settings.files.s3 is not None:
        try:
            from extproc.adapters.batches.s3 import S3Files  # boto3 is optional: the s3 extra
        except ImportError as exc:
            raise RuntimeError(f"batches.files.s3 needs boto3 ({exc}): pip install 'extproc-fair[s3]'") from exc
        return S3Files.from_settings(settings.files.s3)
    assert settings.directory is not None  # config/batches.py: required without files.s3
    return DirectoryFiles(Path(settings.directory) / "files")
