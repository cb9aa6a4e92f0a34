"""A minimal gRPC server straight on the ``h2`` HTTP/2 state machine: the ext_proc hop's transport.

Why not grpcio or grpclib: every request Envoy holds in our queue is an open
gRPC stream, so a stream's memory is the cost of a held request. Measured with
10,000 streams held, each after one request and one reply (docs/decisions.md):
grpc.aio keeps 21–24 KB per stream (about 19 KB of it native C-core call and
HTTP/2 stream state, which no channel argument bounds), grpclib 16 KB (four
asyncio Events, several queues and deques per stream); this module about
3 KB: h2's own stream state, one slotted object and one task.

What it implements of gRPC over HTTP/2 is what Envoy's ext_proc filter and
gRPC health checker use: calls of any cardinality whose handler reads an async
iterator of decoded messages and yields replies; length-prefixed, uncompressed
messages (compressed ones are refused, Envoy does not compress them); status
and message in the trailers. A stream the client resets cancels its handler at
once (a client that leaves while queued: the queue entry goes at once). It
never limits concurrent streams, since held requests are streams.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol, cast

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings

log = logging.getLogger(__name__)

# gRPC status codes (https://grpc.github.io/grpc/core/md_doc_statuscodes.html) this server sends.
OK, UNKNOWN, NOT_FOUND, RESOURCE_EXHAUSTED, UNIMPLEMENTED, INTERNAL = 0, 2, 5, 8, 12, 13
# grpcio's default limit for a received message, the least a server takes (a buffered request
# body comes in one: the processor raises it to its body limit, endpoint_picker.max_body_bytes).
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
# Receive windows: large enough that a buffered body arrives without waiting on window updates.
STREAM_WINDOW = 1024 * 1024
CONNECTION_WINDOW = 16 * 1024 * 1024
_H2_CONFIG = h2.config.H2Configuration(
    client_side=False, header_encoding=None,
    validate_inbound_headers=False, normalize_inbound_headers=False,
    validate_outbound_headers=False, normalize_outbound_headers=False,
)
_RESPONSE_HEADERS = [(b":status", b"200"), (b"content-type", b"application/grpc")]


class _H2Connection(h2.connection.H2Connection):
    """h2's connection, without its walk over every stream for each new one.

    h2 counts the open streams on each new inbound stream (to enforce
    MAX_CONCURRENT_STREAMS, which we leave unbounded), walking them all: with
    thousands held that made a burst quadratic (measured: 7 s of CPU to open
    10,000 streams on one connection, 39 s for 20,000). The walk also forgets
    closed streams, so it still runs, but only once per half as many new
    streams as it walks: amortized constant per stream.
    """

    _since_walk = 0

    @property
    def open_inbound_streams(self) -> int:
        self._since_walk += 1
        if self._since_walk * 2 < len(self.streams):
            return 0  # not counted: nothing is limited
        self._since_walk = 0
        return super().open_inbound_streams


class Message(Protocol):
    def SerializeToString(self) -> bytes: ...  # noqa: N802 (protobuf's name)


class GrpcError(Exception):
    """Raised by a handler: the call ends with this status instead of OK."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class Method:
    """One RPC: how to decode its requests, and the handler that turns them into replies."""

    decode: Callable[[bytes], Any]
    handler: Callable[[AsyncIterator[Any]], AsyncIterator[Message]]


class _Call:
    """One stream: its undecoded bytes, decoded messages not yet read, and the reader waiting for them.

    Slotted and lazily filled, because 10,000 of these sit idle while their requests are held.
    """

    __slots__ = ("stream_id", "method", "buffer", "inbox", "waiter", "ended", "task", "started", "outgoing", "closing")

    def __init__(self, stream_id: int, method: Method) -> None:
        self.stream_id = stream_id
        self.method = method
        self.buffer = b""
        self.inbox: deque[Any] | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.ended = False  # the client half-closed: no more messages
        self.task: asyncio.Task[None] | None = None
        self.started = False  # the response headers went out
        self.outgoing = b""  # bytes the flow-control window did not yet let out
        self.closing: list[tuple[bytes, bytes]] | None = None  # trailers to send once outgoing is out

    def __aiter__(self) -> _Call:
        return self

    async def __anext__(self) -> Any:
        while not self.inbox:
            if self.ended:
                raise StopAsyncIteration
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        message = self.inbox.popleft()
        if not self.inbox:
            self.inbox = None  # an empty deque is about 600 bytes, kept by every held stream
        return message

    def wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def received(self, data: bytes, limit: int) -> None:
        """Decode every complete length-prefixed message (of at most ``limit`` bytes) in the bytes received so far."""
        buffer = self.buffer + data if self.buffer else data
        while len(buffer) >= 5:
            size = int.from_bytes(buffer[1:5], "big")
            if buffer[0] != 0 or size > limit:
                raise GrpcError(UNIMPLEMENTED if buffer[0] else RESOURCE_EXHAUSTED,
                                "compressed messages are not supported" if buffer[0] else "message too large")
            if len(buffer) < 5 + size:
                break
            if self.inbox is None:
                self.inbox = deque()
            self.inbox.append(self.method.decode(buffer[5:5 + size]))
            buffer = buffer[5 + size:]
        self.buffer = buffer
        self.wake()


