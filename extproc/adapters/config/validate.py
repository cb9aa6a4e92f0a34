"""A loaded YAML document converted into msgspec structs, with every mistake reported by its key path.

msgspec checks each value against its annotated type and constraints, but
stops at the first error; an operator fixing a config file wants them all at
once. So :func:`convert` walks the struct types field by field, lets msgspec
convert each leaf value, and collects one message per mistake::

    models[0].target_waiting: must be an integer >= 1, got 'three'
    models[1].gate: must be one of adaptive, waiting_target, ..., got 'fast'

The message says what the value must be: the leaf's ``Meta(description=...)``
when it has one, else its type and bounds. A leaf may also carry what no
constraint expresses, in ``Meta(extra=...)``: a ``check`` (the converted
value in, the value normalised out, ValueError if wrong) and a ``parse`` (the
raw YAML value in, what to convert out: e.g. a mapping written inline that
the program keeps as JSON text). Unknown keys are errors, each one.

Rules between fields are a table the caller passes, by struct type: a
struct's rule yields (key, message) pairs, and runs once the struct's own
fields are well-typed (so a second run may find more, after the type errors
are fixed). An empty key names the struct itself. A key a section no longer
takes is refused with what to write instead (``Section.REMOVED``).
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable, Iterable, Mapping
from typing import Annotated, Any, Literal, TypeVar, Union, get_args, get_origin

import msgspec

from extproc.adapters.config.values import Section

S = TypeVar("S", bound=msgspec.Struct)
# A leaf's parse or check (see the module docstring).
Hook = Callable[[Any], Any]
# What a rule finds: (key, message) per problem, the key relative to the struct ("": the struct itself).
Problems = Iterable[tuple[str, str]]
# The rules between fields, by the struct type they check.
Rules = Mapping[type[msgspec.Struct], Callable[[Any], Problems]]


class Invalid(ValueError):
    """The document has mistakes; ``problems`` lists each as (key path, message), ``errors`` as ``key.path: message``.

    The key path stays apart from the message so that a caller holding the
    YAML source can say on which line of the file each mistake is.
    """

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        self.problems = problems
        self.errors = [f"{path or 'the document'}: {message}" for path, message in problems]
        super().__init__("\n".join(self.errors))


# What a walk collects: (key path, message) per mistake; the document itself is the path "".
Errors = list[tuple[str, str]]


class _Failed:
    """Stands in for a value that did not convert (its error is already recorded)."""


_FAILED = _Failed()


def convert(raw: Any, cls: type[S], rules: Rules) -> S:
    """``raw`` as a ``cls``, each struct checked by its entry in ``rules``; raises :class:`Invalid` with every mistake."""
    errors: Errors = []
    value = _struct(raw, cls, "", errors, rules)
    if errors or isinstance(value, _Failed):
        raise Invalid(errors)
    return value


def _key(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def split(annotation: Any) -> tuple[Any, list[msgspec.Meta]]:
    """``Annotated[T, Meta...]`` -> (T, [Meta...]); anything else -> (it, [])."""
    if get_origin(annotation) is Annotated:
        base, *extras = get_args(annotation)
        return base, [m for m in extras if isinstance(m, msgspec.Meta)]
    return annotation, []


def _is_struct(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, msgspec.Struct)


def optional(annotation: Any) -> Any | None:
    """``T`` for ``T | None``, else None."""
    if get_origin(annotation) in (Union, types.UnionType):
        rest = [a for a in get_args(annotation) if a is not type(None)]
        if len(rest) == 1 and len(get_args(annotation)) == 2:
            return rest[0]
    return None


def describe(annotation: Any) -> str:
    """What a value of this type must be, in words ("an integer >= 1")."""
    inner = optional(annotation)
    if inner is not None:
        return describe(inner)
    base, metas = split(annotation)
    bounds: dict[str, Any] = {}
    for meta in metas:
        if meta.description:
            return meta.description
        bounds.update({k: getattr(meta, k) for k in ("ge", "gt", "le", "lt", "min_length") if getattr(meta, k) is not None})
    if base is bool:
        return "true or false"
    if get_origin(base) is Literal:
        return "one of " + ", ".join(str(a) for a in get_args(base))
    if get_origin(base) is tuple:
        return "a non-empty list" if bounds.get("min_length") else "a list"
    if get_origin(base) is dict or _is_struct(base):
        return "a mapping"
    noun = {int: "an integer", float: "a number", str: "a string"}.get(base, getattr(base, "__name__", str(base)))
    if "gt" in bounds and "le" in bounds:
        return f"{noun} in ({bounds['gt']}, {bounds['le']}]"
    if "ge" in bounds and "le" in bounds:
        return f"{noun} in [{bounds['ge']}, {bounds['le']}]"
    if "ge" in bounds and "lt" in bounds:
        return f"{noun} in [{bounds['ge']}, {bounds['lt']})"
    for key, sign in (("ge", ">="), ("gt", ">"), ("le", "<=")):
        if key in bounds:
            return f"{noun} {sign} {bounds[key]}"
    return noun


def _value(raw: Any, annotation: Any, path: str, errors: Errors, rules: Rules) -> Any:
    inner = optional(annotation)
    if inner is not None:
        return None if raw is None else _value(raw, inner, path, errors, rules)
    base, metas = split(annotation)
    if _is_struct(base):
        return _struct(raw, base, path, errors, rules)
    origin, args = get_origin(base), get_args(base)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        if not isinstance(raw, (list, tuple)) or any(m.min_length and len(raw) < m.min_length for m in metas):
            errors.append((path, f"must be {describe(annotation)}, got {raw!r}"))
            return _FAILED
        items = [_value(item, args[0], f"{path}[{i}]", errors, rules) for i, item in enumerate(raw)]
        return _FAILED if any(isinstance(i, _Failed) for i in items) else tuple(items)
    if origin is dict and args[0] is str:
        if raw is None:
            return {}
        if not isinstance(raw, dict):
            errors.append((path, f"must be a mapping, got {type(raw).__name__}"))
            return _FAILED
        bad_keys = [key for key in raw if not isinstance(key, str) or not key.strip()]
        for key in bad_keys:
            errors.append((path, f"keys must be non-empty strings, got {key!r}"))
        entries = {key: _value(item, args[1], _key(path, key), errors, rules) for key, item in raw.items() if key not in bad_keys}
        return _FAILED if bad_keys or any(isinstance(v, _Failed) for v in entries.values()) else entries
    return _leaf(raw, annotation, metas, path, errors)


def _leaf(raw: Any, annotation: Any, metas: list[msgspec.Meta], path: str, errors: Errors) -> Any:
    hooks: dict[str, Hook] = {}
    for meta in metas:
        hooks.update(meta.extra or {})
    try:
        value = msgspec.convert(hooks["parse"](raw) if "parse" in hooks else raw, annotation)
        if "check" in hooks:
            value = hooks["check"](value)
        if isinstance(value, float) and not math.isfinite(value):  # YAML's .inf passes every bound
            raise ValueError(value)
    except (msgspec.ValidationError, ValueError):
        errors.append((path, f"must be {describe(annotation)}, got {raw!r}"))
        return _FAILED
    return value


def _struct(raw: Any, cls: type[S], path: str, errors: Errors, rules: Rules) -> S | _Failed:
    if raw is None:
        raw = {}  # an empty section (`listen:`) takes every default
    if not isinstance(raw, dict):
        errors.append((path, f"must be a mapping, got {type(raw).__name__}"))
        return _FAILED
    fields = {f.encode_name: f for f in msgspec.structs.fields(cls)}
    unknown = [key for key in raw if key not in fields]
    for key in unknown:
        removed = cls.REMOVED.get(str(key)) if issubclass(cls, Section) else None
        message = removed.format(path=path) if removed else f"unknown key (allowed: {', '.join(sorted(fields))})"
        errors.append((_key(path, str(key)), message))
    missing = [key for key, field in fields.items() if field.required and key not in raw]
    for key in missing:
        errors.append((_key(path, key), "is required"))
    values = {field.name: _value(raw[key], field.type, _key(path, key), errors, rules)
              for key, field in fields.items() if key in raw}
    if unknown or missing or any(isinstance(v, _Failed) for v in values.values()):
        return _FAILED
    value = cls(**values)
    rule = rules.get(cls)
    for key, message in rule(value) if rule is not None else ():
        errors.append((_key(path, key) if key else path, message))
    return value  # well-typed even if it breaks a rule: the rules of the structs around it still run
