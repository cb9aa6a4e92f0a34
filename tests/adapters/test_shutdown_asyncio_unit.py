"""Every shutdown path of a ProcessorServer, in-process: asyncio's loop reports nothing, on either transport.

A raw HTTP/2 client (tests/h2raw.py) speaks as Envoy's ext_proc filter: it
holds requests in the queue and has batch requests released (a preemptible
release reads its stream in a task of its own until its response headers
come, servicer.py ``_until_preempted``). Then the server stops: idle, at the
hard deadline, on a second signal, after a graceful drain, with the client
gone (Envoy's half-close and reset at once), with streams mid-message, with a
stream ending inside a message, and with the client leaving as the server
closes. A loop exception handler collects what asyncio reports (a task whose
exception nobody retrieved, a task destroyed pending, an exception in a
callback); a gc pass at the end makes every task left behind report. A
coroutine never awaited warns, which pytest's filterwarnings=error fails.
The child-process version behind a real Envoy is tests/stack/test_shutdown_asyncio.py.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import h2.errors
import h2.events
import pytest
from aiohttp import web
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2, wrappers_pb2

from extproc.adapters.config import parse_config
from extproc.adapters.grpc.builtin.server import BuiltinServer
from extproc.adapters.grpc.transport import Message, Method
from extproc.adapters.server import PROCESS_PATH, ProcessorServer
from extproc.tools.procs import free_port
from tests.h2raw import RawClient, message
from tests.httputil import serving

pytestmark = pytest.mark.unit

# An idle engine's page, as vLLM writes it for model m.
PAGE = 'vllm:num_requests_running{model_name="m"} 0\nvllm:num_requests_waiting{model_name="m"} 0\n'
RELEASED, QUEUED = 2, 2  # the gate lets exactly RELEASED into the engine
PARTIAL = b"\0\0\0\0\x10abc"  # a length prefix promising 16 bytes, and 3 of them
# Only a bound on waiting for the server (which takes milliseconds), never a measurement.
PATIENCE_S = 60.0


async def until(done: Callable[[], bool]) -> None:
    deadline = asyncio.get_running_loop().time() + PATIENCE_S
    while not done():
        assert asyncio.get_running_loop().time() < deadline, "the server did not get there"
        await asyncio.sleep(0.005)


@asynccontextmanager
async def asyncio_reports() -> AsyncIterator[list[dict[str, Any]]]:
    """What the running loop reports to its exception handler inside the block, a gc pass included."""
    loop = asyncio.get_running_loop()
    reports: list[dict[str, Any]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: reports.append(context))
    try:
        yield reports
        for _ in range(3):  # let cancelled tasks finish, then make what was left behind report
            await asyncio.sleep(0)
        gc.collect()
    finally:
        loop.set_exception_handler(previous)


def engine() -> AbstractAsyncContextManager[str]:
    """An engine that only answers its /metrics (the requests never reach it: no Envoy here)."""
    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=PAGE)

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    return serving(app)


def headers_message(tenant: str, priority: str) -> bytes:
    headers = [(":method", "POST"), (":path", "/v1/chat/completions"), ("x-tenant-id", tenant), ("x-priority", priority)]
    request = pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers])))
    fields = struct_pb2.Struct()
    fields.update({"model": "m", "stream": True})  # streams: never taken back for the standard ones queued
    request.metadata_context.filter_metadata["extproc"].CopyFrom(fields)
    return message(request.SerializeToString())


class Envoy:
    """Envoy's ext_proc filter, as far as these tests need it: open a stream per request, read the replies."""

    def __init__(self, client: RawClient) -> None:
        self.client = client

    def open(self, tenant: str, priority: str) -> int:
        stream_id = self.client.request(PROCESS_PATH.encode())
        self.client.send(stream_id, headers_message(tenant, priority))
        return stream_id

    def replies(self, stream_id: int) -> list[pb.ProcessingResponse]:
        data = b"".join(e.data for e in self.client.of(stream_id) if isinstance(e, h2.events.DataReceived))
        out = []
        while len(data) >= 5:
            size = int.from_bytes(data[1:5], "big")
            out.append(pb.ProcessingResponse.FromString(data[5:5 + size]))
            data = data[5 + size:]
        return out

    def released(self, stream_id: int) -> bool:
        return any(r.HasField("request_headers") for r in self.replies(stream_id))

    def end_and_reset(self, stream_id: int) -> None:
        """What Envoy does when the client goes away: half-close the stream, then reset it, in one write."""
        self.client.h2.end_stream(stream_id)
        self.client.h2.reset_stream(stream_id, h2.errors.ErrorCodes.CANCEL)
        self.client.flush()


