"""The transport conformance suite: every implementation of transport.py's ``Transport``, attacked alike, behaves alike.

Each case runs against every server ``listen.transport`` can choose
(adapters/transports.py ``TRANSPORTS``: ``builtin``, ours, and ``grpcio``, the reference)
serving a small fake service, through real clients: grpcio's
C-core channel for conformance, and raw HTTP/2 with the ``h2`` library on
asyncio sockets (or bare bytes) for what no well-behaved client sends. What
is asserted is what a peer and the other peers can observe: the gRPC status,
the HTTP status, whether the connection lives on, whether other streams and
other connections still complete, how much the server lets a client push.
Where the two legitimately differ (a status message's text, whether an abusive
connection is closed or merely survived) the case says so and asserts what
matters. No log record at ERROR (a traceback) may come from anything a peer sends.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings
import pytest
from google.protobuf import wrappers_pb2
from hyperframe.frame import GoAwayFrame, PingFrame, SettingsFrame

from extproc.adapters.grpc.transport import MAX_MESSAGE_BYTES, Transport, TransportLimits
from extproc.adapters.transports import TRANSPORTS
from extproc.tools.procs import free_port
from tests.helpers.h2grpc import ECHO, HOLD, Handlers, tracebacks

pytestmark = pytest.mark.integration

Bytes = wrappers_pb2.BytesValue
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
OK, INTERNAL, RESOURCE_EXHAUSTED = 0, 13, 8
# Not a BytesValue: field 1 says 5 bytes follow, 2 do.
NOT_PROTOBUF = b"\x0a\x05ab"


@dataclass
class Served:
    transport: str
    server: Transport
    port: int
    handlers: Handlers
    channels: list[Any] = field(default_factory=list)

    def channel(self, *options: tuple[str, Any]) -> Any:
        """A grpcio channel (its own connection); Any: grpc-stubs type aio calls after the sync API."""
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{self.port}", options=[
            ("grpc.max_receive_message_length", 2**26), ("grpc.use_local_subchannel_pool", 1), *options])
        self.channels.append(channel)
        return channel

    async def serves(self) -> bool:
        """A new connection gets an echo: the server as a whole is alive."""
        channel = self.channel()
        try:
            reply = await asyncio.wait_for(unary(channel, ECHO)(Bytes(value=b"ok")), 10)
            return bool(reply.value == b"okok")
        finally:
            await channel.close()


@pytest.fixture(params=list(TRANSPORTS))
async def served(request: pytest.FixtureRequest, caplog: pytest.LogCaptureFixture) -> AsyncIterator[Served]:
    handlers = Handlers()
    server = TRANSPORTS[request.param](handlers.methods(ECHO, HOLD), TransportLimits())
    port = free_port()
    await server.start("127.0.0.1", port)
    it = Served(request.param, server, port, handlers)
    caplog.set_level(logging.WARNING)
    try:
        yield it
    finally:
        for channel in it.channels:
            await channel.close()
        await server.stop(0)
    # Nothing a peer sends may log at ERROR, grpcio's own logger included (grpcio_server.py turns its
    # ExecuteBatchError traceback, a reply to a client gone, into one warning).
    tracebacks = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not tracebacks, [r.getMessage() for r in tracebacks]


def unary(channel: Any, path: str, serializer: Callable[[Any], bytes] = Bytes.SerializeToString) -> Any:
    return channel.unary_unary(path, request_serializer=serializer, response_deserializer=Bytes.FromString)


def stream(channel: Any, path: str) -> Any:
    return channel.stream_stream(path, request_serializer=Bytes.SerializeToString,
                                 response_deserializer=Bytes.FromString)


def message(payload: bytes, flag: int = 0) -> bytes:
    """One length-prefixed gRPC message."""
    return bytes([flag]) + len(payload).to_bytes(4, "big") + payload


def echo_message(value: bytes) -> bytes:
    return message(Bytes(value=value).SerializeToString())


def request_headers(path: str = ECHO, content_type: str = "application/grpc", method: str = "POST"
                    ) -> list[tuple[bytes, bytes]]:
    return [(b":method", method.encode()), (b":scheme", b"http"), (b":path", path.encode()),
            (b":authority", b"localhost"), (b"content-type", content_type.encode()), (b"te", b"trailers")]


@dataclass
class StreamSeen:
    headers: dict[bytes, bytes] = field(default_factory=dict)
    data: bytearray = field(default_factory=bytearray)
    trailers: dict[bytes, bytes] = field(default_factory=dict)
    reset: int | None = None
    ended: bool = False

    @property
    def grpc_status(self) -> int | None:
        raw = self.trailers.get(b"grpc-status", self.headers.get(b"grpc-status"))
        return None if raw is None else int(raw)

    @property
    def done(self) -> bool:
        return self.ended or self.reset is not None


class RawClient:
    """An HTTP/2 client on the ``h2`` state machine over an asyncio socket, for frames no gRPC client sends."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, acknowledge: bool) -> None:
        self.reader, self.writer = reader, writer
        self.h2 = h2.connection.H2Connection(h2.config.H2Configuration(
            client_side=True, header_encoding=None, validate_outbound_headers=False,
            validate_inbound_headers=False, normalize_outbound_headers=False))
        self.acknowledge = acknowledge  # False: never open our receive windows (the zero-window client)
        self.streams: dict[int, StreamSeen] = {}
        self.goaway: int | None = None  # the server's GOAWAY error code
        self.closed = False  # the server closed the socket
        self.settled = False  # the server's SETTINGS arrived
        self.refused: h2.exceptions.ProtocolError | None = None  # what the server sent that this client refused

    @classmethod
    async def connect(cls, port: int, *, acknowledge: bool = True, window: int | None = None) -> RawClient:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        client = cls(reader, writer, acknowledge)
        if window is not None:
            client.h2.local_settings = h2.settings.Settings(
                client=True, initial_values={h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: window})
        client.h2.initiate_connection()
        client.flush()
        await client.pump(lambda: client.settled, timeout=5)
        return client

    def flush(self) -> None:
        data = self.h2.data_to_send()
        if data and not self.writer.is_closing():
            self.writer.write(data)

    def write_raw(self, data: bytes) -> None:
        """Bytes around the state machine (frames it would refuse to send, or GOAWAY while streams go on)."""
        self.flush()
        if not self.writer.is_closing():
            self.writer.write(data)

    def request(self, path: str = ECHO, body: bytes | None = None, end: bool = True, **headers: str) -> int:
        stream_id = self.h2.get_next_available_stream_id()
        self.streams[stream_id] = StreamSeen()
        self.h2.send_headers(stream_id, request_headers(path, **headers), end_stream=body is None and end)
        if body is not None:
            self.h2.send_data(stream_id, body, end_stream=end)
        self.flush()
        return stream_id

    async def pump(self, done: Callable[[], bool], timeout: float = 10) -> bool:
        """Read and handle frames until ``done()``, the connection's end or the timeout; returns ``done()``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not done() and not self.closed:
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            try:
                data = await asyncio.wait_for(self.reader.read(65_536), remaining)
            except TimeoutError:
                break
            except ConnectionError:  # reset by the server
                data = b""
            if not data:
                self.closed = True
                break
            self.handle(data)
        return done()

    def handle(self, data: bytes) -> None:
        try:
            events = self.h2.receive_data(data)
        except h2.exceptions.ProtocolError as exc:  # ours to refuse: the state machine cannot go on
            self.refused = exc
            self.closed = True
            return
        for event in events:
            seen = self.streams.setdefault(getattr(event, "stream_id", 0) or 0, StreamSeen())
            if isinstance(event, h2.events.ResponseReceived):
                seen.headers = dict(event.headers or ())
            elif isinstance(event, h2.events.TrailersReceived):
                seen.trailers = dict(event.headers or ())
            elif isinstance(event, h2.events.DataReceived):
                seen.data += event.data or b""
                if self.acknowledge and event.stream_id is not None:
                    self.h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            elif isinstance(event, h2.events.StreamEnded):
                seen.ended = True
            elif isinstance(event, h2.events.StreamReset):
                seen.reset = int(event.error_code) if event.error_code is not None else 0
            elif isinstance(event, h2.events.RemoteSettingsChanged):
                self.settled = True
            elif isinstance(event, h2.events.ConnectionTerminated):
                self.goaway = int(event.error_code) if event.error_code is not None else 0
        self.flush()

    async def answer(self, stream_id: int, timeout: float = 10) -> StreamSeen:
        await self.pump(lambda: self.streams[stream_id].done, timeout)
        return self.streams[stream_id]

    async def alive(self) -> bool:
        """This connection still serves: a new echo stream on it completes OK."""
        if self.closed or self.goaway is not None:
            return False
        try:
            stream_id = self.request(body=echo_message(b"again"))
        except h2.exceptions.ProtocolError:
            return False
        seen = await self.answer(stream_id)
        return seen.grpc_status == OK and bytes(seen.data) == echo_message(b"againagain")

    async def close(self) -> None:
        self.writer.close()
        try:
            await self.writer.wait_closed()
        except ConnectionError:
            pass


Connect = Callable[..., Awaitable[RawClient]]  # the raw fixture: RawClient.connect's keywords


@pytest.fixture
async def raw(served: Served) -> AsyncIterator[Connect]:
    opened: list[RawClient] = []

    async def connect(**kwargs: Any) -> RawClient:
        client: RawClient = await RawClient.connect(served.port, **kwargs)
        opened.append(client)
        return client

    yield connect
    for client in opened:
        await client.close()


async def settle(condition: Callable[[], bool], timeout: float = 10) -> bool:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition() and loop.time() < deadline:
        await asyncio.sleep(0.02)
    return condition()


def goaway(last_stream_id: int = 0, error_code: int = 0) -> bytes:
    return bytes(GoAwayFrame(0, last_stream_id=last_stream_id, error_code=error_code).serialize())


@pytest.mark.parametrize("transport", list(TRANSPORTS))
async def test_a_port_in_use_is_an_os_error(transport: str) -> None:
    """What ProcessorServer turns into ``listen.grpc: cannot bind ...`` (grpcio would share it with SO_REUSEPORT)."""
    port = free_port()
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port))
        holder.listen()
        with pytest.raises(OSError):
            await TRANSPORTS[transport]({}, TransportLimits()).start("127.0.0.1", port)


# --- conformance: per-stream failures stay in their stream -------------------------------------------------


async def test_invalid_protobuf_ends_that_stream_internal_and_the_connection_lives_on(served: Served) -> None:
    channel = served.channel()
    held = stream(channel, HOLD)()
    await held.write(Bytes(value=b"hi"))
    assert (await held.read()).value == b"held"
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await unary(channel, ECHO, serializer=lambda b: b)(NOT_PROTOBUF)
    assert raised.value.code() == grpc.StatusCode.INTERNAL  # the text differs (each says it could not decode)
    # Another stream on the same connection completes, and so do new ones.
    await held.done_writing()
    assert await held.code() == grpc.StatusCode.OK
    assert (await unary(channel, ECHO)(Bytes(value=b"x"))).value == b"xx"


async def test_oversized_message_is_resource_exhausted_and_the_connection_lives_on(served: Served) -> None:
    channel = served.channel()
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await unary(channel, ECHO)(Bytes(value=b"a" * (MAX_MESSAGE_BYTES + 1)))
    assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert (await unary(channel, ECHO)(Bytes(value=b"x"))).value == b"xx"


async def test_compressed_flag_without_grpc_encoding_ends_that_stream_with_the_same_status(
        served: Served, raw: Connect) -> None:
    client = await raw()
    seen = await client.answer(client.request(body=message(Bytes(value=b"z").SerializeToString(), flag=1)))
    # The reference: INTERNAL (RFC-less, but gRPC's spec: the flag needs a grpc-encoding).
    assert seen.grpc_status == INTERNAL, seen
    assert await client.alive()


async def test_truncated_message_then_end_stream_is_internal(served: Served, raw: Connect) -> None:
    client = await raw()
    whole = echo_message(b"0123456789" * 10)
    seen = await client.answer(client.request(body=whole[:20]))
    assert served.handlers.received == 0
    # The reference falls short here: C-core drops the partial message and ends the call OK (grpc-go and
    # grpc-java answer INTERNAL, as ours does).
    assert seen.grpc_status == (OK if served.transport == "grpcio" else INTERNAL), seen
    assert await client.alive()


@pytest.mark.parametrize("content_type,method", [
    ("text/plain", "POST"), ("application/json", "POST"), ("application/grpc-web", "POST"),
    ("application/grpc", "GET"),
])
async def test_non_grpc_requests_are_refused_as_the_reference_does(
        served: Served, raw: Connect, content_type: str, method: str) -> None:
    client = await raw()
    seen = await client.answer(client.request(body=echo_message(b"x"), content_type=content_type, method=method))
    if served.transport == "grpcio" and method == "POST":
        # The reference falls short here: C-core serves any content type as gRPC. The gRPC spec
        # (PROTOCOL-HTTP2.md) says 415, as grpc-go and ours answer.
        assert (seen.headers.get(b":status"), seen.grpc_status) == (b"200", OK), seen
    else:
        # Refused before any handler: a content type with HTTP 415; a GET with 405 or a reset
        # of the stream (C-core resets it, INTERNAL_ERROR).
        assert served.handlers.received == 0
        refused = seen.headers.get(b":status") == b"415" if method == "POST" else (
            seen.reset is not None or seen.headers.get(b":status") == b"405")
        assert refused and seen.grpc_status != OK, seen
    assert await client.alive()


# --- GOAWAY both ways ------------------------------------------------------------------------------------


async def test_client_goaway_racing_a_request(served: Served, raw: Connect) -> None:
    client = await raw()
    stream_id = client.request(body=echo_message(b"race"))
    client.write_raw(goaway())
    seen = await client.answer(stream_id)
    # The request sent before the GOAWAY is answered: a client's GOAWAY speaks of server-pushed streams.
    assert (seen.grpc_status, bytes(seen.data)) == (OK, echo_message(b"racerace")), seen
    assert await served.serves()


async def test_client_goaway_no_error_lets_open_streams_complete(served: Served, raw: Connect) -> None:
    client = await raw()
    ids = [client.request(HOLD, body=echo_message(b"hi"), end=False) for _ in range(3)]
    assert await client.pump(lambda: all(len(client.streams[i].data) > 0 for i in ids))
    client.write_raw(goaway())
    await asyncio.sleep(0.2)
    for stream_id in ids:
        client.h2.end_stream(stream_id)
    client.flush()
    await client.pump(lambda: all(client.streams[i].done for i in ids))
    assert [client.streams[i].grpc_status for i in ids] == [OK] * 3
    assert await settle(lambda: served.handlers.ended == 3)


# --- floods ----------------------------------------------------------------------------------------------


async def test_rapid_reset_cancels_every_handler_and_others_are_served(served: Served, raw: Connect) -> None:
    client = await raw()
    for _ in range(2_000):
        stream_id = client.request(HOLD, end=False)
        client.h2.reset_stream(stream_id)
    client.flush()
    await client.pump(lambda: False, timeout=1)
    assert await settle(lambda: served.server.calls() == 0 and served.handlers.running == 0)
    assert await served.serves()
    # The flooding connection itself: the reference may close it (it counts resets); either is fine.


async def test_stream_flood_stays_within_the_advertised_limit_and_every_handler_ends(
        served: Served, raw: Connect) -> None:
    client = await raw()
    limit = client.h2.remote_settings.max_concurrent_streams
    n = 3_000
    sent = 0
    for _ in range(n):
        stream_id = client.h2.get_next_available_stream_id()
        client.streams[stream_id] = StreamSeen()
        # Written around h2's own check of the server's limit: a flood does not ask.
        client.h2.send_headers(stream_id, request_headers(HOLD))
        client.h2.send_data(stream_id, echo_message(b"hi"))
        client.flush()
        sent += 1
        if sent % 500 == 0:
            await client.pump(lambda: False, timeout=0.05)
    await client.pump(lambda: False, timeout=2)
    assert served.handlers.received <= min(n, limit)
    assert await served.serves()
    await client.close()
    assert await settle(lambda: served.server.calls() == 0 and served.handlers.running == 0)


async def _bounded(client: RawClient) -> bool:
    """The connection still serves, or the server ended it (GOAWAY, close): asked in that order, since a server that
    is slow to count a flood (grpcio on a busy machine) may end the connection while the echo stream is on it."""
    return await client.alive() or client.closed or client.goaway is not None


async def _flood(served: Served, raw: Connect, frame: bytes, count: int) -> RawClient:
    client = await raw()
    client.write_raw(frame * count)
    # Others are served while the flood is handled (not read back here: the acks queue up in the socket).
    assert await served.serves()
    await client.pump(lambda: False, timeout=1)
    return client


async def test_ping_flood_does_not_stop_other_connections(served: Served, raw: Connect) -> None:
    client = await _flood(served, raw, bytes(PingFrame(0, opaque_data=b"12345678").serialize()), 20_000)
    # The reference answers pings and bounds abuse by closing (GOAWAY ENHANCE_YOUR_CALM); either way, not a crash.
    assert await _bounded(client)


async def test_settings_flood_does_not_stop_other_connections(served: Served, raw: Connect) -> None:
    settings = bytes(SettingsFrame(0, settings={SettingsFrame.INITIAL_WINDOW_SIZE: 65_535}).serialize())
    client = await _flood(served, raw, settings, 20_000)
    assert await _bounded(client)


async def test_header_bomb_never_reaches_a_handler(served: Served, raw: Connect) -> None:
    client = await raw()
    bomb = [(f"x-bomb-{i}".encode(), b"b" * 1_000) for i in range(1_000)]  # 1 MB of headers
    stream_id = client.h2.get_next_available_stream_id()
    client.streams[stream_id] = StreamSeen()
    client.h2.send_headers(stream_id, [*request_headers(HOLD), *bomb])
    client.h2.send_data(stream_id, echo_message(b"hi"))
    client.flush()
    await client.pump(lambda: client.streams[stream_id].done, timeout=5)
    assert served.handlers.received == 0
    seen = client.streams[stream_id]
    # Refused: the reference ends that stream RESOURCE_EXHAUSTED ("metadata size exceeds hard limit",
    # 16 KB) and the connection lives on; h2's HPACK decoder stops inside the block, so the builtin server can only
    # end the connection (GOAWAY). Either way no handler sees it and other connections are served.
    assert (seen.done and seen.grpc_status != OK) or client.closed or client.goaway is not None, seen
    assert await served.serves()


# --- garbage ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("garbage", [b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", bytes(range(256)) * 4])
async def test_garbage_instead_of_the_preface_closes_that_connection(served: Served, garbage: bytes) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", served.port)
    writer.write(garbage)
    try:
        await asyncio.wait_for(reader.read(), 10)  # everything until the server closes
    except ConnectionError:
        pass
    assert reader.at_eof()
    writer.close()
    assert await served.serves()


async def test_unknown_frames_are_ignored_and_a_malformed_frame_ends_the_connection(
        served: Served, raw: Connect) -> None:
    client = await raw()
    unknown = (8).to_bytes(3, "big") + bytes([0xFA, 0]) + (0).to_bytes(4, "big") + b"whatever"
    client.write_raw(unknown)
    assert await client.alive()
    # HEADERS on stream 0: a connection error (RFC 9113, 6.2). The builtin server says GOAWAY(PROTOCOL_ERROR) and
    # closes; the reference just closes. (DATA on stream 0, as much an error, the reference ignores.)
    headers_on_stream_0 = (4).to_bytes(3, "big") + bytes([0x1, 0x4]) + (0).to_bytes(4, "big") + b"oops"
    client.write_raw(headers_on_stream_0)
    await client.pump(lambda: False, timeout=3)
    assert client.closed and client.goaway in (None, 1), (client.closed, client.goaway)
    assert await served.serves()


async def test_slowloris_preface_does_not_block_other_connections(served: Served) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", served.port)

    async def dribble() -> None:
        for byte in PREFACE:
            writer.write(bytes([byte]))
            await asyncio.sleep(0.1)

    slow = asyncio.create_task(dribble())
    try:
        channel = served.channel()
        for _ in range(20):
            assert (await unary(channel, ECHO)(Bytes(value=b"x"))).value == b"xx"
        assert not slow.done()  # all twenty answered while the preface was still arriving
    finally:
        slow.cancel()
        writer.close()


async def test_zero_window_client_cannot_make_the_server_buffer_unboundedly(
        served: Served, raw: Connect) -> None:
    """It never reads replies (window 0, no updates) yet keeps sending echo requests."""
    client = await raw(acknowledge=False, window=0)
    attempt = 96 * 1024 * 1024
    pushed = await push(client, [client.request(body=None, end=False) for _ in range(2)],
                        echo_message(b"z" * (1024 * 1024 - 16)), attempt)
    assert await served.serves()
    # The reference stops reading a stream once its reply cannot go out: one message reached each
    # handler, and C-core took in 5-18 MiB a stream (measured), not all the client had to push.
    assert pushed < attempt / 2, f"{served.transport} accepted {pushed / 2**20:.1f} MiB of {attempt / 2**20:.0f}"


async def test_two_thousand_requests_from_a_client_that_opens_no_window_leave_no_traceback(
        served: Served, raw: Connect, caplog: pytest.LogCaptureFixture) -> None:
    """Its replies cannot be sent, then it leaves: grpcio's traceback for that is one warning line at most."""
    client = await raw(acknowledge=False, window=0)
    for _ in range(2_000):
        client.request(body=echo_message(b"x" * 100))
    await client.pump(lambda: False, timeout=1)
    await client.close()
    assert await settle(lambda: served.server.calls() == 0)
    assert await served.serves()
    assert tracebacks(caplog.records) == []
    assert len([r for r in caplog.records if "ExecuteBatchError" in r.getMessage()]) <= 1


