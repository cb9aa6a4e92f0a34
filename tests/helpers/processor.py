"""What other test modules share of test_processor.py's: CONFIG, Stream, headers_message, make_processor, settle
(written for its tests), and LateLoop, a loop lag to give a processor.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2

from extproc.adapters.config import parse_config
from extproc.adapters.ext_proc.loop_lag import LoopLag
from extproc.adapters.ext_proc.servicer import Processor
from extproc.adapters.runtime import ModelRuntime
from extproc.adapters.telemetry import Telemetry
from extproc.core.dispatcher import ModelDispatcher

CONFIG = parse_config(
    {"models": [{"name": "m", "endpoints": ["http://127.0.0.1:1"], "advanced": {"fallback_max_in_flight": 1}}]}
)


def make_processor(telemetry: Telemetry | None = None) -> tuple[Processor, ModelDispatcher]:
    """The processor of CONFIG and its one model's dispatcher; ``telemetry`` given: its metrics are read there."""
    telemetry = telemetry or Telemetry()
    runtime = ModelRuntime(CONFIG, CONFIG.models[0], telemetry)
    return Processor(CONFIG, {"m": runtime}, telemetry), runtime.dispatcher


def headers_message(tenant: str = "t", model: str | None = "m", priority: str = "") -> pb.ProcessingRequest:
    headers = [(":method", "POST"), (":path", "/v1/chat/completions"), ("x-tenant-id", tenant)]
    if priority:
        headers.append(("x-priority", priority))
    request = pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(
            headers=base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers])
        ),
        protocol_config=pb.ProtocolConfiguration(),  # the generated filter's: no body (Envoy 1.40 declares it)
    )
    if model is not None:
        fields = struct_pb2.Struct()
        fields.update({"model": model})
        request.metadata_context.filter_metadata["extproc"].CopyFrom(fields)
    return request


class Stream:
    """Envoy's side of one ext_proc stream: send messages, read answers, hang up."""

    def __init__(self, processor: Processor, first: pb.ProcessingRequest) -> None:
        self._inbox: asyncio.Queue[pb.ProcessingRequest | None] = asyncio.Queue()
        self.send(first)
        self.answers: asyncio.Queue[pb.ProcessingResponse] = asyncio.Queue()
        self.task = asyncio.create_task(self._run(processor))

    async def _requests(self) -> AsyncIterator[pb.ProcessingRequest]:
        while (message := await self._inbox.get()) is not None:
            yield message

    async def _run(self, processor: Processor) -> None:
        async for answer in processor.process(self._requests()):
            await self.answers.put(answer)

    def send(self, message: pb.ProcessingRequest) -> None:
        """Envoy's next message on the stream."""
        self._inbox.put_nowait(message)

    def close(self) -> None:
        """The response finished: Envoy half-closes the stream."""
        self._inbox.put_nowait(None)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


class LateLoop(LoopLag):
    """A loop that runs ``lag_s`` late, as under a burst, and has for ``late_for_s`` (0: one stall, now over)."""

    def __init__(self, lag_s: float, late_for_s: float = 0.0) -> None:
        super().__init__()
        self.lag_s = lag_s
        self.late_for_s = late_for_s

    def seconds(self, now: float) -> float:
        return self.lag_s

    def late_for(self, now: float) -> float:
        return self.late_for_s
