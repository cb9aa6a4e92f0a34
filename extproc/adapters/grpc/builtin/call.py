"""One gRPC call of the builtin transport: its message framing, its inbox, and what it owes flow control.

Split from builtin/connection.py so the per-stream state, the part that
10,000 held requests multiply, reads on its own. The statuses and messages are
grpcio's (or grpc-go's where grpcio does not check), so a client sees what a
reference gRPC server would have said.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any, Protocol

from extproc.adapters.grpc.transport import INTERNAL, INVALID_ARGUMENT, RESOURCE_EXHAUSTED, GrpcError, Method

# What grpcio's server says of a message it cannot decode (grpc/_server.py).
UNDECODABLE = "Exception deserializing request!"
TRUNCATED = "the stream ended inside a message (its length prefix promised more bytes)"
PREFIX = 5  # a message's compressed flag and 4-byte length
# A stream holding at least this much unread is a candidate when its connection's cap is reached (builtin/connection.py).
BIG = 64 * 1024


class Consumer(Protocol):
    """The connection: what it buffers for its calls, and told when a handler took a message that matters to it."""

    buffered: int

    def consumed(self, call: Call) -> None: ...


class Call:
    """One stream: its undecoded bytes, decoded messages not yet read, and the reader waiting for them.

    Slotted and lazily filled, because 10,000 of these sit idle while their requests are held.
    ``buffered`` counts the request bytes received and not yet taken by the
    handler (the partial message and the inbox); ``unacked`` the flow-controlled
    bytes not yet handed back to the peer. The connection keeps the two such
    that the peer can never make ``buffered`` exceed one message's worth.
    """

    __slots__ = ("stream_id", "method", "owner", "buffer", "inbox", "waiter", "ended", "task", "started",
                 "outgoing", "closing", "buffered", "unacked", "born", "parked")

    def __init__(self, stream_id: int, method: Method, owner: Consumer, born: float) -> None:
        self.stream_id = stream_id
        self.method = method
        self.owner = owner
        self.buffer: bytes | bytearray = b""
        self.inbox: deque[tuple[Any, int]] | None = None  # (message, its size on the wire)
        self.waiter: asyncio.Future[None] | None = None
        self.ended = False  # the client half-closed: no more messages
        self.task: asyncio.Task[None] | None = None
        self.started = False  # the response headers went out
        self.outgoing = b""  # bytes the flow-control window did not yet let out
        self.closing: list[tuple[bytes, bytes]] | None = None  # trailers to send once outgoing is out
        self.buffered = 0
        self.unacked = 0
        self.born = born  # when its headers came; 0 once its handler took a message (builtin/connection.py)
        self.parked = 0  # the outgoing bytes its connection counted when it parked the call (waiting on a window)

    def __aiter__(self) -> Call:
        return self

    async def __anext__(self) -> Any:
        # While a reply waits on the peer's window, the next message waits too: its bytes stay
        # unacknowledged, so a client that reads nothing cannot make us buffer without end.
        while self.outgoing or not self.inbox:
            if self.ended and not self.inbox and not self.outgoing:
                raise StopAsyncIteration
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        message, size = self.inbox.popleft()
        if not self.inbox:
            self.inbox = None  # an empty deque is about 600 bytes, kept by every held stream
        self.buffered -= size
        self.born = 0.0  # a reset from now on is not premature: its work was asked for and done
        owner = self.owner
        owner.buffered -= size
        # Most messages were handed back as they came (builtin/connection.py's _data): nothing more to tell.
        if self.unacked or self.buffered + size >= BIG:
            owner.consumed(self)
        return message

    def wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def received(self, data: bytes, limit: int) -> None:
        """Decode every complete length-prefixed message (of at most ``limit`` bytes) in the bytes received so far.

        Raises GrpcError for what ends the call: a compressed message (Envoy
        does not compress), one larger than ``limit``, one that does not decode.
        """
        self.buffered += len(data)
        if self.buffer:  # a message arriving in many frames grows in place, not by a copy per frame
            self.buffer += data
            buffer: bytes | bytearray = self.buffer
        else:
            buffer = data
        start = 0
        while len(buffer) - start >= PREFIX:
            size = int.from_bytes(buffer[start + 1:start + PREFIX], "big")
            if buffer[start] != 0:
                raise GrpcError(INTERNAL, "Compression bit set but no encoding configured")  # grpcio's words
            if size > limit:
                raise GrpcError(RESOURCE_EXHAUSTED, f"Received message larger than max ({size} vs. {limit})")
            end = start + PREFIX + size
            if len(buffer) < end:
                break
            try:
                message = self.method.decode(bytes(buffer[start + PREFIX:end]))
            except Exception:  # noqa: BLE001 (any decoder's error is the peer's bytes, never ours)
                raise GrpcError(INTERNAL, UNDECODABLE) from None
            if self.inbox is None:
                self.inbox = deque()
            self.inbox.append((message, PREFIX + size))
            start = end
        if start == len(buffer):
            self.buffer = b""
        elif start or not isinstance(buffer, bytearray):
            self.buffer = bytearray(buffer[start:])
        self.wake()

    def end(self) -> None:
        """The client half-closed. Raises GrpcError if that cut a message short (grpcio would answer OK)."""
        self.ended = True
        self.wake()
        if self.buffer:
            raise GrpcError(INTERNAL, TRUNCATED)


def trailers(status: int, message: str) -> list[tuple[bytes, bytes]]:
    out = [(b"grpc-status", str(status).encode())]
    if message:
        # grpc-message is the UTF-8 bytes, percent-encoded outside printable ASCII (and '%' itself).
        encoded = b"".join(bytes([b]) if 0x20 <= b <= 0x7E and b != 0x25 else b"%%%02X" % b for b in message.encode())
        out.append((b"grpc-message", encoded))
    return out


def is_grpc(content_type: bytes) -> bool:
    """grpc-go's rule: ``application/grpc``, alone or followed by ``+`` or ``;`` (so not gRPC-Web)."""
    value = content_type.lower()
    return value == b"application/grpc" or value[:17] in (b"application/grpc+", b"application/grpc;")


def refused(headers: dict[bytes, bytes]) -> tuple[bytes, int, str] | None:
    """A request that is not a gRPC POST: refused as grpc-go refuses it (grpc.aio serves it as gRPC), with
    the HTTP status, the gRPC status and its message; None for a gRPC request."""
    content_type = headers.get(b"content-type", b"")
    if not is_grpc(content_type):
        return b"415", INVALID_ARGUMENT, f'invalid gRPC request content-type "{shown(content_type)}"'
    verb = headers.get(b":method", b"")
    if verb != b"POST":
        return b"405", INTERNAL, f'Received a HEADERS frame with :method "{shown(verb)}" which should be POST'
    return None


def shown(value: bytes) -> str:
    """A peer's header value as a log line and a status message may carry it: printable ASCII, any other byte escaped.

    The HTTP/2 layer does not check inbound headers (docs/decisions.md), so a value may
    hold any byte, a line break that would forge a log line included.
    """
    return "".join(chr(b) if 0x20 <= b < 0x7F else f"\\x{b:02x}" for b in value)
