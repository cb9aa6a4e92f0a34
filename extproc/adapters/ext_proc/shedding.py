"""Whom to refuse when the processor is overloaded: new arrivals of the lowest class present, never a higher one.

**When.** Only under *sustained* overload: the event loop has run late on
every probe (``loop_lag.py``: each probe late by the servicer's ACK_LAG_S or
more) for :data:`SUSTAINED_SHARE` of Envoy's ``message_timeout`` (1 s of the
generated config's 2 s), counted from the first late probe's firing. A late
stream costs the same reply either way: an acknowledgement
(``override_message_timeout``, prebuilt) stops Envoy's timer as surely as a
refusal, so a stream is acknowledged and decided whenever the loop can still
answer it. A single stall of any length is one late probe, measured once it
is over; the loop then answers at once, and nothing is shed. A loop that has
stayed late for half the timeout has had no idle moment for that long: the
streams behind it in the socket, where their age is invisible, have waited
as long, and what it takes in beyond that brings Envoy's 504 closer for all.
The other half of the timeout is the margin that shedding has to catch up in.

**Whom.** A class is *present* while it has requests queued (any model: the
loop is the processor's) or has sent one within :data:`ARRIVING_SHARE` of the
message timeout. An arrival is shed only when no lower class is present:
batch arrivals go first, then standard ones once no batch request is queued
or arriving, and an interactive (the first band's) request only when it is
the only class left. Shedding a class keeps it present (its arrivals are
seen), so a higher class is never shed while a lower one is still being shed.

**Not queued requests.** What is already queued stays queued until it is
released or its queue timeout: refusing it would spend the loop's time now,
when it has least, on a reply that relieves nothing (a held request costs no
CPU while it waits, and strict priority already serves every higher class
first), and would empty the lower classes whose presence keeps the higher
ones from being shed.

The class is the band :func:`~extproc.core.entitlement.grant` gives the
request (its priority header, else its objective, limited by its tenant's
entitlement), known from the first message's headers and our metadata
without the body. Attached by ext_proc alone, the body's ``priority`` may be
the only word on it: the servicer decides after the body is read, as it
does for admission; such a gateway's message timeout is long and nothing is
acknowledged there, so the wait costs only that read.
"""

from __future__ import annotations

import math
from collections.abc import Callable

# Shed only once the loop has run late for this share of Envoy's message_timeout.
SUSTAINED_SHARE = 0.5
# A class that sent a request within this share of the message timeout is still arriving.
ARRIVING_SHARE = 1.0


class Shedding:
    """Which arrivals the servicer refuses ``overloaded``, from how long the loop has run late and who is present.

    ``queued(band)`` is how many requests of ``band`` all models hold now.
    Times are the event loop's.
    """

    def __init__(self, bands: int, message_timeout_s: float, queued: Callable[[int], int]) -> None:
        self.sustained_s = SUSTAINED_SHARE * message_timeout_s
        self._arriving_s = ARRIVING_SHARE * message_timeout_s
        self._queued = queued
        # When each band's last request arrived.
        self._seen = [-math.inf] * bands

    def overloaded(self, late_for_s: float) -> bool:
        """Whether a loop that has run late for ``late_for_s`` is in sustained overload."""
        return late_for_s >= self.sustained_s

    def present(self, band: int, now: float) -> bool:
        """Whether ``band`` has requests queued, or sent one lately."""
        return now - self._seen[band] <= self._arriving_s or self._queued(band) > 0

    def arrived(self, band: int, now: float, overloaded: bool) -> bool:
        """An arrival of ``band`` (0: the highest) at ``now``: whether to refuse it (only when ``overloaded``)."""
        self._seen[band] = now
        return overloaded and not any(self.present(lower, now) for lower in range(band + 1, len(self._seen)))
