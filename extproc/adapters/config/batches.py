"""The ``batches:`` section: OpenAI's Batch API served by ``extproc serve`` (docs/batches.md).

Its own module, so the batch settings and their rules stay together; schema.py
names the section, rules.py runs :func:`batch_problems` and the file rule
:func:`batch_file_problems`.
"""

from __future__ import annotations

import re
from typing import Annotated

import msgspec
from msgspec import Meta

from extproc.adapters.config.instances import ClusterSettings
from extproc.adapters.config.validate import Problems
from extproc.adapters.config.values import Address, Count, Count0, HttpUrl, NonEmpty, Section

# A completion window as written: a whole number of seconds, minutes, hours or days ("24h").
WINDOW = re.compile(r"([1-9][0-9]*)([smhd])")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}
# The smallest chunk_tokens but 0 (off): each chunk is a request through the gateway and re-reads the prompt
# and the text so far; below this the path's own cost per chunk outweighs the slot it frees.
MIN_CHUNK_TOKENS = 16


def window_s(window: str) -> int | None:
    """Seconds of a completion window as written (``24h`` -> 86400); None when it is not one."""
    found = WINDOW.fullmatch(window)
    return None if found is None else int(found[1]) * _UNIT_S[found[2]]


def _window(value: str) -> str:
    if window_s(value) is None:
        raise ValueError(value)
    return value


Window = Annotated[str, Meta(description="a window such as 24h, 30m, 90s or 7d", extra={"check": _window})]


class S3Settings(Section, frozen=True):
    """An S3-compatible bucket for the files' contents (adapters/batches/s3.py)."""

    bucket: NonEmpty
    # Prepended to every object's name (e.g. "extproc/batches/"); unset: none.
    prefix: NonEmpty | None = None
    # An S3-compatible store (MinIO, Ceph, R2...): its URL, addressed path-style. Unset: AWS's own endpoint.
    endpoint_url: HttpUrl | None = None
    # The region to sign for (unset: the AWS chain's, e.g. AWS_REGION).
    region: NonEmpty | None = None
    # Explicit credentials: the key id, and a file holding the secret key (never the secret in this file).
    # Unset: the AWS chain (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE, web identity, instance role).
    access_key_id: NonEmpty | None = None
    secret_access_key_file: NonEmpty | None = None


class FileSettings(Section, frozen=True):
    """Where the files' contents live: under ``directory`` (unset) or in S3."""

    s3: S3Settings | None = None


class BatchSettings(Section, frozen=True):
    """OpenAI's Batch API: where its state lives, where it listens, how fast lines are fed."""

    # SQLite (batches.sqlite3) and, without files.s3, the files' contents; created if missing. With cluster:
    # and files.s3 nothing is kept there.
    directory: NonEmpty | None = None
    # Where the files' contents live when not under directory.
    files: FileSettings = msgspec.field(default_factory=FileSettings)
    # The API (files, batches), for Envoy only: the generated routes send /v1/files and /v1/batches here.
    listen: Address = "127.0.0.1:8090"
    # Envoy's listener for the runner's lines: the tenant header kept, no auth (bind it where only we reach it).
    runner_listen: Address = "127.0.0.1:10001"
    # Where the runner reaches that listener (default: http://runner_listen).
    gateway_url: HttpUrl | None = None
    # When set, the runner listener's routes require x-extproc-batch-key: <runner_key>.
    runner_key: NonEmpty | None = None
    # Lines of one batch in flight at once (queued in the fair queue or running), and over all batches.
    in_flight_per_batch: Count = 32
    max_in_flight: Count = 256
    # A line asking for more tokens is sent as chunks of at most this many, each continuing the last, so the
    # engine slot frees at each chunk's end (docs/batches.md, Long generations). 0: every line sent whole.
    chunk_tokens: Count0 = 0
    # The completion windows a batch may ask for (OpenAI: 24h only).
    completion_windows: Annotated[tuple[Window, ...], Meta(min_length=1)] = ("24h",)
    # OpenAI's limits: 200 MB a file, 50,000 requests a batch.
    max_file_bytes: Count = 200 * 1024 * 1024
    max_lines: Count = 50_000
    # One line's most bytes (below Envoy's 16 MiB body buffer).
    max_line_bytes: Count = 8 * 1024 * 1024


def batch_problems(settings: BatchSettings) -> Problems:
    """The rules between the section's fields."""
    if settings.in_flight_per_batch > settings.max_in_flight:
        yield "in_flight_per_batch", (f"must be <= max_in_flight ({settings.max_in_flight}), "
                                      f"got {settings.in_flight_per_batch}")
    if 0 < settings.chunk_tokens < MIN_CHUNK_TOKENS:
        yield "chunk_tokens", (f"must be 0 (every line sent whole) or at least {MIN_CHUNK_TOKENS} (each chunk is a "
                               f"request of its own), got {settings.chunk_tokens}")
    if settings.listen == settings.runner_listen:
        yield "runner_listen", "must differ from listen (the API and Envoy's runner listener are two ports)"
    s3 = settings.files.s3
    if s3 is not None and (s3.access_key_id is None) != (s3.secret_access_key_file is None):
        missing = "secret_access_key_file" if s3.secret_access_key_file is None else "access_key_id"
        yield f"files.s3.{missing}", "is required with the other (explicit credentials), or unset both (the AWS chain)"


def batch_file_problems(batches: BatchSettings | None, sharded: bool, cluster: ClusterSettings | None) -> Problems:
    """The section against the rest of the file: one instance, or a cluster sharing the batches through Redis.

    Shards split the models, not the work: a batch's lines would need the
    instance that owns its model, so batches are refused with ``shards:``.
    With ``cluster.instances`` each instance serves the API on its own
    address (``batches``), so that Envoy's API cluster lists every one.
    """
    if batches is None:
        return
    if batches.directory is None and (cluster is None or batches.files.s3 is None):
        where = "the files' contents and, without cluster:, the SQLite state" if batches.files.s3 is None else (
            "one instance's SQLite state (with cluster: and files.s3 none is needed)")
        yield "batches.directory", f"is required: {where}"
    if sharded:
        yield "batches", "cannot be used with shards: (use cluster: to share the batches; docs/batches.md)"
    if cluster is not None and cluster.instances:
        for name, instance in cluster.instances.items():
            if instance.batches is None:
                yield f"cluster.instances.{name}.batches", ("is required with batches: (where this instance serves "
                                                             "the batch API)")
