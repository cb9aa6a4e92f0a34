"""The same gRPC server as builtin/server.py on grpc.aio (``listen.transport: grpcio``): the reference transport.

Why keep it: grpcio's C-core is the battle-tested HTTP/2 and gRPC stack that
our own transport is compared with (tests/adapters/grpc/test_transport_differential.py), and
an operator who distrusts ours can switch to it. It costs more per held
request (21–24 KB of native state per stream against about 3 KB,
docs/decisions.md) and more CPU per request (docs/reports/benchmarks.md).

It implements the same :class:`~.transport.Transport` as
:class:`~.builtin.server.BuiltinServer`, serving the ``{path: Method}`` table through one
generic handler, so the ext_proc servicer and the health service (the same
:class:`~.health.Health` object, one source of truth for status) do not know
which transport carries them. A handler's :class:`~.transport.GrpcError` ends
the call with its status; a request that does not decode ends with INTERNAL,
as the builtin server does; any other exception is logged and ends with INTERNAL.

TLS takes the same files; grpcio reads them through its own credentials, which
ask :class:`~.tls.ServerTls` before every handshake whether they were reloaded,
so a rotated certificate serves new connections as on the builtin server.
"""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from extproc.adapters.grpc.peer_warnings import WARN_EVERY_S
from extproc.adapters.grpc.tls import ServerTls
from extproc.adapters.grpc.transport import INTERNAL, GrpcError, Message, Method, Methods, Transport, TransportLimits

log = logging.getLogger(__name__)

_CODES = {code.value[0]: code for code in grpc.StatusCode}
if TYPE_CHECKING:  # grpc-stubs make it generic; grpcio's class is not subscriptable
    _GenericRpcHandler = grpc.GenericRpcHandler[Any, Any]
else:
    _GenericRpcHandler = grpc.GenericRpcHandler


