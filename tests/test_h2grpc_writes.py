"""The replies of streams that run in the same loop iteration leave in one socket write.

At saturation one read brings a dozen streams' messages; a write per reply
was 1.7 system calls per request, and as many reads for Envoy.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.test_h2grpc_abuse import ECHO, HI, OK, _connected

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
