"""What other test modules share of test_budgets_processor.py's: request (written for its tests)."""

from __future__ import annotations

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2


def request(tenant: str = "t", max_tokens: int | None = 100, priority: str = "",
            length: int = 480, body: dict[str, bool] | None = None) -> pb.ProcessingRequest:
    """The request headers with our metadata: ``body``'s other fields as json_to_metadata writes them."""
    headers = [(":method", "POST"), (":path", "/v1/chat/completions"), ("x-tenant-id", tenant),
               ("content-length", str(length))]
    if priority:
        headers.append(("x-priority", priority))
    message = pb.ProcessingRequest(request_headers=pb.HttpHeaders(
        headers=base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers])))
    fields = struct_pb2.Struct()
    fields.update({"model": "m", **({"max_tokens": max_tokens} if max_tokens is not None else {})})
    fields.update(body or {})
    message.metadata_context.filter_metadata["extproc"].CopyFrom(fields)
    return message
