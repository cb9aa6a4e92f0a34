"""Queued requests' longest waits (core/expiry.py): each expires at its own deadline, with one timer per wait length."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from extproc.core.cost import Estimate
from extproc.core.expiry import Expiry
from extproc.core.held import Held, Request

pytestmark = pytest.mark.unit


class _Timers:
    """Timers the test fires by hand, each at its deadline on the clock ``now``: every deadline armed, and its callback."""

    def __init__(self) -> None:
        self.now = 0.0
        self.armed: list[tuple[float, Callable[[], None]]] = []

    def at(self, deadline: float, callback: Callable[[], None]) -> _Timers:
        self.armed.append((deadline, callback))
        return self

    def cancel(self) -> None:
        raise AssertionError("expiry never cancels")

    def future(self) -> asyncio.Future[Any]:
        raise AssertionError("expiry makes no future")

    def fire(self) -> None:
        self.now, callback = self.armed.pop(0)
        callback()


def _held(at: float, wait: float) -> Held:
    return Held(Request("t", 0, "t"), at, asyncio.get_running_loop().create_future(), Estimate(1, 1, None, 1.0),
                ttft_objective_s=None, deadline=at + wait, queue_wait_s=wait)


async def test_each_request_expires_at_its_own_deadline_in_arrival_order_on_one_timer() -> None:
    timers, expired = _Timers(), list[Held]()
    expiry = Expiry(timers, lambda: timers.now, expired.append)
    first, second, third = _held(0.0, 10.0), _held(1.0, 10.0), _held(2.0, 10.0)
    for held in (first, second, third):
        expiry.add(held)
    assert [d for d, _ in timers.armed] == [10.0]  # one timer, for the earliest
    timers.fire()
    assert expired == [first] and [d for d, _ in timers.armed] == [11.0]
    expiry.discard(second)  # released before its wait ran out: it never expires
    timers.fire()  # fires for it anyway, finds nothing due, and waits for the next
    assert expired == [first] and [d for d, _ in timers.armed] == [12.0]
    timers.fire()
    assert expired == [first, third] and timers.armed == []


async def test_a_request_that_leaves_at_once_costs_no_timer_while_one_is_set() -> None:
    timers, expired = _Timers(), list[Held]()
    expiry = Expiry(timers, lambda: timers.now, expired.append)
    for i in range(100):  # an uncontended gate: each released as it arrives
        held = _held(i * 0.01, 10.0)
        expiry.add(held)
        expiry.discard(held)
    assert len(timers.armed) == 1
    timers.fire()
    assert expired == [] and timers.armed == []


async def test_each_wait_length_keeps_its_own_order_and_timer() -> None:
    timers, expired = _Timers(), list[Held]()
    expiry = Expiry(timers, lambda: timers.now, expired.append)
    long, short = _held(0.0, 10.0), _held(1.0, 2.0)  # a reload shortened the band's wait
    expiry.add(long)
    expiry.add(short)
    assert sorted(d for d, _ in timers.armed) == [3.0, 10.0]
    timers.armed.sort(key=lambda armed: armed[0])
    timers.fire()
    assert expired == [short]
    timers.fire()
    assert expired == [short, long]


async def test_kept_requests_expire_at_their_own_deadlines_whatever_order_they_were_kept_in() -> None:
    """The cold start keeps requests past their wait (``keep``): deadlines not in arrival order, on one heap."""
    timers, expired = _Timers(), list[Held]()
    expiry = Expiry(timers, lambda: timers.now, expired.append)
    late, early, gone = _held(0.0, 2.0), _held(0.0, 1.0), _held(0.0, 1.0)
    for held in (late, early, gone):
        expiry.add(held)
    timers.armed.sort(key=lambda armed: armed[0])
    timers.fire()  # the 1 s length: early and gone run out, and are kept
    assert expired == [early, gone]
    expired.clear()
    expiry.keep(gone, 20.0)
    expiry.keep(early, 10.0)  # kept after gone, due before it: a timer for the earlier deadline
    assert sorted(d for d, _ in timers.armed) == [2.0, 10.0, 20.0]
    expiry.discard(gone)  # released meanwhile: it never expires
    timers.armed.sort(key=lambda armed: armed[0])
    timers.fire()  # the 2 s length: late runs out
    assert expired == [late]
    timers.fire()
    assert expired == [late, early]
    timers.fire()  # the timer set for gone finds nothing due, and nothing is left to wait for
    assert expired == [late, early] and timers.armed == []
