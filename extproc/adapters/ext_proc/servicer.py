"""The ext_proc stream: one gRPC stream per HTTP request passing through Envoy.

Transport-independent: :meth:`Processor.process` turns the stream's messages
into replies; h2grpc.py carries them (server.py wires the two).

Life of a stream (processing mode: request headers SEND, response trailers
SEND, everything else off):

1. Envoy sends the request headers, with the body's ``model`` (and
   ``max_tokens``, ``max_completion_tokens``) already in dynamic metadata by
   its json_to_metadata filter: the prompt never passes through Python.
2. We work out model, tenant and priority, queue the request and — if it has
   to wait — tell Envoy to extend its message timeout while we hold it.
3. When the dispatcher releases it we answer CONTINUE, setting the routing
   header to the model from the body (a client-sent header is overwritten)
   and clearing Envoy's route cache so it routes on it.
4. For a release the gate checks (a sample; ``mode_override``), the
   response headers tell whether it reached a live engine
   (release_outcome.py); a failure marks the endpoint down at once. The
   stream then stays open, silent, until the response has finished or the
   client has gone; its end is the request's completion, which keeps the
   gate's in-flight count exact at no per-chunk cost.

For ``engine_priority`` models only, the CONTINUE also switches the stream to
a buffered request body (ext_proc ``mode_override``): Envoy then sends the
body, which comes back with the band's ``priority`` written in (priority_body.py).
Every other model stays headers-only.

Who asks and how urgently: the tenant comes from the tenant header, which
only Envoy's auth filter can set (missing: the default tenant, or 401 with
``identity.missing_tenant: reject``). The class comes from the priority
header, limited by the tenant's entitlement: a class it may not use is
downgraded to the next lower one it may (counted in
``extproc_priority_downgraded_total``), never upgraded; with no lower one the
request is refused (403).

A client that leaves while queued cancels the stream; the cancellation
removes its entry from the queue at once.

Under a burst the first reply must still reach Envoy within its
``message_timeout``: while the event loop runs late (``loop_lag.py``) the
stream is acknowledged (``override_message_timeout``) before any other work,
and past the shed bound it is answered ``overloaded`` at once.

A request that does not reach the engine ends in one of the core's named
refusals (``core/outcomes.py``); what the client hears for each — HTTP status,
OpenAI-style JSON error, ``Retry-After`` — is chosen here (:data:`ANSWERS`,
:func:`retry_after_s`).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass
from urllib.parse import urlsplit

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf import duration_pb2, struct_pb2

from extproc.adapters.config import Config
from extproc.adapters.ext_proc.contract import (
    DESTINATION_HEADER,
    METADATA_NAMESPACE,
    PROCESSING_MODE,
    QUEUE_WAIT_HEADER,
    REASON_HEADER,
    hold_timeout_for,
)
from extproc.adapters.ext_proc.loop_lag import LoopLag
from extproc.adapters.ext_proc.priority_body import with_priority
from extproc.adapters.ext_proc.release_outcome import engine_answered
from extproc.adapters.telemetry import NO_TENANT, Telemetry
from extproc.core.dispatcher import ModelDispatcher, shutting_down
from extproc.core.outcomes import Refusal, Refused

_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
# What the client hears for each refusal: the HTTP status and OpenAI's error type.
# 429 only where the tenant's own backlog is the cause (it sends faster than its
# share: slow down); a full class or model, a timeout and draining are
# server-side conditions, 503 for everyone.
ANSWERS: dict[Refusal, tuple[int, str]] = {
    Refusal.MODEL_MISSING: (400, "invalid_request_error"),
    Refusal.MODEL_NOT_FOUND: (404, "invalid_request_error"),
    Refusal.INVALID_MAX_TOKENS: (400, "invalid_request_error"),
    Refusal.TENANT_MISSING: (401, "authentication_error"),
    Refusal.PRIORITY_NOT_ALLOWED: (403, "permission_error"),
    Refusal.TENANT_QUEUE_FULL: (429, "rate_limit_error"),
    Refusal.BAND_QUEUE_FULL: (503, "server_error"),
    Refusal.MODEL_QUEUE_FULL: (503, "server_error"),
    Refusal.QUEUE_TIMEOUT: (503, "server_error"),
    Refusal.SHUTTING_DOWN: (503, "server_error"),
    Refusal.OVERLOADED: (503, "server_error"),
}
# Retry-After: the refusing queue's drain time at the recent release rate, within these bounds.
MIN_RETRY_AFTER_S = 1
MAX_RETRY_AFTER_S = 60
# From this loop lag on, a stream is acknowledged before it is decided: the
# acknowledgement is the cheapest reply that stops Envoy's message timer.
ACK_LAG_S = 0.05
# From this share of Envoy's message_timeout of loop lag on, a new stream is
# shed (overloaded): its reply would come too close to Envoy's 504.
SHED_LAG_SHARE = 0.5
# The filter's own mode with, after a release, the request body buffered (engine_priority
# models) and/or the response headers sent (a release the gate checks for failure); by
# (body, response headers). Neither: no override.
_OVERRIDES = {
    (body, checked): processing_mode_pb2.ProcessingMode(**{
        **PROCESSING_MODE,
        **({"request_body_mode": "BUFFERED"} if body else {}),
        **({"response_header_mode": "SEND"} if checked else {}),
    })
    for body in (False, True) for checked in (False, True) if body or checked
}


@dataclass(frozen=True)
class Admission:
    model: str
    tenant: str
    band: int
    # The band the request asked for, when it was downgraded.
    requested: int | None = None


def _duration(seconds: float) -> duration_pb2.Duration:
    duration = duration_pb2.Duration()
    duration.FromMilliseconds(round(seconds * 1000))
    return duration


def _header(name: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=name, raw_value=value.encode()), append_action=_OVERWRITE
    )


def retry_after_s(refused: Refused) -> int | None:
    """Seconds a client should wait before retrying, or None where retrying later does not help."""
    if refused.refusal in (Refusal.SHUTTING_DOWN, Refusal.OVERLOADED):
        # Another replica, or this one restarted, answers in a moment; a burst passes in moments.
        return MIN_RETRY_AFTER_S
    if refused.drain_s is None:
        return None
    if math.isinf(refused.drain_s):  # nothing released lately: no estimate
        return MAX_RETRY_AFTER_S
    return min(MAX_RETRY_AFTER_S, max(MIN_RETRY_AFTER_S, math.ceil(refused.drain_s)))


def error_response(refused: Refused) -> pb.ProcessingResponse:
    """An OpenAI-style JSON error that Envoy sends to the client in place of the engine's answer."""
    status, error_type = ANSWERS[refused.refusal]
    body = {"error": {"message": refused.message, "type": error_type, "param": refused.param,
                      "code": refused.refusal.value}}
    headers = [_header("content-type", "application/json"), _header(REASON_HEADER, refused.refusal.value)]
    retry_after = retry_after_s(refused)
    if retry_after is not None:
        headers.append(_header("retry-after", str(retry_after)))
    if refused.queue_wait_s is not None:
        headers.append(_header(QUEUE_WAIT_HEADER, str(round(refused.queue_wait_s * 1000))))
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status),
            headers=pb.HeaderMutation(set_headers=headers),
            body=json.dumps(body).encode(),
            details=refused.refusal.value,
        )
    )


