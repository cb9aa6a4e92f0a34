"""Where one instance's batches live: SQLite for their state and each line's outcome, a file store for the contents.

One owner of batch state (the runner and the API both go through it). The
rules that make a restart lose and duplicate nothing:

* a line's outcome and the batch's counts change in one transaction, and
  only while the line is still pending (:meth:`LocalStore.record` returns False
  for a line already recorded), so an answer is counted once however often
  the line was sent;
* a file's content is committed to the file store (``files.py``: whole or not
  at all) before its row is committed: a row always has its whole content;
* the output and error files are rebuilt from the recorded outcomes when a
  batch finalizes, under ids fixed by the batch, so a finalization cut short
  is redone identically.

WAL with ``synchronous=NORMAL``: a commit survives the process's crash (what
a restart needs); a power cut may lose the last commits, which then run again.
Calls are short and made on the event loop, except the large ones (a batch's
lines in, its files out), which the runner makes in a thread: one connection,
serialised by a lock.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from extproc.adapters.batches.files import FileStore
from extproc.adapters.batches.lines import Line, LineError
from extproc.adapters.batches.shapes import ACTIVE, Json, file_object, output_line, request_id

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT NULL, tenant TEXT NOT NULL,
    purpose TEXT NOT NULL, filename TEXT NOT NULL, bytes INTEGER NOT NULL, created_at INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS batches (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT NULL, tenant TEXT NOT NULL,
    status TEXT NOT NULL, doc TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS lines (
    batch_id TEXT NOT NULL, idx INTEGER NOT NULL, custom_id TEXT, body BLOB,
    state INTEGER NOT NULL, result TEXT, PRIMARY KEY (batch_id, idx));
"""
# A line's state: to be sent, or its outcome recorded (in the output file, or the error file).
PENDING, DONE, FAILED = 0, 1, 2
# Validated lines written per transaction.
PUT_CHUNK = 1000


@dataclass(frozen=True)
class Pending:
    index: int
    custom_id: str
    body: bytes


