"""The simulator's incremental KV and preemption (``kv_mode="incremental"``), on the pure scheduler.

What is checked is vLLM 0.32's ``Scheduler.schedule`` (vllm/v1/core/sched/scheduler.py):
KV grows a block at a time; a running request that cannot get its next block preempts the
running request with the lowest priority (``priority``) or the last admitted (``fcfs``); the
victim is queued again and recomputed; a full batch or a waiting request that does not fit
never preempts.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from hypothesis import given
from hypothesis import settings as hyp_settings
from hypothesis import strategies as st
from prometheus_client import generate_latest

from extproc.tools.sim.engine import (
    RequestHandle,
    ScheduledStep,
    Scheduler,
    SimEngine,
    SimRequest,
    SimSettings,
    TokenEvent,
)
from extproc.tools.sim.metrics import VllmMetrics
from tests.helpers.sim import MODEL, FakeTime, _value
from tests.propertyutil import examples

pytestmark = pytest.mark.unit

BLOCK = 4
STEP_S = 0.010


def _scheduler(policy: str = "priority", **overrides: Any) -> Scheduler:
    options: dict[str, Any] = {
        "kv_mode": "incremental", "block_size": BLOCK, "kv_cache_tokens": 24, "max_num_seqs": 8,
        "scheduling_policy": policy, "step_ms": STEP_S * 1000, "step_ms_per_seq": 0, "prefill_ms_per_token": 0,
        **overrides,
    }
    return Scheduler(SimSettings(model=MODEL, **options))


def _request(prompt: int, max_tokens: int, priority: int = 0, arrival: float = 0.0) -> SimRequest:
    return SimRequest(prompt_tokens=prompt, max_tokens=max_tokens, arrival=arrival, priority=priority)


class Run:
    """Steps a scheduler to the end, adding requests at the steps given, and keeps what happened."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.now = 0.0
        self.steps: list[ScheduledStep] = []
        self.batches: list[list[SimRequest]] = []
        self.events: list[TokenEvent] = []

    def step(self) -> ScheduledStep:
        step = self.scheduler.schedule(self.now)
        self.steps.append(step)
        self.batches.append(list(self.scheduler.batch))
        self.now += step.duration
        self.events.extend(self.scheduler.complete(self.now))
        return step

    def advance(self, arrivals: dict[int, list[SimRequest]] | None = None, steps: int | None = None) -> None:
        """Run ``steps`` steps, or until idle; ``arrivals[n]`` are added before the n-th."""
        arrivals = arrivals or {}
        for number in range(1000 if steps is None else steps):
            for request in arrivals.get(number, []):
                self.scheduler.add(request)
            if self.scheduler.has_work:
                self.step()
            elif steps is None and number > max(arrivals, default=0):
                return
        assert steps is not None, "still busy after 1000 steps"

    @property
    def victims(self) -> list[SimRequest]:
        return [victim for step in self.steps for victim in step.preempted]


def test_kv_grows_a_block_per_block_size_tokens_and_is_freed_at_the_end() -> None:
    scheduler = _scheduler(kv_cache_tokens=64)
    request = _request(5, 12)
    scheduler.add(request)
    run = Run(scheduler)

    held = []
    while scheduler.has_work:
        run.step()
        held.append(request.kv_blocks)
        assert scheduler.kv_used == request.kv_blocks * BLOCK

    # The step that samples token n+1 stores the KV of the 5 + n tokens before it: 2 blocks
    # for 5..8 tokens, 3 for 9..12, 4 for 13..16. The last token's KV is never stored.
    assert held[:-1] == [2, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4]
    assert held[-1] == 0 and scheduler.kv_used == 0  # finished: every block freed
    # In reserve mode the same request holds prompt + max_tokens = 17 tokens from the start.
    reserve = Scheduler(SimSettings(model=MODEL, kv_cache_tokens=64))
    reserve.add(_request(5, 12))
    reserve.schedule(0.0)
    assert reserve.kv_used == 17


def _three_requests() -> tuple[SimRequest, SimRequest, SimRequest, dict[int, list[SimRequest]]]:
    """b (priority 5) runs first; a (1) and c (0) join at the next step; 6 blocks cannot hold all three."""
    b = _request(3, 12, priority=5, arrival=0.0)
    a = _request(4, 12, priority=1, arrival=1.0)
    c = _request(4, 12, priority=0, arrival=1.5)
    return b, a, c, {0: [b], 1: [a, c]}


def test_priority_preempts_the_lowest_priority_running_request_on_kv_pressure() -> None:
    b, a, c, arrivals = _three_requests()
    scheduler = _scheduler("priority")
    run = Run(scheduler)
    run.advance(arrivals, steps=6)
    assert scheduler.running == [b, c, a] and scheduler.free_blocks == 0  # admitted in priority order after b

    step = run.step()  # b needs its third block: b itself has the lowest priority
    assert step.preempted == (b,) and b.num_preemptions == 1
    assert b.kv_blocks == 0 and list(scheduler.waiting) == [b]
    # b was first in line and preempted itself: the requests behind it sit this step out
    # (vLLM breaks out of its loop over the running requests), nothing is admitted, and the
    # empty step takes no time (no forward pass).
    assert run.batches[-1] == [] and step.duration == 0.0
    assert step.admitted == step.resumed == ()

    run.advance()
    # Then a (priority 1) goes before c (priority 0), and b and a resume once there is room.
    assert run.victims == [b, a]
    assert scheduler.num_preemptions == 2 and not scheduler.has_work
    assert [r.finish_reason for r in (a, b, c)] == ["length"] * 3
    assert c.num_preemptions == 0  # the highest priority is never the victim while others run


