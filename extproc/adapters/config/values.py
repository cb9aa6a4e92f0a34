"""What a leaf of the file must be: the constrained types the schema's fields are annotated with; and a mapping's base.

Each type is an ``Annotated`` alias whose ``Meta`` carries what msgspec checks
(bounds, a pattern) and, in ``extra``, what it cannot: a ``check`` of the
converted value and a ``parse`` of the raw one (validate.py runs both). The
``description`` is what an error says the value must be, so
``must be HOST:PORT, got 'localhost'`` reads the same for every field of
that type.
"""

from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar
from urllib.parse import urlsplit

import msgspec
from msgspec import Meta


class Section(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A mapping in the file: typed fields, unknown keys refused.

    Subclasses inherit these options; they repeat ``frozen=True`` for the type
    checker, which reads each class on its own. ``REMOVED`` names the keys a
    section no longer takes, each with what to write instead (``{path}``: the
    section's own key path): validate.py refuses such a key with that message
    rather than as merely unknown.
    """

    REMOVED: ClassVar[Mapping[str, str]] = {}


def split_address(text: str) -> tuple[str, int]:
    """A validated ``HOST:PORT`` (IPv6 in brackets allowed) -> (host, port)."""
    host, _, port = text.rpartition(":")
    return host.strip("[]"), int(port)


def is_ip_address(host: str) -> bool:
    """True for a literal IPv4/IPv6 address, False for a host name (which needs DNS)."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def choice(names: tuple[str, ...] | dict[str, Any]) -> Meta:
    """Constraint for a string that must be one of ``names`` (a tuple, or a registry's keys)."""
    allowed = tuple(names)

    def check(value: str) -> str:
        if value not in allowed:
            raise ValueError(value)
        return value

    return Meta(description=f"one of {', '.join(allowed)}", extra={"check": check})


def _header(value: str) -> str:
    if not value.strip() or value != value.lower() or any(c.isspace() for c in value):
        raise ValueError(value)
    return value


def _address(value: str) -> str:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(value)
    return value


def _endpoint(value: str) -> str:
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.port is None:  # .port: ValueError if bad
        raise ValueError(value)
    return value.rstrip("/")


def _http_url(value: str) -> str:
    """An http(s) URL whose port may be implied by its scheme."""
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(value)
    return value


def _redis_url(value: str) -> str:
    """Where Redis listens, as redis-py reads it: ``redis://`` or ``rediss://`` (TLS) with a host, or ``unix://`` with a path."""
    parts = urlsplit(value)
    if parts.scheme in ("redis", "rediss"):
        # .port raises ValueError for a port that is not a number in range; the path is the database number.
        if not parts.hostname or parts.port == 0 or not re.fullmatch(r"/?\d*", parts.path):
            raise ValueError(value)
    elif parts.scheme != "unix" or not parts.path:
        raise ValueError(value)
    return value


def _jwks_text(raw: Any) -> Any:
    """A JWKS written as YAML becomes the JSON text Envoy takes inline."""
    return json.dumps(raw, sort_keys=True) if isinstance(raw, dict) else raw


def _jwks(value: str) -> str:
    try:
        keys = json.loads(value).get("keys")
    except (ValueError, AttributeError):
        keys = None
    if not isinstance(keys, list) or not keys:
        raise ValueError(value)
    return value


NonEmpty = Annotated[str, Meta(pattern=r"\S", description="a non-empty string")]
Header = Annotated[str, Meta(description="a lower-case header name without spaces", extra={"check": _header})]
Address = Annotated[str, Meta(description="HOST:PORT", extra={"check": _address})]
Endpoint = Annotated[str, Meta(description="an http(s)://HOST:PORT URL", extra={"check": _endpoint})]
HttpUrl = Annotated[str, Meta(description="an http(s) URL", extra={"check": _http_url})]
RedisUrl = Annotated[str, Meta(description="a redis://HOST[:PORT][/DB], rediss://... or unix:///PATH URL",
                               extra={"check": _redis_url})]
Jwks = Annotated[str, Meta(description='a JWKS: a JSON object with a non-empty "keys" list',
                           extra={"parse": _jwks_text, "check": _jwks})]
Count = Annotated[int, Meta(ge=1)]
Count0 = Annotated[int, Meta(ge=0)]
Positive = Annotated[float, Meta(gt=0)]
NonNegative = Annotated[float, Meta(ge=0)]
Share = Annotated[float, Meta(gt=0, le=1)]
# A share of the engine an idle-only band keeps free for the bands above: never more than half of it.
ReserveShare = Annotated[float, Meta(ge=0, le=0.5)]
# A share that may be nothing but never everything (a minimum share of releases).
ReleaseShare = Annotated[float, Meta(ge=0, lt=1)]
Names = Annotated[tuple[NonEmpty, ...], Meta(min_length=1)]
