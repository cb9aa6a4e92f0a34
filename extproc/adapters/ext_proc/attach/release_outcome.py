"""How a released request's engine answered, read from the response headers ext_proc is sent.

Envoy's router answers itself when it cannot get a response from the engine
(connection refused, reset before the response began, after its retries):
a local reply, 503 (or 502/504), without the ``x-envoy-upstream-service-time``
header the router puts on every response that came from upstream (checked
with Envoy 1.40, tests/stack/test_fault_engine.py). That is ``DOWN``: the gate
marks the endpoint down instead of refilling the slot at once, which would
turn a queue held for the engine's restart into a burst of errors.

An engine's own answer with one of its dialect's ``full_statuses`` says it
refused the request before starting it, because its own queue cap was
reached: vLLM (``QueueOverflowError``, ``MaxQueuedTokensError``: "The engine
is currently busy…") and SGLang ("The request queue is full.") answer 503,
TGI 429 ("Model is overloaded"). The route retries those
(adapters/envoy/routes.py), so one that reaches us is a refusal that
outlasted the retries. That is ``FULL``: backpressure, not death — the
endpoint stays up and its limit is cut. An engine that stops does not
answer 503: it stops listening (uvicorn and axum close their sockets
first), which Envoy reports as connection failures, read as ``DOWN``; so
is a 503 from an engine without a queue cap (llama.cpp's "Loading model").
Any other answer (200, a 400 for a bad body, a 500 on one request) shows a
live engine that took the request.
"""

from __future__ import annotations

from collections.abc import Mapping

from extproc.core.release.answer import Answer

# Set by Envoy's router on responses that came from the upstream, never on its own local replies.
UPSTREAM_TIME_HEADER = "x-envoy-upstream-service-time"


def engine_answer(headers: Mapping[str, str], full_statuses: frozenset[int]) -> Answer:
    """What the response headers say of the release: served, refused as full, or no engine."""
    status = headers.get(":status", "")
    from_upstream = UPSTREAM_TIME_HEADER in headers
    if from_upstream and status.isdigit() and int(status) in full_statuses:
        return Answer.FULL
    if from_upstream and status != "503":
        return Answer.SERVED
    return Answer.DOWN if status.startswith("5") else Answer.SERVED
