"""Each flood limit of the builtin transport (advanced.grpc, builtin/flood.py and builtin/bounds.py), one test each.

Past a limit the connection ends with GOAWAY ENHANCE_YOUR_CALM and one warning naming the key; below it,
the same frames are served. The counting rules are Envoy's (``ProtocolConstraints``) unless the test says
otherwise. The HTTP/2 layer alone (bytes in, bytes out) where the rule is its own; a real socket where the
connection's (premature resets, back-pressure, what the peer leaves unread).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Iterator

import h2.errors
import h2.events
import pytest
from hyperframe.frame import PingFrame

from extproc.adapters.config import GrpcLimits
from extproc.adapters.grpc.builtin import frames as f
from extproc.adapters.grpc.builtin import http2
from extproc.adapters.grpc.builtin.frames import ErrorCode
from extproc.adapters.grpc.builtin.http2 import Http2Error
from tests.h2raw import RawClient, message
from tests.helpers.h2grpc import Handlers, tracebacks
from tests.helpers.h2grpc_abuse import HI, HOLD, _connected, _echoes, _held, _serving
from tests.helpers.h2grpc_http2 import REQUEST, block, connection_error, headers_frame, server, written
from tests.waitutil import eventually

pytestmark = pytest.mark.unit

PING = f.ping(b"12345678")


def limited(**limits: int) -> http2.Http2Connection:
    return server(GrpcLimits(**limits))


def calm(conn: http2.Http2Connection, data: bytes, key: str) -> None:
    """``data`` ends the connection with ENHANCE_YOUR_CALM, its error naming ``advanced.grpc.<key>``."""
    with pytest.raises(Http2Error, match=rf"past advanced\.grpc\.{key}\)"):
        conn.receive_data(data)
    assert [frame.error_code for frame in written(conn) if frame.type == f.GOAWAY] == [ErrorCode.ENHANCE_YOUR_CALM]


# --- the HTTP/2 layer's counts ---------------------------------------------------------------------------------


@pytest.mark.parametrize("frame", [PING, f.settings({f.INITIAL_WINDOW_SIZE: 65_535})])
def test_pings_and_settings_are_answered_up_to_the_control_frame_limit_while_the_peer_does_not_read(frame: bytes) -> None:
    conn = limited(max_outbound_control_frames=10)
    conn.receive_data(frame * 10)
    assert conn.outbound_control_frames == 10  # ten answers queued, none written out yet
    calm(conn, frame, "max_outbound_control_frames")


def test_resets_we_owe_count_as_control_frames() -> None:
    conn = limited(max_outbound_control_frames=3, max_frames_per_read=10**6)
    conn.receive_data(b"".join(headers_frame(s) + f.window_update(s, 0) for s in (1, 3, 5)))  # each a stream error
    calm(conn, headers_frame(7) + f.window_update(7, 0), "max_outbound_control_frames")


def test_what_the_socket_took_is_no_longer_counted_and_what_waits_is_scaled_to_its_bytes() -> None:
    conn = limited(max_outbound_control_frames=10, max_outbound_frames=20)
    conn.receive_data(PING * 10)
    data = conn.data_to_send()
    assert conn.written(len(data), 0) is None and conn.outbound_control_frames == 0  # all taken
    conn.receive_data(PING * 10)
    data = conn.data_to_send()
    assert conn.written(len(data), len(data) // 2) is None  # half of them still wait: 5
    assert (conn.outbound_frames, conn.outbound_control_frames) == (5, 5)
    conn.receive_data(PING * 5)
    assert conn.outbound_control_frames == 10
    data = conn.data_to_send()
    waiting = len(data) + len(data)  # nothing of these 85 bytes left, and the 5 before still wait
    assert conn.written(len(data), waiting) is None
    conn.outbound_frames += 20  # 20 more frames of ours (replies) that wait as well
    assert conn.written(0, waiting) == "max_outbound_frames"


def test_one_empty_frame_is_allowed_two_in_a_row_are_not() -> None:
    conn = limited(max_frames_per_read=10**6)
    empty = f.frame(f.DATA, 0, 1)
    conn.receive_data(headers_frame(1) + empty + f.frame(f.DATA, 0, 1, b"x") + empty)  # data between: counting anew
    conn.receive_data(f.frame(f.DATA, f.END_STREAM, 1))  # an empty END_STREAM carries something
    conn.receive_data(headers_frame(3) + empty.replace(b"\x01", b"\x03", 1)[:9])
    calm(conn, f.frame(f.DATA, 0, 3), "max_consecutive_inbound_frames_with_empty_payload")


@pytest.mark.parametrize("frames", [
    f.frame(f.HEADERS, f.END_HEADERS, 1),  # an empty header block that does not end its stream
    f.frame(f.HEADERS, 0, 1, block()[:3]) + f.frame(f.CONTINUATION, 0, 1),  # an empty CONTINUATION
])
def test_empty_header_frames_count_too(frames: bytes) -> None:
    conn = limited(max_consecutive_inbound_frames_with_empty_payload=0)
    calm(conn, frames, "max_consecutive_inbound_frames_with_empty_payload")


def test_priority_frames_are_allowed_per_header_block() -> None:
    conn = limited(max_inbound_priority_frames_per_stream=2, max_frames_per_read=10**6)
    priority = f.frame(f.PRIORITY, 0, 9, b"\x00\x00\x00\x01\x10")
    conn.receive_data(priority * 2 + headers_frame(1) + priority * 2)  # 2 x (1 + 1 block)
    calm(conn, priority, "max_inbound_priority_frames_per_stream")


def test_window_updates_are_allowed_per_header_block_and_data_frame_sent() -> None:
    conn = limited(max_inbound_window_update_frames_per_data_frame_sent=2)
    update = f.window_update(0, 1)
    conn.receive_data(headers_frame(1) + update * 3)  # 1 + 2 x (1 block)
    conn.send_response_headers(1)
    conn.send_data(1, b"x")
    conn.receive_data(update * 4)  # + 2 x 2 x 1 DATA frame sent
    calm(conn, update, "max_inbound_window_update_frames_per_data_frame_sent")


def test_a_header_block_in_more_continuations_than_the_limit_ends_the_connection() -> None:
    encoded = block([*REQUEST, (b"x-long", b"v" * 600)])
    pieces = [encoded[i:i + 40] for i in range(0, len(encoded), 40)]
    assert len(pieces) > 9
    ok = f.frame(f.HEADERS, 0, 1, pieces[0]) + b"".join(f.frame(f.CONTINUATION, 0, 1, p) for p in pieces[1:9])
    conn = limited(max_continuation_frames=8)
    conn.receive_data(ok)  # eight are allowed
    calm(conn, f.frame(f.CONTINUATION, 0, 1, pieces[9]), "max_continuation_frames")
    connection_error(limited(max_continuation_frames=0), f.frame(f.HEADERS, 0, 1, pieces[0]) +
                     f.frame(f.CONTINUATION, f.END_HEADERS, 1, b"".join(pieces[1:])), ErrorCode.ENHANCE_YOUR_CALM)


def test_a_read_is_handled_in_slices_of_max_frames_per_read_with_the_same_events() -> None:
    data = b"".join(headers_frame(s) + f.frame(f.DATA, f.END_STREAM, s, HI) for s in range(1, 200, 2))
    whole = limited(max_frames_per_read=10**6).receive_data(data)
    sliced = limited(max_frames_per_read=100)
    events, calls = sliced.receive_data(data), 1
    while sliced.more_input:
        events += sliced.receive_data(b"")
        calls += 1
    assert events == whole and len(whole) == 300
    # 100 streams, each its block's 5 fields, 16 for its stream, and 2 frames: 23 a stream, 4 or 5 a slice.
    assert 20 <= calls <= 25


# --- the connection's ---------------------------------------------------------------------------------------------


@pytest.fixture
def warnings(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    caplog.set_level(logging.INFO)
    yield caplog
    assert tracebacks(caplog.records) == []


def named(caplog: pytest.LogCaptureFixture, key: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if f"past advanced.grpc.{key}" in r.getMessage()]


async def test_streams_reset_before_their_first_message_end_the_connection_once_half_are(
        warnings: pytest.LogCaptureFixture) -> None:
    async with _connected(premature_reset_total_stream_count=20) as (server, client):
        for _ in range(9):  # 9 premature of 9: under half of 20
            client.h2.reset_stream(client.request(HOLD))
        assert await _echoes(client)
        for _ in range(3):  # 12 premature of 13
            client.h2.reset_stream(client.request(HOLD))
        client.flush()
        await client.until(lambda: client.eof)
        assert [g.error_code for g in client.goaways()] == [h2.errors.ErrorCodes.ENHANCE_YOUR_CALM]
        assert len(named(warnings, "premature_reset_total_stream_count")) == 1


async def test_streams_reset_once_their_message_was_read_are_not_premature(warnings: pytest.LogCaptureFixture) -> None:
    """Envoy resets the stream of every client that leaves while its request is held: never the connection's end."""
    handlers = Handlers()
    async with _connected(handlers, premature_reset_total_stream_count=20) as (server, client):
        for _ in range(60):
            stream = await _held(client)
            client.h2.reset_stream(stream)
            client.flush()
        await client.until(lambda: handlers.ended == 60)
        assert await _echoes(client) and not client.goaways()


