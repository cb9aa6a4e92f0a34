"""The Endpoint Picker: a Gateway API Inference Extension gateway's ext_proc filter, and nothing else of ours.

No metadata comes (no ``json_to_metadata`` in front): the body is read from
the stream in the gateway's body mode (``body.py``) and its fields decoded
(``request_fields.py``), then the request is admitted and held like any
other; the release speaks the Endpoint Picker Protocol (``epp_protocol.py``, docs/epp.md):

* in: the gateway's subset hint bounds the pick (an empty or foreign one, or
  one with no endpoint up while another endpoint of the pool is: 503 at
  once); with no endpoint of the pool up at all (scaled to zero, starting)
  the request is held as on any attachment, up to the model's
  ``cold_start_wait_s``; on the response, the endpoint that served it (a
  fallback taken: the count moves there and the pick is marked down);
* out: the picked endpoint and its fallbacks in
  ``x-gateway-destination-endpoint`` and in ``envoy.lb`` metadata, with the
  body passed back (``FULL_DUPLEX_STREAMED``, in chunks, and the response's
  chunks as they come) or left in place (``BUFFERED``);
* refusals: the protocol's statuses (a shed request:
  ``endpoint_picker.shed_status``, 429).

Nothing is sent while a request is held: the gateway sets its own long
message timeout (AI Gateway 300 s, Istio 1000 s) and allows no override. A
filter that sends no body (``NONE``, ``STREAMED``) leaves nothing to schedule
on: such a request is refused at once (400 ``model_missing``), and the first
one of each mode is logged.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.adapters.config import Config
from extproc.adapters.ext_proc.attach import body
from extproc.adapters.ext_proc.attach.base import Attachment, Stream
from extproc.adapters.ext_proc.attach.replies import content_length, error_response, header
from extproc.adapters.ext_proc.attach.served import ServedModel
from extproc.adapters.protocol import epp_protocol as epp
from extproc.adapters.protocol.answers import SHED
from extproc.adapters.protocol.contract import DESTINATION_HEADER, QUEUE_WAIT_HEADER
from extproc.adapters.request.request_fields import NO_FIELDS, NO_PROMPT, RequestFields, from_body
from extproc.adapters.telemetry import ServedElsewhere
from extproc.core.dispatcher import Held, ModelDispatcher
from extproc.core.values.outcomes import Refusal, Refused

log = logging.getLogger(__name__)

# Envoy sends a buffered body only once the headers are answered; this answer changes nothing.
_HEADERS_GO_ON = pb.ProcessingResponse(request_headers=pb.HeadersResponse())


def _without_body(mode: str) -> Refused:
    _told_without_body(mode)
    return Refused(Refusal.MODEL_MISSING, "the request names no model: the body must be JSON with a 'model' field "
                   f"(this processor received neither its fields nor the body: the gateway's request_body_mode {mode} "
                   "sends no body; it must be BUFFERED or FULL_DUPLEX_STREAMED)")


@functools.cache  # once per mode: a gateway set up so sends every request so
def _told_without_body(mode: str) -> None:
    log.warning("ext_proc streams arrive without our metadata and without their body (request_body_mode %s): "
                "answered 400 model_missing. As an Endpoint Picker the gateway's ext_proc filter must send the body "
                "(BUFFERED or FULL_DUPLEX_STREAMED); behind our own Envoy config, such a request's body had no JSON "
                "'model'. Logged once per mode.", mode)


class EndpointPicker(Attachment):
    """Requests that come without our metadata: the body read from the stream, the release as the protocol says."""

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        picker = config.endpoint_picker
        self._max_body_bytes = picker.max_body_bytes
        self._fallbacks = picker.fallbacks
        self._shed_status = picker.shed_status
        self.overloaded = error_response(Refused(
            Refusal.OVERLOADED, "the gateway is overloaded and refuses the lowest class of requests first; retry shortly"
        ), picker.shed_status)

    def open(self, first: pb.ProcessingRequest, metadata: RequestFields | None) -> Stream:
        # An Envoy before 1.34 declares no body mode, and has no duplex one: BUFFERED is the one mode of it that brings
        # the body before the request goes upstream (any other sends it on unrouted, answered 500 by body.read).
        return Stream(first, NO_FIELDS, NO_PROMPT, epp.subset_hint(first), usage=self.reads_usage,
                      undeclared=self.undeclared(first, "Endpoint Picker", body.Mode.BUFFERED))

    async def read(self, stream: Stream, messages: AsyncIterator[pb.ProcessingRequest],
                   headers: dict[str, str]) -> AsyncIterator[pb.ProcessingResponse]:
        """The body and its fields, in the gateway's body mode: asked for (buffered), or streamed at once (duplex)."""
        if not stream.has_body:
            return
        if stream.request_mode in body.BUFFERED:
            yield _HEADERS_GO_ON
            stream.held_on_body = True
        elif not stream.duplex:
            raise _without_body(body.mode_name(stream.request_mode))
        stream.body = await body.read(messages, content_length(headers), self._max_body_bytes)
        stream.fields, stream.prompt = from_body(stream.body)

    def eligible(self, stream: Stream, dispatcher: ModelDispatcher) -> frozenset[str] | None:
        """The protocol: pick only inside the gateway's subset hint, and 503 when it is empty or names no
        endpoint of the pool, or none of it is up while another endpoint is. With no endpoint of the pool up the
        request is held (the cold start: an autoscaler is bringing one), as the dispatcher holds any request then."""
        if stream.subset is None:
            return None
        eligible = frozenset(e for e in dispatcher.endpoints if epp.host_port(e) in stream.subset)
        if not eligible:
            raise Refused(Refusal.NO_ENDPOINT, "none of the endpoints in the gateway's subset hint "
                          f"({', '.join(sorted(stream.subset)) or 'empty'}) is an endpoint of this pool")
        if dispatcher.serves() and not dispatcher.serves(eligible):
            raise Refused(Refusal.NO_ENDPOINT, f"no endpoint of model {dispatcher.name!r} in the subset hint is up "
                          "while others are; retry shortly")
        return eligible

    def release(self, stream: Stream, held: Held, model: str, waited_s: float,
                priority: int | None) -> list[pb.ProcessingResponse]:
        """The endpoints in a header and in ``envoy.lb`` metadata, the same value in both."""
        routing = [header(QUEUE_WAIT_HEADER, str(round(waited_s * 1000)))]
        fallbacks = held.fallbacks[:self._fallbacks]
        picked = [hp for e in (held.endpoint, *fallbacks) if e and (hp := epp.host_port(e))]
        metadata = None
        if picked:
            value = ",".join(picked)
            routing.append(header(DESTINATION_HEADER, value))
            metadata = epp.destination_metadata(value)
        replies = body.release(duplex=stream.duplex, held_on_body=stream.held_on_body, body=stream.body, routing=routing,
                               metadata=metadata, priority=priority, override=None)
        stream.body = b""
        return replies

    def response_began(self, stream: Stream, model: ServedModel, held: Held,
                       message: pb.ProcessingRequest) -> dict[str, str]:
        """The endpoint that served, as the gateway reports it: a fallback taken moves the count there."""
        served = epp.served_endpoint(message)
        dispatcher = model.dispatcher
        endpoint = next((e for e in dispatcher.endpoints if epp.host_port(e) == served), None)
        if endpoint is not None and endpoint != held.endpoint:
            model.report(ServedElsewhere())
            dispatcher.record_served(held, endpoint)
        return super().response_began(stream, model, held, message)

    def refusal(self, refused: Refused) -> pb.ProcessingResponse:
        """A request shed under load gets the protocol's status (429 by default)."""
        return error_response(refused, self._shed_status if refused.refusal in SHED else None)
