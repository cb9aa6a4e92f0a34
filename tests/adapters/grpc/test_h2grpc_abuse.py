"""The ext_proc hop's own gRPC server (listen.transport: builtin) under abuse: what a peer that can reach the port may send.

Each test attacks a real BuiltinServer on a loopback socket with a raw HTTP/2
client (tests/h2raw.py) or grpcio's, and asserts what the peers observe:
the attacked stream's status, that another stream on the same connection
still completes, what the server buffers, that stalled connections close, and
that nothing a peer sends puts a traceback in the log.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import types
from collections.abc import Iterator
from typing import Any

import grpc
import h2.errors
import pytest
from hyperframe.frame import PingFrame, WindowUpdateFrame

from extproc.adapters.grpc.builtin.call import TRUNCATED, UNDECODABLE
from extproc.adapters.grpc.peer_warnings import PeerWarnings
from extproc.adapters.grpc.transport import MAX_MESSAGE_BYTES
from tests.h2raw import message
from tests.helpers.h2grpc import Handlers, tracebacks
from tests.helpers.h2grpc_abuse import (
    ECHO,
    GATE,
    HI,
    HOLD,
    INTERNAL,
    INVALID_ARGUMENT,
    OK,
    RESOURCE_EXHAUSTED,
    Bytes,
    _connected,
    _echoes,
    _held,
    _serving,
)

pytestmark = pytest.mark.unit

NOT_PROTOBUF = b"\x0a\x05ab"  # field 1 says 5 bytes follow, 2 do


@pytest.fixture
def no_tracebacks(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    caplog.set_level(logging.INFO)
    yield caplog
    assert tracebacks(caplog.records) == []


async def test_an_undecodable_message_ends_only_its_stream(no_tracebacks: pytest.LogCaptureFixture) -> None:
    """grpcio's answer (INTERNAL "Exception deserializing request!"); the connection and its held stream live on."""
    async with _serving(Handlers()) as served:
        channel: Any = grpc.aio.insecure_channel(f"127.0.0.1:{served.port}")
        try:
            held = channel.stream_stream(HOLD.decode(), request_serializer=Bytes.SerializeToString,
                                         response_deserializer=Bytes.FromString)()
            await held.write(Bytes(value=b"hi"))
            assert (await held.read()).value == b"held"
            garbage = channel.unary_unary(ECHO.decode(), request_serializer=lambda _: NOT_PROTOBUF,
                                          response_deserializer=Bytes.FromString)
            for _ in range(3):
                with pytest.raises(grpc.aio.AioRpcError) as raised:
                    await garbage(Bytes())
                assert (raised.value.code(), raised.value.details()) == (grpc.StatusCode.INTERNAL, UNDECODABLE)
            await held.done_writing()  # the held stream, on the same connection, still completes
            assert await held.code() == grpc.StatusCode.OK
            assert len(served.server.connections) == 1
            # One warning line for the three (rate-limited per peer).
            assert len([r for r in no_tracebacks.records if "deserializing" in r.getMessage()]) == 1
        finally:
            await channel.close()


async def test_a_truncated_message_then_the_stream_end_is_internal_not_ok(no_tracebacks: pytest.LogCaptureFixture) -> None:
    async with _connected() as (_, client):
        for cut in (HI[:-1], HI[:3]):  # inside the payload, inside the length prefix
            stream = client.request(ECHO)
            client.send(stream, cut, end=True)
            await client.until(lambda s=stream: client.ended(s))  # type: ignore[misc]
            assert client.status(stream) == INTERNAL
            assert client.headers(stream)[b"grpc-message"] == TRUNCATED.encode()
        assert await _echoes(client)


async def test_a_client_goaway_lets_running_streams_finish_then_the_connection_closes(
        no_tracebacks: pytest.LogCaptureFixture) -> None:
    handlers = Handlers()
    async with _connected(handlers) as (_, client):
        held = await _held(client)
        racing = client.request(ECHO)  # a request and the GOAWAY in the same burst
        client.send(racing, HI, end=True)
        client.goaway()
        await client.until(lambda: client.ended(racing))
        assert client.status(racing) == OK
        await asyncio.sleep(0.1)
        assert not client.eof and handlers.holding == 1  # the held stream was not cut
        client.send(held, b"", end=True)
        await client.until(lambda: client.eof)  # closed once none are left
        assert client.status(held) == OK


