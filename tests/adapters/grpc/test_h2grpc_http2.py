"""The builtin transport's HTTP/2 layer (builtin/http2.py), frame by frame: what each frame does, and what RFC 9113
says a server answers when a peer breaks a rule (a connection error: GOAWAY and the end; a stream error:
RST_STREAM, the rest of the connection goes on).

No sockets: bytes in, events and bytes out. Valid traffic comes from the h2 library's client, frames that
break a rule are built by hand, and what the layer writes is read back with hyperframe (another parser
than ours).
"""

from __future__ import annotations

from typing import Any

import h2.config
import h2.connection
import h2.events
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.adapters.config import GrpcLimits
from extproc.adapters.grpc.builtin import frames as f
from extproc.adapters.grpc.builtin import http2
from extproc.adapters.grpc.builtin.frames import ErrorCode
from extproc.adapters.grpc.builtin.http2 import Http2Connection, Http2Error, StreamClosed
from extproc.adapters.grpc.builtin.streams import REMEMBERED_RESETS
from tests.helpers.h2grpc_http2 import (
    CONNECTION_WINDOW,
    REQUEST,
    STREAM_WINDOW,
    block,
    connection_error,
    headers_frame,
    server,
    written,
)
from tests.propertyutil import examples

pytestmark = pytest.mark.unit


def kinds(conn: Http2Connection) -> list[tuple[int, int, Any]]:
    """What the server wrote, as (frame type, stream, error code or increment or flags)."""
    out = []
    for frame in written(conn):
        detail = getattr(frame, "error_code", None)
        if detail is None:
            detail = getattr(frame, "window_increment", None)
        out.append((frame.type, frame.stream_id, detail if detail is not None else sorted(frame.flags)))
    return out


# --- the preface and SETTINGS ------------------------------------------------------------------------------


def test_the_preface_may_come_byte_by_byte_and_settings_are_acknowledged() -> None:
    conn = Http2Connection(max_streams=7, stream_window=STREAM_WINDOW, connection_window=CONNECTION_WINDOW)
    conn.initiate_connection()
    ours = written(conn)
    assert [type(x).__name__ for x in ours] == ["SettingsFrame", "WindowUpdateFrame"]
    assert ours[0].settings == {f.MAX_CONCURRENT_STREAMS: 7, f.INITIAL_WINDOW_SIZE: STREAM_WINDOW,
                                f.MAX_HEADER_LIST_SIZE: 16 * 1024}
    assert ours[1].window_increment == CONNECTION_WINDOW - 65_535
    events = [e for byte in f.PREFACE + f.settings({f.MAX_FRAME_SIZE: 2**15}) for e in conn.receive_data(bytes([byte]))]
    assert events == [(http2.SETTLED, 0, None, 0)]
    assert kinds(conn) == [(f.SETTINGS, 0, ["ACK"])] and conn.max_outbound_frame_size == 2**15


@pytest.mark.parametrize("garbage", [b"GET / HTTP/1.1\r\n", b"PRI * HTTP/1.1", b"\x00" * 30])
def test_anything_but_the_preface_is_a_protocol_error(garbage: bytes) -> None:
    conn = Http2Connection(max_streams=7, stream_window=STREAM_WINDOW, connection_window=CONNECTION_WINDOW)
    conn.initiate_connection()
    conn.data_to_send()
    connection_error(conn, garbage, ErrorCode.PROTOCOL_ERROR)


@pytest.mark.parametrize("first", [f.frame(f.PING, 0, 0, b"12345678"), f.frame(f.SETTINGS, f.ACK, 0)])
def test_the_first_frame_must_be_settings(first: bytes) -> None:
    conn = Http2Connection(max_streams=7, stream_window=STREAM_WINDOW, connection_window=CONNECTION_WINDOW)
    connection_error(conn, f.PREFACE + first, ErrorCode.PROTOCOL_ERROR)


