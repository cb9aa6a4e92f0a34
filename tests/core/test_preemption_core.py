"""Priority inside the engine, in the pure core: reservations lent when unused, minimum shares, work conservation, preemption.

The dispatcher runs on a static_concurrency gate of two slots (``max_running``
2, so a full engine is known without metrics) and a clock the test moves.
"""

from __future__ import annotations

import math

import pytest

from extproc.adapters.timers import LoopTimers
from extproc.core.bands import ARRIVING_S, MAX_DEFAULT_SHARE, SHARE_S, Band, BandActivity, BandAllowance, BandShares
from extproc.core.cost import CostWeights
from extproc.core.dispatcher import Held, ModelDispatcher
from extproc.core.entitlement import Tenant
from extproc.core.policies import POLICIES
from extproc.core.preemption import WATCH_S
from extproc.core.release.answer import Answer
from extproc.core.values.engine_load import EngineLoad
from extproc.core.values.report import Event, RequestEvent, Step
from tests.helpers.gate import make_gate

pytestmark = pytest.mark.unit

BANDS = (Band("interactive", ttft_objective_s=0.2), Band("standard"),
         Band("batch", idle_only=True, preemptible=True))
# Batch that is preemptible but not idle-only: its slots are its own, ended only for an objective at risk.
OWN_SLOTS = (*BANDS[:2], Band("batch", preemptible=True))
INTERACTIVE, STANDARD, BATCH = range(3)


class Steps(list[RequestEvent]):
    def __call__(self, event: Event) -> None:
        if isinstance(event, RequestEvent):
            self.append(event)

    def of(self, step: Step) -> list[RequestEvent]:
        return [e for e in self if e.step is step]


def make(now: list[float], rate: float = 2.0, slots: int = 2, bands: tuple[Band, ...] = BANDS,
         in_flight: int | None = None, engine_priority: bool = False) -> tuple[ModelDispatcher, Steps]:
    """``slots`` engine slots; the gate lets ``in_flight`` go (default: ``slots``), the rest queued in the engine."""
    steps = Steps()
    every = Tenant(tuple(b.name for b in bands), "standard", weight=1.0, max_queued=100)
    gate = make_gate(kind="static_concurrency", max_in_flight=in_flight or slots, max_running=slots)
    dispatcher = ModelDispatcher(
        "m", gate, bands, steps,
        lambda: now[0], policy=POLICIES["round_robin"], tenant=lambda _: every, cost=CostWeights(), max_queued=100,
        max_queue_wait_s=120.0, reserved_waiting=0, max_preemptions_per_s=rate, timers=LoopTimers(lambda: now[0]),
        engine_priority=engine_priority,
    )
    return dispatcher, steps


def fill(dispatcher: ModelDispatcher, tenants: tuple[str, ...] = ("bob", "bob")) -> list[Held]:
    batch = [dispatcher.submit(tenant, BATCH, whole=True) for tenant in tenants]
    assert all(h.future.done() for h in batch)
    return batch


def chats_came(dispatcher: ModelDispatcher) -> None:
    """A chat came and went: the class above batch is active, so batch's releases are watched (preemption.WATCH_S)."""
    dispatcher.end(dispatcher.submit("dave", INTERACTIVE))


def test_a_band_arrives_now_for_a_couple_of_seconds_after_a_request() -> None:
    activity = BandActivity(3)
    assert not activity.arriving(INTERACTIVE, 0.0)
    activity.arrived(INTERACTIVE, 10.0)
    assert activity.arriving(INTERACTIVE, 11.0) and not activity.arriving(STANDARD, 11.0)
    assert not activity.arriving(INTERACTIVE, 10.0 + 2 * ARRIVING_S)  # one request is not a stream
    for t in range(20, 40, 2):  # one every 2 s: a steady stream, however thin
        activity.arrived(INTERACTIVE, float(t))
    assert activity.arriving(INTERACTIVE, 39.9)


