"""Whatever Envoy answers itself, rewritten to the processor's OpenAI-style JSON error with a reason header.

Envoy's own replies (an auth filter's 401, an unreachable engine, timeouts,
a body too large) are plain text or empty; OpenAI clients expect the error
object and operators the reason header. The HTTP connection manager's
``local_reply_config`` matches each kind and rewrites it; status, error type
and Retry-After are the reason's (``adapters/protocol/answers.py``).
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass

from extproc.adapters.envoy.base import Json, header_values, typed
from extproc.adapters.protocol.answers import ANSWERS, answer_headers, error_body, retry_after_s
from extproc.adapters.protocol.contract import REASON_HEADER
from extproc.core.values.outcomes import Refusal


@dataclass(frozen=True)
class LocalReply:
    """One kind of answer Envoy gives itself."""

    reason: Refusal  # the error's ``code`` and the reason header
    match: Json  # an access-log filter (status, response flags or CEL on the details)
    message: str  # an Envoy format string


def _status_is(refusal: Refusal) -> Json:
    code = ANSWERS[refusal].status
    value = {"default_value": code, "runtime_key": f"extproc.local_reply.status_{code}"}
    return {"status_code_filter": {"comparison": {"op": "EQ", "value": value}}}


def _status_at_least(refusal: Refusal) -> Json:
    code = ANSWERS[refusal].status
    value = {"default_value": code, "runtime_key": f"extproc.local_reply.status_ge_{code}"}
    return {"status_code_filter": {"comparison": {"op": "GE", "value": value}}}


def _flags(*flags: str) -> Json:
    return {"response_flag_filter": {"flags": list(flags)}}


def cel(expression: str) -> Json:
    """An access-log filter on a CEL expression."""
    return {
        "extension_filter": {
            "name": "envoy.access_loggers.extension_filters.cel",
            "typed_config": typed("envoy.extensions.access_loggers.filters.cel.v3.ExpressionFilter",
                                  expression=expression),
        }
    }


# The processor's own answers carry the reason header and are JSON already:
# the first mapper matches them and leaves them as they are.
_PROCESSOR_ANSWER = cel(f"'{REASON_HEADER}' in response.headers")
# Tried in order after that; the first that matches wins. ext_proc's failures
# (no response flag) are told apart by their details, the router's upstream
# failures by their response flags.
LOCAL_REPLIES = (
    LocalReply(Refusal.UNAUTHENTICATED, _status_is(Refusal.UNAUTHENTICATED), "%LOCAL_REPLY_BODY%"),
    LocalReply(Refusal.PERMISSION_DENIED, _status_is(Refusal.PERMISSION_DENIED), "%LOCAL_REPLY_BODY%"),
    # The admission bucket (local_ratelimit), circuit breakers (UO) or Envoy's overload manager (OM) shedding load.
    LocalReply(
        Refusal.OVERLOADED,
        # local_ratelimit sets no response flag its filter could match (checked on Envoy 1.40): its details.
        {"or_filter": {"filters": [cel("response.code_details == 'local_rate_limited'"), _flags("UO", "OM")]}},
        "The gateway is overloaded; retry shortly.",
    ),
    LocalReply(Refusal.ENGINE_UNAVAILABLE, _flags("UF", "UH", "URX", "UR", "UC", "NC"),
               "The model server is unavailable; retry shortly."),
    LocalReply(Refusal.UPSTREAM_TIMEOUT, _flags("UT"), "The model server did not answer in time."),
    LocalReply(Refusal.REQUEST_TIMEOUT, _status_is(Refusal.REQUEST_TIMEOUT), "The request timed out at the gateway."),
    LocalReply(Refusal.REQUEST_TOO_LARGE, _status_is(Refusal.REQUEST_TOO_LARGE),
               "The request body is larger than the gateway accepts."),
    LocalReply(Refusal.MODEL_NOT_FOUND, _status_is(Refusal.MODEL_NOT_FOUND),
               "The requested model does not exist on this server."),
    # Anything else: Envoy's details name the cause (its body may be empty).
    LocalReply(Refusal.GATEWAY_ERROR, _status_at_least(Refusal.GATEWAY_ERROR),
               "The gateway could not complete the request (%RESPONSE_CODE_DETAILS%)."),
    LocalReply(Refusal.BAD_REQUEST, _status_at_least(Refusal.BAD_REQUEST),
               "The gateway refused the request (%RESPONSE_CODE_DETAILS%)."),
)


def _mapper(reply: LocalReply) -> Json:
    return {
        "filter": copy.deepcopy(reply.match),
        "body_format_override": {"json_format": error_body(reply.reason, reply.message)},
        "headers_to_add": header_values(answer_headers(reply.reason, retry_after_s(reply.reason))),
    }


def local_reply_config() -> Json:
    """HCM ``local_reply_config``: every answer Envoy gives itself as the OpenAI-style JSON error."""
    # Copies: each document owns its dicts (protobuf's ParseDict reorders the keys of what it reads).
    return {"mappers": [{"filter": copy.deepcopy(_PROCESSOR_ANSWER)}, *(_mapper(reply) for reply in LOCAL_REPLIES)]}


def direct_reply(refusal: Refusal, message: str) -> Json:
    """A catch-all route's answer: Envoy's own OpenAI-style error, the route named by the reason."""
    headers = [("content-type", "application/json"), *answer_headers(refusal, retry_after_s(refusal))]
    body = json.dumps(error_body(refusal, message), separators=(",", ":"))
    return {
        "name": refusal.value,
        "match": {"prefix": "/"},
        "direct_response": {"status": ANSWERS[refusal].status, "body": {"inline_string": body}},
        "response_headers_to_add": header_values(headers),
    }
