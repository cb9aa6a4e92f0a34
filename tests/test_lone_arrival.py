"""The release strategy's shortcut for a request that arrives alone decides as its general round would.

``LocalRelease`` serves an arrival that finds nothing else held without its
loop (``strategy.py``, ``_alone``): most arrivals do, and the loop's rereads
of the queue are calls on every request's latency. The shortcut must leave
every decision as it was: these tests run the same arrivals, ends, scrapes
and wake-ups through a strategy that takes it and through one that always
makes the general round, and compare every event the dispatchers report and
every request's outcome.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from extproc.core.bands import Band
from extproc.core.cost import CostWeights
from extproc.core.dispatcher import Held, ModelDispatcher
from extproc.core.engine_load import EngineLoad
from extproc.core.model_state import ModelState
from extproc.core.policies import POLICIES
from extproc.core.release.pool import Pool
from extproc.core.report import Event
from extproc.core.strategy import LocalRelease
from tests.propertyutil import examples
from tests.test_gate import make_gate
from tests.test_reload_core import tenants

pytestmark = pytest.mark.unit

# Three classes: one with an objective (preemption reads it), a lower one with a share, an idle-only preemptible one.
BANDS = (
    Band("interactive", 120.0, ttft_objective_s=0.5),
    Band("standard", 120.0, min_share=0.3),
    Band("batch", 120.0, idle_only=True, preemptible=True, min_share=0.0),
)
RULES: dict[str, Callable[[], Pool]] = {  # a rule that reads metrics, one that counts, a rate (its wake-ups)
    "adaptive": lambda: make_gate(kind="adaptive"),
    "static_concurrency": lambda: make_gate(kind="static_concurrency", max_in_flight=2),
    "static_rate": lambda: make_gate(kind="static_rate", release_rate=5.0),
}


class _Timer:
    def __init__(self, timers: _Timers, deadline: float, callback: Callable[[], None]) -> None:
        self.deadline, self.callback, self.cancelled = deadline, callback, False

    def cancel(self) -> None:
        self.cancelled = True


class _Timers:
    """Deadlines kept until the test's clock passes them (``fire``), in the order they were set."""

    def __init__(self) -> None:
        self.pending: list[_Timer] = []

    def at(self, deadline: float, callback: Callable[[], None]) -> _Timer:
        timer = _Timer(self, deadline, callback)
        self.pending.append(timer)
        return timer

    def fire(self, now: float) -> None:
        due = [t for t in self.pending if t.deadline <= now]
        self.pending = [t for t in self.pending if t.deadline > now]
        for timer in due:
            if not timer.cancelled:
                timer.callback()


class _GeneralRound(LocalRelease):
    """Every arrival through the general round (the reference)."""

    def queued(self, band: int, tenant: str, first: bool, now: float) -> None:
        self.changed(now)


class _Counted(LocalRelease):
    """The strategy as served, counting the arrivals it took alone."""

    alone = 0

    def _alone(self, band: int, now: float) -> None:
        _Counted.alone += 1
        super()._alone(band, now)


