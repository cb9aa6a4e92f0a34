"""The ext_proc replies every attachment builds from: a header to set, the JSON error, a pass, and the request's headers read.

Messages only, no decision: which reply a stream gets is the servicer's and
its attachment's (``attach/``). An error's status, OpenAI-style body and
``Retry-After`` come from ``adapters/protocol/answers.py``, the table Envoy's own
answers use too.
"""

from __future__ import annotations

import json

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf import duration_pb2

from extproc.adapters.protocol.answers import ANSWERS, answer_headers, error_body, retry_after_s
from extproc.adapters.protocol.contract import QUEUE_WAIT_HEADER
from extproc.core.values.outcomes import Refused

_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


def header(name: str, value: str) -> base_pb2.HeaderValueOption:
    """``name: value``, replacing whatever the request carried."""
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=name, raw_value=value.encode()), append_action=_OVERWRITE
    )


def headers(*pairs: tuple[str, str]) -> list[base_pb2.HeaderValueOption]:
    """Each ``(name, value)`` of ``pairs`` as :func:`header` makes it: one call into this module for a reply's set."""
    return [header(name, value) for name, value in pairs]


def duration(seconds: float) -> duration_pb2.Duration:
    value = duration_pb2.Duration()
    value.FromMilliseconds(round(seconds * 1000))
    return value


def error_response(refused: Refused, status: int | None = None) -> pb.ProcessingResponse:
    """An OpenAI-style JSON error that Envoy sends to the client in place of the engine's answer."""
    body = error_body(refused.refusal, refused.message, refused.param)
    retry_after = retry_after_s(refused.refusal, refused.drain_s, refused.retry_in_s)
    headers = [header("content-type", "application/json"),
               *(header(key, value) for key, value in (*answer_headers(refused.refusal, retry_after), *refused.headers))]
    if refused.queue_wait_s is not None:
        headers.append(header(QUEUE_WAIT_HEADER, str(round(refused.queue_wait_s * 1000))))
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status or ANSWERS[refused.refusal].status),
            headers=pb.HeaderMutation(set_headers=headers),
            body=json.dumps(body).encode(),
            details=refused.refusal.value,
        )
    )


def models_response(names: list[str]) -> pb.ProcessingResponse:
    """``GET /v1/models`` answered from the configuration: the models this gateway routes."""
    body = {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "extproc"} for name in names]}
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=200),
            headers=pb.HeaderMutation(set_headers=[header("content-type", "application/json")]),
            body=json.dumps(body).encode(),
        )
    )


def passed(message: pb.ProcessingRequest) -> pb.ProcessingResponse:
    """A no-op answer to whatever phase Envoy sent (e.g. response trailers)."""
    phase = message.WhichOneof("request")
    if phase in ("request_headers", "response_headers"):
        return pb.ProcessingResponse(**{phase: pb.HeadersResponse()})
    if phase in ("request_body", "response_body"):
        return pb.ProcessingResponse(**{phase: pb.BodyResponse()})
    return pb.ProcessingResponse(**{phase: pb.TrailersResponse()})


def headers_of(message: pb.HttpHeaders) -> dict[str, str]:
    """The headers of a headers message, by name.

    Envoy sends the names in lower case (its header maps keep them so, as
    HTTP/2 requires): they are looked up as they come.
    """
    # Envoy fills raw_value (bytes); value is only used by older Envoys.
    return {h.key: (h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value)
            for h in message.headers.headers}


def content_length(headers: dict[str, str]) -> int | None:
    """The declared body size; None when absent (chunked) or not plain ASCII digits."""
    value = headers.get("content-length", "")
    return int(value) if value.isascii() and value.isdigit() else None
