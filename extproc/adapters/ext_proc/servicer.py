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
   (release_outcome.py); a failure marks the endpoint down at once, a
   refusal as full cuts its limit. The
   stream then stays open, silent, until the response has finished or the
   client has gone; its end is the request's completion, which keeps the
   gate's in-flight count exact at no per-chunk cost.
5. A request of a preemptible class also has its response headers sent;
   until they come the core may preempt it (``core/preemption.py``), and
   the stream answers 503 ``preempted`` itself: Envoy sends that to the
   client and resets the request to the engine, which aborts it.

Attached by ext_proc alone — a Gateway API Inference Extension gateway, whose
filter sends the body and reads the pick back (docs/epp.md) — there is no
metadata: the body is read from the stream (``request_fields.py``) in the
gateway's body mode, the request held the same way, and the release answered
as the Endpoint Picker Protocol says (``epp.py``): the endpoint and its
fallbacks in a header and in ``envoy.lb`` metadata, the body passed back
unchanged, the protocol's statuses for a refusal.

For ``engine_priority`` models only, the CONTINUE also switches the stream to
a buffered request body (ext_proc ``mode_override``): Envoy then sends the
body, which comes back with the band's ``priority`` written in (priority_body.py).

A model with prefix signatures (``models[].prefix``, or ``policy: locality``)
needs its prompt before the hold, to queue the request with its signature
(prompt_prefix.py). Attached by ext_proc alone the body is already read.
Behind our own Envoy the headers are answered at once, without a decision,
switching the stream to a buffered body (and the response headers sent: a
mode can be overridden only in a headers reply, and whether a release is
checked is known only at the release); the request is held on the body
message, and the release answers it: the routing headers, and the
``priority`` rewrite, go in the body reply. Envoy keeps the headers until
then: in BUFFERED mode its headers reply does not continue the request
("we're not ready to continue processing because then we won't be able to
modify the headers any more"), and the body reply applies header mutations,
checks Content-Length against a mutated body and clears the route cache
(``ProcessorState::handleHeadersResponse`` and ``handleBodyResponse`` in
envoyproxy/envoy source/extensions/filters/http/ext_proc/processor_state.cc at
055a650d3bfa4b2cad214cdb649eee0d85051b28; ``Filter::onReceiveMessage`` in
ext_proc.cc honours ``mode_override`` only ``inHeaderProcessState()``). An
operator's own filter may instead put the leading text into
``extproc.prompt_prefix`` metadata: then the body is not sent. Every other
model stays headers-only.

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
stream is acknowledged (``override_message_timeout``) before any other work.
Only when the loop has stayed late long enough to call it sustained overload
(``shedding.py``) is a new request answered ``overloaded``, and then only one
of the lowest class present: its class is decided first, from the headers
and our metadata, so that a shed stream gets one reply and an admitted one
its acknowledgement.

A request that does not reach the engine ends in one of the core's named
refusals (``core/outcomes.py``); what the client hears for each — HTTP status,
OpenAI-style JSON error, ``Retry-After`` — comes from ``adapters/answers.py``,
the table Envoy's own answers use too.
"""

from __future__ import annotations

import asyncio
import fnmatch
import json
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf import duration_pb2

from extproc.adapters.answers import ANSWERS, SHED, answer_headers, error_body, retry_after_s
from extproc.adapters.config import Config, ModelConfig
from extproc.adapters.engines.dialects import DIALECTS
from extproc.adapters.ext_proc import epp
from extproc.adapters.ext_proc.contract import (
    DESTINATION_HEADER,
    PROCESSING_MODE,
    QUEUE_WAIT_HEADER,
    hold_timeout_for,
)
from extproc.adapters.ext_proc.loop_lag import LoopLag
from extproc.adapters.ext_proc.priority_body import with_priority
from extproc.adapters.ext_proc.prompt_prefix import Signer
from extproc.adapters.ext_proc.release_outcome import engine_answer
from extproc.adapters.ext_proc.request_fields import (
    NO_PROMPT,
    RequestFields,
    from_body,
    from_metadata,
    max_tokens,
    prompt_from_metadata,
    prompt_of,
)
from extproc.adapters.ext_proc.shedding import Shedding
from extproc.adapters.telemetry import UNKNOWN_MODEL, Admitted, ServedElsewhere, Signed, Telemetry, TurnedAway
from extproc.core.dispatcher import Held, ModelDispatcher, shutting_down
from extproc.core.entitlement import grant
from extproc.core.outcomes import Refusal, Refused
from extproc.core.prefix import NO_PREFIX, Prefix
from extproc.core.report import RequestEvent, Step

_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
# From this loop lag on, a stream is acknowledged before it is decided: the
# acknowledgement is the cheapest reply that stops Envoy's message timer. A loop
# this late on every probe for long enough is overloaded (shedding.py).
ACK_LAG_S = 0.05
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
# A model with prefix signatures behind our Envoy: the headers answered at once, the body
# wanted before the hold (and the response headers, as the release may be checked).
_PROMPT_FIRST = pb.ProcessingResponse(request_headers=pb.HeadersResponse(), mode_override=_OVERRIDES[(True, True)])


@dataclass(frozen=True)
class Admission:
    model: str
    tenant: str
    band: int
    # The band the request asked for, when it was downgraded.
    requested: int | None = None
    # The model name the body asked for, as counted (a served name or the pattern it matched).
    name: str = ""
    ttft_objective_s: float | None = None
    # The client says it is a retry (identity.retry_headers): never preempted.
    retried: bool = False


def is_pattern(name: str) -> bool:
    """Whether a served name is a shell-style pattern rather than one name."""
    return any(c in name for c in "*?[")


class ModelNames:
    """Which configured model serves a requested name: its own name, a served name, or a pattern.

    Exact names first, then the patterns in the order the config lists them.
    Returns the model and the name to count it under (bounded by the config:
    a client-chosen name never becomes a label value itself).
    """

    def __init__(self, models: tuple[ModelConfig, ...]) -> None:
        names = [(n, m.name) for m in models for n in (m.name, *m.served_names)]
        self._exact = {n: model for n, model in names if not is_pattern(n)}
        self._patterns = [(n, model) for n, model in names if is_pattern(n)]

    def resolve(self, name: str) -> tuple[str, str] | None:
        """(model, counted name) for the requested ``name``; None if no model serves it."""
        model = self._exact.get(name)
        if model is not None:
            return model, name
        return next(((m, pattern) for pattern, m in self._patterns if fnmatch.fnmatchcase(name, pattern)), None)

    def listed(self) -> list[str]:
        """The names a client can ask for by name (``GET /v1/models``)."""
        return list(self._exact)


def _duration(seconds: float) -> duration_pb2.Duration:
    duration = duration_pb2.Duration()
    duration.FromMilliseconds(round(seconds * 1000))
    return duration


def _header(name: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=name, raw_value=value.encode()), append_action=_OVERWRITE
    )


def error_response(refused: Refused, status: int | None = None) -> pb.ProcessingResponse:
    """An OpenAI-style JSON error that Envoy sends to the client in place of the engine's answer."""
    body = error_body(refused.refusal, refused.message, refused.param)
    retry_after = retry_after_s(refused.refusal, refused.drain_s)
    headers = [_header("content-type", "application/json"),
               *(_header(key, value) for key, value in answer_headers(refused.refusal, retry_after))]
    if refused.queue_wait_s is not None:
        headers.append(_header(QUEUE_WAIT_HEADER, str(round(refused.queue_wait_s * 1000))))
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status or ANSWERS[refused.refusal].status),
            headers=pb.HeaderMutation(set_headers=headers),
            body=json.dumps(body).encode(),
            details=refused.refusal.value,
        )
    )


