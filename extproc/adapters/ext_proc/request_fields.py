"""What the scheduler needs from a request's body, from either of the two places it can come from.

Behind our own Envoy config, Envoy's json_to_metadata filter copies the fields
into dynamic metadata (namespace ``extproc``) and the prompt never reaches
Python: the fast path. Attached by ext_proc alone (a Gateway API Inference
Extension gateway, docs/epp.md), there is no such filter, so the body comes
on the stream and is read here. Both roads end in the same
:class:`RequestFields`, so admission does not care which one a request took.

Reading a body decodes only the few fields named in :class:`_Wanted`: msgspec
skips every other key (the messages, tools, images) without building them.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import msgspec
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.adapters.ext_proc.contract import METADATA_NAMESPACE
from extproc.core.outcomes import Refusal, Refused

# The body's output limits, in the order they are read: the later one wins (as in vLLM).
LIMIT_FIELDS = ("max_tokens", "max_completion_tokens")


@dataclass(frozen=True)
class RequestFields:
    """The body's scheduling inputs, each as the client wrote it (None: absent)."""

    model: str | None = None
    # Each output-limit field present, with its JSON value (checked by max_tokens()).
    limits: tuple[tuple[str, Any], ...] = ()
    prompt_cache_key: str | None = None
    # The body's `priority`: a class name, or the engine's integer priority.
    priority: Any = None


class _Wanted(msgspec.Struct):
    model: Any = None
    max_tokens: Any = None
    max_completion_tokens: Any = None
    prompt_cache_key: Any = None
    priority: Any = None


_decoder = msgspec.json.Decoder(_Wanted)
# Metadata values read as what they are; any other kind (Envoy drops lists and objects) by its name.
_SCALARS = ("string_value", "number_value", "bool_value")


@dataclass(frozen=True)
class _Other:
    """A metadata value of a kind no field takes (a list, an object, null): shown by its kind."""

    kind: str


def from_metadata(request: pb.ProcessingRequest) -> RequestFields | None:
    """The fields json_to_metadata put into our namespace; None when Envoy put none there (no such filter)."""
    namespace = request.metadata_context.filter_metadata.get(METADATA_NAMESPACE)
    if namespace is None:
        return None
    fields = namespace.fields

    def value(name: str) -> Any:
        if name not in fields:
            return None
        item = fields[name]
        kind = item.WhichOneof("kind")
        return getattr(item, kind) if kind in _SCALARS else _Other(str(kind))

    limits = {f: value(f) for f in LIMIT_FIELDS if f in fields}
    return _fields(value("model"), limits, value("prompt_cache_key"), None)


def from_body(body: bytes) -> RequestFields:
    """The fields of a JSON body; raises Refused when it is not a JSON object."""
    try:
        wanted = _decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise Refused(Refusal.INVALID_BODY, f"the request body must be a JSON object: {exc}") from None
    limits = {f: getattr(wanted, f) for f in LIMIT_FIELDS if getattr(wanted, f) is not None}
    return _fields(wanted.model, limits, wanted.prompt_cache_key, wanted.priority)


def _fields(model: Any, limits: dict[str, Any], prompt_cache_key: Any, priority: Any) -> RequestFields:
    return RequestFields(
        model=model if isinstance(model, str) and model else None,
        limits=tuple(limits.items()),
        prompt_cache_key=prompt_cache_key if isinstance(prompt_cache_key, str) else None,
        priority=priority,
    )


def max_tokens(fields: RequestFields) -> float | None:
    """The output limit (``max_completion_tokens`` wins over ``max_tokens``, as in vLLM), or None.

    A string, a bool, a fraction, zero or a negative number is refused,
    naming the field, as OpenAI's API refuses it. A whole number too large for
    any context (``1e308``) is valid JSON and passes: the cost model clamps it.
    """
    limit = None
    for field, value in fields.limits:
        number = float(value) if isinstance(value, int | float) and not isinstance(value, bool) else math.nan
        if not (math.isfinite(number) and number >= 1 and number.is_integer()):
            raise Refused(Refusal.INVALID_MAX_TOKENS, f"{field} must be an integer >= 1, got {_shown(value)}",
                          param=field)
        limit = number
    return limit


def _shown(value: Any) -> str:
    """A value as the client wrote it, short (it goes into an error message)."""
    if isinstance(value, str):
        return json.dumps(value[:40])
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return f"{value:g}"
    if isinstance(value, _Other):
        return value.kind
    return type(value).__name__
