"""A cluster's batches (``cluster:``): state and line leases in the cluster's Redis, files in a shared file store.

Every instance serves the API and runs every active batch; what keeps a line
from running twice is its lease (``cluster_store.lua``, atomic):

* a runner *claims* lines (up to its free slots), each leased to it for
  ``cluster.lease_s`` and renewed every heartbeat while it runs; a lease
  that lapses (the instance died, or lost Redis) puts the line back, and
  another instance takes it;
* an outcome is *recorded* once (the first answer wins; a later one is a
  duplicate and dropped) and only while the batch runs: once it is
  finalizing, cancelling or past its window, nothing more is recorded, so the
  output and error files written from the recorded outcomes are final;
* validating and finalizing a batch is one instance's work at a time (a
  lock with a lease): redone from scratch by another if that one dies.

The files' contents (uploads, the validated lines' bodies, the output and
error files) live in a file store every instance reaches (``files.py``: a
directory every instance mounts, or S3): a file appears whole or not at all,
so a reader on another instance never sees half of one. Redis holds only
small records (a line is its ``custom_id`` and where its body is).

Redis away (an error, or slower than the service's timeout, ``service.py``): the API
answers 503 (Retry-After: 1), the runners stop claiming and try again each
heartbeat; an answer to a line already sent is recorded once Redis is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from importlib.resources import files
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from extproc.adapters.batches.books import BooksUnavailable
from extproc.adapters.batches.files import FileStore
from extproc.adapters.batches.shapes import Json, file_object

SCRIPT = files("extproc.adapters.batches").joinpath("cluster_store.lua").read_text()
# Internal fields of a batch's hash (the rest are OpenAI's fields, each as JSON text).
_INTERNAL = ("_status", "_tenant", "_seq", "_total", "_completed", "_failed", "_expired")
# Records written per pipeline (a validation's lines, a finalization's outcomes).
CHUNK = 1000
# Redis errors, and a call slower than the timeout.
FAILURES = (RedisError, OSError, TimeoutError)


@dataclass(frozen=True)
class Batch:
    """A batch as the runner reads it: OpenAI's object, its tenant, and whether its window ended."""

    doc: Json
    tenant: str
    expired: bool

    @property
    def status(self) -> str:
        status: str = self.doc["status"]
        return status


