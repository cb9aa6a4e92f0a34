"""The process's log output: ``--log-format text|json`` and ``--log-level``.

Text is for a person at a terminal; JSON lines are for a log pipeline (Loki,
Elasticsearch, ``jq``), one object per line with ``ts``, ``level``,
``logger``, ``msg`` and whatever the call passed as ``extra=`` as fields of
their own, so that a decision line can be filtered by tenant without parsing
its message.

The per-request decision lines go to the ``extproc.decisions`` logger at
DEBUG (written by ``telemetry.model.ModelTelemetry._decided``): ``outcome``, the
model, ``tenant``, ``class``, ``wait_ms`` (a preempted request's line has
``ran_ms`` instead: how long it had run since its release) and, for a request
with a TTFT objective, ``slack_ms`` (its deadline - now; negative: missed).
A batch line's entries carry ``batch_line`` (``<batch id>/<line>``, from the
runner's ``x-extproc-batch-line``), and the runner (``adapters/batches``) adds a
``batch_line`` entry per attempt's end: ``outcome`` (``completed``,
``failed:<status>``, ``retry:<reason>``), ``batch``, ``line``, ``custom_id``, ``tenant``.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import Literal

LogFormat = Literal["text", "json"]
FORMATS: tuple[LogFormat, ...] = ("text", "json")
LEVELS = ("debug", "info", "warning", "error")
# Attributes every LogRecord has; anything else on a record came from ``extra=``.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "taskName"}
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ts (UTC, ISO 8601, ms), level, logger, msg, the ``extra`` fields, exc."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        entry.update((key, value) for key, value in vars(record).items() if key not in _STANDARD)
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def setup_logging(level: str = "info", log_format: LogFormat = "text") -> None:
    """Send log records at ``level`` or above to stderr in ``log_format``; replaces earlier handlers.

    ``debug`` is for extproc's own loggers only: the libraries' debug output
    (gRPC's event-loop chatter, asyncio) would bury the decision lines.
    """
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    numeric = logging.getLevelNamesMapping()[level.upper()]
    logging.basicConfig(level=max(numeric, logging.INFO), handlers=[handler], force=True)
    logging.getLogger("extproc").setLevel(numeric)
