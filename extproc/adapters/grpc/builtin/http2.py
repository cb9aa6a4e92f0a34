"""The server side of one HTTP/2 connection (RFC 9113), as much of it as a gRPC server needs.

It turns the peer's bytes into events and our sends into frames, and keeps the
state those depend on: the preface and SETTINGS, each open stream's two
halves, flow control both ways, HEADERS with CONTINUATION decoded by HPACK
(builtin/hpack_decoder.py), and the connection's error. It does no I/O:
builtin/connection.py feeds it what the socket read and writes what it
queued. A connection error queues GOAWAY and raises :class:`Http2Error`; a
stream error resets that stream and is reported as its reset; frames that
oblige an answer or carry nothing are counted as Envoy counts them
(builtin/flood.py). It replaced the ``h2`` library, whose generality cost a
quarter of the processor's CPU per request (docs/decisions.md), and is
checked against h2's state machine (tests/adapters/grpc/test_h2grpc_conformance.py).

Left out, as a gRPC server may: server push (a client's PUSH_PROMISE is a
connection error), priorities (read, checked and ignored, as RFC 9113 lets
a server), header field checks (the transport reads three headers).
"""

from __future__ import annotations

from typing import Any, NoReturn

from hpack import Encoder, HPACKError

from extproc.adapters.config import GrpcLimits
from extproc.adapters.grpc.builtin import frames as f
from extproc.adapters.grpc.builtin.flood import DEFAULT_LIMITS, FloodCounts
from extproc.adapters.grpc.builtin.frames import ErrorCode
from extproc.adapters.grpc.builtin.hpack_decoder import MemoDecoder
from extproc.adapters.grpc.builtin.streams import BY_PEER, BY_US, ENDED_BOTH, ClosedStreams, Stream, window_increment

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

# The largest header list we take (SETTINGS_MAX_HEADER_LIST_SIZE, enforced while decoding), grpcio's hard limit
# (GRPC_ARG_ABSOLUTE_MAX_METADATA_SIZE): it bounds a block's decoding to 512 fields, 1.4 ms of pure Python.
MAX_HEADER_LIST = 16 * 1024
# A header block's cost in max_frames_per_read (builtin/flood.py): one per field, and this for its stream.
STREAM_WORK = 16
# A header block larger than this (in HPACK bytes, HEADERS and CONTINUATIONs together) ends the connection
# before it is decoded: a bound on what a peer makes us buffer, far above the header list limit's worth.
MAX_BLOCK_FACTOR = 4
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