async def test_a_client_goaway_with_an_error_closes_the_connection(no_tracebacks: pytest.LogCaptureFixture) -> None:
    handlers = Handlers()
    async with _connected(handlers) as (_, client):
        await _held(client)
        client.goaway(h2.errors.ErrorCodes.INTERNAL_ERROR)
        await client.until(lambda: client.eof)
        await client.until(lambda: handlers.holding == 0)  # its handler was cancelled


async def test_our_shutdown_goaway_is_two_step_and_lets_running_streams_end(
        no_tracebacks: pytest.LogCaptureFixture) -> None:
    handlers = Handlers()
    async with _connected(handlers) as (server, client):
        held = await _held(client)
        stopping = asyncio.ensure_future(server.stop(5.0))
        await client.until(lambda: len(client.goaways()) == 2)  # 2^31-1 first; after our PING, the last stream
        assert [g.last_stream_id for g in client.goaways()] == [2**31 - 1, held]
        assert handlers.holding == 1 and not stopping.done()
        client.send(held, b"", end=True)
        await client.until(lambda: client.ended(held))
        assert client.status(held) == OK
        await asyncio.wait_for(stopping, 2.0)  # done as soon as the last stream was, not after the grace


async def test_data_is_acknowledged_as_the_handler_reads_it(no_tracebacks: pytest.LogCaptureFixture) -> None:
    """A handler that does not read: the peer can push one message's worth, no more; once it reads, the rest comes."""
    handlers = Handlers()
    async with _connected(handlers) as (server, client):
        await client.until(lambda: client.h2.remote_settings.initial_window_size > 65_535)
        stream = client.request(GATE)
        chunk = message(Bytes(value=b"x" * 60_000).SerializeToString())
        rest = chunk * 200  # 12 MB of whole messages: three times what one stream may hold
        for _ in range(50):
            rest = client.send_within_window(stream, rest)
            await asyncio.sleep(0.01)
        (conn,) = server.connections
        budget = MAX_MESSAGE_BYTES + 5 + 16_384
        assert rest and client.h2.local_flow_control_window(stream) == 0
        assert 0.5 * budget < conn.buffered <= budget
        assert await _echoes(client)  # the connection's other streams are not held up
        handlers.opened.set()
        while rest:
            rest = client.send_within_window(stream, rest)
            await asyncio.sleep(0.005)
        client.send(stream, b"", end=True)
        await client.until(lambda: client.ended(stream), timeout=20)
        assert client.status(stream) == OK
        assert conn.buffered == 0


async def test_messages_never_finished_on_many_streams_are_bounded_per_connection(
        no_tracebacks: pytest.LogCaptureFixture) -> None:
    """24 streams each one byte short of a whole 4 MiB message: the connection holds its budget, no more."""
    async with _connected(connection_buffer_bytes=8 * 1024 * 1024) as (server, client):
        body = Bytes(value=b"x" * (MAX_MESSAGE_BYTES - 16)).SerializeToString()
        streams = {client.request(ECHO): message(body)[:-1] for _ in range(24)}
        (conn,) = server.connections
        most = 0
        for _ in range(100):
            for stream, rest in streams.items():
                if not client.ended(stream):
                    streams[stream] = client.send_within_window(stream, rest)
            await asyncio.sleep(0.01)
            most = max(most, conn.buffered)
        assert most <= 8 * 1024 * 1024
        refused = [s for s in streams if client.ended(s)]
        assert refused and all(client.status(s) == RESOURCE_EXHAUSTED for s in refused)
        assert await _echoes(client)


