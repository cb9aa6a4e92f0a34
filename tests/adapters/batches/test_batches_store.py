"""The store's rules that make a restart lose and duplicate nothing (store.py's docstring)."""

from __future__ import annotations

from pathlib import Path

import pytest

from extproc.adapters.batches.files import DirectoryFiles
from extproc.adapters.batches.lines import Line, LineError
from extproc.adapters.batches.local_store import LocalStore
from extproc.adapters.batches.shapes import batch_object

pytestmark = pytest.mark.unit

OK = {"response": {"status_code": 200, "request_id": "r", "body": {"ok": True}}, "error": None}


def started(tmp_path: Path, lines: int = 4) -> LocalStore:
    store = LocalStore(tmp_path, DirectoryFiles(tmp_path / "files"))
    store.add_batch("bob", batch_object("batch_x", "/v1/chat/completions", "file-in", "24h", 0, 100, None))
    items: list[Line | LineError] = [Line(i, f"c{i}", b"{}") for i in range(lines)]
    items.insert(1, LineError(lines, None, "invalid_json_line", "bad"))
    assert store.put_lines("batch_x", items) == (lines, 1)
    store.begin("batch_x", "m1", lines, 1, 1)
    return store


def content(store: LocalStore, file_id: str) -> bytes:
    with store.contents.open(file_id) as source:
        return source.read()


def test_an_outcome_counts_once_however_often_the_line_was_answered(tmp_path: Path) -> None:
    store = started(tmp_path)
    assert store.record("batch_x", 2, True, OK)
    assert not store.record("batch_x", 2, False, OK)  # sent again after a restart: the first answer stands
    batch = store.batch("batch_x")
    assert batch is not None and batch["request_counts"] == {"total": 5, "completed": 1, "failed": 1}
    assert [p.index for p in store.pending("batch_x", -1, 10)] == [0, 1, 3]
    assert store.remaining("batch_x") == 3


def test_a_validation_redone_replaces_the_lines_and_a_finalization_redone_is_the_same(tmp_path: Path) -> None:
    store = started(tmp_path)
    assert store.put_lines("batch_x", [Line(0, "c0", b"{}"), Line(1, "c1", b"{}")]) == (2, 0)
    store.begin("batch_x", "m1", 2, 0, 1)
    for index in (0, 1):
        store.record("batch_x", index, index == 0, OK)
    first = store.finalize("batch_x", "bob", None, 2)
    contents = [content(store, first[k]) for k in ("output_file_id", "error_file_id")]
    again = store.finalize("batch_x", "bob", None, 3)
    assert again == first and [content(store, again[k]) for k in ("output_file_id", "error_file_id")] == contents
    assert first["request_counts"] == {"total": 2, "completed": 1, "failed": 1}
    files, more = store.files("bob", None, 10, True, "batch_output")
    assert len(files) == 2 and not more


def test_state_survives_a_new_store_on_the_same_directory(tmp_path: Path) -> None:
    store = started(tmp_path)
    store.record("batch_x", 0, True, OK)
    store.close()
    again = LocalStore(tmp_path, DirectoryFiles(tmp_path / "files"))
    assert again.active() == ["batch_x"]
    assert [p.index for p in again.pending("batch_x", -1, 10)] == [1, 2, 3]
    assert again.batch("batch_x", "alice") is None and again.batch("batch_x", "bob") is not None


def test_pages_follow_after_and_an_unknown_after_gives_none(tmp_path: Path) -> None:
    store = LocalStore(tmp_path, DirectoryFiles(tmp_path / "files"))
    for i in range(3):
        store.add_batch("bob", batch_object(f"batch_{i}", "/v1/chat/completions", "file-in", "24h", i, 100, None))
    assert [b["id"] for b in store.batches("bob", None, 2)[0]] == ["batch_2", "batch_1"]
    assert store.batches("bob", "batch_1", 2) == ([store.batch("batch_0")], False)
    assert store.batches("bob", "batch_9", 2) == ([], False)
    assert store.batches("alice", None, 2) == ([], False)