def _run(script: list[tuple[Any, ...]], policy: str, rule: str,
         general: bool) -> tuple[list[Event], list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    events: list[Event] = []
    clock = [0.0]
    timers = _Timers()
    kind: type[LocalRelease] = _GeneralRound if general else _Counted

    states: list[ModelState] = []

    def strategy(state: ModelState) -> LocalRelease:
        states.append(state)
        return kind(state, timers)

    def report(event: Event) -> None:
        events.append(event)

    pool = RULES[rule]()
    d = ModelDispatcher(
        "m", pool, BANDS, report, lambda: clock[0],
        policy=POLICIES[policy], timers=timers, tenant=tenants({"b": 2.0}), cost=CostWeights(), max_queued=1_000,
        max_queue_wait_s=3.0, reserved_waiting=1, max_preemptions_per_s=100.0, strategy=strategy,
    )
    every: list[Held] = []
    seen: list[tuple[Any, ...]] = []
    for step in script:
        if step[0] == "submit":
            _, tenant, band, tokens = step
            every.append(d.submit(tenant, band, content_length=400, max_tokens=tokens))
        elif step[0] == "time":
            clock[0] += step[1]
            timers.fire(clock[0])
        elif step[0] == "scrape":
            d.record_scrape("e1", EngineLoad(waiting=step[1], running=step[2]), clock[0] - 0.05)
        else:  # "end" a released request, or "leave" one still queued
            candidates = [h for h in every if not h.ended and h.released == (step[0] == "end")]
            if candidates:
                d.end(candidates[step[1] % len(candidates)])
        seen.append(_decided(states[0], pool, clock[0]))
    outcomes = [(h.released, h.released_at, h.endpoint, h.ended, h.future.done() and h.future.exception() is None)
                for h in every]
    return events, outcomes, seen


def _decided(state: ModelState, pool: Pool, now: float) -> tuple[Any, ...]:
    """What the next decisions read, left by the last step (the state a shortcut could leave otherwise than the
    round): the bands' credits, the load estimate, each band's allowance, read as the strategy reads them."""
    return (state.admission().shares.credits, pool.load_now(),
            tuple(state.allowance(band, now) for band in range(len(BANDS))), state.free_slots(now))


steps = st.lists(st.one_of(
    st.tuples(st.just("submit"), st.sampled_from("abc"), st.integers(0, 2), st.sampled_from([None, 10, 500])),
    st.tuples(st.just("end"), st.integers(0, 20)),
    st.tuples(st.just("leave"), st.integers(0, 20)),
    st.tuples(st.just("time"), st.sampled_from([0.01, 0.2, 1.0, 4.0])),
    st.tuples(st.just("scrape"), st.integers(0, 4), st.integers(0, 6)),
), max_size=60)


# A lower band's credit left over from a backlog that has since left: the first pick of a lone arrival clears it.
CREDIT_LEFT = [("submit", "a", 0, 10), ("submit", "a", 0, 10), ("submit", "b", 1, 10),
               *[("submit", "a", 0, 10)] * 3, *[("end", 0)] * 6, ("submit", "a", 0, 10), ("submit", "b", 1, 10)]
# A lone arrival the rate holds: only its wake-up lets it go.
HELD_BY_RATE = [("submit", "a", 0, 10), ("submit", "b", 0, 10), ("time", 1.0), ("end", 0)]


@settings(max_examples=examples(300), deadline=None)
@example(script=CREDIT_LEFT, policy="round_robin", rule="static_concurrency")
@example(script=HELD_BY_RATE, policy="vtc", rule="static_rate")
@given(script=steps, policy=st.sampled_from(sorted(POLICIES)), rule=st.sampled_from(sorted(RULES)))
def test_an_arrival_served_alone_is_decided_as_the_general_round_decides_it(
    script: list[tuple[Any, ...]], policy: str, rule: str,
) -> None:
    async def both() -> None:
        assert _run(script, policy, rule, general=False) == _run(script, policy, rule, general=True)

    asyncio.run(both())


def test_an_arrival_into_an_empty_queue_takes_the_shortcut_and_one_behind_others_does_not() -> None:
    script: list[tuple[Any, ...]] = [("scrape", 0, 0), ("submit", "a", 0, 10), ("end", 0),
                                     ("submit", "a", 0, 10), ("submit", "b", 0, 10), ("submit", "c", 0, 10),
                                     ("submit", "a", 0, 10)]

    async def run() -> None:
        _Counted.alone = 0
        _, outcomes, _ = _run(script, "round_robin", "static_concurrency", general=False)
        assert [released for released, *_ in outcomes] == [True, True, True, False, False]  # two slots
        assert _Counted.alone == 4  # each arrival into an empty queue (the gate full for the fourth), not the fifth

    asyncio.run(run())
