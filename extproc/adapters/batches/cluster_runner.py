"""A cluster instance's runner: every active batch's lines, taken from Redis under leases (``cluster_store.py``).

Each instance runs every active batch it finds in Redis (a look each
heartbeat, ``cluster.heartbeat_s``): it claims lines up to its free slots
(``in_flight_per_batch`` of a batch and ``max_in_flight`` in all, on each
instance), sends each through the gateway (``sender.py``) and records the
answer once. Its leases are renewed every heartbeat; a line whose lease was
lost meanwhile (Redis was away longer than ``cluster.lease_s``) is cut, since
another instance runs it now. A batch's validation and finalization are one
instance's at a time (a lock with a lease); the others wait for it.

A stop (SIGTERM) cuts the lines in flight and hands them back at once, so
another instance sends them without waiting for the lease; a crash leaves
them to the lease. Either way the line runs again elsewhere and appears once
in the output (the engine may have begun it twice: the first run was cut).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

from extproc.adapters.batches.cluster_store import FAILURES, Batch, ClusterState
from extproc.adapters.batches.files import FilesUnavailable, Writer
from extproc.adapters.batches.lines import Line, LineError, LineLimits, Reading, Unusable, open_input, raw_lines
from extproc.adapters.batches.local_store import Pending, Usage
from extproc.adapters.batches.metrics import BatchMetrics
from extproc.adapters.batches.sender import Sender, decided
from extproc.adapters.batches.shapes import ENDINGS, FINAL, PROGRESS_LISTED, Json, output_line, request_id
from extproc.adapters.config import Config

log = logging.getLogger(__name__)


class ClusterRunner:
    """This instance's share of the cluster's batches."""

    def __init__(self, current: Callable[[], Config], state: ClusterState, metrics: BatchMetrics, instance: str,
                 lease_s: float, heartbeat_s: float, clock: Callable[[], float] = time.time) -> None:
        settings = current().batches
        assert settings is not None
        self._settings, self._state, self._metrics, self._clock = settings, state, metrics, clock
        self._me, self._lease_ms, self._heartbeat_s = instance, round(lease_s * 1000), heartbeat_s
        self._sender = Sender(current, settings, metrics)
        self._tasks: dict[str, asyncio.Task[None]] = {}
        # Each batch's lines in flight here, by index.
        self._held: dict[str, dict[int, asyncio.Task[None]]] = {}
        self._wake: dict[str, asyncio.Event] = {}
        self._background: list[asyncio.Task[None]] = []
        # Answers being recorded: not cut with their line (the record may have reached Redis already).
        self._recording: set[asyncio.Task[None]] = set()
        self._progress: list[Json] = []
        self._pending_tenants: set[str] = set()
        self._warned = False

    def start(self) -> None:
        self._sender.start()
        self._background = [asyncio.create_task(self._discover(), name="batches: discover"),
                            asyncio.create_task(self._renew(), name="batches: renew leases")]

    async def stop(self) -> None:
        """Stop every batch where it is; the lines in flight go back to be sent (by another instance, or the next start)."""
        for task in (*self._background, *self._tasks.values()):
            task.cancel()
        await asyncio.gather(*self._background, *self._tasks.values(), return_exceptions=True)
        if self._recording:  # answers being recorded: a lease's time at most (then the line runs again elsewhere)
            _, late = await asyncio.wait(self._recording, timeout=self._lease_ms / 1000)
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)
        await self._sender.close()

    def progress(self) -> list[Json]:
        """The active batches as last read from Redis (the status page): counts and lines per second since they began."""
        return self._progress

    def _trouble(self, exc: BaseException) -> None:
        if not self._warned:
            self._warned = True
            log.warning("batches: Redis unreachable (%s); no line is claimed or recorded until it answers",
                        exc or type(exc).__name__)

    # --- finding the batches ---------------------------------------------------------------------

    async def _discover(self) -> None:
        while True:
            try:
                active = await self._state.active()
                counts = await self._state.counts_by_status()
            except FAILURES as exc:
                self._trouble(exc)
            else:
                if self._warned:
                    self._warned = False
                    log.info("batches: Redis answers again")
                for batch in active:
                    if batch.doc["id"] not in self._tasks:
                        self._run(batch.doc["id"])
                self._metrics.statuses(counts)
                self._seen(active)
            await asyncio.sleep(self._heartbeat_s)

    def _seen(self, active: list[Batch]) -> None:
        now = self._clock()
        progress: list[Json] = []
        pending = dict.fromkeys(self._pending_tenants, 0)
        for batch in active:
            counts, began = batch.doc["request_counts"], batch.doc["in_progress_at"]
            label = self._metrics.tenant(batch.tenant)
            pending[label] = pending.get(label, 0) + counts["total"] - counts["completed"] - counts["failed"]
            if len(progress) < PROGRESS_LISTED:
                rate = None if began is None else counts["completed"] / max(1.0, now - began)
                progress.append({"id": batch.doc["id"], "tenant": batch.tenant, "status": batch.status,
                                 "model": batch.doc["model"], **counts, "lines_per_s": rate})
        for label, count in pending.items():
            self._metrics.pending.labels(tenant=label).set(count)
        self._pending_tenants = set(pending)
        self._progress = progress

    def _run(self, batch_id: str) -> None:
        self._held[batch_id] = {}
        self._wake[batch_id] = asyncio.Event()
        task = asyncio.create_task(self._batch(batch_id), name=f"batch {batch_id}")
        self._tasks[batch_id] = task

        def ended(_: asyncio.Task[None]) -> None:
            self._tasks.pop(batch_id, None)
            self._held.pop(batch_id, None)
            self._wake.pop(batch_id, None)

        task.add_done_callback(ended)

    # --- one batch -------------------------------------------------------------------------------

    async def _batch(self, batch_id: str) -> None:
        held = self._held[batch_id]
        files_away = False
        try:
            while True:
                try:
                    if not await self._step(batch_id, held):
                        return
                    if files_away:
                        files_away = False
                        log.info("batch %s: the file store answers again", batch_id)
                except FAILURES as exc:
                    self._trouble(exc)
                    await asyncio.sleep(self._heartbeat_s)
                except FilesUnavailable as exc:  # the step is redone whole at the next look
                    if not files_away:
                        files_away = True
                        log.warning("batch %s: the file store is unreachable (%s); its validation, new lines and "
                                    "finalization wait for it", batch_id, exc)
                    await asyncio.sleep(self._heartbeat_s)
                except Exception:
                    log.exception("batch %s: the runner failed; it tries again in a heartbeat", batch_id)
                    await asyncio.sleep(self._heartbeat_s)
        finally:  # stopped: what is in flight here goes back at once
            await self._cut(batch_id, held, hand_back=True)

    async def _step(self, batch_id: str, held: dict[int, asyncio.Task[None]]) -> bool:
        """One look at the batch and what it needs from this instance; False once it is final."""
        batch = await self._state.batch(batch_id)
        if batch is None or batch.status in FINAL:
            return False
        doc = batch.doc
        if batch.status == "validating":  # its window is looked at once it is in progress
            await self._in_turn(batch_id, "validate", lambda: self._validate(batch))
            return True
        if batch.status == "in_progress" and not batch.expired:
            if self._clock() >= doc["expires_at"]:
                await self._state.call("expire", id=batch_id)
                return True
            await self._feed(batch, held)
            return True
        await self._cut(batch_id, held, hand_back=False)  # finalizing, cancelling or expired: no line runs
        await self._in_turn(batch_id, "finalize", lambda: self._finalize(batch))
        return True

    async def _in_turn(self, batch_id: str, what: str, work: Callable[[], Awaitable[None]]) -> None:
        """``work`` if it is this instance's turn to do ``what`` to the batch; else a heartbeat's wait for the next look."""
        async with self._lock(batch_id, what) as mine:
            if mine:
                await work()
                return
        await asyncio.sleep(self._heartbeat_s)

    @contextlib.asynccontextmanager
    async def _lock(self, batch_id: str, what: str) -> AsyncIterator[bool]:
        """This instance's turn to validate or finalize the batch (renewed while it works), or False."""
        answer = await self._state.call("lock", id=batch_id, what=what, me=self._me, lease_ms=self._lease_ms)
        if not answer["held"]:
            yield False
            return

        async def renew() -> None:
            while True:
                await asyncio.sleep(self._heartbeat_s)
                with contextlib.suppress(*FAILURES):
                    await self._state.call("lock", id=batch_id, what=what, me=self._me, lease_ms=self._lease_ms)

        renewing = asyncio.create_task(renew())
        try:
            yield True
        finally:
            renewing.cancel()
            await asyncio.gather(renewing, return_exceptions=True)
            with contextlib.suppress(*FAILURES):
                await self._state.call("unlock", id=batch_id, what=what, me=self._me)

    async def _feed(self, batch: Batch, held: dict[int, asyncio.Task[None]]) -> None:
        """Claim lines up to the free slots, then wait for one to end (or a heartbeat)."""
        batch_id = batch.doc["id"]
        wake = self._wake[batch_id]
        wake.clear()
        free = min(self._settings.in_flight_per_batch - len(held),
                   self._settings.max_in_flight - sum(len(h) for h in self._held.values()))
        claimed: list[list[object]] = []
        if free > 0:
            answer = await self._state.call("claim", id=batch_id, me=self._me, n=free, lease_ms=self._lease_ms)
            claimed = answer["lines"] or []  # cjson writes an empty list as an object
        if claimed:
            try:
                bodies = await asyncio.to_thread(self._bodies, batch_id, claimed)
            except FilesUnavailable:  # handed back at once, not left to their leases
                with contextlib.suppress(*FAILURES):
                    await self._state.call("release", id=batch_id, me=self._me, held=[int(str(i)) for i, _ in claimed])
                raise
            for line in bodies:
                task = asyncio.create_task(self._line(batch, line))
                held[line.index] = task
                task.add_done_callback(_ended(held, line.index, wake))
        elif not held and free > 0:
            done = await self._state.call("done", id=batch_id, fields=_fields(finalizing_at=int(self._clock())))
            if done["moved"]:
                return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self._heartbeat_s):
                await wake.wait()

    def _bodies(self, batch_id: str, claimed: list[list[object]]) -> list[Pending]:
        """The claimed lines' bodies, read from the batch's lines file."""
        where = [json.loads(str(text)) for _, text in claimed]
        bodies = self._state.contents.read_spans(_lines_name(batch_id), [(offset, size) for _, offset, size in where])
        return [Pending(int(str(index)), custom_id, body)
                for (index, _), (custom_id, _, _), body in zip(claimed, where, bodies, strict=True)]

    async def _line(self, batch: Batch, line: Pending) -> None:
        """Send the line until its answer is final, then record it: a cut from then on does not stop the record."""
        ok, result = await self._sender.send(batch.doc["id"], batch.tenant, batch.doc["endpoint"], line)
        recording = asyncio.create_task(self._record(batch, line, ok, result))
        self._recording.add(recording)
        recording.add_done_callback(self._recording.discard)
        await asyncio.shield(recording)

    async def _record(self, batch: Batch, line: Pending, ok: bool, result: Json) -> None:
        """The answer recorded once Redis takes it (the first answer wins), and counted if it was the first."""
        batch_id, tenant = batch.doc["id"], batch.tenant
        stored = json.dumps({"ok": ok, "custom_id": line.custom_id, "entry": result})
        token = uuid.uuid4().hex  # this attempt's: a record sent again after a lost answer is not a duplicate
        while True:
            try:
                answer = await self._state.call("record", id=batch_id, index=line.index, ok=ok, result=stored,
                                                token=token)
                break
            except FAILURES as exc:
                self._trouble(exc)
                await asyncio.sleep(self._heartbeat_s)
        if answer["outcome"] == "recorded":
            label = self._metrics.tenant(tenant)
            self._metrics.lines.labels(tenant=label, outcome="completed" if ok else "failed").inc()
            decided(batch_id, line, tenant, "completed" if ok else f"failed:{result['response']['status_code']}")

    async def _cut(self, batch_id: str, held: dict[int, asyncio.Task[None]], *, hand_back: bool) -> None:
        """End the lines in flight here; ``hand_back``: their leases released so another instance sends them now."""
        if not held:
            return
        indices, tasks = list(held), list(held.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if hand_back:
            with contextlib.suppress(*FAILURES):
                await self._state.call("release", id=batch_id, me=self._me, held=indices)

    async def _renew(self) -> None:
        """Every heartbeat: this instance's leases extended; a line whose lease another instance took is cut."""
        while True:
            await asyncio.sleep(self._heartbeat_s)
            for batch_id, held in list(self._held.items()):
                if not held:
                    continue
                try:
                    answer = await self._state.call("renew", id=batch_id, me=self._me, held=list(held),
                                                    lease_ms=self._lease_ms)
                except FAILURES as exc:
                    self._trouble(exc)
                    continue
                for index in answer["lost"] or ():
                    task = held.get(int(index))
                    if task is not None:
                        log.info("batch %s line %d: its lease lapsed and another instance runs it; cut here",
                                 batch_id, index)
                        task.cancel()

    # --- validation and finalization -------------------------------------------------------------

    async def _validate(self, batch: Batch) -> None:
        """The input file read into the lines file and Redis, then the batch in progress (or failed)."""
        batch_id, doc = batch.doc["id"], batch.doc
        try:
            lines, bad, model = await asyncio.to_thread(self._read, batch_id, doc)
        except Unusable as unusable:
            await self._state.call("drop", id=batch_id, when=["validating"])
            errors = {"object": "list", "data": [{"code": unusable.code, "message": unusable.message, "param": None,
                                                  "line": None}]}
            await self._state.move(batch_id, ("validating",), "failed", failed_at=int(self._clock()), errors=errors)
            return
        if not await self._state.put_lines(batch_id, lines, bad):
            return  # no longer validating (cancelled, or another instance took over): looked at again
        await self._state.call("begin", id=batch_id, total=len(lines) + len(bad), bad=len(bad),
                               fields=_fields(in_progress_at=int(self._clock()), model=model))
        self._metrics.lines.labels(tenant=self._metrics.tenant(batch.tenant), outcome="failed").inc(len(bad))

    def _read(self, batch_id: str, doc: Json) -> tuple[list[tuple[int, str]], list[tuple[int, str]], str | None]:
        """(index, line) of each valid line, whose body goes to the lines file; (index, outcome) of each bad one."""
        settings = self._settings
        reading = Reading(doc["endpoint"], LineLimits(settings.max_lines, settings.max_line_bytes))
        source = open_input(self._state.contents, doc["input_file_id"])
        lines, bad = [], []
        with source, self._state.contents.create(_lines_name(batch_id)) as out:
            for item in reading.items(raw_lines(source, settings.max_line_bytes)):
                if isinstance(item, Line):
                    lines.append((item.index, json.dumps([item.custom_id, out.size, len(item.body)])))
                    out.write(item.body)
                else:
                    bad.append((item.index, _bad(item)))
            out.commit()
        return lines, bad, reading.model

    async def _finalize(self, batch: Batch) -> None:
        """The output and error files from the recorded outcomes, then the batch final; redone whole if cut short."""
        batch_id, tenant = batch.doc["id"], batch.tenant
        final, unfinished = ENDINGS["expired" if batch.status == "in_progress" else batch.status]
        suffix = batch_id.removeprefix("batch_")
        out_id, err_id = f"file-{suffix}o", f"file-{suffix}e"
        contents = self._state.contents
        out = await asyncio.to_thread(contents.create, out_id)
        err = await asyncio.to_thread(contents.create, err_id)
        changes: Json = {"output_file_id": None, "error_file_id": None}
        try:
            usage, completed, failed = await self._outcomes(batch, unfinished, out, err)
            for key, written, file_id, name in (("output_file_id", out, out_id, f"{batch_id}_output.jsonl"),
                                                ("error_file_id", err, err_id, f"{batch_id}_error.jsonl")):
                if written.size:
                    size = await asyncio.to_thread(written.commit)
                    await self._state.add_file(file_id, tenant, "batch_output", name, size, int(self._clock()))
                    changes[key] = file_id
                else:
                    await asyncio.to_thread(written.abort)
        except BaseException:  # redone whole by the next look
            for written in (out, err):
                with contextlib.suppress(FilesUnavailable):
                    await asyncio.to_thread(written.abort)
            raise
        now = int(self._clock())
        if not await self._state.move(batch_id, (batch.status,), final, **changes, usage=usage.batch_usage(),
                                      **{f"{final}_at": now}, _total=completed + failed, _completed=completed,
                                      _failed=failed):
            return  # it moved meanwhile (cancelled while expiring): finalized again from where it stands
        await self._state.call("drop", id=batch_id, when=list(FINAL))
        with contextlib.suppress(FilesUnavailable):  # a leftover only, unlisted
            await asyncio.to_thread(contents.delete, _lines_name(batch_id))
        log.info("batch %s: %s (%d completed, %d failed)", batch_id, final, completed, failed)

    async def _outcomes(self, batch: Batch, unfinished: Json | None, out: Writer,
                        err: Writer) -> tuple[Usage, int, int]:
        """Every line's outcome, from Redis in chunks, to the output or the error file; what the batch counted."""
        batch_id = batch.doc["id"]
        completed = failed = 0
        usage = Usage()
        total = batch.doc["request_counts"]["total"]
        for start in range(0, total, 1000):
            rows = await self._state.results(batch_id, start, min(total, start + 1000))
            output: list[bytes] = []
            errors: list[bytes] = []
            for index, (outcome, line) in enumerate(rows, start):
                if outcome is None:
                    if unfinished is None:
                        raise RuntimeError(f"{batch_id}: line {index} has no outcome at finalization")
                    custom_id = None if line is None else json.loads(line)[0]
                    ok, entry = False, {"error": unfinished}
                else:
                    recorded = json.loads(outcome)
                    ok, custom_id, entry = recorded["ok"], recorded["custom_id"], recorded["entry"]
                written = output_line(request_id(batch_id, index), custom_id, entry.get("response"), entry.get("error"))
                (output if ok else errors).append(json.dumps(written).encode() + b"\n")
                if ok:
                    usage.add(entry["response"]["body"])
                completed += ok
                failed += not ok
            await asyncio.to_thread(out.write, b"".join(output))
            await asyncio.to_thread(err.write, b"".join(errors))
        return usage, completed, failed


def _ended(held: dict[int, asyncio.Task[None]], index: int, wake: asyncio.Event) -> Callable[[asyncio.Task[None]], None]:
    """A line's task ended: its slot is free, and its batch looks for the next line at once."""

    def ended(task: asyncio.Task[None]) -> None:
        held.pop(index, None)
        wake.set()
        if not task.cancelled() and task.exception() is not None:  # its lease lapses: another instance sends it
            log.error("batch line %d: the runner failed", index, exc_info=task.exception())

    return ended


def _fields(**values: object) -> dict[str, str]:
    """OpenAI's fields as the batch's hash keeps them: JSON text."""
    return {name: json.dumps(value) for name, value in values.items()}


def _lines_name(batch_id: str) -> str:
    """The file store's name of a batch's validated lines' bodies (each line's offset and size are in Redis)."""
    return f".{batch_id}.lines"


def _bad(item: LineError) -> str:
    return json.dumps({"ok": False, "custom_id": item.custom_id,
                       "entry": {"error": {"code": item.code, "message": item.message}}})