class ClusterState:
    """The Redis side: files, batches and lines; every call raises one of ``FAILURES`` when Redis is away."""

    def __init__(self, client: aioredis.Redis, key_prefix: str, timeout_s: float, contents: FileStore) -> None:
        """``contents``: the files' contents, the same store for every instance."""
        self._client = client
        self._script = client.register_script(SCRIPT)
        self._prefix = f"{key_prefix}:batches"
        self.timeout_s = timeout_s
        self.contents = contents

    def _key(self, *parts: str) -> str:
        return ":".join((self._prefix, *parts))

    async def call(self, op: str, **args: Any) -> Any:
        async with asyncio.timeout(self.timeout_s):
            reply = await self._script(keys=[self._prefix], args=[json.dumps({"op": op, **args})])
        return json.loads(reply)

    async def _run(self, pipe: Any) -> list[Any]:
        async with asyncio.timeout(self.timeout_s):
            result: list[Any] = await pipe.execute()
        return result

    # --- files ----------------------------------------------------------------------------------

    async def add_file(self, file_id: str, tenant: str, purpose: str, filename: str, size: int,
                       created_at: int) -> Json:
        """Keep a file whose content (``size`` bytes) the file store has committed."""
        async with asyncio.timeout(self.timeout_s):
            seq = await self._client.incr(self._key("seq"))
        pipe = self._client.pipeline(transaction=True)
        pipe.hset(self._key("file", file_id), mapping={"tenant": tenant, "purpose": purpose, "filename": filename,
                                                       "bytes": size, "created_at": created_at})
        pipe.zadd(self._key("files", tenant), {file_id: seq})
        await self._run(pipe)
        return file_object(file_id, purpose, filename, size, created_at)

    async def file(self, tenant: str, file_id: str) -> Json | None:
        async with asyncio.timeout(self.timeout_s):
            found = await self._client.hgetall(self._key("file", file_id))
        return _file(file_id, found, tenant)

    async def files(self, tenant: str, after: str | None, limit: int, ascending: bool,
                    purpose: str | None) -> tuple[list[Json], bool]:
        """A page of ``tenant``'s files, newest first unless ``ascending``; and whether more follow."""
        index = self._key("files", tenant)
        low, high = "-inf", "+inf"
        if after is not None:
            async with asyncio.timeout(self.timeout_s):
                score = await self._client.zscore(index, after)
            if score is None:
                return [], False
            low, high = (f"({score}", "+inf") if ascending else ("-inf", f"({score}")
        found: list[Json] = []
        offset = 0
        while len(found) <= limit:
            async with asyncio.timeout(self.timeout_s):
                if ascending:
                    ids = await self._client.zrangebyscore(index, low, high, start=offset, num=CHUNK)
                else:
                    ids = await self._client.zrevrangebyscore(index, high, low, start=offset, num=CHUNK)
            if not ids:
                break
            offset += len(ids)
            pipe = self._client.pipeline(transaction=False)
            for file_id in ids:
                pipe.hgetall(self._key("file", _text(file_id)))
            for file_id, fields in zip(ids, await self._run(pipe), strict=True):
                item = _file(_text(file_id), fields, tenant)
                if item is not None and (purpose is None or item["purpose"] == purpose):
                    found.append(item)
        return found[:limit], len(found) > limit

    async def delete_file(self, tenant: str, file_id: str) -> bool:
        """The content first, then the records: a file store away leaves both."""
        if await self.file(tenant, file_id) is None:
            return False
        await asyncio.to_thread(self.contents.delete, file_id)
        pipe = self._client.pipeline(transaction=True)
        pipe.delete(self._key("file", file_id))
        pipe.zrem(self._key("files", tenant), file_id)
        await self._run(pipe)
        return True

    # --- batches --------------------------------------------------------------------------------

    async def add_batch(self, tenant: str, doc: Json) -> None:
        async with asyncio.timeout(self.timeout_s):
            seq = await self._client.incr(self._key("seq"))
        fields: dict[Any, Any] = {name: json.dumps(value) for name, value in doc.items()
                                  if name not in ("status", "request_counts")}
        pipe = self._client.pipeline(transaction=True)
        pipe.hset(self._key("batch", doc["id"]), mapping={**fields, "_status": doc["status"], "_tenant": tenant,
                                                          "_seq": seq})
        pipe.zadd(self._key("batches", tenant), {doc["id"]: seq})
        pipe.zadd(self._key("active"), {doc["id"]: seq})
        pipe.hincrby(self._key("statuses"), doc["status"], 1)
        await self._run(pipe)

    async def batch(self, batch_id: str) -> Batch | None:
        async with asyncio.timeout(self.timeout_s):
            fields = await self._client.hgetall(self._key("batch", batch_id))
        return _batch(fields)

    async def tenants_batch(self, tenant: str, batch_id: str) -> Json | None:
        found = await self.batch(batch_id)
        return None if found is None or found.tenant != tenant else found.doc

    async def batches(self, tenant: str, after: str | None, limit: int) -> tuple[list[Json], bool]:
        """A page of ``tenant``'s batches, newest first; and whether more follow."""
        index, high = self._key("batches", tenant), "+inf"
        if after is not None:
            async with asyncio.timeout(self.timeout_s):
                score = await self._client.zscore(index, after)
            if score is None:
                return [], False
            high = f"({score}"
        async with asyncio.timeout(self.timeout_s):
            ids: list[Any] = await self._client.zrevrangebyscore(index, high, "-inf", start=0, num=limit + 1)
        found = await self._docs(_text(i) for i in ids)
        return [b.doc for b in found[:limit]], len(ids) > limit

    async def _docs(self, ids: Iterable[str]) -> list[Batch]:
        pipe = self._client.pipeline(transaction=False)
        for batch_id in ids:
            pipe.hgetall(self._key("batch", batch_id))
        return [b for b in map(_batch, await self._run(pipe)) if b is not None]

    async def active(self, limit: int | None = None) -> list[Batch]:
        """The batches not final, oldest first (up to ``limit``)."""
        async with asyncio.timeout(self.timeout_s):
            ids: list[Any] = await self._client.zrange(self._key("active"), 0, -1 if limit is None else limit - 1)
        return await self._docs(_text(i) for i in ids)

    async def counts_by_status(self) -> dict[str, int]:
        async with asyncio.timeout(self.timeout_s):
            counts = await self._client.hgetall(self._key("statuses"))
        return {_text(status): int(count) for status, count in counts.items()}

    async def move(self, batch_id: str, from_: Iterable[str], to: str, **fields: Any) -> bool:
        """The batch to ``to`` with ``fields`` (OpenAI's, as values) if its status is one of ``from_``."""
        answer = await self.call("move", id=batch_id, **{"from": list(from_)}, to=to, fields=_stored(fields))
        moved: bool = answer["moved"]
        return moved

    async def cancel(self, batch_id: str, now: int) -> Json:
        await self.move(batch_id, ("validating", "in_progress"), "cancelling", cancelling_at=now)
        found = await self.batch(batch_id)
        assert found is not None
        return found.doc

    # --- lines ----------------------------------------------------------------------------------

    async def put_lines(self, batch_id: str, lines: list[tuple[int, str]], bad: list[tuple[int, str]]) -> bool:
        """The validated lines to send (index, the line as the runner reads it) and the bad ones' outcomes.

        False, writing nothing, when the batch is no longer validating: the lines of a batch in progress
        (another instance validated it while this one's lock had lapsed) are never dropped.
        """
        if not (await self.call("drop", id=batch_id, when=["validating"]))["dropped"]:
            return False
        for start in range(0, max(len(lines), len(bad)), CHUNK):
            pipe = self._client.pipeline(transaction=False)
            chunk, failed = lines[start:start + CHUNK], bad[start:start + CHUNK]
            if chunk:
                pipe.hset(self._key("b", batch_id, "line"), mapping=dict(chunk))
                pipe.zadd(self._key("b", batch_id, "todo"), {str(index): index for index, _ in chunk})
            if failed:
                pipe.hset(self._key("b", batch_id, "result"), mapping=dict(failed))
            await self._run(pipe)
        return True

    async def results(self, batch_id: str, start: int, stop: int) -> list[tuple[str | None, str | None]]:
        """Lines ``start`` to ``stop - 1``: each one's outcome (None: none recorded) and its line (None: a bad one)."""
        indices = [str(i) for i in range(start, stop)]
        pipe = self._client.pipeline(transaction=False)
        pipe.hmget(self._key("b", batch_id, "result"), indices)
        pipe.hmget(self._key("b", batch_id, "line"), indices)
        outcomes, lines = await self._run(pipe)
        return [(None if o is None else _text(o), None if x is None else _text(x)) for o, x in zip(outcomes, lines,
                                                                                                  strict=True)]


