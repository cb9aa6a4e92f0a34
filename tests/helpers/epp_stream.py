"""What other test modules share of test_epp_stream.py's: BUFFERED, DUPLEX, answers, body, chat, first_message,
send (written for its tests).
"""

from __future__ import annotations

import json

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2

from tests.helpers.processor import Stream, settle

DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED


BUFFERED = processing_mode_pb2.ProcessingMode.BUFFERED


def first_message(mode: int | None, headers: dict[str, str] | None = None, subset: list[str] | None = None,
                  body_follows: bool = True) -> pb.ProcessingRequest:
    """The request headers as Envoy sends them, declaring ``mode`` for both bodies (None: as Envoy before 1.34, none)."""
    pairs = {":method": "POST", ":path": "/v1/chat/completions", **(headers or {})}
    message = pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(
            headers=base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]),
            end_of_stream=not body_follows,
        ),
    )
    if mode is not None:
        message.protocol_config.CopyFrom(pb.ProtocolConfiguration(request_body_mode=mode, response_body_mode=mode))
    if subset is not None:
        hint = struct_pb2.Struct()
        hint.update({"x-gateway-destination-endpoint-subset": subset})
        message.metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(hint)
    return message


def body(data: bytes, end: bool = True) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=data, end_of_stream=end))


def chat(model: str = "base", **extra: object) -> bytes:
    return json.dumps({"model": model, "messages": [{"role": "user", "content": "hi" * 50}], **extra}).encode()


async def answers(stream: Stream) -> list[pb.ProcessingResponse]:
    await settle()
    out = []
    while not stream.answers.empty():
        out.append(stream.answers.get_nowait())
    return out


def send(stream: Stream, message: pb.ProcessingRequest) -> None:
    stream.send(message)