@pytest.mark.parametrize(("frame", "code"), [
    (f.frame(f.SETTINGS, f.ACK, 0, b"\x00" * 6), ErrorCode.FRAME_SIZE_ERROR),
    (f.frame(f.SETTINGS, 0, 0, b"\x00" * 5), ErrorCode.FRAME_SIZE_ERROR),
    (f.frame(f.SETTINGS, 0, 1), ErrorCode.PROTOCOL_ERROR),
    (f.settings({f.INITIAL_WINDOW_SIZE: 2**31}), ErrorCode.FLOW_CONTROL_ERROR),
    (f.settings({f.MAX_FRAME_SIZE: 16_383}), ErrorCode.PROTOCOL_ERROR),
    (f.settings({f.MAX_FRAME_SIZE: 2**24}), ErrorCode.PROTOCOL_ERROR),
    (f.settings({f.ENABLE_PUSH: 2}), ErrorCode.PROTOCOL_ERROR),
])
def test_settings_that_break_a_rule_end_the_connection(frame: bytes, code: ErrorCode) -> None:
    connection_error(server(), frame, code)


def test_unknown_settings_are_ignored_and_an_ack_is_only_read() -> None:
    conn = server()
    assert conn.receive_data(f.settings({0x99: 5, f.ENABLE_PUSH: 0})) == [(http2.SETTLED, 0, None, 0)]
    assert conn.receive_data(f.frame(f.SETTINGS, f.ACK, 0)) == []
    assert kinds(conn) == [(f.SETTINGS, 0, ["ACK"])]


def test_a_new_initial_window_moves_every_open_stream_s_window() -> None:
    conn = server()
    conn.receive_data(headers_frame(1))
    conn.send_data(1, b"x" * 1000)
    assert conn.local_flow_control_window(1) == 65_535 - 1000
    assert conn.receive_data(f.settings({f.INITIAL_WINDOW_SIZE: 100_000}))[0] == (http2.WINDOW, 0, None, 0)
    assert conn.local_flow_control_window(1) == 65_535 - 1000  # the connection's window is the smaller now
    conn.receive_data(f.window_update(0, 10**6))
    assert conn.local_flow_control_window(1) == 100_000 - 1000
    conn.receive_data(f.settings({f.INITIAL_WINDOW_SIZE: 500}))
    assert conn.local_flow_control_window(1) == 500 - 1000  # negative: nothing may go out (RFC 9113, 6.9.2)
    conn.receive_data(headers_frame(3))
    assert conn.local_flow_control_window(3) == 500


def test_a_new_initial_window_that_overflows_a_stream_is_a_flow_control_error() -> None:
    conn = server()
    conn.receive_data(headers_frame(1) + f.window_update(1, 2**31 - 1 - 65_535))
    connection_error(conn, f.settings({f.INITIAL_WINDOW_SIZE: 65_536}), ErrorCode.FLOW_CONTROL_ERROR)


# --- PING, GOAWAY, PUSH_PROMISE, unknown and oversized frames ----------------------------------------------


def test_a_ping_is_answered_with_its_bytes_and_a_ping_ack_is_reported() -> None:
    conn = server()
    assert conn.receive_data(f.ping(b"abcdefgh")) == []
    (pong,) = written(conn)
    assert (pong.type, sorted(pong.flags), pong.opaque_data) == (f.PING, ["ACK"], b"abcdefgh")
    assert conn.receive_data(f.ping(b"12345678", ack=True)) == [(http2.PONG, 0, b"12345678", 0)]
    assert conn.data_to_send() == b""


@pytest.mark.parametrize(("frame", "code"), [
    (f.frame(f.PING, 0, 0, b"1234567"), ErrorCode.FRAME_SIZE_ERROR),
    (f.frame(f.PING, 0, 1, b"12345678"), ErrorCode.PROTOCOL_ERROR),
    (f.frame(f.GOAWAY, 0, 1, b"\x00" * 8), ErrorCode.PROTOCOL_ERROR),
    (f.frame(f.GOAWAY, 0, 0, b"\x00" * 7), ErrorCode.FRAME_SIZE_ERROR),
    (f.frame(f.PUSH_PROMISE, f.END_HEADERS, 1, b"\x00\x00\x00\x02"), ErrorCode.PROTOCOL_ERROR),
    (f.frame(f.DATA, 0, 1, b"x" * 16_385), ErrorCode.FRAME_SIZE_ERROR),
])
def test_control_frames_that_break_a_rule_end_the_connection(frame: bytes, code: ErrorCode) -> None:
    connection_error(server(), frame, code)


