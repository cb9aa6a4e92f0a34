"""The ext_proc hop's floor: a processor that lets every request through at once.

The overhead benchmark's ``envoy+null`` path puts this behind the same
gateway Envoy as ``envoy+extproc`` (same filter, processing mode, metadata)
and on the same transport (builtin/server.py), so what the real processor adds above
it is the scheduler's, and what it adds to Envoy alone is the hop's own:
Envoy's ext_proc filter and one gRPC round trip. No config, queue or metrics.

Its reply to the request headers is CONTINUE with the one header the
generated routes match on (``x-model``, which the real processor sets on a
release) and the route cache cleared, built once; every other message gets
the empty reply of its phase. It also answers Envoy's gRPC health check, as
the real processor does.

Run as ``python -m extproc.tools.bench.null_processor HOST:PORT MODEL``.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.adapters.ext_proc.attach.replies import header, passed
from extproc.adapters.grpc.builtin.server import BuiltinServer
from extproc.adapters.grpc.health import Health
from extproc.adapters.grpc.transport import Method
from extproc.adapters.protocol.contract import MODEL_HEADER
from extproc.adapters.server import PROCESS_PATH
from extproc.tools.procs import ManagedProcess, ProcessStartError, log_tail


def continue_reply(model: str) -> pb.ProcessingResponse:
    """CONTINUE, routed to ``model``: the least our generated Envoy needs to send a request on."""
    common = pb.CommonResponse(header_mutation=pb.HeaderMutation(set_headers=[header(MODEL_HEADER, model)]),
                               clear_route_cache=True)
    return pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=common))


def methods(model: str) -> dict[str, Method]:
    reply = continue_reply(model)

    async def process(messages: AsyncIterator[pb.ProcessingRequest]) -> AsyncIterator[pb.ProcessingResponse]:
        async for message in messages:
            yield reply if message.HasField("request_headers") else passed(message)

    health = Health(lambda: True)
    health.start()
    return {PROCESS_PATH: Method(pb.ProcessingRequest.FromString, process), **health.methods()}


async def serve(address: str, model: str) -> None:
    host, _, port = address.rpartition(":")
    server = BuiltinServer(methods(model))
    await server.start(host, int(port))
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await server.stop(1.0)


async def start_null_processor(address: str, model: str, log: Path, timeout: float = 30.0) -> ManagedProcess:
    """This module in a child process, returned once ``address`` accepts connections."""
    argv = [sys.executable, "-m", __name__, address, model]
    with open(log, "ab") as out:
        process = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=asyncio.subprocess.STDOUT
        )
    child = ManagedProcess("null processor", process, log)
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.returncode is None:
        with contextlib.suppress(OSError):
            _, writer = await asyncio.open_connection(host, int(port))
            writer.close()
            return child
        await asyncio.sleep(0.05)
    await child.stop()
    raise ProcessStartError(f"null processor not listening on {address}:\n{log_tail(log)}")


if __name__ == "__main__":
    asyncio.run(serve(sys.argv[1], sys.argv[2]))
