"""The runner: each active batch's lines sent through the gateway as its tenant, at a bounded pace.

One task per active batch (:class:`LocalRunner` owns them). A batch is validated
(its input file read into lines, ``lines.py``), then its pending lines are
sent, at most ``in_flight_per_batch`` at once and ``max_in_flight`` over all
batches, to Envoy's runner listener (docs/batches.md says why Envoy and not
the queue directly): as the batch's tenant, in the lowest class its
entitlement allows. Each answer is recorded before the line's slot is given
to the next (``local_store.py``); ``sender.py`` sends a line again while the
gateway's answer says a retry helps. A batch ends ``completed`` when
every line has an outcome, ``cancelled`` when cancelled, ``expired`` at its
window's end; the output and error files are written then.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from extproc.adapters.batches.files import FilesUnavailable
from extproc.adapters.batches.lines import LineLimits, Reading, Unusable, open_input, raw_lines
from extproc.adapters.batches.local_store import LocalStore, Pending
from extproc.adapters.batches.metrics import BatchMetrics
from extproc.adapters.batches.sender import Sender, decided
from extproc.adapters.batches.shapes import ENDINGS, Json
from extproc.adapters.config import Config

log = logging.getLogger(__name__)

# Pending lines read from the store at a time.
CHUNK = 256
# The wait before a batch's step that needs the file store is tried again.
FILES_RETRY_S = 1.0


class LocalRunner:
    """Every active batch's task; ``start`` resumes those a previous process left."""

    def __init__(self, current: Callable[[], Config], store: LocalStore, metrics: BatchMetrics,
                 clock: Callable[[], float] = time.time) -> None:
        """``current``: the config now (a reload changes identity and entitlements; ``batches:`` needs a restart)."""
        settings = current().batches
        assert settings is not None
        self._current, self._settings, self._store, self._metrics, self._clock = (
            current, settings, store, metrics, clock)
        self._sender = Sender(current, settings, metrics)
        self._slots = asyncio.Semaphore(settings.max_in_flight)
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._cancelled: dict[str, asyncio.Event] = {}

    def start(self) -> None:
        self._sender.start()
        for batch_id in self._store.active():
            log.info("batch %s: resumed", batch_id)
            self.run(batch_id)
        self._count_statuses()

    async def stop(self) -> None:
        """Stop every batch where it is: lines in flight get no outcome and are sent again by the next start."""
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._sender.close()

    def run(self, batch_id: str) -> None:
        """Start (or resume) ``batch_id``'s task."""
        self._cancelled[batch_id] = asyncio.Event()
        task = asyncio.create_task(self._run(batch_id), name=f"batch {batch_id}")
        self._tasks[batch_id] = task
        task.add_done_callback(lambda _: (self._tasks.pop(batch_id, None), self._cancelled.pop(batch_id, None)))

    def cancel(self, batch_id: str) -> Json:
        """Mark the batch ``cancelling``; its task stops sending, ends what is in flight and finalizes it."""
        doc = self._store.cancel(batch_id, int(self._clock()))
        event = self._cancelled.get(batch_id)
        if event is not None:
            event.set()
        self._count_statuses()
        return doc

    def _count_statuses(self) -> None:
        self._metrics.statuses(self._store.counts_by_status())

    async def _run(self, batch_id: str) -> None:
        """The batch's lifecycle; again after :data:`FILES_RETRY_S` while the file store is away (the steps that
        touch files, validation and finalization, are redone whole)."""
        away = False
        while True:
            try:
                await self._lifecycle(batch_id)
                return
            except asyncio.CancelledError:
                raise
            except FilesUnavailable as exc:
                if not away:  # said once: it is tried again every FILES_RETRY_S until the store answers
                    away = True
                    log.warning("batch %s: the file store is unreachable (%s); tried again every %g s", batch_id,
                                exc, FILES_RETRY_S)
                await asyncio.sleep(FILES_RETRY_S)
            except Exception:
                log.exception("batch %s: the runner failed; it resumes at the next start", batch_id)
                return

    async def _lifecycle(self, batch_id: str) -> None:
        doc = self._store.batch(batch_id)
        assert doc is not None
        tenant = self._store.tenant_of(batch_id)
        if doc["status"] == "validating":
            doc = await self._validate(batch_id, doc)
        ending = doc["status"]
        if ending == "in_progress":
            ending = await self._feed(batch_id, tenant, doc)
        if ending not in ENDINGS:
            return  # failed at validation, or stopped by a failure of its own
        final, unfinished = ENDINGS[ending]
        changes = await asyncio.to_thread(self._store.finalize, batch_id, tenant, unfinished, int(self._clock()))
        self._store.update(batch_id, **changes, status=final, **{f"{final}_at": int(self._clock())})
        self._count_statuses()
        log.info("batch %s: %s (%s)", batch_id, final, changes["request_counts"])

    async def _validate(self, batch_id: str, doc: Json) -> Json:
        """The input file read line by line into the store (in a thread), then the batch in progress or failed."""
        try:
            valid, bad, model = await asyncio.to_thread(self._read, batch_id, doc)
        except Unusable as unusable:
            self._store.drop_lines(batch_id)
            errors = {"object": "list", "data": [{"code": unusable.code, "message": unusable.message, "param": None,
                                                  "line": None}]}
            doc = self._store.update(batch_id, status="failed", failed_at=int(self._clock()), errors=errors)
        else:
            doc = self._store.begin(batch_id, model, valid, bad, int(self._clock()))
            label = self._metrics.tenant(self._store.tenant_of(batch_id))
            self._metrics.lines.labels(tenant=label, outcome="failed").inc(bad)
        self._count_statuses()
        return doc

    def _read(self, batch_id: str, doc: Json) -> tuple[int, int, str | None]:
        settings = self._settings
        reading = Reading(doc["endpoint"], LineLimits(settings.max_lines, settings.max_line_bytes))
        source = open_input(self._store.contents, doc["input_file_id"])
        with source:
            valid, bad = self._store.put_lines(batch_id, reading.items(raw_lines(source, settings.max_line_bytes)))
        return valid, bad, reading.model

    async def _feed(self, batch_id: str, tenant: str, doc: Json) -> str:
        """Send every pending line; how the batch ends: finalizing (every line answered), cancelling or expired."""
        cancelled = self._cancelled.setdefault(batch_id, asyncio.Event())
        per_batch = asyncio.Semaphore(self._settings.in_flight_per_batch)
        lines: set[asyncio.Task[None]] = set()
        pending = self._metrics.pending.labels(tenant=self._metrics.tenant(tenant))
        pending.inc(self._store.remaining(batch_id))

        def done(task: asyncio.Task[None]) -> None:
            lines.discard(task)
            per_batch.release()
            self._slots.release()

        async def feed() -> None:
            after = -1
            while chunk := self._store.pending(batch_id, after, CHUNK):
                for line in chunk:
                    await per_batch.acquire()
                    await self._slots.acquire()
                    task = asyncio.create_task(self._line(batch_id, tenant, doc["endpoint"], line))
                    lines.add(task)
                    task.add_done_callback(done)
                after = chunk[-1].index
            while lines:
                await asyncio.wait(set(lines))

        feeding, stopped = asyncio.create_task(feed()), asyncio.create_task(cancelled.wait())
        try:
            # What woke the wait says how the batch ends, not the wall clock read after it: uvloop's timers fire
            # up to a millisecond before the wall clock reaches expires_at, and a wall clock may step back.
            ended, _ = await asyncio.wait((feeding, stopped), timeout=max(0.0, doc["expires_at"] - self._clock()),
                                          return_when=asyncio.FIRST_COMPLETED)
        finally:  # cancelled, expired, or every line answered; a line in flight is cut (and pending)
            for task in (feeding, stopped, *lines):
                task.cancel()
            await asyncio.gather(feeding, stopped, *lines, return_exceptions=True)
            pending.dec(self._store.remaining(batch_id))
        if self._store.batch(batch_id)["status"] == "cancelling":  # type: ignore[index]
            return "cancelling"
        if self._store.remaining(batch_id):
            if ended:  # fed to the end, yet lines are left: a line's task failed; left in progress, resumed next start
                log.error("batch %s: lines left without an outcome; the batch resumes at the next start", batch_id)
                return "in_progress"
            return "expired"  # written with the files: a batch reads expired only once they are there
        self._store.update(batch_id, status="finalizing", finalizing_at=int(self._clock()))
        return "finalizing"

    async def _line(self, batch_id: str, tenant: str, endpoint: str, line: Pending) -> None:
        """Send one line until its answer is final, then record it."""
        ok, result = await self._sender.send(batch_id, tenant, endpoint, line)
        if self._store.record(batch_id, line.index, ok, result):
            label = self._metrics.tenant(tenant)
            self._metrics.lines.labels(tenant=label, outcome="completed" if ok else "failed").inc()
            self._metrics.pending.labels(tenant=label).dec()
            status = result["response"]["status_code"]
            decided(batch_id, line, tenant, "completed" if ok else f"failed:{status}")
