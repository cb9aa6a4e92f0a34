"""The batch series: per tenant (bounded labels) progress and throughput, and batches by status.

A batch's own progress is its ``request_counts`` (``GET /v1/batches/{id}``):
batch ids are unbounded, so they are never label values. Throughput is the
rate of ``extproc_batch_lines_total``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from extproc.adapters.batches.shapes import ACTIVE, FINAL
from extproc.adapters.telemetry.labels import TenantLabels


class BatchMetrics:
    def __init__(self, registry: CollectorRegistry, tenants: TenantLabels) -> None:
        self.tenant = tenants
        self.lines = Counter("extproc_batch_lines", "Batch lines with a recorded outcome (completed: the output "
                             "file; failed: the error file)", ["tenant", "outcome"], registry=registry)
        self.retries = Counter("extproc_batch_line_retries", "Batch lines sent again: the gateway's answer said a "
                               "retry helps (preempted, queue_timeout, ...) or it could not be reached (connection)",
                               ["tenant", "reason"], registry=registry)
        self.chunks = Counter("extproc_batch_line_chunks", "Continuations sent: the chunks of long batch lines after "
                              "each line's first (batches.chunk_tokens)", ["tenant"], registry=registry)
        self.in_flight = Gauge("extproc_batch_lines_in_flight", "Batch lines sent and not yet answered",
                               ["tenant"], registry=registry)
        self.pending = Gauge("extproc_batch_lines_pending", "Batch lines of active batches still to run",
                             ["tenant"], registry=registry)
        self.batches = Gauge("extproc_batches", "Batches by status", ["status"], registry=registry)
        for status in (*ACTIVE, *FINAL):
            self.batches.labels(status=status)

    def statuses(self, counts: dict[str, int]) -> None:
        for status in (*ACTIVE, *FINAL):
            self.batches.labels(status=status).set(counts.get(status, 0))
