"""What the generated Envoy config and the processor must agree on: names, the processing mode, the hold.

Kept in one light module (no gRPC import) so that the Envoy config generator,
the processor and the clients read the same facts.
"""

import math
from types import MappingProxyType

# The gRPC service the processor serves; its gRPC health status (grpc.health.v1)
# turns NOT_SERVING while the processor drains, and Envoy's health check asks for it.
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
# Dynamic-metadata namespace that Envoy's json_to_metadata filter writes the body fields into.
METADATA_NAMESPACE = "extproc"
# A string in that namespace an operator's own filter may fill with a request's leading
# prompt text: hashed as it is (request/prompt_prefix.py), so such a model's body need not be sent.
PROMPT_PREFIX_FIELD = "prompt_prefix"
# Where budgets are on, json_to_metadata also writes the body's `stream` and `stream_options.include_usage` there:
# whether the engine's usage comes in one JSON answer, at a stream's end, or not at all (engine_usage.py); and
# where a model checks its streams' first event (stream_start.py), whether the response is a stream.
STREAM_FIELD = "stream"
INCLUDE_USAGE_FIELD = "include_usage"
# Set by the processor on released requests, from the body's model (anything a client sent is
# removed by Envoy first): the generated Envoy's routes, and deploy/'s manifests, match on it.
MODEL_HEADER = "x-model"
# Set by the processor on released requests; Envoy copies it onto the response
# (ext_proc itself skips response headers), so clients and logs see the wait.
QUEUE_WAIT_HEADER = "x-extproc-queue-wait-ms"
# On the processor's own answers: why it answered instead of the engine.
REASON_HEADER = "x-extproc-reason"
# Gateway API Inference Extension convention: the endpoint picked for a request
# (HOST:PORT); Envoy routes requests carrying it to an ORIGINAL_DST cluster.
DESTINATION_HEADER = "x-gateway-destination-endpoint"
# Set by the batch runner on each line it sends (``<batch id>/<line>``, adapters/batches/sender.py) and kept
# only on Envoy's runner listener: the processor's decision entry for the request names the batch line.
BATCH_LINE_HEADER = "x-extproc-batch-line"

# The ext_proc processing mode: the request headers in, and the response
# trailers, which keep the stream open until the response is done (completion
# seen without per-chunk messages). The response headers, whose status tells
# a live engine from a failed release (release_outcome.py), cost one more
# message each: the processor asks for them (mode_override) only on the
# releases it checks (core/release/health.py: a sample, and every release to
# an endpoint just back up). adapters/envoy/filters.py writes it into the filter;
# the processor's overrides are the same with the request body buffered
# (engine_priority models) and/or the response headers sent (an override
# replaces the whole mode).
PROCESSING_MODE = MappingProxyType({
    "request_header_mode": "SEND",
    "response_header_mode": "SKIP",
    "request_body_mode": "NONE",
    "response_body_mode": "NONE",
    "request_trailer_mode": "SKIP",
    "response_trailer_mode": "SEND",
})

# While it holds a request the processor extends Envoy's per-message timeout
# (override_message_timeout) to the request's longest queue wait plus this
# margin, and the generated filter allows up to the longest wait of any model
# plus it (max_message_timeout): the processor answers a timed-out request
# itself, well before Envoy would give up on it.
HOLD_MARGIN_S = 30


def hold_timeout_for(longest_wait_s: float) -> float:
    """How long Envoy waits for the answer to a request that may be queued ``longest_wait_s``.

    Whole milliseconds, rounded down, so a model's own hold never exceeds the
    filter's maximum (Envoy ignores an override above it).
    """
    return math.floor((longest_wait_s + HOLD_MARGIN_S) * 1000) / 1000