def test_a_lower_band_is_lent_everything_while_nobody_above_has_work() -> None:
    """No average of what the chats held keeps anything back: only their requests held now, or arriving."""
    pool = make_gate(target=3, max_running=4)
    pool.record_scrape("e1", EngineLoad(waiting=0, running=0), started_at=0.0)
    held, firm = [0, 0, 0], [0, 0, 0]
    allowances = BandAllowance(BANDS, pool, reserved_waiting=2, held=held.__getitem__, firm=firm.__getitem__)
    assert allowances.allowance(STANDARD, 0.0) == 7  # 4 slots and the queue room of 3
    allowances.arrived(INTERACTIVE, 0.0)  # chats arrive: standard leaves them 2 of the queue room...
    assert allowances.allowance(STANDARD, 0.0) == 5
    # ...and batch goes into free slots only: all of them while what it holds can be taken back...
    assert allowances.allowance(BATCH, 0.0) == 4
    # ...while it holds streams, which cannot once begun, it leaves the chats a reserve of 1 (35 % of 4, rounded).
    firm[BATCH] = 1
    assert allowances.allowance(BATCH, 0.0) == 3
    pool.record_scrape("e1", EngineLoad(waiting=0, running=0), started_at=3 * ARRIVING_S)
    assert allowances.allowance(STANDARD, 3 * ARRIVING_S) == 7  # they stopped: lent again
    assert allowances.allowance(BATCH, 3 * ARRIVING_S) == 4  # the reserve too: its free slots (streams never queue)
    firm[BATCH] = 0
    assert allowances.allowance(BATCH, 3 * ARRIVING_S) == 7  # what can be taken back: the queue room too
    held[INTERACTIVE] = 1  # one is held here (strict priority serves it first anyway)
    assert allowances.allowance(STANDARD, 3 * ARRIVING_S) == 5


def test_the_reserve_is_lent_again_the_moment_the_bands_above_stop_arriving() -> None:
    """A batch held for the chats' reserve is woken when they stop arriving, not at the next event, which may be
    seconds away."""
    pool = make_gate(target=3, max_running=4)
    pool.record_scrape("e1", EngineLoad(waiting=0, running=0), started_at=0.0)
    held = [0, 0, 0]
    allowances = BandAllowance(BANDS, pool, reserved_waiting=0, held=held.__getitem__)
    allowances.arrived(INTERACTIVE, 0.0)
    assert allowances.next_change_in(0.0) is None  # nothing held: nothing to wake
    held[BATCH] = 5
    lapse = allowances.next_change_in(0.0)
    assert lapse is not None and lapse == pytest.approx(ARRIVING_S * math.log(2), abs=1e-5)  # one arrival, to half
    pool.record_scrape("e1", EngineLoad(waiting=0, running=0), started_at=lapse - 0.01)
    assert allowances.allowance(BATCH, lapse - 0.01) == 3 and allowances.allowance(BATCH, lapse) == 4
    held[INTERACTIVE] = 1
    assert allowances.next_change_in(0.0) is None  # a chat held: only its release changes anything


def test_free_slots_are_never_kept_back_for_the_bands_above() -> None:
    """Work conservation: whatever the reserve, a free slot goes to whoever is held."""
    pool = make_gate(target=3, max_running=4)
    pool.record_scrape("e1", EngineLoad(waiting=0, running=0), started_at=0.0)
    allowances = BandAllowance(BANDS, pool, reserved_waiting=100, held=lambda band: 0)
    allowances.arrived(INTERACTIVE, 0.0)
    assert pool.free_slots(0.0) == 4 and allowances.allowance(STANDARD, 0.0) == 4
    for i in range(3):
        pool.record_release(i, 0.0, into_free_slot=True)
    assert pool.free_slots(0.0) == 1 and allowances.allowance(STANDARD, 0.0) == 1
    pool.record_release(3, 0.0, into_free_slot=True)
    assert pool.free_slots(0.0) == 0 and allowances.allowance(STANDARD, 0.0) == 0
    assert pool.allowance(0.0) == 3  # the queue room stays the chats'


