"""The server side of one HTTP/2 connection (RFC 9113), as much of it as a gRPC server needs.

It turns the peer's bytes into events and our sends into frames, and keeps the
state those depend on: the preface and SETTINGS, each open stream's two
halves, flow control both ways, HEADERS with CONTINUATION decoded by HPACK
(h2grpc_hpack.py), and the connection's error. It does no I/O:
h2grpc_connection.py feeds it what the socket read and writes what it
queued. What the protocol asks of a peer is checked here and answered as RFC
9113 says: a connection error queues GOAWAY and raises :class:`Http2Error`;
a stream error resets that stream and is reported as its reset.

Why not the ``h2`` library, which this replaced: it is general (both sides,
push, priorities, header validation, an event object per frame, a state
machine stepped through enum tables, a frame object per frame built and
parsed by hyperframe), and that generality was about a quarter of the
processor's CPU per held-and-released request (docs/decisions.md). This
module is one class with a slotted record per open stream.

What is left out, as a gRPC server may: server push (never sent; a client's
PUSH_PROMISE is a connection error), priorities (read, checked and ignored,
as RFC 9113 lets a server), and the checks h2 did not make here either (the
transport reads three headers and refuses per stream what it does not serve).
"""

from __future__ import annotations

from typing import Any, NoReturn

from hpack import Encoder, HPACKError

from extproc.adapters.ext_proc import h2grpc_frames as f
from extproc.adapters.ext_proc.h2grpc_frames import ErrorCode
from extproc.adapters.ext_proc.h2grpc_hpack import MemoDecoder

# What receive_data reports: (kind, stream id, value, size) tuples.
REQUEST = 1  # a new stream's headers: value the header list
DATA = 2  # value the data, size the flow-controlled length (with padding)
ENDED = 3  # the peer half-closed the stream
RESET = 4  # the stream is over: the peer reset it, or a stream error did (value the error code)
WINDOW = 5  # the peer opened a send window: stream 0 for the connection's
SETTLED = 6  # the peer's SETTINGS (its first is the handshake's)
PONG = 7  # the answer to our PING: value its 8 bytes
GOING_AWAY = 8  # the peer's GOAWAY: value (error code, debug data), size the last stream id

Event = tuple[int, int, Any, int]
Headers = list[tuple[bytes, bytes]]

# A header block larger than this (in HPACK bytes, HEADERS and CONTINUATIONs together) ends the connection
# before it is decoded: a bound on what a peer makes us buffer, far above the header list limit's worth.
MAX_BLOCK_FACTOR = 4
# And a block in more CONTINUATION frames than this ends it too: empty ones would cost CPU without end (h2's bound).
MAX_CONTINUATIONS = 64
# Streams we reset, remembered so that frames the peer sent before it read our RST_STREAM are ignored: the
# last 1,024 (a round trip's worth of our resets, at about 60 KB a connection at most); a frame on one
# forgotten is answered as on any closed stream.
REMEMBERED_RESETS = 1024
# The response headers of every gRPC reply; as a block: ":status: 200" from HPACK's static table and
# content-type a literal that is not indexed, so the encoder's dynamic table (the trailers') is untouched.
RESPONSE_HEADERS = [(b":status", b"200"), (b"content-type", b"application/grpc")]
_RESPONSE_BLOCK = b"\x88\x0f\x10\x10application/grpc"
_RESPONSE_FRAME = len(_RESPONSE_BLOCK).to_bytes(3, "big") + bytes([f.HEADERS, f.END_HEADERS])
_EMPTY = b""
# A HEADERS frame whose priority names its own stream: a flag of ours, outside the wire's 8 bits.
_SELF_DEPENDENT = 0x100


