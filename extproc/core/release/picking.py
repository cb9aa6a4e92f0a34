"""Endpoint picking (``endpoint_picking: true``): which endpoint the next release goes to.

Each release is assigned an endpoint, and the processor tells Envoy
(``x-gateway-destination-endpoint``). The affinity key's rendezvous-hash
favourite keeps it (its prefix cache is warm there) while that endpoint has
room and at most ``spread`` less room than the emptiest one: bounded-load
stickiness, so a tenant's flood spills over instead of queueing on one
engine. Otherwise the endpoint with the most room, ties broken by the hash
order. Room is the release rule's per-endpoint allowance.

The other endpoints follow the pick in order of room: Envoy walks that list
when the first cannot be reached (the Endpoint Picker Protocol's fallbacks),
so a dead endpoint costs a retry rather than an error.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence


def ranked(key: str, endpoints: Sequence[str], room: Callable[[str], int], spread: int) -> list[str]:
    """``endpoints`` in order of preference for a release with affinity ``key``: the pick, then by room.

    The first has room if any has; with none, it is the one nearest to room.
    """
    order = sorted(endpoints, key=lambda e: hashlib.blake2b(f"{key}\0{e}".encode(), digest_size=8).digest(),
                   reverse=True)
    if not order:
        return []
    rooms = {e: room(e) for e in order}
    favourite = order[0]
    best = max(rooms.values())
    # max() and sorted() keep the first of equals: hash order.
    first = favourite if rooms[favourite] >= 1 and best - rooms[favourite] <= spread else max(order, key=rooms.__getitem__)
    return [first, *sorted((e for e in order if e != first), key=lambda e: -rooms[e])]