def _models_response(config: Config) -> pb.ProcessingResponse:
    """``GET /v1/models`` answered from the configuration: the models this gateway routes."""
    body = {"object": "list", "data": [{"id": m.name, "object": "model", "owned_by": "extproc"} for m in config.models]}
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=200),
            headers=pb.HeaderMutation(set_headers=[_header("content-type", "application/json")]),
            body=json.dumps(body).encode(),
        )
    )


def _headers_of(message: pb.HttpHeaders) -> dict[str, str]:
    # Envoy fills raw_value (bytes); value is only used by older Envoys.
    return {h.key.lower(): (h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value)
            for h in message.headers.headers}


def _metadata_value(request: pb.ProcessingRequest, name: str) -> struct_pb2.Value | None:
    """A body field that Envoy's json_to_metadata copied into our metadata namespace."""
    fields = request.metadata_context.filter_metadata.get(METADATA_NAMESPACE)
    if fields is None or name not in fields.fields:
        return None
    value: struct_pb2.Value = fields.fields[name]
    return value


def _body_field(request: pb.ProcessingRequest, name: str) -> str | None:
    value = _metadata_value(request, name)
    return value.string_value if value is not None and value.WhichOneof("kind") == "string_value" else None


def _body_model(request: pb.ProcessingRequest) -> str | None:
    return _body_field(request, "model")


def _host_port(endpoint: str) -> str | None:
    """``http://10.0.0.7:8000`` -> ``10.0.0.7:8000``; None for a host name (ORIGINAL_DST needs an address)."""
    parts = urlsplit(endpoint)
    try:
        address = ipaddress.ip_address(parts.hostname or "")
    except ValueError:
        return None
    host = f"[{address}]" if address.version == 6 else str(address)
    return f"{host}:{parts.port}"


