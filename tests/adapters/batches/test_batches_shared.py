"""A cluster's batch state in a real Redis (``adapters/batches/cluster_store.py`` and ``shared.lua``), two instances by name.

The rules that keep a line from running or counting twice, each step as
the runners make it: a line is leased to one instance at a time and comes
back when its lease lapses or is released; an outcome is recorded once, and
not at all once the batch stopped running; a batch in progress never loses
its lines to a validation redone; the API's reads are each tenant's own.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from extproc.adapters.batches.cluster_store import ClusterState
from extproc.adapters.batches.files import DirectoryFiles
from extproc.adapters.batches.shapes import batch_object
from tests.redisutil import RedisServer

pytestmark = pytest.mark.integration

LEASE_MS = 300
TOKENS = itertools.count()


@pytest.fixture
async def state(redis_server: RedisServer, tmp_path: Path) -> AsyncIterator[ClusterState]:
    client = aioredis.from_url(redis_server.url)
    yield ClusterState(client, "t", 1.0, DirectoryFiles(tmp_path))
    await client.aclose()


async def in_progress(state: ClusterState, lines: int) -> str:
    """A batch of bob's, validated with ``lines`` lines, in progress."""
    doc = batch_object("batch_x", "/v1/chat/completions", "file-in", "24h", 0, 10**10, None)
    await state.add_batch("bob", doc)
    assert await state.put_lines("batch_x", [(i, json.dumps([f"c{i}", 0, 1])) for i in range(lines)], [])
    await state.call("begin", id="batch_x", total=lines, bad=0, fields={"in_progress_at": "1"})
    return "batch_x"


async def claim(state: ClusterState, batch_id: str, me: str, n: int) -> list[int]:
    answer = await state.call("claim", id=batch_id, me=me, n=n, lease_ms=LEASE_MS)
    return [int(index) for index, _ in answer["lines"] or []]


async def renew(state: ClusterState, batch_id: str, me: str, held: list[int]) -> list[int]:
    """The lines of ``held`` that are no longer ``me``'s."""
    answer = await state.call("renew", id=batch_id, me=me, held=held, lease_ms=LEASE_MS)
    return [int(index) for index in answer["lost"] or []]  # cjson writes an empty list as an object


async def record(state: ClusterState, batch_id: str, index: int, token: str = "") -> str:
    """``token``: the attempt's (each attempt its own unless given)."""
    answer = await state.call("record", id=batch_id, index=index, ok=True, result=json.dumps({"ok": True}),
                              token=token or f"t{next(TOKENS)}")
    outcome: str = answer["outcome"]
    return outcome


async def test_a_line_is_leased_to_one_instance_until_its_lease_lapses_or_is_released(state: ClusterState) -> None:
    batch_id = await in_progress(state, 4)
    assert await claim(state, batch_id, "a", 2) == [0, 1]
    assert await claim(state, batch_id, "b", 5) == [2, 3]  # in file order, none twice
    assert await claim(state, batch_id, "b", 5) == []
    await state.call("release", id=batch_id, me="b", held=[3])  # b stopped: line 3 back at once
    assert await renew(state, batch_id, "a", [0, 1, 3]) == [3]
    assert await claim(state, batch_id, "a", 5) == [3]
    await asyncio.sleep(LEASE_MS / 1000 + 0.1)  # nobody renewed: every lease lapses
    assert await renew(state, batch_id, "b", [2]) == []  # late, but nobody took line 2 meanwhile: still b's
    assert sorted(await claim(state, batch_id, "a", 5)) == [0, 1, 3]  # the lapsed ones, a's own included


async def test_an_outcome_is_recorded_once_and_only_while_the_batch_runs(state: ClusterState) -> None:
    batch_id = await in_progress(state, 3)
    assert await claim(state, batch_id, "a", 3) == [0, 1, 2]
    await asyncio.sleep(LEASE_MS / 1000 + 0.1)
    assert await claim(state, batch_id, "b", 1) == [0]  # a's lease lapsed: b sends line 0 too
    assert [await record(state, batch_id, 0), await record(state, batch_id, 0)] == ["recorded", "duplicate"]
    # One attempt's record sent again (its answer lost to a timeout) is its own, not a duplicate: counted once.
    assert [await record(state, batch_id, 1, "mine"), await record(state, batch_id, 1, "mine")] == ["recorded"] * 2
    assert await claim(state, batch_id, "b", 5) == [2]
    assert not (await state.call("done", id=batch_id, fields={}))["moved"]  # line 2 still leased
    assert await state.move(batch_id, ("in_progress",), "cancelling", cancelling_at=5)
    assert await record(state, batch_id, 2) == "closed"  # the files are being written from what is recorded
    found = await state.batch(batch_id)
    assert found is not None and found.doc["request_counts"] == {"total": 3, "completed": 2, "failed": 0}
    assert (found.doc["status"], found.doc["cancelling_at"]) == ("cancelling", 5)
    assert await claim(state, batch_id, "a", 5) == []


async def test_a_batch_in_progress_never_loses_its_lines_to_a_validation_redone(state: ClusterState) -> None:
    batch_id = await in_progress(state, 2)
    assert await record(state, batch_id, 0) == "recorded"
    assert not await state.put_lines(batch_id, [(0, "x")], [])  # another instance's late validation: refused
    assert [outcome is not None for outcome, _ in await state.results(batch_id, 0, 2)] == [True, False]
    assert not (await state.call("drop", id=batch_id, when=["validating"]))["dropped"]


async def test_each_tenant_reads_and_lists_its_own_and_the_statuses_are_counted(state: ClusterState,
                                                                               tmp_path: Path) -> None:
    batch_id = await in_progress(state, 1)
    assert await state.tenants_batch("alice", batch_id) is None
    assert (await state.tenants_batch("bob", batch_id) or {})["status"] == "in_progress"
    for name in ("f1", "f2"):
        with state.contents.create(name) as written:
            written.write(b"{}\n")
            await state.add_file(name, "bob", "batch", f"{name}.jsonl", written.commit(), 1)
    assert await state.file("alice", "f1") is None and await state.files("alice", None, 10, False, None) == ([], False)
    page, more = await state.files("bob", None, 1, False, None)
    assert [f["id"] for f in page] == ["f2"] and more
    page, more = await state.files("bob", "f2", 10, False, None)
    assert [f["id"] for f in page] == ["f1"] and not more
    assert not await state.delete_file("alice", "f1") and await state.delete_file("bob", "f1")
    assert [b["id"] for b in (await state.batches("bob", None, 10))[0]] == [batch_id]
    assert await state.counts_by_status() == {"validating": 0, "in_progress": 1}
    assert [b.doc["id"] for b in await state.active()] == [batch_id]