class Http2Error(Exception):
    """A connection error (RFC 9113, 5.4.1): the GOAWAY that says why is queued, and the connection must close."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code


class StreamClosed(Exception):
    """Nothing may be sent on this stream any more: the peer reset it, or both sides ended it."""


class _Stream:
    """An open stream: its windows both ways, and which halves are still open."""

    __slots__ = ("send_window", "recv_window", "processed", "remote_open", "local_open")

    def __init__(self, send_window: int, recv_window: int, remote_open: bool) -> None:
        self.send_window = send_window  # what we may still send
        self.recv_window = recv_window  # what the peer may still send
        self.processed = 0  # bytes the handler took that the peer was not given back yet
        self.remote_open = remote_open
        self.local_open = True


def _increment(window: int, processed: int, largest: int) -> int:
    """How much window to give back: h2's rule, kept so the peer sees the same updates.

    Once half the window's worth is processed, or the window is shut and more
    than 1 KB (a quarter of a small window) is: few WINDOW_UPDATEs for many
    small DATA frames, and a stream is never left blocked.
    """
    if processed >= largest // 2 or (window == 0 and processed > min(1024, largest // 4)):
        return min(processed, largest - window)
    return 0


class Http2Connection:
    """One server connection's HTTP/2 state: events out of received bytes, frames out of sends."""

    def __init__(self, *, max_streams: int, stream_window: int, connection_window: int,
                 max_header_list: int = 2**16) -> None:
        self.streams: dict[int, _Stream] = {}
        self.highest_inbound_stream_id = 0
        self.max_outbound_frame_size = f.DEFAULT_FRAME_SIZE
        self.outbound_flow_control_window = f.DEFAULT_WINDOW
        self.decoder = MemoDecoder(max_header_list, 4096)
        self.encoder = Encoder()
        self._settings = {f.MAX_CONCURRENT_STREAMS: max_streams, f.INITIAL_WINDOW_SIZE: stream_window,
                          f.MAX_HEADER_LIST_SIZE: max_header_list}
        self._stream_window = stream_window
        self._connection_window = connection_window
        self._recv_window = f.DEFAULT_WINDOW  # the connection's: what the peer may still send
        self._processed = 0
        self._peer_window = f.DEFAULT_WINDOW  # the peer's SETTINGS_INITIAL_WINDOW_SIZE: a new stream's send window
        self._max_block = MAX_BLOCK_FACTOR * max_header_list
        self._out = bytearray()
        self._in = _EMPTY
        self._preface = f.PREFACE  # what of the preface is still to come
        self._settled = False  # the peer's first frame, a SETTINGS, came
        self._block: tuple[int, int, bytearray] | None = None  # a header block waiting on CONTINUATION
        self._continuations = 0  # the CONTINUATION frames of that block so far
        self._resets: dict[int, None] = {}  # streams we reset, oldest first
        self._broken = False

    # -- our side ---------------------------------------------------------------------------------

    def initiate_connection(self) -> None:
        """Our SETTINGS, and the connection's receive window opened to its size (its default is 64 KB)."""
        self._out += f.settings(self._settings)
        if self._connection_window > f.DEFAULT_WINDOW:
            self._out += f.window_update(0, self._connection_window - f.DEFAULT_WINDOW)
            self._recv_window = self._connection_window

    def data_to_send(self) -> bytes:
        out = bytes(self._out)
        self._out.clear()
        return out

    def _open(self, stream_id: int) -> _Stream:
        stream = self.streams.get(stream_id)
        if stream is None or not stream.local_open:
            raise StreamClosed(stream_id)
        return stream

    def send_response_headers(self, stream_id: int) -> None:
        """RESPONSE_HEADERS on a stream, as constant bytes (the same two headers on every stream)."""
        self._open(stream_id)
        self._out += _RESPONSE_FRAME + stream_id.to_bytes(4, "big") + _RESPONSE_BLOCK

    def send_headers(self, stream_id: int, headers: Headers, *, end_stream: bool = True) -> None:
        """Headers (trailers, or a whole refusal) HPACK-encoded; with ``end_stream`` our half of the stream ends."""
        stream = self._open(stream_id)
        self._out += f.header_block(stream_id, self.encoder.encode(headers), end_stream, self.max_outbound_frame_size)
        if end_stream:
            stream.local_open = False
            if not stream.remote_open:
                del self.streams[stream_id]

    def send_data(self, stream_id: int, data: bytes) -> None:
        """One DATA frame; the caller keeps it within local_flow_control_window and max_outbound_frame_size."""
        stream = self._open(stream_id)
        size = len(data)
        stream.send_window -= size
        self.outbound_flow_control_window -= size
        self._out += f.HEADER.pack(size >> 8, size & 0xFF, f.DATA, 0, stream_id) + data

    def local_flow_control_window(self, stream_id: int) -> int:
        """How much DATA may go out on the stream now: the smaller of its window and the connection's."""
        return min(self._open(stream_id).send_window, self.outbound_flow_control_window)

    def reset_stream(self, stream_id: int, code: int) -> None:
        """RST_STREAM, if the stream is still open (a closed one has nothing to reset: nothing is sent)."""
        if self.streams.pop(stream_id, None) is not None:
            self._out += f.rst_stream(stream_id, code)
            self._remember_reset(stream_id)

    def acknowledge_received_data(self, size: int, stream_id: int) -> None:
        """The handler took ``size`` flow-controlled bytes: the peer may send them again (when it is worth a frame)."""
        self._processed += size
        increment = _increment(self._recv_window, self._processed, self._connection_window)
        if increment:
            self._processed = 0
            self._recv_window += increment
            self._out += f.window_update(0, increment)
        stream = self.streams.get(stream_id)
        if stream is None or not stream.remote_open:  # the peer sends nothing more on it
            return
        stream.processed += size
        increment = _increment(stream.recv_window, stream.processed, self._stream_window)
        if increment:
            stream.processed = 0
            stream.recv_window += increment
            self._out += f.window_update(stream_id, increment)

    def send_goaway(self, last_stream_id: int, code: int = 0, debug: bytes = b"") -> None:
        """GOAWAY as a message (no new streams after ``last_stream_id``): the connection decides when it ends."""
        self._out += f.goaway(last_stream_id, code, debug)

    def ping(self, data: bytes) -> None:
        self._out += f.ping(data)

    def _remember_reset(self, stream_id: int) -> None:
        resets = self._resets
        resets[stream_id] = None
        if len(resets) > REMEMBERED_RESETS:
            del resets[next(iter(resets))]

    # -- the peer's side --------------------------------------------------------------------------

    def receive_data(self, data: bytes) -> list[Event]:
        """The events the peer's bytes make, in order. Raises Http2Error (its GOAWAY queued) on a connection error."""
        if self._broken:
            return []
        buffer = self._in + data if self._in else data
        if self._preface:
            expected = self._preface
            if buffer[:len(expected)] != expected[:len(buffer)]:
                self._fail(ErrorCode.PROTOCOL_ERROR, "invalid HTTP/2 preface")
            if len(buffer) < len(expected):
                self._preface = expected[len(buffer):]
                self._in = _EMPTY
                return []
            buffer = buffer[len(expected):]
            self._preface = _EMPTY
        events: list[Event] = []
        position, end = 0, len(buffer)
        try:
            while end - position >= f.HEADER_SIZE:
                high, low, kind, flags, stream_id = f.HEADER.unpack_from(buffer, position)
                length = high << 8 | low
                if length > f.DEFAULT_FRAME_SIZE:
                    self._fail(ErrorCode.FRAME_SIZE_ERROR, f"a frame of {length} bytes (SETTINGS_MAX_FRAME_SIZE 16384)")
                stop = position + f.HEADER_SIZE + length
                if stop > end:
                    break
                payload = buffer[position + f.HEADER_SIZE:stop]
                position = stop
                self._frame(kind, flags, stream_id & f.STREAM_MASK, payload, events)
        except Http2Error:
            self._in = _EMPTY
            raise
        self._in = buffer[position:]
        return events

    def _fail(self, code: ErrorCode, message: str) -> NoReturn:
        """A connection error: GOAWAY with the last stream we took, and nothing more is read."""
        self._broken = True
        self._out += f.goaway(self.highest_inbound_stream_id, code)
        raise Http2Error(code, message)

    def _frame(self, kind: int, flags: int, stream_id: int, payload: bytes, events: list[Event]) -> None:
        if self._block is not None and kind != f.CONTINUATION:
            self._fail(ErrorCode.PROTOCOL_ERROR, "a header block not followed by its CONTINUATION")
        if not self._settled and kind != f.SETTINGS:
            self._fail(ErrorCode.PROTOCOL_ERROR, "the first frame is not SETTINGS")
        if kind == f.DATA:
            self._data(flags, stream_id, payload, events)
        elif kind == f.HEADERS:
            self._headers(flags, stream_id, payload, events)
        elif kind == f.RST_STREAM:
            self._rst_stream(stream_id, payload, events)
        elif kind == f.WINDOW_UPDATE:
            self._window_update(stream_id, payload, events)
        elif kind == f.CONTINUATION:
            self._continuation(flags, stream_id, payload, events)
        elif kind == f.SETTINGS:
            self._settings_frame(flags, stream_id, payload, events)
        elif kind == f.PING:
            self._ping(flags, stream_id, payload, events)
        elif kind == f.GOAWAY:
            if stream_id:
                self._fail(ErrorCode.PROTOCOL_ERROR, "GOAWAY on a stream")
            if len(payload) < 8:
                self._fail(ErrorCode.FRAME_SIZE_ERROR, "GOAWAY shorter than 8 bytes")
            events.append((GOING_AWAY, 0, (f.u32(payload, 4), payload[8:]), f.u32(payload) & f.STREAM_MASK))
        elif kind == f.PRIORITY:
            self._priority(stream_id, payload, events)
        elif kind == f.PUSH_PROMISE:
            self._fail(ErrorCode.PROTOCOL_ERROR, "PUSH_PROMISE from a client")
        # Any other type is an extension we do not know: ignored (RFC 9113, 4.1).

    def _stream_error(self, stream_id: int, code: ErrorCode, events: list[Event]) -> None:
        """A stream error (RFC 9113, 5.4.2): RST_STREAM; an open stream ends as if reset."""
        self._out += f.rst_stream(stream_id, code)
        self._remember_reset(stream_id)
        if self.streams.pop(stream_id, None) is not None:
            events.append((RESET, stream_id, code, 0))

    def _unpadded(self, flags: int, payload: bytes) -> bytes:
        if not flags & f.PADDED:
            return payload
        if not payload or payload[0] >= len(payload):
            self._fail(ErrorCode.PROTOCOL_ERROR, "padding as long as the frame")
        return payload[1:len(payload) - payload[0]]

    def _data(self, flags: int, stream_id: int, payload: bytes, events: list[Event]) -> None:
        if not stream_id:
            self._fail(ErrorCode.PROTOCOL_ERROR, "DATA on stream 0")
        size = len(payload)
        if size > self._recv_window:
            self._fail(ErrorCode.FLOW_CONTROL_ERROR, "DATA beyond the connection's window")
        self._recv_window -= size
        data = self._unpadded(flags, payload)
        stream = self.streams.get(stream_id)
        if stream is None or not stream.remote_open:
            if stream_id > self.highest_inbound_stream_id:
                self._fail(ErrorCode.PROTOCOL_ERROR, f"DATA on idle stream {stream_id}")
            self.acknowledge_received_data(size, 0)  # nobody reads it: the connection's window is the peer's again
            if stream is not None or stream_id not in self._resets:  # not in flight past our reset: an error
                self._stream_error(stream_id, ErrorCode.STREAM_CLOSED, events)
            return
        if size > stream.recv_window:
            self._fail(ErrorCode.FLOW_CONTROL_ERROR, f"DATA beyond stream {stream_id}'s window")
        stream.recv_window -= size
        events.append((DATA, stream_id, data, size))
        if flags & f.END_STREAM:
            self._remote_end(stream_id, stream, events)

    def _remote_end(self, stream_id: int, stream: _Stream, events: list[Event]) -> None:
        stream.remote_open = False
        if not stream.local_open:
            del self.streams[stream_id]
        events.append((ENDED, stream_id, None, 0))

    def _headers(self, flags: int, stream_id: int, payload: bytes, events: list[Event]) -> None:
        if not stream_id:
            self._fail(ErrorCode.PROTOCOL_ERROR, "HEADERS on stream 0")
        block = self._unpadded(flags, payload)
        if flags & f.PRIORITY_FLAG:
            if len(block) < 5:
                self._fail(ErrorCode.FRAME_SIZE_ERROR, "HEADERS too short for its priority")
            depends_on = f.u32(block) & f.STREAM_MASK
            block = block[5:]
            if depends_on == stream_id:
                flags |= _SELF_DEPENDENT
        if flags & f.END_HEADERS:
            self._header_block(flags, stream_id, block, events)
        else:
            self._block = (stream_id, flags, bytearray(block))
            self._continuations = 0

    def _continuation(self, flags: int, stream_id: int, payload: bytes, events: list[Event]) -> None:
        pending = self._block
        if pending is None or pending[0] != stream_id:
            self._fail(ErrorCode.PROTOCOL_ERROR, "CONTINUATION without the HEADERS it continues")
        block = pending[2]
        block += payload
        self._continuations += 1
        if len(block) > self._max_block or self._continuations > MAX_CONTINUATIONS:
            self._fail(ErrorCode.ENHANCE_YOUR_CALM, f"a header block over {self._max_block} bytes or "
                       f"{MAX_CONTINUATIONS} CONTINUATION frames")
        if flags & f.END_HEADERS:
            self._block = None
            self._header_block(pending[1], stream_id, bytes(block), events)

    def _header_block(self, flags: int, stream_id: int, block: bytes, events: list[Event]) -> None:
        """A whole header block: decoded in any case (HPACK's table is the connection's), then a stream opens or ends."""
        try:
            headers: Headers = self.decoder.decode(block, raw=True)  # type: ignore[assignment]
        except HPACKError as exc:  # OversizedHeaderListError included: a block we will not hold
            self._fail(ErrorCode.COMPRESSION_ERROR, f"header block: {exc}")
        stream = self.streams.get(stream_id)
        if stream is not None:  # trailers: they must end the stream (RFC 9113, 8.1)
            if not stream.remote_open:
                self._stream_error(stream_id, ErrorCode.STREAM_CLOSED, events)
            elif not flags & f.END_STREAM or flags & _SELF_DEPENDENT:
                self._stream_error(stream_id, ErrorCode.PROTOCOL_ERROR, events)
            else:
                self._remote_end(stream_id, stream, events)
            return
        if stream_id <= self.highest_inbound_stream_id:
            if stream_id in self._resets:  # sent before the peer read our RST_STREAM
                return
            self._fail(ErrorCode.PROTOCOL_ERROR, f"HEADERS on stream {stream_id}, closed or skipped")
        if not stream_id % 2:
            self._fail(ErrorCode.PROTOCOL_ERROR, f"a client stream with an even id ({stream_id})")
        self.highest_inbound_stream_id = stream_id
        if flags & _SELF_DEPENDENT:
            self._stream_error(stream_id, ErrorCode.PROTOCOL_ERROR, events)
            return
        ends = bool(flags & f.END_STREAM)
        self.streams[stream_id] = _Stream(self._peer_window, self._stream_window, not ends)
        events.append((REQUEST, stream_id, headers, 0))
        if ends:
            events.append((ENDED, stream_id, None, 0))

    def _rst_stream(self, stream_id: int, payload: bytes, events: list[Event]) -> None:
        if len(payload) != 4:
            self._fail(ErrorCode.FRAME_SIZE_ERROR, "RST_STREAM not 4 bytes")
        if not stream_id or stream_id > self.highest_inbound_stream_id:
            self._fail(ErrorCode.PROTOCOL_ERROR, f"RST_STREAM on idle stream {stream_id}")
        if self.streams.pop(stream_id, None) is not None:  # on a closed stream: nothing to end
            events.append((RESET, stream_id, f.u32(payload), 0))

    def _window_update(self, stream_id: int, payload: bytes, events: list[Event]) -> None:
        if len(payload) != 4:
            self._fail(ErrorCode.FRAME_SIZE_ERROR, "WINDOW_UPDATE not 4 bytes")
        increment = f.u32(payload) & f.STREAM_MASK
        if not stream_id:
            if not increment:
                self._fail(ErrorCode.PROTOCOL_ERROR, "WINDOW_UPDATE of 0 on the connection")
            self.outbound_flow_control_window += increment
            if self.outbound_flow_control_window > f.MAX_WINDOW:
                self._fail(ErrorCode.FLOW_CONTROL_ERROR, "the connection's window over 2^31-1")
            events.append((WINDOW, 0, None, 0))
            return
        stream = self.streams.get(stream_id)
        if stream is None:
            if stream_id > self.highest_inbound_stream_id:
                self._fail(ErrorCode.PROTOCOL_ERROR, f"WINDOW_UPDATE on idle stream {stream_id}")
            return  # a closed stream: frames in flight are ignored
        if not increment:
            self._stream_error(stream_id, ErrorCode.PROTOCOL_ERROR, events)
            return
        stream.send_window += increment
        if stream.send_window > f.MAX_WINDOW:
            self._stream_error(stream_id, ErrorCode.FLOW_CONTROL_ERROR, events)
            return
        events.append((WINDOW, stream_id, None, 0))

    def _settings_frame(self, flags: int, stream_id: int, payload: bytes, events: list[Event]) -> None:
        if stream_id:
            self._fail(ErrorCode.PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & f.ACK:
            if payload:
                self._fail(ErrorCode.FRAME_SIZE_ERROR, "SETTINGS ACK with a payload")
            if not self._settled:
                self._fail(ErrorCode.PROTOCOL_ERROR, "the first frame is a SETTINGS ACK")
            return
        if len(payload) % 6:
            self._fail(ErrorCode.FRAME_SIZE_ERROR, "SETTINGS not a multiple of 6 bytes")
        for code, value in f.parse_settings(payload):
            self._setting(code, value, events)
        self._settled = True
        self._out += f.frame(f.SETTINGS, f.ACK, 0)
        events.append((SETTLED, 0, None, 0))

    def _setting(self, code: int, value: int, events: list[Event]) -> None:
        if code == f.INITIAL_WINDOW_SIZE:
            if value > f.MAX_WINDOW:
                self._fail(ErrorCode.FLOW_CONTROL_ERROR, "SETTINGS_INITIAL_WINDOW_SIZE over 2^31-1")
            delta, self._peer_window = value - self._peer_window, value
            if delta:  # every open stream's window moves by the difference (RFC 9113, 6.9.2)
                for stream in self.streams.values():
                    stream.send_window += delta
                    if stream.send_window > f.MAX_WINDOW:
                        self._fail(ErrorCode.FLOW_CONTROL_ERROR, "a stream's window over 2^31-1")
                if delta > 0:
                    events.append((WINDOW, 0, None, 0))
        elif code == f.MAX_FRAME_SIZE:
            if not f.DEFAULT_FRAME_SIZE <= value <= f.LARGEST_FRAME_SIZE:
                self._fail(ErrorCode.PROTOCOL_ERROR, f"SETTINGS_MAX_FRAME_SIZE {value}")
            self.max_outbound_frame_size = value
        elif code == f.HEADER_TABLE_SIZE:
            self.encoder.header_table_size = value
        elif code == f.ENABLE_PUSH and value > 1:
            self._fail(ErrorCode.PROTOCOL_ERROR, f"SETTINGS_ENABLE_PUSH {value}")
        # The others (concurrent streams, header list size, unknown codes) ask nothing of a server that never pushes.

    def _ping(self, flags: int, stream_id: int, payload: bytes, events: list[Event]) -> None:
        if stream_id:
            self._fail(ErrorCode.PROTOCOL_ERROR, "PING on a stream")
        if len(payload) != 8:
            self._fail(ErrorCode.FRAME_SIZE_ERROR, "PING not 8 bytes")
        if flags & f.ACK:
            events.append((PONG, 0, payload, 0))
        else:
            self._out += f.ping(payload, ack=True)

    def _priority(self, stream_id: int, payload: bytes, events: list[Event]) -> None:
        """Read and ignored (RFC 9113 deprecates priorities), but for what makes it an error."""
        if not stream_id:
            self._fail(ErrorCode.PROTOCOL_ERROR, "PRIORITY on stream 0")
        if len(payload) != 5:
            self._stream_error(stream_id, ErrorCode.FRAME_SIZE_ERROR, events)
        elif f.u32(payload) & f.STREAM_MASK == stream_id:
            self._stream_error(stream_id, ErrorCode.PROTOCOL_ERROR, events)
