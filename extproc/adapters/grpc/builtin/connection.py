"""One HTTP/2 connection of the builtin transport: what a peer may send on it, and what it costs.

Envoy keeps one or a few long-lived connections to us, each carrying every
held request of its share as a stream, so a mistake that ends a connection
ends all of them. Everything a peer can send therefore ends at most its own
stream, with the status a reference gRPC server would send, or, for a broken
connection (an HTTP/2 protocol error), that connection; never a traceback,
and a warning at most once per peer per 10 s (grpc/peer_warnings.py).

Memory is bounded by flow control. A stream's bytes are handed back to the
peer (WINDOW_UPDATE) as its handler takes its messages, beyond what one whole
message needs to arrive, so a stream holds at most one message's worth. Over
a connection, request bytes no handler has taken are capped too: past the
cap, the stream holding the most is ended RESOURCE_EXHAUSTED. Ending one
rather than pausing the connection's window keeps it deadlock-free: partial
messages of many streams can never wedge every other stream on it.

What we write is bounded too, and what a peer makes us do per loop cycle:
a peer that does not read what it asks for is not read from, and floods end
the connection (builtin/bounds.py, builtin/flood.py).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, cast

from extproc.adapters.grpc.builtin import http2
from extproc.adapters.grpc.builtin.bounds import OUTPUT, Bounded
from extproc.adapters.grpc.builtin.call import BIG, PREFIX, Call, refused, shown, trailers
from extproc.adapters.grpc.builtin.frames import RESPONSE_HEADERS, ErrorCode
from extproc.adapters.grpc.builtin.http2 import Http2Connection, Http2Error, StreamClosed
from extproc.adapters.grpc.peer_warnings import PeerWarnings
from extproc.adapters.grpc.transport import INTERNAL, OK, RESOURCE_EXHAUSTED, UNIMPLEMENTED, GrpcError, Methods, TransportLimits

log = logging.getLogger("extproc.adapters.grpc.builtin")

# Receive windows: large enough that a buffered body arrives without waiting on window updates.
STREAM_WINDOW = 1024 * 1024
CONNECTION_WINDOW = 16 * 1024 * 1024
LAST_STREAM = 2**31 - 1
_SHUTDOWN_PING = b"h2grpc\x00\x01"


class Connection(Bounded):
    """One HTTP/2 connection (Envoy keeps one or a few to us, each carrying many streams).

    Given what it shares with the other connections of its server: the methods,
    the limits, the set of open connections (which it joins and leaves) and the
    per-peer warnings.
    """

    def __init__(self, methods: Methods, limits: TransportLimits, connections: set[Connection],
                 warnings: PeerWarnings) -> None:
        grpc = limits.grpc
        super().__init__(grpc, Http2Connection(max_streams=grpc.max_streams_per_connection, stream_window=STREAM_WINDOW,
                                               connection_window=CONNECTION_WINDOW, limits=grpc), warnings)
        self._methods = methods
        self._max_message = limits.max_message_bytes
        self._connections = connections
        self.calls: dict[int, Call] = {}
        self._pending: dict[int, Call] = {}  # calls with reply bytes waiting on a window, oldest first
        self._big: set[Call] = set()  # calls holding at least BIG unread bytes
        self.buffered = 0  # request bytes received that no handler has taken yet
        # One message (and the frame that brings its last byte) must fit, whatever else a stream holds.
        self._stream_budget = self._max_message + PREFIX + 16_384
        self._connection_budget = max(self._grpc.connection_buffer_bytes, self._stream_budget)
        self._timer: asyncio.TimerHandle | None = None
        self._flush_pending = False  # a _flush is queued on the loop
        self._handshaken = False
        self._last_frame = 0.0
        self._draining = False  # a GOAWAY went either way: the connection ends with its last stream
        self._last_stream: int | None = None  # streams after it are refused (our final GOAWAY)
        self._queued = 0  # reply bytes queued for this loop cycle's write
        self._parked = False  # replies wait on our output (_output_full), not on a window

    # -- the connection's life --------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass, but one in kind
        # Above this much unwritten, pause_writing stops reading the peer (asyncio's low mark: a quarter).
        self._transport.set_write_buffer_limits(high=self._grpc.output_buffer_bytes)
        self._peer = transport.get_extra_info("peername")
        self._last_frame = self._loop.time()
        if len(self._connections) >= self._grpc.max_connections:
            self._warnings.warn(self._peer, "connection refused: %d open (advanced.grpc.max_connections)",
                                len(self._connections))
            self._h2.initiate_connection()
            self._h2.send_goaway(0, ErrorCode.ENHANCE_YOUR_CALM, b"too many connections")
            self._flush()
            self.close()
            return
        self._connections.add(self)
        self._h2.initiate_connection()
        self._flush()
        self._timer = self._loop.call_later(self._grpc.handshake_timeout_s, self._handshake_expired)

    def connection_lost(self, exc: Exception | None) -> None:
        self._connections.discard(self)
        if self._timer is not None:
            self._timer.cancel()
        self._abandon()
        self._transport = None

    def _end(self) -> None:
        """Past a limit, or broken: every call ends now, not when the transport reports the close (a loop cycle
        later, in which their handlers would go on making replies nobody reads)."""
        super()._end()
        self._abandon()

    def _abandon(self) -> None:
        for call in self.calls.values():
            _cancel(call)
            call.outgoing = b""
        self.calls.clear()
        self._pending.clear()
        self._waiting = 0
        self._big.clear()

    def _handshake_expired(self) -> None:
        self._warnings.warn(self._peer, "no HTTP/2 preface and SETTINGS within %gs: connection closed",
                            self._grpc.handshake_timeout_s)
        self.close()

    def _idle_check(self) -> None:
        """Close a connection without streams or frames for advanced.grpc.idle_timeout_s (Envoy reconnects when it needs one)."""
        quiet = self._loop.time() - self._last_frame
        idle = self._grpc.idle_timeout_s
        if self.calls or quiet < idle:
            self._timer = self._loop.call_later(idle if self.calls else idle - quiet, self._idle_check)
            return
        log.debug("connection from %s idle for %gs: closed", self._peer, quiet)
        self._h2.send_goaway(self._h2.highest_inbound_stream_id, 0, b"idle")
        self._flush()
        self.close()

    def go_away(self) -> None:
        """No new streams (shutdown), in HTTP/2's two steps, so a stream already on its way is not lost.

        First GOAWAY(last stream 2^31-1) and a PING; once the PING comes back,
        every stream the client had sent before reading the first is here, and
        the final GOAWAY names the last one. Running streams go on; the
        connection ends with the last of them.
        """
        if self._transport is None or self._draining:
            return
        self._draining = True
        self._h2.send_goaway(LAST_STREAM)
        self._h2.ping(_SHUTDOWN_PING)
        self._flush()

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def _end_if_done(self) -> None:
        if self._draining and not self.calls:
            self._flush()
            self.close()

    # -- frames in ------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self._ended:
            return
        self._last_frame = self._loop.time()
        try:
            events = self._read(data)
        except Http2Error as exc:  # the GOAWAY that says why is queued
            if exc.code == ErrorCode.ENHANCE_YOUR_CALM:
                self._flood(str(exc), queued=True)
            else:
                self._warnings.warn(self._peer, "HTTP/2 protocol error, connection closed: %s", exc)
                self._end()
            return
        for kind, stream_id, value, size in events:
            if kind == http2.DATA:
                self._data(stream_id, value, size)
            elif kind == http2.REQUEST:
                self._start(stream_id, value)
                if self._ended:  # the stream was one too many
                    return
            elif kind == http2.ENDED:
                call = self.calls.get(stream_id)
                if call is not None and call.closing is None:
                    try:
                        call.end()
                    except GrpcError as exc:
                        self._fail(call, exc)
            elif kind == http2.RESET:
                call = self._drop(stream_id)
                if call is not None:
                    _cancel(call)
                    if self._premature_reset(call.born, self._last_frame):
                        return
            else:
                self._connection_event(kind, stream_id, value)
        self._flush_soon()
        if self._h2.more_input:
            self._more_later()

    def _connection_event(self, kind: int, stream_id: int, value: Any) -> None:
        if kind == http2.WINDOW:
            if stream_id:
                pending = self._pending.get(stream_id)
                if pending is not None:
                    self._drain(pending)
            else:
                self._drain_pending()
        elif kind == http2.SETTLED and not self._handshaken:
            self._handshaken = True
            if self._timer is not None:
                self._timer.cancel()
            self._timer = self._loop.call_later(self._grpc.idle_timeout_s, self._idle_check)
        elif kind == http2.PONG and value == _SHUTDOWN_PING:
            self._last_stream = self._h2.highest_inbound_stream_id
            self._h2.send_goaway(self._last_stream)
            self._end_if_done()
        elif kind == http2.GOING_AWAY:
            self._peer_goaway(*value)

    def _peer_goaway(self, error_code: int, debug: bytes) -> None:
        """The client opens no more streams; NO_ERROR lets the running ones finish, an error ends them."""
        if error_code == ErrorCode.NO_ERROR:
            self._draining = True
            self._end_if_done()
            return
        try:
            code: object = ErrorCode(error_code).name
        except ValueError:  # a code RFC 9113 does not name
            code = error_code
        self._warnings.warn(self._peer, "GOAWAY %s (%s), connection closed", code, shown(debug))
        self.close()

    def _start(self, stream_id: int, header_list: list[tuple[bytes, bytes]]) -> None:
        if self._last_stream is not None and stream_id > self._last_stream:
            self._h2.reset_stream(stream_id, ErrorCode.REFUSED_STREAM)  # after our final GOAWAY: retry elsewhere
            return
        if len(self.calls) >= self._grpc.max_streams_per_connection:
            self._warnings.warn(self._peer, "stream refused: %d open on one connection "
                                "(advanced.grpc.max_streams_per_connection)", len(self.calls))
            self._h2.reset_stream(stream_id, ErrorCode.REFUSED_STREAM)
            return
        if self._waiting > self._grpc.output_buffer_bytes:  # new work from a peer that takes none of ours
            self._flood(f"a new stream while {self._waiting} bytes of replies wait on the peer's windows "
                        "(past advanced.grpc.output_buffer_bytes)")
            return
        headers = dict(header_list)
        # What Envoy sends is let through at once; anything else is looked at (refused says what a reference server does).
        plain = headers.get(b"content-type") == b"application/grpc" and headers.get(b":method") == b"POST"
        refusal = None if plain else refused(headers)
        if refusal is not None:
            self._warnings.warn(self._peer, "not a gRPC request: %s", refusal[2])
            self._close_stream(stream_id, [(b":status", refusal[0]), (b"content-type", b"application/grpc"),
                                           *trailers(refusal[1], refusal[2])])
            return
        method = self._methods.get(headers.get(b":path", b"").decode("latin-1"))
        if method is None:  # grpcio's words
            self._close_stream(stream_id, [*RESPONSE_HEADERS, *trailers(UNIMPLEMENTED, "Method not found!")])
            return
        call = Call(stream_id, method, self, self._last_frame)
        self.calls[stream_id] = call
        call.task = self._loop.create_task(self._run(call))

    def _data(self, stream_id: int, data: bytes, size: int) -> None:
        call = self.calls.get(stream_id)
        if call is None or call.closing is not None:  # a stream we are done with: only the window matters
            self._h2.acknowledge_received_data(size, stream_id)
            return
        call.unacked += size
        self.buffered += len(data)
        try:
            call.received(data, self._max_message)
        except GrpcError as exc:
            self._fail(call, exc)
            return
        self._account(call)
        self._acknowledge(call)
        while self.buffered > self._connection_budget:
            victim = max(self._big, key=lambda c: c.buffered) if self._big else call
            if not victim.buffered:
                break
            self._fail(victim, GrpcError(RESOURCE_EXHAUSTED, f"more than {self._connection_budget} request bytes "
                                         "unread on this connection (advanced.grpc.connection_buffer_bytes)"))

    # -- flow control ---------------------------------------------------------------------

    def consumed(self, call: Call) -> None:
        """A handler took a message of a call that held BIG bytes or more, or has bytes to hand back (Call.__anext__,
        which counted it off ``buffered``): its place among the big ones, and its bytes handed back to the peer."""
        self._account(call)
        if call.unacked and self._transport is not None:
            self._acknowledge(call)
            self._flush_soon()

    def _acknowledge(self, call: Call) -> None:
        """Hand back what keeps the call's unread bytes, plus what the peer may still send, within one message."""
        keep = max(0, call.buffered + STREAM_WINDOW - self._stream_budget)
        if call.unacked > keep:
            self._h2.acknowledge_received_data(call.unacked - keep, call.stream_id)
            call.unacked = keep

    def _account(self, call: Call) -> None:
        if call.buffered >= BIG:
            self._big.add(call)
        else:
            self._big.discard(call)

    def _release(self, call: Call) -> None:
        """The call will read nothing more: its unread bytes are gone, its window is the connection's again."""
        self.buffered -= call.buffered
        call.buffered = 0
        call.buffer = b""
        call.inbox = None
        self._big.discard(call)
        if call.unacked:
            self._h2.acknowledge_received_data(call.unacked, call.stream_id)
            call.unacked = 0

    # -- replies out ----------------------------------------------------------------------

    async def _run(self, call: Call) -> None:
        try:
            status, message = OK, ""
            try:
                async for reply in call.method.handler(call):
                    if call.closing is not None:  # finished by the transport (bad input): nothing more to say
                        return
                    payload = reply.SerializeToString()
                    call.outgoing += b"\0" + len(payload).to_bytes(4, "big") + payload
                    if not self._drain(call):  # the stream was reset or closed while the reply was being made
                        return
                    self._flush_soon()
            except GrpcError as exc:
                status, message = exc.status, exc.message
            except Exception:
                log.exception("handler for stream %d failed", call.stream_id)
                status, message = INTERNAL, "internal error"
            if call.closing is None and self.calls.get(call.stream_id) is call:
                self._finish(call, status, message)
                self._flush_soon()
        finally:
            # A reset leaves its CancelledError in the task, and that error's traceback holds this frame, which
            # holds the call: with the call's link back to the task dropped, the task, its frames and the request
            # they hold are freed at once instead of waiting for the cyclic GC (test_h2grpc_garbage.py).
            call.task = None

    def _fail(self, call: Call, exc: GrpcError) -> None:
        """The peer's bytes end this call (and only it): the handler is cancelled, the client gets the status."""
        self._warnings.warn(self._peer, "stream %d ended with gRPC status %d: %s", call.stream_id,
                            exc.status, exc.message)
        _cancel(call)
        self._release(call)
        self._finish(call, exc.status, exc.message)

    def _finish(self, call: Call, status: int, message: str) -> None:
        """End the call with trailers (after any reply bytes still waiting on the window)."""
        status_trailers = trailers(status, message)
        call.closing = status_trailers if call.started else [*RESPONSE_HEADERS, *status_trailers]
        if not call.outgoing:
            self._close_stream(call.stream_id, call.closing)

    def _close_stream(self, stream_id: int, last: list[tuple[bytes, bytes]]) -> None:
        try:
            self._h2.send_headers(stream_id, last, end_stream=True)
        except StreamClosed:  # closed by the client's end or reset: nothing more to say
            pass
        else:
            # The client may still send (its end may not have been handled yet): we are done listening.
            # A stream both sides ended is closed: nothing to reset, nothing is sent.
            self._h2.reset_stream(stream_id, ErrorCode.NO_ERROR)
        self._drop(stream_id)  # last: a draining connection ends with it

    def _drop(self, stream_id: int) -> Call | None:
        """Forget a call whose stream is over (the connection ends with its last, once draining)."""
        call = self.calls.pop(stream_id, None)
        if self._pending.pop(stream_id, None) is not None and call is not None:
            self._waiting -= call.parked
        if call is not None:
            self._closed_calls += 1
            self._release(call)
            self._end_if_done()
        return call

    def _drain(self, call: Call) -> bool:
        """Send as much of the call's pending reply bytes as the flow-control windows allow, while the peer reads
        (its response headers first, with its first reply); False if the stream turned out closed (the call dropped)."""
        if self._pending.pop(call.stream_id, None) is not None:
            self._waiting -= call.parked
        outgoing, headers = call.outgoing, not call.started
        call.started = True
        room = -1 if self._paused & OUTPUT else self._grpc.output_buffer_bytes - self._queued
        try:
            sent = self._h2.send_reply(call.stream_id, outgoing, room, headers=headers)
        except StreamClosed:
            call.outgoing = b""
            self._drop(call.stream_id)
            return False
        self._queued += sent
        if sent < len(outgoing):
            call.outgoing = outgoing[sent:]  # what is left is cut off once, not after every frame
            self._output_full()  # marks the write to wait for, if that is what stopped it
            self._park(call)
            return True
        call.outgoing = b""
        if call.waiter is not None:
            call.wake()  # its handler may read on
        if call.closing is not None:
            self._close_stream(call.stream_id, call.closing)
        return True

    def _park(self, call: Call) -> None:
        """The call's reply waits (at the back: the next window goes to the others first), counted as output the
        peer has not taken: past max_output_buffer_bytes with what its socket holds, the connection ends."""
        self._pending[call.stream_id] = call
        call.parked = len(call.outgoing)
        self._waiting += call.parked
        if self._waiting > self._grpc.max_output_buffer_bytes:
            self._output_check(0)

    def _output_full(self) -> bool:
        """The peer has output_buffer_bytes of ours unread, or this loop cycle's write will be that large.

        Replies then wait with their calls, as on a shut window, and their
        handlers with them (Call.__anext__): a window opened for every stream
        at once (SETTINGS) cannot pour every waiting reply into one write.
        They go once that write was taken (the next cycle) or read (resume_writing).
        """
        if self._paused & OUTPUT or self._queued > self._grpc.output_buffer_bytes:
            self._parked = True
            return True
        return False

    def _drain_pending(self) -> None:
        """A window opened, or our output was taken: the calls waiting, not every call, get their turn."""
        for call in list(self._pending.values()):
            if self._h2.outbound_flow_control_window <= 0 or self._output_full():
                return
            self._drain(call)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._drain_pending()
        self._flush_soon()

    def _flush(self) -> None:
        """Write what the HTTP/2 layer has to send now (before a close, which must not cut it off).

        Then what the peer left unread is checked against the limits: the bytes
        that wait, and the frames they are (builtin/flood.py).
        """
        self._flush_pending = False
        transport = self._transport
        if transport is None or self._ended:
            return
        out = self._h2.out  # data_to_send's two steps here: this runs once per loop cycle with work
        data = bytes(out)
        out.clear()
        self._queued = 0
        if data:
            transport.write(data)
            self.writes += 1
            self._output_check(len(data))
        if self._parked and not self._paused & OUTPUT:  # taken: the replies that waited on this write go on
            self._parked = False
            self._loop.call_soon(self._drain_pending)

    def _flush_soon(self) -> None:
        """Write what the HTTP/2 layer has to send once the loop has run what is ready: one write for many streams' replies.

        At saturation a socket read brings a dozen streams' messages; their
        handlers run in the next loop iteration, before this write (which is
        queued after them), so their replies and the window updates leave in
        one write instead of one or two per stream.
        """
        if not self._flush_pending:
            self._flush_pending = True
            self._loop.call_soon(self._flush)


def _cancel(call: Call) -> None:
    """End the call's handler, and any other task reading the call (one its handler started): none waits on it forever.

    The call lets go of its task: a task cancelled before it first ran never
    reaches _run's own letting go, and the two would be a reference cycle
    (a stream opened and reset in one read, rapid reset's shape), each left
    to the cyclic GC, whose full passes then held the loop for 80 ms.
    """
    if call.task is not None:
        call.task.cancel()
        call.task = None
    if call.waiter is not None:
        call.waiter.cancel()
