"""Whether a released request reached a live engine, read from the response headers ext_proc is sent.

Envoy's router answers itself when it cannot get a response from the engine
(connection refused, reset before the response began, after its retries):
a local reply, 503 (or 502/504), without the ``x-envoy-upstream-service-time``
header the router puts on every response that came from upstream (checked
with Envoy 1.40, tests/test_fault_engine.py). A 503 that does carry it is the
engine's own: overloaded or shutting down. Both are release failures: the
gate marks the endpoint down instead of refilling the slot at once, which
would turn a queue held for the engine's restart into a burst of errors.
Any other answer (200, a 400 for a bad body, a 500 on one request) shows a
live engine.
"""

from __future__ import annotations

from collections.abc import Mapping

# Set by Envoy's router on responses that came from the upstream, never on its own local replies.
UPSTREAM_TIME_HEADER = "x-envoy-upstream-service-time"


def engine_answered(headers: Mapping[str, str]) -> bool:
    """False when the response headers say the engine was unreachable or refused the work (503)."""
    status = headers.get(":status", "")
    if status == "503":
        return False
    from_upstream = UPSTREAM_TIME_HEADER in headers
    return from_upstream or not status.startswith("5")
