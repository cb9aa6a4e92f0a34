"""A gRPC server on one transport in a process of its own, for the abuse suite (tests/stack/test_abuse.py) to attack.

``python -m tests.abuseserver TRANSPORT PORT`` serves the fake service of
tests/adapters/grpc/test_h2grpc.py (Echo, Hold) and Release, a held request released
after RELEASE_S, on ``listen.transport`` TRANSPORT with the limits a config
gets by default, on uvloop as ``extproc serve`` runs. Its own process so
that the suite reads its memory from outside (/proc/PID/status) and its
event loop is not the attackers'. It prints ``ready`` once listening and
logs to stderr; SIGTERM stops it.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import AsyncIterator

import uvloop
from google.protobuf import wrappers_pb2

from extproc.adapters.grpc.transport import Method, TransportLimits
from extproc.adapters.transports import TRANSPORTS
from tests.helpers.h2grpc import ECHO, HOLD, Handlers

Bytes = wrappers_pb2.BytesValue
RELEASE = "/t.T/Release"
# How long Release holds a request: the "usual time" a bystander's release is compared against.
RELEASE_S = 0.02


async def release(requests: AsyncIterator[Bytes]) -> AsyncIterator[Bytes]:
    """A held request: its first message answered after RELEASE_S, then the stream read to its end."""
    async for _ in requests:
        await asyncio.sleep(RELEASE_S)
        yield Bytes(value=b"released")
        break
    async for _ in requests:
        pass


async def serve(transport: str, port: int) -> None:
    methods = {**Handlers().methods(ECHO, HOLD), RELEASE: Method(Bytes.FromString, release)}
    server = TRANSPORTS[transport](methods, TransportLimits())
    await server.start("127.0.0.1", port)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    print("ready", flush=True)
    await stop.wait()
    await server.stop(0)


def main() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    uvloop.run(serve(sys.argv[1], int(sys.argv[2])))


if __name__ == "__main__":
    main()
