"""The ext_proc stream handler driven directly: admission and every way a hold can end."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2

from extproc.config import parse_config
from extproc.dispatcher import ModelDispatcher
from extproc.processor import Processor
from extproc.telemetry import Telemetry

CONFIG = parse_config(
    {"models": [{"name": "m", "endpoints": ["http://127.0.0.1:1"], "fallback_max_in_flight": 1}]}
)


def make_processor() -> tuple[Processor, ModelDispatcher]:
    telemetry = Telemetry()
    dispatcher = ModelDispatcher(CONFIG.models[0], CONFIG.priorities, telemetry)
    return Processor(CONFIG, {"m": dispatcher}, telemetry), dispatcher


def headers_message(tenant: str = "t", model: str | None = "m", priority: str = "") -> pb.ProcessingRequest:
    headers = [(":method", "POST"), (":path", "/v1/chat/completions"), ("x-tenant-id", tenant)]
    if priority:
        headers.append(("x-priority", priority))
    request = pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(
            headers=base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers])
        )
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
        self._inbox.put_nowait(first)
        self.answers: asyncio.Queue[pb.ProcessingResponse] = asyncio.Queue()
        self.task = asyncio.create_task(self._run(processor))

    async def _requests(self) -> AsyncIterator[pb.ProcessingRequest]:
        while (message := await self._inbox.get()) is not None:
            yield message

    async def _run(self, processor: Processor) -> None:
        async for answer in processor.Process(self._requests(), None):  # type: ignore[arg-type]
            await self.answers.put(answer)

    def close(self) -> None:
        """The response finished: Envoy half-closes the stream."""
        self._inbox.put_nowait(None)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_release_then_client_gone_before_continue_frees_the_slot() -> None:
    processor, dispatcher = make_processor()
    first = Stream(processor, headers_message())
    assert (await first.answers.get()).HasField("request_headers")  # released at once (fallback limit 1)
    second = Stream(processor, headers_message())
    assert (await second.answers.get()).HasField("override_message_timeout")  # held
    assert dispatcher.queued == 1
    first.close()
    # The first response finishes; the second is released — and its client leaves
    # in the same instant, before the stream could send CONTINUE.
    await asyncio.sleep(0)
    assert dispatcher.gate.in_flight == 1 and dispatcher.queued == 0
    second.task.cancel()
    await settle()
    assert dispatcher.gate.in_flight == 0
    assert dispatcher.queued == 0


async def test_queued_client_gone_leaves_the_queue() -> None:
    processor, dispatcher = make_processor()
    first = Stream(processor, headers_message())
    await first.answers.get()
    waiting = [Stream(processor, headers_message(tenant=f"t{i}")) for i in range(3)]
    for stream in waiting:
        await stream.answers.get()
    assert dispatcher.queued == 3
    waiting[1].task.cancel()
    await settle()
    assert dispatcher.queued == 2
    first.close()
    await settle()
    # The next in line (t0) is released; t1 is never released to a dead stream.
    assert (await waiting[0].answers.get()).HasField("request_headers")
    assert waiting[2].answers.empty() and dispatcher.queued == 1


@pytest.mark.parametrize(
    ("message", "status", "code"),
    [
        (headers_message(model=None), 400, "model_missing"),
        (headers_message(model="other"), 404, "model_not_found"),
    ],
)
async def test_rejections_are_immediate_json_answers(message: pb.ProcessingRequest, status: int, code: str) -> None:
    processor, dispatcher = make_processor()
    stream = Stream(processor, message)
    answer = await stream.answers.get()
    assert answer.immediate_response.status.code == status
    assert f'"code": "{code}"'.encode() in answer.immediate_response.body
    assert dispatcher.queued == 0 and dispatcher.gate.in_flight == 0
    samples = {s.labels["model"] for m in processor._telemetry.registry.collect() for s in m.samples
               if m.name == "extproc_rejected"}
    assert samples == {"(unknown)"}  # neither "other" nor "" became a label value


async def test_unknown_priority_falls_back_to_the_default_band() -> None:
    processor, _ = make_processor()
    headers = {"x-priority": "urgent!!"}
    assert processor.admit(headers, "m").band == CONFIG.priorities.index("standard")
    assert processor.admit({"x-priority": "Interactive"}, "m").band == 0
    assert processor.admit({}, "m").tenant == "anonymous"
