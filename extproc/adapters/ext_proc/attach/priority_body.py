"""Writing the engine priority into a request body (``engine_priority: true`` models).

vLLM started with ``--scheduling-policy priority`` orders its waiting queue by
the body's ``priority`` (an integer, lower first, default 0) and, when its KV
cache runs short, preempts the running request with the highest value first.
The band decides the value; whatever the client wrote is replaced, so a client
cannot raise its own priority inside the engine.

When the text ``"priority"`` appears nowhere in the body, the field is
inserted right after the opening brace: the client's bytes stay as they were
and no object tree of a long prompt is built. Otherwise the body is parsed
and rewritten. Either way costs about 2.5 ms per MB of body (measured), on
the processor's event loop, for these models only.
"""

from __future__ import annotations

import json

_KEY = b'"priority"'


def with_priority(body: bytes, priority: int) -> bytes | None:
    """``body`` with its top-level ``priority`` set; None if it is not a JSON object."""
    start = len(body) - len(body.lstrip())
    if not body[start:start + 1] == b"{":
        return None
    if _KEY not in body:
        rest = body[start + 1:].lstrip()
        separator = b"" if rest.startswith(b"}") else b","
        return body[:start + 1] + b'"priority":%d' % priority + separator + body[start + 1:]
    try:
        document = json.loads(body)
    except ValueError:
        return None
    if not isinstance(document, dict):
        return None
    document["priority"] = priority
    return json.dumps(document, ensure_ascii=False, separators=(",", ":")).encode()