def test_a_goaway_is_reported_with_its_code_last_stream_and_debug_data() -> None:
    conn = server()
    assert conn.receive_data(f.goaway(7, ErrorCode.ENHANCE_YOUR_CALM, b"calm")) == [
        (http2.GOING_AWAY, 0, (ErrorCode.ENHANCE_YOUR_CALM, b"calm"), 7)]


def test_frames_of_unknown_types_are_ignored() -> None:
    conn = server()
    assert conn.receive_data(f.frame(0xFA, 0xFF, 0, b"whatever") + f.frame(0x20, 0, 3)) == []
    assert conn.receive_data(headers_frame(1, end_stream=True))[0][0] == http2.REQUEST


# --- HEADERS and CONTINUATION ------------------------------------------------------------------------------


def test_a_header_block_in_continuations_padded_and_with_a_priority_opens_one_stream() -> None:
    conn = server()
    encoded = block([*REQUEST, (b"x-long", b"v" * 300)])
    priority = (3).to_bytes(4, "big") + b"\x10"
    first = f.frame(f.HEADERS, f.PADDED | f.PRIORITY_FLAG | f.END_STREAM, 5, b"\x04" + priority + encoded[:100] + b"\0" * 4)
    middle = f.frame(f.CONTINUATION, 0, 5, encoded[100:200])
    last = f.frame(f.CONTINUATION, f.END_HEADERS, 5, encoded[200:])
    assert conn.receive_data(first + middle) == []
    assert conn.receive_data(last) == [(http2.REQUEST, 5, [*REQUEST, (b"x-long", b"v" * 300)], 0),
                                       (http2.ENDED, 5, None, 0)]
    assert conn.highest_inbound_stream_id == 5


@pytest.mark.parametrize(("frames", "code"), [
    (headers_frame(0), ErrorCode.PROTOCOL_ERROR),
    (headers_frame(2), ErrorCode.PROTOCOL_ERROR),
    (headers_frame(5) + headers_frame(3), ErrorCode.PROTOCOL_ERROR),  # a lower id: closed (skipped)
    (f.frame(f.HEADERS, f.PADDED | f.END_HEADERS, 1, b"\x09" + block()[:8]), ErrorCode.PROTOCOL_ERROR),
    (f.frame(f.HEADERS, f.PRIORITY_FLAG | f.END_HEADERS, 1, b"\x00\x00"), ErrorCode.FRAME_SIZE_ERROR),
    (f.frame(f.HEADERS, 0, 1, block()) + f.ping(b"12345678"), ErrorCode.PROTOCOL_ERROR),
    (f.frame(f.HEADERS, 0, 1, block()) + f.frame(f.CONTINUATION, f.END_HEADERS, 3, b""), ErrorCode.PROTOCOL_ERROR),
    (f.frame(f.CONTINUATION, f.END_HEADERS, 1, block()), ErrorCode.PROTOCOL_ERROR),
    (headers_frame(1, payload=b"\xff\xff\xff\xff"), ErrorCode.COMPRESSION_ERROR),  # an index past the table
    (f.frame(f.HEADERS, 0, 1, b"") + f.frame(f.CONTINUATION, 0, 1, b"\x00" * 16_384) * 17, ErrorCode.ENHANCE_YOUR_CALM),
    (f.frame(f.HEADERS, 0, 1, b"") + f.frame(f.CONTINUATION, 0, 1) * 65, ErrorCode.ENHANCE_YOUR_CALM),
])
def test_header_blocks_that_break_a_rule_end_the_connection(frames: bytes, code: ErrorCode) -> None:
    connection_error(server(), frames, code)


def test_a_header_list_over_the_limit_ends_the_connection_before_any_stream_opens() -> None:
    conn = server()
    bomb = block([*REQUEST, *((f"x-{i}".encode(), b"b" * 1000) for i in range(70))])
    pieces = [bomb[i:i + 16_384] for i in range(0, len(bomb), 16_384)]
    data = f.frame(f.HEADERS, 0, 1, pieces[0]) + b"".join(
        f.frame(f.CONTINUATION, f.END_HEADERS if i == len(pieces) - 1 else 0, 1, p) for i, p in enumerate(pieces) if i)
    connection_error(conn, data, ErrorCode.COMPRESSION_ERROR)
    assert conn.streams == {}