class ClusterBooks:
    """The cluster's books for the API (``books.Books``): Redis failures answer 503."""

    def __init__(self, state: ClusterState, clock: Callable[[], float] = time.time) -> None:
        self._state, self._clock = state, clock

    async def add_file(self, file_id: str, tenant: str, purpose: str, filename: str, size: int,
                       created_at: int) -> Json:
        with _answering():
            return await self._state.add_file(file_id, tenant, purpose, filename, size, created_at)

    async def file(self, tenant: str, file_id: str) -> Json | None:
        with _answering():
            return await self._state.file(tenant, file_id)

    async def files(self, tenant: str, after: str | None, limit: int, ascending: bool,
                    purpose: str | None) -> tuple[list[Json], bool]:
        with _answering():
            return await self._state.files(tenant, after, limit, ascending, purpose)

    async def delete_file(self, tenant: str, file_id: str) -> bool:
        with _answering():
            return await self._state.delete_file(tenant, file_id)

    async def create_batch(self, tenant: str, doc: Json) -> None:
        """Kept in Redis; every instance's runner finds it there (the next heartbeat at most)."""
        with _answering():
            await self._state.add_batch(tenant, doc)

    async def batch(self, tenant: str, batch_id: str) -> Json | None:
        with _answering():
            return await self._state.tenants_batch(tenant, batch_id)

    async def batches(self, tenant: str, after: str | None, limit: int) -> tuple[list[Json], bool]:
        with _answering():
            return await self._state.batches(tenant, after, limit)

    async def cancel(self, batch_id: str) -> Json:
        """``cancelling`` in Redis: each instance running its lines cuts them at its next look."""
        with _answering():
            return await self._state.cancel(batch_id, int(self._clock()))


@contextlib.contextmanager
def _answering() -> Iterator[None]:
    """A Redis failure inside becomes the API's 503 (BooksUnavailable), saying why."""
    try:
        yield
    except FAILURES as exc:
        raise BooksUnavailable(str(exc) or type(exc).__name__) from exc


def _text(value: Any) -> str:
    """A Redis reply as text (the client answers bytes)."""
    return value.decode() if isinstance(value, bytes) else str(value)


def _stored(fields: dict[str, Any]) -> dict[str, str]:
    """OpenAI's fields as the batch's hash keeps them (JSON text); the internal ``_`` ones as they are."""
    return {name: str(value) if name.startswith("_") else json.dumps(value) for name, value in fields.items()}


def _file(file_id: str, fields: dict[Any, Any], tenant: str) -> Json | None:
    found = {_text(k): _text(v) for k, v in fields.items()}
    if found.get("tenant") != tenant:
        return None
    return file_object(file_id, found["purpose"], found["filename"], int(found["bytes"]), int(found["created_at"]))


def _batch(fields: dict[Any, Any]) -> Batch | None:
    if not fields:
        return None
    found = {_text(k): _text(v) for k, v in fields.items()}
    doc: Json = {name: json.loads(value) for name, value in found.items() if name not in _INTERNAL}
    doc["status"] = found["_status"]
    doc["request_counts"] = {"total": int(found.get("_total", 0)), "completed": int(found.get("_completed", 0)),
                             "failed": int(found.get("_failed", 0))}
    return Batch(doc, found["_tenant"], "_expired" in found)
