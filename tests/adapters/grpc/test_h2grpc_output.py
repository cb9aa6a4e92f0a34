"""What the builtin transport writes: the replies of streams that run in the same loop iteration leave in one
socket write, and the response headers, written as constant bytes, read as h2's own would; a request's
frames become its three events.

At saturation one read brings a dozen streams' messages; a write per reply
was 1.7 system calls per request, and as many reads for Envoy.
"""

from __future__ import annotations

import asyncio

import h2.config
import h2.connection
import h2.events
import pytest

from extproc.adapters.grpc.builtin import http2
from tests.helpers.h2grpc_abuse import ECHO, HI, HOLD, OK, _connected

pytestmark = pytest.mark.unit


async def test_twenty_streams_sent_in_one_write_are_answered_in_one_write() -> None:
    async with _connected() as (server, client):
        await client.until(lambda: len(server.connections) == 1)
        await asyncio.sleep(0.05)  # the handshake's frames, out of the count
        (connection,) = server.connections
        before = connection.writes
        streams = []
        for _ in range(20):  # requests, messages and ends: one write from the client
            stream = client.h2.get_next_available_stream_id()
            client.h2.send_headers(stream, [(b":method", b"POST"), (b":scheme", b"http"), (b":path", ECHO),
                                            (b":authority", b"test"), (b"content-type", b"application/grpc")])
            client.h2.send_data(stream, HI, end_stream=True)
            streams.append(stream)
        client.flush()
        await client.until(lambda: all(client.ended(s) for s in streams))
        assert [client.status(s) for s in streams] == [OK] * 20
        assert connection.writes - before <= 2  # one, unless the socket split the client's bytes; a write per reply was 40


async def test_response_headers_then_trailers_read_as_h2_would_send_them_stream_after_stream() -> None:
    async with _connected() as (_, client):
        for _ in range(3):  # the encoder's table, which trailers use, stays in step with the client's decoder
            stream = client.request(ECHO)
            client.send(stream, HI, end=True)
            await client.until(lambda s=stream: client.ended(s))  # type: ignore[misc]
            first, *_, last = client.of(stream)
            assert isinstance(first, h2.events.ResponseReceived)
            assert first.headers == [(b":status", b"200"), (b"content-type", b"application/grpc")]
            assert isinstance(last, h2.events.StreamEnded)
            assert client.status(stream) == OK
        held = client.request(HOLD)  # reset before its reply: the reply is not sent, the connection goes on
        client.h2.reset_stream(held)
        client.send(client.request(ECHO), HI, end=True)
        await client.until(lambda: client.ended(held + 2))
        assert client.status(held + 2) == OK


def test_a_request_s_frames_from_h2_s_client_become_its_three_events() -> None:
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
    client.initiate_connection()
    headers = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", ECHO), (b":authority", b"t"),
               (b"content-type", b"application/grpc")]
    client.send_headers(1, headers)
    client.send_data(1, HI, end_stream=True)
    server = http2.Http2Connection(max_streams=10, stream_window=2**20, connection_window=2**24)
    server.initiate_connection()
    events = server.receive_data(client.data_to_send())
    assert events == [(http2.SETTLED, 0, None, 0), (http2.REQUEST, 1, headers, 0), (http2.DATA, 1, HI, len(HI)),
                      (http2.ENDED, 1, None, 0)]
