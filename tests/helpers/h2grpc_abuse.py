"""What other test modules share of test_h2grpc_abuse.py's: Bytes, ECHO, GATE, HI, HOLD, INTERNAL,
INVALID_ARGUMENT, OK, RESOURCE_EXHAUSTED, _Served, _connected, _echoes, _held, _serving (written for its
tests).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from google.protobuf import wrappers_pb2

from extproc.adapters.config import GrpcLimits
from extproc.adapters.grpc.builtin.server import BuiltinServer
from extproc.adapters.grpc.transport import TransportLimits
from extproc.tools.procs import free_port
from tests.h2raw import RawClient, message
from tests.helpers.h2grpc import Handlers

Bytes = wrappers_pb2.BytesValue


ECHO, HOLD, GATE = b"/t.T/Echo", b"/t.T/Hold", b"/t.T/Gate"


OK, INVALID_ARGUMENT, RESOURCE_EXHAUSTED, INTERNAL = 0, 3, 8, 13


HI = message(Bytes(value=b"hi").SerializeToString())


@dataclass
class _Served:
    server: BuiltinServer
    port: int
    clients: list[RawClient] = field(default_factory=list)

    async def connect(self, *, preface: bool = True) -> RawClient:
        """A raw client, closed when the server stops."""
        self.clients.append(client := await RawClient.connect(self.port, preface=preface))
        return client


@asynccontextmanager
async def _serving(handlers: Handlers, **limits: Any) -> AsyncIterator[_Served]:
    server = BuiltinServer(handlers.methods(*(p.decode() for p in (ECHO, HOLD, GATE))),
                           limits=TransportLimits(GrpcLimits(**limits)))
    served = _Served(server, free_port())
    await server.start("127.0.0.1", served.port)
    try:
        yield served
    finally:
        for client in served.clients:
            await client.close()
        await server.stop(0)


@asynccontextmanager
async def _connected(handlers: Handlers | None = None, **limits: Any) -> AsyncIterator[tuple[BuiltinServer, RawClient]]:
    """A server and one raw client connected to it."""
    async with _serving(handlers or Handlers(), **limits) as served:
        yield served.server, await served.connect()


async def _held(client: RawClient) -> int:
    stream = client.request(HOLD)
    client.send(stream, HI)
    await client.until(lambda: any(getattr(e, "data", b"") for e in client.of(stream)))
    return stream


async def _echoes(client: RawClient) -> bool:
    stream = client.request(ECHO)
    client.send(stream, HI, end=True)
    await client.until(lambda: client.ended(stream))
    return client.status(stream) == OK
