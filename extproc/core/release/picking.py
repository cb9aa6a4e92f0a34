"""Endpoint picking (``endpoint_picking: true``): which endpoint the next release goes to.

Each release is assigned an endpoint, and the processor tells Envoy
(``x-gateway-destination-endpoint``). The affinity key's rendezvous-hash
favourite keeps it (its prefix cache is warm there) while that endpoint has
room and at most ``spread`` less room than the emptiest one: bounded-load
stickiness, so a tenant's flood spills over instead of queueing on one
engine. Otherwise the endpoint with the most room, ties broken by the hash
order. Room is the release rule's per-endpoint allowance.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence


def pick(key: str, endpoints: Sequence[str], room: Callable[[str], int], spread: int) -> str | None:
    """The endpoint for the next release of requests with affinity ``key``; None if none has room."""
    ranked = sorted(endpoints, key=lambda e: hashlib.blake2b(f"{key}\0{e}".encode(), digest_size=8).digest(),
                    reverse=True)
    rooms = {e: room(e) for e in ranked}
    if not ranked or max(rooms.values()) < 1:
        return None
    favourite = ranked[0]
    if rooms[favourite] >= 1 and max(rooms.values()) - rooms[favourite] <= spread:
        return favourite
    return max(ranked, key=lambda e: rooms[e])  # max() keeps the first of equals: hash order
