"""What a client hears for each :class:`~extproc.core.values.outcomes.Refusal`: status, OpenAI error type, Retry-After.

One table for every front end that answers instead of the engine: the
processor's ext_proc answers (``ext_proc/servicer.py``), the answers Envoy
gives itself (``envoy/local_replies.py`` and the catch-all routes) and the
metrics port (``web/app.py``). The OpenAI-style error body is built here and
nowhere else, so a client reads the same object, with the reason as its
``code`` and in the reason header, whoever answered.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import Any

from extproc.adapters.protocol.contract import REASON_HEADER
from extproc.core.values.outcomes import Refusal

# Retry-After: the refusing queue's drain time at the recent release rate, within these bounds.
MIN_RETRY_AFTER_S = 1
MAX_RETRY_AFTER_S = 60


class Retry(Enum):
    """When a client should try again (the ``Retry-After`` rule)."""

    NO = "no"  # retrying later does not help (or there is no estimate to give)
    SOON = "soon"  # another replica, a restart or a passing burst answers in a moment: MIN_RETRY_AFTER_S
    DRAIN = "drain"  # when the queue that refused it would have drained
    WINDOW = "window"  # when the budget's limit that refused it has room again (any length: a month's budget too)


@dataclass(frozen=True)
class RefusalAnswer:
    status: int
    error_type: str  # OpenAI's error ``type``
    retry: Retry = Retry.NO


_BAD = RefusalAnswer(400, "invalid_request_error")
_DOWN = RefusalAnswer(503, "server_error")
# 429 only where the tenant's own backlog is the cause (it sends faster than its
# share: slow down); a full class or model, a timeout and draining are
# server-side conditions, 503 for everyone.
ANSWERS: dict[Refusal, RefusalAnswer] = {
    Refusal.MODEL_MISSING: _BAD,
    Refusal.MODEL_NOT_FOUND: RefusalAnswer(404, "invalid_request_error"),
    Refusal.INVALID_MAX_TOKENS: _BAD,
    Refusal.INVALID_BODY: _BAD,
    Refusal.BODY_TOO_LARGE: RefusalAnswer(413, "invalid_request_error"),
    Refusal.INVALID_TTFT_OBJECTIVE: _BAD,
    Refusal.NO_ENDPOINT: _DOWN,
    Refusal.TENANT_MISSING: RefusalAnswer(401, "authentication_error"),
    Refusal.PRIORITY_NOT_ALLOWED: RefusalAnswer(403, "permission_error"),
    Refusal.TENANT_QUEUE_FULL: RefusalAnswer(429, "rate_limit_error", Retry.DRAIN),
    Refusal.RATE_LIMIT_EXCEEDED: RefusalAnswer(429, "rate_limit_error", Retry.WINDOW),
    Refusal.INSUFFICIENT_QUOTA: RefusalAnswer(429, "insufficient_quota", Retry.WINDOW),
    Refusal.BAND_QUEUE_FULL: RefusalAnswer(503, "server_error", Retry.DRAIN),
    Refusal.MODEL_QUEUE_FULL: RefusalAnswer(503, "server_error", Retry.DRAIN),
    Refusal.QUEUE_TIMEOUT: RefusalAnswer(503, "server_error", Retry.DRAIN),
    Refusal.SHUTTING_DOWN: RefusalAnswer(503, "server_error", Retry.SOON),
    Refusal.OVERLOADED: RefusalAnswer(503, "server_error", Retry.SOON),
    Refusal.PREEMPTED: RefusalAnswer(503, "server_error", Retry.SOON),
    Refusal.ENGINE_FULL: RefusalAnswer(503, "server_error", Retry.SOON),
    Refusal.PROCESSOR_UNAVAILABLE: RefusalAnswer(503, "server_error", Retry.SOON),
    Refusal.UNAUTHENTICATED: RefusalAnswer(401, "authentication_error"),
    Refusal.PERMISSION_DENIED: RefusalAnswer(403, "permission_error"),
    Refusal.ENGINE_UNAVAILABLE: RefusalAnswer(503, "server_error", Retry.SOON),
    Refusal.UPSTREAM_TIMEOUT: RefusalAnswer(504, "server_error"),
    Refusal.REQUEST_TIMEOUT: RefusalAnswer(408, "invalid_request_error"),
    Refusal.REQUEST_TOO_LARGE: RefusalAnswer(413, "invalid_request_error"),
    Refusal.GATEWAY_ERROR: RefusalAnswer(500, "server_error"),
    Refusal.BAD_REQUEST: _BAD,
    Refusal.NOT_FOUND: RefusalAnswer(404, "invalid_request_error"),
    Refusal.METHOD_NOT_ALLOWED: RefusalAnswer(405, "invalid_request_error"),
    Refusal.NOT_READY: _DOWN,
}
# Refusals of a request shed under load: the Endpoint Picker Protocol answers them 429
# (endpoint_picker.shed_status) for requests attached by ext_proc alone.
SHED = frozenset({Refusal.BAND_QUEUE_FULL, Refusal.MODEL_QUEUE_FULL, Refusal.QUEUE_TIMEOUT, Refusal.OVERLOADED})


def retry_after_s(refusal: Refusal, drain_s: float | None = None, retry_in_s: float | None = None) -> int | None:
    """Seconds a client should wait before retrying, or None where retrying later does not help.

    ``drain_s``: how long the refusing queue would take to drain (inf:
    nothing was released lately, so no estimate); ``retry_in_s``: when the
    budget that refused it has room (rounded up: a client that waits so long
    finds it).
    """
    retry = ANSWERS[refusal].retry
    if retry is Retry.WINDOW:
        return None if retry_in_s is None else max(MIN_RETRY_AFTER_S, math.ceil(retry_in_s))
    if retry is Retry.SOON:
        return MIN_RETRY_AFTER_S
    if retry is Retry.NO or drain_s is None:
        return None
    if math.isinf(drain_s):
        return MAX_RETRY_AFTER_S
    return min(MAX_RETRY_AFTER_S, max(MIN_RETRY_AFTER_S, math.ceil(drain_s)))


def error_body(refusal: Refusal, message: str, param: str | None = None) -> dict[str, Any]:
    """The OpenAI-style error object; ``message`` may be an Envoy format string where Envoy renders it."""
    return {"error": {"message": message, "type": ANSWERS[refusal].error_type, "param": param, "code": refusal.value}}


def answer_headers(refusal: Refusal, retry_after: int | None) -> list[tuple[str, str]]:
    """The reason header and, when there is one, ``Retry-After``."""
    headers = [(REASON_HEADER, refusal.value)]
    if retry_after is not None:
        headers.append(("retry-after", str(retry_after)))
    return headers
