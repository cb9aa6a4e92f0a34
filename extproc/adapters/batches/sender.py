"""One batch line sent through the gateway until its answer is final: what every runner does with a line.

The line goes to Envoy's runner listener (docs/batches.md says why Envoy and
not the queue directly) as the batch's tenant, in the lowest class its
entitlement allows. An answer the gateway marks retryable (its reason's
Retry-After rule in ``adapters/protocol/answers.py``: ``preempted``, ``queue_timeout``,
...) or no answer at all is sent again after its Retry-After, never reported
as a failure. A line asking for more than ``batches.chunk_tokens`` tokens is
sent as chunks, each continuing the last and each one request of its own
through the gateway (``continuation.py``), its answer the chunks' merged.
What to do with the final answer (record it once) is the runner's: the
single instance's SQLite store, or the cluster's Redis.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable

import aiohttp

from extproc.adapters.batches.continuation import Chunks, plan
from extproc.adapters.batches.local_store import Pending
from extproc.adapters.batches.metrics import BatchMetrics
from extproc.adapters.batches.shapes import Json
from extproc.adapters.config import Config
from extproc.adapters.config.batches import BatchSettings
from extproc.adapters.envoy.batches import RUNNER_KEY_HEADER
from extproc.adapters.protocol.answers import ANSWERS, Retry
from extproc.adapters.protocol.contract import BATCH_LINE_HEADER, REASON_HEADER
from extproc.adapters.telemetry.model import DECISIONS
from extproc.core.values.outcomes import Refusal

log = logging.getLogger(__name__)

# The least wait before a line is sent again, and the wait after a connection failure.
MIN_RETRY_S = 1.0
MAX_RETRY_S = 60.0
# Statuses the gateway answers when a retry helps, without a reason header (the engine's own 429).
_RETRY_STATUSES = frozenset({429})
# The engines whose chat template takes vLLM's continue_final_message (docs/batches.md, Long generations).
CONTINUING_ENGINES = frozenset({"vllm"})


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


class Sender:
    """The HTTP client of a runner: ``send`` a line until its answer is final."""

    def __init__(self, current: Callable[[], Config], settings: BatchSettings, metrics: BatchMetrics) -> None:
        """``current``: the config now (a reload changes identity and entitlements; ``batches:`` needs a restart)."""
        self._current, self._settings, self._metrics = current, settings, metrics
        self._url = (settings.gateway_url or f"http://{_connectable(settings.runner_listen)}").rstrip("/")
        self._session: aiohttp.ClientSession | None = None

    def start(self) -> None:
        # No overall timeout: a line waits in the fair queue as long as the class allows. A connection per
        # line in flight (aiohttp's default pool of 100 would cap max_in_flight below what it says).
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
                                              connector=aiohttp.TCPConnector(limit=self._settings.max_in_flight))

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def send(self, batch_id: str, tenant: str, endpoint: str, line: Pending) -> tuple[bool, Json]:
        """Send ``line`` until its answer is final, in chunks where it is long (continuation.py): (a 2xx?, its entry)."""
        chunks = self._chunks(endpoint, line.body)
        if chunks is None:
            status, request_id, parsed = await self._final(batch_id, tenant, endpoint, line, line.body)
        else:
            first_id = None
            while True:
                status, request_id, parsed = await self._final(batch_id, tenant, endpoint, line, chunks.request())
                first_id = first_id or request_id
                if not (200 <= status < 300 and isinstance(parsed, dict)):
                    break  # a final refusal or the engine's error: the line's answer, as a whole line's would be
                if not chunks.add(parsed):
                    parsed, request_id = chunks.answer(), first_id
                    break
                self._metrics.chunks.labels(tenant=self._metrics.tenant(tenant)).inc()
                decided(batch_id, line, tenant, f"chunk:{chunks.generated}")
        return 200 <= status < 300, {"response": {"status_code": status, "request_id": request_id, "body": parsed},
                                     "error": None}

    def _chunks(self, endpoint: str, body: bytes) -> Chunks | None:
        """The line's chunks: with ``chunk_tokens`` set, for a model served by vLLM, whose answer they can rebuild."""
        found = plan(endpoint, body, self._settings.chunk_tokens)
        if found is None:
            return None
        model = self._current().model(str(found.body.get("model")))
        return Chunks(found) if model is not None and model.engine in CONTINUING_ENGINES else None

    async def _final(self, batch_id: str, tenant: str, endpoint: str, line: Pending,
                     body: bytes) -> tuple[int, str | None, Json]:
        """POST ``body`` until the answer is final: its status, request id and body (JSON, else its text)."""
        assert self._session is not None
        label = self._metrics.tenant(tenant)
        preempted = 0
        while True:
            self._metrics.in_flight.labels(tenant=label).inc()
            try:
                async with self._session.post(f"{self._url}{endpoint}", data=body,
                                              headers=self._headers(batch_id, line, tenant, preempted)) as response:
                    raw = await response.read()
                    status, answer = response.status, response.headers
            except (TimeoutError, aiohttp.ClientError) as exc:
                log.debug("batch %s line %d: %s; sent again", batch_id, line.index, exc)
                self._metrics.retries.labels(tenant=label, reason="connection").inc()
                await asyncio.sleep(MIN_RETRY_S)
                continue
            finally:
                self._metrics.in_flight.labels(tenant=label).dec()
            again = retry_after(status, answer.get)
            if again is None:
                break
            self._metrics.retries.labels(tenant=label, reason=again[0]).inc()
            decided(batch_id, line, tenant, f"retry:{again[0]}")
            preempted += again[0] == Refusal.PREEMPTED
            await asyncio.sleep(again[1])
        try:
            parsed = json.loads(raw)
        except ValueError:
            parsed = {"text": raw.decode("utf-8", "replace")}
        response_id = answer.get("x-request-id") or (parsed.get("id") if isinstance(parsed, dict) else None)
        return status, response_id, parsed

    def _headers(self, batch_id: str, line: Pending, tenant: str, preempted: int) -> dict[str, str]:
        """The line's identity for the runner listener: the tenant, the lowest class it may use, the batch line.

        A line sent again after a preemption says it is a retry (the first of
        ``identity.retry_headers``, as the OpenAI SDKs do), so it is not preempted
        twice: like any batch client's request, it runs when it comes back. Not
        after a queue timeout: lines that waited would all become unpreemptible.
        """
        config = self._current()
        identity = config.identity
        headers = {"content-type": "application/json", identity.tenant_header: tenant,
                   identity.priority_header: config.tenant(tenant).bands[-1],
                   BATCH_LINE_HEADER: f"{batch_id}/{line.index}"}
        if preempted and identity.retry_headers:
            headers[identity.retry_headers[0]] = str(preempted)
        if self._settings.runner_key is not None:
            headers[RUNNER_KEY_HEADER] = self._settings.runner_key
        return headers


def decided(batch_id: str, line: Pending, tenant: str, outcome: str) -> None:
    """The batch line's entry in the decision log: what became of one attempt (the queue's own entry is apart)."""
    if DECISIONS.isEnabledFor(logging.DEBUG):
        fields = {"batch": batch_id, "line": line.index, "custom_id": line.custom_id, "tenant": tenant,
                  "outcome": outcome}
        DECISIONS.debug("batch_line %s %s line=%d tenant=%s", outcome, batch_id, line.index, tenant, extra=fields)


def _connectable(address: str) -> str:
    """A wildcard bind address is reached through loopback."""
    host, _, port = address.rpartition(":")
    loopback = {"0.0.0.0": "127.0.0.1", "[::]": "[::1]", "": "127.0.0.1"}
    return f"{loopback.get(host, host)}:{port}"