def test_a_stream_depending_on_itself_is_a_stream_error() -> None:
    conn = server()
    self_dependent = (1).to_bytes(4, "big") + b"\x10" + block()
    assert conn.receive_data(f.frame(f.HEADERS, f.PRIORITY_FLAG | f.END_HEADERS, 1, self_dependent)) == []
    assert kinds(conn) == [(f.RST_STREAM, 1, ErrorCode.PROTOCOL_ERROR)]
    assert conn.receive_data(headers_frame(3))[0][:2] == (http2.REQUEST, 3)  # the connection goes on


def test_trailers_end_the_stream_and_trailers_without_end_stream_are_a_stream_error() -> None:
    conn = server()
    conn.receive_data(headers_frame(1) + headers_frame(3))
    trailers = block([(b"x-trailer", b"1")])
    assert conn.receive_data(headers_frame(1, end_stream=True, payload=trailers)) == [(http2.ENDED, 1, None, 0)]
    assert conn.receive_data(headers_frame(3, payload=trailers)) == [(http2.RESET, 3, ErrorCode.PROTOCOL_ERROR, 0)]
    assert kinds(conn) == [(f.RST_STREAM, 3, ErrorCode.PROTOCOL_ERROR)]


def test_headers_sent_before_the_peer_read_our_reset_are_decoded_and_ignored() -> None:
    """HPACK's table is the connection's: the ignored block still changes it, and the next block reads right."""
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
    client.initiate_connection()
    conn = Http2Connection(max_streams=100, stream_window=STREAM_WINDOW, connection_window=CONNECTION_WINDOW)
    client.send_headers(1, REQUEST)
    conn.receive_data(client.data_to_send())
    conn.reset_stream(1, ErrorCode.REFUSED_STREAM)
    client.send_headers(1, [(b"x-new", b"indexed")], end_stream=True)  # trailers, in flight past our reset
    client.send_headers(3, [*REQUEST, (b"x-new", b"indexed")])
    assert conn.receive_data(client.data_to_send()) == [(http2.REQUEST, 3, [*REQUEST, (b"x-new", b"indexed")], 0)]


# --- DATA and flow control ---------------------------------------------------------------------------------


def test_padded_data_is_reported_without_its_padding_and_counted_with_it() -> None:
    conn = server()
    conn.receive_data(headers_frame(1))
    padded = f.frame(f.DATA, f.PADDED | f.END_STREAM, 1, b"\x03abc\0\0\0")
    assert conn.receive_data(padded) == [(http2.DATA, 1, b"abc", 7), (http2.ENDED, 1, None, 0)]


@pytest.mark.parametrize(("frames", "code"), [
    (f.frame(f.DATA, 0, 0, b"x"), ErrorCode.PROTOCOL_ERROR),
    (f.frame(f.DATA, 0, 9, b"x"), ErrorCode.PROTOCOL_ERROR),  # an idle stream
    (headers_frame(1) + f.frame(f.DATA, f.PADDED, 1, b"\x05abc"), ErrorCode.PROTOCOL_ERROR),
])
def test_data_that_breaks_a_rule_ends_the_connection(frames: bytes, code: ErrorCode) -> None:
    connection_error(server(), frames, code)


def test_data_beyond_a_stream_s_window_is_a_flow_control_error() -> None:
    conn = Http2Connection(max_streams=100, stream_window=20_000, connection_window=CONNECTION_WINDOW)
    conn.receive_data(f.PREFACE + f.settings({}) + headers_frame(1) + f.frame(f.DATA, 0, 1, b"x" * 16_000))
    conn.data_to_send()
    connection_error(conn, f.frame(f.DATA, 0, 1, b"x" * 4_001), ErrorCode.FLOW_CONTROL_ERROR)


def test_data_beyond_the_connection_s_window_is_a_flow_control_error() -> None:
    conn = Http2Connection(max_streams=100, stream_window=STREAM_WINDOW, connection_window=65_535)
    conn.receive_data(f.PREFACE + f.settings({}))
    conn.data_to_send()
    chunk = f.frame(f.DATA, 0, 1, b"x" * 16_384)
    for stream_id in (1, 3, 5, 7):
        conn.receive_data(headers_frame(stream_id) + f.frame(f.DATA, 0, stream_id, b"x" * 16_383))
    connection_error(conn, headers_frame(9) + chunk, ErrorCode.FLOW_CONTROL_ERROR)


