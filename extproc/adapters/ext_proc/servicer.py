"""The ext_proc stream: one gRPC stream per HTTP request passing through Envoy.

Transport-independent: :meth:`Processor.process` turns the stream's messages
into replies; a gRPC server of adapters/grpc/ carries them (server.py wires the two).

What every request shares is here: the request is read (by its attachment),
admitted (``admission.py``: who asks, for which model, how urgently), signed
when its model has prefix signatures (``request/prompt_prefix.py``), queued with its
model's dispatcher and held until the dispatcher decides; then released, and
followed until the stream ends, which is the request's completion (the
gate's in-flight count stays exact at no per-chunk cost). A client that
leaves while queued cancels the stream; the cancellation removes its entry
from the queue at once.

How a request arrives and leaves depends on how Envoy attached the processor
(``attach/``): our own Envoy, whose metadata carries the body's fields, or a
gateway's Endpoint Picker filter, which sends the body. The attachment is
picked per stream, by whether our metadata came; the shape of each reply
follows the body modes Envoy declared for the stream.

A preemptible request's response headers are sent; until they come the core
may preempt it (``core/preemption.py``), and the stream answers 503
``preempted`` itself (``follow.py``, which answers the stream after the
release): Envoy sends that to the client and resets the request to the
engine, which aborts it.

What the stream reads of its model is a narrow view (``attach/served.py``) of the
model's runtime (``adapters/runtime.py``). With tenant budgets one gate
stands around the submit (``adapters/budgets/gate.py``): asked before the
request is queued (it may refuse or downgrade it), told at the request's end.

Under a burst the first reply must still reach Envoy within its
``message_timeout``: while the event loop runs late (``loop_lag.py``) the
stream is acknowledged (``override_message_timeout``, where the attachment
has one) before any other work. Only when the loop has stayed late long
enough to call it sustained overload (``shedding.py``) is a new request
answered ``overloaded``, and then only one of the lowest class present: its
class is decided first, so that a shed stream gets one reply and an admitted
one its acknowledgement.

A request that does not reach the engine ends in one of the core's named
refusals (``core/values/outcomes.py``); what the client hears for each comes from
``adapters/protocol/answers.py`` (``replies.py``), in its attachment's statuses.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.adapters.config import Config
from extproc.adapters.ext_proc.attach.base import Attachment, Stream
from extproc.adapters.ext_proc.attach.endpoint_picker import EndpointPicker
from extproc.adapters.ext_proc.attach.own_envoy import OwnEnvoy
from extproc.adapters.ext_proc.attach.replies import content_length, headers_of, models_response, passed
from extproc.adapters.ext_proc.attach.served import ServedModel
from extproc.adapters.ext_proc.follow import follow
from extproc.adapters.ext_proc.loop_lag import LoopLag
from extproc.adapters.ext_proc.shedding import Shedding
from extproc.adapters.request.admission import Admission, Admissions
from extproc.adapters.request.request_fields import NO_PROMPT, from_metadata, max_tokens
from extproc.adapters.telemetry import UNKNOWN_MODEL, Admitted, Signed, Telemetry, TurnedAway
from extproc.core.held import Held
from extproc.core.prefix import NO_PREFIX, Prefix
from extproc.core.values.outcomes import Refusal, Refused, shutting_down
from extproc.core.values.report import RequestEvent, Step

if TYPE_CHECKING:  # imported where a budgets: section is configured (_budgets)
    from extproc.adapters.budgets.gate import BudgetGate

# From this loop lag on, a stream is acknowledged before it is decided: the
# acknowledgement is the cheapest reply that stops Envoy's message timer. A loop
# this late on every probe for long enough is overloaded (shedding.py).
ACK_LAG_S = 0.05
# Refusals the dispatcher makes (and counts) itself: a queue cap.
_QUEUE_CAPS = frozenset({Refusal.TENANT_QUEUE_FULL, Refusal.BAND_QUEUE_FULL, Refusal.MODEL_QUEUE_FULL})


class Processor:
    """What Envoy's ext_proc filter talks to: one :meth:`process` per stream.

    It turns a stream's messages into a decision the core can make (who asks,
    for which model, how urgently) and the core's outcome back into Envoy's
    answers; it holds nothing itself but the stream, so a held request costs
    its open stream and its queue entry only.
    """

    def __init__(self, config: Config, models: Mapping[str, ServedModel], telemetry: Telemetry) -> None:
        """``models``: each configured model's view by name, read live (a reload changes it in place)."""
        self._models = models
        self._telemetry = telemetry
        self.draining = False
        self.lag = LoopLag(late_s=ACK_LAG_S)
        self.shedding = self._shedding(config)
        self._config = config
        self.budgets: BudgetGate | None = None
        self._budgets(config)
        self._derive(config)

    def _shedding(self, config: Config) -> Shedding:
        models = self._models
        return Shedding(len(config.bands), config.envoy.message_timeout_ms / 1000,
                        lambda band: sum(m.dispatcher.queued_in(band) for m in models.values()))

    def reconfigure(self, config: Config) -> None:
        """Read ``config`` from the next request on (a reload: adapters/reload.py); held streams keep their model's view.

        The models (the same mapping) must already hold its models. Shedding
        keeps its history unless the classes or the message timeout changed.
        """
        old = self._config
        if (old.band_names, old.envoy.message_timeout_ms) != (config.band_names, config.envoy.message_timeout_ms):
            self.shedding = self._shedding(config)
        self._config = config
        self._budgets(config)
        self._derive(config)

    def _budgets(self, config: Config) -> None:
        """Tenant budgets (config.budgets): the gate around each submit, kept through reloads (its counts are the
        tenants' usage)."""
        if config.budgets is None:
            self.budgets = None
        elif self.budgets is None:
            from extproc.adapters.budgets.gate import BudgetGate  # an optional feature: loaded where configured

            self.budgets = BudgetGate(config.budgets, len(config.bands) - 1)
        else:
            self.budgets.reconfigure(config.budgets, len(config.bands) - 1)

    def _derive(self, config: Config) -> None:
        """What the processor keeps prebuilt from the config: the admission and both attachments."""
        self.admissions = Admissions(config)
        self.own_envoy = OwnEnvoy(config)
        self.endpoint_picker = EndpointPicker(config)

    async def process(self, requests: AsyncIterator[pb.ProcessingRequest]) -> AsyncIterator[pb.ProcessingResponse]:
        """One stream: read the request, admit it, hold it until the dispatcher decides, then follow the response."""
        messages = requests  # an iterator already: read as it is
        first = await anext(messages, None)
        if first is None:
            return
        if not first.HasField("request_headers"):  # not our processing mode: stay out of the way
            yield passed(first)
            async for message in messages:
                yield passed(message)
            return
        metadata = from_metadata(first)
        side: Attachment = self.own_envoy if metadata is not None else self.endpoint_picker
        stream = side.open(first, metadata)
        now = asyncio.get_running_loop().time()
        # Sustained overload (shedding.py): then the class decides before any reply, else the acknowledgement goes first.
        overloaded = self.shedding.overloaded(self.lag.late_for(now))
        ack = side.acknowledgement
        acknowledged = ack is not None and self.lag.seconds(now) >= ACK_LAG_S
        if acknowledged and not overloaded:
            yield ack
        headers = headers_of(first.request_headers)
        del first
        if headers.get(":method") == "GET" and headers.get(":path", "").split("?")[0] == "/v1/models":
            yield models_response(self.admissions.names.listed())
            return
        budgets = self.budgets  # the gate around the submit: a budget over its limit refuses (raises) or downgrades
        try:
            if side.reads(stream):  # else no generator: the fast path reads nothing more
                async for reply in side.read(stream, messages, headers):
                    yield reply
            if self.draining:
                raise shutting_down()
            admission = self.admissions.admit(headers, stream.fields)
            if self._sheds(admission):
                yield side.overloaded
                return
            if acknowledged and overloaded:
                yield ack
            model = self._models[admission.model]
            dispatcher = model.dispatcher
            side.check_start(stream, model)
            prefix = NO_PREFIX
            signer = model.signer
            if signer is not None:
                async for reply in side.read_prompt(stream, messages, headers):
                    yield reply
                if stream.held_on_body and ack is not None:  # the acknowledgement stopped the headers' timer, not the body's
                    acknowledged = self.lag.seconds(asyncio.get_running_loop().time()) >= ACK_LAG_S
                    if acknowledged:
                        yield ack
                prefix = signer.sign(stream.prompt, stream.fields.prompt_cache_key)
                model.report(Signed(len(prefix.blocks)))
            stream.prompt = NO_PROMPT  # its slices would keep the body alive through the hold
            if budgets is not None:
                admission = await budgets.enter(admission, stream, dispatcher, content_length(headers))
            held = self._submit(side, stream, headers, admission, model, prefix)
        except Refused as refused:
            if budgets is not None:
                budgets.leave(stream, None)
            if refused.refusal not in _QUEUE_CAPS:  # the dispatcher counts its own
                self._count_refusal(stream.fields.model, refused.refusal)
            yield side.refusal(refused)
            return
        # Not kept through the hold: a held request costs memory, 10,000 of them add up. For that too the hold
        # runs here, in this generator's frame, not in one of its own.
        del headers
        # One try for the whole hold: the stream can be cancelled (client gone) at
        # any await or yield, and the request must leave the queue or the gate then.
        try:
            if not held.future.done() and not acknowledged:
                hold = side.hold_reply(model)
                if hold is not None:
                    yield hold
            try:
                waited = await held.future
            except Refused as refused:
                yield side.refusal(refused)
                return
            # A body read before the hold and dropped (nothing was to be written then) cannot be rewritten now.
            priority = None if stream.held_on_body and not stream.body else model.engine_priority(admission.band)
            for reply in side.release(stream, held, admission.model, waited, priority):
                yield reply
            async for reply in follow(side, stream, messages, model, held, priority):
                yield reply
        finally:
            dispatcher.end(held)
            if budgets is not None:
                budgets.leave(stream, held)

    def _submit(self, side: Attachment, stream: Stream, headers: dict[str, str], admission: Admission,
                model: ServedModel, prefix: Prefix) -> Held:
        """Queue the admitted request (raises Refused: its inputs, where it may go, or a queue cap)."""
        limit = max_tokens(stream.fields)
        dispatcher = model.dispatcher
        eligible = side.eligible(stream, dispatcher)
        self._count_admission(admission, model)
        if not stream.duplex and dispatcher.priority_first is None:
            stream.body = b""  # neither given back nor rewritten: not worth its memory through the hold
        return dispatcher.submit(
            admission.tenant, admission.band,
            content_length=content_length(headers), max_tokens=limit,
            # OpenAI's prompt_cache_key names requests that share a prompt prefix; without
            # it, a tenant's requests stick together (they often share a system prompt).
            affinity=stream.fields.prompt_cache_key or "", prefix=prefix,
            eligible=eligible, ttft_objective_s=admission.ttft_objective_s, retried=admission.retried,
            whole=not stream.fields.stream,
            tag=admission.batch_line,
        )

    def _count_admission(self, admission: Admission, model: ServedModel) -> None:
        names = self._config.band_names
        downgraded = None if admission.requested is None else (names[admission.requested], names[admission.band])
        model.report(Admitted(admission.name, *(downgraded or (None, None))))

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
            RequestEvent(Step.REFUSED, band, admission.tenant, refusal=Refusal.OVERLOADED, dequeued=False,
                         tag=admission.batch_line))
        return True

    def _count_refusal(self, body_model: str | None, refusal: Refusal) -> None:
        """Count a refusal made before the request reached a dispatcher (which counts its own)."""
        # Client-chosen names never become label values: unbounded series would sink Prometheus.
        resolved = self.admissions.names.resolve(body_model) if body_model else None
        self._telemetry.report(resolved[0] if resolved else UNKNOWN_MODEL)(TurnedAway(refusal))