def test_a_lower_band_gets_its_minimum_share_of_releases_while_it_holds_requests() -> None:
    bands = (Band("interactive"), Band("standard", min_share=0.25), Band("batch", idle_only=True, min_share=0.0))
    held = [10, 10, 10]
    shares = BandShares(bands, BandActivity(3))
    picks = [shares.pick(INTERACTIVE, held.__getitem__, 0.0) for _ in range(100)]
    assert picks.count(STANDARD) == 25 and picks.count(BATCH) == 0
    assert picks[:4] == [INTERACTIVE, INTERACTIVE, INTERACTIVE, STANDARD]  # spread, not saved up
    held[STANDARD] = 0  # nothing held: no credit is saved for later
    for _ in range(10):
        assert shares.pick(INTERACTIVE, held.__getitem__, 0.0) == INTERACTIVE
    held[STANDARD] = 10
    assert [shares.pick(INTERACTIVE, held.__getitem__, 0.0) for _ in range(4)].count(STANDARD) == 1


def test_the_default_minimum_share_is_the_bands_share_of_arrivals_at_most_a_half() -> None:
    """What FIFO would give the band (its share of everything sent), so it is never served slower than by FIFO."""
    activity = BandActivity(3)
    shares = BandShares(BANDS, activity)
    assert shares.share(STANDARD, 0.0) == 0.0
    for _ in range(2):
        activity.arrived(INTERACTIVE, 1.0)
    activity.arrived(STANDARD, 1.0)
    activity.arrived(BATCH, 1.0)
    assert shares.share(STANDARD, 1.0) == pytest.approx(0.25)
    for _ in range(10):
        activity.arrived(STANDARD, 2.0)
    assert shares.share(STANDARD, 2.0) == MAX_DEFAULT_SHARE
    assert shares.share(STANDARD, 2.0 + 20 * SHARE_S) == MAX_DEFAULT_SHARE  # shares of a decaying count, not of zero


def test_an_idle_only_band_alone_is_released_like_any_other() -> None:
    """Work conservation: with nothing above it working, batch fills the engine's queue to its target too."""
    pool = make_gate(target=3, max_running=2)
    pool.record_scrape("e1", EngineLoad(waiting=0, running=2), started_at=0.0)
    allowances = BandAllowance(BANDS, pool, reserved_waiting=0, held=lambda band: 0)
    alone = allowances.allowance(BATCH, 0.1)
    assert not allowances.into_free_slots(BATCH, 0.1) and alone == pool.allowance(0.1) and alone > 0
    allowances.arrived(INTERACTIVE, 0.1)
    assert allowances.into_free_slots(BATCH, 0.2) and allowances.allowance(BATCH, 0.2) == 0  # no slot is free


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


async def test_a_slot_that_is_its_own_is_not_preempted_while_no_objective_is_at_risk() -> None:
    now = [0.0]
    dispatcher, steps = make(now, bands=OWN_SLOTS)
    chats_came(dispatcher)
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
    retried = dispatcher.submit("bob", BATCH, retried=True, whole=True)
    started = dispatcher.submit("bob", BATCH, whole=True)
    dispatcher.record_response(started, Answer.SERVED)
    now[0] = 1.0
    chat = dispatcher.submit("alice", INTERACTIVE)
    assert not steps.of(Step.PREEMPTED) and not chat.future.done()
    assert retried.preempted is None and started.preempted is not None and not started.preempted.done()


async def test_a_stream_is_never_a_victim_its_response_begins_as_the_engine_accepts_it() -> None:
    now = [0.0]
    dispatcher, steps = make(now)
    streams = [dispatcher.submit("bob", BATCH), dispatcher.submit("carol", BATCH)]
    now[0] = 5.0  # nothing completes: the chat is at risk
    chat = dispatcher.submit("alice", INTERACTIVE)
    assert not steps.of(Step.PREEMPTED) and not chat.future.done()
    assert all(s.preempted is None for s in streams)


async def test_own_slots_are_watched_only_while_a_class_above_with_an_objective_comes() -> None:
    """Watching a release for its response's start costs a message each way: work whose slot is its own is watched (and
    can be taken back) only while a class above with an objective has had an arrival within WATCH_S; an idle-only
    band's always is."""
    now = [0.0]
    dispatcher, steps = make(now, bands=OWN_SLOTS)
    quiet = fill(dispatcher, ("bob",))
    assert quiet[0].preempted is None  # nobody above ever came: its stream asks for nothing more
    chats_came(dispatcher)
    watched = fill(dispatcher, ("carol",))
    assert watched[0].preempted is not None
    dispatcher.end(watched[0])
    now[0] = WATCH_S + 1.0  # the chats have been quiet since
    assert fill(dispatcher, ("carol",))[0].preempted is None
    lent, _ = make(now)
    assert fill(lent, ("bob",))[0].preempted is not None  # idle-only: taken back cheaply for any need
    assert not steps.of(Step.PREEMPTED)