def _body_max_tokens(request: pb.ProcessingRequest) -> float | None:
    """The body's output limit (``max_completion_tokens`` wins over ``max_tokens``, as in vLLM), or None.

    Envoy copies each field as the JSON value it is (json_to_metadata type
    PROTOBUF_VALUE): a string, a bool, a fraction, zero or a negative number is
    refused here, naming the field, as OpenAI's API refuses it. Envoy's NUMBER
    type would instead have turned ``"inf"`` or ``"nan"`` into a number and
    ``true`` into 1. A list, an object or null never reaches us (Envoy drops
    them; the engine answers those). A whole number too large for any context
    (``1e308``) is valid JSON and passes: the cost model clamps it.
    """
    limit = None
    for field in ("max_tokens", "max_completion_tokens"):
        value = _metadata_value(request, field)
        if value is None:
            continue
        number = value.number_value if value.WhichOneof("kind") == "number_value" else math.nan
        if not (math.isfinite(number) and number >= 1 and number.is_integer()):
            raise Refused(Refusal.INVALID_MAX_TOKENS, f"{field} must be an integer >= 1, got {_shown(value)}",
                          param=field)
        limit = number
    return limit


def _shown(value: struct_pb2.Value) -> str:
    """A metadata value as the client wrote it, short (it goes into an error message)."""
    kind = value.WhichOneof("kind")
    if kind == "string_value":
        return json.dumps(value.string_value[:40])
    if kind == "bool_value":
        return "true" if value.bool_value else "false"
    if kind == "number_value":
        return f"{value.number_value:g}"
    return str(kind)


def _content_length(headers: dict[str, str]) -> int | None:
    """The declared body size; None when absent (chunked) or not plain ASCII digits."""
    value = headers.get("content-length", "")
    return int(value) if value.isascii() and value.isdigit() else None