class NoReader:
    """A raw peer that asks for big replies (Echo doubles 400 KB) and never reads them: its receive buffer is 4 KB."""

    REQUEST = message(b"\x0a\x80\xb5\x18" + b"x" * 400_000)

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.sock.setblocking(False)
        self.streams = 0

    async def connect(self, port: int, window: int = 2**31 - 1) -> None:
        """With ``window`` as its streams' (the default: as wide open as it gets)."""
        await asyncio.get_running_loop().sock_connect(self.sock, ("127.0.0.1", port))
        self.sock.send(f.PREFACE + f.settings({f.INITIAL_WINDOW_SIZE: window}) + f.window_update(0, 2**31 - 2**16))

    def ask(self) -> bool:
        """One more request; False once our socket is full (the server stopped reading) or the server ended it."""
        stream = 2 * self.streams + 1
        request = self.REQUEST
        frames = headers_frame(stream) + b"".join(
            f.frame(f.DATA, f.END_STREAM if at + 16_384 >= len(request) else 0, stream, request[at:at + 16_384])
            for at in range(0, len(request), 16_384))
        try:
            self.sock.sendall(frames)
        except (BlockingIOError, ConnectionError):
            return False
        self.streams += 1
        return True


async def test_a_peer_that_does_not_read_is_not_read_from(warnings: pytest.LogCaptureFixture) -> None:
    """Past output_buffer_bytes unread, reading pauses: the peer's requests wait in its own socket, and what we
    hold for it stays within max_output_buffer_bytes; the other connections are served."""
    async with _serving(Handlers(), output_buffer_bytes=256 * 1024, max_output_buffer_bytes=8 * 1024 * 1024) as served:
        peer = NoReader()
        await peer.connect(served.port)
        await eventually(lambda: len(served.server.connections) == 1)
        (conn,) = served.server.connections
        for _ in range(200):
            if not peer.ask():
                break
            await asyncio.sleep(0.01)
        await eventually(lambda: conn.reading_paused, what="reading paused")
        assert conn.unread_bytes + conn.waiting_bytes <= 8 * 1024 * 1024
        assert conn in served.server.connections and await _echoes(await served.connect())
        peer.sock.close()


