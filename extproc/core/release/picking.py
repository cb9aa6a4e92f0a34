"""Endpoint picking (``endpoint_picking: true``): which endpoint the next release goes to.

Each release is assigned an endpoint, and the processor tells Envoy
(``x-gateway-destination-endpoint``). An endpoint *fits* while it has room
and at most ``spread`` less room than the emptiest one: bounded-load
stickiness, so a flood spills over instead of queueing on one engine. The
first that fits of:

* the endpoint where the request's prompt prefix is most likely cached
  (``hit``: the account of ``core/prefix_cache.py``), when any is;
* the affinity key's rendezvous-hash favourite (``prompt_cache_key``, the
  prefix's first block, else the tenant), so a prefix seen nowhere yet lands
  where the next request with it will look;

otherwise the endpoint with the most room, ties broken by the hash order.
Room is the release rule's per-endpoint allowance.

The other endpoints follow the pick in order of room: Envoy walks that list
when the first cannot be reached (the Endpoint Picker Protocol's fallbacks),
so a dead endpoint costs a retry rather than an error.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence


def ranked(key: str, endpoints: Sequence[str], room: Callable[[str], int], spread: int,
           hit: Callable[[str], float] | None = None) -> list[str]:
    """``endpoints`` in order of preference for a release with affinity ``key``: the pick, then by room.

    ``hit``: the prompt tokens the release would find cached at each. The
    first has room if any has; with none, it is the one nearest to room.
    """
    order = sorted(endpoints, key=lambda e: hashlib.blake2b(f"{key}\0{e}".encode(), digest_size=8).digest(),
                   reverse=True)
    if not order:
        return []
    rooms = {e: room(e) for e in order}
    best = max(rooms.values())
    preferred = [order[0]]
    if hit is not None:
        hits = {e: hit(e) for e in order}
        cached = max(order, key=hits.__getitem__)  # max() and sorted() keep the first of equals: hash order
        if hits[cached] > 0:
            preferred.insert(0, cached)
    first = next((e for e in preferred if rooms[e] >= 1 and best - rooms[e] <= spread), None)
    if first is None:
        first = max(order, key=rooms.__getitem__)
    return [first, *sorted((e for e in order if e != first), key=lambda e: -rooms[e])]
