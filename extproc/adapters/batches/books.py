"""What the API asks of where batches live and run: :class:`Books`, and the single instance's :class:`LocalBooks`.

Two implementations: :class:`LocalBooks` (the SQLite store and the runner of
one instance) and ``cluster_store.py``'s ``ClusterBooks`` (state in the cluster's
Redis). The API (``api.py``) sees only this seam and the file store's
(``files.py``: where the contents are), so its handlers, its validation and
OpenAI's shapes are the same whichever keeps the books.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from extproc.adapters.batches.local_runner import LocalRunner
from extproc.adapters.batches.local_store import LocalStore
from extproc.adapters.batches.shapes import Json


class BooksUnavailable(Exception):
    """The books cannot be read or written now (the cluster's Redis is away): the API answers 503."""


class Books(Protocol):
    """Files and batches of each tenant; a tenant's ``None`` is an id it does not own, or no such id."""

    async def add_file(self, file_id: str, tenant: str, purpose: str, filename: str, size: int,
                       created_at: int) -> Json:
        """Keep a file whose content (``size`` bytes) the file store has committed."""

    async def file(self, tenant: str, file_id: str) -> Json | None: ...

    async def files(self, tenant: str, after: str | None, limit: int, ascending: bool,
                    purpose: str | None) -> tuple[list[Json], bool]: ...

    async def delete_file(self, tenant: str, file_id: str) -> bool:
        """The file's content, then the file; False (nothing done) when it is not the tenant's."""

    async def create_batch(self, tenant: str, doc: Json) -> None:
        """Keep a new batch (``validating``) and have it run."""

    async def batch(self, tenant: str, batch_id: str) -> Json | None: ...

    async def batches(self, tenant: str, after: str | None, limit: int) -> tuple[list[Json], bool]: ...

    async def cancel(self, batch_id: str) -> Json:
        """``cancelling`` if the batch is still validating or in progress; the batch as it now stands."""


class LocalBooks:
    """One instance's books: the SQLite store, and its own runner for the batches it creates."""

    def __init__(self, store: LocalStore, runner: LocalRunner) -> None:
        self._store, self._runner = store, runner

    async def add_file(self, file_id: str, tenant: str, purpose: str, filename: str, size: int,
                       created_at: int) -> Json:
        return self._store.add_file(file_id, tenant, purpose, filename, size, created_at)

    async def file(self, tenant: str, file_id: str) -> Json | None:
        return self._store.file(tenant, file_id)

    async def files(self, tenant: str, after: str | None, limit: int, ascending: bool,
                    purpose: str | None) -> tuple[list[Json], bool]:
        return self._store.files(tenant, after, limit, ascending, purpose)

    async def delete_file(self, tenant: str, file_id: str) -> bool:
        return await asyncio.to_thread(self._store.delete_file, tenant, file_id)

    async def create_batch(self, tenant: str, doc: Json) -> None:
        self._store.add_batch(tenant, doc)
        self._runner.run(doc["id"])

    async def batch(self, tenant: str, batch_id: str) -> Json | None:
        return self._store.batch(batch_id, tenant)

    async def batches(self, tenant: str, after: str | None, limit: int) -> tuple[list[Json], bool]:
        return self._store.batches(tenant, after, limit)

    async def cancel(self, batch_id: str) -> Json:
        return self._runner.cancel(batch_id)