def _models_response(names: list[str]) -> pb.ProcessingResponse:
    """``GET /v1/models`` answered from the configuration: the models this gateway routes."""
    body = {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "extproc"} for name in names]}
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


def _content_length(headers: dict[str, str]) -> int | None:
    """The declared body size; None when absent (chunked) or not plain ASCII digits."""
    value = headers.get("content-length", "")
    return int(value) if value.isascii() and value.isdigit() else None


def _first(headers: dict[str, str], names: tuple[str, ...]) -> str:
    """The value of the first of ``names`` present (empty: none is)."""
    return next((headers[n] for n in names if headers.get(n)), "")


_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
_BUFFERED_MODES = (processing_mode_pb2.ProcessingMode.BUFFERED, processing_mode_pb2.ProcessingMode.BUFFERED_PARTIAL)
_HEADERS_GO_ON = pb.ProcessingResponse(request_headers=pb.HeadersResponse())
# Refusals the dispatcher makes (and counts) itself: a queue cap.
_QUEUE_CAPS = frozenset({Refusal.TENANT_QUEUE_FULL, Refusal.BAND_QUEUE_FULL, Refusal.MODEL_QUEUE_FULL})


class Stream:
    """One request as its ext_proc stream brings it: by our metadata, or by its body (ext_proc alone).

    ``fields`` is what the scheduler reads, whichever way it came; ``body``
    is kept only when the stream must give it back (full duplex) or rewrite it.
    """

    def __init__(self, first: pb.ProcessingRequest) -> None:
        metadata = from_metadata(first)
        # Attached by ext_proc alone (no json_to_metadata in front): the Endpoint Picker Protocol applies.
        self.epp = metadata is None
        self.fields = metadata or RequestFields()
        # The prompt, undecoded, until the request is signed (or an operator's metadata text).
        self.prompt = (prompt_from_metadata(first) if metadata is not None else None) or NO_PROMPT
        self.body = b""
        # Behind our Envoy, the body was read before the hold: the release answers the body message.
        self.body_first = False
        config = first.protocol_config
        self.duplex = self.epp and config.request_body_mode == _DUPLEX
        self.buffered = self.epp and config.request_body_mode in _BUFFERED_MODES
        self.response_duplex = self.epp and config.response_body_mode == _DUPLEX
        self.has_body = not first.request_headers.end_of_stream
        self.subset = epp.subset_hint(first) if self.epp else None

    async def read_body(self, messages: AsyncIterator[pb.ProcessingRequest], declared: int | None,
                        limit: int) -> None:
        """Take in the body and its fields from the stream; raises Refused."""
        self.body = await _body(messages, declared, limit)
        self.fields, self.prompt = from_body(self.body)

    async def read_prompt(self, messages: AsyncIterator[pb.ProcessingRequest], declared: int | None,
                          limit: int) -> None:
        """Take in the body for its prompt only: its fields came by metadata; raises Refused."""
        self.body = await _body(messages, declared, limit)
        self.prompt = prompt_of(self.body)
        self.body_first = True


