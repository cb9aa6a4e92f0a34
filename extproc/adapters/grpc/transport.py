"""The seam between what we serve over gRPC and the server that carries it: what a transport owes, and the shared types.

The ext_proc servicer and the health service hand a transport a table of
:class:`Method` by gRPC path and end a call early by raising
:class:`GrpcError`; they never learn which server carries them. Two servers
implement :class:`Transport`, chosen by ``listen.transport`` (``TRANSPORTS``,
``adapters/transports.py``): ``builtin`` (builtin/, ours, a few KB per held request) and
``grpcio`` (grpcio_server.py, grpc.aio, the reference). Each maps its
library's failures to ours at this seam, so a caller sees the same errors and
statuses whichever runs. tests/adapters/grpc/test_transport_differential.py is the
conformance suite: every case runs against each entry of ``TRANSPORTS``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from extproc.adapters.config import GrpcLimits

if TYPE_CHECKING:
    from extproc.adapters.grpc.tls import ServerTls

# gRPC status codes (https://grpc.github.io/grpc/core/md_doc_statuscodes.html) our servers and handlers send.
OK, UNKNOWN, INVALID_ARGUMENT, NOT_FOUND, RESOURCE_EXHAUSTED, UNIMPLEMENTED, INTERNAL = 0, 2, 3, 5, 8, 12, 13

# grpcio's default limit for a received message, and the least a transport is given (server.py raises it
# to the body limit: a buffered request body comes in one message).
MAX_MESSAGE_BYTES = 4 * 1024 * 1024


class Message(Protocol):
    def SerializeToString(self) -> bytes: ...  # noqa: N802 (protobuf's name)


class GrpcError(Exception):
    """Raised by a handler: the call ends with this status instead of OK."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class Method:
    """One RPC: how to decode its requests, and the handler that turns them into replies.

    A transport serves every method as a bidirectional stream: the handler
    reads an async iterator of decoded requests and yields its replies, so one
    shape fits calls of any cardinality.
    """

    decode: Callable[[bytes], Any]
    handler: Callable[[AsyncIterator[Any]], AsyncIterator[Message]]


Methods = Mapping[str, Method]  # by gRPC path, ``/package.Service/Method``


@dataclass(frozen=True, slots=True)
class TransportLimits:
    """What a transport lets its peers hold: ``advanced.grpc``'s bounds as configured, and the largest message.

    The bounds are read from the config's own struct (its defaults are far
    above what Envoy's held requests need, docs/configuration.md), so there is
    one place that says what they are.
    """

    grpc: GrpcLimits = field(default_factory=GrpcLimits)
    max_message_bytes: int = MAX_MESSAGE_BYTES


class Transport(Protocol):
    """A gRPC server for a table of methods: what an implementation owes.

    Constructed as ``Transport(methods, limits)`` (:data:`TransportFactory`).
    A handler's :class:`GrpcError` ends its call with that status; a request
    that does not decode or is larger than ``limits.max_message_bytes`` ends
    only its call (INTERNAL, RESOURCE_EXHAUSTED); an unknown path is
    UNIMPLEMENTED; a client that resets a call cancels its handler; any other
    exception of a handler is logged and ends its call INTERNAL. Nothing a peer
    sends may put a traceback in the log.
    """

    async def start(self, host: str, port: int, tls: ServerTls | None = None) -> None:
        """Listen on ``host:port``; with ``tls``, every connection is TLS with its files (reloaded ones for new handshakes).

        Raises OSError when the address cannot be bound (in use, or not permitted).
        """
        ...

    def calls(self) -> int:
        """The calls in progress: from the request's headers until its status is sent or the client reset it."""
        ...

    async def stop(self, grace_s: float) -> None:
        """Stop listening and refuse new calls (GOAWAY), let running calls end for up to ``grace_s``, then cut the rest."""
        ...


TransportFactory = Callable[[Methods, TransportLimits], Transport]