async def test_preemptions_for_objectives_at_risk_are_rate_bounded_and_spread_over_tenants() -> None:
    now = [0.0]
    dispatcher, steps = make(now, rate=1.0, slots=3, bands=OWN_SLOTS)
    chats_came(dispatcher)
    fill(dispatcher, ("bob", "bob", "carol"))
    now[0] = 1.0
    chats = [dispatcher.submit("alice", INTERACTIVE) for _ in range(2)]
    # One token: one victim, the youngest (carol's); the second chat waits for the bucket.
    assert [e.tenant for e in steps.of(Step.PREEMPTED)] == ["carol"]
    assert chats[0].future.done() and not chats[1].future.done()
    now[0] = 2.0
    dispatcher.dispatch()
    assert [e.tenant for e in steps.of(Step.PREEMPTED)] == ["carol", "bob"] and chats[1].future.done()


async def test_work_in_progress_is_reclaimed_as_it_drains_unless_an_objective_is_at_risk() -> None:
    """Idle-only work running in slots lent while nobody above needed them has cost its prefill and every token since:
    a chat that is not at risk waits for one to finish rather than throw that away (APF reclaims borrowed seats as
    they drain); one at risk ends the youngest."""
    now = [0.0]
    dispatcher, steps = make(now, rate=0.5, slots=3)
    batch = fill(dispatcher, ("bob", "bob", "carol"))
    now[0] = 0.01  # the last completion a moment ago: a slot is as likely to free itself within 0.2 s as not
    patient = dispatcher.submit("alice", INTERACTIVE)
    assert not steps.of(Step.PREEMPTED) and not patient.future.done()
    dispatcher.end(batch[0])  # a batch request finishes: the chat takes its slot
    assert patient.future.done() and not steps.of(Step.PREEMPTED)
    now[0] = 5.0  # nothing completed for 5 s: the next chat's 0.2 s objective is at risk
    urgent = dispatcher.submit("alice", INTERACTIVE)
    assert [e.tenant for e in steps.of(Step.PREEMPTED)] == ["carol"] and urgent.future.done()


async def test_lent_requests_queued_in_the_engine_ahead_of_a_chat_are_ended_the_running_ones_kept() -> None:
    """Batch alone filled the engine's queue too (2 slots, 3 released): the chat would wait behind the queued one,
    which has made no progress: it is ended at once, whatever the slack; the two running keep their slots."""
    now = [0.0]
    dispatcher, steps = make(now, slots=2, in_flight=4)
    batch = fill(dispatcher, ("bob", "bob", "bob"))
    now[0] = 0.1
    chat = dispatcher.submit("alice", INTERACTIVE)
    assert chat.future.done()
    assert [h.preempted is not None and h.preempted.done() for h in batch] == [False, False, True]
    assert len(steps.of(Step.PREEMPTED)) == 1


async def test_what_lower_bands_queue_in_an_engine_that_orders_by_priority_is_passed_not_ended() -> None:
    """Behind an engine that runs the classes in order, the chat passes the queued batch request: nothing is ended,
    and the chat goes in although the gate's line is reached."""
    now = [0.0]
    dispatcher, steps = make(now, slots=2, in_flight=3, engine_priority=True)
    batch = fill(dispatcher, ("bob", "bob", "bob"))
    now[0] = 0.1
    chat = dispatcher.submit("alice", INTERACTIVE)
    assert chat.future.done() and not steps.of(Step.PREEMPTED)
    assert all(not h.preempted.done() for h in batch if h.preempted is not None)


async def test_preemption_off_preempts_nothing() -> None:
    now = [0.0]
    dispatcher, steps = make(now, rate=0.0)
    batch = fill(dispatcher)
    now[0] = 5.0
    dispatcher.submit("alice", INTERACTIVE)
    assert not steps.of(Step.PREEMPTED) and all(h.preempted is None for h in batch)