PATHS = ["idle", "hard_deadline", "second_signal", "drain", "client_gone", "mid_message", "truncated",
         "client_leaves_as_server_closes"]


@pytest.mark.parametrize("transport", ["builtin", "grpcio"])
@pytest.mark.parametrize("path", PATHS)
async def test_no_shutdown_path_leaves_asyncio_anything_to_report(path: str, transport: str) -> None:
    async with engine() as url, asyncio_reports() as reports:
        config = parse_config({
            "listen": {"grpc": f"127.0.0.1:{free_port()}", "metrics": f"127.0.0.1:{free_port()}", "transport": transport},
            "models": [{"name": "m", "endpoints": [url], "gate": "static_concurrency", "max_in_flight": RELEASED}],
        })
        server = ProcessorServer(config)
        await server.start()
        client = await RawClient.connect(int(config.listen.grpc.rpartition(":")[2]))
        try:
            await shut_down(server, Envoy(client), path)
        finally:
            await client.close()
        assert server.queued() == 0 and server.in_flight() == 0  # every request ended (its finally ran)
    assert [(r.get("message"), r.get("exception"), r.get("task") or r.get("future")) for r in reports] == []


async def shut_down(server: ProcessorServer, envoy: Envoy, path: str) -> None:
    """Hold and release requests as ``path`` needs, then stop the server that way."""
    if path == "idle":
        await server.drain_and_stop(0, 0)
        return
    released = [envoy.open(f"b{i}", "batch") for i in range(RELEASED)]
    await until(lambda: all(envoy.released(s) for s in released))
    queued = [envoy.open(f"s{i}", "standard") for i in range(QUEUED)]
    await until(lambda: server.queued() == QUEUED)
    if path == "client_gone":
        for stream_id in released:
            envoy.end_and_reset(stream_id)
        await until(lambda: all(envoy.released(s) for s in queued))  # the freed slots go to the queue
    elif path == "mid_message":
        for stream_id in released:
            envoy.client.send(stream_id, PARTIAL)
    elif path == "truncated":  # the server ends these streams itself (INTERNAL), the queue takes their slots
        for stream_id in released:
            envoy.client.send(stream_id, PARTIAL, end=True)
        await until(lambda: all(envoy.released(s) for s in queued))
    if path == "second_signal":
        force = asyncio.Event()
        stopping = asyncio.create_task(server.drain_and_stop(600, 600, force))
        await until(lambda: server.processor.draining)
        force.set()
        await stopping
    elif path == "drain":  # the graceful end: the queue answered, every released response ends
        stopping = asyncio.create_task(server.drain_and_stop(0, 600))
        await until(lambda: server.queued() == 0)
        for stream_id in released:
            envoy.client.send(stream_id, b"", end=True)
        await stopping
    elif path == "client_leaves_as_server_closes":
        stopping = asyncio.create_task(server.drain_and_stop(0, 0))
        await asyncio.sleep(0)
        envoy.client.goaway()
        await envoy.client.close()
        await stopping
    else:  # the hard deadline cuts what is released and still open
        await server.drain_and_stop(0, 0)


@pytest.mark.parametrize("end", ["reset", "connection_lost", "server_stopped"])
async def test_a_task_reading_a_call_the_transport_ends_is_cancelled_not_left_waiting(end: str) -> None:
    """The builtin server's guarantee, whatever a handler does: a reader of a call it ended (another task) ends too."""
    readers: list[asyncio.Task[Any]] = []

    async def handler(requests: AsyncIterator[Any]) -> AsyncIterator[Message]:
        readers.append(asyncio.ensure_future(anext(aiter(requests))))
        await asyncio.Event().wait()  # held until the transport cancels the handler
        yield wrappers_pb2.BytesValue()

    server = BuiltinServer({"/t.T/Read": Method(wrappers_pb2.BytesValue.FromString, handler)})
    port = free_port()
    await server.start("127.0.0.1", port)
    client = await RawClient.connect(port)
    try:
        stream_id = client.request(b"/t.T/Read")
        await until(lambda: len(readers) == 1)
        if end == "reset":
            client.h2.reset_stream(stream_id, h2.errors.ErrorCodes.CANCEL)
            client.flush()
        elif end == "connection_lost":
            await client.close()
        await server.stop(0)
        await asyncio.wait(readers, timeout=PATIENCE_S)
    finally:
        await client.close()
    assert [reader.cancelled() for reader in readers] == [True]