def test_fcfs_preempts_the_last_admitted_whatever_its_priority() -> None:
    b, a, c, arrivals = _three_requests()
    scheduler = _scheduler("fcfs")
    run = Run(scheduler)
    run.advance(arrivals, steps=6)
    assert scheduler.running == [b, a, c]

    step = run.step()  # b needs a block: the last admitted (c) goes, b and a run on
    assert step.preempted == (c,) and list(scheduler.waiting) == [c]
    assert scheduler.running == [b, a] and step.duration > 0

    run.advance()
    assert run.victims == [c, a]
    assert list(scheduler.waiting) == [] and all(r.finish_reason == "length" for r in (a, b, c))


@pytest.mark.parametrize(("policy", "order"), [("fcfs", "sul"), ("priority", "usl")])
def test_a_preempted_request_goes_back_to_its_place_in_the_queue(policy: str, order: str) -> None:
    """fcfs: the head of the queue (vLLM's ``prepend_request``); priority: its place by (priority, arrival)."""
    scheduler = _scheduler(policy, kv_cache_tokens=8, max_num_seqs=2)
    first, second = _request(1, 7, priority=2, arrival=0.0), _request(1, 7, priority=2, arrival=1.0)
    scheduler.add(first)
    scheduler.add(second)
    run = Run(scheduler)
    run.step()
    urgent, lazy = _request(6, 1, priority=1, arrival=2.0), _request(6, 1, priority=3, arrival=3.0)
    scheduler.add(urgent)  # the batch is full: they wait
    scheduler.add(lazy)
    while not run.victims:
        run.step()

    # The later arrival of the same priority, and the last admitted: second, under either policy.
    assert run.victims == [second]
    names = {"s": second, "u": urgent, "l": lazy}
    assert list(scheduler.waiting) == [names[letter] for letter in order]


@pytest.mark.parametrize(
    ("pressure", "settings", "low", "urgent_prompt"),
    [
        ("slots", {"kv_cache_tokens": 400, "max_num_seqs": 2}, (1, 8), 1),  # plenty of KV, both slots taken
        ("kv", {"kv_cache_tokens": 24, "max_num_seqs": 8}, (5, 4), 12),  # 2 blocks each of 6; it needs 3
    ],
)
def test_a_waiting_higher_priority_request_never_preempts(
    pressure: str, settings: dict[str, int], low: tuple[int, int], urgent_prompt: int
) -> None:
    """A full batch, or a queue head that does not fit in the free blocks, waits: only running requests preempt."""
    scheduler = _scheduler("priority", **settings)
    lows = [_request(*low, priority=9, arrival=0.0) for _ in range(2)]
    urgent = _request(urgent_prompt, 3, priority=0, arrival=1.0)
    run = Run(scheduler)
    run.advance({0: lows, 1: [urgent]})

    assert scheduler.num_preemptions == 0 and run.victims == []
    assert urgent.scheduled_at is not None
    first_done = min(r.last_token_at for r in lows if r.last_token_at is not None)
    assert urgent.scheduled_at >= first_done  # it waited for a low one to finish
    assert all(r.num_generated == r.max_tokens for r in (*lows, urgent))


def test_a_preempted_request_is_recomputed_and_finishes_with_all_its_tokens() -> None:
    b, a, c, arrivals = _three_requests()
    scheduler = _scheduler("priority", prefill_ms_per_token=1.0)
    run = Run(scheduler)
    run.advance(arrivals)

    assert [r for step in run.steps for r in step.resumed] == [a, b]
    # Every token exactly once and in order, although the stream paused.
    for request in (a, b, c):
        indices = [e.index for e in run.events if e.request is request]
        assert indices == list(range(request.max_tokens))
        assert request.finish_reason == "length" and request.num_generated == request.max_tokens
    gaps = [e.since_previous for e in run.events if e.request is b and e.index > 0]
    assert max(gaps) > 3 * STEP_S  # b's stream stalled while it waited to be recomputed
    # The prompt counter's stand-in: each request was admitted for the first time once.
    assert sorted(id(r) for step in run.steps for r in step.admitted) == sorted(id(r) for r in (a, b, c))
    assert b.scheduled_at == 0.0  # the queue time counts the first admission only, as vLLM's


