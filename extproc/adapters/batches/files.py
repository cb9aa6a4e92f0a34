"""Where the batch files' contents live: a :class:`FileStore`, a directory (:class:`DirectoryFiles`) or S3 (``s3.py``).

The state (SQLite or the cluster's Redis) names each file and keeps its size;
the store keeps only the bytes, under a name: a file's id, or a batch's
validated lines (``.<batch id>.lines``, a cluster's). What every caller needs
of it, and nothing more:

* a file is *written* through a :class:`Writer` and appears under its name
  only when committed, whole (a directory: a name of its own renamed into
  place; S3: one object, sent in parts), so a reader on any instance sees all
  of it or nothing, and the state's row is committed after its content;
* an input file is *opened* for reading line by line (``lines.raw_lines``),
  never read whole; a cluster reads its lines file by byte ranges;
* a missing file is :class:`FileNotFoundError`; a store that cannot be reached
  now is :class:`FilesUnavailable` (the API answers 503, a runner tries again).

Every call blocks (a disk or an HTTP round trip): the runners make them in
worker threads, as they do their other large work, and the API through
``asyncio.to_thread``.
"""

from __future__ import annotations

import os
import secrets
from abc import ABC, abstractmethod
from pathlib import Path
from types import TracebackType
from typing import BinaryIO


class FilesUnavailable(Exception):
    """The file store cannot be reached now (S3 away, or refusing): try again later; nothing was half written."""


class Writer(ABC):
    """One file being written: invisible under its name until :meth:`commit`, dropped by :meth:`abort`.

    As a context manager it aborts when its block raises before the commit.
    """

    def __init__(self) -> None:
        self.size = 0
        self._done = False

    def write(self, data: bytes) -> None:
        self._write(data)
        self.size += len(data)

    def commit(self) -> int:
        """The file under its name, whole (replacing one already there); its size."""
        self._commit()
        self._done = True
        return self.size

    def abort(self) -> None:
        """Nothing of the file kept (a store that cannot be reached keeps at most an unlisted leftover)."""
        if not self._done:
            self._done = True
            self._abort()

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if kind is not None:
            try:
                self.abort()
            except FilesUnavailable:
                pass  # the first failure is the one to report

    @abstractmethod
    def _write(self, data: bytes) -> None: ...

    @abstractmethod
    def _commit(self) -> None: ...

    @abstractmethod
    def _abort(self) -> None: ...


class FileStore(ABC):
    """The files' contents by name; see the module's docstring for what each call promises."""

    @abstractmethod
    def create(self, name: str) -> Writer:
        """A new file ``name``, to be written and committed (or aborted)."""

    @abstractmethod
    def open(self, name: str) -> BinaryIO:
        """``name`` for reading from its start, in order (``readline`` and ``read``)."""

    @abstractmethod
    def read_spans(self, name: str, spans: list[tuple[int, int]]) -> list[bytes]:
        """The bytes of each (offset, size) of ``name``."""

    @abstractmethod
    def delete(self, name: str) -> None:
        """``name`` gone; nothing happens when there is none."""

    @abstractmethod
    def close(self) -> None:
        """Its connections released (the service's stop)."""


class DirectoryFiles(FileStore):
    """A directory (``batches.directory/files``, created if missing): a cluster's, one every instance mounts."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)

    def create(self, name: str) -> Writer:
        return _DirectoryWriter(self.directory / name)

    def open(self, name: str) -> BinaryIO:
        return (self.directory / name).open("rb")

    def read_spans(self, name: str, spans: list[tuple[int, int]]) -> list[bytes]:
        found = []
        with (self.directory / name).open("rb") as source:
            for offset, size in spans:
                source.seek(offset)
                found.append(source.read(size))
        return found

    def delete(self, name: str) -> None:
        (self.directory / name).unlink(missing_ok=True)

    def close(self) -> None:
        """Nothing is held open between calls."""


class _DirectoryWriter(Writer):
    """Written to a name of its own beside the file, renamed into place by the commit."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self._path = path
        self._written = path.with_name(f".{path.name}.{secrets.token_hex(4)}.part")
        self._out = self._written.open("wb")

    def _write(self, data: bytes) -> None:
        self._out.write(data)

    def _commit(self) -> None:
        self._out.close()
        os.replace(self._written, self._path)

    def _abort(self) -> None:
        self._out.close()
        self._written.unlink(missing_ok=True)