async def push(client: RawClient, ids: list[int], body: bytes, attempt: int) -> int:
    """Send ``body`` on every stream, again and again, as fast as the server's windows let,
    until ``attempt`` bytes went out or nothing moved for 3 s; returns the bytes sent."""
    offset = dict.fromkeys(ids, 0)
    loop = asyncio.get_running_loop()
    stalled_since = loop.time()
    while sum(offset.values()) < attempt and loop.time() - stalled_since < 3:
        progressed = False
        for stream_id in ids:
            window = min(client.h2.local_flow_control_window(stream_id), client.h2.max_outbound_frame_size)
            start = offset[stream_id] % len(body)
            piece = body[start: start + window]
            if piece:
                client.h2.send_data(stream_id, piece)
                offset[stream_id] += len(piece)
                progressed = True
        client.flush()
        await client.writer.drain()
        await client.pump(lambda: False, timeout=0.01)
        if progressed:
            stalled_since = loop.time()
    return sum(offset.values())


# --- keepalive, big messages, many connections ----------------------------------------------------------


async def test_keepalive_pings_keep_the_connection_and_calls_work(served: Served) -> None:
    channel = served.channel(("grpc.keepalive_time_ms", 1000), ("grpc.keepalive_timeout_ms", 5000))
    held = stream(channel, HOLD)()
    await held.write(Bytes(value=b"hi"))
    assert (await held.read()).value == b"held"
    for _ in range(4):
        await asyncio.sleep(1)
        assert (await unary(channel, ECHO)(Bytes(value=b"k"))).value == b"kk"
    await held.done_writing()
    assert await held.code() == grpc.StatusCode.OK