class _Connection(asyncio.Protocol):
    """One HTTP/2 connection (Envoy keeps one or a few to us, each carrying many streams)."""

    def __init__(self, server: GrpcServer) -> None:
        self._server = server
        self._h2 = _H2Connection(_H2_CONFIG)
        self._transport: asyncio.Transport | None = None
        self.calls: dict[int, _Call] = {}

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass, but one in kind
        self._server.connections.add(self)
        self._h2.local_settings = h2.settings.Settings(client=False, initial_values={
            h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: 2**31 - 1,
            h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: STREAM_WINDOW,
            # h2's default, kept: ext_proc carries the HTTP headers inside messages, not here.
            h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: 2**16,
        })
        self._h2.initiate_connection()
        self._h2.increment_flow_control_window(CONNECTION_WINDOW - 65_535)
        self._flush()

    def connection_lost(self, exc: Exception | None) -> None:
        self._server.connections.discard(self)
        for call in self.calls.values():
            if call.task is not None:
                call.task.cancel()
        self.calls.clear()
        self._transport = None

    def data_received(self, data: bytes) -> None:
        try:
            events = self._h2.receive_data(data)
        except h2.exceptions.ProtocolError as exc:
            log.warning("HTTP/2 protocol error from %s: %s", self._peer(), exc)
            self._flush()
            self.close()
            return
        for event in events:
            self._handle(event)
        self._flush()

    def _handle(self, event: h2.events.Event) -> None:
        if isinstance(event, h2.events.RequestReceived):
            self._start(event.stream_id, dict(event.headers or ()).get(b":path", b""))
        elif isinstance(event, h2.events.DataReceived):
            self._h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            call = self.calls.get(event.stream_id)
            if call is not None and event.data:
                try:
                    call.received(event.data, self._server.max_message_bytes)
                except GrpcError as exc:
                    self._cancel(call)
                    self._finish(call, exc.status, exc.message)
        elif isinstance(event, h2.events.StreamEnded):
            call = self.calls.get(event.stream_id)
            if call is not None:
                call.ended = True
                call.wake()
        elif isinstance(event, h2.events.StreamReset):
            call = self.calls.pop(event.stream_id, None)
            if call is not None:
                self._cancel(call)
        elif isinstance(event, h2.events.WindowUpdated):
            for call in list(self.calls.values()) if event.stream_id == 0 else [self.calls.get(event.stream_id)]:
                if call is not None and call.outgoing:
                    self._drain(call)
        elif isinstance(event, h2.events.ConnectionTerminated):
            self.close()

    def _start(self, stream_id: int, path: bytes) -> None:
        name = path.decode("ascii", "replace")
        method = self._server.methods.get(name)
        if method is None:
            self._close_stream(stream_id, [*_RESPONSE_HEADERS, *_trailers(UNIMPLEMENTED, f"no method {name}")])
            return
        call = _Call(stream_id, method)
        self.calls[stream_id] = call
        call.task = asyncio.ensure_future(self._run(call))

    async def _run(self, call: _Call) -> None:
        status, message = OK, ""
        try:
            async for reply in call.method.handler(call):
                if call.closing is not None:  # finished by the transport (bad input): nothing more to say
                    return
                if not call.started:
                    self._h2.send_headers(call.stream_id, _RESPONSE_HEADERS)
                    call.started = True
                payload = reply.SerializeToString()
                call.outgoing += b"\0" + len(payload).to_bytes(4, "big") + payload
                self._drain(call)
                self._flush()
        except h2.exceptions.StreamClosedError:  # the client reset it while the reply was being made
            self.calls.pop(call.stream_id, None)
            return
        except GrpcError as exc:
            status, message = exc.status, exc.message
        except Exception:
            log.exception("handler for stream %d failed", call.stream_id)
            status, message = INTERNAL, "internal error"
        if call.closing is None and self.calls.get(call.stream_id) is call:
            self._finish(call, status, message)
            self._flush()

    def _finish(self, call: _Call, status: int, message: str) -> None:
        """End the call with trailers (after any reply bytes still waiting on the window)."""
        trailers = _trailers(status, message)
        call.closing = trailers if call.started else [*_RESPONSE_HEADERS, *trailers]
        if not call.outgoing:
            self._close_stream(call.stream_id, call.closing)

    def _close_stream(self, stream_id: int, trailers: list[tuple[bytes, bytes]]) -> None:
        self.calls.pop(stream_id, None)
        try:
            self._h2.send_headers(stream_id, trailers, end_stream=True)
            # The client may still send (our StreamEnded may not have been handled yet): we are done listening.
            self._h2.reset_stream(stream_id, h2.errors.ErrorCodes.NO_ERROR)
        except h2.exceptions.StreamClosedError:  # closed by the client's end or reset: nothing more to say
            pass

    def _drain(self, call: _Call) -> None:
        """Send as much of the call's pending reply bytes as the flow-control windows allow."""
        try:
            while call.outgoing:
                size = min(len(call.outgoing), self._h2.local_flow_control_window(call.stream_id),
                           self._h2.max_outbound_frame_size)
                if size <= 0:
                    return
                self._h2.send_data(call.stream_id, call.outgoing[:size])
                call.outgoing = call.outgoing[size:]
        except h2.exceptions.StreamClosedError:
            call.outgoing = b""
            return
        if call.closing is not None:
            self._close_stream(call.stream_id, call.closing)

    @staticmethod
    def _cancel(call: _Call) -> None:
        if call.task is not None:
            call.task.cancel()

    def _flush(self) -> None:
        data = self._h2.data_to_send()
        if data and self._transport is not None:
            self._transport.write(data)

    def _peer(self) -> Any:
        return self._transport.get_extra_info("peername") if self._transport is not None else None

    def go_away(self) -> None:
        """No new streams on this connection (the client opens a new one, which then finds the listener gone)."""
        self._h2.close_connection()
        self._flush()

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()