class LocalStore:
    """The SQLite database under ``directory`` (created if missing), and the files' contents in ``contents``."""

    def __init__(self, directory: str | Path, contents: FileStore) -> None:
        self.directory, self.contents = Path(directory), contents
        self.directory.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.directory / "batches.sqlite3", check_same_thread=False, isolation_level=None)
        self._lock = threading.Lock()
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _tx(self) -> _Transaction:
        return _Transaction(self._db, self._lock)

    # --- files ----------------------------------------------------------------------------------

    def add_file(self, file_id: str, tenant: str, purpose: str, filename: str, size: int, created_at: int) -> Json:
        """Commit a file whose content of ``size`` bytes the file store holds already."""
        with self._tx() as db:
            db.execute("INSERT OR REPLACE INTO files (id, tenant, purpose, filename, bytes, created_at) "
                       "VALUES (?, ?, ?, ?, ?, ?)", (file_id, tenant, purpose, filename, size, created_at))
        return file_object(file_id, purpose, filename, size, created_at)

    def file(self, tenant: str, file_id: str) -> Json | None:
        with self._tx() as db:
            row = db.execute("SELECT id, purpose, filename, bytes, created_at FROM files WHERE id = ? AND tenant = ?",
                             (file_id, tenant)).fetchone()
        return None if row is None else file_object(*row)

    def files(self, tenant: str, after: str | None, limit: int, ascending: bool, purpose: str | None) -> tuple[list[Json], bool]:
        """A page of ``tenant``'s files, newest first unless ``ascending``; and whether more follow."""
        order, cmp = ("ASC", ">") if ascending else ("DESC", "<")
        query = "SELECT id, purpose, filename, bytes, created_at FROM files WHERE tenant = ?"
        args: list[Any] = [tenant]
        if purpose is not None:
            query += " AND purpose = ?"
            args.append(purpose)
        if after is not None:
            query += f" AND seq {cmp} (SELECT seq FROM files WHERE id = ? AND tenant = ?)"  # unknown: none
            args += [after, tenant]
        with self._tx() as db:
            rows = db.execute(f"{query} ORDER BY seq {order} LIMIT ?", (*args, limit + 1)).fetchall()
        return [file_object(*row) for row in rows[:limit]], len(rows) > limit

    def delete_file(self, tenant: str, file_id: str) -> bool:
        """The content first (blocking: called in a thread), then the row: a store away leaves both."""
        if self.file(tenant, file_id) is None:
            return False
        self.contents.delete(file_id)
        with self._tx() as db:
            db.execute("DELETE FROM files WHERE id = ? AND tenant = ?", (file_id, tenant))
        return True

    # --- batches --------------------------------------------------------------------------------

    def add_batch(self, tenant: str, doc: Json) -> None:
        with self._tx() as db:
            db.execute("INSERT INTO batches (id, tenant, status, doc) VALUES (?, ?, ?, ?)",
                       (doc["id"], tenant, doc["status"], json.dumps(doc)))

    def batch(self, batch_id: str, tenant: str | None = None) -> Json | None:
        """The batch (``tenant``'s only, when given)."""
        with self._tx() as db:
            row = db.execute("SELECT doc, tenant FROM batches WHERE id = ?", (batch_id,)).fetchone()
        if row is None or (tenant is not None and row[1] != tenant):
            return None
        doc: Json = json.loads(row[0])
        return doc

    def tenant_of(self, batch_id: str) -> str:
        with self._tx() as db:
            tenant: str = db.execute("SELECT tenant FROM batches WHERE id = ?", (batch_id,)).fetchone()[0]
        return tenant

    def batches(self, tenant: str, after: str | None, limit: int) -> tuple[list[Json], bool]:
        """A page of ``tenant``'s batches, newest first; and whether more follow."""
        query, args = "SELECT doc FROM batches WHERE tenant = ?", [tenant]
        if after is not None:
            query += " AND seq < (SELECT seq FROM batches WHERE id = ? AND tenant = ?)"  # unknown: none
            args += [after, tenant]
        with self._tx() as db:
            rows = db.execute(f"{query} ORDER BY seq DESC LIMIT ?", (*args, limit + 1)).fetchall()
        return [json.loads(row[0]) for row in rows[:limit]], len(rows) > limit

    def active(self) -> list[str]:
        """The batches a runner must carry on with, oldest first (after a restart: all that were running)."""
        marks = ",".join("?" * len(ACTIVE))
        with self._tx() as db:
            return [row[0] for row in db.execute(f"SELECT id FROM batches WHERE status IN ({marks}) ORDER BY seq", ACTIVE)]

    def progress(self, now: float, limit: int) -> list[Json]:
        """Up to ``limit`` active batches, oldest first: who, what, how far, how fast since they began."""
        marks = ",".join("?" * len(ACTIVE))
        with self._tx() as db:
            rows = db.execute(f"SELECT tenant, doc FROM batches WHERE status IN ({marks}) ORDER BY seq LIMIT ?",
                              (*ACTIVE, limit)).fetchall()
        found = []
        for tenant, text in rows:
            doc = json.loads(text)
            counts, began = doc["request_counts"], doc["in_progress_at"]
            rate = None if began is None else counts["completed"] / max(1.0, now - began)
            found.append({"id": doc["id"], "tenant": tenant, "status": doc["status"], "model": doc["model"],
                          **counts, "lines_per_s": rate})
        return found

    def counts_by_status(self) -> dict[str, int]:
        with self._tx() as db:
            return dict(db.execute("SELECT status, COUNT(*) FROM batches GROUP BY status").fetchall())

    def update(self, batch_id: str, **changes: Any) -> Json:
        """Change fields of the batch (``status`` too); returns the batch as now stored."""
        with self._tx() as db:
            return _update(db, batch_id, changes)

    def cancel(self, batch_id: str, now: int) -> Json:
        """``cancelling`` if the batch is still validating or in progress; otherwise unchanged."""
        with self._tx() as db:
            doc = _doc(db, batch_id)
            if doc["status"] in ("validating", "in_progress"):
                doc = _update(db, batch_id, {"status": "cancelling", "cancelling_at": now})
            return doc

    # --- lines ----------------------------------------------------------------------------------

    def put_lines(self, batch_id: str, items: Iterable[Line | LineError]) -> tuple[int, int]:
        """The validated lines in (pending), the bad ones recorded failed at once; (valid, bad) counted.

        In transactions of ``PUT_CHUNK`` lines, so the lock is never held for a whole file: the batch stays
        ``validating`` until :meth:`begin`, and a validation cut short is redone from scratch.
        """
        self.drop_lines(batch_id)
        valid = bad = 0
        rows: list[tuple[Any, ...]] = []
        for item in items:
            if isinstance(item, Line):
                rows.append((batch_id, item.index, item.custom_id, item.body, PENDING, None))
                valid += 1
            else:
                error = json.dumps({"error": {"code": item.code, "message": item.message}})
                rows.append((batch_id, item.index, item.custom_id, None, FAILED, error))
                bad += 1
            if len(rows) == PUT_CHUNK:
                self._put(rows)
                rows = []
        self._put(rows)
        return valid, bad

    def _put(self, rows: list[tuple[Any, ...]]) -> None:
        with self._tx() as db:
            db.executemany("INSERT INTO lines (batch_id, idx, custom_id, body, state, result) VALUES (?, ?, ?, ?, ?, ?)",
                           rows)

    def drop_lines(self, batch_id: str) -> None:
        with self._tx() as db:
            db.execute("DELETE FROM lines WHERE batch_id = ?", (batch_id,))

    def begin(self, batch_id: str, model: str | None, valid: int, bad: int, now: int) -> Json:
        """The batch ``in_progress`` with its counts (the bad lines failed already); a cancelled one stays cancelling."""
        with self._tx() as db:
            status = "cancelling" if _doc(db, batch_id)["status"] == "cancelling" else "in_progress"
            return _update(db, batch_id, {"status": status, "in_progress_at": now, "model": model,
                                          "request_counts": {"total": valid + bad, "completed": 0, "failed": bad}})

    def pending(self, batch_id: str, after: int, limit: int) -> list[Pending]:
        """Up to ``limit`` pending lines after index ``after``, in file order."""
        with self._tx() as db:
            rows = db.execute("SELECT idx, custom_id, body FROM lines WHERE batch_id = ? AND state = ? AND idx > ? "
                              "ORDER BY idx LIMIT ?", (batch_id, PENDING, after, limit)).fetchall()
        return [Pending(*row) for row in rows]

    def remaining(self, batch_id: str) -> int:
        with self._tx() as db:
            left: int = db.execute("SELECT COUNT(*) FROM lines WHERE batch_id = ? AND state = ?",
                                   (batch_id, PENDING)).fetchone()[0]
        return left

    def record(self, batch_id: str, index: int, ok: bool, result: Json) -> bool:
        """A line's outcome and the batch's count, once: False if the line was already recorded."""
        with self._tx() as db:
            changed = db.execute("UPDATE lines SET state = ?, result = ?, body = NULL "
                                 "WHERE batch_id = ? AND idx = ? AND state = ?",
                                 (DONE if ok else FAILED, json.dumps(result), batch_id, index, PENDING)).rowcount
            if changed:
                doc = _doc(db, batch_id)
                counts = dict(doc["request_counts"])
                counts["completed" if ok else "failed"] += 1
                _update(db, batch_id, {"request_counts": counts}, doc)
        return changed == 1

    def finalize(self, batch_id: str, tenant: str, unfinished: Json | None, now: int) -> Json:
        """The output and error files from the recorded outcomes; lines not run get ``unfinished`` as their error.

        Returns the changes to make to the batch (its files, its final counts);
        the caller sets the final status with them.
        """
        suffix = batch_id.removeprefix("batch_")
        completed = failed = 0
        usage = Usage()
        out_id, err_id = f"file-{suffix}o", f"file-{suffix}e"
        with self.contents.create(out_id) as output, self.contents.create(err_id) as errors:
            for index, custom_id, state, result in self._outcomes(batch_id):
                if state == PENDING:
                    if unfinished is None:
                        raise RuntimeError(f"{batch_id}: line {index} has no outcome at finalization")
                    entry, state = {"error": unfinished}, FAILED
                else:
                    entry = json.loads(result)
                line = output_line(request_id(batch_id, index), custom_id, entry.get("response"), entry.get("error"))
                (output if state == DONE else errors).write(json.dumps(line).encode() + b"\n")
                if state == DONE:
                    usage.add(entry["response"]["body"])
                completed += state == DONE
                failed += state == FAILED
            changes: Json = {"request_counts": {"total": completed + failed, "completed": completed, "failed": failed},
                             "output_file_id": None, "error_file_id": None, "usage": usage.batch_usage()}
            for key, written, file_id, name in (("output_file_id", output, out_id, f"{batch_id}_output.jsonl"),
                                                ("error_file_id", errors, err_id, f"{batch_id}_error.jsonl")):
                if written.size:
                    self.add_file(file_id, tenant, "batch_output", name, written.commit(), now)
                    changes[key] = file_id
                else:
                    written.abort()
        return changes

    def _outcomes(self, batch_id: str) -> Iterator[tuple[int, str | None, int, str]]:
        """Every line's (index, custom_id, state, result), in file order, read in chunks."""
        after = -1
        while True:
            with self._tx() as db:
                rows = db.execute("SELECT idx, custom_id, state, result FROM lines WHERE batch_id = ? AND idx > ? "
                                  "ORDER BY idx LIMIT 1000", (batch_id, after)).fetchall()
            if not rows:
                return
            yield from rows
            after = rows[-1][0]