class Processor:
    """What Envoy's ext_proc filter talks to: one :meth:`process` per stream."""

    def __init__(self, config: Config, dispatchers: dict[str, ModelDispatcher], telemetry: Telemetry) -> None:
        self._config = config
        self._dispatchers = dispatchers
        self._telemetry = telemetry
        # Prebuilt, like the two replies below: one is sent to every request that has to wait.
        self._hold_reply = {
            m.name: pb.ProcessingResponse(override_message_timeout=_duration(hold_timeout_for(config.longest_queue_wait_s(m))))
            for m in config.models
        }
        self._engine_priority_models = {m.name for m in config.models if m.engine_priority}
        self.draining = False
        self.lag = LoopLag()
        self._shed_lag_s = SHED_LAG_SHARE * config.envoy.message_timeout_ms / 1000
        # Prebuilt: under a burst these are sent to every arrival, so they cost no construction.
        self._acknowledgement = max(
            self._hold_reply.values(), key=lambda reply: reply.override_message_timeout.ToMilliseconds()
        )
        self._overloaded = error_response(Refused(
            Refusal.OVERLOADED, "the gateway received more requests at once than it can take in; retry shortly"
        ))

    def admit(self, headers: dict[str, str], body_model: str | None) -> Admission:
        """Who asks, for which model, how urgently — or why not (raises Refused)."""
        identity = self._config.identity
        if self.draining:
            raise shutting_down()
        if body_model is None:
            raise Refused(
                Refusal.MODEL_MISSING,
                "the request body must be JSON (content-type: application/json) with a 'model' field",
            )
        if body_model not in self._dispatchers:
            known = ", ".join(sorted(self._dispatchers))
            raise Refused(Refusal.MODEL_NOT_FOUND, f"the model {body_model!r} does not exist; served models: {known}")
        tenant = headers.get(identity.tenant_header)
        if not tenant:
            if identity.missing_tenant == "reject":
                raise Refused(Refusal.TENANT_MISSING, "the request carries no tenant identity; authenticate first")
            tenant = identity.default_tenant
        return self._entitled(body_model, tenant, headers.get(identity.priority_header, "").strip().lower())

    def _entitled(self, model: str, tenant: str, asked: str) -> Admission:
        """The class ``tenant`` gets when it asks for ``asked`` (see the module docstring)."""
        priorities = self._config.priorities
        entitlement = self._config.tenant(tenant)
        allowed = entitlement.priorities or priorities
        if asked not in priorities:  # none, or a class that does not exist
            return Admission(model, tenant, priorities.index(entitlement.default_priority or self._config.default_priority))
        requested = priorities.index(asked)
        if asked in allowed:
            return Admission(model, tenant, requested)
        lower = [priorities.index(p) for p in allowed if priorities.index(p) > requested]
        if not lower:
            raise Refused(Refusal.PRIORITY_NOT_ALLOWED, f"tenant {tenant!r} may not use priority {asked!r}; "
                           f"its classes are {', '.join(allowed)}")
        return Admission(model, tenant, min(lower), requested=requested)

    async def process(self, requests: AsyncIterator[pb.ProcessingRequest]) -> AsyncIterator[pb.ProcessingResponse]:
        messages = aiter(requests)
        first = await anext(messages, None)
        if first is None:
            return
        if not first.HasField("request_headers"):  # not our processing mode: stay out of the way
            yield _continue(first)
            async for message in messages:
                yield _continue(message)
            return
        lag = self.lag.seconds(asyncio.get_running_loop().time())
        if lag >= self._shed_lag_s:
            self._count_refusal(_body_model(first), Refusal.OVERLOADED)
            yield self._overloaded
            return
        acknowledged = lag >= ACK_LAG_S
        if acknowledged:
            yield self._acknowledgement
        headers = _headers_of(first.request_headers)
        if headers.get(":method") == "GET" and headers.get(":path", "").split("?")[0] == "/v1/models":
            yield _models_response(self._config)
            return
        body_model = _body_model(first)
        try:
            admission = self.admit(headers, body_model)
            max_tokens = _body_max_tokens(first)
        except Refused as refused:
            self._count_refusal(body_model, refused.refusal)
            yield error_response(refused)
            return
        priorities = self._config.priorities
        if admission.requested is not None:
            self._telemetry.priority_downgraded.labels(
                admission.model, priorities[admission.requested], priorities[admission.band]
            ).inc()

        dispatcher = self._dispatchers[admission.model]
        try:
            held = dispatcher.submit(
                admission.tenant, admission.band,
                content_length=_content_length(headers), max_tokens=max_tokens,
                # OpenAI's prompt_cache_key names requests that share a prompt prefix; without
                # it, a tenant's requests stick together (they often share a system prompt).
                affinity=_body_field(first, "prompt_cache_key") or "",
            )
        except Refused as refused:  # a queue cap; the dispatcher counted it
            yield error_response(refused)
            return
        # Not kept through the hold: a held request costs memory, 10,000 of them add up.
        del first, headers
        engine_priority = self._engine_priority(admission)
        # One try for the whole hold: the stream can be cancelled (client gone) at
        # any await or yield, and the request must leave the queue or the gate then.
        try:
            if not held.future.done() and not acknowledged:
                yield self._hold_reply[admission.model]
            try:
                waited = await held.future
            except Refused as refused:
                yield error_response(refused)
                return
            routing = [
                _header(self._config.identity.model_header, admission.model),
                _header(QUEUE_WAIT_HEADER, str(round(waited * 1000))),
            ]
            destination = _host_port(held.endpoint) if held.endpoint else None
            if destination:
                routing.append(_header(DESTINATION_HEADER, destination))
            yield pb.ProcessingResponse(
                request_headers=pb.HeadersResponse(
                    response=pb.CommonResponse(
                        header_mutation=pb.HeaderMutation(set_headers=routing),
                        clear_route_cache=True,
                    )
                ),
                mode_override=_OVERRIDES.get((engine_priority is not None, held.checked)),
            )
            async for message in messages:
                if engine_priority is not None and message.HasField("request_body"):
                    yield _priority_body(message.request_body.body, engine_priority)
                elif message.HasField("response_headers"):
                    dispatcher.record_response(held, engine_answered(_headers_of(message.response_headers)))
                    yield _continue(message)
                else:
                    yield _continue(message)
        finally:
            dispatcher.end(held)

    def _count_refusal(self, body_model: str | None, refusal: Refusal) -> None:
        """Count a refusal made before the request reached a dispatcher (which counts its own)."""
        # Client-chosen names never become label values: unbounded series would sink Prometheus.
        label = body_model if body_model in self._dispatchers else "(unknown)"
        self._telemetry.rejected.labels(label, refusal.value, NO_TENANT).inc()

    def _engine_priority(self, admission: Admission) -> int | None:
        """The body ``priority`` to write for this request, or None (model without engine_priority)."""
        if admission.model not in self._engine_priority_models:
            return None
        return self._config.bands[admission.band].engine_priority


def _priority_body(body: bytes, priority: int) -> pb.ProcessingResponse:
    rewritten = with_priority(body, priority)
    if rewritten is None:  # not a JSON object: the engine will say so itself
        return pb.ProcessingResponse(request_body=pb.BodyResponse())
    # Envoy refuses a mutated body whose length disagrees with Content-Length (503).
    length = pb.HeaderMutation(set_headers=[_header("content-length", str(len(rewritten)))])
    return pb.ProcessingResponse(
        request_body=pb.BodyResponse(
            response=pb.CommonResponse(header_mutation=length, body_mutation=pb.BodyMutation(body=rewritten))
        )
    )


def _continue(message: pb.ProcessingRequest) -> pb.ProcessingResponse:
    """A no-op answer to whatever phase Envoy sent (e.g. response trailers)."""
    phase = message.WhichOneof("request")
    if phase in ("request_headers", "response_headers"):
        return pb.ProcessingResponse(**{phase: pb.HeadersResponse()})
    if phase in ("request_body", "response_body"):
        return pb.ProcessingResponse(**{phase: pb.BodyResponse()})
    return pb.ProcessingResponse(**{phase: pb.TrailersResponse()})
