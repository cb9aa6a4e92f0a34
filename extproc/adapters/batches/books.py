"""What the API asks of where batches live and run: :class:`Books`, and the single instance's :class:`LocalBooks`.

Two implementations: :class:`LocalBooks` (the SQLite store and the runner of
one instance) and ``cluster.py``'s ``SharedBooks`` (state in the cluster's
Redis, files on a directory every instance mounts). The API (``api.py``)
sees only this seam, so its handlers, its validation and OpenAI's shapes are
the same whichever keeps the books.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from extproc.adapters.batches.runner import Runner
from extproc.adapters.batches.shapes import Json
from extproc.adapters.batches.store import Store


class BooksUnavailable(Exception):
    """The books cannot be read or written now (the cluster's Redis is away): the API answers 503."""


class Books(Protocol):
    """Files and batches of each tenant; a tenant's ``None`` is an id it does not own, or no such id."""

    @property
    def files_dir(self) -> Path:
        """Where uploads are written (then committed by :meth:`add_file`, which renames them)."""

    def path(self, file_id: str) -> Path:
        """Where a committed file's content is."""

    async def add_file(self, file_id: str, tenant: str, purpose: str, filename: str, written: Path,
                       created_at: int) -> Json: ...

    async def file(self, tenant: str, file_id: str) -> Json | None: ...

    async def files(self, tenant: str, after: str | None, limit: int, ascending: bool,
                    purpose: str | None) -> tuple[list[Json], bool]: ...

    async def delete_file(self, tenant: str, file_id: str) -> bool: ...

    async def create_batch(self, tenant: str, doc: Json) -> None:
        """Keep a new batch (``validating``) and have it run."""

    async def batch(self, tenant: str, batch_id: str) -> Json | None: ...

    async def batches(self, tenant: str, after: str | None, limit: int) -> tuple[list[Json], bool]: ...

    async def cancel(self, batch_id: str) -> Json:
        """``cancelling`` if the batch is still validating or in progress; the batch as it now stands."""


class LocalBooks:
    """One instance's books: the SQLite store, and its own runner for the batches it creates."""

    def __init__(self, store: Store, runner: Runner) -> None:
        self._store, self._runner = store, runner

    @property
    def files_dir(self) -> Path:
        return self._store.files_dir

    def path(self, file_id: str) -> Path:
        return self._store.path(file_id)

    async def add_file(self, file_id: str, tenant: str, purpose: str, filename: str, written: Path,
                       created_at: int) -> Json:
        return self._store.add_file(file_id, tenant, purpose, filename, written, created_at)

    async def file(self, tenant: str, file_id: str) -> Json | None:
        return self._store.file(tenant, file_id)

    async def files(self, tenant: str, after: str | None, limit: int, ascending: bool,
                    purpose: str | None) -> tuple[list[Json], bool]:
        return self._store.files(tenant, after, limit, ascending, purpose)

    async def delete_file(self, tenant: str, file_id: str) -> bool:
        return self._store.delete_file(tenant, file_id)

    async def create_batch(self, tenant: str, doc: Json) -> None:
        self._store.add_batch(tenant, doc)
        self._runner.run(doc["id"])

    async def batch(self, tenant: str, batch_id: str) -> Json | None:
        return self._store.batch(batch_id, tenant)

    async def batches(self, tenant: str, after: str | None, limit: int) -> tuple[list[Json], bool]:
        return self._store.batches(tenant, after, limit)

    async def cancel(self, batch_id: str) -> Json:
        return self._runner.cancel(batch_id)
