"""The attachment seam: a request's stream as it arrives, and what an attachment owes the servicer.

The servicer (``servicer.py``) does what every request shares: admission,
shedding, the queue, the hold and the stream's end. An :class:`Attachment`
does what depends on how Envoy attached the processor: which fields come
from where (:meth:`~Attachment.open`, :meth:`~Attachment.read`), where a
request may go (:meth:`~Attachment.eligible`), how a held request is kept
alive (:meth:`~Attachment.hold_reply`), how it is let go
(:meth:`~Attachment.release`), how the stream is answered after that
(:meth:`~Attachment.after_release`: where the model checks its streams'
start, the response headers held until the first event is read,
``stream_start.py``) and how a refusal sounds (:meth:`~Attachment.refusal`).
``own_envoy.py`` and ``endpoint_picker.py`` implement it; the base class
holds what both answer alike. Whichever it is, the shape of each reply
follows the body modes Envoy declared for the stream (:class:`Stream`,
``body.py``).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.adapters.config import Config
from extproc.adapters.ext_proc.attach import body
from extproc.adapters.ext_proc.attach.release_outcome import engine_answer
from extproc.adapters.ext_proc.attach.replies import error_response, headers_of, passed
from extproc.adapters.ext_proc.attach.served import ServedModel
from extproc.adapters.ext_proc.attach.stream_start import FirstEvent, Verdict, error_message
from extproc.adapters.request.engine_usage import UsageReader
from extproc.adapters.request.request_fields import Prompt, RequestFields
from extproc.core.dispatcher import Held, ModelDispatcher
from extproc.core.release.answer import Answer
from extproc.core.values.outcomes import Refusal, Refused

log = logging.getLogger(__name__)

# The answer to a response body chunk read and left as it is: one for all, as a stream may send many.
_BODY_GOES_ON = [pb.ProcessingResponse(response_body=pb.BodyResponse())]
# The answer that lets the response headers go on, unchanged.
_HEADERS_GO_ON = pb.ProcessingResponse(response_headers=pb.HeadersResponse())
# The first Envoy that declares its filter's body modes on each stream (``ProcessingRequest.protocol_config``,
# envoyproxy/envoy 1609d78876cf7893f5844c4b7ef2a9a04ff3f9ca, 2025-03-18: in 1.34.0, as FULL_DUPLEX_STREAMED is).
DECLARES_MODES_SINCE = "1.34"


class Stream:
    """One request as its ext_proc stream brings it: the body modes Envoy declared, and what was read so far.

    ``fields`` is what the scheduler reads, whichever way it came; ``body`` is
    kept only while the stream must give it back (``FULL_DUPLEX_STREAMED``)
    or rewrite it (``engine_priority``).
    """

    __slots__ = ("request_mode", "response_mode", "has_body", "duplex", "response_duplex", "fields", "prompt", "body",
                 "held_on_body", "subset", "headers", "usage", "start", "ticket")

    def __init__(self, first: pb.ProcessingRequest, fields: RequestFields, prompt: Prompt,
                 subset: frozenset[str] | None = None, usage: bool = False, undeclared: int = body.Mode.NONE) -> None:
        if first.HasField("protocol_config"):  # on the first message only (Envoy 1.34 and later)
            self.request_mode: int = first.protocol_config.request_body_mode
            self.response_mode: int = first.protocol_config.response_body_mode
        else:  # an older Envoy: no duplex mode yet; the request body as the attachment takes it (``undeclared``)
            self.request_mode, self.response_mode = undeclared, body.Mode.NONE
        self.has_body = not first.request_headers.end_of_stream
        # A body comes at once, and reaches the engine only as it is given back.
        self.duplex = self.has_body and self.request_mode == body.DUPLEX
        self.response_duplex = self.response_mode == body.DUPLEX
        self.fields = fields
        # The prompt, undecoded, until the request is signed (or an operator's metadata text).
        self.prompt = prompt
        self.body = b""
        # Held on its body message (buffered, read before the hold): the release answers that message.
        self.held_on_body = False
        # The endpoints the gateway allows (the Endpoint Picker Protocol's subset hint); None: any.
        self.subset = subset
        # Headers its release sets for the response to carry (a budget's rate headers; our own Envoy echoes them).
        self.headers: tuple[tuple[str, str], ...] = ()
        # The engine's usage, read from the response body where budgets charge it (None: not read).
        self.usage = UsageReader() if usage else None
        # The response's first event, read before its headers go on (stream_start.py); None: not read, or read.
        self.start: FirstEvent | None = None
        # What the gate around the submit gave the request (a budget's pass), taken back at its end; None: nothing.
        self.ticket: object = None


class Attachment:
    """How requests arrive and leave on one kind of attachment; one instance per configuration.

    Subclasses implement :meth:`open`, :meth:`read` and :meth:`release`; the
    rest has a default both attachments share.
    """

    # The reply that stops Envoy's message timer before a request is decided (the loop runs late); None: never sent.
    acknowledgement: pb.ProcessingResponse | None = None
    # The answer to an arrival shed under overload (shedding.py).
    overloaded: pb.ProcessingResponse

    # The response body modes a stream's first event can be read in: the chunks come while the headers wait.
    reads_start_in: frozenset[int] = frozenset({body.DUPLEX})

    def __init__(self, config: Config) -> None:
        # Budgets charge the engine's usage: each stream reads it where its response brings it (a stream's
        # chunk by chunk only if the section says so).
        self.reads_usage = config.budgets is not None
        self.reads_streams = config.budgets is not None and config.budgets.stream_usage
        # Whether a stream without declared body modes was told of (once per configuration: a gateway's Envoy
        # sends every stream so).
        self._told_undeclared = False

    def undeclared(self, first: pb.ProcessingRequest, attachment: str, assumed: int) -> int:
        """The request body mode ``attachment`` takes a stream in where Envoy declares none: ``assumed``, said once."""
        if not first.HasField("protocol_config") and not self._told_undeclared:
            self._told_undeclared = True
            log.warning("ext_proc streams arrive without protocol_config: the gateway's Envoy is older than %s, the "
                        "first that declares its body modes (FULL_DUPLEX_STREAMED came with it). The %s attachment "
                        "takes the request body as %s; set the ext_proc filter's request_body_mode so, or run Envoy %s "
                        "or later. Logged once per configuration.",
                        DECLARES_MODES_SINCE, attachment, body.mode_name(assumed), DECLARES_MODES_SINCE)
        return assumed

    def open(self, first: pb.ProcessingRequest, metadata: RequestFields | None) -> Stream:
        """The stream of ``first`` (its request headers), with ``metadata``: our namespace's fields, if Envoy sent them."""
        raise NotImplementedError

    def reads(self, stream: Stream) -> bool:
        """Whether :meth:`read` has anything to take in from ``stream`` (False: the servicer does not call it)."""
        return True

    def read(self, stream: Stream, messages: AsyncIterator[pb.ProcessingRequest],
             headers: dict[str, str]) -> AsyncIterator[pb.ProcessingResponse]:
        """Take in what admission needs from the stream (raises Refused); yields what Envoy needs answered first."""
        raise NotImplementedError

    async def read_prompt(self, stream: Stream, messages: AsyncIterator[pb.ProcessingRequest],
                          headers: dict[str, str]) -> AsyncIterator[pb.ProcessingResponse]:
        """Take in the prompt of a model with prefix signatures before the hold; by default the body already read has it."""
        return
        yield

    def check_start(self, stream: Stream, model: ServedModel) -> None:
        """Read the first event of ``stream``'s response before its headers go on, if its model checks its streams'
        start (``check_stream_start``; unset, while an engine of it says it caps what it holds) and the response
        will come in duplex (declared, or asked for in the release's override)."""
        refusal = model.stream_refusal
        if refusal is None or model.checks_start_if_capped and not model.dispatcher.caps_held():
            return
        if stream.fields.stream and stream.response_mode in self.reads_start_in:
            stream.start = FirstEvent(refusal)
            stream.response_duplex = True

    def eligible(self, stream: Stream, dispatcher: ModelDispatcher) -> frozenset[str] | None:
        """Where the request may go (raises Refused where nowhere can take it); None: wherever the pool picks."""
        return None

    def hold_reply(self, model: ServedModel) -> pb.ProcessingResponse | None:
        """What keeps Envoy waiting while the request is held; None: nothing (the gateway's own timeout is long)."""
        return None

    def release(self, stream: Stream, held: Held, model: str, waited_s: float,
                priority: int | None) -> list[pb.ProcessingResponse]:
        """The replies that let the held request go to ``held.endpoint``; ``priority``: the body's engine priority."""
        raise NotImplementedError

    def after_release(self, stream: Stream, model: ServedModel, held: Held, message: pb.ProcessingRequest,
                      priority: int | None) -> list[pb.ProcessingResponse]:
        """The answers to a message after the release, in the stream's body modes.

        A response body's chunks pass through the usage reader, where a budget charges the engine's usage. Where the
        stream's start is read, the response headers' answer waits for the first event (:meth:`_first_event`).
        """
        start = stream.start
        if message.HasField("response_headers"):
            headers = self.response_began(stream, model, held, message)
            if start is not None:
                if headers.get(":status") == "200" and headers.get("content-type", "").startswith("text/event-stream"):
                    start.headers_held = True
                    hold = self.hold_reply(model)  # until the engine's first token
                    return [hold] if hold is not None else []
                stream.start = None  # not a stream the engine began: nothing of it to read
        elif message.HasField("response_body"):
            chunk = message.response_body
            if stream.usage is not None:
                stream.usage.feed(chunk.body)
            if start is not None and start.headers_held:
                return self._first_event(stream, start, model.dispatcher, held, chunk)
            if stream.response_duplex:  # passed back as it came
                return body.streamed("response_body", chunk.body, chunk.end_of_stream)
            return _BODY_GOES_ON
        elif message.HasField("request_body") and priority is not None:  # buffered after the release (mode override)
            return [body.rewritten(message.request_body.body, priority)]
        elif message.HasField("response_trailers") and start is not None and start.headers_held:
            stream.start = None  # trailers before any event: everything goes on
            held_back = start.held()
            return [_HEADERS_GO_ON, *(body.streamed("response_body", held_back, False) if held_back else ()),
                    passed(message)]
        return [passed(message)]

    def _first_event(self, stream: Stream, start: FirstEvent, dispatcher: ModelDispatcher, held: Held,
                     chunk: pb.HttpBody) -> list[pb.ProcessingResponse]:
        """A chunk while the response headers wait: nothing until the first event is whole; then the engine's
        refusal answered 503 in the response's place (the engine's answer recorded as full), or the headers and the
        chunks so far let go."""
        verdict = start.feed(chunk.body, chunk.end_of_stream)
        if verdict is None:
            return []
        stream.start = None
        if verdict is Verdict.REFUSED:
            dispatcher.record_response(held, Answer.FULL)
            said = error_message(start.event or {})
            return [self.refusal(Refused(Refusal.ENGINE_FULL, f"the engine refused the stream before its first "
                                         f"token, its own queue being full ({said}); retry"))]
        return [_HEADERS_GO_ON, *body.streamed("response_body", start.held(), chunk.end_of_stream)]

    def response_began(self, stream: Stream, model: ServedModel, held: Held,
                       message: pb.ProcessingRequest) -> dict[str, str]:
        """The response's headers: whether the release reached a live engine, a full one or none (release_outcome.py)."""
        headers = headers_of(message.response_headers)
        model.dispatcher.record_response(held, engine_answer(headers, model.full_statuses))
        return headers

    def refusal(self, refused: Refused) -> pb.ProcessingResponse:
        """The refusal as the client hears it."""
        return error_response(refused)

