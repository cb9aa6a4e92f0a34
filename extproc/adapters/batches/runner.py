"""The runner: each active batch's lines sent through the gateway as its tenant, at a bounded pace.

One task per active batch (:class:`Runner` owns them). A batch is validated
(its input file read into lines, ``lines.py``), then its pending lines are
sent, at most ``in_flight_per_batch`` at once and ``max_in_flight`` over all
batches, to Envoy's runner listener (docs/batches.md says why Envoy and not
the queue directly): as the batch's tenant, in the lowest class its
entitlement allows. Each answer is recorded before the line's slot is given
to the next (``store.py``); an answer the gateway marks retryable (its
reason's Retry-After rule in ``adapters/answers.py``: ``preempted``,
``queue_timeout``, ...) or no answer at all is sent again after its
Retry-After, never recorded as a failure. A batch ends ``completed`` when
every line has an outcome, ``cancelled`` when cancelled, ``expired`` at its
window's end; the output and error files are written then.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable

import aiohttp

from extproc.adapters.answers import ANSWERS, Retry
from extproc.adapters.batches.lines import Limits, Reading, Unusable, raw_lines
from extproc.adapters.batches.metrics import BatchMetrics
from extproc.adapters.batches.shapes import Json
from extproc.adapters.batches.store import Pending, Store
from extproc.adapters.config import Config
from extproc.adapters.envoy.batches import RUNNER_KEY_HEADER
from extproc.adapters.ext_proc.contract import REASON_HEADER
from extproc.adapters.logs import DECISIONS
from extproc.core.outcomes import Refusal

log = logging.getLogger(__name__)

# The least wait before a line is sent again, and the wait after a connection failure.
MIN_RETRY_S = 1.0
MAX_RETRY_S = 60.0
# Pending lines read from the store at a time.
CHUNK = 256
# Statuses the gateway answers when a retry helps, without a reason header (the engine's own 429).
_RETRY_STATUSES = frozenset({429})


def retry_after(status: int, headers: Callable[[str], str | None]) -> tuple[str, float] | None:
    """(reason, seconds) when the answer says to send the line again later; None when it is final."""
    reason = headers(REASON_HEADER) or ""
    try:
        refusal: Refusal | None = Refusal(reason)
    except ValueError:
        refusal = None
    retryable = (refusal is not None and ANSWERS[refusal].retry is not Retry.NO) or (
        refusal is None and status in _RETRY_STATUSES)
    if not retryable:
        return None
    try:
        wait = float(headers("retry-after") or MIN_RETRY_S)
    except ValueError:
        wait = MIN_RETRY_S
    return reason or str(status), min(MAX_RETRY_S, max(MIN_RETRY_S, wait))


# How a batch ends, by the status it reached: its final status, and the error of each line not run.
_ENDINGS: dict[str, tuple[str, Json | None]] = {
    "finalizing": ("completed", None),
    "cancelling": ("cancelled", {"code": "batch_cancelled", "message": "the batch was cancelled before this "
                                 "request ran"}),
    "expired": ("expired", {"code": "batch_expired", "message": "this request could not be executed before the "
                            "completion window expired"}),
}


class Runner:
    """Every active batch's task; ``start`` resumes those a previous process left."""

    def __init__(self, current: Callable[[], Config], store: Store, metrics: BatchMetrics,
                 clock: Callable[[], float] = time.time) -> None:
        """``current``: the config now (a reload changes identity and entitlements; ``batches:`` needs a restart)."""
        settings = current().batches
        assert settings is not None
        self._current, self._settings, self._store, self._metrics, self._clock = (
            current, settings, store, metrics, clock)
        self._url = (settings.gateway_url or f"http://{_connectable(settings.runner_listen)}").rstrip("/")
        self._slots = asyncio.Semaphore(settings.max_in_flight)
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._cancelled: dict[str, asyncio.Event] = {}
        self._session: aiohttp.ClientSession | None = None

    def start(self) -> None:
        # No overall timeout: a line waits in the fair queue as long as the class allows. A connection per
        # line in flight (aiohttp's default pool of 100 would cap max_in_flight below what it says).
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
                                              connector=aiohttp.TCPConnector(limit=self._settings.max_in_flight))
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
        if self._session is not None:
            await self._session.close()

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
        try:
            await self._lifecycle(batch_id)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("batch %s: the runner failed; it resumes at the next start", batch_id)

    async def _lifecycle(self, batch_id: str) -> None:
        doc = self._store.batch(batch_id)
        assert doc is not None
        tenant = self._store.tenant_of(batch_id)
        if doc["status"] == "validating":
            doc = await self._validate(batch_id, doc)
        ending = doc["status"]
        if ending == "in_progress":
            ending = await self._feed(batch_id, tenant, doc)
        if ending not in _ENDINGS:
            return  # failed at validation, or stopped by a failure of its own
        final, unfinished = _ENDINGS[ending]
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
        reading = Reading(doc["endpoint"], Limits(settings.max_lines, settings.max_line_bytes))
        try:
            source = self._store.path(doc["input_file_id"]).open("rb")
        except FileNotFoundError:
            raise Unusable("missing_file", "the input file was deleted before the batch ran") from None
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
            await asyncio.wait((feeding, stopped), timeout=max(0.0, doc["expires_at"] - self._clock()),
                               return_when=asyncio.FIRST_COMPLETED)
        finally:  # cancelled, expired, or every line answered; a line in flight is cut (and pending)
            for task in (feeding, stopped, *lines):
                task.cancel()
            await asyncio.gather(feeding, stopped, *lines, return_exceptions=True)
            pending.dec(self._store.remaining(batch_id))
        if self._store.batch(batch_id)["status"] == "cancelling":  # type: ignore[index]
            return "cancelling"
        if self._store.remaining(batch_id):
            if self._clock() < doc["expires_at"]:  # a line's task failed: left in progress, resumed next start
                log.error("batch %s: lines left without an outcome; the batch resumes at the next start", batch_id)
                return "in_progress"
            return "expired"  # written with the files: a batch reads expired only once they are there
        self._store.update(batch_id, status="finalizing", finalizing_at=int(self._clock()))
        return "finalizing"

    async def _line(self, batch_id: str, tenant: str, endpoint: str, line: Pending) -> None:
        """Send one line until its answer is final, then record it."""
        assert self._session is not None
        index = line.index
        label = self._metrics.tenant(tenant)
        preempted = 0
        while True:
            self._metrics.in_flight.labels(tenant=label).inc()
            try:
                async with self._session.post(f"{self._url}{endpoint}", data=line.body,
                                              headers=self._headers(tenant, preempted)) as response:
                    raw = await response.read()
                    status, answer = response.status, response.headers
            except (TimeoutError, aiohttp.ClientError) as exc:
                log.debug("batch %s line %d: %s; sent again", batch_id, index, exc)
                self._metrics.retries.labels(tenant=label, reason="connection").inc()
                await asyncio.sleep(MIN_RETRY_S)
                continue
            finally:
                self._metrics.in_flight.labels(tenant=label).dec()
            again = retry_after(status, answer.get)
            if again is None:
                break
            self._metrics.retries.labels(tenant=label, reason=again[0]).inc()
            self._decided(batch_id, line, tenant, f"retry:{again[0]}")
            preempted += again[0] == Refusal.PREEMPTED
            await asyncio.sleep(again[1])
        try:
            parsed = json.loads(raw)
        except ValueError:
            parsed = {"text": raw.decode("utf-8", "replace")}
        response_id = answer.get("x-request-id") or (parsed.get("id") if isinstance(parsed, dict) else None)
        ok = 200 <= status < 300
        result = {"response": {"status_code": status, "request_id": response_id, "body": parsed}, "error": None}
        if self._store.record(batch_id, index, ok, result):
            self._metrics.lines.labels(tenant=label, outcome="completed" if ok else "failed").inc()
            self._metrics.pending.labels(tenant=label).dec()
            self._decided(batch_id, line, tenant, "completed" if ok else f"failed:{status}")

    def _decided(self, batch_id: str, line: Pending, tenant: str, outcome: str) -> None:
        """The batch line's entry in the decision log: what became of one attempt (the queue's own line is apart)."""
        if DECISIONS.isEnabledFor(logging.DEBUG):
            fields = {"batch": batch_id, "line": line.index, "custom_id": line.custom_id, "tenant": tenant,
                      "outcome": outcome}
            DECISIONS.debug("batch_line %s %s line=%d tenant=%s", outcome, batch_id, line.index, tenant, extra=fields)

    def _headers(self, tenant: str, preempted: int) -> dict[str, str]:
        """The line's identity for the runner listener: the tenant, and the lowest class it may use.

        A line sent again after a preemption says it is a retry (the first of
        ``identity.retry_headers``, as the OpenAI SDKs do), so it is not preempted
        twice: like any batch client's request, it runs when it comes back. Not
        after a queue timeout: lines that waited would all become unpreemptible.
        """
        config = self._current()
        identity = config.identity
        headers = {"content-type": "application/json", identity.tenant_header: tenant,
                   identity.priority_header: config.tenant(tenant).bands[-1]}
        if preempted and identity.retry_headers:
            headers[identity.retry_headers[0]] = str(preempted)
        if self._settings.runner_key is not None:
            headers[RUNNER_KEY_HEADER] = self._settings.runner_key
        return headers


def _connectable(address: str) -> str:
    """A wildcard bind address is reached through loopback."""
    host, _, port = address.rpartition(":")
    loopback = {"0.0.0.0": "127.0.0.1", "[::]": "[::1]", "": "127.0.0.1"}
    return f"{loopback.get(host, host)}:{port}"