def test_data_after_the_peer_s_end_is_a_stream_error_and_after_our_reset_is_ignored() -> None:
    conn = Http2Connection(max_streams=100, stream_window=STREAM_WINDOW, connection_window=131_070)
    conn.initiate_connection()
    conn.receive_data(f.PREFACE + f.settings({}) + headers_frame(1, end_stream=True) + headers_frame(3))
    conn.data_to_send()
    assert conn.receive_data(f.frame(f.DATA, 0, 1, b"late")) == [(http2.RESET, 1, ErrorCode.STREAM_CLOSED, 0)]
    assert kinds(conn) == [(f.RST_STREAM, 1, ErrorCode.STREAM_CLOSED)]
    conn.reset_stream(3, ErrorCode.CANCEL)
    conn.data_to_send()
    assert conn.receive_data(f.frame(f.DATA, 0, 3, b"x" * 16_000) * 3) == []  # in flight past our reset
    assert conn.data_to_send() == b""  # nothing answered; its bytes count against the connection's window
    conn.receive_data(f.frame(f.DATA, 0, 3, b"y" * 16_000) * 2)  # half the window's worth: given back
    assert kinds(conn) == [(f.WINDOW_UPDATE, 0, 4 + 5 * 16_000)]


def test_the_streams_we_reset_are_remembered_up_to_a_bound() -> None:
    # Our resets, never written out here; the streams' headers all read in one call.
    conn = server(GrpcLimits(max_outbound_control_frames=10_000, max_frames_per_read=10**6))
    count = REMEMBERED_RESETS + 1
    conn.receive_data(b"".join(headers_frame(2 * i + 1) for i in range(count)))
    for i in range(count):
        conn.reset_stream(2 * i + 1, ErrorCode.REFUSED_STREAM)
    conn.data_to_send()
    last = 2 * count - 1
    assert conn.receive_data(f.frame(f.DATA, 0, last, b"x") + headers_frame(last, end_stream=True)) == []
    assert conn.data_to_send() == b""  # in flight past our reset: ignored
    assert conn.receive_data(f.frame(f.DATA, 0, 1, b"x")) == []  # the first is forgotten: a closed stream
    assert kinds(conn) == [(f.RST_STREAM, 1, ErrorCode.STREAM_CLOSED)]