async def _body(messages: AsyncIterator[pb.ProcessingRequest], declared: int | None, limit: int) -> bytes:
    """The body from the stream (its end, or the request's trailers, ends it); raises Refused."""
    if declared is not None and declared > limit:
        raise _too_large(declared, limit)
    chunks, size = [], 0
    async for message in messages:
        if message.HasField("request_trailers"):
            break
        if not message.HasField("request_body"):
            continue
        chunk = message.request_body
        size += len(chunk.body)
        if size > limit:
            raise _too_large(size, limit)
        chunks.append(chunk.body)
        if chunk.end_of_stream:
            break
    return b"".join(chunks)


def _too_large(size: int, limit: int) -> Refused:
    return Refused(Refusal.BODY_TOO_LARGE,
                   f"the request body has {size} bytes or more; this gateway takes at most {limit} "
                   "(endpoint_picker.max_body_bytes)")


def _without_body_mode() -> Refused:
    return Refused(Refusal.MODEL_MISSING, "the processor needs the request body: the ext_proc filter must send it "
                   "(request_body_mode BUFFERED or FULL_DUPLEX_STREAMED), or json_to_metadata copy its fields")


class Processor:
    """What Envoy's ext_proc filter talks to: one :meth:`process` per stream.

    It turns a stream's messages into a decision the core can make (who asks,
    for which model, how urgently) and the core's outcome back into Envoy's
    answers; it holds nothing itself but the stream, so a held request costs
    its open stream and its queue entry only.
    """

    def __init__(self, config: Config, dispatchers: dict[str, ModelDispatcher], telemetry: Telemetry) -> None:
        self._dispatchers = dispatchers
        self._telemetry = telemetry
        self.draining = False
        self.lag = LoopLag(late_s=ACK_LAG_S)
        self.shedding = self._shedding(config)
        self._config = config
        self._derive(config)

    def _shedding(self, config: Config) -> Shedding:
        dispatchers = self._dispatchers
        return Shedding(len(config.bands), config.envoy.message_timeout_ms / 1000,
                        lambda band: sum(d.queued_in(band) for d in dispatchers.values()))

    def reconfigure(self, config: Config) -> None:
        """Read ``config`` from the next request on (a reload: adapters/reload.py); held streams keep their dispatcher.

        The dispatchers (the same dict) must already hold its models. Shedding
        keeps its history unless the classes or the message timeout changed.
        """
        old = self._config
        if (old.band_names, old.envoy.message_timeout_ms) != (config.band_names, config.envoy.message_timeout_ms):
            self.shedding = self._shedding(config)
        self._config = config
        self._derive(config)

    def _derive(self, config: Config) -> None:
        """What the processor keeps prebuilt from the config."""
        self._names = ModelNames(config.models)
        # Prebuilt, like the two replies below: one is sent to every request that has to wait.
        self._hold_reply = {
            m.name: pb.ProcessingResponse(override_message_timeout=_duration(hold_timeout_for(config.longest_queue_wait_s(m))))
            for m in config.models
        }
        self._engine_priority_models = {m.name for m in config.models if m.engine_priority}
        self._full_statuses = {m.name: DIALECTS[m.engine].full_statuses for m in config.models}
        self._signers = {m.name: Signer(m) for m in config.models if m.prefix is not None}
        # Prebuilt: under a burst these are sent to every arrival, so they cost no construction.
        self._acknowledgement = max(
            self._hold_reply.values(), key=lambda reply: reply.override_message_timeout.ToMilliseconds()
        )
        overloaded = Refused(
            Refusal.OVERLOADED, "the gateway is overloaded and refuses the lowest class of requests first; retry shortly"
        )
        self._overloaded = error_response(overloaded)
        self._overloaded_epp = error_response(overloaded, config.endpoint_picker.shed_status)

    def admit(self, headers: dict[str, str], fields: RequestFields) -> Admission:
        """Who asks, for which model, how urgently — or why not (raises Refused)."""
        identity = self._config.identity
        if self.draining:
            raise shutting_down()
        if fields.model is None:
            raise Refused(
                Refusal.MODEL_MISSING,
                "the request body must be JSON (content-type: application/json) with a 'model' field",
            )
        resolved = self._names.resolve(fields.model)
        if resolved is None:
            known = ", ".join(sorted(self._names.listed()))
            raise Refused(Refusal.MODEL_NOT_FOUND, f"the model {fields.model!r} does not exist; served models: {known}")
        model, name = resolved
        tenant = headers.get(identity.tenant_header) or _first(headers, identity.fairness_id_headers)
        if not tenant:
            if identity.missing_tenant == "reject":
                raise Refused(Refusal.TENANT_MISSING, "the request carries no tenant identity; authenticate first")
            tenant = identity.default_tenant
        # The band: what it asks for, limited by the tenant's entitlement (core/entitlement.py decides).
        granted = grant(self._config.band_names, self._config.tenant(tenant), tenant, self._asked(headers, fields))
        retried = _first(headers, identity.retry_headers).strip() not in ("", "0")
        return Admission(model, tenant, granted.band, granted.requested, name, self._ttft_objective_s(headers), retried)

    def _asked(self, headers: dict[str, str], fields: RequestFields) -> str:
        """The class the request asks for: the priority header, else its objective, else the body's priority."""
        identity = self._config.identity
        asked = headers.get(identity.priority_header, "").strip().lower()
        if asked:
            return asked
        objective = _first(headers, identity.objective_headers).strip()
        if objective:
            return identity.objectives.get(objective, "")
        priority = fields.priority
        if isinstance(priority, str):
            return priority.strip().lower()
        if isinstance(priority, int) and not isinstance(priority, bool):  # the engine's number for a class
            return next((b.name for b in self._config.bands if b.engine_priority == priority), "")
        return ""

    def _ttft_objective_s(self, headers: dict[str, str]) -> float | None:
        names = self._config.identity.ttft_headers
        written = _first(headers, names).strip()
        if not written:
            return None
        try:
            ms = float(written)
        except ValueError:
            ms = math.nan
        if not (math.isfinite(ms) and ms > 0):
            header = next(n for n in names if headers.get(n))
            raise Refused(Refusal.INVALID_TTFT_OBJECTIVE, f"{header} must be a number of milliseconds > 0, "
                          f"got {json.dumps(written[:40])}", param=header)
        return ms / 1000

    def _eligible(self, stream: Stream, dispatcher: ModelDispatcher) -> frozenset[str] | None:
        """Where a request attached by ext_proc alone may go; raises Refused where nowhere can take it.

        The protocol: pick only inside the gateway's subset hint, and 503 when
        it is empty or names no endpoint of the pool, or no endpoint is ready.
        """
        if not stream.epp:
            return None
        eligible = None
        if stream.subset is not None:
            eligible = frozenset(e for e in dispatcher.endpoints if epp.host_port(e) in stream.subset)
            if not eligible:
                raise Refused(Refusal.NO_ENDPOINT, "none of the endpoints in the gateway's subset hint "
                              f"({', '.join(sorted(stream.subset)) or 'empty'}) is an endpoint of this pool")
        if not dispatcher.serves(eligible):
            raise Refused(Refusal.NO_ENDPOINT, f"no endpoint of model {dispatcher.name!r}"
                          f"{' in the subset hint' if eligible else ''} is up; retry shortly")
        return eligible

    async def process(self, requests: AsyncIterator[pb.ProcessingRequest]) -> AsyncIterator[pb.ProcessingResponse]:
        """One stream: read the request, admit it, hold it until the dispatcher decides, then follow the response."""
        messages = aiter(requests)
        first = await anext(messages, None)
        if first is None:
            return
        if not first.HasField("request_headers"):  # not our processing mode: stay out of the way
            yield _continue(first)
            async for message in messages:
                yield _continue(message)
            return
        stream = Stream(first)
        now = asyncio.get_running_loop().time()
        # Sustained overload (shedding.py): then the class decides before any reply, else the acknowledgement goes first.
        overloaded = self.shedding.overloaded(self.lag.late_for(now))
        # Only our own Envoy allows a longer message timeout; a gateway's own is long (AI Gateway: 300 s).
        acknowledged = self.lag.seconds(now) >= ACK_LAG_S and not stream.epp
        if acknowledged and not overloaded:
            yield self._acknowledgement
        headers = _headers_of(first.request_headers)
        del first
        if headers.get(":method") == "GET" and headers.get(":path", "").split("?")[0] == "/v1/models":
            yield _models_response(self._names.listed())
            return
        try:
            async for reply in self._read(stream, messages, headers):
                yield reply
            admission = self.admit(headers, stream.fields)
            if self._sheds(admission):
                yield self._overloaded_epp if stream.epp else self._overloaded
                return
            if acknowledged and overloaded:
                yield self._acknowledgement
            prefix = NO_PREFIX
            signer = self._signers.get(admission.model)
            if signer is not None:
                async for reply in self._read_prompt(stream, messages, headers):
                    yield reply
                if stream.body_first:  # the acknowledgement stopped the headers' timer, not the body's
                    acknowledged = self.lag.seconds(asyncio.get_running_loop().time()) >= ACK_LAG_S
                    if acknowledged:
                        yield self._acknowledgement
                prefix = signer.sign(stream.prompt, stream.fields.prompt_cache_key)
                self._telemetry.report(admission.model)(Signed(len(prefix.blocks)))
            stream.prompt = NO_PROMPT  # its slices would keep the body alive through the hold
            dispatcher = self._dispatchers[admission.model]
            held = self._submit(stream, headers, admission, dispatcher, prefix)
        except Refused as refused:
            if refused.refusal not in _QUEUE_CAPS:  # the dispatcher counts its own
                self._count_refusal(stream.fields.model, refused.refusal)
            yield self._answer(refused, stream)
            return
        # Not kept through the hold: a held request costs memory, 10,000 of them add up.
        del headers
        async for reply in self._hold(stream, messages, admission, dispatcher, held, acknowledged):
            yield reply

    async def _read(self, stream: Stream, messages: AsyncIterator[pb.ProcessingRequest],
                    headers: dict[str, str]) -> AsyncIterator[pb.ProcessingResponse]:
        """Attached by ext_proc alone, take the body in from the stream (what Envoy needs first, yielded)."""
        if not (stream.epp and stream.has_body):
            return
        if not (stream.duplex or stream.buffered):
            raise _without_body_mode()
        if stream.buffered:  # Envoy sends the buffered body only once the headers are answered
            yield _HEADERS_GO_ON
        await stream.read_body(messages, _content_length(headers), self._config.endpoint_picker.max_body_bytes)

    async def _read_prompt(self, stream: Stream, messages: AsyncIterator[pb.ProcessingRequest],
                           headers: dict[str, str]) -> AsyncIterator[pb.ProcessingResponse]:
        """Behind our Envoy, take in the body of a model with signatures before the hold (unless metadata had the text)."""
        if stream.epp or not stream.has_body or stream.prompt.text is not None:
            return
        yield _PROMPT_FIRST
        await stream.read_prompt(messages, _content_length(headers), self._config.endpoint_picker.max_body_bytes)

    def _submit(self, stream: Stream, headers: dict[str, str], admission: Admission, dispatcher: ModelDispatcher,
                prefix: Prefix) -> Held:
        """Queue the admitted request (raises Refused: its inputs, its subset, or a queue cap)."""
        limit = max_tokens(stream.fields)
        eligible = self._eligible(stream, dispatcher)
        self._count_admission(admission)
        if not stream.duplex and admission.model not in self._engine_priority_models:
            stream.body = b""  # buffered and passed on as it is: not worth its memory through the hold
        return dispatcher.submit(
            admission.tenant, admission.band,
            content_length=_content_length(headers), max_tokens=limit,
            # OpenAI's prompt_cache_key names requests that share a prompt prefix; without
            # it, a tenant's requests stick together (they often share a system prompt).
            affinity=stream.fields.prompt_cache_key or "", prefix=prefix,
            eligible=eligible, ttft_objective_s=admission.ttft_objective_s, retried=admission.retried,
        )

    async def _hold(self, stream: Stream, messages: AsyncIterator[pb.ProcessingRequest], admission: Admission,
                    dispatcher: ModelDispatcher, held: Held, acknowledged: bool) -> AsyncIterator[pb.ProcessingResponse]:
        """Hold until the dispatcher decides, answer the release, then stay on the stream until it ends."""
        engine_priority = self._engine_priority(admission)
        # One try for the whole hold: the stream can be cancelled (client gone) at
        # any await or yield, and the request must leave the queue or the gate then.
        try:
            if not held.future.done() and not acknowledged and not stream.epp:
                yield self._hold_reply[admission.model]
            try:
                waited = await held.future
            except Refused as refused:
                yield self._answer(refused, stream)
                return
            routing = [_header(QUEUE_WAIT_HEADER, str(round(waited * 1000)))]
            if stream.epp:
                for reply in self._release_epp(stream, held, routing, engine_priority):
                    yield reply
            else:
                routing.append(_header(self._config.identity.model_header, admission.model))
                destination = epp.host_port(held.endpoint) if held.endpoint else None
                if destination:
                    routing.append(_header(DESTINATION_HEADER, destination))
                if stream.body_first:
                    yield _body_release(stream.body, routing, engine_priority)
                    stream.body = b""
                else:
                    yield pb.ProcessingResponse(
                        request_headers=pb.HeadersResponse(response=pb.CommonResponse(
                            header_mutation=pb.HeaderMutation(set_headers=routing), clear_route_cache=True,
                        )),
                        # A preemptible request's response headers say when it can no longer be preempted.
                        mode_override=_OVERRIDES.get((engine_priority is not None,
                                                      held.checked or held.preempted is not None)),
                    )
            async for message in _until_preempted(messages, held):
                for reply in self._after_release(stream, dispatcher, held, message, engine_priority):
                    yield reply
            if held.preempted is not None and held.preempted.done() and not held.started:
                yield self._answer(_preempted(), stream)
        finally:
            dispatcher.end(held)

    def _release_epp(self, stream: Stream, held: Held, routing: list[base_pb2.HeaderValueOption],
                     engine_priority: int | None) -> list[pb.ProcessingResponse]:
        """The release as the Endpoint Picker Protocol says: the endpoints in a header and in metadata."""
        fallbacks = held.fallbacks[:self._config.endpoint_picker.fallbacks]
        picked = [hp for e in (held.endpoint, *fallbacks) if e and (hp := epp.host_port(e))]
        metadata = None
        if picked:
            value = ",".join(picked)
            routing.append(_header(DESTINATION_HEADER, value))
            metadata = epp.destination_metadata(value)
        body = stream.body
        rewritten = with_priority(body, engine_priority) if engine_priority is not None else None
        if rewritten is not None:
            body = rewritten
            routing.append(_header("content-length", str(len(body))))  # Envoy checks a mutated body's length
        common = pb.CommonResponse(header_mutation=pb.HeaderMutation(set_headers=routing), clear_route_cache=True)
        if stream.duplex:
            return [pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=common), dynamic_metadata=metadata),
                    *epp.streamed_body("request_body", body)]
        if rewritten is not None:
            common.body_mutation.body = body
        # Buffered: the body message is the one Envoy waits on (a request without a body was refused: no model).
        return [pb.ProcessingResponse(request_body=pb.BodyResponse(response=common), dynamic_metadata=metadata)]

    def _after_release(self, stream: Stream, dispatcher: ModelDispatcher, held: Held, message: pb.ProcessingRequest,
                       engine_priority: int | None) -> list[pb.ProcessingResponse]:
        """The answers to a message after the release: the response's headers tell how the release went."""
        if message.HasField("request_body") and engine_priority is not None and not stream.epp:
            return [_priority_body(message.request_body.body, engine_priority)]
        if message.HasField("response_headers"):
            if stream.epp:
                served = epp.served_endpoint(message)
                endpoint = next((e for e in dispatcher.endpoints if epp.host_port(e) == served), None)
                if endpoint is not None and endpoint != held.endpoint:
                    self._telemetry.report(dispatcher.name)(ServedElsewhere())
                    dispatcher.record_served(held, endpoint)
            answer = engine_answer(_headers_of(message.response_headers), self._full_statuses[dispatcher.name])
            dispatcher.record_response(held, answer)
        elif message.HasField("response_body") and stream.response_duplex:  # passed back as it came
            return epp.streamed_body("response_body", message.response_body.body, message.response_body.end_of_stream)
        return [_continue(message)]

    def _answer(self, refused: Refused, stream: Stream) -> pb.ProcessingResponse:
        """The refusal as the client hears it; shed under load, the protocol's status for an Endpoint Picker."""
        shed = stream.epp and refused.refusal in SHED
        return error_response(refused, self._config.endpoint_picker.shed_status if shed else None)

    def _count_admission(self, admission: Admission) -> None:
        names = self._config.band_names
        downgraded = None if admission.requested is None else (names[admission.requested], names[admission.band])
        self._telemetry.report(admission.model)(Admitted(admission.name, *(downgraded or (None, None))))

    def _sheds(self, admission: Admission) -> bool:
        """Whether to refuse the admitted request ``overloaded`` (shedding.py), counted if so.

        Asked again after the body was read (ext_proc alone), which takes its own time.
        Its tenant and class are known: counted as a refusal at the queue's door.
        """
        now = asyncio.get_running_loop().time()
        if not self.shedding.arrived(admission.band, now, self.shedding.overloaded(self.lag.late_for(now))):
            return False
        band = self._config.band_names[admission.band]
        self._telemetry.report(admission.model)(
            RequestEvent(Step.REFUSED, band, admission.tenant, refusal=Refusal.OVERLOADED, dequeued=False))
        return True

    def _count_refusal(self, body_model: str | None, refusal: Refusal) -> None:
        """Count a refusal made before the request reached a dispatcher (which counts its own)."""
        # Client-chosen names never become label values: unbounded series would sink Prometheus.
        resolved = self._names.resolve(body_model) if body_model else None
        self._telemetry.report(resolved[0] if resolved else UNKNOWN_MODEL)(TurnedAway(refusal))

    def _engine_priority(self, admission: Admission) -> int | None:
        """The body ``priority`` to write for this request, or None (model without engine_priority)."""
        if admission.model not in self._engine_priority_models:
            return None
        return self._config.bands[admission.band].engine_priority