def _trailers(status: int, message: str) -> list[tuple[bytes, bytes]]:
    trailers = [(b"grpc-status", str(status).encode())]
    if message:
        # grpc-message is the UTF-8 bytes, percent-encoded outside printable ASCII (and '%' itself).
        encoded = b"".join(bytes([b]) if 0x20 <= b <= 0x7E and b != 0x25 else b"%%%02X" % b for b in message.encode())
        trailers.append((b"grpc-message", encoded))
    return trailers


class GrpcServer:
    """Serves ``methods`` (by gRPC path, ``/package.Service/Method``) on one listening address."""

    def __init__(self, methods: dict[str, Method], max_message_bytes: int = MAX_MESSAGE_BYTES) -> None:
        self.methods = methods
        self.max_message_bytes = max(MAX_MESSAGE_BYTES, max_message_bytes)
        self.connections: set[_Connection] = set()
        self._listener: asyncio.Server | None = None

    async def start(self, host: str, port: int, tls: ssl.SSLContext | None = None) -> None:
        """Listen; with ``tls`` (a server context offering ALPN h2: tls.py), every connection is TLS."""
        loop = asyncio.get_running_loop()
        self._listener = await loop.create_server(lambda: _Connection(self), host, port, reuse_address=True, ssl=tls)

    def calls(self) -> int:
        return sum(len(c.calls) for c in self.connections)

    async def stop(self, grace_s: float) -> None:
        """Stop listening, let running calls end for up to ``grace_s``, then cut the rest."""
        if self._listener is not None:
            self._listener.close()
        for conn in list(self.connections):
            conn.go_away()
        deadline = asyncio.get_running_loop().time() + grace_s
        while self.calls() and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.02)
        tasks = [call.task for conn in self.connections for call in conn.calls.values() if call.task is not None]
        for conn in list(self.connections):
            conn.close()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._listener is not None:
            await self._listener.wait_closed()
            self._listener = None
