"""Queued requests' longest waits: one timer per wait length, not one per request.

A queued request is refused ``queue_timeout`` once it has waited its band's
longest wait. The requests queued with one wait length expire in the order
they arrived, so each length keeps its requests in arrival order (an
``OrderedDict``: one leaves from anywhere at once, when it is released or its
client leaves, and the earliest is found at once, where a plain dict would
step over every entry removed before it) and one timer, for the earliest. When it fires, every request of that length
whose wait has run out expires, and the timer is set again for the next.

A request leaving does not touch the timer: it fires for a request gone,
finds nothing due and is set for the next. So an uncontended gate, which
releases each request at once, costs one timer per wait length per longest
wait, not one per request; and a held request costs an entry in its dict,
not a timer of the event loop.

A reload that changes a band's longest wait starts another length; a request
keeps the wait it was queued with.

A request whose wait ran out while its model had no engine up may be *kept*
(:meth:`Expiry.keep`: the model's cold-start wait, ``model_state.py``) until
a later deadline. Kept requests are rare (a pool scaled to zero, or every
engine down) and their deadlines are not in arrival order across wait
lengths, so they have a heap of their own, by deadline, and one timer for
its earliest.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Callable

from extproc.core.held import Held
from extproc.core.timers import Timers


class _Length:
    """The requests queued with one wait length, in arrival order, and whether a timer is set for them."""

    __slots__ = ("held", "armed")

    def __init__(self) -> None:
        self.held: OrderedDict[Held, None] = OrderedDict()
        self.armed = False


class Expiry:
    """When each queued request runs out of wait (see the module docstring); ``expire`` is told of each."""

    def __init__(self, timers: Timers, clock: Callable[[], float], expire: Callable[[Held], None]) -> None:
        self._timers = timers
        self._clock = clock
        self._expire = expire
        self._lengths: dict[float, _Length] = {}
        # Requests kept past their wait (:meth:`keep`): (deadline, order, held), and those still queued among them.
        self._kept: list[tuple[float, int, Held]] = []
        self._keeping: set[Held] = set()
        self._order = itertools.count()
        self._kept_armed: set[float] = set()  # the deadlines a timer is set for

    def add(self, held: Held) -> None:
        """``held`` was queued: it expires at ``enqueued_at + queue_wait_s`` unless it leaves first (:meth:`discard`)."""
        wait = held.queue_wait_s
        length = self._lengths.get(wait)
        if length is None:
            length = self._lengths[wait] = _Length()
        length.held[held] = None
        if not length.armed:  # none waiting with this length: it is the first to run out
            self._arm(wait, length, held.enqueued_at + wait)

    def discard(self, held: Held) -> None:
        """``held`` left the queue (released, refused, its client gone): it no longer expires."""
        length = self._lengths.get(held.queue_wait_s)
        if length is not None:
            length.held.pop(held, None)
        self._keeping.discard(held)  # its heap entry is skipped when it comes up

    def keep(self, held: Held, deadline: float) -> None:
        """``held``, whose wait ran out, stays queued until ``deadline`` (then ``expire`` is told again) unless it
        leaves first."""
        heapq.heappush(self._kept, (deadline, next(self._order), held))
        self._keeping.add(held)
        self._arm_kept()

    def _arm_kept(self) -> None:
        """A timer for the earliest kept request still queued, unless one is set for it or before."""
        kept = self._kept
        while kept and kept[0][2] not in self._keeping:  # left the queue meanwhile
            heapq.heappop(kept)
        if kept and not any(armed <= kept[0][0] for armed in self._kept_armed):
            deadline = kept[0][0]
            self._kept_armed.add(deadline)
            self._timers.at(deadline, lambda: self._fire_kept(deadline))

    def _fire_kept(self, armed: float) -> None:
        self._kept_armed.discard(armed)
        now = self._clock()
        kept = self._kept
        while kept and kept[0][0] <= now:
            held = heapq.heappop(kept)[2]
            if held in self._keeping:
                self._keeping.discard(held)
                self._expire(held)
        self._arm_kept()

    def _arm(self, wait: float, length: _Length, deadline: float) -> None:
        length.armed = True
        self._timers.at(deadline, lambda: self._fire(wait, length))

    def _fire(self, wait: float, length: _Length) -> None:
        length.armed = False
        now = self._clock()
        waiting = length.held
        while waiting:
            held = next(iter(waiting))
            due = held.enqueued_at + wait
            if due > now:
                self._arm(wait, length, due)
                return
            waiting.popitem(last=False)
            self._expire(held)
