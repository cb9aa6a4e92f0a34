"""What the scheduler needs from a request's body, from either of the two places it can come from.

Behind our own Envoy config, Envoy's json_to_metadata filter copies the fields
into dynamic metadata (namespace ``extproc``) and the prompt never reaches
Python: the fast path. Attached by ext_proc alone (a Gateway API Inference
Extension gateway, docs/epp.md), there is no such filter, so the body comes
on the stream and is read here. Both roads end in the same
:class:`RequestFields`, so admission does not care which one a request took.

Reading a body decodes only the few fields named in :class:`_Wanted`: msgspec
skips every other key (tools, images) without building them. The prompt
(``messages`` or ``prompt``) is kept as it is, an undecoded slice of the body
(:class:`Prompt`): only a model with prefix signatures reads it
(prompt_prefix.py), so one pass over the body serves both.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from typing import Any

import msgspec
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2

from extproc.adapters.protocol.contract import (
    INCLUDE_USAGE_FIELD,
    METADATA_NAMESPACE,
    PROMPT_PREFIX_FIELD,
    STREAM_FIELD,
)
from extproc.core.values.outcomes import Refusal, Refused

# The body's output limits, in the order they are read: the later one wins (as in vLLM).
LIMIT_FIELDS = ("max_tokens", "max_completion_tokens")


@dataclass(frozen=True, slots=True)
class RequestFields:
    """The body's scheduling inputs, each as the client wrote it (None: absent)."""

    model: str | None = None
    # Each output-limit field present, with its JSON value (checked by max_tokens()).
    limits: tuple[tuple[str, Any], ...] = ()
    prompt_cache_key: str | None = None
    # The body's `priority`: a class name, or the engine's integer priority.
    priority: Any = None
    # The body's `stream` and `stream_options.include_usage` are true: the answer is a stream (it cannot be taken
    # back once the engine accepts it), whose last event carries the engine's usage (engine_usage.py; read only where
    # budgets are on: json_to_metadata's rules).
    stream: bool = False
    include_usage: bool = False


NO_FIELDS = RequestFields()

# A Raw field captures any value, null included; absent, it stays empty (b"").
_ABSENT = msgspec.Raw()


class Prompt(msgspec.Struct, frozen=True):
    """A request's prompt as it came: undecoded slices of the body, or the text a metadata field carries.

    Kept apart from :class:`RequestFields` so that a held request does not keep
    its body alive through them (the servicer drops it once signed).
    """

    # The body's `messages` (chat) and `prompt` (completions), each as written (empty: absent).
    messages: msgspec.Raw = _ABSENT
    prompt: msgspec.Raw = _ABSENT
    # The leading text an operator's filter put into metadata (`prompt_prefix`), if any.
    text: bytes | None = None


NO_PROMPT = Prompt()


class _Wanted(msgspec.Struct):
    model: Any = None
    max_tokens: Any = None
    max_completion_tokens: Any = None
    prompt_cache_key: Any = None
    priority: Any = None
    stream: Any = None
    stream_options: Any = None
    messages: msgspec.Raw = _ABSENT
    prompt: msgspec.Raw = _ABSENT


class _PromptOnly(msgspec.Struct):
    messages: msgspec.Raw = _ABSENT
    prompt: msgspec.Raw = _ABSENT


_decoder = msgspec.json.Decoder(_Wanted)
_prompt_decoder = msgspec.json.Decoder(_PromptOnly)
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
    # get(), once per field: indexing a map of messages with a missing key would add it.
    fields = namespace.fields
    limits = {f: _value(item) for f in LIMIT_FIELDS if (item := fields.get(f)) is not None}
    found = _fields(_value(fields.get("model")), limits, _value(fields.get("prompt_cache_key")), None)
    stream = fields.get(STREAM_FIELD)
    if stream is None or not stream.bool_value:
        return found
    usage = fields.get(INCLUDE_USAGE_FIELD)
    return replace(found, stream=True, include_usage=usage is not None and usage.bool_value)


def _value(item: struct_pb2.Value | None) -> Any:
    """A metadata value as the body had it (None: absent)."""
    if item is None:
        return None
    kind = item.WhichOneof("kind")
    return getattr(item, kind) if kind in _SCALARS else _Other(str(kind))


def prompt_from_metadata(request: pb.ProcessingRequest) -> Prompt | None:
    """The leading prompt text an operator's own filter put into ``extproc.prompt_prefix`` (a string); else None."""
    namespace = request.metadata_context.filter_metadata.get(METADATA_NAMESPACE)
    item = namespace.fields.get(PROMPT_PREFIX_FIELD) if namespace is not None else None
    if item is None or item.WhichOneof("kind") != "string_value":
        return None
    return Prompt(text=item.string_value.encode())


def from_body(body: bytes) -> tuple[RequestFields, Prompt]:
    """The fields of a JSON body and its prompt, in one pass; raises Refused when it is not a JSON object."""
    try:
        wanted = _decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise Refused(Refusal.INVALID_BODY, f"the request body must be a JSON object: {exc}") from None
    limits = {f: getattr(wanted, f) for f in LIMIT_FIELDS if getattr(wanted, f) is not None}
    found = _fields(wanted.model, limits, wanted.prompt_cache_key, wanted.priority)
    if wanted.stream is True:
        options = wanted.stream_options
        found = replace(found, stream=True,
                        include_usage=isinstance(options, dict) and options.get("include_usage") is True)
    return found, Prompt(wanted.messages, wanted.prompt)


def prompt_of(body: bytes) -> Prompt:
    """The prompt of a body whose fields came by metadata; nothing (never an error) if it is not a JSON object.

    Its fields were read by Envoy (json_to_metadata): a body Envoy passed
    stays the engine's to judge, as for a model without signatures.
    """
    try:
        wanted = _prompt_decoder.decode(body)
    except msgspec.DecodeError:
        return NO_PROMPT
    return Prompt(wanted.messages, wanted.prompt)


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