def test_received_bytes_are_given_back_as_h2_gives_them_back() -> None:
    """Once half the window is processed (few updates for many small frames), or the window is shut."""
    conn = server(GrpcLimits(max_frames_per_read=10**6))  # 512 KiB of DATA in one call
    conn.receive_data(headers_frame(1))
    half = STREAM_WINDOW // 2
    conn.receive_data(f.frame(f.DATA, 0, 1, b"x" * 16_384) * (half // 16_384 + 1))
    conn.acknowledge_received_data(half - 1, 1)
    assert kinds(conn) == []
    conn.acknowledge_received_data(1, 1)
    assert kinds(conn) == [(f.WINDOW_UPDATE, 1, half)]
    conn.acknowledge_received_data(10, 1)  # a stream the peer ended gets no update, the connection does
    conn.receive_data(f.frame(f.DATA, f.END_STREAM, 1, b""))
    conn.acknowledge_received_data(CONNECTION_WINDOW // 2, 1)  # never more than the peer used of it
    assert kinds(conn) == [(f.WINDOW_UPDATE, 0, (half // 16_384 + 1) * 16_384)]


@pytest.mark.parametrize(("frames", "code"), [
    (f.frame(f.WINDOW_UPDATE, 0, 0, b"\x00\x00\x01"), ErrorCode.FRAME_SIZE_ERROR),
    (f.window_update(0, 0), ErrorCode.PROTOCOL_ERROR),
    (f.window_update(0, 2**31 - 65_535), ErrorCode.FLOW_CONTROL_ERROR),
    (f.window_update(5, 1), ErrorCode.PROTOCOL_ERROR),  # an idle stream
])
def test_window_updates_that_break_a_connection_rule_end_it(frames: bytes, code: ErrorCode) -> None:
    connection_error(server(), frames, code)


def test_window_updates_on_streams() -> None:
    conn = server()
    conn.receive_data(headers_frame(1) + headers_frame(3) + headers_frame(5))
    assert conn.receive_data(f.window_update(1, 100)) == [(http2.WINDOW, 1, None, 0)]
    assert conn.receive_data(f.window_update(3, 0)) == [(http2.RESET, 3, ErrorCode.PROTOCOL_ERROR, 0)]
    assert conn.receive_data(f.window_update(5, 2**31 - 65_535)) == [(http2.RESET, 5, ErrorCode.FLOW_CONTROL_ERROR, 0)]
    assert conn.receive_data(f.window_update(3, 10)) == []  # a closed stream: ignored
    assert kinds(conn) == [(f.RST_STREAM, 3, ErrorCode.PROTOCOL_ERROR), (f.RST_STREAM, 5, ErrorCode.FLOW_CONTROL_ERROR)]
    assert conn.local_flow_control_window(1) == 65_535  # the connection's is the smaller


# --- RST_STREAM, PRIORITY ------------------------------------------------------------------------------------


def test_a_reset_ends_an_open_stream_and_is_ignored_on_a_closed_one() -> None:
    conn = server()
    conn.receive_data(headers_frame(1))
    assert conn.receive_data(f.rst_stream(1, ErrorCode.CANCEL)) == [(http2.RESET, 1, ErrorCode.CANCEL, 0)]
    assert conn.receive_data(f.rst_stream(1, ErrorCode.CANCEL)) == [] and conn.streams == {}
    with pytest.raises(StreamClosed):
        conn.send_response_headers(1)


@pytest.mark.parametrize(("frames", "code"), [
    (f.rst_stream(0, 0), ErrorCode.PROTOCOL_ERROR),
    (f.rst_stream(3, 0), ErrorCode.PROTOCOL_ERROR),  # an idle stream
    (headers_frame(1) + f.frame(f.RST_STREAM, 0, 1, b"\x00" * 5), ErrorCode.FRAME_SIZE_ERROR),
    (f.frame(f.PRIORITY, 0, 0, b"\x00" * 5), ErrorCode.PROTOCOL_ERROR),
])
def test_resets_and_priorities_that_break_a_connection_rule_end_it(frames: bytes, code: ErrorCode) -> None:
    connection_error(server(), frames, code)


def test_priorities_are_ignored_unless_malformed_or_self_dependent() -> None:
    conn = server()
    conn.receive_data(headers_frame(1) + headers_frame(3))
    assert conn.receive_data(f.frame(f.PRIORITY, 0, 9, b"\x00\x00\x00\x01\x10")) == []  # an idle stream may get one
    assert conn.receive_data(f.frame(f.PRIORITY, 0, 1, b"\x00" * 4)) == [(http2.RESET, 1, ErrorCode.FRAME_SIZE_ERROR, 0)]
    assert conn.receive_data(f.frame(f.PRIORITY, 0, 3, b"\x00\x00\x00\x03\x10")) == [
        (http2.RESET, 3, ErrorCode.PROTOCOL_ERROR, 0)]
    assert kinds(conn) == [(f.RST_STREAM, 1, ErrorCode.FRAME_SIZE_ERROR), (f.RST_STREAM, 3, ErrorCode.PROTOCOL_ERROR)]


# --- what we send --------------------------------------------------------------------------------------------


def test_replies_read_back_by_h2_s_client_and_nothing_is_sent_on_a_closed_stream() -> None:
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
    client.initiate_connection()
    conn = Http2Connection(max_streams=100, stream_window=STREAM_WINDOW, connection_window=CONNECTION_WINDOW)
    conn.initiate_connection()
    client.send_headers(1, REQUEST, end_stream=True)
    client.send_headers(3, REQUEST)
    conn.receive_data(client.data_to_send())
    client.receive_data(conn.data_to_send())
    conn.send_response_headers(1)
    conn.send_data(1, b"reply")
    big = [(b"grpc-status", b"0"), (b"grpc-message", b"m" * 40_000)]  # larger than a frame: CONTINUATIONs
    conn.send_headers(1, big)
    assert 1 not in conn.streams  # both halves ended: forgotten
    conn.send_headers(3, [(b":status", b"415"), (b"grpc-status", b"3")])
    conn.reset_stream(3, ErrorCode.NO_ERROR)  # the client had not ended it: we stop listening
    conn.reset_stream(1, ErrorCode.NO_ERROR)  # closed: nothing to reset
    events: list[Any] = client.receive_data(conn.data_to_send())
    summary = [(type(e).__name__, getattr(e, "stream_id", None)) for e in events]
    assert summary == [("ResponseReceived", 1), ("DataReceived", 1), ("TrailersReceived", 1), ("StreamEnded", 1),
                       ("ResponseReceived", 3), ("StreamEnded", 3), ("StreamReset", 3)]
    assert events[2].headers == big
    for send in (lambda: conn.send_data(1, b"x"), lambda: conn.send_response_headers(3),
                 lambda: conn.local_flow_control_window(1)):
        with pytest.raises(StreamClosed):
            send()


def test_a_header_table_size_from_the_peer_is_applied_to_our_trailers() -> None:
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
    client.initiate_connection()
    client.update_settings({f.HEADER_TABLE_SIZE: 0})
    client.send_headers(1, REQUEST, end_stream=True)
    conn = Http2Connection(max_streams=100, stream_window=STREAM_WINDOW, connection_window=CONNECTION_WINDOW)
    conn.receive_data(client.data_to_send())
    conn.send_headers(1, [(b":status", b"200"), (b"grpc-status", b"0")])
    events = client.receive_data(conn.data_to_send())
    assert [e.headers for e in events if isinstance(e, h2.events.ResponseReceived)] == [
        [(b":status", b"200"), (b"grpc-status", b"0")]]
    assert conn.encoder.header_table_size == 0


# --- any bytes -----------------------------------------------------------------------------------------------


@settings(max_examples=examples(300), deadline=None)
@given(st.binary(max_size=600))
def test_any_bytes_after_the_handshake_make_events_or_a_connection_error_never_another_exception(data: bytes) -> None:
    conn = server()
    try:
        conn.receive_data(headers_frame(1) + data)
    except Http2Error:
        assert any(frame.type == f.GOAWAY for frame in written(conn))


@settings(max_examples=examples(200), deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["request", "data", "end", "reset", "ping", "window"]),
                          st.binary(max_size=40)), max_size=12),
       st.lists(st.integers(min_value=1, max_value=200), max_size=20))
def test_events_do_not_depend_on_how_the_bytes_are_split(actions: list[tuple[str, bytes]], cuts: list[int]) -> None:
    """h2's client writes a conversation; fed whole or in pieces of any size, the server reports the same events."""
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
    client.initiate_connection()
    open_streams: list[int] = []
    for action, payload in actions:
        if action == "request" or not open_streams:
            stream_id = client.get_next_available_stream_id()
            client.send_headers(stream_id, [*REQUEST, (b"x-n", str(stream_id).encode())])
            open_streams.append(stream_id)
        elif action == "data":
            client.send_data(open_streams[-1], payload)
        elif action == "end":
            client.end_stream(open_streams.pop())
        elif action == "reset":
            client.reset_stream(open_streams.pop())
        elif action == "ping":
            client.ping(payload[:8].ljust(8, b"\0"))
        else:
            client.increment_flow_control_window(len(payload) + 1)
    data = client.data_to_send()

    def events(pieces: list[bytes]) -> list[http2.Event]:
        # Empty DATA frames in a row, and WINDOW_UPDATEs for replies never sent, are h2's to send and past the
        # flood limits (test_h2grpc_flood.py): lifted, as if the server had sent many replies.
        conn = Http2Connection(max_streams=100, stream_window=STREAM_WINDOW, connection_window=CONNECTION_WINDOW,
                               limits=GrpcLimits(max_consecutive_inbound_frames_with_empty_payload=100))
        conn.data_frames_sent = 1_000
        return [e for piece in pieces for e in conn.receive_data(piece)]

    pieces, start = [], 0
    for cut in cuts:
        pieces.append(data[start:start + cut])
        start += cut
    pieces.append(data[start:])
    assert events(pieces) == events([data])