class Usage:
    """The tokens of a batch's completed lines, summed from each response's ``usage`` (OpenAI's ``Batch.usage``)."""

    def __init__(self) -> None:
        self.input = self.cached = self.output = self.reasoning = 0

    def add(self, body: Any) -> None:
        usage = body.get("usage") if isinstance(body, dict) else None
        if not isinstance(usage, dict):
            return
        self.input += _tokens(usage, "prompt_tokens")
        self.output += _tokens(usage, "completion_tokens")
        self.cached += _tokens(usage.get("prompt_tokens_details"), "cached_tokens")
        self.reasoning += _tokens(usage.get("completion_tokens_details"), "reasoning_tokens")

    def batch_usage(self) -> Json:
        return {"input_tokens": self.input, "input_tokens_details": {"cached_tokens": self.cached},
                "output_tokens": self.output, "output_tokens_details": {"reasoning_tokens": self.reasoning},
                "total_tokens": self.input + self.output}


def _tokens(part: Any, key: str) -> int:
    """A token count an engine wrote (a whole number >= 0), else 0."""
    value = part.get(key) if isinstance(part, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


class _Transaction:
    """The lock held and one transaction open: committed on success, rolled back on an exception."""

    def __init__(self, db: sqlite3.Connection, lock: threading.Lock) -> None:
        self._db, self._lock = db, lock

    def __enter__(self) -> sqlite3.Connection:
        self._lock.acquire()
        self._db.execute("BEGIN IMMEDIATE")
        return self._db

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        try:
            self._db.execute("COMMIT" if exc_type is None else "ROLLBACK")
        finally:
            self._lock.release()


def _doc(db: sqlite3.Connection, batch_id: str) -> Json:
    doc: Json = json.loads(db.execute("SELECT doc FROM batches WHERE id = ?", (batch_id,)).fetchone()[0])
    return doc


def _update(db: sqlite3.Connection, batch_id: str, changes: Json, doc: Json | None = None) -> Json:
    doc = {**(doc if doc is not None else _doc(db, batch_id)), **changes}
    db.execute("UPDATE batches SET status = ?, doc = ? WHERE id = ?", (doc["status"], json.dumps(doc), batch_id))
    return doc
