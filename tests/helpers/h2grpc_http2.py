"""What other test modules share of test_h2grpc_http2.py's: CONNECTION_WINDOW, REQUEST, STREAM_WINDOW, block,
connection_error, headers_frame, server, written (written for its tests).
"""

from __future__ import annotations

from typing import Any

import pytest
from hpack import Encoder
from hyperframe.frame import Frame

from extproc.adapters.config import GrpcLimits
from extproc.adapters.grpc.builtin import frames as f
from extproc.adapters.grpc.builtin import http2
from extproc.adapters.grpc.builtin.flood import DEFAULT_LIMITS
from extproc.adapters.grpc.builtin.frames import ErrorCode
from extproc.adapters.grpc.builtin.http2 import Http2Connection, Http2Error

STREAM_WINDOW, CONNECTION_WINDOW = 2**20, 2**24


REQUEST = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", b"/t.T/Echo"), (b":authority", b"t"),
           (b"content-type", b"application/grpc")]


def server(limits: GrpcLimits = DEFAULT_LIMITS) -> Http2Connection:
    """A server after the handshake (the peer's preface and SETTINGS), its own bytes so far read and dropped."""
    conn = Http2Connection(max_streams=100, stream_window=STREAM_WINDOW, connection_window=CONNECTION_WINDOW,
                           limits=limits)
    conn.initiate_connection()
    assert conn.receive_data(f.PREFACE + f.settings({})) == [(http2.SETTLED, 0, None, 0)]
    conn.written(len(conn.data_to_send()), 0)  # all taken by the socket
    return conn


def block(headers: list[tuple[bytes, bytes]] = REQUEST) -> bytes:
    return Encoder().encode(headers)


def headers_frame(stream_id: int, *, end_stream: bool = False, payload: bytes | None = None, flags: int = 0) -> bytes:
    return f.frame(f.HEADERS, flags | f.END_HEADERS | (f.END_STREAM if end_stream else 0), stream_id,
                   block() if payload is None else payload)


def written(conn: Http2Connection) -> list[Any]:
    """What the server queued, parsed by hyperframe (Any: each frame type has its own fields)."""
    data, frames = conn.data_to_send(), []
    while data:
        frame, length = Frame.parse_frame_header(memoryview(data[:9]))
        frame.parse_body(memoryview(data[9:9 + length]))
        frames.append(frame)
        data = data[9 + length:]
    return frames


def connection_error(conn: Http2Connection, data: bytes, code: ErrorCode) -> None:
    """``data`` is a connection error ``code``: Http2Error, a GOAWAY saying it, and nothing is read after it."""
    with pytest.raises(Http2Error) as raised:
        conn.receive_data(data)
    assert raised.value.code == code
    goaways = [frame for frame in written(conn) if frame.type == f.GOAWAY]
    assert [g.error_code for g in goaways] == [code]
    assert conn.receive_data(f.frame(f.PING, 0, 0, b"12345678")) == [] and conn.data_to_send() == b""