class _BatchErrors(logging.Filter):
    """grpcio's traceback for a reply it could not send becomes one line, at most one per WARN_EVERY_S.

    When a client leaves, or never opens its window, with replies still to
    send, grpc.aio logs ``ExecuteBatchError raised in core by servicer method``
    with the traceback of its own send, at ERROR (2,000 requests from a
    zero-window client left one): nothing of ours failed, and the client is
    gone. The record is kept as a warning without the traceback, the next
    ones within the window counted into it.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self._clock = clock
        self._last = float("-inf")
        self._suppressed = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.getMessage().startswith("ExecuteBatchError raised in core"):
            return True
        now = self._clock()
        if now - self._last < WARN_EVERY_S:
            self._suppressed += 1
            return False
        more = f" ({self._suppressed} more not logged)" if self._suppressed else ""
        self._last, self._suppressed = now, 0
        record.msg = (f"{record.getMessage()}: a reply could not be sent, its client left or opened no window "
                      f"(grpcio's traceback not logged){more}")
        record.args = ()
        record.exc_info = record.exc_text = None
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


# grpc.aio logs its failures to send through this logger (grpc/_cython/_cygrpc/aio/server.pyx.pxi).
_GRPC_AIO_LOG = logging.getLogger("grpc._cython.cygrpc")
_BATCH_ERRORS = _BatchErrors()


class _Undecodable(Exception):
    """A request's bytes are not a valid message: the peer's fault, answered without a traceback."""


def _decoder(decode: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def decoded(data: bytes) -> Any:
        try:
            return decode(data)
        except Exception as exc:
            raise _Undecodable(str(exc)) from None
    return decoded


def _serialize(message: Message) -> bytes:
    return message.SerializeToString()


class _Handlers(_GenericRpcHandler):
    """Every method of the table as a bidirectional stream, as the builtin server serves them (any cardinality fits)."""

    def __init__(self, server: GrpcioServer) -> None:
        self._handlers = {
            path: grpc.stream_stream_rpc_method_handler(
                server.behaviour(method), request_deserializer=_decoder(method.decode), response_serializer=_serialize)
            for path, method in server.methods.items()
        }

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler[Any, Any] | None:
        return self._handlers.get(handler_call_details.method)  # None: grpcio answers UNIMPLEMENTED


class GrpcioServer(Transport):
    """Serves ``methods`` on grpc.aio (transport.py says what it owes)."""

    def __init__(self, methods: Methods, limits: TransportLimits | None = None) -> None:
        self.methods = methods
        self.limits = limits or TransportLimits()
        self._active = 0
        self._server: grpc.aio.Server | None = None

    def behaviour(self, method: Method) -> Callable[[AsyncIterator[Any], grpc.aio.ServicerContext[Any, Any]],
                                                     AsyncIterator[Message]]:
        async def call(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext[Any, Any]
                       ) -> AsyncIterator[Message]:
            self._active += 1
            # Counted until its status is sent or the client reset it (grpc-stubs want a DoneCallback
            # instance; grpcio takes any callable of the context).
            context.add_done_callback(self._ended)  # type: ignore[arg-type]
            try:
                async for reply in method.handler(requests):
                    yield reply
            except GrpcError as exc:
                await context.abort(_CODES.get(exc.status, grpc.StatusCode.UNKNOWN), exc.message)
            except _Undecodable as exc:
                await context.abort(grpc.StatusCode.INTERNAL, f"cannot decode the message: {exc}")
            except Exception:
                log.exception("handler for %s failed", context.peer())
                await context.abort(_CODES[INTERNAL], "internal error")
        return call

    def _ended(self, _: object) -> None:
        self._active -= 1

    async def start(self, host: str, port: int, tls: ServerTls | None = None) -> None:
        """Listen; with ``tls``, every connection is TLS with its files (reloaded ones for new handshakes)."""
        bounds = self.limits.grpc
        if _BATCH_ERRORS not in _GRPC_AIO_LOG.filters:
            _GRPC_AIO_LOG.addFilter(_BATCH_ERRORS)
        self._server = grpc.aio.server(handlers=[_Handlers(self)], options=[
            ("grpc.max_receive_message_length", self.limits.max_message_bytes),
            ("grpc.max_send_message_length", -1),
            # A port already in use is an error, as on the builtin server, not a second listener sharing it.
            ("grpc.so_reuseport", 0),
            # C-core cancels new calls once 1,000 wait for Python to take them (3,000: at once): a burst of
            # held requests does that (measured: 207 of 2,000 opened at once lost). Every held request is a
            # call, so like the builtin server, no such limit.
            ("grpc.server.max_pending_requests", 2**30), ("grpc.server.max_pending_requests_hard_limit", 2**30),
            # advanced.grpc's limits, as C-core names them. connection_buffer_bytes has no C-core
            # counterpart: its own flow-control windows bound what a connection buffers.
            ("grpc.max_concurrent_streams", bounds.max_streams_per_connection),
            ("grpc.max_allowed_incoming_connections", bounds.max_connections),
            ("grpc.max_connection_idle_ms", int(bounds.idle_timeout_s * 1000)),
            ("grpc.server_handshake_timeout_ms", int(bounds.handshake_timeout_s * 1000)),
            # Abuse (docs/decisions.md, "The two transports side by side"): C-core's own limits, set to what
            # builtin holds where C-core has the knob. A header list of 16 KiB, as builtin's; PINGs without
            # data: GOAWAY ENHANCE_YOUR_CALM ("too_many_pings") at the third within 5 minutes; at most 32 new
            # streams handled per read (its defaults, written down so they do not drift).
            ("grpc.absolute_max_metadata_size", 16 * 1024),
            ("grpc.http2.max_ping_strikes", 2),
            ("grpc.http2.min_ping_interval_without_data_ms", 5 * 60 * 1000),
            ("grpc.http2.max_requests_per_read", 32),
        ])
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            if tls is None:
                self._server.add_insecure_port(address)
            else:
                self._server.add_secure_port(address, _credentials(tls))
        except RuntimeError:  # grpcio says only that it could not bind; an OSError, as the builtin server raises
            raise OSError(errno.EADDRINUSE, "Address already in use, or not permitted (grpcio does not say which)"
                          ) from None
        await self._server.start()

    def calls(self) -> int:
        """The calls grpc.aio handed us and has not yet ended (status sent, or reset by the client)."""
        return self._active

    async def stop(self, grace_s: float) -> None:
        """Stop listening (GOAWAY), let running calls end for up to ``grace_s``, then cut the rest."""
        if self._server is not None:
            await self._server.stop(grace_s)
            self._server = None


def _credentials(tls: ServerTls) -> grpc.ServerCredentials:
    """grpcio's TLS from the files ServerTls validated, refetched before a handshake once it reloaded them."""
    loaded = [tls.current]

    def configuration() -> grpc.ServerCertificateConfiguration:
        s = tls.settings
        ca = None if s.client_ca_file is None else Path(s.client_ca_file).read_bytes()
        return grpc.ssl_server_certificate_configuration(
            [(Path(s.key_file).read_bytes(), Path(s.cert_file).read_bytes())], root_certificates=ca)

    def fetch() -> grpc.ServerCertificateConfiguration | None:
        if tls.current is loaded[0]:
            return None
        # Read just after ServerTls validated them: files rewritten in between would hand grpcio a pair
        # ServerTls has not checked (until its next look at the files, a few reload_s later).
        loaded[0] = tls.current
        try:
            return configuration()
        except OSError as exc:  # gone since it loaded: keep what serves, ServerTls will warn on its next look
            log.warning("listen.tls: cannot read the reloaded files (%s); still serving the previous ones", exc)
            return None

    # grpc-stubs type the fetcher without its None ("no change"), which grpcio documents.
    return grpc.dynamic_ssl_server_credentials(
        configuration(), fetch,  # type: ignore[arg-type]
        require_client_authentication=tls.settings.client_ca_file is not None)
