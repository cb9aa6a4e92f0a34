"""Priority inside the engine, in the pure core: the self-tuning reservation, work conservation and preemption.

The dispatcher runs on a static_concurrency gate of two slots (``max_running``
2, so a full engine is known without metrics) and a clock the test moves.
"""

from __future__ import annotations

import pytest

from extproc.adapters.timers import LoopTimers
from extproc.core.bands import DEMAND_WINDOW_S, Band, BandAdmission, BandDemand
from extproc.core.cost import CostWeights
from extproc.core.dispatcher import Held, ModelDispatcher
from extproc.core.engine_load import EngineLoad
from extproc.core.entitlement import Tenant
from extproc.core.policies import POLICIES
from extproc.core.report import Event, RequestEvent, Step
from tests.test_gate import make_gate

pytestmark = pytest.mark.unit

BANDS = (Band("interactive", ttft_objective_s=0.2), Band("standard"),
         Band("batch", idle_only=True, preemptible=True))
INTERACTIVE, STANDARD, BATCH = range(3)


class Steps(list[RequestEvent]):
    def __call__(self, event: Event) -> None:
        if isinstance(event, RequestEvent):
            self.append(event)

    def of(self, step: Step) -> list[RequestEvent]:
        return [e for e in self if e.step is step]


def make(now: list[float], rate: float = 2.0, slots: int = 2) -> tuple[ModelDispatcher, Steps]:
    steps = Steps()
    every = Tenant(tuple(b.name for b in BANDS), "standard", weight=1.0, max_queued=100)
    dispatcher = ModelDispatcher(
        "m", make_gate(kind="static_concurrency", max_in_flight=slots, max_running=slots), BANDS, steps,
        lambda: now[0], policy=POLICIES["round_robin"], tenant=lambda _: every, cost=CostWeights(), max_queued=100,
        max_queue_wait_s=120.0, reserved_waiting=0, max_preemptions_per_s=rate, timers=LoopTimers(lambda: now[0]),
    )
    return dispatcher, steps


def fill(dispatcher: ModelDispatcher, tenants: tuple[str, ...] = ("bob", "bob")) -> list[Held]:
    batch = [dispatcher.submit(tenant, BATCH) for tenant in tenants]
    assert all(h.future.done() for h in batch)
    return batch


def test_demand_is_the_peak_of_the_bands_above_in_the_window() -> None:
    demand = BandDemand(3)
    for _ in range(3):
        demand.change(0, 1, 0.0)
    demand.change(0, -3, 1.0)
    assert demand.peak_above(1, 2.0) == 3 and demand.peak_above(2, 2.0) == 3 and demand.above(1) == 0
    assert demand.peak_above(1, 1.0 + DEMAND_WINDOW_S + 0.1) == 0  # the burst is forgotten
    demand.change(1, 2, 50.0)
    assert demand.peak_above(1, 50.0) == 0 and demand.peak_above(2, 50.0) == 2


def test_the_reservation_follows_the_higher_bands_recent_demand() -> None:
    pool = make_gate(kind="static_concurrency", max_in_flight=4)
    admission = BandAdmission(BANDS, pool, reserved_waiting=0)
    assert admission.allowance(STANDARD, 0.0) == 4  # nobody above asked lately: nothing kept back
    admission.demand.change(INTERACTIVE, 2, 0.0)  # chats hold 2, for a long while
    assert admission.reserve(STANDARD, 120.0) == 0  # ...which they hold now: nothing more is kept free
    admission.demand.change(INTERACTIVE, -2, 120.0)
    assert admission.reserve(STANDARD, 120.5) == 2 and admission.allowance(STANDARD, 120.5) == 2
    admission.demand.change(INTERACTIVE, 1, 121.0)  # one of them is back, in flight: one slot more is kept
    assert admission.reserve(STANDARD, 121.0) == 1
    admission.demand.change(INTERACTIVE, -1, 122.0)
    assert admission.allowance(STANDARD, 122.0 + 2 * DEMAND_WINDOW_S) == 4  # unused for a minute: given back
    # A burst is not a habit: 3 chats for a second keep nothing free after them.
    admission.demand.change(INTERACTIVE, 3, 300.0)
    admission.demand.change(INTERACTIVE, -3, 301.0)
    assert admission.reserve(STANDARD, 301.0) == 0
    # A preemptible band keeps nothing free when preemption is on: room is made when it is needed.
    preempting = BandAdmission(BANDS, pool, reserved_waiting=0, preemption=True)
    preempting.demand.change(INTERACTIVE, 2, 0.0)
    preempting.demand.change(INTERACTIVE, -2, 120.0)
    assert preempting.reserve(BATCH, 120.5) == 0 and preempting.reserve(STANDARD, 120.5) == 2