def _preempted() -> Refused:
    return Refused(Refusal.PREEMPTED, "a request of a higher priority class needed the engine before this one's "
                   "response began; retry (it will not be preempted again)")


async def _until_preempted(messages: AsyncIterator[pb.ProcessingRequest], held: Held) -> AsyncIterator[pb.ProcessingRequest]:
    """The stream's messages after the release, until it ends or ``held`` is preempted before its response began.

    Only a preemptible request pays for the race (a task per message until its
    response headers come); every other stream reads its messages plainly.
    The reading task is this stream's to end and its outcome this stream's to
    take, however the wait ends: preempted, or cancelled (the client gone, the
    server stopping). Left behind, it waits on a dead stream until it is
    destroyed pending, or it ends (StopAsyncIteration: Envoy half-closes a
    stream just before resetting it) with an exception nobody retrieves.
    """
    preempted = held.preempted
    while preempted is not None and not held.started:
        following = asyncio.ensure_future(anext(messages))
        try:
            await asyncio.wait((following, preempted), return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # cancelled: the stream ends here, and the reader with it
            await _end_reader(following)
            raise
        if not following.done():  # preempted: the stream ends with our answer
            await _end_reader(following)
            return
        try:
            message = following.result()
        except StopAsyncIteration:
            return
        yield message
    async for message in messages:
        yield message


async def _end_reader(reader: asyncio.Future[pb.ProcessingRequest]) -> None:
    """Cancel ``reader`` (if still reading) and wait for it, taking its outcome: a message, the stream's end, an error."""
    reader.cancel()
    await asyncio.gather(reader, return_exceptions=True)


def _priority_body(body: bytes, priority: int) -> pb.ProcessingResponse:
    """The body reply of an ``engine_priority`` model: its ``priority`` written in."""
    return _body_release(body, [], priority)


def _body_release(body: bytes, routing: list[base_pb2.HeaderValueOption], priority: int | None) -> pb.ProcessingResponse:
    """The answer to a buffered body: ``routing`` set (the route recomputed), and the engine priority written in."""
    rewritten = with_priority(body, priority) if priority is not None else None
    headers = list(routing)
    if rewritten is not None:  # None: no priority to write, or not a JSON object (the engine will say so itself)
        # Envoy refuses a mutated body whose length disagrees with Content-Length (503).
        headers.append(_header("content-length", str(len(rewritten))))
    if not headers:
        return pb.ProcessingResponse(request_body=pb.BodyResponse())
    common = pb.CommonResponse(header_mutation=pb.HeaderMutation(set_headers=headers), clear_route_cache=bool(routing))
    if rewritten is not None:
        common.body_mutation.body = rewritten
    return pb.ProcessingResponse(request_body=pb.BodyResponse(response=common))


def _continue(message: pb.ProcessingRequest) -> pb.ProcessingResponse:
    """A no-op answer to whatever phase Envoy sent (e.g. response trailers)."""
    phase = message.WhichOneof("request")
    if phase in ("request_headers", "response_headers"):
        return pb.ProcessingResponse(**{phase: pb.HeadersResponse()})
    if phase in ("request_body", "response_body"):
        return pb.ProcessingResponse(**{phase: pb.BodyResponse()})
    return pb.ProcessingResponse(**{phase: pb.TrailersResponse()})
