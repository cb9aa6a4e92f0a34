"""What every piece of the generated Envoy config shares: Duration text, addresses, the hold's timeouts.

The documents are plain dicts in Envoy's JSON mapping (what YAML bootstraps
are written in); tests parse each into Envoy's own protobuf messages
(``merge.bootstrap_message``), so a field Envoy's API lacks fails there.
"""

from __future__ import annotations

from typing import Any

from extproc.adapters.config import Config
from extproc.adapters.protocol.contract import HOLD_MARGIN_S, hold_timeout_for

Json = dict[str, Any]

TYPE = "type.googleapis.com/"
# A stream may be silent this long (a non-streamed generation sends nothing
# until it is done); raised further if the queue wait needs more.
MIN_IDLE_TIMEOUT_S = 600.0
# Time on top of the hold for the client to upload its body.
UPLOAD_MARGIN_S = 60.0
OVERWRITE = "OVERWRITE_IF_EXISTS_OR_ADD"


def duration(seconds: float) -> str:
    """Envoy's Duration text: `150s`, `0.5s`."""
    text = f"{seconds:.3f}".rstrip("0").rstrip(".")
    return f"{text}s"


def typed(type_name: str, **fields: Any) -> Json:
    """A ``typed_config``: the message's ``@type`` first, then its fields."""
    return {"@type": TYPE + type_name, **fields}


def header_values(headers: list[tuple[str, str]]) -> list[Json]:
    """``(name, value)`` pairs as HeaderValueOptions that replace what is there."""
    return [{"header": {"key": key, "value": value}, "append_action": OVERWRITE} for key, value in headers]


def hold_timeout_s(config: Config) -> float:
    """The longest the processor may hold a message (ext_proc max_message_timeout)."""
    return hold_timeout_for(max(config.longest_queue_wait_s(m) for m in config.models))


def idle_timeout_s(config: Config) -> float:
    return max(MIN_IDLE_TIMEOUT_S, hold_timeout_s(config) + HOLD_MARGIN_S)