def test_an_idle_only_band_alone_is_released_like_any_other() -> None:
    """Work conservation: with nothing above it lately, batch fills the engine's queue to its target too."""
    pool = make_gate(target=3, max_running=2)
    pool.record_scrape("e1", EngineLoad(waiting=0, running=2), started_at=0.0)
    admission = BandAdmission(BANDS, pool, reserved_waiting=0)
    alone = admission.allowance(BATCH, 0.1)
    assert not admission.into_free_slots(BATCH, 0.1) and alone == pool.allowance(0.1) and alone > 0
    admission.demand.change(INTERACTIVE, 1, 0.1)
    assert admission.into_free_slots(BATCH, 0.2) and admission.allowance(BATCH, 0.2) == 0  # no slot is free


async def test_a_chat_at_risk_preempts_the_youngest_batch_request_once() -> None:
    now = [0.0]
    dispatcher, steps = make(now)
    first, second = fill(dispatcher, ("bob", "carol"))
    now[0] = 1.0  # nothing has completed for a second: a slot is not expected within the chat's 0.2 s
    chat = dispatcher.submit("alice", INTERACTIVE)
    assert second.preempted is not None and second.preempted.done()
    assert first.preempted is not None and not first.preempted.done()
    assert chat.future.done()  # the preempted request's slot went to the chat at once
    [preempted] = steps.of(Step.PREEMPTED)
    assert (preempted.band, preempted.tenant, preempted.waited_s) == ("batch", "carol", 1.0)
    # Its stream ends later: already ended, nothing counts twice.
    dispatcher.end(second)
    assert dispatcher.in_flight == 2
    now[0] = 1.5
    dispatcher.dispatch()
    assert not first.preempted.done()  # the chat had its room: no second victim for it


async def test_nothing_is_preempted_while_no_objective_is_at_risk() -> None:
    now = [0.0]
    dispatcher, steps = make(now)
    fill(dispatcher)
    now[0] = 0.05  # a slot is as likely to free itself within 0.2 s as not: no reason to preempt
    standard = dispatcher.submit("alice", STANDARD)  # no objective at all
    chat = dispatcher.submit("alice", INTERACTIVE)
    assert not steps.of(Step.PREEMPTED) and not chat.future.done() and not standard.future.done()
    now[0] = 1.0  # still nothing completed: now the chat's objective is at risk, not the standard request's
    dispatcher.dispatch()
    assert len(steps.of(Step.PREEMPTED)) == 1 and chat.future.done() and not standard.future.done()


async def test_retries_and_started_responses_are_never_victims() -> None:
    now = [0.0]
    dispatcher, steps = make(now)
    retried = dispatcher.submit("bob", BATCH, retried=True)
    started = dispatcher.submit("bob", BATCH)
    dispatcher.record_response(started, True)
    now[0] = 1.0
    chat = dispatcher.submit("alice", INTERACTIVE)
    assert not steps.of(Step.PREEMPTED) and not chat.future.done()
    assert retried.preempted is None and started.preempted is not None and not started.preempted.done()


async def test_preemptions_are_rate_bounded_and_spread_over_tenants() -> None:
    now = [0.0]
    dispatcher, steps = make(now, rate=1.0, slots=3)
    fill(dispatcher, ("bob", "bob", "carol"))
    now[0] = 1.0
    chats = [dispatcher.submit("alice", INTERACTIVE) for _ in range(2)]
    # One token: one victim, the youngest (carol's); the second chat waits for the bucket.
    assert [e.tenant for e in steps.of(Step.PREEMPTED)] == ["carol"]
    assert chats[0].future.done() and not chats[1].future.done()
    now[0] = 2.0
    dispatcher.dispatch()
    assert [e.tenant for e in steps.of(Step.PREEMPTED)] == ["carol", "bob"] and chats[1].future.done()


async def test_preemption_off_preempts_nothing() -> None:
    now = [0.0]
    dispatcher, steps = make(now, rate=0.0)
    batch = fill(dispatcher)
    now[0] = 5.0
    dispatcher.submit("alice", INTERACTIVE)
    assert not steps.of(Step.PREEMPTED) and all(h.preempted is None for h in batch)
