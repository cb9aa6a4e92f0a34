"""A minimal gRPC server on its own HTTP/2 layer: the ext_proc hop's default transport.

Why not grpcio or grpclib: every request Envoy holds in our queue is an open
gRPC stream, so a stream's memory is the cost of a held request. Measured with
10,000 streams held, each after one request and one reply (docs/decisions.md):
grpc.aio keeps 21–24 KB per stream (about 19 KB of it native C-core call and
HTTP/2 stream state, which no channel argument bounds), grpclib 16 KB (four
asyncio Events, several queues and deques per stream); this module about
3 KB: a slotted record of HTTP/2 stream state, one slotted call and one task.

What it implements of gRPC over HTTP/2 is what Envoy's ext_proc filter and
gRPC health checker use: calls of any cardinality whose handler reads an async
iterator of decoded messages and yields replies; length-prefixed, uncompressed
messages (compressed ones are refused, Envoy does not compress them); status
and message in the trailers. A stream the client resets cancels its handler at
once (a client that leaves while queued: the queue entry goes at once).

It is the most exposed port we have, so it is hardened as a reference server
is (docs/reports/reliability.md, "The gRPC port under abuse"): a peer's bad
bytes end only its stream, flow control bounds what it can make us buffer,
streams per connection and connections are limited (TransportLimits, far above the
held requests we expect), stalled and idle connections are closed, GOAWAY
is graceful both ways. Its pieces, one module each, are listed in the
package's docstring (``builtin/__init__.py``).
"""

from __future__ import annotations

import asyncio

from extproc.adapters.grpc.builtin.connection import Connection
from extproc.adapters.grpc.builtin.hpack_decoder import mute_debug
from extproc.adapters.grpc.peer_warnings import PeerWarnings
from extproc.adapters.grpc.tls import ServerTls
from extproc.adapters.grpc.transport import Methods, Transport, TransportLimits

__all__ = ["BuiltinServer"]


class BuiltinServer(Transport):
    """Serves ``methods`` on one listening address over HTTP/2 (transport.py says what it owes)."""

    def __init__(self, methods: Methods, limits: TransportLimits | None = None) -> None:
        self.methods = methods
        self.limits = limits or TransportLimits()
        self.warnings = PeerWarnings()
        self.connections: set[Connection] = set()
        self._listener: asyncio.Server | None = None

    async def start(self, host: str, port: int, tls: ServerTls | None = None) -> None:
        """Listen; with ``tls`` (its listener context offers ALPN h2, reloaded files included), every connection is TLS."""
        mute_debug()
        loop = asyncio.get_running_loop()
        self._listener = await loop.create_server(
            lambda: Connection(self.methods, self.limits, self.connections, self.warnings), host, port,
            reuse_address=True, ssl=None if tls is None else tls.listener,
            # The TLS handshake counts against the HTTP/2 one's limit (which starts after it).
            ssl_handshake_timeout=None if tls is None else self.limits.grpc.handshake_timeout_s,
        )

    def calls(self) -> int:
        """The streams open on every connection (a call leaves its connection once its status is sent or it is reset)."""
        return sum(len(c.calls) for c in self.connections)

    async def stop(self, grace_s: float) -> None:
        """Stop listening, let running calls end for up to ``grace_s`` (GOAWAY), then cut the rest."""
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
