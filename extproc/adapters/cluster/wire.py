"""What one round trip sends to ``schedule.lua`` and what it answers: one JSON schema, named fields.

The script gets two inputs: ``KEYS[1]``, the model's key prefix (every
other key name is derived from it in one place, ``key`` at the top of the
script), and ``ARGV[1]``, a :class:`Trip` as JSON. It answers a
:class:`~extproc.core.cluster.Grant` as JSON. The core's dataclasses
(``Ask``, ``Backlog``, ``Correction``, ``Grant``, ``Release``) are the
schema: the script reads and writes them by these field names, so a field
renamed here is renamed in the script.
"""

from __future__ import annotations

import msgspec

from extproc.core.cluster import Ask, Grant


class Trip(msgspec.Struct, frozen=True, omit_defaults=True):
    """One instance's round trip for one model (ARGV[1])."""

    # This instance, unique per process start.
    instance: str
    # How long its count in flight and its backlog stand without another trip.
    lease_ms: int
    # The wake-up channel of instance X is ``wake + X``; the message is the model.
    wake: str
    model: str
    # The policy's cluster form (``ClusterForm``): the script refuses one it does not implement.
    form: str
    # None: the instance leaves (a clean stop): its count, backlog and untaken grants go at once.
    ask: Ask | None = None


_encoder = msgspec.json.Encoder()
_grant = msgspec.json.Decoder(Grant)


def encode_trip(trip: Trip) -> bytes:
    return _encoder.encode(trip)


def decode_grant(reply: bytes | str) -> Grant:
    return _grant.decode(reply)