async def test_a_peer_that_leaves_more_than_the_cap_unread_is_ended(warnings: pytest.LogCaptureFixture) -> None:
    async with _serving(Handlers(), output_buffer_bytes=64 * 1024, max_output_buffer_bytes=512 * 1024) as served:
        peer = NoReader()
        await peer.connect(served.port)
        await eventually(lambda: len(served.server.connections) == 1)
        while peer.ask():  # the first 800 KB reply is past the cap: it ends the connection
            await asyncio.sleep(0.01)
        await eventually(lambda: not served.server.connections, what="the connection ended")
        assert len(named(warnings, "max_output_buffer_bytes")) == 1
        peer.sock.close()
        assert await _echoes(await served.connect())


async def test_a_peer_that_opens_no_window_gets_no_new_stream_past_the_output_buffer(
        warnings: pytest.LogCaptureFixture) -> None:
    """Its replies wait on windows it never opens (800 KB each); past output_buffer_bytes of them, the next stream
    it opens ends the connection: new work from a peer that takes none."""
    async with _serving(Handlers(), output_buffer_bytes=1024 * 1024, max_output_buffer_bytes=64 * 1024 * 1024) as served:
        peer = NoReader()
        await peer.connect(served.port, window=0)
        await eventually(lambda: len(served.server.connections) == 1)
        (conn,) = served.server.connections
        peer.ask()
        await eventually(lambda: conn.waiting_bytes > 0, what="a reply waiting")
        peer.ask()  # 1.6 MB waiting
        await eventually(lambda: conn.waiting_bytes > 1024 * 1024, what="two replies waiting")
        assert conn in served.server.connections
        peer.ask()
        await eventually(lambda: not served.server.connections, what="the connection ended")
        assert len(named(warnings, "output_buffer_bytes")) == 1
        peer.sock.close()
        assert await _echoes(await served.connect())


async def test_a_flood_is_answered_while_the_peer_reads_it(warnings: pytest.LogCaptureFixture) -> None:
    """Under the limit, a peer that reads gets every answer: 900 PINGs a read, 20 times."""
    async with _connected() as (_, client):
        for round_ in range(1, 21):
            client.write(PingFrame(0, opaque_data=b"abcdefgh").serialize() * 900)
            await client.until(lambda n=round_: acks(client) == 900 * n)  # type: ignore[misc]
        assert await _echoes(client) and not client.goaways()


def acks(client: RawClient) -> int:
    return sum(isinstance(e, h2.events.PingAckReceived) for e in client.events)