async def test_streams_past_the_limit_are_refused_and_the_rest_complete(no_tracebacks: pytest.LogCaptureFixture) -> None:
    async with _connected(max_streams_per_connection=3) as (_, client):
        await client.until(lambda: client.h2.remote_settings.max_concurrent_streams == 3)
        held = [await _held(client) for _ in range(3)]
        extra = client.request(ECHO)
        client.send(extra, HI, end=True)
        await client.until(lambda: client.ended(extra))
        assert client.reset_code(extra) == h2.errors.ErrorCodes.REFUSED_STREAM
        for stream in held:
            client.send(stream, b"", end=True)
        await client.until(lambda: all(client.ended(s) for s in held))
        assert [client.status(s) for s in held] == [OK] * 3
        assert await _echoes(client)  # room again


async def test_connections_past_the_limit_are_refused_with_one_log_line(no_tracebacks: pytest.LogCaptureFixture) -> None:
    async with _serving(Handlers(), max_connections=2) as served:
        clients = [await served.connect() for _ in range(2)]
        await asyncio.sleep(0.05)
        refused = [await served.connect() for _ in range(5)]
        for client in refused:
            await client.until(lambda c=client: c.eof)  # type: ignore[misc]
            assert [g.error_code for g in client.goaways()] == [h2.errors.ErrorCodes.ENHANCE_YOUR_CALM]
        assert all([await _echoes(c) for c in clients[:2]])
        assert len([r for r in no_tracebacks.records if "advanced.grpc.max_connections" in r.getMessage()]) == 1


async def test_stalled_handshakes_and_idle_connections_are_closed_but_not_one_holding_a_stream(
        no_tracebacks: pytest.LogCaptureFixture) -> None:
    async with _serving(Handlers(), handshake_timeout_s=0.2, idle_timeout_s=0.4) as served:
        silent = await served.connect(preface=False)
        idle = await served.connect()
        holding = await served.connect()
        held = await _held(holding)
        await silent.until(lambda: silent.eof, timeout=3)
        await idle.until(lambda: idle.eof, timeout=3)
        assert idle.goaways() and idle.goaways()[0].error_code == 0
        assert not holding.eof
        holding.write(PingFrame(0, opaque_data=b"12345678").serialize())  # answered, as h2 does
        await holding.until(lambda: any(type(e).__name__ == "PingAckReceived" for e in holding.events))
        holding.send(held, b"", end=True)
        await holding.until(lambda: holding.ended(held))
        assert holding.status(held) == OK
        await holding.until(lambda: holding.eof, timeout=3)  # idle now: closed in turn


@pytest.mark.parametrize(("content_type", "method", "http", "grpc_status"), [
    (b"text/plain", b"POST", b"415", INVALID_ARGUMENT),
    (b"application/json", b"POST", b"415", INVALID_ARGUMENT),
    (b"application/grpc-web", b"POST", b"415", INVALID_ARGUMENT),
    (b"application/grpc-web+proto", b"POST", b"415", INVALID_ARGUMENT),
    (None, b"POST", b"415", INVALID_ARGUMENT),
    (b"application/grpc", b"GET", b"405", INTERNAL),
    (b"application/grpc", b"PUT", b"405", INTERNAL),
    (b"application/grpc+proto", b"POST", b"200", OK),
    (b"application/grpc; charset=utf-8", b"POST", b"200", OK),
])
async def test_non_grpc_requests_are_refused_as_grpc_go_refuses_them(
        content_type: bytes | None, method: bytes, http: bytes, grpc_status: int,
        no_tracebacks: pytest.LogCaptureFixture) -> None:
    async with _connected() as (_, client):
        stream = client.request(ECHO, content_type=content_type, method=method)
        client.send(stream, HI, end=True)
        await client.until(lambda: client.ended(stream))
        assert (client.headers(stream)[b":status"], client.status(stream)) == (http, grpc_status)
        assert await _echoes(client)