def test_the_resumed_prefill_costs_prompt_plus_generated_tokens() -> None:
    scheduler = _scheduler("fcfs", prefill_ms_per_token=1.0, kv_cache_tokens=8, max_num_seqs=2)
    keeper, victim = _request(1, 7, arrival=0.0), _request(1, 7, arrival=1.0)
    scheduler.add(keeper)
    scheduler.add(victim)
    run = Run(scheduler)
    while not run.victims:
        run.step()
    generated = victim.num_generated
    assert generated > 0
    while victim not in scheduler.running:
        run.step()
    step = run.steps[-1]
    assert step.resumed == (victim,)
    # A batch of one (the keeper finished) plus the recomputation of 1 prompt + `generated` tokens.
    assert step.duration == pytest.approx(STEP_S + (1 + generated) / 1000)


async def _text(handle: RequestHandle) -> list[str]:
    return [piece async for piece in handle]


async def test_vllm_metrics_count_preemptions() -> None:
    """``vllm:num_preemptions_total`` counts each one; each finished request observes its own count."""
    fake = FakeTime()
    settings = SimSettings(
        model=MODEL, kv_mode="incremental", block_size=BLOCK, kv_cache_tokens=24, scheduling_policy="priority",
        step_ms=10, step_ms_per_seq=0, prefill_ms_per_token=0, visibility_delay_ms=0,
        visibility_delay_per_pending_ms=0,
    )
    engine = SimEngine(settings, clock=fake.clock, sleep=fake.sleep)
    metrics = VllmMetrics(MODEL, engine.scheduler)
    engine.observer = metrics
    engine.start()
    try:
        b = engine.submit(3, 12, priority=5)
        await anext(aiter(b))
        a, c = engine.submit(4, 12, priority=1), engine.submit(4, 12, priority=0)
        texts = await asyncio.gather(*(_text(h) for h in (a, b, c)))
    finally:
        await engine.close()

    assert [len(t) for t in texts] == [12, 11, 12]  # a, b (its first token was read above), c
    preemptions = engine.scheduler.num_preemptions
    assert preemptions >= 1
    page = generate_latest(metrics.registry).decode()
    assert _value(page, "vllm:num_preemptions_total") == preemptions
    assert _value(page, "vllm:request_num_preemptions_sum") == preemptions
    assert _value(page, "vllm:request_num_preemptions_count") == 3
    assert _value(page, "vllm:request_success_total", finished_reason="length") == 3
    assert _value(page, "vllm:kv_cache_usage_perc") == 0


@hyp_settings(max_examples=examples(150), deadline=None)
@given(
    policy=st.sampled_from(["fcfs", "priority"]),
    block_size=st.integers(1, 8),
    extra_blocks=st.integers(0, 6),
    max_num_seqs=st.integers(1, 4),
    arrivals=st.lists(
        # (step, prompt, max_tokens, priority, abort at step or None)
        st.tuples(st.integers(0, 6), st.integers(1, 16), st.integers(1, 16), st.integers(0, 3),
                  st.none() | st.integers(0, 30)),
        max_size=12,
    ),
)
def test_every_request_finishes_or_is_aborted_exactly_once_and_kv_never_overflows(
    policy: str, block_size: int, extra_blocks: int, max_num_seqs: int,
    arrivals: list[tuple[int, int, int, int, int | None]],
) -> None:
    # Room for the longest request (32 tokens) alone, plus a few blocks.
    blocks = -(-32 // block_size) + extra_blocks
    scheduler = _scheduler(policy, block_size=block_size, kv_cache_tokens=blocks * block_size,
                           max_num_seqs=max_num_seqs)
    submitted: list[tuple[SimRequest, int | None]] = []
    ends: list[SimRequest] = []
    tokens: dict[int, list[int]] = {}
    now, number = 0.0, 0
    while number <= 6 or scheduler.has_work:
        assert number < 5000, "no progress"
        for at, prompt, max_tokens, priority, abort_at in arrivals:
            if at == number:
                request = _request(prompt, max_tokens, priority, arrival=now)
                scheduler.add(request)
                submitted.append((request, abort_at))
        for request, abort_at in submitted:
            if abort_at == number and scheduler.abort(request):
                ends.append(request)
        if scheduler.has_work:
            step = scheduler.schedule(now)
            assert len(scheduler.running) <= max_num_seqs
            assert set(map(id, scheduler.batch)) <= set(map(id, scheduler.running))
            assert scheduler.kv_used == sum(r.kv_blocks for r in scheduler.running) * block_size
            assert scheduler.kv_used <= scheduler.kv_capacity
            assert all(r.kv_blocks == 0 for r in scheduler.waiting)
            assert not set(map(id, step.preempted)) & set(map(id, scheduler.running))
            now += step.duration
            for event in scheduler.complete(now):
                tokens.setdefault(id(event.request), []).append(event.index)
                if event.request.finished:
                    ends.append(event.request)
        number += 1

    assert sorted(map(id, ends)) == sorted(id(r) for r, _ in submitted)  # each ends exactly once
    for request, _ in submitted:
        assert tokens.get(id(request), []) == list(range(request.num_generated))  # no token lost or repeated
        if request.finish_reason == "length":
            assert request.num_generated == request.max_tokens
        else:
            assert request.finish_reason == "abort"
    assert scheduler.kv_used == 0
    assert scheduler.num_preemptions == sum(r.num_preemptions for r, _ in submitted)
