"""What other test modules share of test_h2grpc.py's: BROKEN, Bytes, ECHO, FAIL, GATE, HOLD, Handlers (written
for its tests).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from google.protobuf import wrappers_pb2

from extproc.adapters.grpc.transport import GrpcError, Method

Bytes = wrappers_pb2.BytesValue


ECHO, HOLD, GATE, FAIL, BROKEN = "/t.T/Echo", "/t.T/Hold", "/t.T/Gate", "/t.T/Fail", "/t.T/Broken"


class Handlers:
    """The fake service these tests and test_h2grpc_abuse.py / test_transport_differential.py serve.

    Echo (each message back, doubled), Hold (answer the first message, then read on until the client's
    end, as an ext_proc stream holding a request), Gate (read nothing until ``opened``, then answer how
    many bytes came: a handler busy elsewhere), Fail (a status) and Broken (a bug).
    """

    def __init__(self) -> None:
        self.received = 0  # messages that reached Echo or Hold
        self.running = 0  # Hold handlers started and not ended
        self.holding = 0  # Hold handlers that answered and wait for the client's end
        self.ended = 0  # Hold handlers ended, however
        self.opened = asyncio.Event()

    def methods(self, *paths: str) -> dict[str, Method]:
        """The methods at ``paths`` (all of them by default)."""
        every = {ECHO: self.echo, HOLD: self.hold, GATE: self.gate, FAIL: self.fail, BROKEN: self.broken}
        return {path: Method(Bytes.FromString, every[path]) for path in paths or every}

    async def echo(self, requests: AsyncIterator[Bytes]) -> AsyncIterator[Bytes]:
        async for request in requests:
            self.received += 1
            yield Bytes(value=request.value * 2)

    async def hold(self, requests: AsyncIterator[Bytes]) -> AsyncIterator[Bytes]:
        self.running += 1
        try:
            async for _ in requests:
                self.received += 1
                yield Bytes(value=b"held")
                break
            self.holding += 1
            try:
                async for _ in requests:
                    pass
            finally:
                self.holding -= 1
        finally:
            self.running -= 1
            self.ended += 1

    async def gate(self, requests: AsyncIterator[Bytes]) -> AsyncIterator[Bytes]:
        await self.opened.wait()
        total = 0
        async for request in requests:
            total += len(request.value)
        yield Bytes(value=str(total).encode())

    async def fail(self, requests: AsyncIterator[Bytes]) -> AsyncIterator[Bytes]:
        async for _ in requests:
            raise GrpcError(9, "no, because ünïcode 100%")
        yield Bytes()

    async def broken(self, requests: AsyncIterator[Bytes]) -> AsyncIterator[Bytes]:
        async for _ in requests:
            raise ValueError("a bug")
        yield Bytes()


def tracebacks(records: list[logging.LogRecord]) -> list[logging.LogRecord]:
    """The records of ``records`` that carry a traceback or an error, but grpc.aio's callbacks for an event loop an
    earlier test closed: its poller is the process's, bound to the loop it first ran on, and calls back there after
    that test's loop is gone ("Event loop is closed"), whichever test is running then. Nothing of the server under
    test is in those."""
    def closed_loop(r: logging.LogRecord) -> bool:
        error = r.exc_info[1] if r.exc_info else None
        return (r.name == "asyncio" and "PollerCompletionQueue._handle_events" in r.getMessage()
                and isinstance(error, RuntimeError) and "Event loop is closed" in str(error))
    return [r for r in records if (r.exc_info or r.levelno >= logging.ERROR) and not closed_loop(r)]
