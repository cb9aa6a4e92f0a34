"""What the h2grpc transport writes: the replies of streams that run in the same loop iteration leave in one
socket write, and the response headers, written as constant bytes, read as h2's own would; frames received
are not rendered as text for nothing.

At saturation one read brings a dozen streams' messages; a write per reply
was 1.7 system calls per request, and as many reads for Envoy.
"""

from __future__ import annotations

import asyncio
from typing import Any

import h2.config
import h2.connection
import h2.events
import pytest
from hyperframe.frame import Frame

from extproc.adapters.ext_proc.h2grpc_h2 import H2_CONFIG, H2Connection
from tests.test_h2grpc_abuse import ECHO, HI, HOLD, OK, _connected

pytestmark = pytest.mark.unit


class _CountingTransport:
    """The connection's transport, counting its writes."""

    def __init__(self, transport: Any) -> None:
        self.transport = transport
        self.writes = 0

    def write(self, data: bytes) -> None:
        self.writes += 1
        self.transport.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.transport, name)


async def test_twenty_streams_sent_in_one_write_are_answered_in_one_write() -> None:
    async with _connected() as (server, client):
        await client.until(lambda: len(server.connections) == 1)
        await asyncio.sleep(0.05)  # the handshake's frames, out of the count
        (connection,) = server.connections
        counting = connection._transport = _CountingTransport(connection._transport)  # type: ignore[assignment]
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
        assert counting.writes <= 2  # one, unless the socket split the client's bytes; a write per reply was 40


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


def test_frames_received_are_not_rendered_for_h2s_silent_trace_line(monkeypatch: pytest.MonkeyPatch) -> None:
    def rendered(_: Frame) -> str:
        raise AssertionError("a received frame was rendered")

    monkeypatch.setattr(Frame, "__repr__", rendered)
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
    client.initiate_connection()
    client.send_headers(1, [(b":method", b"POST"), (b":scheme", b"http"), (b":path", ECHO), (b":authority", b"t"),
                            (b"content-type", b"application/grpc")])
    client.send_data(1, HI, end_stream=True)
    server = H2Connection(H2_CONFIG)
    server.initiate_connection()
    events = server.receive_data(client.data_to_send())
    assert [type(e) for e in events][-3:] == [h2.events.RequestReceived, h2.events.DataReceived,
                                               h2.events.StreamEnded]