async def test_a_refused_header_value_cannot_forge_a_log_line(no_tracebacks: pytest.LogCaptureFixture) -> None:
    """h2 does not check inbound headers here (docs/decisions.md): the refusal shows a line break escaped."""
    async with _connected() as (_, client):
        client.h2.config.validate_outbound_headers = False  # send what a well-behaved client would not
        stream = client.request(ECHO, content_type=b"text/plain\r\n2026-12-03 ERROR extproc: forged")
        client.send(stream, HI, end=True)
        await client.until(lambda: client.ended(stream))
        assert (client.headers(stream)[b":status"], client.status(stream)) == (b"415", INVALID_ARGUMENT)
        (line,) = [r.getMessage() for r in no_tracebacks.records if "content-type" in r.getMessage()]
        assert "\n" not in line and "\r" not in line and 'text/plain\\x0d\\x0a2026' in line
        assert await _echoes(client)


async def test_a_connection_window_update_walks_the_waiting_calls_not_every_call() -> None:
    """With many held streams, WINDOW_UPDATEs in bulk cost what they cost with none (they walked every call).

    The cost is counted, not timed: the Python calls made (the server's and this client's, on this loop) while
    the updates and a ping behind them go through; a clock would measure the machine's load as well."""
    handlers = Handlers()
    updates = WindowUpdateFrame(0, window_increment=1).serialize() * 5_000
    # Far past the WINDOW_UPDATE limit (test_h2grpc_flood.py): lifted, to time the walk alone (one DATA frame
    # sent allows a million of them).
    async with _connected(handlers, max_inbound_window_update_frames_per_data_frame_sent=10**6) as (_, client):
        assert await _echoes(client)

        async def behind_updates() -> int:
            before, counted = len(client.events), 0

            def count(frame: types.FrameType, event: str, arg: object) -> None:
                nonlocal counted
                counted += event == "call"

            sys.setprofile(count)
            try:
                client.write(updates + PingFrame(0, opaque_data=b"abcdefgh").serialize())
                await client.until(lambda: any(type(e).__name__ == "PingAckReceived" for e in client.events[before:]))
            finally:
                sys.setprofile(None)
            return counted

        alone = min([await behind_updates() for _ in range(3)])
        for _ in range(3_000):
            client.send(client.request(HOLD), HI)
        await client.until(lambda: handlers.holding == 3_000, timeout=30)
        held = min([await behind_updates() for _ in range(3)])
        assert held < 2 * alone, (held, alone)  # walking the 3,000 calls per update: millions more


async def test_garbage_floods_and_rapid_resets_cost_no_traceback(no_tracebacks: pytest.LogCaptureFixture) -> None:
    async with _serving(Handlers()) as served:
        bystander = await served.connect()
        garbage = await served.connect()
        resetting = await served.connect()
        held = await _held(bystander)
        garbage.write(b"\x00\x00\x08\x07\x00\x00\x00\x00\x01" + b"\xff" * 4096)  # a GOAWAY on stream 1, and noise
        await garbage.until(lambda: garbage.eof)
        for _ in range(1_000):  # open and reset at once: past the premature resets' limit (test_h2grpc_flood.py)
            stream = resetting.request(HOLD)
            resetting.h2.reset_stream(stream, h2.errors.ErrorCodes.CANCEL)
        resetting.flush()
        await resetting.until(lambda: resetting.eof)
        assert [g.error_code for g in resetting.goaways()] == [h2.errors.ErrorCodes.ENHANCE_YOUR_CALM]
        await bystander.until(lambda: served.server.calls() == 1)  # only the bystander's stream is left
        assert await _echoes(bystander)
        bystander.send(held, b"", end=True)
        await bystander.until(lambda: bystander.ended(held))
        assert bystander.status(held) == OK


def test_warnings_are_one_per_peer_per_window_and_count_the_rest(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    warnings = PeerWarnings(every_s=10.0, clock=lambda: now[0])
    caplog.set_level(logging.WARNING)
    for _ in range(5):
        warnings.warn(("10.0.0.1", 1234), "bad %s", "frame")
    warnings.warn(("10.0.0.2", 99), "bad %s", "frame")
    now[0] = 10.5
    warnings.warn(("10.0.0.1", 555), "bad %s", "frame")
    assert [r.getMessage() for r in caplog.records] == [
        "peer 10.0.0.1: bad frame", "peer 10.0.0.2: bad frame",
        "peer 10.0.0.1: bad frame (4 more from this peer not logged)",
    ]

