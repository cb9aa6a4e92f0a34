"""The ext_proc hop's own gRPC server (builtin/server.py), spoken to by grpcio's C-core client over real HTTP/2.

grpcio is an independent implementation of the same protocol, so these check
the wire behaviour Envoy relies on: replies and statuses, flow control for
messages larger than the windows, cancellation on a client reset, thousands
of streams on one connection, and the health service's drain (abuse: test_h2grpc_abuse.py).
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from extproc.adapters.grpc.builtin.server import BuiltinServer
from extproc.adapters.grpc.health import Health
from extproc.adapters.grpc.transport import MAX_MESSAGE_BYTES
from extproc.tools.procs import free_port
from tests.helpers.h2grpc import BROKEN, ECHO, FAIL, HOLD, Bytes, Handlers
from tests.waitutil import eventually

pytestmark = pytest.mark.unit


async def _serving(handlers: Handlers, health: Health | None = None) -> tuple[BuiltinServer, Any]:
    server = BuiltinServer({**handlers.methods(ECHO, HOLD, FAIL, BROKEN), **(health.methods() if health else {})})
    port = free_port()
    await server.start("127.0.0.1", port)
    # Any: grpc-stubs type the aio channel's calls after the synchronous API's.
    channel: Any = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_receive_message_length", 2**26)])
    return server, channel


def _stream(channel: Any, path: str) -> Any:
    return channel.stream_stream(path, request_serializer=Bytes.SerializeToString,
                                 response_deserializer=Bytes.FromString)


async def test_messages_larger_than_every_window_arrive_whole_both_ways() -> None:
    """3 MiB in, 6 MiB out: more than the client's and our stream windows, so flow control must work."""
    handlers = Handlers()
    server, channel = await _serving(handlers)
    try:
        call = _stream(channel, ECHO)()
        big = bytes(range(256)) * (3 * 4096)
        await call.write(Bytes(value=big))
        await call.write(Bytes(value=b"x"))
        await call.done_writing()
        replies = [r.value async for r in call]
        assert replies == [big * 2, b"xx"]
        assert await call.code() == grpc.StatusCode.OK
    finally:
        await channel.close()
        await server.stop(0)


async def test_errors_end_the_call_with_a_status_the_client_reads() -> None:
    handlers = Handlers()
    server, channel = await _serving(handlers)
    try:
        for path, code, details in (
            (FAIL, grpc.StatusCode.FAILED_PRECONDITION, "no, because ünïcode 100%"),
            (BROKEN, grpc.StatusCode.INTERNAL, "internal error"),
            ("/t.T/Missing", grpc.StatusCode.UNIMPLEMENTED, None),
        ):
            # Unary: the request and its end go out together. A stream's later write racing the
            # server's early end makes grpcio report its own INTERNAL instead of the sent status.
            unary = channel.unary_unary(path, request_serializer=Bytes.SerializeToString,
                                        response_deserializer=Bytes.FromString)
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await unary(Bytes(value=b"a"))
            assert raised.value.code() == code, raised.value
            if details is not None:
                assert raised.value.details() == details
        call = _stream(channel, ECHO)(iter([Bytes(value=b"a" * (MAX_MESSAGE_BYTES + 1))]))
        assert await call.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # The connection still serves after every error above.
        assert (await _stream(channel, ECHO)(iter([Bytes(value=b"ok")])).read()).value == b"okok"
    finally:
        await channel.close()
        await server.stop(0)


async def test_thousands_of_held_streams_on_one_connection_and_a_reset_ends_each_handler_at_once() -> None:
    """Far under the stream limit (held requests are streams); a client that leaves cancels its handler."""
    handlers = Handlers()
    server, channel = await _serving(handlers)
    n = 2_000
    try:
        calls = [_stream(channel, HOLD)() for _ in range(n)]
        for call in calls:
            await call.write(Bytes(value=b"hi"))
        replies = await asyncio.gather(*(call.read() for call in calls))
        assert {r.value for r in replies} == {b"held"}
        assert handlers.holding == n and server.calls() == n
        for call in calls[: n // 2]:
            call.cancel()  # RST_STREAM
        for call in calls[n // 2:]:
            await call.done_writing()  # END_STREAM: the request finished normally
        await eventually(lambda: handlers.ended == n, what=f"all {n} handlers ended")
        assert handlers.holding == 0
        assert server.calls() == 0
        assert [await call.code() for call in calls[n // 2:]] == [grpc.StatusCode.OK] * (n - n // 2)
        # The HTTP/2 layer's table of streams keeps open ones only: after as many again, the first are gone.
        echo = _stream(channel, ECHO)
        await asyncio.gather(*(echo(iter([Bytes(value=b"x")])).read() for _ in range(n)))
        (connection,) = server.connections
        assert connection.open_streams < 1.5 * n
    finally:
        await channel.close()
        await server.stop(0)


async def test_health_answers_the_endpoint_picker_services_and_only_liveness_survives_the_drain() -> None:
    pools_known = [False]
    health = Health(lambda: pools_known[0])
    server, channel = await _serving(Handlers(), health)
    stub = health_pb2_grpc.HealthStub(channel)
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING

    async def statuses() -> dict[str, int]:
        services = ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor", "")
        return {s: (await stub.Check(health_pb2.HealthCheckRequest(service=s))).status for s in services}

    try:
        assert set((await statuses()).values()) == {serving, not_serving}  # alive, not started yet
        health.start()
        assert (await statuses())["readiness"] == not_serving  # no pool member known yet
        pools_known[0] = True
        assert set((await statuses()).values()) == {serving}
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await stub.Check(health_pb2.HealthCheckRequest(service="other"))
        assert raised.value.code() == grpc.StatusCode.NOT_FOUND
        health.enter_graceful_shutdown()
        assert await statuses() == {"liveness": serving, "readiness": not_serving,
                                    "envoy.service.ext_proc.v3.ExternalProcessor": not_serving, "": not_serving}
    finally:
        await channel.close()
        await server.stop(0)


async def test_stop_lets_running_calls_finish_within_the_grace_and_cuts_the_rest() -> None:
    handlers = Handlers()
    server, channel = await _serving(handlers)
    try:
        call = _stream(channel, HOLD)()
        await call.write(Bytes(value=b"hi"))
        await call.read()
        await server.stop(0.1)  # the held call does not end by itself: cut after the grace
        assert handlers.ended == 1 and server.calls() == 0
        with pytest.raises(grpc.aio.AioRpcError):
            await call.read()
    finally:
        await channel.close()
