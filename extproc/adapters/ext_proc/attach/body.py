"""The body as the stream's processing mode brings it, and the replies that mode wants back.

Envoy declares its filter's body modes on the first message of each stream
(``ProcessingRequest.protocol_config``: ``request_body_mode`` and
``response_body_mode``, the filter's or its route's). What each asks of the
processor (``Filter::onReceiveMessage`` in envoyproxy/envoy
source/extensions/filters/http/ext_proc/ext_proc.cc at
294012761b5c38055c8a65dd755bc5733043588e, ``ProcessorState::handleHeadersResponse``
and ``handleBodyResponse`` in processor_state.cc at
055a650d3bfa4b2cad214cdb649eee0d85051b28; each combination run through
Envoy 1.40 by tests/stack/test_attach_matrix.py):

* ``NONE``: no body. The headers reply continues the request.
  ``STREAMED``: the same, then the chunks, each answered as it comes.
* ``BUFFERED`` (and ``BUFFERED_PARTIAL``): the body comes as one message once
  the headers are answered, and the request waits for the body's reply: a
  headers reply without a mutation lets Envoy send the body, and the body
  reply may carry the routing headers (the route cache cleared there) and a
  body mutation, whose length must match ``content-length``.
* ``FULL_DUPLEX_STREAMED``: the chunks come at once, without waiting for the
  headers reply, and reach the engine only as the processor gives them back
  (``streamed_response``), after the headers reply. A plain body reply is
  *spurious* there (Envoy answers the client 500), and mode overrides are
  ignored. Response bodies alike: each chunk is given back as it came.

So the release's replies follow the mode and whether the body was read
before the hold (:func:`release`), never who attached the processor; every
attachment uses the one builder here.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2

from extproc.adapters.ext_proc.attach.priority_body import with_priority
from extproc.adapters.ext_proc.attach.replies import header
from extproc.core.values.outcomes import Refusal, Refused

log = logging.getLogger(__name__)

Mode = processing_mode_pb2.ProcessingMode
DUPLEX = Mode.FULL_DUPLEX_STREAMED
# The body comes as one message once the headers are answered.
BUFFERED = (Mode.BUFFERED, Mode.BUFFERED_PARTIAL)
# Streamed bodies go back in chunks of at most this many bytes (what llm-d's picker sends:
# some Envoy builds cap a streamed chunk at 64 KiB).
CHUNK_BYTES = 62_000


def mode_name(mode: int) -> str:
    return Mode.BodySendMode.Name(mode) if mode in Mode.BodySendMode.values() else str(mode)


async def read(messages: AsyncIterator[pb.ProcessingRequest], declared: int | None, limit: int) -> bytes:
    """The request body from the stream (its end, or the request's trailers, ends it); raises Refused.

    Over ``limit`` (declared or received): 413. Any other message first means
    Envoy is not sending the body (a mode override it did not honour): 500,
    logged, instead of waiting on a request that has already moved on.
    """
    if declared is not None and declared > limit:
        raise _too_large(declared, limit)
    chunks, size = [], 0
    async for message in messages:
        if message.HasField("request_trailers"):
            break
        if not message.HasField("request_body"):
            phase = str(message.WhichOneof("request"))
            _body_not_sent(phase)
            raise Refused(Refusal.GATEWAY_ERROR, f"the gateway's ext_proc filter sent {phase} instead of the request "
                          "body this model needs before it is queued: set its request_body_mode to BUFFERED, or "
                          "allow_mode_override")
        chunk = message.request_body
        size += len(chunk.body)
        if size > limit:
            raise _too_large(size, limit)
        chunks.append(chunk.body)
        if chunk.end_of_stream:
            break
    return b"".join(chunks)


@functools.cache  # once per phase: a filter set up so sends every stream so
def _body_not_sent(phase: str) -> None:
    log.warning("ext_proc sent %s where the processor waited for the request body: the filter did not send the "
                "body it was asked for (allow_mode_override false?); answered 500 gateway_error (logged once)", phase)


def _too_large(size: int, limit: int) -> Refused:
    return Refused(Refusal.BODY_TOO_LARGE,
                   f"the request body has {size} bytes or more; this gateway takes at most {limit} "
                   "(endpoint_picker.max_body_bytes)")


def release(*, duplex: bool, held_on_body: bool, body: bytes, routing: list[base_pb2.HeaderValueOption],
            metadata: struct_pb2.Struct | None, priority: int | None,
            override: processing_mode_pb2.ProcessingMode | None) -> list[pb.ProcessingResponse]:
    """The replies that let a held request go: ``routing`` set, the route recomputed, the body given back or rewritten.

    ``duplex``: the headers reply, then the body (read before the hold) in
    streamed chunks. ``held_on_body`` (buffered, read before the hold): the
    body message is the one Envoy waits on. Else the headers message is, and
    ``override`` (a mode override) goes with it. ``priority``: the engine
    priority written into the body, with a ``content-length`` to match.
    """
    new = with_priority(body, priority) if priority is not None and (duplex or held_on_body) else None
    if new is not None:  # None: no priority to write, or not a JSON object (the engine will say so itself)
        body = new
        routing.append(header("content-length", str(len(body))))  # Envoy refuses a mutated body of another length
    common = pb.CommonResponse(header_mutation=pb.HeaderMutation(set_headers=routing), clear_route_cache=True)
    if duplex:
        return [pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=common), dynamic_metadata=metadata),
                *streamed("request_body", body)]
    if held_on_body:
        if new is not None:
            common.body_mutation.body = body
        return [pb.ProcessingResponse(request_body=pb.BodyResponse(response=common), dynamic_metadata=metadata)]
    return [pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=common), dynamic_metadata=metadata,
                                  mode_override=override)]


def rewritten(body: bytes, priority: int) -> pb.ProcessingResponse:
    """The reply to a buffered body that came after the release: its engine ``priority`` written in."""
    new = with_priority(body, priority)
    if new is None:
        return pb.ProcessingResponse(request_body=pb.BodyResponse())
    return pb.ProcessingResponse(request_body=pb.BodyResponse(response=pb.CommonResponse(
        header_mutation=pb.HeaderMutation(set_headers=[header("content-length", str(len(new)))]),
        body_mutation=pb.BodyMutation(body=new),
    )))


def streamed(phase: str, body: bytes, end_of_stream: bool = True) -> list[pb.ProcessingResponse]:
    """``body`` as FULL_DUPLEX_STREAMED answers to ``phase`` (request_body or response_body), in chunks."""
    if len(body) <= CHUNK_BYTES:  # a response's chunk as it came: the one per token of a duplex stream
        return [_streamed(phase, body, end_of_stream)]
    chunks = [body[i:i + CHUNK_BYTES] for i in range(0, len(body), CHUNK_BYTES)]
    return [_streamed(phase, chunk, end_of_stream and i == len(chunks) - 1) for i, chunk in enumerate(chunks)]


def _streamed(phase: str, chunk: bytes, end_of_stream: bool) -> pb.ProcessingResponse:
    """One streamed answer, its deepest field set in place: a third of the time of its five messages built by their
    constructors (2.5 against 6-10 us), paid on every chunk of a duplex stream."""
    reply = pb.ProcessingResponse()
    given = getattr(reply, phase).response.body_mutation.streamed_response
    given.body = chunk
    given.end_of_stream = end_of_stream
    return reply
