"""Our own Envoy: the generated config (or its drop-in) in front, the body's fields in our metadata.

The fast path, in the generated filter's mode (request headers and response
trailers sent, bodies not: ``contract.PROCESSING_MODE``):

1. Envoy's ``json_to_metadata`` has put the body's ``model``, ``max_tokens``,
   ``max_completion_tokens`` and ``prompt_cache_key`` into dynamic metadata
   ``extproc``, which comes with the request headers: the prompt never passes
   through Python.
2. While the request is held, one ``override_message_timeout`` keeps Envoy
   waiting past its short message timeout (the filter allows up to the
   longest hold, ``max_message_timeout``).
3. The release answers the headers: the routing header set to the model (a
   client-sent one is overwritten), the picked endpoint in
   ``x-gateway-destination-endpoint`` (endpoint picking), the queue wait, and
   the route cache cleared, so Envoy routes on them.
4. A release the gate checks (a sample), or of a preemptible class, turns
   the response headers on (``mode_override``): their status tells a live
   engine from a failed release (``release_outcome.py``), and a response
   begun can no longer be preempted. The stream then stays open, silent,
   until the response ends: its end is the request's completion.
5. An ``engine_priority`` model's release also switches the request body to
   buffered; it comes back with the band's ``priority`` written in.
6. With budgets, the release also asks for the response body where the
   engine's usage will be in it (``_read``): a whole answer buffered, a
   stream whose client asked for ``include_usage`` chunk by chunk
   (``budgets.stream_usage``); each chunk passes the usage reader
   (``engine_usage.py``) and goes on unchanged.
7. A stream of a model with ``check_stream_start`` has its response body
   asked for in duplex, with its headers: they wait for their answer while
   the chunks come, until the first event is read (``stream_start.py``);
   every chunk is then given back as it came (and read for its usage).
8. A model with prefix signatures needs its prompt before the hold: its
   headers are answered at once, switching to a buffered body (a mode can
   be overridden only in a headers reply, and whether a release is checked is
   known only at the release, so the response headers are turned on too);
   the request is held on the body message and released by its reply. An
   operator's own filter may put the leading text into
   ``extproc.prompt_prefix`` metadata instead: then no body is asked for.

Any other body mode the filter declares is followed (``body.py``): with
``BUFFERED`` the body comes after the headers are answered, and the overrides
keep it; with ``FULL_DUPLEX_STREAMED`` Envoy streams the body at once and
passes on only what is given back, so it is read before the hold and given
back after the release's headers reply, and the response's chunks as they
come (overrides are ignored there: the response headers come only if the
filter sends them). Overrides need the filter's ``allow_mode_override``, as
the generated one has; a gateway without it (Envoy AI Gateway) ignores them
and ignores the hold's timeout too (warning once per request in its log;
its own message timeout is long).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.adapters.config import Config
from extproc.adapters.ext_proc.attach import body
from extproc.adapters.ext_proc.attach.base import Attachment, Stream
from extproc.adapters.ext_proc.attach.replies import content_length, duration, error_response, headers
from extproc.adapters.ext_proc.attach.served import ServedModel
from extproc.adapters.protocol import epp_protocol as epp
from extproc.adapters.protocol.contract import (
    DESTINATION_HEADER,
    MODEL_HEADER,
    PROCESSING_MODE,
    QUEUE_WAIT_HEADER,
    hold_timeout_for,
)
from extproc.adapters.request.request_fields import NO_FIELDS, NO_PROMPT, RequestFields, prompt_from_metadata, prompt_of
from extproc.core.dispatcher import Held
from extproc.core.values.outcomes import Refusal, Refused

_MODES = body.Mode.BodySendMode.values()
# A release reply is built once for each queue wait below this many milliseconds (and each model, destination and
# mode override), then reused: an uncontended gate releases at once, and a reply costs more to build than to send.
# Longer waits, each value rarer, are built for their request.
_REUSED_WAIT_MS = 32
# Endpoints come and go (discovery), and the destination is part of a reused reply: at this many replies the
# reuse starts over, so a long-lived processor behind a changing pool does not keep one per endpoint it ever saw.
_MAX_REUSED = 1024


def _override(request_mode: int, response_mode: int, body_wanted: bool, checked: bool,
              read: int | None, start: bool) -> processing_mode_pb2.ProcessingMode | None:
    """The generated filter's mode with the declared bodies, the request body buffered, the response headers sent
    and/or the response body read in mode ``read`` (for the engine's usage) or in duplex, its headers held until its
    first event is read (``start``: stream_start.py).

    None when none is wanted, or in duplex mode, where Envoy ignores overrides.
    """
    if not (body_wanted or checked or read is not None or start) or body.DUPLEX in (request_mode, response_mode):
        return None
    return processing_mode_pb2.ProcessingMode(**{
        **PROCESSING_MODE,
        "request_body_mode": body.Mode.BUFFERED if body_wanted else request_mode,
        "response_body_mode": body.DUPLEX if start else response_mode if read is None else read,
        **({"response_header_mode": "SEND"} if checked or start else {}),
    })


# How the response body is read for the engine's usage (``_read``): a whole answer buffered (partially: a body
# over Envoy's buffer limit is sent in part, its usage then unread, rather than refused), a stream chunk by chunk.
_WHOLE: int = body.Mode.BUFFERED_PARTIAL
_CHUNKS: int = body.Mode.STREAMED
_READS = (None, _WHOLE, _CHUNKS)
# By (declared request body mode, declared response body mode, body wanted, response headers wanted, read, start).
_OVERRIDES = {(rq, rs, b, c, r, st): _override(rq, rs, b, c, r, st)
              for rq in _MODES for rs in _MODES for b in (False, True) for c in (False, True) for r in _READS
              for st in (False, True)}
# A model with prefix signatures: the headers answered at once, the body wanted before the hold (and the
# response headers, as the release may be checked, and the response body where it is read or its start is);
# by the declared body modes, the read and the start.
_PROMPT_FIRST = {
    (rq, rs, r, st): pb.ProcessingResponse(request_headers=pb.HeadersResponse(),
                                           mode_override=_OVERRIDES[rq, rs, True, True, r, st])
    for rq in _MODES for rs in _MODES for r in _READS for st in (False, True)
}


def _read(stream: Stream, streams: bool) -> int | None:
    """The response body mode that brings the engine's usage where a budget charges it; None: not read.

    A body the filter sends anyway (its declared mode, or duplex where its start is
    read) is read as it comes. A stream carries the usage only when its client asked
    (``include_usage``): without it there is nothing to read, and the estimate
    stands; with it, it is read chunk by chunk if ``streams`` (``budgets.stream_usage``).
    """
    if stream.usage is None or stream.response_mode != body.Mode.NONE or stream.start is not None:
        return None
    fields = stream.fields
    if not fields.stream:
        return _WHOLE
    return _CHUNKS if fields.include_usage and streams else None


class OwnEnvoy(Attachment):
    """Requests that come with our metadata: held by message-timeout overrides, released by the routing headers."""

    # No response body declared: the release's override asks for it in duplex; or duplex declared.
    reads_start_in = frozenset({body.Mode.NONE, body.DUPLEX})

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self._max_body_bytes = config.endpoint_picker.max_body_bytes
        # The release replies built so far, reused (never changed once sent), by what varies among them: the model,
        # the queue wait (those under _REUSED_WAIT_MS: an uncontended gate's), the destination and the mode override.
        self._releases: dict[tuple[str, int, str | None, tuple[int, int, bool, bool, int | None, bool]],
                             pb.ProcessingResponse] = {}
        # Prebuilt: under a burst these are sent to every arrival, so they cost no construction.
        # The longest of the models' holds (each model's own is its runtime's, ServedModel.hold_reply).
        self.acknowledgement = pb.ProcessingResponse(override_message_timeout=duration(
            max(hold_timeout_for(config.longest_queue_wait_s(m)) for m in config.models)))
        self.overloaded = error_response(Refused(
            Refusal.OVERLOADED, "the gateway is overloaded and refuses the lowest class of requests first; retry shortly"
        ))

    @property
    def reused_replies(self) -> int:
        """How many release replies are kept for reuse now: at most ``_MAX_REUSED``, however the endpoints change."""
        return len(self._releases)

    def open(self, first: pb.ProcessingRequest, metadata: RequestFields | None) -> Stream:
        # Where Envoy declares no body mode (before 1.34), the generated filter's is taken: no body.
        return Stream(first, metadata or NO_FIELDS, prompt_from_metadata(first) or NO_PROMPT, usage=self.reads_usage)

    def reads(self, stream: Stream) -> bool:
        """Only in duplex mode: the body comes at once; else the metadata had what admission needs."""
        return stream.duplex

    async def read(self, stream: Stream, messages: AsyncIterator[pb.ProcessingRequest],
                   headers: dict[str, str]) -> AsyncIterator[pb.ProcessingResponse]:
        """The body (duplex mode): Envoy streams it at once and passes on only what is given back."""
        stream.body = await body.read(messages, content_length(headers), self._max_body_bytes)
        return
        yield

    async def read_prompt(self, stream: Stream, messages: AsyncIterator[pb.ProcessingRequest],
                          headers: dict[str, str]) -> AsyncIterator[pb.ProcessingResponse]:
        """The body, for its prompt (unless metadata had the text): asked for at once, or already read (duplex)."""
        if not stream.has_body or stream.prompt.text is not None:
            return
        if not stream.duplex:
            start = stream.start is not None
            yield _PROMPT_FIRST.get((stream.request_mode, stream.response_mode, _read(stream, self.reads_streams), start),
                                    _PROMPT_FIRST[body.Mode.NONE, body.Mode.NONE, None, start])
            stream.body = await body.read(messages, content_length(headers), self._max_body_bytes)
            stream.held_on_body = True
        stream.prompt = prompt_of(stream.body)

    def hold_reply(self, model: ServedModel) -> pb.ProcessingResponse | None:
        return model.hold_reply

    def release(self, stream: Stream, held: Held, model: str, waited_s: float,
                priority: int | None) -> list[pb.ProcessingResponse]:
        waited_ms = round(waited_s * 1000)
        destination = epp.host_port(held.endpoint) if held.endpoint else None
        # Only a headers reply may override: the body for engine_priority, the response headers for a checked
        # release or a preemptible one (they say when it can no longer be preempted).
        override_key = (stream.request_mode, stream.response_mode, priority is not None,
                        held.checked or held.preempted is not None, _read(stream, self.reads_streams),
                        stream.start is not None)
        # The headers reply alone: nothing of the body in it, nor headers of this request's own.
        plain = not stream.duplex and not stream.held_on_body and not stream.headers
        key = (model, waited_ms, destination, override_key)
        if plain and waited_ms < _REUSED_WAIT_MS and (reply := self._releases.get(key)) is not None:
            return [reply]
        # One call however many headers: the request path's count of entries does not depend on the request.
        routing = headers((QUEUE_WAIT_HEADER, str(waited_ms)), (MODEL_HEADER, model), *stream.headers,
                          *(((DESTINATION_HEADER, destination),) if destination else ()))
        replies = body.release(duplex=stream.duplex, held_on_body=stream.held_on_body, body=stream.body, routing=routing,
                               metadata=None, priority=priority, override=_OVERRIDES.get(override_key))
        stream.body = b""
        if plain and waited_ms < _REUSED_WAIT_MS:
            if len(self._releases) >= _MAX_REUSED:
                self._releases.clear()
            self._releases[key] = replies[0]
        return replies
