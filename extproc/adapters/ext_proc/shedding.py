"""Whom to refuse when the processor is overloaded: new arrivals of the lowest class present, never a higher one.

**When.** Only under *sustained* overload: every probe of the event loop
(``loop_lag.py``) has been late, by the servicer's ACK_LAG_S (50 ms) or more,
for :data:`SUSTAINED_SHARE` of Envoy's ``message_timeout`` since the first
late one fired: 1 s of the generated config's 2 s. Late at all, not late by
much: how late the probe runs says little of how long a stream has waited,
since most of that wait is in the socket, before the loop sees the stream
(measured with the processor starved: probes 0.3–0.6 s late while streams
went past Envoy's 2 s without a reply).
That the loop has had no moment to catch up for half the timeout says that
its backlog has grown, not shrunk, for that long; the other half is the
margin shedding has to catch up in.

A late stream costs the same reply either way: an acknowledgement
(``override_message_timeout``, prebuilt) stops Envoy's timer as surely as a
refusal, so until then a stream is acknowledged and decided. A single stall
of any length is one late probe, measured once it is over; if the loop then
answers at once, nothing is shed. Only a backlog that keeps the loop late for
half the timeout after it is overload.

**Whom.** A class is *present* while it has requests queued (any model: the
loop is the processor's) or has sent one within :data:`ARRIVING_SHARE` of the
message timeout: under overload the socket holds up to that much of the
arrivals unseen, so a class seen that recently likely has more in it. An arrival is shed only when no lower class is present:
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

# Shed once every probe has been late for this share of Envoy's message_timeout.
SUSTAINED_SHARE = 0.5
# A class that sent a request within this share of the message timeout is still arriving.
ARRIVING_SHARE = 1.0


class Shedding:
    """Which arrivals the servicer refuses ``overloaded``: from how long the loop has run late, and who is present.

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
