"""What other test modules share of test_prompt_prefix.py's: BODY, CHAT, SYSTEM, body_message, headers_message,
make (written for its tests).
"""

from __future__ import annotations

import json
from typing import Any

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2

from extproc.adapters.config import parse_config
from extproc.adapters.ext_proc.servicer import Processor
from extproc.adapters.runtime import build_runtimes
from extproc.adapters.telemetry import Telemetry
from extproc.core.dispatcher import Held, ModelDispatcher
from extproc.core.prefix import Prefix
from extproc.core.values.engine_load import EngineLoad

SYSTEM = "You are a careful assistant for the ACME support desk. " * 20  # ~1.1 KB: two 512-byte blocks and more


CHAT: dict[str, Any] = {
    "model": "m", "max_tokens": 50,
    "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Where is my order?"}],
}


def make(**model: Any) -> tuple[Processor, ModelDispatcher, list[Prefix]]:
    """A processor on an idle engine; the signatures it submits are recorded."""
    cfg = parse_config({"models": [{"name": "m", "endpoints": ["http://127.0.0.1:1"], **model}]})
    telemetry = Telemetry()
    runtimes = build_runtimes(cfg, telemetry)
    dispatcher = runtimes["m"].dispatcher
    dispatcher.record_scrape("http://127.0.0.1:1", EngineLoad(waiting=0, running=0), 0.0)
    submitted: list[Prefix] = []
    submit = dispatcher.submit

    def recording(*args: Any, **kwargs: Any) -> Held:
        submitted.append(kwargs["prefix"])
        return submit(*args, **kwargs)

    dispatcher.submit = recording  # type: ignore[method-assign]
    return Processor(cfg, runtimes, telemetry), dispatcher, submitted


def headers_message(body: bytes, metadata: dict[str, Any] | None = None) -> pb.ProcessingRequest:
    pairs = {":method": "POST", ":path": "/v1/chat/completions", "x-tenant-id": "t", "content-length": str(len(body))}
    request = pb.ProcessingRequest(request_headers=pb.HttpHeaders(
        headers=base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()])))
    fields = struct_pb2.Struct()
    fields.update({"model": "m", **(metadata or {})})
    request.metadata_context.filter_metadata["extproc"].CopyFrom(fields)
    return request


def body_message(body: bytes) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True))


BODY = json.dumps(CHAT).encode()