async def test_a_three_megabyte_message_round_trips(served: Served) -> None:
    channel = served.channel()
    big = bytes(range(256)) * (3 * 4096)
    assert (await unary(channel, ECHO)(Bytes(value=big))).value == big * 2


async def test_a_burst_of_three_thousand_held_calls_on_one_connection_all_served(served: Served) -> None:
    """Envoy opens a burst's streams on the connections it has: none may be refused for arriving together."""
    channel = served.channel()
    calls = [stream(channel, HOLD)() for _ in range(3_000)]
    await asyncio.gather(*(call.write(Bytes(value=b"hi")) for call in calls))
    assert {r.value for r in await asyncio.gather(*(call.read() for call in calls))} == {b"held"}
    for call in calls:
        await call.done_writing()
    assert {await call.code() for call in calls} == {grpc.StatusCode.OK}
    assert await settle(lambda: served.handlers.ended == 3_000)


async def test_two_hundred_connections_each_with_a_held_call_all_complete(served: Served) -> None:
    channels = [served.channel() for _ in range(200)]
    calls = [stream(channel, HOLD)() for channel in channels]
    for call in calls:
        await call.write(Bytes(value=b"hi"))
    assert {r.value for r in await asyncio.gather(*(call.read() for call in calls))} == {b"held"}
    assert served.handlers.running == 200
    for call in calls:
        await call.done_writing()
    assert [await call.code() for call in calls] == [grpc.StatusCode.OK] * 200
    assert await settle(lambda: served.handlers.ended == 200)

