"""The ways a request ends without reaching the engine, by name.

The core names what happened (:class:`Refusal`) and the facts behind it
(:class:`Refused`); what the client hears — the HTTP status, the
OpenAI-style JSON body, ``Retry-After`` — is the adapters' choice, made in
one table (``adapters/protocol/answers.py``). So another front end (a different proxy
protocol, a batch API) can answer the same outcomes its own way.

Every reason a client can read in ``x-extproc-reason`` is a member, also
those only Envoy (its local replies) and the metrics port answer: one name
per outcome, whoever gives it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Refusal(StrEnum):
    """Why the gateway answered instead of the engine; the value is the reason on the wire and in metrics."""

    # The processor's own answers.
    MODEL_MISSING = "model_missing"  # the body names no model
    MODEL_NOT_FOUND = "model_not_found"  # a model this gateway does not serve
    INVALID_MAX_TOKENS = "invalid_max_tokens"  # max_tokens / max_completion_tokens is not a whole number >= 1
    INVALID_BODY = "invalid_body"  # a body read from the stream is not a JSON object
    BODY_TOO_LARGE = "body_too_large"  # a body read from the stream is over its limit
    INVALID_TTFT_OBJECTIVE = "invalid_ttft_objective"  # the TTFT objective header is not a number of ms > 0
    NO_ENDPOINT = "no_endpoint"  # no endpoint of the pool (or of the request's subset) can take it
    TENANT_MISSING = "tenant_missing"  # no tenant identity, and the config refuses anonymous requests
    PRIORITY_NOT_ALLOWED = "priority_not_allowed"  # no class the tenant may use at or below the one asked for
    TENANT_QUEUE_FULL = "tenant_queue_full"  # the tenant's own backlog is at its cap
    BAND_QUEUE_FULL = "band_queue_full"  # the priority class is full, for everyone
    MODEL_QUEUE_FULL = "model_queue_full"  # the model's queue is full, for everyone
    QUEUE_TIMEOUT = "queue_timeout"  # no room freed up within the class's longest wait
    SHUTTING_DOWN = "shutting_down"  # the processor drains
    PREEMPTED = "preempted"  # released, then ended before its response began: a higher class needed the engine
    ENGINE_FULL = "engine_full"  # released, then refused by the engine's own queue cap inside a stream's 200
    RATE_LIMIT_EXCEEDED = "rate_limit_exceeded"  # the tenant is over a per-minute limit of its budget (OpenAI's code)
    INSUFFICIENT_QUOTA = "insufficient_quota"  # the tenant is over a day or month budget (OpenAI's code)
    OVERLOADED = "overloaded"  # a burst put the processor (or Envoy's admission bucket) too far behind: shed on arrival
    # Envoy's own answers (adapters/envoy: local replies and catch-all routes).
    PROCESSOR_UNAVAILABLE = "processor_unavailable"  # the processor never answered (processor_failure: closed)
    UNAUTHENTICATED = "unauthenticated"  # no valid API key or JWT
    PERMISSION_DENIED = "permission_denied"  # an auth filter's 403
    ENGINE_UNAVAILABLE = "engine_unavailable"  # Envoy could not reach the model server
    UPSTREAM_TIMEOUT = "upstream_timeout"  # the model server did not answer in time
    REQUEST_TIMEOUT = "request_timeout"  # the request took longer than the gateway allows
    REQUEST_TOO_LARGE = "request_too_large"  # a body larger than Envoy buffers
    GATEWAY_ERROR = "gateway_error"  # any other 5xx of Envoy's own
    BAD_REQUEST = "bad_request"  # any other 4xx of Envoy's own
    # The metrics port's answers (adapters/web/app.py).
    NOT_FOUND = "not_found"  # no such path
    METHOD_NOT_ALLOWED = "method_not_allowed"
    NOT_READY = "not_ready"  # /readyz: not ready to schedule


@dataclass(frozen=True)
class Refused(Exception):
    """A request the processor answers itself: the outcome, in words, with what a client can act on."""

    refusal: Refusal
    message: str
    # How long the queue that refused it would take to drain at the recent
    # release rate (inf: nothing was released lately); None where the queue
    # is not the cause.
    drain_s: float | None = None
    # Set when the request was queued before it was refused.
    queue_wait_s: float | None = None
    # The request field at fault, when one is (OpenAI's error ``param``).
    param: str | None = None
    # When the limit that refused it has room again, in seconds (a budget's window or period).
    retry_in_s: float | None = None
    # Headers the answer carries beside the reason (a budget's x-ratelimit-*), as the adapter named them.
    headers: tuple[tuple[str, str], ...] = ()


def shutting_down() -> Refused:
    """The refusal while the processor drains (a new exception each time: one is raised per request)."""
    return Refused(Refusal.SHUTTING_DOWN, "the gateway is restarting; retry shortly")
