"""How the builtin transport tells the operator about peers that break the rules (or its ``TransportLimits``).

The limits are the ``listen`` section's (config/schema.py, docs/configuration.md), built in transport.py.
The warnings are rate-limited per peer host: whatever a peer sends can cost it
its stream or its connection, but never a flood of log lines.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

log = logging.getLogger("extproc.adapters.grpc.builtin")

# How long a peer's further warnings are counted instead of logged, and how many peers are remembered.
WARN_EVERY_S = 10.0
MAX_PEERS = 4096


class PeerWarnings:
    """At most one warning per peer host per ``every_s``; the next one says how many were not logged."""

    def __init__(self, every_s: float = WARN_EVERY_S, clock: Callable[[], float] = time.monotonic) -> None:
        self._every_s = every_s
        self._clock = clock
        self._peers: dict[str, tuple[float, int]] = {}  # host -> (last logged, suppressed since)

    def warn(self, peer: object, message: str, *args: object) -> None:
        host = str(peer[0]) if isinstance(peer, tuple) and peer else str(peer)
        now = self._clock()
        last, suppressed = self._peers.get(host, (float("-inf"), 0))
        if now - last < self._every_s:
            self._peers[host] = (last, suppressed + 1)
            return
        if len(self._peers) >= MAX_PEERS:  # forget the quiet ones: a bounded table whoever connects
            self._peers = {h: v for h, v in self._peers.items() if now - v[0] < self._every_s}
            if len(self._peers) >= MAX_PEERS:  # that many loud at once: start over rather than grow
                self._peers.clear()
        self._peers[host] = (now, 0)
        more = f" ({suppressed} more from this peer not logged)" if suppressed else ""
        log.warning("peer %s: " + message + more, host, *args)
