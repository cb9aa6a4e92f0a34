"""Memory per held request on each gRPC transport (``listen.transport``): what a long queue costs.

Every request the processor holds is an open ext_proc stream, so a stream's
memory is a held request's. For each transport this starts the real
processor (``extproc serve``, with one simulator behind it and a gate that
releases one request per thousand seconds), opens ``n`` ext_proc streams on
one HTTP/2 connection from grpcio's C-core client, each sending the request
headers Envoy would send on our metadata fast path, and waits until the queue
stops growing. Per held = (processor RSS with them held − RSS before) / held,
as docs/reports/reliability.md measures it through Envoy; Envoy is left out here (its
share, about 54 KB a held request, does not depend on our transport), which
also keeps the run short. The processor's CPU while the streams arrived is
given per stream as well.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import yaml
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2

from extproc.adapters.config import load_config
from extproc.adapters.protocol.contract import METADATA_NAMESPACE
from extproc.tools.burst import holding_config, queued, rss_bytes
from extproc.tools.procs import cpu_seconds
from extproc.tools.stack import Stack, start_sim

TRANSPORTS = ("builtin", "grpcio")
HELD = 2_000  # streams held per transport in `extproc-dev bench` (10,000 in docs/reports/reliability.md's runs)
PROCESS = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
# The queue is taken as settled once its depth has not changed for this long.
SETTLE_S = 2.0


@dataclass(frozen=True)
class HeldResult:
    transport: str
    streams: int  # opened
    held: float  # queued when the RSS was read
    rss_idle: int
    rss_held: int
    cpu_s: float  # processor CPU from the first stream until the queue settled

    @property
    def per_held_bytes(self) -> float:
        return (self.rss_held - self.rss_idle) / max(self.held, 1)

    def summary(self) -> dict[str, float]:
        return {
            "streams": self.streams, "held": self.held,
            "rss_idle_mb": self.rss_idle / 2**20, "rss_held_mb": self.rss_held / 2**20,
            "kb_per_held": self.per_held_bytes / 1024,
            "cpu_us_per_stream": self.cpu_s * 1e6 / max(self.streams, 1),
        }


def headers_request(tenant: str, model: str) -> pb.ProcessingRequest:
    """The first message of an ext_proc stream as our generated Envoy config sends it (the model in metadata)."""
    headers = [(":method", "POST"), (":path", "/v1/chat/completions"), ("x-tenant-id", tenant)]
    request = pb.ProcessingRequest(request_headers=pb.HttpHeaders(
        headers=base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers])))
    fields = struct_pb2.Struct()
    fields.update({"model": model})
    request.metadata_context.filter_metadata[METADATA_NAMESPACE].CopyFrom(fields)
    return request


async def _settled(stack: Stack) -> float:
    depth, since = -1.0, time.monotonic()
    while time.monotonic() - since < SETTLE_S:
        await asyncio.sleep(0.25)
        now = await queued(stack)
        if now != depth:
            depth, since = now, time.monotonic()
    return depth


async def measure_held(workdir: Path, transport: str, n: int = HELD) -> HeldResult:
    """Hold ``n`` streams on the processor running ``transport``; its RSS before and with them held."""
    workdir.mkdir(parents=True, exist_ok=True)
    path = holding_config(workdir, hold_s=600, max_queued=max(n, 10_000))
    doc = yaml.safe_load(path.read_text())
    doc["listen"]["transport"] = transport
    path.write_text(yaml.safe_dump(doc))
    config = load_config(path)
    model = config.models[0]
    async with Stack(config, path, workdir) as stack:
        stack.sims.append(await start_sim(model, model.endpoints[0], workdir, ["--max-num-seqs", "1"]))
        processor = (await stack.start_processor()).process.pid
        await asyncio.sleep(1.0)  # the first scrapes, the loop-lag probe: idle means idle
        idle, cpu = rss_bytes(processor), cpu_seconds(processor)
        # Any: grpc-stubs type the aio channel's calls after the synchronous API's.
        channel: Any = grpc.aio.insecure_channel(config.listen.grpc)
        try:
            process = channel.stream_stream(PROCESS, request_serializer=pb.ProcessingRequest.SerializeToString,
                                            response_deserializer=pb.ProcessingResponse.FromString)
            calls = [process() for _ in range(n)]
            request = headers_request("bench", model.name)
            await asyncio.gather(*(call.write(request) for call in calls))
            held = await _settled(stack)
            result = HeldResult(transport, n, held, idle, rss_bytes(processor), cpu_seconds(processor) - cpu)
            for call in calls:
                call.cancel()
        finally:
            await channel.close()
    return result


async def run_held(workdir: Path, n: int = HELD, transports: tuple[str, ...] = TRANSPORTS) -> list[HeldResult]:
    """Each transport in turn, on its own processor."""
    return [await measure_held(workdir / transport, transport, n) for transport in transports]