class Http2Connection(FloodCounts, ClosedStreams):
    """One server connection's HTTP/2 state: events out of received bytes, frames out of sends."""

    def __init__(self, *, max_streams: int, stream_window: int, connection_window: int,
                 max_header_list: int = MAX_HEADER_LIST, limits: GrpcLimits = DEFAULT_LIMITS) -> None:
        FloodCounts.__init__(self, limits)
        ClosedStreams.__init__(self)
        self.streams: dict[int, Stream] = {}
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
        # The frames to write, in order: data_to_send takes them (the connection's flush reads them itself).
        self.out = bytearray()
        # The last read's work was cut at max_frames_per_read: frames of it wait for receive_data(b"").
        self.more_input = False
        self._in = _EMPTY
        self._preface = f.PREFACE  # what of the preface is still to come
        self._settled = False  # the peer's first frame, a SETTINGS, came
        self._block: tuple[int, int, bytearray] | None = None  # a header block waiting on CONTINUATION
        self._broken = False

    # -- our side ---------------------------------------------------------------------------------

    def initiate_connection(self) -> None:
        """Our SETTINGS, and the connection's receive window opened to its size (its default is 64 KB)."""
        self.out += f.settings(self._settings)
        if self._connection_window > f.DEFAULT_WINDOW:
            self.out += f.window_update(0, self._connection_window - f.DEFAULT_WINDOW)
            self._recv_window = self._connection_window

    def data_to_send(self) -> bytes:
        out = bytes(self.out)
        self.out.clear()
        return out

    def _open(self, stream_id: int) -> Stream:
        stream = self.streams.get(stream_id)
        if stream is None or not stream.local_open:
            raise StreamClosed(stream_id)
        return stream

    def send_response_headers(self, stream_id: int) -> None:
        """RESPONSE_HEADERS on a stream, as constant bytes (the same two headers on every stream)."""
        self._open(stream_id)
        self.outbound_frames += 1
        self.out += f.RESPONSE_FRAME + stream_id.to_bytes(4, "big") + f.RESPONSE_BLOCK

    def send_headers(self, stream_id: int, headers: Headers, *, end_stream: bool = True) -> None:
        """Headers (trailers, or a whole refusal) HPACK-encoded; with ``end_stream`` our half of the stream ends."""
        stream = self._open(stream_id)
        self.outbound_frames += 1
        self.out += f.header_block(stream_id, self.encoder.encode(headers), end_stream, self.max_outbound_frame_size)
        if end_stream:
            stream.local_open = False
            if not stream.remote_open:
                del self.streams[stream_id]
                self._remember(stream_id, ENDED_BOTH)

    def send_data(self, stream_id: int, data: bytes) -> None:
        """One DATA frame; the caller keeps it within local_flow_control_window and max_outbound_frame_size."""
        stream = self._open(stream_id)
        size = len(data)
        stream.send_window -= size
        self.outbound_flow_control_window -= size
        self.outbound_frames += 1
        self.data_frames_sent += 1
        self.out += f.HEADER.pack(size >> 8, size & 0xFF, f.DATA, 0, stream_id)
        self.out += data

    def send_reply(self, stream_id: int, data: bytes, room: int, *, headers: bool) -> int:
        """One call per reply: RESPONSE_HEADERS first (``headers``), then of ``data`` what the windows let go, each
        DATA frame sent while ``room`` (what the writer still takes, less each frame) is not negative; how much went."""
        stream = self._open(stream_id)
        if headers:
            self.send_response_headers(stream_id)
        sent, total = 0, len(data)
        while sent < total and room >= 0:
            size = min(total - sent, stream.send_window, self.outbound_flow_control_window, self.max_outbound_frame_size)
            if size <= 0:
                break
            self.send_data(stream_id, data[sent:sent + size] if sent or size < total else data)
            sent += size
            room -= size
        return sent

    def local_flow_control_window(self, stream_id: int) -> int:
        """How much DATA may go out on the stream now: the smaller of its window and the connection's."""
        return min(self._open(stream_id).send_window, self.outbound_flow_control_window)

    def reset_stream(self, stream_id: int, code: int) -> None:
        """RST_STREAM, if the stream is still open (a closed one has nothing to reset: nothing is sent)."""
        if self.streams.pop(stream_id, None) is not None:
            self.out += f.rst_stream(stream_id, code)
            self.own_control_frame()
            self._remember(stream_id, BY_US)

    def acknowledge_received_data(self, size: int, stream_id: int) -> None:
        """The handler took ``size`` flow-controlled bytes: the peer may send them again (when it is worth a frame)."""
        self._processed += size
        increment = window_increment(self._recv_window, self._processed, self._connection_window)
        if increment:
            self._processed = 0
            self._recv_window += increment
            self.outbound_frames += 1
            self.out += f.window_update(0, increment)
        stream = self.streams.get(stream_id)
        if stream is None or not stream.remote_open:  # the peer sends nothing more on it
            return
        stream.processed += size
        increment = window_increment(stream.recv_window, stream.processed, self._stream_window)
        if increment:
            stream.processed = 0
            stream.recv_window += increment
            self.outbound_frames += 1
            self.out += f.window_update(stream_id, increment)

    def send_goaway(self, last_stream_id: int, code: int = 0, debug: bytes = b"") -> None:
        """GOAWAY as a message (no new streams after ``last_stream_id``): the connection decides when it ends."""
        self.out += f.goaway(last_stream_id, code, debug)

    def ping(self, data: bytes) -> None:
        self.out += f.ping(data)

    # -- the peer's side --------------------------------------------------------------------------

    def receive_data(self, data: bytes, work: int = 0) -> list[Event]:
        """The events the peer's bytes make, in order (``work`` of max_frames_per_read already spent: more_input).
        Raises Http2Error (its GOAWAY queued) on a connection error."""
        self.more_input = False
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
        self.work = work
        budget = self.max_work
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
                self.work += 1
                if self.work > budget:  # the rest waits for the next loop cycle (more_input)
                    break
        except Http2Error:
            self._in = _EMPTY
            raise
        self._in = buffer[position:]
        self.more_input = self.work > budget and len(self._in) >= f.HEADER_SIZE
        return events

    @property
    def unparsed(self) -> int:
        """Received bytes not yet made into events (part of a frame, or a cut read's rest): what a peer makes us hold."""
        return len(self._in)

    def _fail(self, code: ErrorCode, message: str) -> NoReturn:
        """A connection error: GOAWAY with the last stream we took, and nothing more is read."""
        self._broken = True
        self.out += f.goaway(self.highest_inbound_stream_id, code)
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
        self.control_frame()
        self.out += f.rst_stream(stream_id, code)
        if stream_id in self.streams or stream_id in self._closed:  # one never opened stays so (as h2 has it)
            self._remember(stream_id, BY_US)
        if self.streams.pop(stream_id, None) is not None:
            events.append((RESET, stream_id, code, 0))

    def _unpadded(self, flags: int, payload: bytes) -> bytes:
        if not flags & f.PADDED:
            return payload
        if not payload or payload[0] >= len(payload):  # no Pad Length field is too short (RFC 9113, 4.2)
            self._fail(ErrorCode.PROTOCOL_ERROR if payload else ErrorCode.FRAME_SIZE_ERROR, "padding as long as the frame")
        return payload[1:len(payload) - payload[0]]

    def _data(self, flags: int, stream_id: int, payload: bytes, events: list[Event]) -> None:
        if not stream_id:
            self._fail(ErrorCode.PROTOCOL_ERROR, "DATA on stream 0")
        size = len(payload)
        if size > self._recv_window:
            self._fail(ErrorCode.FLOW_CONTROL_ERROR, "DATA beyond the connection's window")
        self._recv_window -= size
        data = self._unpadded(flags, payload)
        self.payload(data or flags & f.END_STREAM, size)
        stream = self.streams.get(stream_id)
        if stream is None or not stream.remote_open:
            if stream_id > self.highest_inbound_stream_id:
                self._fail(ErrorCode.PROTOCOL_ERROR, f"DATA on idle stream {stream_id}")
            self.acknowledge_received_data(size, 0)  # nobody reads it: the connection's window is the peer's again
            if stream is not None or self._closed_error(stream_id, headers=False):  # not past our own reset
                self._stream_error(stream_id, ErrorCode.STREAM_CLOSED, events)
            return
        if size > stream.recv_window:
            self._fail(ErrorCode.FLOW_CONTROL_ERROR, f"DATA beyond stream {stream_id}'s window")
        stream.recv_window -= size
        events.append((DATA, stream_id, data, size))
        if flags & f.END_STREAM:
            self._remote_end(stream_id, stream, events)

    def _remote_end(self, stream_id: int, stream: Stream, events: list[Event]) -> None:
        stream.remote_open = False
        if not stream.local_open:
            del self.streams[stream_id]
            self._remember(stream_id, ENDED_BOTH)
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
        self.payload(block or flags & f.END_STREAM)
        if flags & f.END_HEADERS:
            self._header_block(flags, stream_id, block, events)
        else:
            self._block = (stream_id, flags, bytearray(block))
            self.continuations = 0

    def _continuation(self, flags: int, stream_id: int, payload: bytes, events: list[Event]) -> None:
        pending = self._block
        if pending is None or pending[0] != stream_id:
            self._fail(ErrorCode.PROTOCOL_ERROR, "CONTINUATION without the HEADERS it continues")
        block = pending[2]
        block += payload
        self.continuation_frame(payload)
        if len(block) > self._max_block:
            self._fail(ErrorCode.ENHANCE_YOUR_CALM, f"a header block over {self._max_block} bytes")
        if flags & f.END_HEADERS:
            self._block = None
            self._header_block(pending[1], stream_id, bytes(block), events)

    def _header_block(self, flags: int, stream_id: int, block: bytes, events: list[Event]) -> None:
        """A whole header block: decoded in any case (HPACK's table is the connection's), then a stream opens or ends."""
        self.header_blocks += 1
        try:
            headers: Headers = self.decoder.decode(block, raw=True)  # type: ignore[assignment]
        except HPACKError as exc:  # OversizedHeaderListError included: a block we will not hold
            self._fail(ErrorCode.COMPRESSION_ERROR, f"header block: {exc}")
        self.work += len(headers) + STREAM_WORK
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
            if self._closed_error(stream_id, headers=True):
                self._stream_error(stream_id, ErrorCode.STREAM_CLOSED, events)
            return
        if not stream_id % 2:
            self._fail(ErrorCode.PROTOCOL_ERROR, f"a client stream with an even id ({stream_id})")
        self.highest_inbound_stream_id = stream_id
        if flags & _SELF_DEPENDENT:
            self._stream_error(stream_id, ErrorCode.PROTOCOL_ERROR, events)
            return
        ends = bool(flags & f.END_STREAM)
        self.streams[stream_id] = Stream(self._peer_window, self._stream_window, not ends)
        events.append((REQUEST, stream_id, headers, 0))
        if ends:
            events.append((ENDED, stream_id, None, 0))

    def _rst_stream(self, stream_id: int, payload: bytes, events: list[Event]) -> None:
        if len(payload) != 4 and stream_id:  # on stream 0 the first of its errors is that (as h2 finds it)
            self._fail(ErrorCode.FRAME_SIZE_ERROR, "RST_STREAM not 4 bytes")
        if not stream_id or stream_id > self.highest_inbound_stream_id:
            self._fail(ErrorCode.PROTOCOL_ERROR, f"RST_STREAM on idle stream {stream_id}")
        if self.streams.pop(stream_id, None) is not None:  # on a closed stream: nothing to end
            self._remember(stream_id, BY_PEER)
            events.append((RESET, stream_id, f.u32(payload), 0))

    def _window_update(self, stream_id: int, payload: bytes, events: list[Event]) -> None:
        if len(payload) != 4:
            self._fail(ErrorCode.FRAME_SIZE_ERROR, "WINDOW_UPDATE not 4 bytes")
        self.window_update_frame()
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
        self.control_frame()
        self.out += f.frame(f.SETTINGS, f.ACK, 0)
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
            self.control_frame()
            self.out += f.ping(payload, ack=True)

    def _priority(self, stream_id: int, payload: bytes, events: list[Event]) -> None:
        """Read and ignored (RFC 9113 deprecates priorities), but for what makes it an error."""
        if not stream_id:
            self._fail(ErrorCode.PROTOCOL_ERROR, "PRIORITY on stream 0")
        self.priority_frame()
        if len(payload) != 5:
            self._stream_error(stream_id, ErrorCode.FRAME_SIZE_ERROR, events)
        elif f.u32(payload) & f.STREAM_MASK == stream_id:
            self._stream_error(stream_id, ErrorCode.PROTOCOL_ERROR, events)
