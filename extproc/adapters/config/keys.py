"""Every key the file may hold, walked from the schema's types: the ground truth of the reference.

The reference (docs/configuration.md, written by ``extproc.tools.config_reference``)
and its test read the keys from here, so a field added to a struct is a row
missing from the page until it is documented. A key is named by its pattern:
a list's item as ``[]`` (``models[].cost.input_weight``), a mapping's entry as
``<name>`` (``bands.<name>.min_share``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, get_args, get_origin

import msgspec

from extproc.adapters.config.schema import ConfigFile
from extproc.adapters.config.validate import describe, optional, split


@dataclass(frozen=True)
class Key:
    """One key: its pattern, what its value must be (in words), its default (None: required or none)."""

    path: str
    must_be: str
    default: Any
    required: bool = False
    # A section (a mapping of settings) rather than a leaf.
    section: bool = False


def _struct(annotation: Any) -> type[msgspec.Struct] | None:
    base, _ = split(optional(annotation) or annotation)
    return base if isinstance(base, type) and issubclass(base, msgspec.Struct) else None


def keys(cls: type[msgspec.Struct] = ConfigFile, path: str = "") -> Iterator[Key]:
    """Every key under ``cls``, depth first in the schema's order; a section before its own keys."""
    for field in msgspec.structs.fields(cls):
        key = f"{path}.{field.encode_name}" if path else field.encode_name
        default = None if field.default is msgspec.NODEFAULT else field.default
        if field.default_factory is not msgspec.NODEFAULT:
            default = field.default_factory()
        inner, _ = split(field.type)
        struct, args = _struct(field.type), get_args(inner)
        if struct is not None:
            yield Key(key, "a mapping", default, field.required, section=True)
            yield from keys(struct, key)
        elif get_origin(inner) is tuple and args and _struct(args[0]) is not None:
            yield Key(key, describe(field.type), default, field.required, section=True)
            yield from keys(_struct(args[0]) or cls, f"{key}[]")
        elif get_origin(inner) is dict and _struct(args[1]) is not None:
            yield Key(key, "a mapping", default, field.required, section=True)
            yield from keys(_struct(args[1]) or cls, f"{key}.<name>")
        else:
            yield Key(key, describe(field.type), default, field.required)
